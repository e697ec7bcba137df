"""Pure tensor math: accumulating attention weights into vocabulary × vocabulary sums, and the epoch metrics.

Notation (see the glossary in the README): for one attention module with H heads, a query vocabulary of size Vq and a
key vocabulary of size Vk,

- ``S[h, a, b]`` (attention sum): sum of weights ``w[n, h, i, j]`` over valid query positions ``i`` holding ``a`` and
  valid key positions ``j`` holding ``b``;
- ``C[a, b]`` (pair count): number of valid (query ``i``, key ``j``) pairs holding ``(a, b)``;
- ``Q[a]`` (query count): number of valid query positions holding ``a``.

Rows are queries and columns are keys, always. Nothing here knows about Lightning or hooks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "POSITION_STATS",
    "accumulate_attention",
    "accumulate_attention_reference",
    "asymmetry_index",
    "attention_drift",
    "attention_mass",
    "in_degree",
    "js_divergence",
    "lift",
    "mean_lift",
    "mean_weight",
    "moved_tokens",
    "one_way_pairs",
    "pagerank",
    "pair_index",
    "pairwise_asymmetry",
    "position_statistics",
    "row_entropy",
    "row_plogp",
    "safe_divide",
    "sink_mass",
    "top_pairs",
    "top_tokens",
]

#: Rows of the ``position_sums`` state, each a per-head sum over valid query rows ``i`` (weights ``w`` restricted to
#: valid keys ``j``): the entropy of the row renormalised over the valid keys; its maximum ``log #visible keys``; mass
#: on ``j = i``, ``j = i - 1``, ``j = i + 1``; attention distance ``Σ_j w |i - j|``.
POSITION_STATS = ("entropy", "max_entropy", "self", "previous", "next", "distance")


def accumulate_attention_reference(
    attention_sum: Tensor,
    pair_count: Tensor,
    query_count: Tensor,
    weights: Tensor,
    query_ids: Tensor,
    key_ids: Tensor,
    query_valid: Tensor,
    key_valid: Tensor,
    *,
    uniform_sum: Tensor | None = None,
    position_sums: Tensor | None = None,
) -> Tensor:
    """The simple reference path: scatter-add one batch of attention weights into separate running sums, in place.

    :func:`accumulate_attention` computes the same sums faster (tests hold the two equal); this one is kept short and
    obvious so it can serve as the reference. ``S[h, a, b] += Σ w[n, h, i, j]``, ``C[a, b] += #(i, j)``,
    ``Q[a] += #i`` over valid query positions ``i`` holding ``a`` and valid key positions ``j`` holding ``b``.
    A query row that holds a non-finite weight in any head (a fully masked row is NaN), or no positive weight in any
    head (some attention code zeroes the rows of padded queries), is dropped as a whole and counted instead: it is no
    occurrence of its token's attention.

    Args:
        attention_sum: ``(H, Vq, Vk)`` floating accumulator, updated in place.
        pair_count: ``(Vq, Vk)`` accumulator, updated in place.
        query_count: ``(Vq,)`` accumulator, updated in place.
        weights: ``(B, H, Lq, Lk)`` per-head attention weights, rows over keys.
        query_ids: ``(B, Lq)`` integer token ids of the query positions.
        key_ids: ``(B, Lk)`` integer token ids of the key positions.
        query_valid: ``(B, Lq)`` bool, False for query positions to ignore (padding). Ids there may be anything.
        key_valid: ``(B, Lk)`` bool, False for key positions to ignore.
        uniform_sum: optional ``(Vq, Vk)`` floating accumulator of the uniform baseline
            ``U[a, b] += Σ 1 / #visible(i)`` over valid query positions ``i`` holding ``a`` and visible keys ``j``
            holding ``b``. A key is *visible* to a query when it is valid and at least one head gives it a non-zero
            weight: masked keys (padding, causal, any ``attn_mask``) get exactly 0 from the softmax.
        position_sums: optional ``(len(POSITION_STATS), H)`` floating accumulator of the position-level sums listed
            in :data:`POSITION_STATS`.

    Returns:
        A 0-dim int64 tensor on the weights' device: the number of valid query rows dropped for non-finite or
        all-zero weights.

    Example:
        >>> S, C, Q = torch.zeros(1, 3, 3), torch.zeros(3, 3, dtype=torch.long), torch.zeros(3, dtype=torch.long)
        >>> w = torch.tensor([[[[0.25, 0.75], [1.0, 0.0]]]])  # (B=1, H=1, Lq=2, Lk=2)
        >>> ids, valid = torch.tensor([[1, 2]]), torch.ones(1, 2, dtype=torch.bool)
        >>> int(accumulate_attention_reference(S, C, Q, w, ids, ids, valid, valid))
        0
        >>> S[0].tolist()
        [[0.0, 0.0, 0.0], [0.0, 0.25, 0.75], [0.0, 1.0, 0.0]]
    """
    num_heads, vocab_q, vocab_k = attention_sum.shape
    finite = torch.isfinite(weights).all(dim=-1).all(dim=1)  # (B, Lq): finite in every head
    weighted = (weights.to(attention_sum.dtype) > 0).any(dim=-1).any(dim=1)  # (B, Lq): some weight, as stored
    usable = finite & weighted
    rows = query_valid & usable
    skipped = (query_valid & ~usable).sum()

    pair_valid = rows[:, :, None] & key_valid[:, None, :]  # (B, Lq, Lk)
    # Ids at ignored positions may be out of range (pad = -100, say): point them at 0, their weight is zeroed anyway.
    q = torch.where(rows, query_ids, 0)
    k = torch.where(key_valid, key_ids, 0)
    flat_pair = (q[:, :, None] * vocab_k + k[:, None, :]).reshape(-1)  # (B*Lq*Lk,) index into a (Vq*Vk) plane

    # torch.where (not multiply) so a NaN in a dropped row cannot leak in as NaN * 0.
    masked = torch.where(pair_valid[:, None], weights, 0).to(attention_sum.dtype)  # (B, H, Lq, Lk)
    per_head = masked.transpose(0, 1).reshape(num_heads, -1)  # (H, B*Lq*Lk), same order as flat_pair
    attention_sum.view(num_heads, vocab_q * vocab_k).index_add_(1, flat_pair, per_head)
    pair_count.view(-1).index_add_(0, flat_pair, pair_valid.reshape(-1).to(pair_count.dtype))
    query_count.index_add_(0, q.reshape(-1), rows.reshape(-1).to(query_count.dtype))
    if uniform_sum is None and position_sums is None:
        return skipped

    visible = pair_valid & (masked > 0).any(dim=1)  # (B, Lq, Lk)
    num_visible = visible.sum(dim=-1, keepdim=True)  # (B, Lq, 1)
    if uniform_sum is not None:
        uniform = visible.to(uniform_sum.dtype) / num_visible.clamp(min=1)  # (B, Lq, Lk): 1 / #visible
        uniform_sum.view(-1).index_add_(0, flat_pair, uniform.reshape(-1).to(uniform_sum.dtype))
    if position_sums is not None:
        len_q, len_k = weights.shape[-2:]
        positions_q = torch.arange(len_q, device=weights.device)
        distance = (positions_q[:, None] - torch.arange(len_k, device=weights.device)[None, :]).abs()  # (Lq, Lk)
        max_entropy = torch.log(num_visible.clamp(min=1).to(masked.dtype)).sum()  # dropped rows have 0 visible
        # Entropy of the row renormalised over the valid keys, so H <= log #visible even when ignored keys got weight.
        renormalised = safe_divide(masked, masked.sum(dim=-1, keepdim=True))  # (B, H, Lq, Lk)
        row_entropy = -torch.special.xlogy(renormalised, renormalised).sum(dim=-1)  # (B, H, Lq)
        position_sums += torch.stack(
            [
                row_entropy.sum(dim=(0, 2)),
                max_entropy.expand(num_heads),
                masked.diagonal(0, -2, -1).sum(dim=(0, 2)),  # w[i, i]
                masked.diagonal(-1, -2, -1).sum(dim=(0, 2)),  # w[i, i - 1]
                masked.diagonal(1, -2, -1).sum(dim=(0, 2)),  # w[i, i + 1]
                (masked * distance).sum(dim=(0, 2, 3)),
            ]
        ).to(position_sums.dtype)
    return skipped


def pair_index(
    query_ids: Tensor,
    key_ids: Tensor,
    query_valid: Tensor,
    key_valid: Tensor,
    query_vocab_size: int,
    key_vocab_size: int,
) -> Tensor:
    """Flat index ``a * Vk + b`` of the (query id, key id) pair at every (query, key) position pair.

    Pairs holding an ignored query or key position point at the *discard cell* ``Vq * Vk``, one past the vocabulary
    plane, so the fast path scatters them without masking the weights first. The index depends on the token ids only:
    compute it once per batch and share it between modules that read the same streams.

    Args:
        query_ids: ``(B, Lq)`` integer ids in ``[0, Vq)`` at valid positions (anything elsewhere).
        key_ids: ``(B, Lk)`` integer ids in ``[0, Vk)`` at valid positions.
        query_valid: ``(B, Lq)`` bool.
        key_valid: ``(B, Lk)`` bool.
        query_vocab_size: ``Vq``.
        key_vocab_size: ``Vk``.

    Returns:
        ``(B, Lq, Lk)`` int64 in ``[0, Vq * Vk]``.

    Example:
        >>> ids, valid = torch.tensor([[1, 2]]), torch.tensor([[True, False]])
        >>> pair_index(ids, ids, valid, valid, 3, 3).tolist()
        [[[4, 9], [9, 9]]]
    """
    flat = query_ids.long()[:, :, None] * key_vocab_size + key_ids.long()[:, None, :]  # (B, Lq, Lk)
    return torch.where(query_valid[:, :, None] & key_valid[:, None, :], flat, query_vocab_size * key_vocab_size)


# Bytes of weights the CPU path works on at a time: a chunk stays in cache between its passes. 8 MB measured 3-20 %
# faster per update than 1-2 MB on the reference workload and others (L3-sized, fewer calls); 64 MB slower.
_CPU_CHUNK_BYTES = 8 << 20


def accumulate_attention(
    sums: Tensor,
    pair_count: Tensor,
    query_count: Tensor,
    position_sums: Tensor,
    weights: Tensor,
    pairs: Tensor,
    query_ids: Tensor,
    query_valid: Tensor,
    key_valid: Tensor,
) -> Tensor:
    """The fast path: add one batch to packed running sums, in place, without a host sync; deterministic on CPU.

    Computes exactly what :func:`accumulate_attention_reference` computes (``S``, ``U``, ``C``, ``Q`` and the position
    sums; a valid query row with a non-finite weight in any head, or with no positive weight at all, is dropped and
    counted), on a packed layout:

    - ``sums[:H]`` is ``S`` and ``sums[H]`` is ``U``, each a flat ``Vq * Vk`` plane plus the discard cell, so one
      index (from :func:`pair_index`, shared by every module reading the same streams) serves every head, ``U`` and
      ``C``, and ignored pairs need no masking pass;
    - on CPU the batch is processed a few samples at a time so that each chunk of weights stays in cache across its
      passes (the scatter, the row sums, ``Σ w log w`` and the distance); position sums are batched matrix-vector
      products rather than element-wise temporaries. On GPU the whole batch is one chunk.

    Args:
        sums: ``(H + 1, Vq * Vk + 1)`` float accumulator: ``S`` per head, then ``U``; the last column is discarded.
            With 2 rows it holds ``mean_h S[h]`` instead of every head (a head-averaged state, ``H`` times smaller).
        pair_count: ``(Vq * Vk + 1,)`` integer accumulator ``C`` plus the discard cell.
        query_count: ``(Vq + 1,)`` integer accumulator ``Q`` plus a discard cell.
        position_sums: ``(len(POSITION_STATS), H)`` float accumulator.
        weights: ``(B, H, Lq, Lk)`` per-head attention weights.
        pairs: ``(B, Lq, Lk)`` from :func:`pair_index`.
        query_ids: ``(B, Lq)`` integer ids in ``[0, Vq)`` at valid positions.
        query_valid: ``(B, Lq)`` bool.
        key_valid: ``(B, Lk)`` bool.

    Returns:
        A 0-dim int64 tensor: the number of valid query rows dropped for non-finite or all-zero weights.
    """
    batch, num_heads, len_q, len_k = weights.shape
    dtype = sums.dtype
    finite = torch.isfinite(weights.sum(dim=-1)).all(dim=1)  # (B, Lq): a sum is finite iff every term is
    positive = weights.amax(dim=1).to(dtype) > 0  # (B, Lq, Lk): some head's weight, non-zero as stored in the sums
    usable = finite & positive.any(dim=-1)
    rows = query_valid & usable
    skipped = (query_valid & ~usable).sum()
    query_count.index_add_(
        0, torch.where(rows, query_ids.long(), query_count.numel() - 1).reshape(-1), rows.reshape(-1).long()
    )
    kept = rows[:, :, None] & key_valid[:, None, :]  # (B, Lq, Lk)
    flat = pairs.reshape(batch, len_q * len_k)
    # Pairs of ignored positions already point at the discard cell; C must also skip the pairs of dropped rows.
    pair_count.index_add_(0, flat.reshape(-1), kept.reshape(-1).to(pair_count.dtype))

    visible = positive & kept  # (B, Lq, Lk)
    num_visible = visible.sum(dim=-1)  # (B, Lq)
    uniform = visible.to(dtype) / num_visible.clamp(min=1)[:, :, None].to(dtype)  # 1 / #visible on visible keys

    positions = torch.arange(len_q, device=weights.device)
    distance = (positions[:, None] - torch.arange(len_k, device=weights.device)[None, :]).abs().to(dtype)
    distance = distance.reshape(len_q * len_k, 1)
    row_plogp = weights.new_empty(num_heads, batch, len_q, dtype=dtype)  # Σ_j p log p, p = w renormalised
    row_distance = weights.new_empty(num_heads, batch, dtype=dtype)  # Σ_ij w |i - j| over valid keys
    sample_bytes = (num_heads + 2) * len_q * len_k * torch.finfo(dtype).bits // 8
    chunk = batch if weights.is_cuda else max(1, _CPU_CHUNK_BYTES // max(sample_bytes, 1))
    channels = sums.shape[0] - 1  # H, or 1 for the mean of the heads
    if channels not in (num_heads, 1):
        raise ValueError(f"Expected `sums` to have H + 1 = {num_heads + 1} or 2 rows, but got {sums.shape[0]}")
    zero = weights.new_zeros((), dtype=dtype)
    # Nothing to mask (no padding, no dropped row): known for free on CPU; asking a GPU would cost a sync.
    keep_all = weights.device.type == "cpu" and bool(kept.all())
    for start in range(0, batch, chunk):
        stop = min(start + chunk, batch)
        size = stop - start
        # Channel-major (channels + 1, b, Lq, Lk): every head (or their mean) and U scatter with one index in one call.
        source = weights.new_empty(channels + 1, size, len_q, len_k, dtype=dtype)
        w = (
            source[:num_heads]
            if channels == num_heads
            else weights.new_empty(num_heads, size, len_q, len_k, dtype=dtype)
        )
        if keep_all:  # a plain copy into the channel-major layout, several times faster than the masked one
            w.transpose(0, 1).copy_(weights[start:stop])
        else:  # ignored keys and dropped rows become 0 (torch.where, so a NaN cannot leak in as NaN * 0)
            torch.where(kept[start:stop, None], weights[start:stop].to(dtype), zero, out=w.transpose(0, 1))
        if channels != num_heads:
            torch.mean(w, dim=0, out=source[0])
        source[channels] = uniform[start:stop]
        sums.index_add_(1, flat[start:stop].reshape(-1), source.view(channels + 1, -1))
        row_plogp[:, start:stop] = _row_plogp(w, w.sum(dim=-1), exact=weights.is_cuda)
        row_distance[:, start:stop] = (w.view(num_heads * size, len_q * len_k) @ distance).view(num_heads, size)

    def diagonal(offset: int) -> Tensor:
        """Σ over kept rows i of w[i, i + offset] where key i + offset is valid, per head."""
        values = weights.diagonal(offset, -2, -1)  # (B, H, n)
        first_row = max(-offset, 0)
        count = values.shape[-1]
        keep = rows[:, first_row : first_row + count] & key_valid[:, first_row + offset : first_row + offset + count]
        return torch.where(keep[:, None, :], values, 0).to(dtype).sum(dim=(0, 2))

    max_entropy = torch.where(rows, num_visible.clamp(min=1).to(dtype).log(), 0).sum()
    position_sums += torch.stack(
        [
            -row_plogp.sum(dim=(1, 2)),
            max_entropy.expand(num_heads),
            diagonal(0),
            diagonal(-1),
            diagonal(1),
            row_distance.sum(dim=1),
        ]
    ).to(position_sums.dtype)
    return skipped


def _x_log_x(x: Tensor) -> Tensor:
    """``Σ x log x`` over the last dimension (``0 log 0 = 0``), with ``log2`` (vectorised on CPU, where ``log`` is
    not) scaled by ``ln 2``."""
    tiny = torch.finfo(x.dtype).tiny
    return x.clamp(min=tiny).log2_().mul_(x).sum(dim=-1).mul_(math.log(2.0))


# Rows whose valid keys hold at least this much of the mass take the one-pass entropy formula on CPU.
_ONE_PASS_MIN_MASS = 0.5


def _row_plogp(w: Tensor, mass: Tensor, exact: bool) -> Tensor:
    """``Σ_j p log p`` per row of ``w (..., L)``, where ``p = w / mass`` (``mass`` the row sums, ``(...)``); 0 for an
    all-zero row.

    ``exact`` renormalises first (several element-wise passes; the GPU path). Otherwise one pass computes
    ``Σ w log w / s - log s`` (``log2``, which is vectorised on CPU where ``log`` is not, scaled by ``ln 2``), exact
    up to rounding when the row mass ``s`` is not small; the rare rows where ignored keys hold most of the mass are
    redone the exact way, so subnormal masses lose no precision.
    """
    if exact:  # no safe_divide: its overflow check would sync with the device on every batch
        return _x_log_x(w / torch.where(mass > 0, mass, 1)[..., None])
    w_log_w = _x_log_x(w)
    safe = torch.where(mass > 0, mass, 1)
    result = (w_log_w / safe - safe.log()).clamp_(max=0)  # rounding must not make an entropy negative
    small = ((mass > 0) & (mass < _ONE_PASS_MIN_MASS)).reshape(-1).nonzero()[:, 0]
    if small.numel():
        flat = result.reshape(-1)  # a view: 0-dim and n-dim results alike
        flat[small] = _row_plogp(w.reshape(-1, w.shape[-1])[small], mass.reshape(-1)[small], exact=True)
    return result


# Epoch statistics of a large vocabulary run over blocks of rows on CPU. A full-size temporary (hundreds of MB) is
# fresh memory that the kernel faults in page by page on every pass, which costs several times the arithmetic;
# blocks of a few MB come back from the allocator's heap (and stay in cache). One block on GPU.
_ROW_BLOCK_BYTES = 4 << 20


def _rows_per_block(matrix: Tensor) -> int:
    """How many rows (dim -2) of ``(..., R, C)``, across all leading indices, make about ``_ROW_BLOCK_BYTES``; every
    row for a vector or a GPU tensor."""
    if matrix.dim() < 2 or matrix.is_cuda:
        return max(matrix.shape[-2] if matrix.dim() >= 2 else 1, 1)
    row_bytes = max(matrix.numel() // max(matrix.shape[-2], 1), 1) * matrix.element_size()
    return max(1, _ROW_BLOCK_BYTES // row_bytes)


def _row_blocks(matrix: Tensor) -> list[slice]:
    """Slices over the rows (dim -2) of ``(..., R, C)`` of :func:`_rows_per_block` rows each; one slice for a vector,
    a small matrix or a GPU tensor."""
    rows, step = (matrix.shape[-2] if matrix.dim() >= 2 else 1), _rows_per_block(matrix)
    if matrix.dim() < 2 or step >= rows:
        return [slice(None)]
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def _square_tiles(matrix: Tensor) -> list[tuple[slice, slice]]:
    """Tiles ``(rows, cols)`` on or above the diagonal of square ``(..., V, V)``, each of about half
    ``_ROW_BLOCK_BYTES`` across all leading indices; one tile for a small matrix or a GPU tensor. A transposed read
    of a tile stays in cache, where a transposed block of whole columns misses it on every element."""
    size = matrix.shape[-1]
    cell_bytes = max(matrix.numel() // max(size * size, 1), 1) * matrix.element_size()  # one cell of every head
    step = size if matrix.is_cuda else max(1, math.isqrt(_ROW_BLOCK_BYTES // 2 // cell_bytes))
    if step >= size:
        return [(slice(None), slice(None))]
    starts = range(0, size, step)
    return [
        (slice(a, min(a + step, size)), slice(b, min(b + step, size))) for i, a in enumerate(starts) for b in starts[i:]
    ]


def _sum_by_blocks(fn: Callable[[Any], Tensor], blocks: Iterable[Any], empty: Tensor) -> Tensor:
    """``Σ_blocks fn(block)``, the partial sums added in float64; ``empty`` (zeros of the result's shape) when there
    is no block."""
    total = empty.double()
    for block in blocks:
        total = total + fn(block).double()
    return total


def safe_divide(numerator: Tensor, denominator: Tensor, out: Tensor | None = None) -> Tensor:
    """``numerator / denominator`` with 0 wherever the denominator is 0 (broadcasting as usual).

    A denominator smaller than the numerator (broadcast) costs one host sync, to check its reciprocals are finite:
    for epoch-end statistics, not for per-batch updates. ``out``, a tensor of the result's shape and dtype, receives
    the result (a large result written into memory already in use skips the page faults of a fresh allocation)."""
    denominator = denominator.to(numerator.dtype) if numerator.is_floating_point() else denominator.double()
    if 0 < denominator.numel() < numerator.numel():
        # A broadcast denominator (row counts, say): zero-safe reciprocals of the few, then one multiplication pass
        # over the many, unless a reciprocal overflows (a subnormal denominator).
        reciprocal = torch.where(denominator == 0, 0.0, 1 / denominator)
        if bool(torch.isfinite(reciprocal).all()):
            return torch.mul(numerator, reciprocal, out=out)
    # x / 0 is inf or NaN here, and torch.where replaces it: no temporary ones/zeros of the full size.
    quotient = torch.where(denominator == 0, 0.0, numerator / denominator)
    return quotient if out is None else out.copy_(quotient)


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


def asymmetry_index(matrix: Tensor) -> Tensor:
    """Asymmetry index of square non-negative matrices: ``sqrt(1 - <P, Pᵀ> / <P, P>)``, in ``[0, 1]``.

    0 means ``P = Pᵀ`` (every pair attends both ways equally); 1 means no pair attends both ways (``<P, Pᵀ> = 0``, as
    for a strictly causal pattern). An all-zero matrix is symmetric: 0.

    Args:
        matrix: ``(..., V, V)``.

    Returns:
        ``(...)`` tensor.

    Example:
        >>> float(asymmetry_index(torch.tensor([[0.0, 1.0], [0.0, 1.0]])))  # <P,Pᵀ> = 1, <P,P> = 2
        0.7071067690849304
    """
    if matrix.shape[-1] != matrix.shape[-2]:
        raise ValueError(f"Expected a square matrix for the asymmetry index, but got shape {tuple(matrix.shape)}")

    def tile_sums(tile: tuple[slice, slice]) -> Tensor:  # <P, Pᵀ> and <P, P> over tiles (r, c) and (c, r), (2, ...)
        r, c = tile
        upper, lower = matrix[..., r, c], matrix[..., c, r]
        cross = (upper * lower.transpose(-1, -2)).sum(dim=(-1, -2))
        if r == c:  # a diagonal tile
            return torch.stack([cross, upper.square().sum(dim=(-1, -2))])
        # Tile (c, r) pairs the same cells the other way round: the same products.
        return torch.stack([2 * cross, upper.square().sum(dim=(-1, -2)) + lower.square().sum(dim=(-1, -2))])

    cross, norm = _sum_by_blocks(tile_sums, _square_tiles(matrix), matrix.new_zeros(2, *matrix.shape[:-2]))
    index = (1 - safe_divide(cross, norm)).clamp(min=0).sqrt() * (norm > 0)
    return index.to(matrix.dtype)


def pairwise_asymmetry(matrix: Tensor) -> Tensor:
    """Per-pair asymmetry ``A[a, b] = (P[a, b] - P[b, a]) / (P[a, b] + P[b, a])``, 0 where both are 0.

    In ``[-1, 1]`` for non-negative ``P``: +1 means ``a`` attends to ``b`` and never the other way round.

    Args:
        matrix: ``(..., V, V)`` square.

    Returns:
        ``(..., V, V)``, antisymmetric.
    """
    transposed = matrix.transpose(-1, -2)
    return safe_divide(matrix - transposed, matrix + transposed)


def one_way_pairs(matrix: Tensor, pair_count: Tensor, k: int, min_support: int = 1) -> list[tuple[int, int, float]]:
    """The ``k`` most one-way pairs ``(a, b)`` by ``A[a, b] = (P[a, b] - P[b, a]) / (P[a, b] + P[b, a])``.

    Only pairs seen both ways at least ``min_support`` times count (``C[a, b] >= min_support`` and
    ``C[b, a] >= min_support``), so a pair is not "one-way" merely because ``b`` never saw ``a``. Ties in ``A``
    (typically at 1) are broken by the larger ``P[a, b] - P[b, a]``.

    Args:
        matrix: ``(V, V)`` attention mass.
        pair_count: ``(V, V)`` pair counts.
        k: how many pairs to return.
        min_support: the minimum pair count in both directions.

    Returns:
        Up to ``k`` tuples ``(a, b, A[a, b])`` with ``A > 0``, most one-way first.
    """
    size = matrix.shape[-1]
    seen = pair_count >= min_support
    support = seen & seen.T  # a transposed read of bools, not of the int64 counts: several times faster on CPU
    # A > 0 iff P[a, b] > P[b, a]: only those cells are candidates, usually a small share of V².
    candidates = (support & (matrix > matrix.T)).reshape(-1).nonzero()[:, 0]  # ascending flat index
    forward = matrix.reshape(-1)[candidates]
    backward = matrix.T.reshape(-1)[candidates]
    gap = forward - backward
    score = gap / (forward + backward)
    score, candidates, gap = _at_least_kth(score, k, candidates, gap)
    # Two stable sorts = lexicographic order on (score, gap), both descending; then the smaller flat index.
    order = torch.sort(gap, descending=True, stable=True).indices
    order = order[torch.sort(score[order], descending=True, stable=True).indices][:k]
    chosen = zip(candidates[order].tolist(), score[order].tolist(), strict=True)
    return [(i // size, i % size, a) for i, a in chosen]


def _at_least_kth(score: Tensor, k: int, *others: Tensor) -> tuple[Tensor, ...]:
    """``(score, *others)`` kept where ``score`` is at least its ``k``-th largest value, in their order: the first
    ``k`` of a stable descending sort are among them, ties included, so sorting these few gives the same ``k`` as
    sorting all (millions of candidate pairs for a large vocabulary)."""
    if k < 0:
        raise ValueError(f"Expected argument `k` to be a non-negative integer, but got {k}")
    if score.numel() <= k:
        return score, *others
    if k == 0:
        return score[:0], *(other[:0] for other in others)
    threshold = torch.topk(score, k, sorted=False).values.min()
    if torch.isnan(threshold):  # NaN ranks above everything in a descending sort: keep all, sort them all
        return score, *others
    keep = score >= threshold
    return score[keep], *(other[keep] for other in others)


def row_plogp(matrix: Tensor) -> Tensor:
    """``Σ_b p[a, b] log p[a, b]`` of every row renormalised to sum to 1 (``-`` the row's entropy), 0 for a zero row.

    Args:
        matrix: ``(..., Vq, Vk)`` non-negative.

    Returns:
        ``(..., Vq)``. Pass it to :func:`row_entropy`, :func:`js_divergence` or :func:`attention_drift` to reuse it.
    """
    blocks = _row_blocks(matrix)
    if len(blocks) > 1:
        return torch.cat([row_plogp(matrix[..., rows, :]) for rows in blocks], dim=-1)
    return _x_log_x(_normalize_rows(matrix))


def _normalize_rows(matrix: Tensor) -> Tensor:
    """Rows scaled to sum to 1 (zero rows stay zero). The same rows always give the same bits, so an epoch compared
    with itself has drift exactly 0."""
    return safe_divide(matrix, matrix.sum(dim=-1, keepdim=True))


def row_entropy(matrix: Tensor, query_count: Tensor, plogp: Tensor | None = None) -> Tensor:
    """Mean row entropy in nats over the key vocabulary, weighted by query count.

    Each row ``P[a, :]`` is first renormalised to sum to 1, then ``H[a] = -Σ_b p[a, b] log p[a, b]``; the result is
    ``Σ_a Q[a] H[a] / Σ_a Q[a]``. 0 means every query token always attends to one key token; ``log Vk`` is uniform.

    Args:
        matrix: ``(..., Vq, Vk)`` attention mass or sums.
        query_count: ``(Vq,)`` query counts.
        plogp: :func:`row_plogp` of ``matrix`` when the caller has it already.

    Returns:
        ``(...)`` tensor.
    """
    entropy = -(row_plogp(matrix) if plogp is None else plogp)  # (..., Vq)
    weights = query_count.to(entropy.dtype)
    return safe_divide((entropy * weights).sum(dim=-1), weights.sum())


def top_tokens(counts: Tensor, k: int) -> Tensor:
    """Ids of the ``k`` most frequent tokens with a non-zero count, most frequent first (ties: smaller id first)."""
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[: min(k, int((counts > 0).sum()))]


def top_pairs(score: Tensor, pair_count: Tensor, k: int, min_support: int = 1) -> list[tuple[int, int, float]]:
    """The ``k`` pairs ``(a, b)`` with the largest ``score[a, b]`` among pairs seen ``C[a, b] >= min_support`` times.

    Args:
        score: ``(Vq, Vk)``, e.g. the lift.
        pair_count: ``(Vq, Vk)`` pair counts.
        k: how many pairs to return.
        min_support: the minimum pair count.

    Returns:
        Up to ``k`` tuples ``(a, b, score[a, b])``, largest first (ties: smaller flat index first).
    """
    candidates = (pair_count >= min_support).reshape(-1).nonzero()[:, 0]  # ascending flat index
    values = score.reshape(-1)[candidates]
    keep = torch.isfinite(values)
    values, candidates = _at_least_kth(values[keep], k, candidates[keep])
    order = torch.sort(values, descending=True, stable=True).indices[:k]
    size = score.shape[-1]
    chosen = zip(candidates[order].tolist(), values[order].tolist(), strict=True)
    return [(i // size, i % size, v) for i, v in chosen]


def lift(attention_sum: Tensor, uniform_sum: Tensor) -> Tensor:
    """Lift over the uniform baseline ``L[..., a, b] = S[..., a, b] / U[a, b]``, 0 where ``U[a, b] = 0``.

    ``U[a, b]`` is the mass that uniform attention over the same visible keys would have given (see
    :func:`accumulate_attention`), so ``L = 3`` reads "a attends to b three times more than chance". Because ``U``
    counts only visible keys, causal and padded models are compared fairly. Pass the head-averaged sum
    ``mean_h S[h]`` for the layer's lift, or ``S`` for per-head lifts (the baseline does not depend on the head).

    Args:
        attention_sum: ``(..., Vq, Vk)``.
        uniform_sum: ``(Vq, Vk)``.

    Returns:
        ``(..., Vq, Vk)``.

    Example:
        >>> lift(torch.tensor([[0.9, 0.1]]), torch.tensor([[0.5, 0.5]]))
        tensor([[1.8000, 0.2000]])
    """
    return safe_divide(attention_sum, uniform_sum)


def mean_lift(attention_sum: Tensor, uniform_sum: Tensor, plogp: Tensor | None = None) -> Tensor:
    """Attention-weighted geometric mean lift: ``exp(Σ_ab S[a, b] log(S[a, b] / U[a, b]) / Σ_ab S[a, b])``.

    "On average, attention lands on (query, key) token pairs this many times more than uniform attention over the
    visible keys would." 1 = no better than chance; it grows as attention concentrates on specific tokens. (Its log is
    the KL divergence, in nats, from the uniform baseline to the attention at the vocabulary level.) Cells with
    ``S = 0`` contribute nothing; 1 when ``S`` is all zero.

    Args:
        attention_sum: ``(..., Vq, Vk)`` (``mean_h S[h]`` for the layer, ``S`` per head).
        uniform_sum: ``(Vq, Vk)``.
        plogp: :func:`row_plogp` of ``attention_sum`` (or of ``P``: rows are renormalised) when the caller has it,
            ``(..., Vq)``: then no logarithm of the V × V sums is taken again.

    Returns:
        ``(...)``.

    Example:
        >>> float(mean_lift(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 0.5]])))  # all mass on 1 of 2 keys
        2.0
    """
    # Σ S log(S / U) = Σ S log S - Σ S log U: where S > 0, U > 0 too (attention only lands on visible keys), and
    # cells with S = 0 add 0 to both. log U is shared by every head: one matrix-vector product per head.
    tiny = torch.finfo(attention_sum.dtype).tiny
    # log2 then * ln 2, as in _x_log_x: log2 is vectorised on CPU where log is not.
    log_uniform = uniform_sum.to(attention_sum.dtype).clamp(min=tiny).log2().mul_(math.log(2.0)).reshape(-1)
    flat = attention_sum.reshape(-1, log_uniform.numel())  # (..., Vq * Vk) -> (prod(...), Vq * Vk)
    if plogp is None:
        s_log_s = _sum_by_blocks(
            lambda r: _x_log_x(attention_sum[..., r, :]).sum(dim=-1),
            _row_blocks(attention_sum),
            attention_sum.new_zeros(attention_sum.shape[:-2]),
        )
    else:
        if plogp.shape != attention_sum.shape[:-1]:
            raise ValueError(
                f"Expected argument `plogp` to have shape {tuple(attention_sum.shape[:-1])} (the rows of "
                f"`attention_sum`), but got {tuple(plogp.shape)}"
            )
        # Row a is r_a p_a with p_a summing to 1: Σ_b S log S = r_a (log r_a + Σ_b p log p).
        # A float32 row sum then float64: sum(dtype=float64) would first copy all of S to float64 (~40x slower).
        rows = attention_sum.sum(dim=-1).double()  # (..., Vq)
        s_log_s = (rows * (rows.clamp(min=torch.finfo(torch.float64).tiny).log() + plogp.double())).sum(dim=-1)
    exponent = safe_divide(s_log_s.reshape(-1) - (flat @ log_uniform).double(), flat.sum(dim=-1).double())
    return torch.exp(exponent.reshape(attention_sum.shape[:-2])).to(attention_sum.dtype)


def js_divergence(p: Tensor, q: Tensor, p_plogp: Tensor | None = None, q_plogp: Tensor | None = None) -> Tensor:
    """Jensen–Shannon divergence in nats between the rows of ``p`` and ``q``, each row renormalised to sum to 1.

    ``JS(p, q) = ½ KL(p ‖ m) + ½ KL(q ‖ m)`` with ``m = (p + q) / 2``; in ``[0, log 2]``. A row that is all zero is
    treated as equal to anything (0), so an unseen token does not count as drift.

    Args:
        p: ``(..., V)`` non-negative.
        q: ``(..., V)`` non-negative, same shape.
        p_plogp: :func:`row_plogp` of ``p`` when the caller has it (it is shared by every comparison of ``p``).
        q_plogp: :func:`row_plogp` of ``q`` likewise.

    Returns:
        ``(...)``.

    Example:
        >>> float(js_divergence(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])))  # disjoint: log 2
        0.6931471824645996
    """
    blocks = _row_blocks(p)
    if len(blocks) > 1:
        return torch.cat(
            [
                js_divergence(
                    p[..., rows, :],
                    q[..., rows, :],
                    None if p_plogp is None else p_plogp[..., rows],
                    None if q_plogp is None else q_plogp[..., rows],
                )
                for rows in blocks
            ],
            dim=-1,
        )
    p_mass, q_mass = p.sum(dim=-1, keepdim=True), q.sum(dim=-1, keepdim=True)
    # As _normalize_rows does, bit for bit (an epoch compared with itself must give exactly 0); new tensors, ours.
    p, q = safe_divide(p, p_mass), safe_divide(q, q_mass)
    p_plogp = _x_log_x(p) if p_plogp is None else p_plogp
    q_plogp = _x_log_x(q) if q_plogp is None else q_plogp
    # ½ KL(p‖m) + ½ KL(q‖m) = ½ (Σ p log p + Σ q log q) - Σ m log m, as Σ p log m + Σ q log m = 2 Σ m log m.
    js = (p_plogp + q_plogp) / 2 - _x_log_x(p.add_(q).mul_(0.5))
    both = (p_mass[..., 0] > 0) & (q_mass[..., 0] > 0)
    # Rounding of long float32 rows can leave [0, log 2] by a few ulps (disjoint rows gave 0.6931481).
    return torch.where(both, js, 0.0).clamp(min=0, max=math.log(2))


def _supported_rows(current_count: Tensor, reference_count: Tensor, min_support: int) -> Tensor:
    return (current_count >= min_support) & (reference_count >= min_support)


def attention_drift(
    current: Tensor,
    reference: Tensor,
    current_count: Tensor,
    reference_count: Tensor,
    min_support: int = 1,
    current_plogp: Tensor | None = None,
    reference_plogp: Tensor | None = None,
    row_divergence: bool = False,
) -> tuple[Tensor, ...]:
    """Drift of the attention mass between two epochs: weighted row Jensen–Shannon and relative Frobenius change.

    - ``js = Σ_a w[a] JS(P_t[a, :], P_s[a, :]) / Σ_a w[a]`` with ``w[a] = Q_t[a]`` for query tokens seen at least
      ``min_support`` times in both epochs (0 otherwise), in nats, ``[0, log 2]``;
    - ``frobenius = ‖P_t - P_s‖_F / ‖P_s‖_F`` over the whole matrix (0 when ``P_s = 0``).

    Args:
        current: ``P_t``, ``(..., Vq, Vk)``.
        reference: ``P_s``, same shape.
        current_count: ``Q_t``, ``(Vq,)``.
        reference_count: ``Q_s``, ``(Vq,)``.
        min_support: the minimum query count, in both epochs, for a row to count.
        current_plogp: :func:`row_plogp` of ``current`` when the caller has it, ``(..., Vq)``.
        reference_plogp: :func:`row_plogp` of ``reference`` likewise.
        row_divergence: also return every row's ``JS(P_t[a, :], P_s[a, :])``, ``(..., Vq)``, NaN for rows that do not
            count (what :func:`moved_tokens` ranks; computed on the way at no extra cost).

    Returns:
        ``(js, frobenius)``, each ``(...)``; ``(js, frobenius, rows)`` with ``row_divergence``.
    """
    supported = _supported_rows(current_count, reference_count, min_support)
    weights = torch.where(supported, current_count, 0).to(current.dtype)  # (Vq,): 0 for rows that do not count
    blocks, batch = _row_blocks(current), current.shape[:-2]
    pieces_js: list[Tensor] = []  # every row's JS, block by block, when asked for

    def js_block(index: Any) -> Tensor:  # Σ_a w[a] JS(P_t[a], P_s[a]) over these rows, (...)
        js_rows = js_divergence(
            current[..., index, :],
            reference[..., index, :].to(current.dtype),
            None if current_plogp is None else current_plogp[..., index],
            None if reference_plogp is None else reference_plogp[..., index].to(current.dtype),
        )
        if row_divergence:
            pieces_js.append(js_rows)
        return (js_rows * weights[index]).sum(dim=-1)

    def change_block(r: slice) -> Tensor:  # ‖P_t - P_s‖² and ‖P_s‖² over these rows, (2, ...)
        now, then = current[..., r, :], reference[..., r, :].to(current.dtype)
        # Norms are one pass each, with no squared temporary.
        return torch.stack([torch.linalg.vector_norm(x, dim=(-1, -2)).square() for x in (now - then, then)])

    rows_js = current.new_full((*batch, supported.numel()), float("nan")) if row_divergence else None
    if 2 * int(supported.sum()) >= supported.numel():  # most rows count: one pass, each block read in place once
        js_sum, change, norm = _sum_by_blocks(
            lambda r: torch.cat([js_block(r)[None], change_block(r)]), blocks, current.new_zeros(3, *batch)
        )
        if rows_js is not None:
            rows_js = torch.where(supported, torch.cat(pieces_js, dim=-1), rows_js)
    else:  # JS only where it has weight (often a small share of the vocabulary), gathered a block of rows at a time
        rows, step = supported.nonzero()[:, 0], _rows_per_block(current)
        pieces = [rows[start : start + step] for start in range(0, len(rows), step)]
        js_sum = _sum_by_blocks(js_block, pieces, current.new_zeros(batch))
        change, norm = _sum_by_blocks(change_block, blocks, current.new_zeros(2, *batch))
        if rows_js is not None and pieces_js:
            rows_js[..., rows] = torch.cat(pieces_js, dim=-1)
    js = safe_divide(js_sum, weights.sum().double())
    result = (js.to(current.dtype), safe_divide(change.sqrt(), norm.sqrt()).to(current.dtype))
    return result if rows_js is None else (*result, rows_js)


def moved_tokens(
    current: Tensor,
    reference: Tensor | None,
    current_count: Tensor,
    reference_count: Tensor,
    k: int,
    min_support: int = 1,
    row_divergence: Tensor | None = None,
) -> list[tuple[int, float]]:
    """The ``k`` query tokens whose attention row moved most, by ``JS(P_t[a, :], P_s[a, :])`` (nats).

    Only tokens seen at least ``min_support`` times in both epochs count.

    Args:
        current: ``P_t``, ``(Vq, Vk)``.
        reference: ``P_s``, ``(Vq, Vk)``; may be None when ``row_divergence`` is given (then it is not read).
        current_count: ``Q_t``, ``(Vq,)``.
        reference_count: ``Q_s``, ``(Vq,)``.
        k: how many tokens to return.
        min_support: minimum query count in both epochs.
        row_divergence: the rows' JS when the caller has it (``attention_drift(..., row_divergence=True)`` of the
            same arguments), ``(Vq,)``; then no row is compared again.

    Returns:
        Up to ``k`` tuples ``(a, JS)``, largest first (ties: smaller id first).
    """
    supported = _supported_rows(current_count, reference_count, min_support)
    score = torch.full(current_count.shape, float("-inf"), dtype=current.dtype, device=current.device)
    if row_divergence is None:
        if reference is None:
            raise ValueError("moved_tokens: argument `reference` may be None only when `row_divergence` is given")
        rows = supported.nonzero()[:, 0]
        score[rows] = js_divergence(current[rows], reference[rows].to(current.dtype))
    else:
        score = torch.where(supported, row_divergence.to(current.dtype), score)
    order = torch.sort(score, descending=True, stable=True).indices
    order = order[torch.isfinite(score[order])][:k]
    return [(int(a), float(score[a])) for a in order.tolist()]


def position_statistics(position_sums: Tensor, query_count: Tensor) -> dict[str, Tensor]:
    """Per-head position-level statistics from the ``position_sums`` state, averaged over query rows.

    With ``R = Σ_a Q[a]`` valid query rows and the per-head sums of :data:`POSITION_STATS`:

    - ``entropy = Σ_i H_i / R``, the mean row entropy in nats, ``H_i = -Σ_j p_ij log p_ij`` with
      ``p_ij = w_ij / Σ_j' w_ij'`` over the valid keys (the row as the model computed it when no attended key is
      ignored);
    - ``entropy_normalized = Σ_i H_i / Σ_i log n_i`` with ``n_i`` the visible keys of row ``i``: 1 = uniform over
      what the query could see, 0 = one key only (rows with one visible key add 0 to both sums);
    - ``self``, ``previous``, ``next``: mean mass on key position ``j = i``, ``i - 1``, ``i + 1``;
    - ``distance = Σ_i Σ_j w_ij |i - j| / R``, the mean attention distance in positions.

    Args:
        position_sums: ``(len(POSITION_STATS), H)``.
        query_count: ``(Vq,)``.

    Returns:
        name -> ``(H,)`` tensor.
    """
    rows = query_count.sum().to(position_sums.dtype)
    stats = dict(zip(POSITION_STATS, position_sums, strict=True))
    return {
        "entropy": safe_divide(stats["entropy"], rows),
        "entropy_normalized": safe_divide(stats["entropy"], stats["max_entropy"]),
        "self": safe_divide(stats["self"], rows),
        "previous": safe_divide(stats["previous"], rows),
        "next": safe_divide(stats["next"], rows),
        "distance": safe_divide(stats["distance"], rows),
    }


def sink_mass(attention_sum: Tensor, query_count: Tensor, sink_ids: Tensor) -> Tensor:
    """Share of all attention that lands on the key tokens ``sink_ids``: ``Σ_a Σ_{b ∈ sinks} S[..., a, b] / Σ_a Q[a]``.

    1 means every query puts all its attention on special tokens ([CLS], [SEP], BOS ...).

    Args:
        attention_sum: ``(..., Vq, Vk)``.
        query_count: ``(Vq,)``.
        sink_ids: 1-D integer tensor of key-vocabulary ids.

    Returns:
        ``(...)``.
    """
    return safe_divide(attention_sum[..., sink_ids].sum(dim=(-1, -2)), query_count.sum())


def in_degree(attention_sum: Tensor, query_count: Tensor) -> Tensor:
    """Weighted in-degree of each key token: its share of all attention, ``Σ_a S[..., a, b] / Σ_a Q[a]``.

    Sums to 1 over the key vocabulary (less mass on ignored keys). A token with a large in-degree is an attention
    hub: many queries look at it.

    Args:
        attention_sum: ``(..., Vq, Vk)``.
        query_count: ``(Vq,)``.

    Returns:
        ``(..., Vk)``.
    """
    return safe_divide(attention_sum.sum(dim=-2), query_count.sum())


def pagerank(
    matrix: Tensor, damping: float = 0.85, tol: float = 1e-10, max_iter: int = 1000, start: Tensor | None = None
) -> Tensor:
    """PageRank of the directed graph whose edge ``a → b`` has weight ``P[a, b]`` (query ``a`` attends to key ``b``).

    The stationary distribution ``π = (1 - d) / V + d · π T`` of the random walk that follows attention with
    probability ``d`` (row-normalised ``T = P / P.sum(1)``; a token with no outgoing attention jumps uniformly) and
    restarts uniformly otherwise. Large ``π[b]``: attention flows to ``b`` from tokens that themselves receive much.
    Rows are normalised, so the sums ``S`` give the same ranks as ``P = S / Q``.

    Args:
        matrix: ``(V, V)`` non-negative.
        damping: ``d`` in ``[0, 1)``.
        tol: stop when the L1 change is below this.
        max_iter: iteration cap.
        start: ``(V,)`` first guess (the last epoch's ranks, say): only how fast the iteration gets there depends on
            it. Uniform when None.

    Returns:
        ``(V,)`` float64, sums to 1.

    Example:
        >>> pagerank(torch.tensor([[0.0, 1.0], [0.0, 1.0]]), damping=0.5).tolist()  # everyone looks at token 1
        [0.25, 0.75]
    """
    if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"Expected a square (V, V) matrix for PageRank, but got shape {tuple(matrix.shape)}")
    size = matrix.shape[-1]
    if not 0 <= damping < 1:
        raise ValueError(f"Expected argument `damping` to be in [0, 1), but got {damping!r}")
    if start is not None and (start.shape != (size,) or not bool(torch.isfinite(start).all()) or start.sum() <= 0):
        raise ValueError(f"Expected argument `start` to be {size} finite weights with a positive sum, got {start!r}")
    weights = matrix.double()
    out = weights.sum(dim=1)
    # π T = (π / out) @ P over the rows with outgoing attention, plus the mass of the others spread uniformly: the
    # (float64) matrix is read as it is, not normalised into a second V × V copy.
    inverse_out = torch.where(out > 0, 1 / torch.where(out > 0, out, 1), 0)
    if not bool(torch.isfinite(inverse_out).all()):  # a subnormal row sum: normalise by division instead
        weights, inverse_out = safe_divide(weights, out[:, None]), (out > 0).double()
    dangling = (out == 0).double()  # (V,): a product, not a boolean index (a device sync per iteration on GPU)
    rank = torch.full((size,), 1.0 / size, dtype=torch.float64, device=matrix.device)
    if start is not None:
        rank = start.to(rank).clamp(min=0)
        rank = rank / rank.sum()
    for _ in range(max_iter):
        spread = (rank @ dangling) / size
        new = (1 - damping) / size + damping * ((rank * inverse_out) @ weights + spread)
        done = float((new - rank).abs().sum()) < tol
        rank = new
        if done:
            break
    return rank / rank.sum()
