"""Saving one epoch's attention sums to disk and reading them back (:mod:`.graph` exports an attention graph).

An *epoch export* holds, per attention module, only the raw sums of :class:`~attn_callbacks.metrics.AttentionStats`
(``S``, ``C``, ``Q``, ``skipped_rows``, ``U``, ``position_sums``): everything else is derived from them on load, so a
loaded epoch gives exactly (``torch.equal``) what :meth:`AttentionAccumulator.compute` gave. Two formats, chosen by
the file suffix:

- ``.pt``: ``torch.save`` of a plain dict (tensors, ints, strings, lists, dicts), loadable with
  ``torch.load(path, weights_only=True)``::

      {"format": "attn_callbacks.epoch", "version": 1, "epoch": int, "global_step": int,
       "streams": {module: [query_stream, key_stream]}, "labels": {stream: [str, ...] or None},
       "modules": {module: {"attention_sum": Tensor, "pair_count": Tensor, ...}}}

- ``.npz``: ``numpy.savez_compressed``, loadable with ``numpy.load(path, allow_pickle=False)``: the arrays
  ``"{i}.attention_sum"``, ``"{i}.pair_count"`` ... for the ``i``-th module, and ``"__meta__"``, a 0-d string array
  holding JSON with the same keys as the ``.pt`` dict except that ``"modules"`` is the list of module names (the
  ``i``-th name owns the arrays ``"{i}.*"``) and ``"dtypes"`` gives each array's torch dtype.

The callback's files (:func:`export_epoch`) are named ``{prefix}-epoch={E:04d}-step={S}.{pt|npz}`` in the export folder,
``epoch={E:04d}-step={S}.{pt|npz}`` for the default prefix ``attention`` (the names attn_callbacks 0.1.0 wrote), with
``-v1``, ``-v2`` ... before the suffix when that name is taken: an export never replaces another file.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import tempfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple

import numpy as np
import torch
from torch import Tensor

from attn_callbacks.base.files import write_atomically
from attn_callbacks.sums.accumulator import SUM_FIELDS, AttentionStats
from attn_callbacks.sums.step import POSITION_STATS

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from attn_callbacks.capture.streams import Streams

__all__ = [
    "FORMAT_VERSION",
    "EpochRecord",
    "check_export_dir",
    "discard",
    "export_directory",
    "export_epoch",
    "export_name",
    "load_epoch",
    "not_a_folder",
    "save_epoch",
]

#: Version of the on-disk layout written by :func:`save_epoch`; :func:`load_epoch` reads this version only.
FORMAT_VERSION = 1

_FORMAT_NAME = "attn_callbacks.epoch"
_SUFFIXES = (".pt", ".npz")
_META_KEY = "__meta__"
_DTYPES = {str(dtype): dtype for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64)}
#: The default ``prefix`` of AttentionMonitor: its exports keep the names attn_callbacks 0.1.0 gave them.
_UNPREFIXED = "attention"
_UNSAFE_IN_NAMES = re.compile(r"[^\w.=+-]")  # what a prefix may not bring into a file name (a "/", say)


class EpochRecord(NamedTuple):
    """One saved validation epoch, as returned by :func:`load_epoch`.

    Attributes:
        epoch: the trainer's ``current_epoch`` when it was saved.
        global_step: the trainer's ``global_step`` when it was saved.
        modules: attention module name -> its statistics, with ``P = S / Q`` and ``M = S / C`` derived again.
        streams: module name -> ``(query_stream, key_stream)``; a module is self-attention when both are equal.
        labels: stream name -> whole token strings for ids ``0 .. V-1``, or None when the run had no labels.
    """

    epoch: int
    global_step: int
    modules: dict[str, AttentionStats]
    streams: dict[str, tuple[str, str]]
    labels: dict[str, list[str] | None]

    def export_graph(
        self, module: str, path: str | os.PathLike, *, head: int | None = None, min_weight: float = 0.0
    ) -> Path:
        """:func:`export_graph` for one module of this epoch, with its labels and stream wiring.

        Args:
            module: the attention module's name, a key of :attr:`modules`.
            path: the ``.graphml`` file to write.
            head: as in :func:`export_graph`.
            min_weight: as in :func:`export_graph`.

        Returns:
            The path written, as a :class:`~pathlib.Path`.
        """
        if module not in self.modules:
            raise ValueError(f"Expected argument `module` to be one of {sorted(self.modules)}, but got {module!r}")
        from attn_callbacks.output.graph import export_graph  # networkx, an optional dependency, is imported there

        query_stream, key_stream = self.streams[module]
        return export_graph(
            path,
            self.modules[module],
            query_labels=self.labels.get(query_stream),
            key_labels=self.labels.get(key_stream),
            self_attention=query_stream == key_stream,
            head=head,
            min_weight=min_weight,
        )


# --------------------------------------------------------------------------------------------------------- saving
def save_epoch(
    path: str | os.PathLike,
    stats: Mapping[str, AttentionStats],
    *,
    streams: Mapping[str, tuple[str, str]],
    labels: Mapping[str, Sequence[str] | None],
    epoch: int,
    global_step: int,
) -> Path:
    """Save the raw attention sums of one epoch, for every module, to a ``.pt`` or ``.npz`` file.

    Only ``S`` (``attention_sum``), ``C`` (``pair_count``), ``Q`` (``query_count``), ``skipped_rows``, ``U``
    (``uniform_sum``) and ``position_sums`` are stored, moved to the CPU; ``P = S / Q`` and ``M = S / C`` are derived
    again by :func:`load_epoch`. The layout of both formats is described in this module's docstring. The file is
    written next to its final name and renamed into place, so an interrupted run never leaves a half-written export;
    parent directories are created.

    Args:
        path: the file to write; its suffix picks the format: ``.pt`` or ``.npz``.
        stats: attention module name -> its statistics (what :meth:`AttentionAccumulator.compute` returned).
        streams: module name -> ``(query_stream, key_stream)``, for every module in ``stats``.
        labels: stream name -> whole token strings for ids ``0 .. V-1`` of that stream, or None. A stream missing
            here is saved as None.
        epoch: the epoch number to record.
        global_step: the global step to record.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: for an unknown suffix, a module without streams, or labels whose length is not the vocabulary
            size of the stream.

    Example:
        >>> import tempfile, torch
        >>> from attn_callbacks import AttentionAccumulator
        >>> acc = AttentionAccumulator(num_heads=1, query_vocab_size=2, key_vocab_size=2)
        >>> ids, valid = torch.tensor([[0, 1]]), torch.ones(1, 2, dtype=torch.bool)
        >>> acc.update(torch.tensor([[[[0.5, 0.5], [0.0, 1.0]]]]), ids, ids, valid, valid)
        >>> file = save_epoch(f"{tempfile.mkdtemp()}/e.pt", {"attn": acc.compute()}, streams={"attn": ("x", "x")},
        ...                   labels={"x": ["a", "b"]}, epoch=0, global_step=10)
        >>> load_epoch(file).modules["attn"].attention_mass[0].tolist()
        [[0.5, 0.5], [0.0, 1.0]]
    """
    path = Path(path)
    write = _epoch_writer(_format_of(path), stats, streams, labels, epoch, global_step)
    write_atomically(path, write)
    return path


def _epoch_writer(
    suffix: str,
    stats: Mapping[str, AttentionStats],
    streams: Mapping[str, tuple[str, str]],
    labels: Mapping[str, Sequence[str] | None],
    epoch: int,
    global_step: int,
) -> Callable[[BinaryIO], Any]:
    """Check :func:`save_epoch`'s arguments and copy the sums to the CPU; return what writes them to an open file in
    the format of ``suffix``."""
    epoch = _non_negative_int("epoch", epoch)
    global_step = _non_negative_int("global_step", global_step)

    modules: dict[str, dict[str, Tensor]] = {}
    vocab: dict[str, int] = {}  # stream -> size, to check labels against
    saved_streams: dict[str, list[str]] = {}
    for name, module_stats in stats.items():
        if name not in streams:
            raise ValueError(f"Expected argument `streams` to have an entry for module {name!r}, but got {streams!r}")
        query_stream, key_stream = (str(stream) for stream in streams[name])
        saved_streams[name] = [query_stream, key_stream]
        # A copy, not a view: torch.save writes a view's whole storage, and the caller's tensors may live on a GPU.
        modules[name] = {field: getattr(module_stats, field).detach().to("cpu", copy=True) for field in SUM_FIELDS}
        _check_sums(name, modules[name], where="argument `stats`")
        _, vocab[query_stream], vocab[key_stream] = modules[name]["attention_sum"].shape
    saved_labels: dict[str, list[str] | None] = {}
    for stream, size in vocab.items():
        tokens = labels.get(stream)
        if tokens is not None:
            tokens = [str(token) for token in tokens]
            if len(tokens) != size:
                raise ValueError(
                    f"Expected argument `labels` to give {size} tokens for stream {stream!r} (its vocabulary size), "
                    f"but got {len(tokens)}"
                )
        saved_labels[stream] = tokens

    header = {
        "format": _FORMAT_NAME,
        "version": FORMAT_VERSION,
        "epoch": epoch,
        "global_step": global_step,
        "streams": saved_streams,
        "labels": saved_labels,
    }
    if suffix == ".pt":
        return lambda file: torch.save({**header, "modules": modules}, file)
    else:
        arrays = {
            f"{i}.{field}": _to_numpy(tensor)
            for i, sums in enumerate(modules.values())
            for field, tensor in sums.items()
        }
        meta = {
            **header,
            "modules": list(modules),
            "dtypes": {
                f"{i}.{field}": str(t.dtype) for i, sums in enumerate(modules.values()) for field, t in sums.items()
            },
        }
        arrays[_META_KEY] = np.array(json.dumps(meta))  # a unicode array, not an object: no pickle needed
        return lambda file: np.savez_compressed(file, **arrays)


# ------------------------------------------------------------------------------------------- the callback's files
def export_name(prefix: str, epoch: int, global_step: int, suffix: str, version: int = 0) -> str:
    """The file name of one export of the callback: ``{prefix}-epoch={E:04d}-step={S}[-v{version}]{suffix}``.

    The default prefix ``attention`` is left out (``epoch=0003-step=120.pt``, as attn_callbacks 0.1.0 named its
    exports); characters a file name should not hold (``/``, spaces ...) become ``_``.

    Example:
        >>> export_name("attention", 3, 120, ".pt"), export_name("dec/x", 3, 120, ".npz", version=2)
        ('epoch=0003-step=120.pt', 'dec_x-epoch=0003-step=120-v2.npz')
    """
    stem = f"epoch={int(epoch):04d}-step={int(global_step)}"
    if prefix != _UNPREFIXED:
        stem = f"{_UNSAFE_IN_NAMES.sub('_', prefix).lstrip('.') or '_'}-{stem}"
    return f"{stem}{f'-v{version}' if version else ''}{suffix}"


def not_a_folder(path: str | os.PathLike) -> Path | None:
    """The first of ``path`` and its parents that exists but is not a folder (a file, a broken link): the reason a
    folder cannot be made at ``path``; None when there is none."""
    path = Path(path)
    for folder in (path, *path.parents):
        if folder.is_dir():
            return None
        if folder.exists() or folder.is_symlink():
            return folder
    return None


def check_export_dir(path: str | os.PathLike, argument: str = "export_dir", note: str = "") -> Path:
    """Check that the export folder ``path`` is, or can be made, a folder; call it before the run, so that a bad
    ``export_dir`` fails in ``setup`` rather than at the end of the first epoch.

    Args:
        path: the folder the exports go to.
        argument: what to call it in the error.
        note: said after the argument's name (how the path was chosen).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: naming ``argument`` and the path, when ``path`` or one of its parents is a file.

    Example:
        >>> import tempfile
        >>> file = tempfile.NamedTemporaryFile()
        >>> check_export_dir(f"{file.name}/epochs")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Expected argument `export_dir` to be a folder ..., below '...', which is a file
    """
    path = Path(path)
    blocking = not_a_folder(path)
    if blocking is not None:
        where = "" if blocking == path else f", below {_cut(str(blocking))}"
        what = "a file" if blocking.exists() else "a broken link"
        raise ValueError(
            f"Expected argument `{argument}`{note} to be a folder (or a path where one can be made), but got "
            f"{_cut(str(path))}{where}, which is {what}"
        )
    return path


def export_directory(trainer: Trainer, export_dir: str | os.PathLike | None = None) -> Path:
    """The folder the callback's exports go to: ``export_dir``, or ``{logger log_dir}/attention_epochs`` when it is
    None (or ``{default_root_dir}/attention_epochs`` without a logger), checked by :func:`check_export_dir`.

    Call it on every rank: ``trainer.log_dir`` is a broadcast under DDP. Call it in ``setup`` too, so that a bad
    folder fails before training.

    Raises:
        ValueError: when the folder is, or lies below, a file.
    """
    if export_dir:
        return check_export_dir(export_dir)
    directory = Path(trainer.log_dir or trainer.default_root_dir) / "attention_epochs"
    return check_export_dir(directory, note=" (None: {logger log_dir}/attention_epochs)")


def export_epoch(
    trainer: Trainer,
    merged: Mapping[str, AttentionStats],
    streams: Streams,
    export: str,
    export_dir: str | os.PathLike | None = None,
    prefix: str = _UNPREFIXED,
) -> Path | None:
    """Save the epoch's sums (:func:`save_epoch`), from global rank 0, to a new file of the export folder
    (:func:`export_directory`) named by :func:`export_name`: the monitor's ``prefix`` (``{prefix}_test`` for a test
    epoch), the epoch and the global step, and ``-v1``, ``-v2`` ... when that name is taken (a second
    ``trainer.validate`` at the same step, a second monitor with the same prefix, another run writing to the same
    folder). An existing file is never replaced, and a reader never sees a half-written one.

    The sums are those of the whole epoch: all validation dataloaders together.

    Args:
        trainer: the Trainer (its epoch, global step, rank and log folder).
        merged: attention module name -> the epoch's statistics.
        streams: the monitor's token streams (each module's query and key stream, their labels).
        export: ``"pt"`` or ``"npz"``.
        export_dir: the folder, or None for ``{logger log_dir}/attention_epochs``.
        prefix: the monitor's prefix for this stage.

    Returns:
        The file written, on global rank 0; None on the other ranks. Pass it to :func:`discard` if the epoch end
        fails later: a failed epoch leaves no export.
    """
    directory = export_directory(trainer, export_dir)  # every rank: trainer.log_dir is a broadcast under DDP
    if not trainer.is_global_zero:
        return None
    epoch, step, suffix = trainer.current_epoch, trainer.global_step, f".{export}"
    labels = {stream: streams.full_labels(stream) for stream in streams.names}
    write = _epoch_writer(suffix, merged, streams.of, labels, epoch, step)
    directory.mkdir(parents=True, exist_ok=True)
    # Written under a hidden name that no reader takes for an export, then given its name without replacing a file.
    descriptor, scratch = tempfile.mkstemp(
        prefix=f".{export_name(prefix, epoch, step, '')}.", suffix=".tmp", dir=directory
    )
    try:
        with os.fdopen(descriptor, "wb") as file:
            write(file)
        return _publish(Path(scratch), directory, lambda version: export_name(prefix, epoch, step, suffix, version))
    finally:
        Path(scratch).unlink(missing_ok=True)


def _publish(scratch: Path, directory: Path, name: Callable[[int], str]) -> Path:
    """Give the written ``scratch`` file the first free name ``name(0)``, ``name(1)`` ... without replacing a file."""
    for version in itertools.count():
        path = directory / name(version)
        try:
            os.link(scratch, path)  # fails when the name exists: atomic, also against another process
        except FileExistsError:
            continue
        except OSError:  # no hard links on this file system: look, then rename (not atomic against other processes)
            if path.exists() or path.is_symlink():
                continue
            os.replace(scratch, path)
        return path
    raise AssertionError("unreachable")  # pragma: no cover


def discard(path: str | os.PathLike | None) -> None:
    """Remove an export that :func:`export_epoch` wrote (nothing for None, or a file already gone): the callback
    calls it when the epoch end fails after the export was written, so that a failed epoch leaves no file."""
    if path is not None:
        Path(path).unlink(missing_ok=True)


def _cut(text: str, limit: int = 120) -> str:
    """``repr(text)``, cut to about ``limit`` characters."""
    return repr(text) if len(text) <= limit else repr(text[: limit - 1] + "…")


def _to_numpy(tensor: Tensor) -> np.ndarray:
    # numpy has no bfloat16; float32 holds every bfloat16 exactly, and the recorded dtype casts it back on load.
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


# -------------------------------------------------------------------------------------------------------- loading
def load_epoch(path: str | os.PathLike) -> EpochRecord:
    """Read an epoch written by :func:`save_epoch` (either format) and derive ``P`` and ``M`` again.

    Each module's :class:`~attn_callbacks.metrics.AttentionStats` is rebuilt from the stored sums through
    :func:`attn_callbacks.metrics.stats_from_sums` (``P = S / Q[:, None]``, ``M = S / C`` per head, see
    :func:`attn_callbacks.functional.attention_mass` and :func:`attn_callbacks.functional.mean_weight`), so every field
    equals exactly what :meth:`AttentionAccumulator.compute` returned when the epoch was saved. Tensors are on the CPU.

    Args:
        path: a ``.pt`` or ``.npz`` file.

    Returns:
        The :class:`EpochRecord`.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: for an unknown suffix, a file that is not an epoch export, or an unknown format version.
    """
    path = Path(path)
    suffix = _format_of(path)
    if not path.is_file():
        raise FileNotFoundError(f"No attention epoch export at {str(path)!r}")
    header, sums = _read_pt(path) if suffix == ".pt" else _read_npz(path)
    try:
        streams = {str(name): (str(pair[0]), str(pair[1])) for name, pair in dict(header["streams"]).items()}
        labels = {
            str(stream): None if tokens is None else [str(token) for token in tokens]
            for stream, tokens in dict(header["labels"]).items()
        }
        epoch, global_step = int(header["epoch"]), int(header["global_step"])
    except (KeyError, TypeError, ValueError, IndexError) as error:
        raise ValueError(f"{str(path)!r} is not a valid attention epoch export: bad metadata ({error!r})") from None
    modules = {}
    for name, module_sums in sums.items():
        if name not in streams:
            raise ValueError(f"{str(path)!r} is not a valid attention epoch export: no streams for module {name!r}")
        _check_sums(name, module_sums, where=repr(str(path)))
        modules[name] = AttentionStats(*(module_sums[field] for field in SUM_FIELDS))
    return EpochRecord(epoch=epoch, global_step=global_step, modules=modules, streams=streams, labels=labels)


def _not_an_export(path: Path, why: str) -> ValueError:
    return ValueError(f"{str(path)!r} is not an attention epoch export written by attn_callbacks.save_epoch: {why}")


def _check_header(path: Path, header: Any) -> dict:
    if not isinstance(header, Mapping) or header.get("format") != _FORMAT_NAME:
        raise _not_an_export(path, f"no {_FORMAT_NAME!r} format marker")
    version = header.get("version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{str(path)!r} has attention export format version {version!r}, but this attn_callbacks reads version "
            f"{FORMAT_VERSION} only (a newer version wrote it? upgrade attn_callbacks)"
        )
    return dict(header)


def _read_pt(path: Path) -> tuple[dict, dict[str, dict[str, Tensor]]]:
    try:
        content = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types (UnpicklingError, RuntimeError, EOFError ...)
        raise _not_an_export(path, f"torch.load(weights_only=True) failed ({type(error).__name__})") from error
    header = _check_header(path, content)
    modules = header.pop("modules", None)
    if not isinstance(modules, Mapping) or not all(isinstance(sums, Mapping) for sums in modules.values()):
        raise _not_an_export(path, "no per-module sums")
    return header, {str(name): dict(sums) for name, sums in modules.items()}


def _read_npz(path: Path) -> tuple[dict, dict[str, dict[str, Tensor]]]:
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as error:
        raise _not_an_export(path, f"numpy.load failed ({type(error).__name__}: {error})") from error
    if _META_KEY not in arrays:
        raise _not_an_export(path, f"no {_META_KEY!r} array")
    try:
        meta = json.loads(str(arrays.pop(_META_KEY)))
    except json.JSONDecodeError as error:
        raise _not_an_export(path, f"{_META_KEY!r} is not JSON") from error
    header = _check_header(path, meta)
    names, dtypes = header.pop("modules", None), header.pop("dtypes", None)
    if not isinstance(names, list) or not isinstance(dtypes, Mapping):
        raise _not_an_export(path, "no module list")
    sums: dict[str, dict[str, Tensor]] = {}
    for i, name in enumerate(names):
        sums[str(name)] = {}
        for field in SUM_FIELDS:
            key = f"{i}.{field}"
            if key in arrays:
                dtype = _DTYPES.get(str(dtypes.get(key)))
                tensor = torch.from_numpy(arrays[key])
                sums[str(name)][field] = tensor if dtype is None else tensor.to(dtype)
    return header, sums


def _check_sums(name: str, sums: Mapping[str, Any], where: str) -> None:
    """The shapes :class:`AttentionStats` promises; a corrupt file fails here rather than deep inside a metric."""
    missing = [field for field in SUM_FIELDS if not isinstance(sums.get(field), Tensor)]
    if missing:
        raise ValueError(f"Module {name!r} in {where} lacks the sums {missing}")
    attention_sum = sums["attention_sum"]
    if attention_sum.dim() != 3:
        raise ValueError(f"Module {name!r} in {where}: expected attention_sum (H, Vq, Vk), got {_shape(attention_sum)}")
    heads, vocab_q, vocab_k = attention_sum.shape
    expected = {
        "pair_count": (vocab_q, vocab_k),
        "query_count": (vocab_q,),
        "skipped_rows": (),
        "uniform_sum": (vocab_q, vocab_k),
        # per_head=False keeps one (head-mean) attention channel but position statistics for every head
        "position_sums": (len(POSITION_STATS), heads if heads > 1 else sums["position_sums"].shape[-1]),
    }
    for field, shape in expected.items():
        if tuple(sums[field].shape) != shape:
            raise ValueError(
                f"Module {name!r} in {where}: expected {field} of shape {shape}, got {_shape(sums[field])}"
            )


def _shape(tensor: Tensor) -> tuple[int, ...]:
    return tuple(tensor.shape)


def _format_of(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in _SUFFIXES:
        raise ValueError(f"Expected argument `path` to end in '.pt' or '.npz', but got {str(path)!r}")
    return suffix


def _non_negative_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"Expected argument `{name}` to be a non-negative integer, but got {value!r}")
    return int(value)
