"""Where results go: the Trainer's loggers (layer scalars through ``LightningModule.log``, per-head scalars straight
to the loggers) and TensorBoard images and text, encoded and written by a background thread."""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any

import numpy as np
import PIL.Image
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.compat.proto.summary_pb2 import Summary
from torch import Tensor
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import custom_scalars

from attn_callbacks.base.numba_loader import uses_numba
from attn_callbacks.base.private_api import epoch_end_step
from attn_callbacks.base.tensor_ops import to_host_flat
from attn_callbacks.output.png import encode_png

__all__ = [
    "BackgroundWriter",
    "add_image",
    "add_layout",
    "add_png",
    "fast_record_checksums",
    "log_heads",
    "log_layer",
    "png_bytes",
    "tensorboard_writer",
]

# Images waiting for the writer thread, at most: drawing may outrun PNG encoding, and each is megabytes.
MAX_PENDING = 4


class BackgroundWriter:
    """During an epoch end only: one worker thread that PNG-encodes the images while the caller computes the next
    statistics and draws the next images (drawing stays with the caller: matplotlib holds the GIL, which would stall
    its many small tensor ops); and the writes of the epoch (images, texts, the Attention tab's files), held until
    the epoch end succeeds, so that a failed or interrupted one leaves nothing behind."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: list[Future] = []
        self._writes: list[Callable[[], Any]] = []

    def __getstate__(self) -> dict[str, Any]:
        return {"_pool": None, "_jobs": [], "_writes": []}  # the thread lives only during an epoch end

    def image(self, writer: Any, tag: str, image: np.ndarray, step: int) -> None:
        """:func:`add_image` of ``image``: encoded now on the worker thread, written when the epoch end succeeds."""
        self.submit(lambda: self.later(encoded_image(writer, tag, image, step)))

    def text(self, writer: Any, tag: str, text: str, step: int) -> None:
        self.later(lambda: writer.add_text(tag, text, step))

    def later(self, write: Callable[[], Any]) -> None:
        """Run ``write`` when the epoch end succeeds (:meth:`finish`), after the writes held before it; never if it
        fails."""
        self._writes.append(write)  # from the caller or the worker thread: list.append is atomic

    def submit(self, job: Callable[[], Any]) -> None:
        """Run ``job`` on the worker thread, after those before it. At most ``MAX_PENDING`` jobs wait: pictures are
        megabytes each, and drawing can outrun encoding."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attn_callbacks-images")
        pending = [future for future in self._jobs if not future.done()]
        if len(pending) >= MAX_PENDING:
            wait(pending[: len(pending) - MAX_PENDING + 1])
        self._jobs.append(self._pool.submit(job))

    def finish(self, raise_errors: bool = True) -> None:
        """Wait for every job of this epoch end and stop the worker; re-raise the first job's error, else make the
        held writes. When ``raise_errors`` is False (the epoch end already failed), or when the wait itself is
        interrupted (Ctrl+C), jobs not yet started, their errors and every held write are dropped; the worker is
        stopped either way."""
        pool, jobs = self._pool, self._jobs
        try:
            if pool is not None:
                try:
                    pool.shutdown(wait=True, cancel_futures=not raise_errors)
                except BaseException:
                    pool.shutdown(wait=True, cancel_futures=True)  # waits for the job in progress only
                    raise
            if raise_errors:
                for job in jobs:
                    job.result()
                for write in self._writes:
                    write()
        finally:
            self._pool, self._jobs, self._writes = None, [], []


def log_layer(
    pl_module: LightningModule, scalars: dict[str, Tensor], hold: Callable[[Callable[[], Any]], None] | None = None
) -> None:
    """Layer scalars through ``LightningModule.log`` (every logger, ``callback_metrics``), as CPU tensors: moved
    from the device in one copy, where Lightning would otherwise keep a result per tag on the device, each updated by
    its own small kernels and read back with its own synchronisation. In a monitored sanity pass, where Lightning
    drops what ``log`` gets, straight to every logger at step 0 instead: through ``hold`` (a
    :meth:`BackgroundWriter.later`) when given, so that a failed epoch end logs none (Lightning drops what ``log``
    got then)."""
    if not scalars:
        return
    trainer = pl_module.trainer
    if trainer.sanity_checking:  # monitored with log_sanity_check=True: Lightning would drop what `log` gets
        values = dict(zip(scalars, to_host_flat(scalars.values(), torch.float64).tolist(), strict=True))
        (hold or (lambda write: write()))(lambda: _log_metrics(trainer, values))
        return
    for tag, value in zip(scalars, to_host_flat(scalars.values(), torch.float32), strict=True):
        # Already summed over ranks by compute(): sync_dist would only average equal numbers. Our own dataloader
        # suffixes replace Lightning's, which would otherwise append one for the current dataloader.
        pl_module.log(tag, value, on_step=False, on_epoch=True, sync_dist=False, add_dataloader_idx=False)


def log_heads(trainer: Trainer, heads: dict[tuple[str, str], Tensor]) -> None:
    """Per-head scalars (``heads``: ``(tag, suffix)`` -> ``(H,)`` values, logged as ``{tag}/head_{h}{suffix}``, the
    tag from :func:`~attn_callbacks.output.dashboard.head_tag`)
    straight to every logger of the Trainer in one call, from global rank 0, at the step (and, but to TensorBoard, with
    ``epoch``) as Lightning logs the layer scalars that went through ``LightningModule.log`` in the same hook (a CSV
    gets one row of them per epoch end).

    ``LightningModule.log`` keeps a result object per tag and walks it on every call (about 1 ms each: a model of
    12 layers × 12 heads has thousands of per-head scalars), and would also fill ``callback_metrics``,
    ``logged_metrics`` and what ``trainer.validate`` returns and prints with them. A monitored sanity pass
    (``log_sanity_check=True``) logs them too, at its step (0), as :func:`log_layer` does its layer scalars.
    """
    if not heads:
        return
    values = iter(to_host_flat(heads.values(), torch.float64).tolist())
    metrics: dict[str, float] = {
        f"{tag}/head_{h}{suffix}": next(values) for (tag, suffix), v in heads.items() for h in range(v.numel())
    }
    _log_metrics(trainer, metrics)


def _log_metrics(trainer: Trainer, metrics: dict[str, float]) -> None:
    """``metrics`` to every logger from global rank 0, at the step where Lightning logs this hook's layer scalars,
    with ``epoch`` as Lightning gives it to them (a CSV row of its own needs it); not to a TensorBoard logger, whose
    ``epoch`` series Lightning writes at that step already (twice, it would hold two points per epoch)."""
    if not trainer.is_global_zero or not trainer.loggers:
        return
    step = epoch_end_step(trainer)
    with_epoch = {**metrics, "epoch": trainer.current_epoch}
    for logger in trainer.loggers:
        logger.log_metrics(metrics if isinstance(logger, TensorBoardLogger) else with_epoch, step=step)


@contextmanager
def fast_record_checksums(writer: Any) -> Iterator[None]:
    """While the epoch end writes, TensorBoard's record writer (``tensorboard.summary.writer.record_writer``, its
    public module function ``masked_crc32c``) computes its checksums with :mod:`~attn_callbacks.output.checksum_numba`:
    the same numbers, without holding the GIL, where its pure-Python CRC-32C took ~0.5 s of the stress workload's
    ~1.3 s epoch end (``benchmarks/overhead.py``, old and new code on one machine). ``writer`` is flushed before the
    function is put back, on every exit path, so that its thread has checksummed this epoch's records. Nested and
    overlapping uses (the drawing process's results are written after the epoch end) count: the last one out puts
    TensorBoard's function back. Nothing changes without numba, or for a writer that is not a torch
    ``SummaryWriter``."""
    if not isinstance(writer, SummaryWriter) or not uses_numba("cpu"):
        yield
        return
    from tensorboard.summary.writer import record_writer

    from attn_callbacks.output.checksum_numba import masked_crc32c

    with _CHECKSUMS["lock"]:
        if _CHECKSUMS["users"] == 0:
            _CHECKSUMS["original"] = record_writer.masked_crc32c
            record_writer.masked_crc32c = masked_crc32c
        _CHECKSUMS["users"] += 1
    try:
        yield
    finally:
        try:
            writer.flush()
        finally:
            with _CHECKSUMS["lock"]:
                _CHECKSUMS["users"] -= 1
                if _CHECKSUMS["users"] == 0:
                    record_writer.masked_crc32c = _CHECKSUMS.pop("original")


# Who uses the numba checksums now, and TensorBoard's function to put back after the last.
_CHECKSUMS: dict[str, Any] = {"lock": threading.Lock(), "users": 0}


def tensorboard_writer(trainer: Trainer) -> Any:
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            return logger.experiment
    return None


def add_image(writer: Any, tag: str, image: Any, step: int) -> None:
    """``writer.add_image(tag, image[..., :3], step, dataformats="HWC")`` for an ``(H, W, 3)`` RGB or ``(H, W, 4)``
    RGBA uint8 array (the alpha is dropped), without its float round trip and with faster PNG compression
    (:func:`png_bytes`); the same event a reader sees."""
    encoded_image(writer, tag, image, step)()


def encoded_image(writer: Any, tag: str, image: Any, step: int) -> Callable[[], None]:
    """:func:`add_image` in two steps: ``image`` is PNG-encoded now, and the call returned writes it."""
    if _event_file(writer) is None:  # tensorboardX's (other protobuf classes), or a closed writer: its own add_image
        return lambda: writer.add_image(tag, image[..., :3], step, dataformats="HWC")
    png = png_bytes(image)
    return lambda: add_png(writer, tag, png, image.shape[:2], step)


def add_png(writer: Any, tag: str, png: bytes, size: tuple[int, int], step: int) -> None:
    """An image event of RGB PNG bytes of ``size`` ``(height, width)`` at ``step``, into a torch ``SummaryWriter``; one
    closed since the picture was drawn gets it through its own ``add_image``, which reopens it, as :func:`add_image`
    does."""
    events = _event_file(writer)
    if events is None:
        with PIL.Image.open(io.BytesIO(png)) as picture:
            writer.add_image(tag, np.asarray(picture.convert("RGB")), step, dataformats="HWC")
        return
    picture = Summary.Image(height=size[0], width=size[1], colorspace=3, encoded_image_string=png)
    events.add_summary(Summary(value=[Summary.Value(tag=tag, image=picture)]), step)


def add_layout(writer: Any, layout: dict[str, dict[str, list]], step: int) -> None:
    """Write TensorBoard's custom-scalars layout (``SummaryWriter.add_custom_scalars``'s format) at ``step``: the
    plugin shows the last one a run wrote."""
    events = _event_file(writer)
    if events is None:  # tensorboardX's has its own
        writer.add_custom_scalars(layout)
        return
    events.add_summary(custom_scalars(layout), step)


def _event_file(writer: Any) -> Any:
    """The open event file of a torch ``SummaryWriter`` (its public ``file_writer``), or None: another writer, or a
    closed one."""
    return writer.file_writer if isinstance(writer, SummaryWriter) else None


def png_bytes(image: np.ndarray, compress_level: int = 1) -> bytes:
    """:func:`~attn_callbacks.output.png.encode_png` of ``image``, its rows filtered in numba where numba works."""
    return encode_png(image, compress_level, numba=uses_numba("cpu"))
