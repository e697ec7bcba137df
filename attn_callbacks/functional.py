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

import torch
from torch import Tensor

__all__ = [
    "accumulate_attention",
    "asymmetry_index",
    "attention_mass",
    "mean_weight",
    "one_way_pairs",
    "pairwise_asymmetry",
    "row_entropy",
    "safe_divide",
    "top_tokens",
]


def accumulate_attention(
    attention_sum: Tensor,
    pair_count: Tensor,
    query_count: Tensor,
    weights: Tensor,
    query_ids: Tensor,
    key_ids: Tensor,
    query_valid: Tensor,
    key_valid: Tensor,
) -> Tensor:
    """Scatter-add one batch of attention weights into the running sums, in place, without a host sync.

    ``S[h, a, b] += Σ w[n, h, i, j]``, ``C[a, b] += #(i, j)``, ``Q[a] += #i`` over valid query positions ``i`` holding
    ``a`` and valid key positions ``j`` holding ``b``. A query row that holds a non-finite weight in any head (a fully
    masked row is NaN) is dropped as a whole and counted instead.

    Args:
        attention_sum: ``(H, Vq, Vk)`` floating accumulator, updated in place.
        pair_count: ``(Vq, Vk)`` accumulator, updated in place.
        query_count: ``(Vq,)`` accumulator, updated in place.
        weights: ``(B, H, Lq, Lk)`` per-head attention weights, rows over keys.
        query_ids: ``(B, Lq)`` integer token ids of the query positions.
        key_ids: ``(B, Lk)`` integer token ids of the key positions.
        query_valid: ``(B, Lq)`` bool, False for query positions to ignore (padding). Ids there may be anything.
        key_valid: ``(B, Lk)`` bool, False for key positions to ignore.

    Returns:
        A 0-dim int64 tensor on the weights' device: the number of valid query rows dropped for non-finite weights.

    Example:
        >>> S, C, Q = torch.zeros(1, 3, 3), torch.zeros(3, 3, dtype=torch.long), torch.zeros(3, dtype=torch.long)
        >>> w = torch.tensor([[[[0.25, 0.75], [1.0, 0.0]]]])  # (B=1, H=1, Lq=2, Lk=2)
        >>> ids, valid = torch.tensor([[1, 2]]), torch.ones(1, 2, dtype=torch.bool)
        >>> int(accumulate_attention(S, C, Q, w, ids, ids, valid, valid))
        0
        >>> S[0].tolist()
        [[0.0, 0.0, 0.0], [0.0, 0.25, 0.75], [0.0, 1.0, 0.0]]
    """
    num_heads, vocab_q, vocab_k = attention_sum.shape
    finite_rows = torch.isfinite(weights).all(dim=-1).all(dim=1)  # (B, Lq): finite in every head
    rows = query_valid & finite_rows
    skipped = (query_valid & ~finite_rows).sum()

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
    return skipped


def safe_divide(numerator: Tensor, denominator: Tensor) -> Tensor:
    """``numerator / denominator`` with 0 wherever the denominator is 0 (broadcasting as usual)."""
    denominator = denominator.to(numerator.dtype) if numerator.is_floating_point() else denominator.double()
    quotient = numerator / torch.where(denominator == 0, torch.ones_like(denominator), denominator)
    return torch.where(denominator == 0, torch.zeros_like(quotient), quotient)


def attention_mass(attention_sum: Tensor, query_count: Tensor) -> Tensor:
    """Attention mass ``P[..., a, b] = S[..., a, b] / Q[a]``, 0 for query tokens never seen.

    The share of one occurrence of query token ``a``'s attention that goes to key token ``b``. Rows sum to 1 over the
    key vocabulary (less the mass the model put on ignored key positions).

    Args:
        attention_sum: ``(..., Vq, Vk)`` attention sums (per head or head-averaged).
        query_count: ``(Vq,)`` query counts.

    Returns:
        ``(..., Vq, Vk)`` tensor of the sums' dtype.
    """
    return safe_divide(attention_sum, query_count[:, None])


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
    cross = (matrix * matrix.transpose(-1, -2)).sum(dim=(-1, -2))
    norm = (matrix * matrix).sum(dim=(-1, -2))
    return (1 - safe_divide(cross, norm)).clamp(min=0).sqrt() * (norm > 0)


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
    support = torch.minimum(pair_count, pair_count.T) >= min_support
    score = pairwise_asymmetry(matrix)
    gap = matrix - matrix.T
    eligible = (support & (score > 0)).reshape(-1)
    # Two stable sorts = lexicographic order on (score, gap), both descending.
    order = torch.sort(gap.reshape(-1), descending=True, stable=True).indices
    order = order[torch.sort(score.reshape(-1)[order], descending=True, stable=True).indices]
    order = order[eligible[order]][:k]
    size = matrix.shape[-1]
    flat_score = score.reshape(-1)
    return [(int(i) // size, int(i) % size, float(flat_score[i])) for i in order.tolist()]


def row_entropy(matrix: Tensor, query_count: Tensor) -> Tensor:
    """Mean row entropy in nats over the key vocabulary, weighted by query count.

    Each row ``P[a, :]`` is first renormalised to sum to 1, then ``H[a] = -Σ_b p[a, b] log p[a, b]``; the result is
    ``Σ_a Q[a] H[a] / Σ_a Q[a]``. 0 means every query token always attends to one key token; ``log Vk`` is uniform.

    Args:
        matrix: ``(..., Vq, Vk)`` attention mass or sums.
        query_count: ``(Vq,)`` query counts.

    Returns:
        ``(...)`` tensor.
    """
    rows = safe_divide(matrix, matrix.sum(dim=-1, keepdim=True))
    entropy = -torch.special.xlogy(rows, rows).sum(dim=-1)  # (..., Vq)
    weights = query_count.to(entropy.dtype)
    return safe_divide((entropy * weights).sum(dim=-1), weights.sum())


def top_tokens(counts: Tensor, k: int) -> Tensor:
    """Ids of the ``k`` most frequent tokens with a non-zero count, most frequent first (ties: smaller id first)."""
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[: min(k, int((counts > 0).sum()))]
