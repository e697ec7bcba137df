"""The probe: a few fixed validation samples whose position × position attention is drawn every epoch."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from attn_callbacks.capture.streams import Streams

__all__ = ["Probe"]


class Probe:
    """The probe samples' ids and which of them count (frozen at first sight, checkpointed) and this epoch's weights
    per module.

    Args:
        batch: ``"first"`` (the first samples of validation batch 0), a batch of your own, or None for no probe.
        forward: ``fn(pl_module, batch)`` running the model on a batch of your own.
        samples: how many samples to keep.
    """

    def __init__(self, batch: Any = None, forward: Callable[[Any, Any], Any] | None = None, samples: int = 1) -> None:
        if isinstance(batch, str) and batch != "first":
            raise ValueError(f"Expected argument `probe` to be 'first', a batch or None, but got {batch!r}")
        if batch == "first" and forward is not None:
            raise ValueError(
                "Argument `probe_forward` runs a probe batch you give in `probe`; with probe='first' the probe is read "
                "from the normal validation pass, so leave `probe_forward` as None"
            )
        if batch is not None and batch != "first" and not callable(forward):
            raise ValueError(
                "A probe batch given in argument `probe` needs argument `probe_forward`, a callable "
                f"(pl_module, batch) that runs the model on it; got probe_forward={forward!r}"
            )
        self.batch = batch
        self.forward = forward
        self.samples = samples
        self.ids: dict[str, Tensor] | None = None  # frozen ids per stream, (samples, L) on CPU
        self.valid: dict[str, Tensor] | None = None  # their positions that count (not ignored or masked), the same
        self.weights: dict[str, Tensor] = {}  # this epoch's weights per module, (n, H, Lq, Lk) on CPU
        self.capturing = False  # the current batch is the probe: keep its weights
        self.only = False  # running the user's probe batch: keep its weights, accumulate nothing
        self._warned = False

    @property
    def own_batch(self) -> bool:
        """Whether the probe is a batch of the user's, run by :attr:`forward` at the epoch end."""
        return self.batch is not None and not isinstance(self.batch, str)

    def keep(self, name: str, weights: Tensor, rows: slice | None = None) -> None:
        """Keep the probe samples of a module's weights ``(b, H, Lq, Lk)``, the samples ``rows`` of the batch (all when
        None: SDPA calls come a few samples at a time)."""
        if not (self.capturing or self.only):
            return
        start = 0 if rows is None else rows.start
        if start >= self.samples:
            return
        part = weights[: self.samples - start].detach().float().cpu()
        self.weights[name] = part if start == 0 else torch.cat([self.weights[name], part])

    def match(self, read: Mapping[str, tuple[Tensor, Tensor, Tensor]]) -> bool:
        """Freeze the probe at its first sight (``read``: each stream's :meth:`Streams.read`, whose ids as in the
        batch and valid positions it keeps); afterwards, whether batch 0 still starts with the same samples."""
        head = {stream: ids[: self.samples].detach().cpu() for stream, (_, _, ids) in read.items()}
        if self.ids is None:
            self._freeze(read)
            return True
        same = head.keys() == self.ids.keys() and all(torch.equal(head[s], self.ids[s]) for s in head)
        if not same and not self._warned:
            self._warned = True
            rank_zero_warn(
                "AttentionMonitor: validation batch 0 no longer starts with the frozen probe samples (a shuffled "
                "validation loader?), so probe maps are skipped for such epochs; give a batch in `probe` with "
                "`probe_forward` instead."
            )
        return same

    def run(self, pl_module: Any, streams: Streams, ran: Callable[[], None] | None = None) -> None:
        """Run :attr:`forward` on the user's probe batch with the hooks attached, keeping only the probe weights
        (and the ids of the streams the modules read); then ``ran()`` while the batch is still on (the capture's
        ``finish_batch``, which reads decoder loops)."""
        streams.start_batch(move_data_to_device(self.batch, pl_module.device))
        try:
            try:
                read = {stream: streams.read(stream, pl_module.device) for stream in streams.used()}
            except (KeyError, IndexError, AttributeError, TypeError, ValueError) as error:
                raise ValueError(
                    f"AttentionMonitor: the probe batch given in argument `probe` does not hold the token ids "
                    f"`token_ids` reads from every validation batch: {error}"
                ) from error
            self._freeze(read)
            self.only = True
            self.weights.clear()
            with torch.no_grad():
                self.forward(pl_module, streams.batch)
            if ran is not None:
                ran()
        finally:
            self.only = False
            streams.end_batch()
        if not self.weights and not self._warned:
            self._warned = True
            rank_zero_warn(
                "AttentionMonitor: argument `probe_forward` ran the probe batch, but no attention of a monitored "
                "module was read in it, so no probe maps are drawn: does it call the model's attention (the modules "
                "selected by `modules`)? A decoder loop is read only where its steps make the probe's query stream "
                "(a softmax that was not read is named in its own warning)."
            )

    def _freeze(self, read: Mapping[str, tuple[Tensor, Tensor, Tensor]]) -> None:
        def head(part: int) -> dict[str, Tensor]:  # copies, not views
            return {stream: parts[part][: self.samples].detach().cpu().clone() for stream, parts in read.items()}

        self.ids, self.valid = head(2), head(1)
