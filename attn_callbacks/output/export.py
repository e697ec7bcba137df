"""Saving one epoch's attention sums to disk and reading them back (:mod:`.graph` exports an attention graph).

An *epoch export* holds, per attention module, only the raw sums of :class:`~attn_callbacks.AttentionStats`
(``S``, ``C``, ``Q``, ``skipped_rows``, ``U``, ``position_sums``): everything else is derived from them on load, so a
loaded epoch gives exactly (``torch.equal``) what :meth:`AttentionAccumulator.compute` gave. Two formats, chosen by
the file suffix:

- ``.pt``: ``torch.save`` of a plain dict (tensors, ints, strings, lists, dicts), loadable with
  ``torch.load(path, weights_only=True)``::

      {"format": "attn_callbacks.epoch", "version": 1, "epoch": int, "global_step": int,
       "streams": {module: [query_stream, key_stream]}, "labels": {stream: [str, ...] or None},
       "vocab_ids": {stream: [int, ...] or None},
       "modules": {module: {"attention_sum": Tensor, "pair_count": Tensor, ...}}}

  ``vocab_ids`` gives, for a stream tracked to its most frequent ids (``max_tracked_tokens``, ``tracked_ids``), the
  vocabulary id of each row or column of the sums but the last, ``<other>``: the bucket of every untracked id. It is
  None (absent in files written by 0.1.0) where the sums' indices are the vocabulary ids.

- ``.npz``: ``numpy.savez_compressed``, loadable with ``numpy.load(path, allow_pickle=False)``: the arrays
  ``"{i}.attention_sum"``, ``"{i}.pair_count"`` ... for the ``i``-th module, and ``"__meta__"``, a 0-d string array
  holding JSON with the same keys as the ``.pt`` dict except that ``"modules"`` is the list of module names (the
  ``i``-th name owns the arrays ``"{i}.*"``) and ``"dtypes"`` gives each array's torch dtype.

Where the callback puts its exports, and their names: :mod:`.epoch_files`.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import numpy as np
import torch
from torch import Tensor

from attn_callbacks.base.config import short_repr
from attn_callbacks.base.files import write_atomically
from attn_callbacks.sums.accumulator import SUM_FIELDS, AttentionStats
from attn_callbacks.sums.step import POSITION_STATS

__all__ = ["FORMAT_VERSION", "EpochRecord", "epoch_writer", "load_epoch", "save_epoch"]

#: Version of the on-disk layout written by :func:`save_epoch`; :func:`load_epoch` reads this version only.
FORMAT_VERSION = 1

_FORMAT_NAME = "attn_callbacks.epoch"
_SUFFIXES = (".pt", ".npz")
_META_KEY = "__meta__"
_DTYPES = {str(dtype): dtype for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64)}


class EpochRecord(NamedTuple):
    """One saved validation epoch, as returned by :func:`load_epoch`.

    Attributes:
        epoch: the trainer's ``current_epoch`` when it was saved.
        global_step: the trainer's ``global_step`` when it was saved.
        modules: attention module name -> its statistics, with ``P = S / Q`` and ``M = S / C`` derived again.
        streams: module name -> ``(query_stream, key_stream)``; a module is self-attention when both are equal.
        labels: stream name -> whole token strings of the sums' indices ``0 .. V-1`` (for a tracked stream, its
            tracked tokens' and then ``"<other>"``), or None when the run had no labels.
        vocab_ids: stream name -> the vocabulary id of each index of a tracked stream but its last (``<other>``), or
            None where each index is its vocabulary id.
    """

    epoch: int
    global_step: int
    modules: dict[str, AttentionStats]
    streams: dict[str, tuple[str, str]]
    labels: dict[str, list[str] | None]
    vocab_ids: dict[str, list[int] | None] = {}  # noqa: RUF012  (read-only: a NamedTuple's default)

    def vocab_id(self, stream: str, index: int) -> int | None:
        """The vocabulary id of row or column ``index`` of a stream's sums; None for a tracked stream's ``<other>``.

        Example:
            >>> record = EpochRecord(0, 0, {}, {}, {"tokens": None}, {"tokens": [7, 3]})
            >>> [record.vocab_id("tokens", index) for index in range(3)]
            [7, 3, None]
        """
        ids = self.vocab_ids.get(stream)
        if ids is None:
            return index
        return ids[index] if index < len(ids) else None

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
            query_ids=self.vocab_ids.get(query_stream),
            key_ids=self.vocab_ids.get(key_stream),
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
    vocab_ids: Mapping[str, Sequence[int] | None] | None = None,
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
        labels: stream name -> whole token strings of the indices ``0 .. V-1`` of that stream's sums, or None. A
            stream missing here is saved as None.
        epoch: the epoch number to record.
        global_step: the global step to record.
        vocab_ids: stream name -> for a stream whose sums hold tracked ids and ``<other>`` last, the vocabulary id of
            each index but the last; None (or a stream missing here) where each index is its vocabulary id.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: for an unknown suffix, a module without streams, labels whose length is not the vocabulary size
            of the stream, or ``vocab_ids`` that are not one non-negative integer per index but the last.

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
    write = epoch_writer(_format_of(path), stats, streams, labels, epoch, global_step, vocab_ids)
    write_atomically(path, write)
    return path


def epoch_writer(
    suffix: str,
    stats: Mapping[str, AttentionStats],
    streams: Mapping[str, tuple[str, str]],
    labels: Mapping[str, Sequence[str] | None],
    epoch: int,
    global_step: int,
    vocab_ids: Mapping[str, Sequence[int] | None] | None = None,
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
    saved_ids = {stream: _vocab_ids(stream, (vocab_ids or {}).get(stream), size) for stream, size in vocab.items()}

    header = {
        "format": _FORMAT_NAME,
        "version": FORMAT_VERSION,
        "epoch": epoch,
        "global_step": global_step,
        "streams": saved_streams,
        "labels": saved_labels,
        "vocab_ids": saved_ids,
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


def _vocab_ids(stream: str, ids: Sequence[int] | None, size: int) -> list[int] | None:
    if ids is None:
        return None
    ids = list(ids)
    if len(ids) != size - 1 or not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in ids):
        raise ValueError(
            f"Expected argument `vocab_ids` to give {size - 1} integer ids for stream {stream!r} (its {size} indices "
            f"but the last, <other>), but got {short_repr(ids)}"
        )
    if any(i < 0 for i in ids):
        raise ValueError(f"Expected argument `vocab_ids` to hold ids >= 0 for stream {stream!r}, but got {min(ids)}")
    return [int(i) for i in ids]


def _to_numpy(tensor: Tensor) -> np.ndarray:
    # numpy has no bfloat16; float32 holds every bfloat16 exactly, and the recorded dtype casts it back on load.
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


# -------------------------------------------------------------------------------------------------------- loading
def load_epoch(path: str | os.PathLike) -> EpochRecord:
    """Read an epoch written by :func:`save_epoch` (either format) and derive ``P`` and ``M`` again.

    Each module's :class:`~attn_callbacks.AttentionStats` is rebuilt from the stored sums (``P = S / Q[:, None]``,
    ``M = S / C`` per head, see
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
        vocab_ids = {
            str(stream): None if ids is None else [int(i) for i in ids]
            for stream, ids in dict(header.get("vocab_ids") or {}).items()
        }
        epoch, global_step = int(header["epoch"]), int(header["global_step"])
    except (KeyError, TypeError, ValueError, IndexError) as error:
        raise ValueError(f"{str(path)!r} is not a valid attention epoch export: bad metadata ({error!r})") from None
    modules = {}
    for name, module_sums in sums.items():
        if name not in streams:
            raise ValueError(f"{str(path)!r} is not a valid attention epoch export: no streams for module {name!r}")
        _check_sums(name, module_sums, where=repr(str(path)))
        for stream, size in zip(streams[name], module_sums["attention_sum"].shape[1:], strict=True):
            if vocab_ids.get(stream) is not None and len(vocab_ids[stream]) != size - 1:
                why = f"{len(vocab_ids[stream])} vocab_ids for stream {stream!r}, whose sums have {size} indices"
                raise ValueError(f"{str(path)!r} is not a valid attention epoch export: {why}")
        modules[name] = AttentionStats(*(module_sums[field] for field in SUM_FIELDS))
    return EpochRecord(epoch, global_step, modules, streams, labels, vocab_ids)


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
