"""Writing a file so that a reader never sees half of it. Standard library only: the explorer's TensorBoard plugin
imports it without torch."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["as_umask_allows", "write_atomically"]


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (setting it, even back, races with threads
    creating files meanwhile); elsewhere set and restored once, at import."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_umask()


def as_umask_allows(path: str | os.PathLike) -> None:
    """Give a file made by :func:`tempfile.mkstemp` (always 0600) the mode a plain ``open`` would have given it, so that
    a TensorBoard run by another user reads it as it reads the event files."""
    os.chmod(path, _FILE_MODE)


def write_atomically(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """Call ``write`` on a temporary file beside ``path``, then rename it to ``path`` (an atomic replace on POSIX and
    Windows): a reader sees the old file or the whole new one. The temporary file is removed if ``write`` fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as file:
            write(file)
        as_umask_allows(temporary)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
