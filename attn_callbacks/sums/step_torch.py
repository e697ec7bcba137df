"""The torch code of the per-batch kernel (:func:`attn_callbacks.sums.step.accumulate_attention`): the GPU path, the
CPU path without numba, and the reference the numba kernel (:mod:`attn_callbacks.sums.step_numba`) is tested against.
Notation as in :mod:`attn_callbacks.sums.step`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from attn_callbacks.base.tensor_ops import x_log_x

__all__ = ["accumulate_attention_torch", "batch_terms", "chunk_planes", "row_masks", "spread", "weights_plogp"]


def spread(positions: int, cells: int, device: torch.device) -> Tensor:
    """``arange(positions) mod cells``: where the positions of ignored entries add their zeros, one cell each (a
    GPU's atomic adds aimed at one cell would queue)."""
    cell = torch.arange(positions, device=device)
    if positions > cells:
        cell %= max(cells, 1)
    return cell


# Bytes of weights the CPU path works on at a time: a chunk stays in cache between its passes. 8 MB measured 3-20 %
# faster per update than 1-2 MB on the reference workload and others (L3-sized, fewer calls); 64 MB slower.
_CPU_CHUNK_BYTES = 8 << 20


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
    allowed: Tensor | None = None,
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

    The batch's ``S`` and ``U`` are summed into zeroed memory of the sums' shape first, then added to the sums, one
    add per cell: a float32 cell that has summed many batches is large, and a weight added to it alone rounds away
    (pair by pair into the running sums, 200 batches of 16 × 512 Zipf ids over 64 tokens lost 12 % of a frequent
    pair's mass).
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
        flat = torch.where(hot, spread(len_q * len_k, sums.shape[1], flat.device), flat)
    distance = _distance(len_q, len_k, weights.device, dtype)  # (Lq * Lk,)
    terms = None
    if compiled:
        from attn_callbacks.sums.step_compiled import batch_terms_compiled

        terms = batch_terms_compiled(weights, query_valid, key_valid, distance, hot, channels, dtype, allowed)
    if terms is not None:  # the whole batch as one chunk
        rows, kept, planes, part, hot_sums, skipped = terms
        chunks: Iterable[tuple[slice, Tensor, Tensor, Tensor | None]] = [(slice(0, batch), planes, part, hot_sums)]
    else:
        rows, kept, visible, num_visible, skipped = row_masks(weights, query_valid, key_valid, dtype, allowed)
        masks = (kept, visible, num_visible)
        chunks = _chunks(weights, masks, distance, channels, hot)
    # Dropped and ignored rows add 0 (ignored positions may hold any id: -100 for padding, say), at the id of their
    # position: spread, as pair_index spreads ignored pairs, not queued at one address on a GPU.
    at_position = spread(len_q, query_count.numel(), query_ids.device)  # (Lq,)
    query_count.index_add_(0, torch.where(rows, query_ids.long(), at_position).reshape(-1), rows.reshape(-1).long())
    # Pairs of ignored positions point anywhere (see pair_index), and like the pairs of dropped rows, add 0 to C,
    # S and U.
    counted = kept
    if hot is not None:
        pair_count[hot_cell] += (hot.view_as(kept) & kept).sum()
        counted = kept & ~hot.view_as(kept)
    pair_count.index_add_(0, flat.reshape(-1), counted.reshape(-1).to(pair_count.dtype))
    batch_sums = torch.zeros_like(sums)
    for samples, planes, part, hot_sums in chunks:  # made one at a time
        position_sums += part.to(position_sums.dtype)
        if hot_sums is not None:
            batch_sums[:, hot_cell] += hot_sums
        batch_sums.index_add_(1, flat[samples].reshape(-1), planes)
    sums += batch_sums
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
    allowed: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor]:
    """:func:`row_masks` and :func:`chunk_planes` of a whole batch, as one function for ``torch.compile`` (see
    :mod:`attn_callbacks.sums.step_compiled`): ``(rows, kept, planes, part, hot_sums, skipped)``."""
    rows, kept, visible, num_visible, skipped = row_masks(weights, query_valid, key_valid, dtype, allowed)
    planes, part, hot_sums = chunk_planes(weights, kept, visible, num_visible, distance, channels, exact=True, hot=hot)
    return rows, kept, planes, part, hot_sums, skipped


def row_masks(
    weights: Tensor, query_valid: Tensor, key_valid: Tensor, dtype: torch.dtype, allowed: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Which rows and pairs of a batch ``weights (B, H, Lq, Lk)`` count: ``(rows (B, Lq), kept (B, Lq, Lk), visible
    (B, Lq, Lk), num_visible (B, Lq), skipped ())``. A valid query row is kept unless some head's weight in it is not
    finite, no weight in it is positive (as ``dtype`` stores it) or ``allowed`` allows no key in it, which ``skipped``
    counts; ``kept`` pairs a kept
    row with a valid key, ``visible`` those that ``allowed`` (the call's mask, broadcastable to ``(B, Lq, Lk)``, or
    None) allows or some head gives a positive weight, ``num_visible`` counts them (1 for a row with none: such a row
    adds nothing to ``U``, and ``log 1 = 0`` to the maximum entropy)."""
    finite = torch.isfinite(weights.sum(dim=-1)).all(dim=1)  # (B, Lq): a sum is finite iff every term is
    positive = weights.amax(dim=1).to(dtype) > 0  # (B, Lq, Lk): some head's weight, non-zero as stored in the sums
    usable = finite & positive.any(dim=-1)
    if allowed is not None:  # a row whose mask allows no key: Hugging Face eager's padding rows are uniform, not NaN
        usable &= allowed.any(dim=-1)
    rows = query_valid & usable
    skipped = (query_valid & ~usable).sum()
    kept = rows[:, :, None] & key_valid[:, None, :]  # (B, Lq, Lk)
    # A key the mask allows but whose weight rounded to 0 in every head (a sharp softmax) is still visible.
    visible = (positive if allowed is None else positive | allowed) & kept
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
