"""The per-batch kernel: one batch of attention weights added to the packed running sums of one module.

Notation (see docs/reading.md): for one attention module with H heads, a query vocabulary of size Vq and a key
vocabulary of size Vk, ``S[h, a, b]`` (attention sum) adds the weights ``w[n, h, i, j]`` over valid query positions
``i`` holding ``a`` and valid key positions ``j`` holding ``b``; ``C[a, b]`` (pair count) counts those (query, key)
pairs and ``Q[a]`` (query count) the valid query positions holding ``a``. Rows are queries and columns keys, always.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from attn_callbacks.base.numba_loader import uses_numba
from attn_callbacks.base.tensor_ops import x_log_x

__all__ = [
    "POSITION_STATS",
    "accumulate_attention",
    "accumulate_attention_torch",
    "pair_index",
    "weights_plogp",
]

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
    position = _spread(len_q * len_k, cells, flat.device).view(len_q, len_k)  # (Lq, Lk)
    index = torch.where(query_valid[:, :, None] & key_valid[:, None, :], flat, position)
    # An id outside its vocabulary (unchecked with validate_args=False) must not land in another pair's cell (a key id
    # Vk would count as key 0 of the next query row): its pairs point past the last cell, which the scatter refuses.
    query_out = (query_ids < 0) | (query_ids >= query_vocab_size)  # (B, Lq)
    key_out = (key_ids < 0) | (key_ids >= key_vocab_size)  # (B, Lk)
    outside = (query_out & query_valid)[:, :, None] | (key_out & key_valid)[:, None, :]
    return index.masked_fill_(outside, cells)


def _spread(positions: int, cells: int, device: torch.device) -> Tensor:
    """``arange(positions) mod cells``: where the positions of ignored entries add their zeros, one cell each (a
    GPU's atomic adds aimed at one cell would queue)."""
    spread = torch.arange(positions, device=device)
    if positions > cells:
        spread %= max(cells, 1)
    return spread


# Bytes of weights the CPU path works on at a time: a chunk stays in cache between its passes. 8 MB measured 3-20 %
# faster per update than 1-2 MB on the reference workload and others (L3-sized, fewer calls); 64 MB slower.
_CPU_CHUNK_BYTES = 8 << 20


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
    hot_cell: int | None = None,
    compiled: bool = False,
) -> Tensor:
    """The fast path: add one batch to packed running sums, in place, without a host sync; deterministic on CPU.

    Computes ``S``, ``U``, ``C``, ``Q`` and the position sums (what the tests' float64 loop computes, up to
    rounding; a valid query row with a non-finite weight in any head, or with no positive weight at all, is dropped and
    counted), on a packed layout: ``sums[:H]`` is ``S`` and ``sums[H]`` is ``U``, each a flat ``Vq * Vk`` plane, so
    one index (from :func:`pair_index`, shared by every module reading the same streams) serves every head, ``U`` and
    ``C``; every plane is contiguous, so ``S`` can be divided into ``P`` where it lies.

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
        hot_cell: the flat index ``a * Vk + b`` of a cell that many pairs hit, such as ``(<other>, <other>)`` of
            tracked streams: off the CPU its pairs are summed apart (see :func:`accumulate_attention_torch`). The
            same sums.
        compiled: on the torch path, compute the batch's terms with ``torch.compile`` (see
            :mod:`attn_callbacks.sums.step_compiled`); eager where compiling fails. The same sums, up to rounding.

    Returns:
        A 0-dim int64 tensor: the number of valid query rows dropped for non-finite or all-zero weights.

    Raises:
        ValueError: ``pairs`` and ``key_ids`` both None; or on the numba path, an id out of range at a valid position
            (the torch path raises an IndexError from ``index_add_`` on the CPU and trips a device-side assert on a
            GPU, which leaves the CUDA context unusable; a key id just past ``Vk`` adds to the next row).
    """
    if pairs is None and key_ids is None:
        raise ValueError("accumulate_attention: give `pairs` or `key_ids`, but both were None")
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
            sums, pair_count, query_count, position_sums, weights, query_ids, key_ids, query_valid, key_valid
        )
    # On CPU, index_add_ adds one pair after another: a hot cell costs nothing there that summing it apart would save.
    hot_cell = None if weights.device.type == "cpu" else hot_cell
    if pairs is None:
        vocab_q = query_count.numel()
        pairs = pair_index(query_ids, key_ids, query_valid, key_valid, vocab_q, vocab_k)
    state = (sums, pair_count, query_count, position_sums)
    return accumulate_attention_torch(
        *state, weights, pairs, query_ids, query_valid, key_valid, hot_cell=hot_cell, compiled=compiled
    )


def _key_ids_from_pairs(pairs: Tensor, query_ids: Tensor, query_valid: Tensor, key_valid: Tensor, vocab_k: int):
    """Key ids back from a pair index: ``pairs[n, i, j] - a * Vk`` at a valid query row ``i`` (holding ``a``) of each
    sample; 0 in samples without one, whose keys pair with nothing."""
    first = query_valid.long().argmax(dim=1)  # (B,): the first valid query row (0 when there is none)
    rows = pairs.gather(1, first[:, None, None].expand(-1, 1, pairs.shape[2]))[:, 0]  # (B, Lk)
    ids = rows - query_ids.long().gather(1, first[:, None]) * vocab_k
    return torch.where(query_valid.any(dim=1)[:, None] & key_valid, ids, 0)


def accumulate_attention_torch(
    sums: Tensor,
    pair_count: Tensor,
    query_count: Tensor,
    position_sums: Tensor,
    weights: Tensor,
    pairs: Tensor,
    query_ids: Tensor,
    query_valid: Tensor,
    key_valid: Tensor,
    *,
    hot_cell: int | None = None,
    compiled: bool = False,
) -> Tensor:
    """The torch code of :func:`accumulate_attention` (same arguments, ``pairs`` required): the GPU path, the CPU path
    without numba, and the reference the numba kernel is tested against.

    On CPU the batch is processed a few samples at a time so that each chunk of weights stays in cache across its
    passes (the scatter, the row sums, ``Σ w log w``, the diagonals and the distance). On GPU the whole batch is one
    chunk, and the op count is what costs: a BERT-base batch's kernels take microseconds each, their launches from
    Python about as long, so every position statistic is a view or a reduction of the masked weights; ``compiled``
    hands those terms (:func:`batch_terms`) to ``torch.compile``, which fuses them, and scatters the result eagerly.

    A GPU's atomic adds aimed at one cell queue one behind another: with ``hot_cell``, the pairs of that cell are
    summed apart, one reduction per plane, and scatter 0 at their position's cell instead (on an H200, the scatter of a
    BERT-base step whose ids fold ~10 % of its pairs into ``(<other>, <other>)``: 0.44 ms, 0.32 ms with them apart).
    """
    batch, num_heads, len_q, len_k = weights.shape
    dtype = sums.dtype
    channels = sums.shape[0] - 1  # H, or 1 for the mean of the heads
    if channels not in (num_heads, 1):
        raise ValueError(f"Expected `sums` to have H + 1 = {num_heads + 1} or 2 rows, but got {sums.shape[0]}")
    flat = pairs.reshape(batch, len_q * len_k)
    hot = None
    if hot_cell is not None:  # pairs that add 0 may be among them, and add 0 here too
        hot = flat == hot_cell  # (B, Lq * Lk)
        flat = torch.where(hot, _spread(len_q * len_k, sums.shape[1], flat.device), flat)
    distance = _distance(len_q, len_k, weights.device, dtype)  # (Lq * Lk,)
    terms = None
    if compiled:
        from attn_callbacks.sums.step_compiled import batch_terms_compiled

        terms = batch_terms_compiled(weights, query_valid, key_valid, distance, hot, channels, dtype)
    if terms is not None:  # the whole batch as one chunk
        rows, kept, planes, part, hot_sums, skipped = terms
        chunks: Iterable[tuple[slice, Tensor, Tensor, Tensor | None]] = [(slice(0, batch), planes, part, hot_sums)]
    else:
        rows, kept, visible, num_visible, skipped = row_masks(weights, query_valid, key_valid, dtype)
        masks = (kept, visible, num_visible)
        chunks = _chunks(weights, masks, distance, channels, hot)
    # Dropped and ignored rows add 0 (ignored positions may hold any id: -100 for padding, say), at the id of their
    # position: spread, as pair_index spreads ignored pairs, not queued at one address on a GPU.
    spread = _spread(len_q, query_count.numel(), query_ids.device)  # (Lq,)
    query_count.index_add_(0, torch.where(rows, query_ids.long(), spread).reshape(-1), rows.reshape(-1).long())
    # Pairs of ignored positions point anywhere (see pair_index), and like the pairs of dropped rows, add 0 to C,
    # S and U.
    counted = kept
    if hot is not None:
        pair_count[hot_cell] += (hot.view_as(kept) & kept).sum()
        counted = kept & ~hot.view_as(kept)
    pair_count.index_add_(0, flat.reshape(-1), counted.reshape(-1).to(pair_count.dtype))
    for samples, planes, part, hot_sums in chunks:  # made one at a time
        position_sums += part.to(position_sums.dtype)
        if hot_sums is not None:
            sums[:, hot_cell] += hot_sums
        sums.index_add_(1, flat[samples].reshape(-1), planes)
    return skipped


def _chunks(
    weights: Tensor, masks: tuple[Tensor, Tensor, Tensor], distance: Tensor, channels: int, hot: Tensor | None
) -> Iterator[tuple[slice, Tensor, Tensor, Tensor | None]]:
    """:func:`chunk_planes` of a batch, a few samples at a time on CPU (so that each chunk of weights stays in cache
    across its passes), as ``(samples, planes, part, hot_sums)``; on GPU the whole batch is one chunk."""
    kept, visible, num_visible = masks
    batch, num_heads, len_q, len_k = weights.shape
    sample_bytes = (num_heads + 2) * len_q * len_k * num_visible.element_size()
    chunk = max(1, batch if weights.is_cuda else _CPU_CHUNK_BYTES // max(sample_bytes, 1))  # an empty batch: 1
    # Nothing to mask (no padding, no dropped row): known for free on CPU; asking a GPU would cost a sync.
    keep_all = weights.device.type == "cpu" and bool(kept.all())
    for start in range(0, batch, chunk):
        samples = slice(start, min(start + chunk, batch))
        yield (
            samples,
            *chunk_planes(
                weights[samples],
                None if keep_all else kept[samples],
                visible[samples],
                num_visible[samples],
                distance,
                channels,
                exact=weights.is_cuda,
                hot=None if hot is None else hot[samples],
            ),
        )


def batch_terms(
    weights: Tensor,
    query_valid: Tensor,
    key_valid: Tensor,
    distance: Tensor,
    hot: Tensor | None,
    channels: int,
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor]:
    """:func:`row_masks` and :func:`chunk_planes` of a whole batch, as one function for ``torch.compile`` (see
    :mod:`attn_callbacks.sums.step_compiled`): ``(rows, kept, planes, part, hot_sums, skipped)``."""
    rows, kept, visible, num_visible, skipped = row_masks(weights, query_valid, key_valid, dtype)
    planes, part, hot_sums = chunk_planes(weights, kept, visible, num_visible, distance, channels, exact=True, hot=hot)
    return rows, kept, planes, part, hot_sums, skipped


def row_masks(
    weights: Tensor, query_valid: Tensor, key_valid: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Which rows and pairs of a batch ``weights (B, H, Lq, Lk)`` count: ``(rows (B, Lq), kept (B, Lq, Lk), visible
    (B, Lq, Lk), num_visible (B, Lq), skipped ())``. A valid query row is kept unless some head's weight in it is not
    finite or no weight in it is positive (as ``dtype`` stores it), which ``skipped`` counts; ``kept`` pairs a kept
    row with a valid key, ``visible`` those of positive weight in some head, ``num_visible`` counts them (1 for a
    row with none: such a row adds nothing to ``U``, and ``log 1 = 0`` to the maximum entropy)."""
    finite = torch.isfinite(weights.sum(dim=-1)).all(dim=1)  # (B, Lq): a sum is finite iff every term is
    positive = weights.amax(dim=1).to(dtype) > 0  # (B, Lq, Lk): some head's weight, non-zero as stored in the sums
    usable = finite & positive.any(dim=-1)
    rows = query_valid & usable
    skipped = (query_valid & ~usable).sum()
    kept = rows[:, :, None] & key_valid[:, None, :]  # (B, Lq, Lk)
    visible = positive & kept
    num_visible = visible.sum(dim=-1, dtype=dtype).clamp_(min=1)  # (B, Lq)
    return rows, kept, visible, num_visible, skipped


def chunk_planes(
    weights: Tensor,
    kept: Tensor | None,
    visible: Tensor,
    num_visible: Tensor,
    distance: Tensor,
    channels: int,
    exact: bool,
    hot: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """What a chunk of samples adds to the sums, before the scatter: ``(planes (channels + 1, b * Lq * Lk), part
    (len(POSITION_STATS), H), hot_sums (channels + 1,) or None)``.

    ``planes`` holds the weights with ignored keys and dropped rows set to 0 (``kept`` False; None keeps every
    pair), per head or (``channels`` 1) their mean, then ``U = visible / num_visible``, channel-major so that one
    index scatters them all. ``part`` is the chunk's position sums (see :data:`POSITION_STATS`); with ``hot``
    ``(b, Lq * Lk)`` bool, the hot pairs' values are summed into ``hot_sums`` and zeroed in ``planes``.
    """
    batch, num_heads, len_q, len_k = weights.shape
    dtype = num_visible.dtype
    zero = weights.new_zeros((), dtype=dtype)
    if torch.compiler.is_compiling():  # functional, for inductor to fuse into few passes
        w = weights.to(dtype) if kept is None else torch.where(kept[:, None], weights.to(dtype), zero)
        w = w.transpose(0, 1)  # (H, b, Lq, Lk)
        u = visible / num_visible[:, :, None]  # (b, Lq, Lk): 1 / #visible
        source = torch.cat([w if channels == num_heads else w.mean(dim=0, keepdim=True), u[None]])
    else:
        # Channel-major (channels + 1, b, Lq, Lk): every head (or their mean) and U scatter with one index in one call.
        source = weights.new_empty(channels + 1, batch, len_q, len_k, dtype=dtype)
        w = (
            source[:num_heads]
            if channels == num_heads
            else weights.new_empty(num_heads, batch, len_q, len_k, dtype=dtype)
        )
        if kept is None:  # a plain copy into the channel-major layout, several times faster than the masked one
            w.transpose(0, 1).copy_(weights)
        else:  # torch.where, so that a NaN cannot leak in as NaN * 0
            torch.where(kept[:, None], weights.to(dtype), zero, out=w.transpose(0, 1))
        if channels != num_heads:
            torch.mean(w, dim=0, out=source[0])
        torch.div(visible, num_visible[:, :, None], out=source[channels])  # U: 1 / #visible
    # The sums over positions need the samples added only: one pass over w, then (H, Lq, Lk) work.
    summed = w.sum(dim=1)  # (H, Lq, Lk)
    # w is masked: its diagonals hold exactly the kept rows' weights on valid keys i, i - 1 and i + 1.
    part = torch.stack(
        [
            -weights_plogp(w, w.sum(dim=-1), exact=exact).sum(dim=(1, 2)),  # Σ p log p, p renormalised
            num_visible.log().sum().expand(num_heads),
            *(summed.diagonal(offset, -2, -1).sum(dim=-1) for offset in (0, -1, 1)),
            (summed.view(num_heads, -1) * distance).sum(dim=-1),  # Σ_ij w |i - j|
        ]
    )  # (len(POSITION_STATS), H)
    planes = source.view(channels + 1, -1)
    hot_sums = None
    if hot is not None:  # after the position sums, which read w: a view of these planes
        hot_part = hot.reshape(-1)  # (b * Lq * Lk,)
        hot_sums = torch.where(hot_part, planes, zero).sum(dim=1)
        planes.masked_fill_(hot_part, 0)
    return planes, part, hot_sums


# (len_q, len_k, device, dtype) -> |i - j| flattened: made once, as a normal tensor even under inference mode.
_DISTANCES: dict[tuple[int, int, torch.device, torch.dtype], Tensor] = {}
# Only vectors this small are kept (4 MB in float32), at most 4 of them: for long sequences the L² work dwarfs making
# one, and a process-long cache of them would hold hundreds of MB of device memory.
_DISTANCE_CACHE_ELEMENTS = 1 << 20


def _distance(len_q: int, len_k: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """``|i - j|`` for every (query, key) position pair, flattened to ``(Lq * Lk,)``: made once per batch shape, not
    once per module, up to :data:`_DISTANCE_CACHE_ELEMENTS` pairs."""
    key = (len_q, len_k, device, dtype)
    distance = _DISTANCES.get(key)
    if distance is None:
        with torch.inference_mode(False):
            positions = torch.arange(max(len_q, len_k), device=device)
            distance = (positions[:len_q, None] - positions[None, :len_k]).abs().to(dtype).reshape(-1)
        if len_q * len_k <= _DISTANCE_CACHE_ELEMENTS:
            if len(_DISTANCES) >= 4:  # a batch's shapes (self- and cross-attention); lengths that vary start afresh
                _DISTANCES.clear()
            _DISTANCES[key] = distance
    return distance


# Rows whose valid keys hold at least this much of the mass take the one-pass entropy formula on CPU.
_ONE_PASS_MIN_MASS = 0.5


def weights_plogp(w: Tensor, mass: Tensor, exact: bool) -> Tensor:
    """``Σ_j p log p`` per row of ``w (..., L)``, where ``p = w / mass`` (``mass`` the row sums, ``(...)``); 0 for an
    all-zero row.

    ``exact`` renormalises first (several element-wise passes; the GPU path). Otherwise one pass computes
    ``Σ w log w / s - log s`` (``log2``, which is vectorised on CPU where ``log`` is not, scaled by ``ln 2``), exact
    up to rounding when the row mass ``s`` is not small; the rare rows where ignored keys hold most of the mass are
    redone the exact way, so subnormal masses lose no precision.
    """
    if exact:  # no safe_divide: its overflow check would sync with the device on every batch
        return x_log_x(w / torch.where(mass > 0, mass, 1)[..., None]).clamp_(max=0)  # as below
    w_log_w = x_log_x(w)
    safe = torch.where(mass > 0, mass, 1)
    result = (w_log_w / safe - safe.log()).clamp_(max=0)  # rounding must not make an entropy negative
    small = ((mass > 0) & (mass < _ONE_PASS_MIN_MASS)).reshape(-1).nonzero()[:, 0]
    if small.numel():
        flat = result.reshape(-1)  # a view: 0-dim and n-dim results alike
        flat[small] = weights_plogp(w.reshape(-1, w.shape[-1])[small], mass.reshape(-1)[small], exact=True)
    return result
