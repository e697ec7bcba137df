"""The torch step's per-batch terms (:func:`attn_callbacks.sums.step_torch.batch_terms`: masks, ``U``, the row
statistics and the position sums) through ``torch.compile``: inductor fuses their ~40 small kernels into a few passes
over the weights (Triton on a GPU, C++ on CPU). The same function as the eager step, so the same numbers up to rounding;
the scatters into the sums stay eager.

One compiled function serves the process. Dynamo specialises it on the first batch's shapes and, when a length
changes, recompiles once with dynamic shapes, so varying lengths do not recompile without bound. A compile error
falls back to the eager code for the rest of the process, with one warning.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
from torch import Tensor

from attn_callbacks.sums.step_torch import batch_terms

__all__ = ["batch_terms_compiled", "compile_failed"]

_compiled: Any = None
_failed: str | None = None  # why compiling failed, once it did


def compile_failed() -> str | None:
    """Why the compiled step fell back to eager in this process, or None."""
    return _failed


def batch_terms_compiled(*args: Any) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor] | None:
    """:func:`~attn_callbacks.sums.step_torch.batch_terms` of these arguments, compiled; None once compiling failed (the
    caller runs the eager code: nothing was changed in place)."""
    global _compiled, _failed
    if _failed is not None:
        return None
    if _compiled is None:
        _compiled = torch.compile(batch_terms, fullgraph=True)
    try:
        # The monitor runs compiled models eagerly while it watches them (force_eager): not this function.
        with _stance("default"):
            return _compiled(*args)
    except Exception as error:  # any compiler error: the eager code computes the same
        _failed = _first_line(error)
        warnings.warn(
            f"AttentionMonitor: torch.compile failed on the per-batch step ({_failed}); the eager step runs instead, "
            "with the same results",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def _stance(stance: str) -> contextlib.AbstractContextManager:
    set_stance = getattr(torch.compiler, "set_stance", None)
    return contextlib.nullcontext() if set_stance is None else set_stance(stance)


def _first_line(error: BaseException) -> str:
    """The error's type and first two lines: dynamo's ``BackendCompilerFailed`` names the backend on the first, and
    the error it raised on the second."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {' '.join(lines[:2])}"
