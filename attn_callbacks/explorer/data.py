"""The explorer's files: one monitored epoch of one module, as the monitor writes it and the plugin reads it.

Each epoch of each *view* (a module under one tag prefix, combined over dataloaders or one dataloader's) is two files
in ``<run>/plugins/attention_explorer/<view, %-quoted>/``:

- ``epoch=<E>-step=<S>.<nonce>.npy``: ``planes``, float32 ``(heads + 3, n_q, n_k)``, an uncompressed ``.npy`` the
  server memory-maps (a query reads one row or column, not the file): plane 0 the head mean of the attention mass
  ``P = S / Q[:, None]``, planes ``1 .. heads`` each head's ``P`` (``heads`` is 0 with ``per_head=False``), then the
  pair count ``C`` and the uniform-attention baseline ``U``; lift is ``P * Q[:, None] / U``.
- ``epoch=<E>-step=<S>.json``: what the planes are (their file, shape, the module and its streams), the rows' and
  columns' vocabulary ids and whole labels, and the rows' query counts ``Q`` (exact integers). The rows are the
  ``n_q`` most frequent tracked query tokens, most frequent first; the columns the same tokens for self-attention, the
  ``n_k`` key tokens most often visible for cross-attention.

Both are written atomically (temporary file, then rename), the planes first: a reader that finds a JSON file finds
its planes whole. The planes' name carries a random nonce, so that rewriting an epoch (a second ``validate`` at the
same step) never changes a file a reader may hold open; the replaced planes are then removed.

Standard library and numpy only: the TensorBoard plugin imports this module, and a plugin import that fails or takes
seconds takes TensorBoard down with it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import numpy as np

from attn_callbacks.base.files import write_atomically

__all__ = [
    "FORMAT",
    "PLUGIN_NAME",
    "VERSION",
    "ExplorerDataError",
    "ExplorerEpoch",
    "list_views",
    "planes_bytes",
    "read_epoch",
    "write_epoch",
]

#: The plugin's name: the folder under ``<run>/plugins/`` and the prefix of its routes.
PLUGIN_NAME = "attention_explorer"
FORMAT = "attn_callbacks.explorer"
VERSION = 1

_EPOCH_FILE = re.compile(r"^epoch=(\d+)-step=(\d+)\.json$")


class ExplorerDataError(ValueError):
    """An explorer file is missing, half-written, malformed or of another version; the message says which file."""


def folder(run_dir: str | os.PathLike) -> Path:
    """Where a run's explorer data lives."""
    return Path(run_dir) / "plugins" / PLUGIN_NAME


def view_folder(view: str) -> str:
    """The name of a view's folder: the view %-quoted, read back by :func:`list_views`."""
    return quote(view, safe="")


def view_fits(view: str) -> bool:
    """Whether the view's folder name fits the file systems' limit of 255 bytes per name (a long prefix or module
    path, %-quoted, may not)."""
    return len(view_folder(view).encode()) <= 255


def planes_bytes(heads: int, rows: int, cols: int) -> int:
    """Size of one epoch's planes file without its 128-byte header: ``(heads + 3) * rows * cols * 4``."""
    return (heads + 3) * rows * cols * 4


def write_epoch(
    run_dir: str | os.PathLike,
    *,
    view: str,
    module: str,
    streams: tuple[str, str],
    epoch: int,
    step: int,
    planes: np.ndarray,
    query_ids: Sequence[int],
    key_ids: Sequence[int],
    query_labels: Sequence[str],
    key_labels: Sequence[str],
    query_count: Sequence[int],
) -> Path:
    """Write one epoch of one view (see the module docstring for the layout); returns the JSON file's path.

    Args:
        run_dir: the TensorBoard run's folder (the logger's ``log_dir``).
        view: the view's name, shown in the tab: ``"{prefix}/{layer}"``, with ``"/dataloader_idx_{k}"`` for one
            dataloader's view.
        module: the attention module's name in the model.
        streams: its ``(query_stream, key_stream)``.
        epoch: the trainer's ``current_epoch``.
        step: the step the epoch's images and tables are logged at (``trainer.global_step``).
        planes: float32 ``(heads + 3, n_q, n_k)``: mean ``P``, each head's ``P``, ``C``, ``U``.
        query_ids: the rows' vocabulary ids, ``n_q`` of them.
        key_ids: the columns' vocabulary ids, ``n_k`` of them.
        query_labels: the rows' whole labels.
        key_labels: the columns' whole labels.
        query_count: the rows' query counts ``Q``.
    """
    planes = np.ascontiguousarray(planes, dtype=np.float32)
    if planes.ndim != 3 or planes.shape[0] < 3:
        raise ValueError(f"Expected `planes` of shape (heads + 3, n_q, n_k), but got {planes.shape}")
    n_q, n_k = planes.shape[1:]
    for name, values, size in (
        ("query_ids", query_ids, n_q),
        ("key_ids", key_ids, n_k),
        ("query_labels", query_labels, n_q),
        ("key_labels", key_labels, n_k),
        ("query_count", query_count, n_q),
    ):
        if len(values) != size:
            raise ValueError(f"Expected `{name}` to have {size} entries (the planes' shape), but got {len(values)}")
    where = folder(run_dir) / view_folder(view)
    stem = f"epoch={int(epoch)}-step={int(step)}"
    meta_path = where / f"{stem}.json"
    old = _planes_name(meta_path)
    array_name = f"{stem}.{secrets.token_hex(4)}.npy"
    write_atomically(where / array_name, lambda file: np.save(file, planes, allow_pickle=False))
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "view": view,
        "module": module,
        "streams": list(streams),
        "epoch": int(epoch),
        "step": int(step),
        "heads": int(planes.shape[0] - 3),
        "planes": array_name,
        "shape": list(planes.shape),
        "query_ids": [int(i) for i in query_ids],
        "key_ids": [int(i) for i in key_ids],
        "query_labels": [str(label) for label in query_labels],
        "key_labels": [str(label) for label in key_labels],
        "query_count": [int(c) for c in query_count],
    }
    text = json.dumps(meta, separators=(",", ":")).encode()  # ensure_ascii: lone surrogates become \udcxx escapes
    write_atomically(meta_path, lambda file: file.write(text))
    if old is not None and old != array_name:
        (where / old).unlink(missing_ok=True)
    return meta_path


def _planes_name(meta_path: Path) -> str | None:
    """The planes file an existing JSON file names (None when there is none, or it is unreadable)."""
    try:
        name = json.loads(meta_path.read_bytes()).get("planes")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) and "/" not in name and "\\" not in name else None


def list_views(run_dir: str | os.PathLike) -> dict[str, list[tuple[int, int, int]]]:
    """Every view of a run with its epochs' ``(epoch, step, version)``, sorted by step; empty when the run has no
    data. ``version`` is the JSON file's modification time in nanoseconds: it changes when an epoch is rewritten, so a
    URL that carries it may be cached.

    The names come from the folder's own listing (never from a request): each view folder's name %-unquoted. A
    folder whose name :func:`write_epoch` would not have written (not its %-quoting, or not UTF-8) is not a view.
    """
    root = folder(run_dir)
    try:
        entries = sorted(os.scandir(root), key=lambda entry: entry.name)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    views: dict[str, list[tuple[int, int, int]]] = {}
    for entry in entries:
        if not entry.is_dir() or entry.name.startswith(".") or not _quoted(entry.name):
            continue
        epochs = []
        for file in os.scandir(entry.path):
            match = _EPOCH_FILE.match(file.name)
            if match:
                try:
                    epochs.append((int(match[1]), int(match[2]), file.stat().st_mtime_ns))
                except FileNotFoundError:  # replaced while listed
                    continue
        if epochs:
            views[unquote(entry.name)] = sorted(epochs, key=lambda item: (item[1], item[0]))
    return views


def _quoted(name: str) -> bool:
    """Whether a folder name is a view's %-quoting (a name that is not UTF-8 is listed with surrogates: never)."""
    try:
        return view_folder(unquote(name)) == name
    except UnicodeEncodeError:
        return False


@dataclass(frozen=True)
class ExplorerEpoch:
    """One epoch of one view, read back: the JSON fields and the memory-mapped planes.

    Attributes:
        meta: the JSON file's fields (see the module docstring).
        planes: float32 ``(heads + 3, n_q, n_k)``, read-only and memory-mapped.
        query_count: the rows' ``Q``, int64 ``(n_q,)``.
    """

    meta: dict[str, Any]
    planes: np.ndarray
    query_count: np.ndarray

    @property
    def heads(self) -> int:
        return int(self.meta["heads"])

    def mass(self, head: int | None) -> np.ndarray:
        """``P`` of one head, or of the head mean (``head=None``), ``(n_q, n_k)``."""
        return self.planes[0 if head is None else 1 + head]

    @property
    def pair_count(self) -> np.ndarray:
        return self.planes[-2]

    @property
    def uniform_sum(self) -> np.ndarray:
        return self.planes[-1]


def read_epoch(run_dir: str | os.PathLike, view: str, epoch: int, step: int) -> ExplorerEpoch:
    """Read one epoch of one view written by :func:`write_epoch`; an epoch rewritten while read (a second
    validation at one step) is read again, once.

    Raises:
        ExplorerDataError: when a file is missing, malformed, half-written or of another format version.
    """
    try:
        return _read_epoch(run_dir, view, epoch, step)
    except _PlanesGone:  # the JSON read named the planes that a rewrite has just replaced
        return _read_epoch(run_dir, view, epoch, step)


class _PlanesGone(ExplorerDataError):
    """The planes file a JSON file names does not exist."""


def _read_epoch(run_dir: str | os.PathLike, view: str, epoch: int, step: int) -> ExplorerEpoch:
    where = folder(run_dir) / view_folder(view)
    meta_path = where / f"epoch={int(epoch)}-step={int(step)}.json"
    try:
        meta = json.loads(meta_path.read_bytes())
    except FileNotFoundError:
        raise ExplorerDataError(f"{meta_path} does not exist") from None
    except (OSError, ValueError) as error:
        raise ExplorerDataError(f"{meta_path} is not readable JSON ({error})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        found = (meta.get("format"), meta.get("version")) if isinstance(meta, dict) else type(meta).__name__
        raise ExplorerDataError(f"{meta_path} is not {FORMAT} version {VERSION} (found {found})")
    name = _planes_name(meta_path)
    if name is None:
        raise ExplorerDataError(f"{meta_path} names no planes file")
    try:
        shape = tuple(int(n) for n in meta["shape"])
        query_count = np.asarray(meta["query_count"], dtype=np.int64)
        sizes = {len(meta[key]) for key in ("query_ids", "query_labels")} | {len(query_count)}
        sizes_k = {len(meta[key]) for key in ("key_ids", "key_labels")}
        heads = int(meta["heads"])
        int(meta["epoch"]), int(meta["step"])
        if not isinstance(meta["module"], str) or len(meta["streams"]) != 2:
            raise ValueError("`module` must be a string and `streams` two names")
    except (KeyError, TypeError, ValueError) as error:
        raise ExplorerDataError(f"{meta_path} lacks or garbles a field ({error!r})") from None
    if len(shape) != 3 or shape[0] != heads + 3 or sizes != {shape[1]} or sizes_k != {shape[2]}:
        raise ExplorerDataError(f"{meta_path}: its fields disagree with its shape {list(shape)}")
    try:
        planes = np.load(where / name, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise _PlanesGone(f"{where / name} (named by {meta_path.name}) does not exist") from None
    except (OSError, ValueError, EOFError) as error:  # EOFError: an empty file
        raise ExplorerDataError(f"{where / name} is not a readable .npy file ({error})") from None
    if planes.shape != shape or planes.dtype != np.float32:
        raise ExplorerDataError(
            f"{where / name} holds {planes.dtype} {list(planes.shape)}, but {meta_path.name} says float32 {list(shape)}"
        )
    return ExplorerEpoch(meta, planes, query_count)
