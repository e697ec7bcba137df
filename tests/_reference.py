"""Independent references and small helpers shared by the test files."""

import contextlib
import functools
import html
import math
import os
import re

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import Tensor

from attn_callbacks.base.tensor_ops import safe_divide
from attn_callbacks.sums.step import POSITION_STATS

# The Lightning accelerator of the end-to-end tests: "cpu" in CI; "gpu" runs them on a CUDA device where one exists.
ACCELERATOR = os.environ.get("ATTN_CALLBACKS_TEST_ACCELERATOR", "cpu")
# assert_close tolerances for sums of the same batches from two runs: bit for bit on CPU, where the kernels add in a
# fixed order; close on a GPU, whose scatter-add (atomics) adds in no fixed order.
SAME_SUMS = {"rtol": 0, "atol": 0} if ACCELERATOR == "cpu" else {}


def add_loop_sums(S: torch.Tensor, Q: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, pad: int) -> None:
    """Add one batch to ``S (H, V, V)`` and ``Q (V,)`` by explicit loops: every non-pad query position ``i`` holding
    ``a`` counts once in ``Q[a]`` and adds ``weights[n, :, i, j]`` to ``S[:, a, b]`` for every non-pad key ``j``
    holding ``b``. ``ids (B, L)``, ``weights (B, H, L, L)``."""
    batch, length = ids.shape
    for n in range(batch):
        for i in range(length):
            if ids[n, i] == pad:
                continue
            Q[ids[n, i]] += 1
            for j in range(length):
                if ids[n, j] != pad:
                    S[:, ids[n, i], ids[n, j]] += weights[n, :, i, j].double()


def naive_js(p, q):
    """Jensen–Shannon divergence in nats of two lists, renormalised; 0 when either is all zero."""
    sp, sq = sum(p), sum(q)
    if sp == 0 or sq == 0:
        return 0.0
    p = [x / sp for x in p]
    q = [x / sq for x in q]
    m = [(x + y) / 2 for x, y in zip(p, q, strict=True)]
    kl_p = sum(x * math.log(x / z) for x, z in zip(p, m, strict=True) if x > 0)
    kl_q = sum(y * math.log(y / z) for y, z in zip(q, m, strict=True) if y > 0)
    return (kl_p + kl_q) / 2


# The vectorised reference the fast path is tested against (torch ops, any dtype); the float64 loops above check it.
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


def figure_to_array(figure: Figure) -> np.ndarray:
    """Render a figure to an ``(H, W, 4)`` uint8 RGBA array, as the canvas holds it."""
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba()).copy()


def words(artist, gid):
    """The :class:`~attn_callbacks.output.text_outlines.OutlinedTexts` of ``artist`` (a figure or an axes) marked
    ``gid``: its tick labels, colour bar numbers or title, whose ``texts`` are the strings drawn."""
    from attn_callbacks.output.text_outlines import OutlinedTexts

    (found,) = [w for w in artist.findobj(OutlinedTexts) if w.get_gid() == gid]
    return found


@contextlib.contextmanager
def spying(obj, method, spy):
    """Within the block, every ``obj.method(*args, **kwargs)`` first calls ``spy(*args, **kwargs)``."""
    original = getattr(obj, method)

    def wrapper(*args, **kwargs):
        spy(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(obj, method, wrapper)
    try:
        yield
    finally:
        delattr(obj, method)


@contextlib.contextmanager
def returned(obj, method, spy):
    """Within the block, every ``obj.method(...)`` hands its result to ``spy(result)`` before returning it."""
    original = getattr(obj, method)

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        spy(result)
        return result

    setattr(obj, method, wrapper)
    try:
        yield
    finally:
        delattr(obj, method)


def copied(stats):
    """An AttentionStats of copies of every raw sum (the epoch end divides ``S`` into ``P`` in place, and the sums
    are zeroed or handed on when it ends)."""
    from attn_callbacks.sums.accumulator import SUM_FIELDS, AttentionStats

    return AttentionStats(*(getattr(stats, field).to("cpu", copy=True) for field in SUM_FIELDS))


# Cases and loops shared by test_step.py and test_summary.py.
def naive_accumulate(weights, query_ids, key_ids, query_valid, key_valid, vq, vk, allowed=None):
    """float64 Python-loop reference of S, C, Q; a row the mask ``allowed`` ``(B, Lq, Lk)`` allows no key in is
    dropped, as a fully masked one."""
    b_, h_, lq, lk = weights.shape
    S = torch.zeros(h_, vq, vk, dtype=torch.float64)
    C = torch.zeros(vq, vk, dtype=torch.float64)
    Q = torch.zeros(vq, dtype=torch.float64)
    skipped = 0
    for n in range(b_):
        for i in range(lq):
            if not query_valid[n, i]:
                continue
            if not row_kept(weights, query_valid, n, i, allowed) or not (weights[n, :, i] > 0).any():
                skipped += 1
                continue
            a = int(query_ids[n, i])
            Q[a] += 1
            for j in range(lk):
                if not key_valid[n, j]:
                    continue
                b = int(key_ids[n, j])
                C[a, b] += 1
                for h in range(h_):
                    S[h, a, b] += float(weights[n, h, i, j])
    return S, C, Q, skipped


def random_case(b, h, lq, lk, vq, vk, causal=False, pad_id=-100, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(b, h, lq, lk, generator=g)
    if causal:
        scores = scores.masked_fill(torch.ones(lq, lk, dtype=torch.bool).triu(1), float("-inf"))
    weights = scores.softmax(-1)
    query_ids = torch.randint(0, vq, (b, lq), generator=g)  # small vocab: many repeated ids
    key_ids = torch.randint(0, vk, (b, lk), generator=g)
    query_ids[0, -2:] = pad_id
    key_ids[-1, -3:] = pad_id
    return weights, query_ids, key_ids, query_ids != pad_id, key_ids != pad_id


def run(weights, query_ids, key_ids, qv, kv, vq, vk):
    h = weights.shape[1]
    S = torch.zeros(h, vq, vk)
    C = torch.zeros(vq, vk, dtype=torch.long)
    Q = torch.zeros(vq, dtype=torch.long)
    skipped = accumulate_attention_reference(S, C, Q, weights, query_ids, key_ids, qv, kv)
    return S, C, Q, int(skipped)


def row_kept(weights, query_valid, n, i, allowed=None):
    """A valid row of finite weights, with some key the mask ``allowed`` allows (when given)."""
    has_key = allowed is None or bool(allowed[n, i].any())
    return bool(query_valid[n, i]) and bool(torch.isfinite(weights[n, :, i]).all()) and has_key


def visible_keys(weights, key_valid, n, i, allowed=None):
    """Valid keys that the mask ``allowed`` ``(B, Lq, Lk)`` allows or at least one head gives a non-zero weight."""
    h_, lk = weights.shape[1], weights.shape[3]
    weighted = [any(float(weights[n, h, i, j]) != 0.0 for h in range(h_)) for j in range(lk)]
    masked = [allowed is not None and bool(allowed[n, i, j]) for j in range(lk)]
    return [j for j in range(lk) if key_valid[n, j] and (weighted[j] or masked[j])]


def naive_uniform(weights, query_ids, key_ids, query_valid, key_valid, vq, vk, allowed=None):
    """float64 Python-loop reference of U."""
    b_, _, lq, _ = weights.shape
    U = torch.zeros(vq, vk, dtype=torch.float64)
    for n in range(b_):
        for i in range(lq):
            if not row_kept(weights, query_valid, n, i, allowed):
                continue
            visible = visible_keys(weights, key_valid, n, i, allowed)
            for j in visible:
                U[int(query_ids[n, i]), int(key_ids[n, j])] += 1.0 / len(visible)
    return U


def naive_position_sums(weights, query_valid, key_valid, allowed=None):
    """float64 Python-loop reference of the position sums, rows in the order of F.POSITION_STATS."""
    b_, h_, lq, lk = weights.shape
    P = torch.zeros(6, h_, dtype=torch.float64)
    for n in range(b_):
        for i in range(lq):
            if not row_kept(weights, query_valid, n, i, allowed):
                continue
            visible = visible_keys(weights, key_valid, n, i, allowed)
            for h in range(h_):
                # weights restricted to valid keys; 0 outside the key range
                w = {j: float(weights[n, h, i, j]) if key_valid[n, j] else 0.0 for j in range(lk)}
                total = sum(w.values())  # entropy of the row renormalised over the valid keys
                P[0, h] += -sum(x / total * math.log(x / total) for x in w.values() if x > 0)
                P[1, h] += math.log(len(visible)) if visible else 0.0
                P[2, h] += w.get(i, 0.0)
                P[3, h] += w.get(i - 1, 0.0)
                P[4, h] += w.get(i + 1, 0.0)
                P[5, h] += sum(x * abs(i - j) for j, x in w.items())
    return P


def run_full(weights, query_ids, key_ids, qv, kv, vq, vk):
    h = weights.shape[1]
    S = torch.zeros(h, vq, vk)
    C = torch.zeros(vq, vk, dtype=torch.long)
    Q = torch.zeros(vq, dtype=torch.long)
    U = torch.zeros(vq, vk, dtype=torch.float64)
    P = torch.zeros(len(POSITION_STATS), h, dtype=torch.float64)
    skipped = accumulate_attention_reference(
        S, C, Q, weights, query_ids, key_ids, qv, kv, uniform_sum=U, position_sums=P
    )
    return S, C, Q, U, P, int(skipped)


def masked_case(b, h, lengths, vocab, causal=True, uniform=False, pad_id=-100, seed=0):
    """Self-attention batch whose weights are exactly 0 on padded (and causally masked) keys.

    ``lengths[n]`` real tokens per sequence, then padding. ``uniform``: weights uniform over the unmasked keys.
    """
    g = torch.Generator().manual_seed(seed)
    length = max(lengths)
    ids = torch.randint(0, vocab, (b, length), generator=g)
    valid = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    ids = torch.where(valid, ids, pad_id)
    allowed = valid[:, None, None, :].expand(b, h, length, length).clone()
    if causal:
        allowed &= torch.ones(length, length, dtype=torch.bool).tril()
    scores = torch.zeros(b, h, length, length) if uniform else torch.randn(b, h, length, length, generator=g)
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return weights, ids, ids, valid, valid


def table_cells(markdown: str) -> list[list[str]]:
    """The body rows of a table :func:`~attn_callbacks.metrics.tables.markdown_table` wrote, each cell as it was
    before escaping (what TensorBoard shows; the no-break spaces that keep a cell's edge spaces read as spaces)."""
    return [
        [html.unescape(re.sub(r"\\(.)", r"\1", cell)).replace("\xa0", " ") for cell in line[2:-2].split(" | ")]
        for line in markdown.splitlines()[2:]
    ]


def passthrough(function):
    """A decorator of the usual kind (``functools.wraps``), in a file of its own: the wrapper's code names nothing
    of the function's, which a reader must unwrap to see (as transformers' ``deprecate_kwarg``)."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        return function(*args, **kwargs)

    return wrapper
