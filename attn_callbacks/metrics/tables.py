"""The text tables of one module's epoch (one-way pairs, lift pairs, moved tokens, hubs) and the rankings behind
them: pure functions of the sums, with labels given as functions."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from attn_callbacks.base.labels import drawable
from attn_callbacks.base.tensor_ops import safe_divide
from attn_callbacks.metrics.drift import Snapshot, moved_tokens
from attn_callbacks.metrics.summary import Drift, lift
from attn_callbacks.sums.accumulator import AttentionStats

__all__ = ["markdown_table", "module_tables", "one_way_pairs", "pagerank", "top_pairs", "top_tokens"]


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
    return _top_pairs_by(lambda rows, cols: score[rows, cols], pair_count, k, min_support)


def _top_pairs_by(
    score_at: Callable[[Tensor, Tensor], Tensor], pair_count: Tensor, k: int, min_support: int
) -> list[tuple[int, int, float]]:
    """:func:`top_pairs` with the scores computed at the candidate cells only (``score_at(rows, cols)``): a score
    such as the lift then never fills a ``V × V`` matrix."""
    rows, cols = (pair_count >= min_support).nonzero().unbind(dim=1)  # ascending flat index
    size = pair_count.shape[-1]
    candidates = rows * size + cols
    values = score_at(rows, cols)
    keep = torch.isfinite(values)
    return _top_of(candidates[keep], values[keep], size, k)


def _top_of(candidates: Tensor, values: Tensor, size: int, k: int) -> list[tuple[int, int, float]]:
    """The ``k`` largest ``values`` as ``(a, b, value)`` of their flat ``candidates`` (ascending) in ``size``
    columns; ties: the smaller flat index first."""
    values, candidates = _at_least_kth(values, k, candidates)
    order = torch.sort(values, descending=True, stable=True).indices[:k]
    chosen = zip(candidates[order].tolist(), values[order].tolist(), strict=True)
    return [(i // size, i % size, v) for i, v in chosen]


def _tables_numba(matrix: Tensor, pair_count: Tensor | None = None) -> Any:
    """:mod:`attn_callbacks.metrics.tables_numba` where it serves these CPU matrices (numba running), else None."""
    from attn_callbacks.base.numba_loader import uses_numba

    if matrix.dtype not in (torch.float32, torch.float64) or (
        pair_count is not None and pair_count.dtype != torch.int64
    ):
        return None
    if not uses_numba(matrix.device):
        return None
    from attn_callbacks.metrics import tables_numba  # imports numba: only once it is known to work

    return tables_numba


def _column_sums(mass: Tensor, query_count: Tensor) -> Tensor:
    """``Σ_a Q[a] P̄[a, b]``, the column sums of ``S̄``, with equal columns summing to equal values: the hubs table
    ranks ties by token (a float32 product or sum may add a matrix's last columns in another order)."""
    fast = _tables_numba(mass)
    if fast is not None:  # float64 sums in a fixed order, the matrix read in place
        return fast.vector_matrix(query_count.double(), mass)
    return (query_count.double() @ mass.double()).float()  # float64 differences in the last bits round away


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
    # A > 0 iff P[a, b] > P[b, a]: only those cells are candidates, usually a small share of V².
    # (a, b) in row-major order, i.e. by ascending flat index; read in place (``matrix`` is often a slice of a larger
    # matrix, which a flat view would first copy whole).
    fast = _tables_numba(matrix, pair_count)
    if fast is not None:  # the same cells, in one read of each matrix
        rows, cols = fast.one_way_candidates(matrix, pair_count, min_support)
    else:
        seen = pair_count >= min_support
        support = seen & seen.T  # a transposed read of bools, not of the int64 counts: several times faster on CPU
        rows, cols = (support & (matrix > matrix.T)).nonzero().unbind(dim=1)
    candidates = rows * size + cols
    forward, backward = matrix[rows, cols], matrix[cols, rows]
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
    # π T = (π / out) @ P over the rows with outgoing attention, plus the mass of the others spread uniformly: the
    # matrix is read as it is, not normalised into a second V × V copy.
    fast = _tables_numba(matrix) if matrix.dtype == torch.float32 else None
    out = fast.row_sums(matrix) if fast is not None else matrix.double().sum(dim=1)
    inverse_out = torch.where(out > 0, 1 / torch.where(out > 0, out, 1), 0)
    if fast is not None and bool(torch.isfinite(out).all()):  # every row sum finite: no NaN or inf in the matrix
        weights = matrix  # read as float32 and summed in float64: no float64 copy

        def step(vector: Tensor) -> Tensor:
            return fast.vector_matrix(vector, weights)
    else:
        weights = matrix.double()
        if not bool(torch.isfinite(inverse_out).all()):  # a subnormal row sum: normalise by division instead
            weights, inverse_out = safe_divide(weights, out[:, None]), (out > 0).double()

        def step(vector: Tensor) -> Tensor:
            return vector @ weights

    dangling = (out == 0).double()  # (V,): a product, not a boolean index (a device sync per iteration on GPU)
    rank = torch.full((size,), 1.0 / size, dtype=torch.float64, device=matrix.device)
    if start is not None:
        rank = start.to(rank).clamp(min=0)
        rank = rank / rank.sum()
    for _ in range(max_iter):
        spread = (rank @ dangling) / size
        new = (1 - damping) / size + damping * (step(rank * inverse_out) + spread)
        done = float((new - rank).abs().sum()) < tol
        rank = new
        if done:
            break
    return rank / rank.sum()


def _labelled(
    pairs: Sequence[tuple[int, int, float]],
    query_labels: Callable[[Sequence[int]], list[str]],
    key_labels: Callable[[Sequence[int]], list[str]],
) -> list[tuple[str, str, float]]:
    """A table's ``(a, b, score)`` pairs as ``(label of a, label of b, score)``, each side labelled in one call."""
    queries, keys = query_labels([a for a, _, _ in pairs]), key_labels([b for _, b, _ in pairs])
    return [(query, key, score) for query, key, (_, _, score) in zip(queries, keys, pairs, strict=True)]


def _read(items: Sequence[Any], device: torch.device, *gathers: Callable[..., Tensor]) -> list[list[float]]:
    """Per gather, its ``(n,)`` values at the ``n`` rows of a table, as floats, moved to the host in one copy (read
    one by one, every value would cost a host sync on a GPU). ``items``: the rows' token ids, or their ``(a, b,
    ...)`` pairs; each gather gets the ids (or ``a`` and ``b``) as tensors on ``device``."""
    if not items:
        return [[] for _ in gathers]
    pairs = isinstance(items[0], tuple)
    index = torch.tensor([item[:2] if pairs else item for item in items], device=device)
    columns = [gather(*index.T) if pairs else gather(index) for gather in gathers]
    return torch.stack([column.to(device, torch.float64) for column in columns]).tolist()


_MARKDOWN_INLINE = re.compile(r"[\\`*_\[\]|]")


def _number(value: float) -> str:
    return f"{value:.3f}" if value == 0 or not math.isfinite(value) or abs(value) >= 0.01 else f"{value:.3g}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (TensorBoard's text plugin renders it). Cells show as written: ``&``, ``<`` and ``>`` become
    entities and the characters of inline Markdown (``\\ ` * _ [ ] |``) are escaped, so that a token such as
    ``__init__``, ``*args*`` or ``<s>`` is not rendered as emphasis, a link or an HTML tag. Spaces at a cell's ends
    (which Markdown trims) become no-break spaces, so that ``" the"`` and ``"the"`` stay apart. Floats get 3 decimals,
    or 3 significant digits below 0.01 (a table ranked by a small JS would read 0.000 all down).

    Example:
        >>> print(markdown_table(["token", "JS"], [("the", 0.5), ("a", 0.000119)]))
        | token | JS |
        |---|---|
        | the | 0.500 |
        | a | 0.000119 |
    """

    def cell(value: object) -> str:
        text = _number(value) if isinstance(value, float) else drawable(str(value))  # UTF-8 holds no lone surrogate
        # A line break would end the row: shown as its escape, as labels show "\n"; a tab too (Markdown trims it).
        text = text.replace("\r", "\\r").replace("\n", "\\n").replace("\t", "\\t")
        text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        text = _MARKDOWN_INLINE.sub(r"\\\g<0>", text)
        lead, core = len(text) - len(text.lstrip(" ")), text.strip(" ")
        return "&nbsp;" * lead + core + "&nbsp;" * (len(text) - lead - len(core))

    lines = ["| " + " | ".join(map(cell, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
    return "\n".join(lines)


def module_tables(
    stats: AttentionStats,
    mass: Tensor,
    *,
    square: bool,
    query_tokens: slice,
    key_tokens: slice,
    query_labels: Callable[[Sequence[int]], list[str]],
    key_labels: Callable[[Sequence[int]], list[str]],
    num_pairs: int,
    min_support: int,
    reference: Snapshot | None = None,
    drifts: dict[str, Drift] | None = None,
    epochs: tuple[int | None, int | None] = (None, None),
    rank_start: Tensor | None = None,
) -> tuple[dict[str, str], Tensor | None]:
    """One module's tables as Markdown, by kind: ``one_way_pairs`` (self-attention), ``lift_pairs``,
    ``drift_tokens`` (with a reference) and ``hubs``; and the PageRank it computed (self-attention), where the next
    epoch's starts (``rank_start``).

    Args:
        stats: the module's sums.
        mass: ``P̄ = mean_h P``, ``(Vq, Vk)``; the tables need ``S̄ = mean_h S = Q P̄`` at a few cells and in column
            sums only, so they take it from ``P̄`` and ``Q`` rather than from a ``V × V`` matrix of its own.
        square: self-attention.
        query_tokens: the query indices that are tokens (``<other>`` left out).
        key_tokens: the key indices that are tokens.
        query_labels: labels of query indices, all of a table's at once (a tokenizer is called once a table).
        key_labels: labels of key indices, likewise.
        num_pairs: rows per table.
        min_support: the least evidence a row needs (see ``AttentionMonitor``).
        reference: the reference epoch, for the moved tokens.
        drifts: this epoch's drifts ("prev" / "ref"), whose row JS the moved tokens rank.
        epochs: (reference epoch, previous epoch), for the headers.
        rank_start: last epoch's PageRank, a first guess.
    """
    tq, tk = query_tokens, key_tokens
    count = stats.pair_count[tq, tk]
    tables: dict[str, str] = {}

    def table(header: Sequence[str], rows: list[Sequence[object]], empty: str) -> str:
        return markdown_table(header, rows) if rows else empty

    needs = f"No pair seen at least min_support={min_support} times"
    if square:
        # C counts masked pairs too: a pair whose U is 0 one way (b always before a under a causal mask) never had
        # the chance to attend back, and is no evidence of one-way attention.
        visible = torch.where(stats.uniform_sum[tq, tk] > 0, count, 0)
        found = one_way_pairs(mass[tq, tk], visible, num_pairs, min_support)
        there, back, seen = _read(
            found, mass.device, lambda a, b: mass[a, b], lambda a, b: mass[b, a], lambda a, b: count[a, b]
        )
        rows: list[Sequence[object]] = [
            (*pair, p, q, int(c))
            for pair, p, q, c in zip(_labelled(found, query_labels, key_labels), there, back, seen, strict=True)
        ]
        header = ("query a", "key b", "(P̄[a,b]-P̄[b,a])/(P̄[a,b]+P̄[b,a])", "P̄[a,b]", "P̄[b,a]", "pairs C[a,b]")
        tables["one_way_pairs"] = table(header, rows, f"{needs} in both directions.")
    query_count = stats.query_count
    shown, uniform = mass[tq, tk], stats.uniform_sum[tq, tk]
    fast = _tables_numba(shown, count)
    if fast is not None:
        top = _top_of(
            *fast.lift_candidates(shown, query_count[tq], uniform, count, min_support), shown.shape[-1], num_pairs
        )
    else:
        weights = query_count[tq].to(mass.dtype)
        top = _top_pairs_by(lambda r, c: lift(weights[r] * shown[r, c], uniform[r, c]), count, num_pairs, min_support)
    there, chance = _read(
        top, mass.device, lambda a, b: mass[a, b], lambda a, b: stats.uniform_sum[a, b] / query_count[a]
    )
    rows = [(*pair, p, u) for pair, p, u in zip(_labelled(top, query_labels, key_labels), there, chance, strict=True)]
    header = ("query a", "key b", "lift S̄/U", "P̄[a,b]", "uniform U[a,b]/Q[a]")
    tables["lift_pairs"] = table(header, rows, f"{needs}.")
    drifts = drifts or {}
    if reference is not None and "ref" in drifts:
        tables["drift_tokens"] = _drift_table(
            stats, mass, reference, drifts, tq, tk, query_labels, key_labels, num_pairs, min_support, epochs
        )
    degree = safe_divide(_column_sums(mass, query_count), query_count.sum())  # summary.in_degree of S̄ = Q P̄
    rank = None
    if square:
        # P̄ has the ranks of S̄ (rows are normalised); last epoch's ranks are a close first guess.
        start = rank_start if rank_start is not None and rank_start.shape == degree.shape else None
        rank = pagerank(mass, start=start)
        order = top_tokens((rank * (degree > 0))[tk], num_pairs).tolist()
        ranks, degrees, counts = _read(
            order, mass.device, lambda b: rank[b], lambda b: degree[b], lambda b: stats.query_count[b]
        )
        rows = [(b, r, d, int(q)) for b, r, d, q in zip(key_labels(order), ranks, degrees, counts, strict=True)]
        header = ("token", "PageRank", "in-degree (share of attention received)", "Q")
    else:
        order = top_tokens(degree[tk], num_pairs).tolist()
        (degrees,) = _read(order, mass.device, lambda b: degree[b])
        rows = [(b, d) for b, d in zip(key_labels(order), degrees, strict=True)]
        header = ("key token", "in-degree (share of attention received)")
    tables["hubs"] = table(header, rows, "No attention recorded.")
    return tables, rank


def _drift_table(
    stats: AttentionStats,
    mass: Tensor,
    reference: Snapshot,
    drifts: dict[str, Drift],
    tq: slice,
    tk: slice,
    query_labels: Callable[[Sequence[int]], list[str]],
    key_labels: Callable[[Sequence[int]], list[str]],
    num_pairs: int,
    min_support: int,
    epochs: tuple[int | None, int | None],
) -> str:
    """The query tokens whose attention moved most since the reference epoch."""
    ref_mass = reference.mean_mass  # where the snapshot lives: only the moved rows are read
    ref_count = reference.query_count.to(mass.device)
    moved = moved_tokens(
        mass[tq], None, stats.query_count[tq], ref_count[tq], num_pairs, min_support, drifts["ref"].rows[tq]
    )
    # Against the previous epoch where the module has one: it saw nothing then (no snapshot), no column.
    previous = "prev" in drifts
    prev_js: list[Any] = []
    if previous and moved:  # NaN (not shown) where the token was too rare in the previous epoch
        prev_js = [
            "" if math.isnan(js) else js
            for js in drifts["prev"].rows[torch.tensor([a for a, _ in moved], device=mass.device)].tolist()
        ]
    now, then, counts = _read(
        [a for a, _ in moved],
        mass.device,
        lambda a: mass[a, tk].argmax(dim=-1),
        lambda a: ref_mass[a.to(ref_mass.device), tk].argmax(dim=-1),  # the snapshot may be in host memory
        lambda a: stats.query_count[a],
    )
    queries = query_labels([a for a, _ in moved])
    tops_now, tops_then = key_labels([int(b) for b in now]), key_labels([int(b) for b in then])
    rows = [
        (query, js, top_now, top_then, int(q))
        for query, (_, js), top_now, top_then, q in zip(queries, moved, tops_now, tops_then, counts, strict=True)
    ]
    if previous:
        rows = [(*row[:2], js, *row[2:]) for row, js in zip(rows, prev_js, strict=True)]
    header = (
        "query token",
        f"JS vs reference (epoch {epochs[0]})",
        *([f"JS vs previous (epoch {epochs[1]})"] if previous else []),
        "top key now",
        "top key at reference",
        "Q now",
    )
    return markdown_table(header, rows) if rows else "No query token seen often enough."
