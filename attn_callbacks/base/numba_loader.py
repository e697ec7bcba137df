"""The one lazy import of numba: the CPU twins (``*_numba`` modules) are imported only once :func:`uses_numba` says
numba works, so that importing the package stays fast and works without numba."""

from __future__ import annotations

import os
from types import ModuleType

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

__all__ = ["NUMBA_SWITCH", "uses_numba"]

#: Set to ``0`` to run the torch code on CPU too, instead of the numba twins (read at every call).
NUMBA_SWITCH = "ATTN_CALLBACKS_NUMBA"

# What the import of numba gave: the module, or None after a failure (warned about once per process).
_NUMBA: dict[str, ModuleType | None] = {}


def _import_numba() -> ModuleType:
    import numba

    return numba


def _numba() -> ModuleType | None:
    if "module" not in _NUMBA:
        try:
            _NUMBA["module"] = _import_numba()
        except (ImportError, OSError) as error:  # OSError: llvmlite's shared library failing to load
            _NUMBA["module"] = None
            rank_zero_warn(
                f"attn_callbacks: numba is unavailable ({type(error).__name__}: {error}); running the slower torch "
                f"code on CPU instead. Install numba, or set {NUMBA_SWITCH}=0 to choose the torch code and silence "
                "this warning."
            )
    return _NUMBA["module"]


def uses_numba(device: torch.device | str) -> bool:
    """Whether work on ``device`` runs the numba twins: a CPU device, numba importable, and the environment variable
    ``ATTN_CALLBACKS_NUMBA`` not ``0``. A caller imports its ``*_numba`` module only after this returned True."""
    if torch.device(device).type != "cpu" or os.environ.get(NUMBA_SWITCH, "").strip() == "0":
        return False
    return _numba() is not None
