"""Writing a file so that a reader never sees half of it. Standard library only: the explorer's TensorBoard plugin
imports it without torch."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["write_atomically"]


def write_atomically(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """Call ``write`` on a temporary file beside ``path``, then rename it to ``path`` (an atomic replace on POSIX and
    Windows): a reader sees the old file or the whole new one. The temporary file is removed if ``write`` fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as file:
            write(file)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
