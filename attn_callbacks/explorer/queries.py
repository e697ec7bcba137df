"""What the tab asks of one view's epochs: a token's ranked row and column, a heatmap, a token's history. Pure numpy
over :class:`~attn_callbacks.explorer.data.ExplorerEpoch`; every number is one the monitor wrote, or the lift
``L[a, b] = P[a, b] * Q[a] / U[a, b]`` (None where ``U`` is 0: the pair was never visible)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from attn_callbacks.explorer.data import ExplorerEpoch

__all__ = ["heatmap", "history", "js_divergence", "token_view"]


def _index(ids: Sequence[int], token: int) -> int | None:
    try:
        return list(ids).index(token)
    except ValueError:
        return None


def _lift(mass: np.ndarray, count: np.ndarray | float, uniform: np.ndarray) -> list[float | None]:
    """``P * Q / U`` in float64, None where ``U`` is 0."""
    mass64, uniform64 = mass.astype(np.float64), uniform.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        lift = mass64 * count / uniform64
    return [None if u == 0 else float(v) for v, u in zip(lift.ravel(), uniform64.ravel(), strict=True)]


def _entries(ids, labels, mass, lift, count, uniform, limit: int | None) -> list[dict[str, Any]]:
    """The pairs that were ever visible (``U > 0``: not every pair counted in ``C`` was, a causal mask hides later
    keys), by ``P`` descending (ties: the more frequent token first)."""
    order = np.argsort(-mass.astype(np.float64), kind="stable")
    rows = [
        {"id": int(ids[i]), "label": labels[i], "p": float(mass[i]), "lift": lift[i], "count": int(count[i])}
        for i in order
        if uniform[i] > 0
    ]
    return rows if limit is None else rows[:limit]


def token_view(
    epoch: ExplorerEpoch, head: int | None, token: int, limit: int | None = None, side: str | None = None
) -> dict[str, Any]:
    """A token's row ("attends to": ``P[token, b]`` over the stored key tokens) and column ("attended by":
    ``P[a, token]`` over the stored query tokens), each ranked by ``P``, with lift and pair count.

    Args:
        epoch: one view's epoch.
        head: a head index, or None for the head mean.
        token: the token's vocabulary id.
        limit: the most entries per list (None: every pair ever visible).
        side: ``"query"`` or ``"key"``: the token is of that axis only (cross-attention, where an id names one token
            of the query vocabulary and another of the key vocabulary); None: both (self-attention).

    Returns:
        ``{"token": {"id", "label", "count"}, "attends_to": [...] | None, "attended_by": [...] | None, "rest": float |
        None}``: a list is None when the token is not among the stored rows (columns); ``rest`` is the share of the
        token's attention that goes to keys outside the stored columns, ``1 - sum_b P[token, b]``.
    """
    meta = epoch.meta
    mass, pairs, uniform = epoch.mass(head), epoch.pair_count, epoch.uniform_sum
    row, col = _sides(meta, token, side)
    label = meta["query_labels"][row] if row is not None else meta["key_labels"][col] if col is not None else None
    result: dict[str, Any] = {
        "token": {"id": token, "label": label, "count": None if row is None else int(epoch.query_count[row])},
        "attends_to": None,
        "attended_by": None,
        "rest": None,
    }
    if row is not None:
        p, q, u = np.asarray(mass[row]), int(epoch.query_count[row]), np.asarray(uniform[row])
        lift = _lift(p, q, u)
        result["attends_to"] = _entries(meta["key_ids"], meta["key_labels"], p, lift, np.asarray(pairs[row]), u, limit)
        result["rest"] = max(0.0, 1.0 - float(p.astype(np.float64).sum()))
    if col is not None:
        p, u = np.asarray(mass[:, col]), np.asarray(uniform[:, col])
        lift = _lift(p, epoch.query_count.astype(np.float64), u)
        result["attended_by"] = _entries(
            meta["query_ids"], meta["query_labels"], p, lift, np.asarray(pairs[:, col]), u, limit
        )
    return result


def _sides(meta: dict[str, Any], token: int, side: str | None) -> tuple[int | None, int | None]:
    """The token's row and column index among the stored ones (None where it is not stored, or not of ``side``)."""
    row = _index(meta["query_ids"], token) if side in (None, "query") else None
    col = _index(meta["key_ids"], token) if side in (None, "key") else None
    return row, col


def heatmap(
    epoch: ExplorerEpoch, head: int | None, size: int, around: int | None = None, side: str | None = None
) -> dict[str, Any]:
    """``P``, lift and pair count over ``size`` rows and columns: the most frequent tokens, or the neighbourhood of
    token ``around`` (it first, then the query tokens that attend to it most as rows, the key tokens it attends to
    most as columns; where it is stored on one axis only, as in cross-attention, it first on that axis, then the
    most frequent, and the other axis as above). ``side`` as in :func:`token_view`.

    Returns:
        ``{"rows": [{"id", "label"}], "cols": [...], "p": [[...]], "lift": [[...]], "count": [[...]], "outline":
        {"row": index | None, "col": index | None}}``, the outlined cell being the searched token's row and column.
    """
    meta = epoch.meta
    mass = epoch.mass(head)
    n_q, n_k = mass.shape
    rows, cols = list(range(min(size, n_q))), list(range(min(size, n_k)))
    row = col = None
    if around is not None:
        row, col = _sides(meta, around, side)
        if row is not None:
            ranked = np.argsort(-np.asarray(mass[row], dtype=np.float64), kind="stable")
            cols = ([col] if col is not None else []) + [int(j) for j in ranked if j != col]
            cols = cols[: min(size, n_k)]
        if col is not None:
            ranked = np.argsort(-np.asarray(mass[:, col], dtype=np.float64), kind="stable")
            rows = ([row] if row is not None else []) + [int(i) for i in ranked if i != row]
            rows = rows[: min(size, n_q)]
        if row is not None and col is None:
            rows = ([row] + [i for i in rows if i != row])[: min(size, n_q)]
        if col is not None and row is None:
            cols = ([col] + [j for j in cols if j != col])[: min(size, n_k)]
    grid = np.ix_(rows, cols)
    p, pairs, uniform = np.asarray(mass[grid]), np.asarray(epoch.pair_count[grid]), np.asarray(epoch.uniform_sum[grid])
    counts = epoch.query_count[rows].astype(np.float64)[:, None]
    lift = _lift(p, counts, uniform)
    width = len(cols)
    return {
        "rows": [{"id": meta["query_ids"][i], "label": meta["query_labels"][i]} for i in rows],
        "cols": [{"id": meta["key_ids"][j], "label": meta["key_labels"][j]} for j in cols],
        "p": p.astype(np.float64).tolist(),
        "lift": [lift[i * width : (i + 1) * width] for i in range(len(rows))],
        "count": pairs.astype(np.int64).tolist(),
        "outline": {"row": rows.index(row) if row in rows else None, "col": cols.index(col) if col in cols else None},
    }


def js_divergence(p: dict[int, float], q: dict[int, float]) -> float:
    """Jensen–Shannon divergence (natural log, in ``[0, log 2]``) of two distributions given as id -> share, over the
    ids both give, each completed by a ``rest`` bucket ``1 - sum`` (clipped at 0) and normalised. An id only one side
    gives is in the other's rest: counting it as 0 there would show movement where there was none."""
    keys = sorted(set(p) & set(q))
    a = np.array([p.get(k, 0.0) for k in keys] + [0.0], dtype=np.float64)
    b = np.array([q.get(k, 0.0) for k in keys] + [0.0], dtype=np.float64)
    a[-1], b[-1] = max(0.0, 1.0 - a[:-1].sum()), max(0.0, 1.0 - b[:-1].sum())
    a, b = a / a.sum(), b / b.sum()
    m = (a + b) / 2

    def kl(x: np.ndarray) -> float:
        nonzero = x > 0
        return float((x[nonzero] * np.log(x[nonzero] / m[nonzero])).sum())

    return max(0.0, (kl(a) + kl(b)) / 2)


def history(
    epochs: Sequence[ExplorerEpoch], head: int | None, token: int, chosen: int, keys: int = 5
) -> dict[str, Any]:
    """How a token's row moved across epochs: ``P[token, b]`` of its ``keys`` top keys at epoch ``epochs[chosen]``,
    at every epoch, and the row's Jensen–Shannon drift from the epoch before.

    The drift compares the two epochs' rows over the columns both store, each completed by a ``rest`` bucket (its
    share outside them): the stored columns are the most frequent tokens, so it is the monitor's ``drift_js`` of
    this one row up to the attention that falls outside them.

    Returns:
        ``{"epochs": [epoch], "steps": [step], "keys": [{"id", "label"}], "p": [[P per epoch, None where the token or
        key is not stored] per key], "js": [None, drift from the previous epoch, ...]}``.
    """
    rows: list[dict[int, float] | None] = []
    labels: dict[int, str] = {}
    for epoch in epochs:
        row = _index(epoch.meta["query_ids"], token)
        if row is None:
            rows.append(None)
            continue
        values = np.asarray(epoch.mass(head)[row], dtype=np.float64)
        rows.append(dict(zip(epoch.meta["key_ids"], values.tolist(), strict=True)))
        labels.update(zip(epoch.meta["key_ids"], epoch.meta["key_labels"], strict=True))
    top: list[int] = []
    if rows[chosen] is not None:
        ranked = sorted(rows[chosen].items(), key=lambda item: -item[1])
        top = [key for key, value in ranked if value > 0][:keys]
    js: list[float | None] = [None]
    for before, after in itertools.pairwise(rows):
        js.append(None if before is None or after is None else js_divergence(after, before))
    return {
        "epochs": [int(epoch.meta["epoch"]) for epoch in epochs],
        "steps": [int(epoch.meta["step"]) for epoch in epochs],
        "keys": [{"id": key, "label": labels[key]} for key in top],
        "p": [[None if row is None or key not in row else row[key] for row in rows] for key in top],
        "js": [None if value is None or math.isnan(value) else value for value in js],
    }
