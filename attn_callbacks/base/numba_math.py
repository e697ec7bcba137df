"""Numba math the CPU twins share: the fast-math flags, the thread count, and a vectorisable ``log`` and
``x log x``. Importing this module imports numba: only ``*_numba`` modules import it, after
:func:`attn_callbacks.base.numba_loader.uses_numba`."""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

__all__ = ["FASTMATH", "TINY", "log", "threads", "xlogx"]

# Fast-math without "nnan"/"ninf", under which LLVM may drop the finiteness test of the pre-check. "reassoc" is what
# lets the row reductions vectorise; "contract" makes FMAs.
FASTMATH = {"reassoc", "contract"}

_LN2 = math.log(2.0)
_SQRT2 = math.sqrt(2.0)
TINY = np.finfo(np.float64).tiny  # log's argument is clamped here: 0 log 0 = 0, and no subnormal input
# 2 atanh(f) = log((1 + f) / (1 - f)) = 2 Σ f^(2k+1) / (2k+1); |f| <= 0.172 once the mantissa is in [√½, √2), where
# the terms up to f^11 leave a relative error below 1e-10 (float32 sums hold 7 digits).
_ATANH = (1.0, 1.0 / 3, 1.0 / 5, 1.0 / 7, 1.0 / 9, 1.0 / 11)


@numba.njit(inline="always", fastmath=FASTMATH)
def log(x):
    """Natural log of a positive normal float64, without branches or calls so that a loop over it vectorises (libm's
    ``log`` is a scalar call per element: several times slower than this polynomial on AVX2/AVX-512)."""
    bits = np.float64(x).view(np.int64)
    exponent = (bits >> 52) - 1023
    mantissa = np.int64((bits & 0x000FFFFFFFFFFFFF) | 0x3FF0000000000000).view(np.float64)  # in [1, 2)
    high = mantissa > _SQRT2
    mantissa = mantissa * 0.5 if high else mantissa
    exponent = exponent + 1 if high else exponent
    f = (mantissa - 1.0) / (mantissa + 1.0)
    s = f * f
    poly = _ATANH[5]
    poly = poly * s + _ATANH[4]
    poly = poly * s + _ATANH[3]
    poly = poly * s + _ATANH[2]
    poly = poly * s + _ATANH[1]
    poly = poly * s + _ATANH[0]
    return exponent * _LN2 + 2.0 * f * poly


@numba.njit(inline="always", fastmath=FASTMATH)
def xlogx(x):
    """``x log x``, 0 at 0 (and for a negative ``x``, ``x`` times the log of the smallest normal): branch-free, so
    that a loop over it vectorises."""
    return x * log(max(x, TINY))


def threads() -> int:
    """Threads for a kernel: numba's, at most torch's, so that ``torch.set_num_threads`` holds for the kernels too."""
    return max(1, min(numba.get_num_threads(), torch.get_num_threads()))
