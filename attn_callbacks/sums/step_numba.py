"""The CPU fast path of :func:`attn_callbacks.sums.step.accumulate_attention`: one numba kernel per batch.

The torch path (:func:`attn_callbacks.sums.step_torch.accumulate_attention_torch`, the reference and the GPU path)
reads the weights several times (masking copy, scatter, row sums, ``Σ w log w``, distance) and scatters through a
``(B, Lq, Lk)`` pair index. This kernel reads each query row's ``H × Lk`` weights from memory once, in one vectorised
pass that decides whether the row is kept (finite, some positive weight) and sums what the position statistics need.
It computes the same sums as the torch path, on the same packed layout, in place. The rows go by query id: all the
batch's kept rows of one id add to one row of ``S``, ``U`` and ``C``, so they are summed per key id in float64 and
added to that row once, each key in the order of its id (the row of the sums swept upwards), as the torch path adds a
batch's sums once: a float32 cell that has summed many batches is large, and small additions to it would round away.

Threads split the work by query id, so no two threads ever write the same row of ``S``/``U``/``C`` or the same cell
of ``Q``: no atomics, and a result that does not depend on scheduling. Each batch's ids are dealt to the threads by
their number of rows, most first, each to the least loaded thread (``a % T`` would give one thread 61 % of the rows of
Zipf-distributed text on 2 threads: the most frequent id and ``<other>`` share a parity). Position sums go to
per-thread float64 partials, added up in a fixed order at the end.

Importing this module imports numba; :mod:`attn_callbacks.sums.step` does so lazily, on the first CPU batch.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch
from torch import Tensor

from attn_callbacks.base.numba_math import FASTMATH, TINY, threads, xlogx

_SMALL_MASS = 1e-250  # a row sum below which w log w may have met the clamp: float64 weights only

# An id with at most this many rows in a batch adds each row to the sums by itself; the rows of a more frequent id are
# summed first. A cell then takes a few additions per batch: U within ~1e-5 of its exact value after 1,500 batches
# (the torch path's one addition: ~1e-6), where summing every id's rows first cost 1.8x the kernel's time for ids
# drawn uniformly from 2,049.
_ROWS_ADDED_ALONE = 8

__all__ = ["accumulate_attention_numba"]


@numba.njit(cache=True, nogil=True)
def _first_bad_id(ids, valid, size):
    """Flat index of the first valid position whose id is outside ``[0, size)``, or -1."""
    flat_ids, flat_valid = ids.reshape(-1), valid.reshape(-1)
    for k in range(flat_ids.size):
        if flat_valid[k] and (flat_ids[k] < 0 or flat_ids[k] >= size):
            return k
    return -1


@numba.njit(cache=True, nogil=True)
def _deal_ids(query_ids, query_valid, size, threads):  # pragma: no cover - compiled
    """The thread of every query id, and its number of valid rows in the batch: ids by that number, most first, each
    to the thread with the fewest rows so far (ties: the lower thread). Deterministic for a batch."""
    rows = np.zeros(size, np.int64)
    for n in range(query_ids.shape[0]):
        for i in range(query_ids.shape[1]):
            if query_valid[n, i]:
                rows[query_ids[n, i]] += 1
    owner = np.zeros(size, np.int64)
    load = np.zeros(threads, np.int64)
    for a in np.argsort(-rows, kind="mergesort"):
        if rows[a] == 0:
            break
        t = np.argmin(load)
        owner[a] = t
        load[t] += rows[a]
    return owner, rows


@numba.njit(parallel=True, cache=True, nogil=True)
def _visiting_order(query_ids, query_valid, key_ids, key_valid, vocab_q):  # pragma: no cover - compiled
    """The order a batch is added in: its rows ``n * Lq + i`` by query id (invalid rows last), then sample and
    position (a counting sort); and per sample its valid key positions by id (``keys[n, :count[n]]``)."""
    batch, len_k = key_ids.shape
    flat_ids, flat_valid = query_ids.reshape(-1), query_valid.reshape(-1)
    start = np.zeros(vocab_q + 2, np.int64)  # start[a + 1]: rows of ids below a; vocab_q: the invalid rows
    for k in range(flat_ids.size):
        start[(flat_ids[k] if flat_valid[k] else vocab_q) + 1] += 1
    start = np.cumsum(start)
    rows = np.empty(flat_ids.size, np.int64)
    for k in range(flat_ids.size):
        a = flat_ids[k] if flat_valid[k] else vocab_q
        rows[start[a]] = k
        start[a] += 1
    keys = np.empty((batch, len_k), np.int64)
    count = np.zeros(batch, np.int64)
    for n in numba.prange(batch):
        for j in np.argsort(key_ids[n], kind="mergesort"):
            if key_valid[n, j]:
                keys[n, count[n]] = j
                count[n] += 1
    return rows, keys, count


@numba.njit(inline="always", fastmath=FASTMATH)
def _add_row(sums, pair_count, base, kid, keys, values, share, size):  # pragma: no cover - compiled
    """Add one kept row to row ``base`` of the sums: ``values`` per channel, U's ``share`` and the largest ``|w|``
    per key position, over its valid ``keys`` in id order; the positions of one key id are summed in float64 first (a
    frequent key added position by position to a large float32 cell would round part of each addition away)."""
    channels = sums.shape[0] - 1
    k = 0
    while k < keys.size:
        j = keys[k]
        end = k + 1
        while end < keys.size and kid[keys[end]] == kid[j]:
            end += 1
        cell = base + kid[j]
        pair_count[cell] += end - k
        if end == k + 1:  # one position, as it is: the loops below made the kernel 1.4x slower for uniform ids
            if share[j] > 0:
                sums[channels, cell] += share[j]
            if size[j] != 0:  # every head 0 at this key (causal): nothing to add
                for c in range(channels):
                    sums[c, cell] += values[c, j]
        else:
            unit, largest = 0.0, 0.0
            for m in range(k, end):
                unit += share[keys[m]]
                largest = max(largest, size[keys[m]])
            if unit > 0:
                sums[channels, cell] += unit
            if largest != 0:
                for c in range(channels):
                    total = 0.0
                    for m in range(k, end):
                        total += values[c, keys[m]]
                    sums[c, cell] += total
        k = end


@numba.njit(inline="always", fastmath=FASTMATH)
def _into_id_sums(kid, keys, rows, group, share, size, batch_sums, a, count):  # pragma: no cover - compiled
    """Add a group of ``rows`` rows of query id ``a`` in one sample, summed per key position, to the batch's sums of
    that id, per key id; ``count`` key ids touched so far, returned updated."""
    values, units, largest, pairs, stamp, touched = batch_sums
    for j in keys:
        b = kid[j]
        if stamp[b] != a:
            stamp[b] = a
            touched[count] = b
            count += 1
        pairs[b] += rows
        units[b] += share[j]
        largest[b] = max(largest[b], size[j])
        if size[j] != 0:
            for c in range(values.shape[0]):
                values[c, b] += group[c, j]
    return count


@numba.njit(inline="always", fastmath=FASTMATH)
def _add_id_sums(sums, pair_count, base, batch_sums, count):  # pragma: no cover - compiled
    """Add the batch's sums of one query id (its ``count`` touched key ids) to row ``base`` of the sums, each key in
    the order of its id (the row swept upwards), and zero them for the next id."""
    values, units, largest, pairs, _, touched = batch_sums
    channels = sums.shape[0] - 1
    touched[:count].sort()
    for b in touched[:count]:
        cell = base + b
        pair_count[cell] += pairs[b]
        if units[b] > 0:
            sums[channels, cell] += units[b]
        if largest[b] != 0:  # every head 0 at this key in every row (causal): nothing to add
            for c in range(channels):
                sums[c, cell] += values[c, b]
                values[c, b] = 0.0
        pairs[b], units[b], largest[b] = 0, 0.0, 0


@numba.njit(parallel=True, cache=True, nogil=True, fastmath=FASTMATH)
def _accumulate(
    weights, query_ids, key_ids, query_valid, key_valid, allowed, sums, pair_count, query_count, threads
):  # pragma: no cover - compiled
    """Add one batch in place; returns the position sums ``(6, H)`` float64 and the number of dropped rows.

    Shapes as in :func:`attn_callbacks.sums.step.accumulate_attention`; ids int64 and in range at valid positions;
    ``allowed`` ``(B, Lq, Lk)`` bool, or ``(0, 0, 0)`` when no mask is known (visible: a positive weight only).
    """
    masked = allowed.shape[0] > 0
    _, heads, len_q, len_k = weights.shape
    channels = sums.shape[0] - 1
    per_head = channels == heads
    key_vocab = sums.shape[1] // query_count.shape[0]
    owner, rows_of = _deal_ids(query_ids, query_valid, query_count.shape[0], threads)
    # The rows go by query id: all the batch's rows of one id add to one row of the sums, so they are summed per key
    # id in float64 and added to it once.
    rows, keys, key_count = _visiting_order(query_ids, query_valid, key_ids, key_valid, query_count.shape[0])
    flat_ids, flat_valid = query_ids.reshape(-1), query_valid.reshape(-1)
    # Per thread, in float64: Σ p log p, max entropy (column 0), self, previous, next, distance; and dropped rows.
    partial = np.zeros((threads, 6, heads))
    skipped = np.zeros(threads, np.int64)
    for t in numba.prange(threads):
        # The row as the sums hold it (their dtype: float64 weights may round to 0 or overflow in float32 sums, as
        # in the torch path), 0 at ignored keys: contiguous, and in L1.
        row = np.empty((heads, len_k), sums.dtype)
        top = np.empty(len_k, sums.dtype)  # max over heads per key (ignored keys too): visible when > 0 (or allowed)
        size = np.empty(len_k, sums.dtype)  # max over heads of |w| per key: nothing to add to S when 0 (causal)
        share = np.empty(len_k)  # the row's part of U per key: 1 / visible keys where visible
        mass = np.empty(heads)  # row sum over the valid keys, per head
        wlogw = np.empty(heads)  # Σ w log w over the valid keys, per head
        distance = np.empty(heads)  # Σ w |i - j| over the valid keys, per head
        mean = np.empty((1, len_k), sums.dtype)  # the mean of the heads per key, as the sums hold it
        total_of_heads = np.empty(len_k)  # their float64 sum, in head order
        # A frequent id's kept rows: summed per key position within a sample (in L1), then per key id over the
        # batch's samples, in float64, and added to the float32 sums once per batch. Added row by row, a large cell of
        # the sums rounds each small addition (3 % of a frequent pair's U lost over 1,500 batches).
        group = np.empty((channels, len_k))
        group_share = np.empty(len_k)
        group_size = np.empty(len_k, sums.dtype)  # the largest |w|: nothing to add to S when 0
        grouped = 0  # rows in the group
        batch_sums = (
            np.zeros((channels, key_vocab)),  # per key id: S per channel
            np.zeros(key_vocab),  # U
            np.zeros(key_vocab, sums.dtype),  # the largest |w|
            np.zeros(key_vocab, np.int64),  # C
            np.full(key_vocab, -1, np.int64),  # the last id (row of the sums) that touched each key id
            np.empty(key_vocab, np.int64),  # the key ids the current id touched
        )
        count = 0  # how many
        acc = partial[t]
        for r in range(rows.size):
            if not (flat_valid[rows[r]] and owner[flat_ids[rows[r]]] == t):
                continue
            n, i = divmod(rows[r], len_q)
            a = query_ids[n, i]
            # Whether the next row in the order is a valid row of this id (the same thread's, then).
            more = r + 1 < rows.size and flat_valid[rows[r + 1]] and flat_ids[rows[r + 1]] == a
            kv = key_valid[n]
            # The one read of the row from memory, vectorised: the pre-check, and the sums the position statistics
            # need (for a row then dropped too: rare, and it saves a second pass).
            finite = True
            top[:] = -np.inf
            size[:] = 0
            for h in range(heads):
                total = 0.0
                plogp = 0.0
                far = 0.0
                for j in range(len_k):
                    x = weights[n, h, i, j]
                    finite &= math.isfinite(x)
                    top[j] = max(top[j], x)
                    size[j] = max(size[j], abs(x))
                    row[h, j] = x if kv[j] else 0
                    stored = np.float64(row[h, j])
                    total += stored
                    plogp += xlogx(stored)
                    far += stored * abs(i - j)
                mass[h] = total
                wlogw[h] = plogp
                distance[h] = far
            keep = finite and top.max() > 0  # like the torch path: a positive weight at any key...
            if keep and masked:  # ...and a key the mask allows (Hugging Face eager's padding rows are uniform)
                keep = allowed[n, i].any()
            if keep:
                query_count[a] += 1
                if masked:  # a key the mask allows is visible even where its weight rounded to 0 in every head
                    for j in range(len_k):
                        top[j] = 1.0 if allowed[n, i, j] else top[j]
                num_visible = 0
                for j in range(len_k):
                    num_visible += kv[j] and top[j] > 0
                acc[1, 0] += math.log(max(num_visible, 1))
                unit = 1.0 / max(num_visible, 1)
                for j in range(len_k):
                    share[j] = unit if kv[j] and top[j] > 0 else 0.0
                # Position sums, per head. p = w / s renormalises over the valid keys (row sum s); Σ p log p =
                # Σ w log w / s - log s, which float64 keeps exact to ~1e-13 even for tiny s (no mass: 0)...
                for h in range(heads):
                    plogp = wlogw[h] / mass[h] - math.log(mass[h]) if mass[h] > 0.0 else wlogw[h]
                    if 0.0 < mass[h] < _SMALL_MASS:  # ...but for float64 weights near the subnormals: renormalise
                        plogp = 0.0
                        for j in range(len_k):
                            p = row[h, j] / mass[h]
                            plogp += p * math.log(max(p, TINY))
                    acc[0, h] += min(plogp, 0.0)  # rounding must not make an entropy negative
                    acc[5, h] += distance[h]
                    acc[2, h] += row[h, i] if i < len_k else 0.0  # ignored keys are 0 in `row`
                    acc[3, h] += row[h, i - 1] if 0 < i <= len_k else 0.0
                    acc[4, h] += row[h, i + 1] if i + 1 < len_k else 0.0
                if not per_head:  # the mean of the heads: their float64 sum per key in head order, over H
                    total_of_heads[:] = 0
                    for h in range(heads):
                        for j in range(len_k):
                            total_of_heads[j] += np.float64(row[h, j])
                    for j in range(len_k):
                        mean[0, j] = total_of_heads[j] / heads
                values = row if per_head else mean
                if rows_of[a] <= _ROWS_ADDED_ALONE:  # a rare id: its rows straight into the sums
                    sample_keys = keys[n, : key_count[n]]
                    _add_row(sums, pair_count, a * key_vocab, key_ids[n], sample_keys, values, share, size)
                else:  # joins the group of this id's rows in this sample, summed per key position
                    first = grouped == 0
                    grouped += 1
                    for j in range(len_k):
                        group_share[j] = share[j] if first else group_share[j] + share[j]
                        group_size[j] = size[j] if first else max(group_size[j], size[j])
                    for c in range(channels):
                        for j in range(len_k):
                            add = np.float64(values[c, j])
                            group[c, j] = add if first else group[c, j] + add
            else:
                skipped[t] += 1
            if grouped > 0 and not (more and rows[r + 1] // len_q == n):  # the sample's last row of this id
                sample_keys = keys[n, : key_count[n]]
                count = _into_id_sums(
                    key_ids[n], sample_keys, grouped, group, group_share, group_size, batch_sums, a, count
                )
                grouped = 0
            if not more and count > 0:  # the id's last row: its cells, each key in id order (the row swept upwards)
                _add_id_sums(sums, pair_count, a * key_vocab, batch_sums, count)
                count = 0
    # A fixed order of addition: the result does not depend on which thread finished first.
    result = np.zeros((6, heads))
    dropped = 0
    for t in range(threads):
        result += partial[t]
        dropped += skipped[t]
    result[0] = -result[0]
    result[1] = result[1, 0]
    return result, dropped


def accumulate_attention_numba(
    sums: Tensor,
    pair_count: Tensor,
    query_count: Tensor,
    position_sums: Tensor,
    weights: Tensor,
    query_ids: Tensor,
    key_ids: Tensor,
    query_valid: Tensor,
    key_valid: Tensor,
    allowed: Tensor | None = None,
) -> Tensor:
    """:func:`attn_callbacks.sums.step.accumulate_attention` on CPU tensors, from the key ids rather than a pair index.

    ``sums`` float32 or float64, ``pair_count`` and ``query_count`` int64, all contiguous (the caller checks), and
    ``weights`` not empty. Runs on ``min(numba threads, torch threads)`` threads, so ``torch.set_num_threads`` holds
    here too. Shapes and ids are checked first: the kernel itself does no bounds checks.

    Raises:
        ValueError: shapes that do not fit together, or a valid position holding an id outside ``[0, Vq)`` (queries)
            or ``[0, Vk)`` (keys); nothing is added then.
    """
    batch, num_heads, len_q, len_k = weights.shape
    channels = sums.shape[0] - 1
    if channels not in (num_heads, 1):
        raise ValueError(f"Expected `sums` to have H + 1 = {num_heads + 1} or 2 rows, but got {sums.shape[0]}")
    vocab_q = query_count.numel()
    vocab_k = sums.shape[1] // max(vocab_q, 1)
    if vocab_q < 1 or vocab_k < 1 or sums.shape[1] != vocab_q * vocab_k or pair_count.numel() != sums.shape[1]:
        raise ValueError(
            f"Expected `sums` (..., Vq * Vk), `pair_count` (Vq * Vk,) and `query_count` (Vq,), but got "
            f"{tuple(sums.shape)}, {tuple(pair_count.shape)} and {tuple(query_count.shape)}"
        )
    for name, tensor, shape in (
        ("query_ids", query_ids, (batch, len_q)),
        ("query_valid", query_valid, (batch, len_q)),
        ("key_ids", key_ids, (batch, len_k)),
        ("key_valid", key_valid, (batch, len_k)),
    ):
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"Expected `{name}` of shape {shape} for weights {tuple(weights.shape)}, got {tuple(tensor.shape)}"
            )
    # A fixed set of argument types, so that one compiled (and cached) specialisation serves nearly every call.
    if weights.dtype not in (torch.float32, torch.float64):
        weights = weights.float()  # exact for half and bfloat16
    allowed = (
        torch.zeros(0, 0, 0, dtype=torch.bool)
        if allowed is None
        else allowed.detach().to(torch.bool).expand(batch, len_q, len_k)  # (B, Lq, Lk)
    )
    arrays = [
        weights.detach().contiguous().numpy(),
        query_ids.detach().to(torch.int64).contiguous().numpy(),
        key_ids.detach().to(torch.int64).contiguous().numpy(),
        query_valid.detach().to(torch.bool).contiguous().numpy(),
        key_valid.detach().to(torch.bool).contiguous().numpy(),
        allowed.contiguous().numpy(),
    ]
    for name, ids, valid, size in (
        ("query_ids", arrays[1], arrays[3], vocab_q),
        ("key_ids", arrays[2], arrays[4], vocab_k),
    ):
        bad = _first_bad_id(ids, valid, size)
        if bad >= 0:
            raise ValueError(
                f"Expected `{name}` in [0, {size}) at valid positions, but got {int(ids.reshape(-1)[bad])} at "
                f"position {np.unravel_index(bad, ids.shape)}"
            )
    stats, skipped = _accumulate(
        *arrays, sums.detach().numpy(), pair_count.detach().numpy(), query_count.detach().numpy(), threads()
    )
    position_sums += torch.from_numpy(stats).to(position_sums.dtype)
    return torch.tensor(skipped, dtype=torch.int64)
