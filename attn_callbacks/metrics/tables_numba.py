"""Numba passes for the epoch-end tables on the CPU: the candidate pairs of ``one_way_pairs`` and ``lift_pairs``, and
PageRank's vector-matrix product.

torch finds them with boolean masks over every cell, transposed reads and ``nonzero`` (~25 ms a table at 2,048
tokens); these read each matrix once (the one-way pass by tiles, whose transposed tile is copied into L1 first) and
give the candidates in row-major order (ascending flat index), as ``nonzero`` does. The lift pass runs twice over
blocks of rows: the first counts each block's candidates, the second writes them where the counts say. PageRank's
product reads the float32 matrix and sums in float64, where torch needs a float64 copy of it (a V × V allocation
every epoch). :mod:`attn_callbacks.metrics.tables`' torch code is the reference they are tested against, and the GPU
path.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from torch import Tensor

from attn_callbacks.base.numba_math import FASTMATH, threads

__all__ = ["lift_candidates", "one_way_candidates", "row_sums", "vector_matrix"]

_BLOCK = 16  # rows per block of the lift pass
_TILE = 64  # the one-way pass's tiles: a tile's transposed counts and values stay in L1
_ONE_WAY_BLOCK = 256  # the one-way pass's blocks: a partner block's support and float32 values (320 KB) stay in L2


@numba.njit(parallel=True, cache=True, nogil=True)
def _one_way(matrix, count, size, min_support, mask):  # pragma: no cover - compiled
    """``mask[a, b]`` for ``a, b < size``: ``C[a, b] >= min_support``, ``C[b, a] >= min_support`` and
    ``P[a, b] > P[b, a]`` (``matrix`` and ``count`` may be wider than ``size``: their rows' first cells), by blocks of
    ``_ONE_WAY_BLOCK`` × ``_ONE_WAY_BLOCK`` cells (of one tile in a smaller matrix), blocks split across threads. The
    partner block (rows and columns swapped) is first copied into local buffers row segment by row segment (read
    straight from memory, its columns are a row of the matrix apart: a few cache lines a row, which the hardware
    prefetcher does not follow); then each tile's partner is transposed into L1, so that the test itself runs along rows
    (row views: numba vectorises those loops, not ones indexing ``[a, b]``)."""
    block = _ONE_WAY_BLOCK if size > _ONE_WAY_BLOCK else _TILE  # one block would leave every thread but one idle
    blocks = (size + block - 1) // block
    for p in numba.prange(blocks * blocks):
        r0, c0 = (p // blocks) * block, (p % blocks) * block
        rows, cols = min(block, size - r0), min(block, size - c0)
        seen_p = np.empty((block, block), np.bool_)  # [b, a]: C[c0 + b, r0 + a] >= min_support
        mass_p = np.empty((block, block), matrix.dtype)  # [b, a]: P[c0 + b, r0 + a]
        for b in range(cols):
            count_row, mass_row = count[c0 + b, r0 : r0 + rows], matrix[c0 + b, r0 : r0 + rows]
            for a in range(rows):
                seen_p[b, a] = count_row[a] >= min_support
                mass_p[b, a] = mass_row[a]
        seen_t = np.empty((_TILE, _TILE), np.bool_)  # [a - i0, b - j0]: C[c0 + b, r0 + a] >= min_support
        mass_t = np.empty((_TILE, _TILE), matrix.dtype)  # [a - i0, b - j0]: P[c0 + b, r0 + a]
        for i0 in range(0, rows, _TILE):
            i1 = min(rows, i0 + _TILE)
            for j0 in range(0, cols, _TILE):
                j1 = min(cols, j0 + _TILE)
                for b in range(j0, j1):
                    seen_t[: i1 - i0, b - j0] = seen_p[b, i0:i1]
                    mass_t[: i1 - i0, b - j0] = mass_p[b, i0:i1]
                for a in range(i0, i1):
                    out = mask[r0 + a, c0 + j0 : c0 + j1]
                    count_row, mass_row = count[r0 + a, c0 + j0 : c0 + j1], matrix[r0 + a, c0 + j0 : c0 + j1]
                    seen_back, mass_back = seen_t[a - i0], mass_t[a - i0]
                    for b in range(j1 - j0):
                        out[b] = (count_row[b] >= min_support) & seen_back[b] & (mass_row[b] > mass_back[b])


@numba.njit(parallel=True, cache=True, nogil=True)
def _lift(mass, weights, uniform, count, shape, min_support, starts, out, values):  # pragma: no cover - compiled
    """The cells ``a, b`` of the first ``shape`` rows and columns with ``C >= min_support`` whose lift ``S / U``
    (``S[a, b] = weights[a] P[a, b]``, 0 where ``U = 0``, in the dtype of ``P``) is finite, as flat indices into
    ``out`` (from ``starts[block]``) and their lifts into ``values``; with an empty ``out``, only how many each block
    of rows has, into ``starts[block + 1]``. The matrices may be wider than ``shape``: their rows' first cells."""
    rows, cols = shape
    blocks = (rows + _BLOCK - 1) // _BLOCK
    fill = out.shape[0] > 0
    for block in numba.prange(blocks):
        n = starts[block] if fill else 0
        for a in range(block * _BLOCK, min(rows, (block + 1) * _BLOCK)):
            # row views: see _one_way
            count_row, mass_row, uniform_row = count[a, :cols], mass[a, :cols], uniform[a, :cols]
            weight = weights[a]
            for b in range(cols):
                if count_row[b] >= min_support:
                    u = uniform_row[b]
                    value = weight * mass_row[b] / u if u != 0 else 0.0
                    if np.isfinite(value):
                        if fill:
                            out[n] = a * cols + b
                            values[n] = value
                        n += 1
        if not fill:
            starts[block + 1] = n


def one_way_candidates(matrix: Tensor, pair_count: Tensor, min_support: int) -> tuple[Tensor, Tensor]:
    """The candidate cells of :func:`attn_callbacks.metrics.tables.one_way_pairs` of a square CPU ``matrix`` (float32 or
    float64) and its int64 ``pair_count``: ``(rows, cols)``, in row-major order."""
    size = matrix.shape[0]
    if matrix.shape != (size, size) or pair_count.shape != (size, size):
        raise ValueError(
            f"Expected square matrices of one shape, got {tuple(matrix.shape)} and {tuple(pair_count.shape)}"
        )
    mask = np.empty((size, size), dtype=np.bool_)
    _one_way(_full_rows(matrix), _full_rows(pair_count.to(torch.int64)), size, min_support, mask)
    return torch.from_numpy(mask).nonzero().unbind(dim=1)


def _full_rows(matrix: Tensor) -> np.ndarray:
    """A C-contiguous array whose rows start with the rows of ``matrix (R, C)``: ``matrix`` itself, or for a slice of
    a larger row-major matrix (the tables' ``[:V - 1, :V - 1]``), the parent's rows read in place; numba compiles
    loops over a strided slice without vectorising them (1.7x slower here). A copy for any other layout."""
    rows, cols = matrix.shape
    width = matrix.stride(0)
    held = matrix.untyped_storage().nbytes() // matrix.element_size() - matrix.storage_offset()
    if not matrix.is_contiguous() and matrix.stride(1) == 1 and width >= cols and rows * width <= held:
        matrix = matrix.as_strided((rows, width), (width, 1))
    return np.ascontiguousarray(matrix.detach().numpy())


def lift_candidates(
    mass: Tensor, query_count: Tensor, uniform: Tensor, pair_count: Tensor, min_support: int
) -> tuple[Tensor, Tensor]:
    """The candidate cells of the ``lift_pairs`` table, CPU ``(Vq, Vk)`` matrices: the flat indices (row-major order)
    of the cells seen ``min_support`` times whose lift ``S / U`` is finite, and those lifts (as
    :func:`attn_callbacks.metrics.summary.lift` computes them of ``S = Q[:, None] P`` in the dtype of ``P``, a product
    taken cell by cell here rather than a ``V × V`` matrix)."""
    if not mass.shape == uniform.shape == pair_count.shape or mass.dim() != 2 or query_count.shape != mass.shape[:1]:
        raise ValueError(
            f"Expected three (Vq, Vk) matrices and (Vq,) query counts, got {tuple(mass.shape)}, "
            f"{tuple(uniform.shape)}, {tuple(pair_count.shape)} and {tuple(query_count.shape)}"
        )
    m = _full_rows(mass)
    u, c = _full_rows(uniform.to(mass.dtype)), _full_rows(pair_count.to(torch.int64))
    weights = query_count.detach().to(mass.dtype).contiguous().numpy()
    counts = np.zeros((mass.shape[0] + _BLOCK - 1) // _BLOCK + 1, dtype=np.int64)
    shape = tuple(mass.shape)
    _lift(m, weights, u, c, shape, min_support, counts, np.empty(0, dtype=np.int64), np.empty(0, dtype=m.dtype))
    starts = np.cumsum(counts)  # each block's first output index; the total last
    out, values = np.empty(int(starts[-1]), dtype=np.int64), np.empty(int(starts[-1]), dtype=m.dtype)
    if out.size:
        _lift(m, weights, u, c, shape, min_support, starts, out, values)
    return torch.from_numpy(out), torch.from_numpy(values)


@numba.njit(parallel=True, cache=True, nogil=True, fastmath=FASTMATH)
def _vector_matrix(vector, matrix, partial):  # pragma: no cover - compiled
    """``partial[t] += Σ_a vector[a] · matrix[a, :]`` over thread ``t``'s block of rows (float64 sums; a row whose
    coefficient is 0 is skipped)."""
    rows = matrix.shape[0]
    threads = partial.shape[0]
    for t in numba.prange(threads):
        acc = partial[t]
        for a in range(t * rows // threads, (t + 1) * rows // threads):
            coefficient = vector[a]
            if coefficient != 0.0:
                row = matrix[a]
                for b in range(row.shape[0]):
                    acc[b] += coefficient * row[b]


def vector_matrix(vector: Tensor, matrix: Tensor) -> Tensor:
    """``vector @ matrix`` for a float64 CPU ``vector (V,)`` and a float32 or float64 ``matrix (V, W)`` without
    non-finite values: ``(W,)`` float64, each thread's block of rows summed apart and the blocks added in a fixed
    order (the same result whatever the scheduling)."""
    if vector.dim() != 1 or matrix.dim() != 2 or vector.shape[0] != matrix.shape[0]:
        raise ValueError(
            f"Expected a (V,) vector and a (V, W) matrix, got {tuple(vector.shape)} and {tuple(matrix.shape)}"
        )
    partial = np.zeros((threads(), matrix.shape[1]))
    _vector_matrix(vector.detach().to(torch.float64).numpy(), matrix.detach().numpy(), partial)
    return torch.from_numpy(partial.sum(axis=0))


@numba.njit(parallel=True, cache=True, nogil=True, fastmath=FASTMATH)
def _row_sums(matrix, out):  # pragma: no cover - compiled
    """``out[a] = Σ_b matrix[a, b]`` in float64, rows split across threads."""
    for a in numba.prange(matrix.shape[0]):
        row = matrix[a]
        total = 0.0
        for b in range(row.shape[0]):
            total += row[b]
        out[a] = total


def row_sums(matrix: Tensor) -> Tensor:
    """Every row's sum of a float32 or float64 CPU ``(V, W)`` matrix, summed in float64: ``(V,)`` (torch's
    ``sum(dim=1, dtype=torch.float64)`` of a float32 matrix converts every cell first, ~100x slower)."""
    out = np.empty(matrix.shape[0])
    _row_sums(matrix.detach().numpy(), out)
    return torch.from_numpy(out)
