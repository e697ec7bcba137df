"""The per-batch kernel: one batch of attention weights added to the packed running sums of one module.

Notation (see docs/reading.md): for one attention module with H heads, a query vocabulary of size Vq and a key
vocabulary of size Vk, ``S[h, a, b]`` (attention sum) adds the weights ``w[n, h, i, j]`` over valid query positions
``i`` holding ``a`` and valid key positions ``j`` holding ``b``; ``C[a, b]`` (pair count) counts those (query, key)
pairs and ``Q[a]`` (query count) the valid query positions holding ``a``. Rows are queries and columns keys, always.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attn_callbacks.base.numba_loader import uses_numba
from attn_callbacks.sums.step_torch import accumulate_attention_torch, spread

__all__ = ["POSITION_STATS", "accumulate_attention", "pair_index"]

#: Rows of the ``position_sums`` state, each a per-head sum over valid query rows ``i`` (weights ``w`` restricted to
#: valid keys ``j``): the entropy of the row renormalised over the valid keys; its maximum ``log #visible keys``; mass
#: on ``j = i``, ``j = i - 1``, ``j = i + 1``; attention distance ``Σ_j w |i - j|``.
POSITION_STATS = ("entropy", "max_entropy", "self", "previous", "next", "distance")


def pair_index(
    query_ids: Tensor,
    key_ids: Tensor,
    query_valid: Tensor,
    key_valid: Tensor,
    query_vocab_size: int,
    key_vocab_size: int,
) -> Tensor:
    """Flat index ``a * Vk + b`` of the (query id, key id) pair at every (query, key) position pair.

    A pair holding an ignored query or key position points at the cell of its position in the sample, ``(i * Lk + j)
    mod (Vq * Vk)``: the torch path scatters it with the rest, and what it adds there is exactly 0 (its weights, count
    and baseline share are masked to 0). Spread so: on a GPU, atomic adds aimed at one cell queue (on an H200, the
    scatter of a BERT-base step with 20 % of its pairs ignored took 0.94 ms with them all at one cell, 0.35 ms
    spread). The index depends on the token ids only: compute it once per batch and share it between modules that
    read the same streams.

    Args:
        query_ids: ``(B, Lq)`` integer ids in ``[0, Vq)`` at valid positions (anything elsewhere).
        key_ids: ``(B, Lk)`` integer ids in ``[0, Vk)`` at valid positions.
        query_valid: ``(B, Lq)`` bool.
        key_valid: ``(B, Lk)`` bool.
        query_vocab_size: ``Vq``.
        key_vocab_size: ``Vk``.

    Returns:
        ``(B, Lq, Lk)`` int64 in ``[0, Vq * Vk)``; ``Vq * Vk`` (past the last cell, so that the scatter raises) for a
        pair whose valid query or key id is outside its vocabulary.

    Example:
        >>> ids, valid = torch.tensor([[1, 2]]), torch.tensor([[True, False]])
        >>> pair_index(ids, ids, valid, valid, 3, 3).tolist()
        [[[4, 1], [2, 3]]]
    """
    query_ids, key_ids = query_ids.long(), key_ids.long()
    flat = query_ids[:, :, None] * key_vocab_size + key_ids[:, None, :]  # (B, Lq, Lk)
    len_q, len_k = flat.shape[1:]
    cells = query_vocab_size * key_vocab_size
    position = spread(len_q * len_k, cells, flat.device).view(len_q, len_k)  # (Lq, Lk)
    index = torch.where(query_valid[:, :, None] & key_valid[:, None, :], flat, position)
    # An id outside its vocabulary (unchecked with validate_args=False) must not land in another pair's cell (a key id
    # Vk would count as key 0 of the next query row): its pairs point past the last cell, which the scatter refuses.
    query_out = (query_ids < 0) | (query_ids >= query_vocab_size)  # (B, Lq)
    key_out = (key_ids < 0) | (key_ids >= key_vocab_size)  # (B, Lk)
    outside = (query_out & query_valid)[:, :, None] | (key_out & key_valid)[:, None, :]
    return index.masked_fill_(outside, cells)


def accumulate_attention(
    sums: Tensor,
    pair_count: Tensor,
    query_count: Tensor,
    position_sums: Tensor,
    weights: Tensor,
    pairs: Tensor | None,
    query_ids: Tensor,
    query_valid: Tensor,
    key_valid: Tensor,
    *,
    key_ids: Tensor | None = None,
    allowed: Tensor | None = None,
    hot_cell: int | None = None,
    compiled: bool = False,
) -> Tensor:
    """The fast path: add one batch to packed running sums, in place, without a host sync; deterministic on CPU.

    Computes ``S``, ``U``, ``C``, ``Q`` and the position sums (what the tests' float64 loop computes, up to
    rounding; a valid query row with a non-finite weight in any head, with no positive weight at all, or whose
    ``allowed`` allows no key, is dropped and counted), on a packed layout: ``sums[:H]`` is ``S`` and ``sums[H]`` is
    ``U``, each a flat ``Vq * Vk`` plane, so one index (from :func:`pair_index`, shared by every module reading the
    same streams) serves every head, ``U`` and ``C``; every plane is contiguous, so ``S`` can be divided into ``P``
    where it lies.

    On CPU (see :func:`~attn_callbacks.base.numba_loader.uses_numba`) the numba kernel of
    :mod:`attn_callbacks.sums.step_numba` runs: one read of the weights, on ``min(numba, torch)`` threads. It reads
    the key ids, not the pair index: pass ``key_ids`` and ``pairs=None`` there (without ``key_ids`` it recovers them
    from ``pairs``). Elsewhere, or with numba switched off
    or missing, :func:`accumulate_attention_torch` runs, from ``pairs`` (computed from ``key_ids`` when None).

    Args:
        sums: ``(H + 1, Vq * Vk)`` float accumulator: ``S`` per head, then ``U``. With 2 rows it holds
            ``mean_h S[h]`` instead of every head (a head-averaged state, ``H`` times smaller).
        pair_count: ``(Vq * Vk,)`` integer accumulator ``C``.
        query_count: ``(Vq,)`` integer accumulator ``Q``.
        position_sums: ``(len(POSITION_STATS), H)`` float accumulator.
        weights: ``(B, H, Lq, Lk)`` per-head attention weights.
        pairs: ``(B, Lq, Lk)`` from :func:`pair_index`, or None with ``key_ids``.
        query_ids: ``(B, Lq)`` integer ids in ``[0, Vq)`` at valid positions.
        query_valid: ``(B, Lq)`` bool.
        key_valid: ``(B, Lk)`` bool.
        key_ids: ``(B, Lk)`` integer ids in ``[0, Vk)`` at valid positions, or None with ``pairs``.
        allowed: bool, broadcastable to ``(B, Lq, Lk)``: the keys each query may attend to by the attention's mask
            (True: may attend), or None. A valid key is *visible* (it counts in ``U`` and in the maximum entropy
            ``log n``) when allowed here or when some head gives it a positive weight: without ``allowed``, a key
            whose weight rounds to 0 in every head (a very sharp softmax) counts as masked. A row it allows no key in
            is dropped, as a fully masked row.
        hot_cell: the flat index ``a * Vk + b`` of a cell that many pairs hit, such as ``(<other>, <other>)`` of
            tracked streams: off the CPU its pairs are summed apart (see :func:`accumulate_attention_torch`). The
            same sums.
        compiled: on the torch path, compute the batch's terms with ``torch.compile`` (see
            :mod:`attn_callbacks.sums.step_compiled`); eager where compiling fails. The same sums, up to rounding.

    Returns:
        A 0-dim int64 tensor: the number of valid query rows dropped (non-finite or all-zero weights, no key allowed).

    Raises:
        ValueError: ``pairs`` and ``key_ids`` both None; or on the numba path, an id out of range at a valid position
            (the torch path raises an IndexError from ``index_add_`` on the CPU and trips a device-side assert on a
            GPU, which leaves the CUDA context unusable; a key id just past ``Vk`` adds to the next row).
    """
    if pairs is None and key_ids is None:
        raise ValueError("accumulate_attention: give `pairs` or `key_ids`, but both were None")
    if allowed is not None:
        allowed = _allowed_view(allowed, weights)
    vocab_k = pair_count.numel() // max(query_count.numel(), 1)
    if (
        weights.numel() > 0  # an empty batch: nothing to gain, and the torch path's edge cases hold
        and sums.dtype in (torch.float32, torch.float64)
        and pair_count.dtype == query_count.dtype == torch.int64
        and all(t.device.type == "cpu" and t.is_contiguous() for t in (sums, pair_count, query_count))
        and uses_numba(weights.device)
    ):
        if key_ids is None:
            key_ids = _key_ids_from_pairs(pairs, query_ids, query_valid, key_valid, vocab_k)
        from attn_callbacks.sums.step_numba import accumulate_attention_numba

        return accumulate_attention_numba(
            sums, pair_count, query_count, position_sums, weights, query_ids, key_ids, query_valid, key_valid, allowed
        )
    # On CPU, index_add_ adds one pair after another: a hot cell costs nothing there that summing it apart would save.
    hot_cell = None if weights.device.type == "cpu" else hot_cell
    if pairs is None:
        vocab_q = query_count.numel()
        pairs = pair_index(query_ids, key_ids, query_valid, key_valid, vocab_q, vocab_k)
    state = (sums, pair_count, query_count, position_sums)
    return accumulate_attention_torch(
        *state, weights, pairs, query_ids, query_valid, key_valid, allowed=allowed, hot_cell=hot_cell, compiled=compiled
    )


def _key_ids_from_pairs(pairs: Tensor, query_ids: Tensor, query_valid: Tensor, key_valid: Tensor, vocab_k: int):
    """Key ids back from a pair index: ``pairs[n, i, j] - a * Vk`` at a valid query row ``i`` (holding ``a``) of each
    sample; 0 in samples without one, whose keys pair with nothing."""
    first = query_valid.long().argmax(dim=1)  # (B,): the first valid query row (0 when there is none)
    rows = pairs.gather(1, first[:, None, None].expand(-1, 1, pairs.shape[2]))[:, 0]  # (B, Lk)
    ids = rows - query_ids.long().gather(1, first[:, None]) * vocab_k
    return torch.where(query_valid.any(dim=1)[:, None] & key_valid, ids, 0)


def _allowed_view(allowed: Tensor, weights: Tensor) -> Tensor:
    """``allowed`` expanded to ``(B, Lq, Lk)`` of ``weights (B, H, Lq, Lk)`` (a view), or ``ValueError``."""
    shape = (weights.size(0), weights.size(2), weights.size(3))
    try:
        fits = allowed.dtype == torch.bool and torch.broadcast_shapes(allowed.shape, shape) == shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"Expected `allowed` to be a bool tensor broadcastable to (B, Lq, Lk) = {shape}, but got "
            f"{allowed.dtype} of shape {tuple(allowed.shape)}"
        )
    return allowed.to(weights.device).expand(shape)
