"""The callback's export files: the folder they go to, checked before the run (:func:`export_directory`), their names
(:func:`export_name`) and their writing (:func:`export_epoch`, the format of :mod:`.export`), which never replaces a
file, and :func:`discard` for the file of a failed epoch end.

Files are named ``{prefix}-epoch={E:04d}-step={S}.{pt|npz}`` in the export folder, ``epoch={E:04d}-step={S}.{pt|npz}``
for the default prefix ``attention`` (the names attn_callbacks 0.1.0 wrote), with ``-v1``, ``-v2`` ... before the
suffix when that name is taken.
"""

from __future__ import annotations

import itertools
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from attn_callbacks.base.config import short_repr
from attn_callbacks.base.files import as_umask_allows
from attn_callbacks.output.export import epoch_writer
from attn_callbacks.sums.accumulator import AttentionStats

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from attn_callbacks.capture.streams import Streams

__all__ = ["check_export_dir", "discard", "export_directory", "export_epoch", "export_name", "not_a_folder"]

#: The default ``prefix`` of AttentionMonitor: its exports keep the names attn_callbacks 0.1.0 gave them.
_UNPREFIXED = "attention"
_UNSAFE_IN_NAMES = re.compile(r"[^\w.=+-]")  # what a prefix may not bring into a file name (a "/", say)


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
        where = "" if blocking == path else f", below {short_repr(str(blocking), limit=120)}"
        what = "a file" if blocking.exists() else "a broken link"
        raise ValueError(
            f"Expected argument `{argument}`{note} to be a folder (or a path where one can be made), but got "
            f"{short_repr(str(path), limit=120)}{where}, which is {what}"
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
    vocab_ids = {stream: streams.vocab_ids(stream) for stream in streams.names}
    write = epoch_writer(suffix, merged, streams.of, labels, epoch, step, vocab_ids)
    directory.mkdir(parents=True, exist_ok=True)
    # Written under a hidden name that no reader takes for an export, then given its name without replacing a file.
    descriptor, scratch = tempfile.mkstemp(
        prefix=f".{export_name(prefix, epoch, step, '')}.", suffix=".tmp", dir=directory
    )
    try:
        with os.fdopen(descriptor, "wb") as file:
            write(file)
        as_umask_allows(scratch)
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
