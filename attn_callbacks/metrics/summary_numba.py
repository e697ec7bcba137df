"""Numba kernels for the epoch end on the CPU: every row statistic of one module's ``P`` in one parallel pass.

:func:`attn_callbacks.metrics.summary.summarize` calls these where numba runs (see
:func:`attn_callbacks.base.numba_loader.uses_numba`); the torch functions of :mod:`attn_callbacks.metrics.summary`
and :mod:`attn_callbacks.metrics.drift` are the reference they are tested against, and the GPU path. Per row ``a``
of every head and of the mean of the heads, one read of ``P[a, :]`` (and of the earlier epochs' rows) gives
``Σ p log p``, the lift's sums and both drift comparisons; logarithms are taken of non-zero cells only (a short
epoch's ``P`` is mostly zeros). The asymmetry needs ``P[b, a]`` beside ``P[a, b]``, so it is a second, tiled pass.
Row sums are float64; threads own whole rows (no two write one cell).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numba
import numpy as np
import torch
from torch import Tensor

from attn_callbacks.base.numba_math import FASTMATH, log, threads, xlogx
from attn_callbacks.base.tensor_ops import safe_divide
from attn_callbacks.metrics.drift import supported_rows

__all__ = ["RowPass", "cross_and_norm", "cross_and_norm_sums", "module_rows", "row_pass"]

# Rows of the per-thread accumulator of :func:`module_rows`, each a float64 sum per channel (heads, then the mean):
# the lift's Σ S, Σ S log S and Σ S log U; then per comparison k (0 previous, 1 reference) Σ_a w[a] JS[a],
# ‖P_t - P_s‖² and ‖P_s‖².
LIFT_S, LIFT_S_LOG_S, LIFT_S_LOG_U, DRIFT = 0, 1, 2, 3
NUM_STATS = 9


_TINY32 = float(np.finfo(np.float32).tiny)
_LOG2 = math.log(2.0)


@numba.njit(cache=True, nogil=True)
def _nonzero(flags, out):  # pragma: no cover - compiled
    """Indices of the true ``flags`` into ``out``; returns how many. Branch-free: sparse rows would mispredict a
    branch per cell."""
    n = 0
    for b in range(flags.shape[0]):
        out[n] = b
        n += flags[b]
    return n


@numba.njit(cache=True, nogil=True, fastmath=FASTMATH)
def _or_positive(row, flags):  # pragma: no cover - compiled
    """``flags |= row > 0``; returns the row's float32 sum, which is NaN or inf where the row holds one (float32 and
    fast-math reassociation: the loop vectorises, and these dense reads of every plane are most of the pass)."""
    total = np.float32(0.0)
    for b in range(row.shape[0]):
        flags[b] |= row[b] > 0
        total += row[b]
    return total


@numba.njit(cache=True, nogil=True, fastmath=FASTMATH)
def _row_stats(row, count, log_u, cells, n, plogp_out, c, a, acc, t, x):  # pragma: no cover - compiled
    """Σ p log p of one row (stored) over its possibly non-zero ``cells[:n]``, as Σ x log x / mass - log mass
    (float64: no cancellation worth the name; 0 for a zero row, never above 0), and the row's share of the lift's
    sums, with ``S[a, :] = Q[a] P[a, :]`` and ``log_u[i]`` the log of ``U`` at ``cells[i]``. Returns the row's mass
    and Σ p log p. ``x``: scratch, the row's values at its cells (gathered, so that the loop with the logarithms
    vectorises)."""
    for i in range(n):
        x[i] = max(np.float64(row[cells[i]]), 0.0)  # a negative value counts as 0, as nowhere
    mass = 0.0
    s_log_u = 0.0
    x_log_x = 0.0
    for i in range(n):
        mass += x[i]
        s_log_u += x[i] * log_u[i]
        x_log_x += xlogx(x[i])
    plogp = min(x_log_x / mass - math.log(mass), 0.0) if mass > 0.0 else 0.0
    plogp_out[c, a] = plogp
    if mass > 0.0 and count > 0:
        total = count * mass  # Σ_b S[a, b]
        acc[t, LIFT_S, c] += total
        # Row a of S is r p_a with p_a summing to 1: Σ_b S log S = r (log r + Σ_b p log p).
        acc[t, LIFT_S_LOG_S, c] += total * (math.log(total) + plogp)
        acc[t, LIFT_S_LOG_U, c] += count * s_log_u
    return mass, plogp


@numba.njit(cache=True, nogil=True, fastmath=FASTMATH)
def _compare_row(  # pragma: no cover - compiled
    row, mass, plogp, then, then_plogp, supported, weight, cells, n, k, c, acc, t, x, y
):
    """One row against the same row of an earlier epoch, over ``cells[:n]`` (every cell where either may be
    non-zero): its JS (returned, NaN when not supported) and its share of both Frobenius norms. ``then_plogp`` NaN:
    computed here (the mean of the heads, which snapshots do not keep). ``x``, ``y``: scratch for both rows' values
    at the cells."""
    for i in range(n):
        x[i] = row[cells[i]]
        y[i] = then[cells[i]]
    then_mass = 0.0
    change = 0.0
    norm = 0.0
    for i in range(n):
        d = x[i] - y[i]
        then_mass += y[i]
        change += d * d
        norm += y[i] * y[i]
    acc[t, DRIFT + 3 * k + 1, c] += change
    acc[t, DRIFT + 3 * k + 2, c] += norm
    if not supported:
        return np.nan
    if mass <= 0.0 or then_mass <= 0.0:
        return 0.0
    if change == 0.0 and mass == then_mass:
        return 0.0  # the same row: exactly no drift
    inv_p, inv_q = 1.0 / mass, 1.0 / then_mass
    m_log_m = 0.0
    for i in range(n):
        m = max(0.5 * (x[i] * inv_p + y[i] * inv_q), 0.0)  # m <= 0 adds nothing
        m_log_m += xlogx(m)
    if then_plogp != then_plogp:
        then_x_log_x = 0.0
        for i in range(n):
            then_x_log_x += xlogx(max(y[i], 0.0))
        then_plogp = min(then_x_log_x / then_mass - math.log(then_mass), 0.0)  # as _row_stats computes it
    # ½ KL(p‖m) + ½ KL(q‖m) = ½ (Σ p log p + Σ q log q) - Σ m log m, m = (p + q) / 2.
    js = min(max(0.5 * (plogp + then_plogp) - m_log_m, 0.0), _LOG2)
    acc[t, DRIFT + 3 * k, c] += weight * js
    return js


@numba.njit(parallel=True, cache=True, nogil=True)
def module_rows(
    mass,
    counts,
    uniform,
    mean_out,
    then_mass0,
    then_mass1,
    then_mean0,
    then_mean1,
    then_plogp,
    then_counts,
    compare,
    min_support,
    plogp_out,
    rows_js,
    acc,
    finite,
):  # pragma: no cover - compiled
    """Every row statistic of one module, rows split across ``acc.shape[0]`` threads.

    Args:
        mass: ``P`` per head, ``(H, Vq, Vk)`` float32.
        counts: ``Q``, ``(Vq,)`` int64.
        uniform: ``U``, ``(Vq, Vk)`` float32.
        mean_out: ``(Vq, Vk)`` float32, receives ``mean_h P`` (not written when ``H = 1``: the caller passes the
            head itself).
        then_mass0, then_mass1: ``(H, Vq, Vk)`` float32, the earlier epochs' ``P`` (only the first ``compare`` are
            read: pass any array of that type for the others).
        then_mean0, then_mean1: ``(Vq, Vk)`` float32, their ``mean_h P``.
        then_plogp: ``(2, H, Vq)`` float64, their ``Σ p log p`` per head and row.
        then_counts: ``(2, Vq)`` int64, their ``Q``.
        compare: how many earlier epochs to compare with, 0 to 2.
        min_support: the least query count, in both epochs, of a row whose JS counts.
        plogp_out: ``(H + 1, Vq)`` float64, receives ``Σ p log p`` of every row (heads, then the mean).
        rows_js: ``(2, H + 1, Vq)`` float64, receives every row's JS per comparison (NaN where not supported).
        acc: ``(threads, NUM_STATS, H + 1)`` float64 zeros, receives each thread's sums.
        finite: ``(threads,)`` bool, True; a thread that meets a non-finite ``P`` sets its own to False (and what it
            computes is not to be used).
    """
    heads, vocab_q, vocab_k = mass.shape
    threads = acc.shape[0]
    for t in numba.prange(threads):
        log_u = np.zeros(vocab_k)  # at the row's cells, in their order
        x = np.empty(vocab_k)  # scratch: a row's values at its cells
        y = np.empty(vocab_k)
        mean_row = np.zeros(vocab_k)
        support = np.empty(vocab_k, dtype=np.bool_)
        either = np.empty(vocab_k, dtype=np.bool_)
        cells = np.empty(vocab_k, dtype=np.int64)
        compared = np.empty((2, vocab_k), dtype=np.int64)
        n_compared = np.zeros(2, dtype=np.int64)
        for a in range(t, vocab_q, threads):
            count = counts[a]
            # The row's support: where U or some head is non-zero (from accumulate_attention, U's alone). Every
            # later loop of this row reads these cells only: a short epoch's rows are mostly zeros.
            for b in range(vocab_k):
                support[b] = uniform[a, b] > 0
            total = np.float32(0.0)
            for c in range(heads):
                total += _or_positive(mass[c, a], support)
            if not math.isfinite(total):  # NaN or inf in P: the caller takes the torch functions, which show them
                finite[t] = False
            n = _nonzero(support, cells)
            for k in range(compare):  # and where this row or the earlier epoch's may be non-zero
                either[:] = support
                then_mass = then_mass0 if k == 0 else then_mass1
                then_mean = then_mean0 if k == 0 else then_mean1
                _or_positive(then_mean[a], either)
                for c in range(heads):
                    _or_positive(then_mass[c, a], either)
                n_compared[k] = _nonzero(either, compared[k])
            for i in range(n):
                b = cells[i]
                log_u[i] = log(max(np.float64(uniform[a, b]), _TINY32))  # as the torch lift clamps U
                mean_row[b] = 0.0
            for c in range(heads + 1):
                if c < heads:
                    row = mass[c, a]
                    if heads > 1:
                        for i in range(n):
                            mean_row[cells[i]] += row[cells[i]]
                else:
                    if heads == 1:  # the mean is the head: copy its numbers
                        plogp_out[1, a] = plogp_out[0, a]
                        for k in range(compare):
                            rows_js[k, 1, a] = rows_js[k, 0, a]
                        continue
                    row = mean_out[a]
                    row[:] = 0.0
                    for i in range(n):
                        row[cells[i]] = np.float32(mean_row[cells[i]] / heads)
                row_mass, plogp = _row_stats(row, count, log_u, cells, n, plogp_out, c, a, acc, t, x)
                for k in range(compare):
                    then_count = then_counts[k, a]
                    supported = count >= min_support and then_count >= min_support
                    weight = np.float64(count) if supported else 0.0
                    if c < heads:
                        earlier = then_mass0[c, a] if k == 0 else then_mass1[c, a]
                        earlier_plogp = then_plogp[k, c, a]
                    else:
                        earlier = then_mean0[a] if k == 0 else then_mean1[a]
                        earlier_plogp = np.nan
                    rows_js[k, c, a] = _compare_row(
                        row,
                        row_mass,
                        plogp,
                        earlier,
                        earlier_plogp,
                        supported,
                        weight,
                        compared[k],
                        n_compared[k],
                        k,
                        c,
                        acc,
                        t,
                        x,
                        y,
                    )
    if heads == 1:  # the mean channel's sums are the head's
        acc[:, :, 1] = acc[:, :, 0]


_TILE = 64  # 64 × 64 float32 cells: a tile and its transpose stay in L1
_BLOCK = 256  # 256 × 256 float32 cells (256 KB): a block and its partner stay in L2


@numba.njit(cache=True, nogil=True, fastmath=FASTMATH)
def _block_pair(forth, partner, rows, cols, diagonal, back, acc, t, c):  # pragma: no cover - compiled
    """Add one block and its partner to ``acc[t, :, c]``: ``forth[a, b]`` (``rows × cols``) pairs with
    ``partner[b, a]`` (the partner block as the matrix holds it: rows and columns swapped); ``back`` receives each
    tile of the partner transposed. A diagonal block is its own partner: only its tiles on and above the diagonal are
    read (every pair once)."""
    tiles_r = (rows + _TILE - 1) // _TILE
    tiles_c = (cols + _TILE - 1) // _TILE
    for i in range(tiles_r):
        r0 = i * _TILE
        r1 = min(r0 + _TILE, rows)
        for j in range(i if diagonal else 0, tiles_c):
            c0 = j * _TILE
            c1 = min(c0 + _TILE, cols)
            for b in range(c0, c1):  # the partner tile, transposed into L1
                back[: r1 - r0, b - c0] = partner[b, r0:r1]
            norm = 0.0
            gap = 0.0
            for a in range(r0, r1):
                ahead, behind = forth[a, c0:c1], back[a - r0]  # row views: these loops vectorise
                for k in range(c1 - c0):
                    x = np.float64(ahead[k])
                    y = np.float64(behind[k])
                    norm += x * x + y * y
                    gap += (x - y) * (x - y)
            # 2 x y = x² + y² - (x - y)²: a symmetric P gives cross = norm exactly, whatever fast-math's order.
            if diagonal and i == j:  # the tile is its own partner: every cell met twice, every pair once each way
                acc[t, 0, c] += 0.5 * (norm - gap)
                acc[t, 1, c] += 0.5 * norm
            else:  # the partner tile pairs the same cells the other way round
                acc[t, 0, c] += norm - gap
                acc[t, 1, c] += norm


@numba.njit(parallel=True, cache=True, nogil=True, fastmath=FASTMATH)
def cross_and_norm(matrix, acc):  # pragma: no cover - compiled
    """``<P, Pᵀ>`` and ``<P, P>`` of every square ``(C, V, V)`` float32 matrix, block pairs split across
    ``acc.shape[0]`` threads; ``acc (threads, 2, C)`` float64 zeros receives each thread's sums.

    Each block (rows I, columns J) and its partner (rows J, columns I) are first copied, row segment by row segment,
    into local buffers: read straight from memory, the partner's columns are a row of the matrix apart, a few lines
    per row (3x slower at V = 2,048, where the hardware prefetcher does not follow). Within the blocks, each tile's
    partner is transposed into L1 (in place, cells a row apart would meet conflict misses for V near a multiple of
    1,024)."""
    channels, size, _ = matrix.shape
    block = _BLOCK if size > _BLOCK else _TILE  # one block would leave every thread but one idle
    blocks = (size + block - 1) // block
    first = np.empty(blocks * (blocks + 1) // 2, np.int64)  # the block pairs (I, J), I <= J
    second = np.empty_like(first)
    n = 0
    for i in range(blocks):
        for j in range(i, blocks):
            first[n], second[n] = i, j
            n += 1
    threads = acc.shape[0]
    for t in numba.prange(threads):
        forth = np.empty((block, block), np.float32)  # [a, b] = P[r0 + a, c0 + b]
        partner = np.empty((block, block), np.float32)  # [b, a] = P[c0 + b, r0 + a]
        back = np.empty((_TILE, _TILE), np.float32)
        for p in range(t, n, threads):
            r0, c0 = first[p] * block, second[p] * block
            rows, cols = min(block, size - r0), min(block, size - c0)
            for c in range(channels):
                m = matrix[c]
                for a in range(rows):
                    forth[a, :cols] = m[r0 + a, c0 : c0 + cols]
                for b in range(cols):
                    partner[b, :rows] = m[c0 + b, r0 : r0 + rows]
                _block_pair(forth, partner, rows, cols, r0 == c0, back, acc, t, c)


class RowPass(NamedTuple):
    """What :func:`row_pass` gives; index ``[-1]`` of a per-channel tensor is the mean of the heads."""

    mean_mass: Tensor  # mean_h P, (Vq, Vk)
    plogp: Tensor  # Σ p log p of every row, (H + 1, Vq)
    lift: Tensor  # mean lift, (H + 1,)
    js: Tensor  # weighted row JS per comparison, (compare, H + 1)
    frobenius: Tensor  # relative Frobenius change per comparison, (compare, H + 1)
    rows_js: Tensor  # every row's JS per comparison, (compare, H + 1, Vq), NaN where a row does not count


def _array(tensor: Tensor, dtype: torch.dtype) -> np.ndarray:
    """A C-contiguous numpy view of a CPU tensor; a copy only where the dtype or the layout needs one."""
    return np.ascontiguousarray(tensor.detach().to(dtype).numpy())


def row_pass(
    mass_heads: Tensor, query_count: Tensor, uniform_sum: Tensor, earlier: list, min_support: int
) -> RowPass | None:
    """:func:`module_rows` on CPU tensors: ``mass_heads (H, Vq, Vk)``, ``query_count (Vq,)``, ``uniform_sum
    (Vq, Vk)`` and up to two earlier epochs (:class:`~attn_callbacks.metrics.drift.Snapshot`) to compare with. None
    when ``P`` holds a non-finite value (the torch functions then give the NaN it deserves).

    The lift's sums are taken as ``S = Q P`` (what ``P`` is made of), so they need no read of ``S``.

    Raises:
        ValueError: when a shape does not match ``P``'s (the kernel reads without bounds checks).
    """
    heads, vocab_q, vocab_k = mass_heads.shape
    expected = {
        "query_count": ((vocab_q,), query_count.shape),
        "uniform_sum": ((vocab_q, vocab_k), uniform_sum.shape),
    }
    for k, then in enumerate(earlier):
        expected[f"earlier[{k}].attention_mass"] = ((heads, vocab_q, vocab_k), then.attention_mass.shape)
        expected[f"earlier[{k}].mean_mass"] = ((vocab_q, vocab_k), then.mean_mass.shape)
        expected[f"earlier[{k}].row_plogp"] = ((heads, vocab_q), then.row_plogp.shape)
        expected[f"earlier[{k}].query_count"] = ((vocab_q,), then.query_count.shape)
    for name, (want, got) in expected.items():
        if tuple(got) != want:
            raise ValueError(
                f"Expected `{name}` of shape {want} for P of shape {tuple(mass_heads.shape)}, got {tuple(got)}"
            )
    mass = _array(mass_heads, torch.float32)
    counts = _array(query_count, torch.int64)
    mean = mass[0] if heads == 1 else np.empty((vocab_q, vocab_k), dtype=np.float32)
    compare = len(earlier)
    then_mass = [_array(then.attention_mass, torch.float32) for then in earlier] or [mass]
    then_mean = [_array(then.mean_mass, torch.float32) for then in earlier] or [mean]
    then_plogp = np.zeros((2, heads, vocab_q))
    then_counts = np.zeros((2, vocab_q), dtype=np.int64)
    for k, then in enumerate(earlier):
        then_plogp[k] = _array(then.row_plogp, torch.float64)
        then_counts[k] = _array(then.query_count, torch.int64)
    plogp = np.zeros((heads + 1, vocab_q))
    rows_js = np.full((2, heads + 1, vocab_q), np.nan)
    acc = np.zeros((threads(), NUM_STATS, heads + 1))
    finite = np.ones(acc.shape[0], dtype=np.bool_)
    module_rows(
        mass,
        counts,
        _array(uniform_sum, torch.float32),
        mean,
        then_mass[0],
        then_mass[-1],
        then_mean[0],
        then_mean[-1],
        then_plogp,
        then_counts,
        compare,
        min_support,
        plogp,
        rows_js,
        acc,
        finite,
    )
    if not finite.all():
        return None
    sums = torch.from_numpy(acc.sum(axis=0))  # (NUM_STATS, H + 1)
    total = sums[LIFT_S]
    exponent = safe_divide(sums[LIFT_S_LOG_S] - sums[LIFT_S_LOG_U], total)  # as mean_lift's
    js, frobenius = [], []
    for k, then in enumerate(earlier):  # as attention_drift divides its sums
        supported = supported_rows(query_count, then.query_count.to(query_count.device), min_support)
        weights = torch.where(supported, query_count, 0).sum().double()
        change, norm = sums[DRIFT + 3 * k + 1], sums[DRIFT + 3 * k + 2]
        js.append(safe_divide(sums[DRIFT + 3 * k], weights))
        frobenius.append(safe_divide(change.sqrt(), norm.sqrt()))
    empty = torch.zeros(0, heads + 1, dtype=torch.float64)
    return RowPass(
        mean_mass=mass_heads[0] if heads == 1 else torch.from_numpy(mean),
        plogp=torch.from_numpy(plogp).float(),
        lift=exponent.exp().float(),
        js=(torch.stack(js) if js else empty).float(),
        frobenius=(torch.stack(frobenius) if frobenius else empty).float(),
        rows_js=torch.from_numpy(rows_js[:compare]).float(),
    )


def cross_and_norm_sums(matrices: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`cross_and_norm` of CPU ``(C, V, V)``: ``<P, Pᵀ>`` and ``<P, P>``, each ``(C,)`` float64 (see
    :func:`attn_callbacks.metrics.summary.asymmetry_from_sums`)."""
    acc = np.zeros((threads(), 2, matrices.shape[0]))
    cross_and_norm(_array(matrices, torch.float32), acc)
    cross, norm = torch.from_numpy(acc.sum(axis=0))
    return cross, norm
