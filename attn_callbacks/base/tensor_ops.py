"""Blockwise helpers for the epoch-end math over large ``(..., V, V)`` matrices.

A full-size temporary of a large vocabulary (hundreds of MB) is fresh memory that the kernel faults in page by page on
every pass, which costs several times the arithmetic; blocks of a few MB come back from the allocator's heap (and stay
in cache). On a GPU every helper here gives one block.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "BIAS_SPAN",
    "MASKED_AT",
    "ROW_BLOCK_BYTES",
    "attention_mass",
    "float_mask_allows",
    "mean_weight",
    "normalize_rows",
    "row_blocks",
    "row_plogp",
    "rows_per_block",
    "safe_divide",
    "square_tiles",
    "sum_by_blocks",
    "to_host_flat",
    "x_log_x",
]


#: A float attention mask masks every key of a row whose largest value is at or below this: -inf, a dtype's minimum,
#: -1e9, the -1e4 of float16-era code.
MASKED_AT = -1e4
#: In other rows it allows the keys within this much of the row's largest value: biases added to the scores (T5's
#: position bias, ALiBi) allow; -1e3, -1e4 + a bias, -1e9 below a 0 mask.
BIAS_SPAN = 1e3


def float_mask_allows(mask: Tensor) -> Tensor:
    """Where a float mask added to attention scores ``(..., Lk)`` allows the key: in a row whose largest value is above
    :data:`MASKED_AT`, the keys less than :data:`BIAS_SPAN` below it (NaN masks).

    Example:
        >>> float_mask_allows(torch.tensor([0.0, -3.5, -999.0, -1e3, -1e9, float("-inf")])).tolist()
        [True, True, True, False, False, False]
        >>> float_mask_allows(torch.full((3,), torch.finfo(torch.float32).min)).tolist()  # a row masked whole
        [False, False, False]
    """
    top = mask.amax(dim=-1, keepdim=True)
    return (top > MASKED_AT) & (mask > top - BIAS_SPAN)


def to_host_flat(tensors: Iterable[Tensor], dtype: torch.dtype) -> Tensor:
    """Every tensor flattened, in ``dtype``, one after another in one CPU tensor, moved from the device in one copy
    (a copy each would be a host sync each on a GPU); gathered on the first one's device (a module of a model split
    across devices may lie on another)."""
    tensors = list(tensors)
    device = tensors[0].device
    return torch.cat([tensor.detach().reshape(-1).to(device, dtype) for tensor in tensors]).cpu()


def x_log_x(x: Tensor) -> Tensor:
    """``Σ x log x`` over the last dimension (``0 log 0 = 0``) of ``x >= 0``: with ``log2`` (vectorised on CPU, where
    ``log`` is not) scaled by ``ln 2``; on a CUDA device ``xlogy``, two kernels where that takes four. Either way the
    log's argument is clamped to the smallest normal number: a negative ``x`` (a custom module's weight) gives
    ``x log tiny``, finite, not NaN."""
    tiny = torch.finfo(x.dtype).tiny
    if x.is_cuda:
        return torch.xlogy(x, x.clamp(min=tiny)).sum(dim=-1)
    return x.clamp(min=tiny).log2_().mul_(x).sum(dim=-1).mul_(math.log(2.0))


# Bytes of one block of rows on CPU.
ROW_BLOCK_BYTES = 4 << 20


def rows_per_block(matrix: Tensor) -> int:
    """How many rows (dim -2) of ``(..., R, C)``, across all leading indices, make about ``ROW_BLOCK_BYTES``; every
    row for a vector or a GPU tensor."""
    if matrix.dim() < 2 or matrix.is_cuda:
        return max(matrix.shape[-2] if matrix.dim() >= 2 else 1, 1)
    row_bytes = max(matrix.numel() // max(matrix.shape[-2], 1), 1) * matrix.element_size()
    return max(1, ROW_BLOCK_BYTES // row_bytes)


def row_blocks(matrix: Tensor) -> list[slice]:
    """Slices over the rows (dim -2) of ``(..., R, C)`` of :func:`rows_per_block` rows each; one slice for a vector,
    a small matrix or a GPU tensor."""
    rows, step = (matrix.shape[-2] if matrix.dim() >= 2 else 1), rows_per_block(matrix)
    if matrix.dim() < 2 or step >= rows:
        return [slice(None)]
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def square_tiles(matrix: Tensor) -> list[tuple[slice, slice]]:
    """Tiles ``(rows, cols)`` on or above the diagonal of square ``(..., V, V)``, each of about half
    ``ROW_BLOCK_BYTES`` across all leading indices; one tile for a small matrix or a GPU tensor. A transposed read
    of a tile stays in cache, where a transposed block of whole columns misses it on every element."""
    size = matrix.shape[-1]
    cell_bytes = max(matrix.numel() // max(size * size, 1), 1) * matrix.element_size()  # one cell of every head
    step = size if matrix.is_cuda else max(1, math.isqrt(ROW_BLOCK_BYTES // 2 // cell_bytes))
    if step >= size:
        return [(slice(None), slice(None))]
    starts = range(0, size, step)
    return [
        (slice(a, min(a + step, size)), slice(b, min(b + step, size))) for i, a in enumerate(starts) for b in starts[i:]
    ]


def sum_by_blocks(fn: Callable[[Any], Tensor], blocks: Iterable[Any], empty: Tensor) -> Tensor:
    """``Σ_blocks fn(block)``, the partial sums added in float64; ``empty`` (zeros of the result's shape) when there
    is no block."""
    total = empty.double()
    for block in blocks:
        total = total + fn(block).double()
    return total


def safe_divide(numerator: Tensor, denominator: Tensor, out: Tensor | None = None) -> Tensor:
    """``numerator / denominator`` with 0 wherever the denominator is 0 (broadcasting as usual).

    On CPU a denominator smaller than the numerator (broadcast) costs a check that its reciprocals are finite, then
    one multiplication pass; elsewhere the check would be a host sync, and the division runs instead (as fast where
    memory bandwidth is the limit). ``out``, a tensor of the result's shape and dtype, receives the result (a large
    result written into memory already in use skips the page faults of a fresh allocation)."""
    denominator = denominator.to(numerator.dtype) if numerator.is_floating_point() else denominator.double()
    if 0 < denominator.numel() < numerator.numel() and numerator.device.type == "cpu":
        # A broadcast denominator (row counts, say): zero-safe reciprocals of the few, then one multiplication pass
        # over the many, unless a reciprocal overflows (a subnormal denominator).
        reciprocal = torch.where(denominator == 0, 0.0, 1 / denominator)
        if bool(torch.isfinite(reciprocal).all()):
            return torch.mul(numerator, reciprocal, out=out)
    if (
        out is not None
        and out.shape == torch.broadcast_shapes(numerator.shape, denominator.shape)
        and out.dtype == torch.result_type(numerator, denominator)
    ):
        # x / 0 is inf or NaN, replaced where it lies: no second result of the full size. The zeros are found first:
        # out may be the denominator's own memory.
        zero = denominator == 0
        return torch.div(numerator, denominator, out=out).masked_fill_(zero, 0.0)
    # torch.where replaces x / 0: no temporary ones/zeros of the full size.
    quotient = torch.where(denominator == 0, 0.0, numerator / denominator)
    return quotient if out is None else out.copy_(quotient)


def normalize_rows(matrix: Tensor) -> Tensor:
    """Rows scaled to sum to 1 (zero rows stay zero). The same rows always give the same bits, so an epoch compared
    with itself has drift exactly 0."""
    return safe_divide(matrix, matrix.sum(dim=-1, keepdim=True))


def row_plogp(matrix: Tensor) -> Tensor:
    """``Σ_b p[a, b] log p[a, b]`` of every row renormalised to sum to 1 (``-`` the row's entropy), 0 for a zero row.

    Args:
        matrix: ``(..., Vq, Vk)`` non-negative.

    Returns:
        ``(..., Vq)``. Pass it to :func:`row_entropy`, :func:`js_divergence` or :func:`attention_drift` to reuse it.
    """
    blocks = row_blocks(matrix)
    if len(blocks) > 1:
        return torch.cat([row_plogp(matrix[..., rows, :]) for rows in blocks], dim=-1)
    return x_log_x(normalize_rows(matrix))


def attention_mass(attention_sum: Tensor, query_count: Tensor, out: Tensor | None = None) -> Tensor:
    """Attention mass ``P[..., a, b] = S[..., a, b] / Q[a]``, 0 for query tokens never seen.

    The share of one occurrence of query token ``a``'s attention that goes to key token ``b``. Rows sum to 1 over the
    key vocabulary (less the mass the model put on ignored key positions).

    Args:
        attention_sum: ``(..., Vq, Vk)`` attention sums (per head or head-averaged).
        query_count: ``(Vq,)`` query counts.
        out: optional ``(..., Vq, Vk)`` tensor of the sums' dtype to write ``P`` into (see :func:`safe_divide`).

    Returns:
        ``(..., Vq, Vk)`` tensor of the sums' dtype (``out`` when given).
    """
    return safe_divide(attention_sum, query_count[:, None], out=out)


def mean_weight(attention_sum: Tensor, pair_count: Tensor) -> Tensor:
    """Mean weight per co-occurrence ``M[..., a, b] = S[..., a, b] / C[a, b]``, 0 where ``C[a, b] = 0``.

    Unlike the attention mass it does not grow merely because ``b`` is frequent: it is the average weight a query
    ``a`` gives to one visible occurrence of ``b``.

    Args:
        attention_sum: ``(..., Vq, Vk)`` attention sums.
        pair_count: ``(Vq, Vk)`` pair counts.

    Returns:
        ``(..., Vq, Vk)`` tensor of the sums' dtype.
    """
    return safe_divide(attention_sum, pair_count)
