"""Drift: how far an epoch's attention mass moved from an earlier one, in pure functions (:func:`js_divergence`,
:func:`attention_drift`, :func:`moved_tokens`). The earlier epochs are kept by
:class:`~attn_callbacks.metrics.drift_memory.DriftMemory`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from attn_callbacks.base.tensor_ops import row_blocks, row_plogp, rows_per_block, safe_divide, sum_by_blocks, x_log_x

__all__ = ["Snapshot", "attention_drift", "head_mean", "js_divergence", "moved_tokens"]


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
    blocks = row_blocks(p)
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
    # As normalize_rows does, bit for bit (an epoch compared with itself must give exactly 0); new tensors, ours.
    p, q = safe_divide(p, p_mass), safe_divide(q, q_mass)
    p_plogp = x_log_x(p) if p_plogp is None else p_plogp
    q_plogp = x_log_x(q) if q_plogp is None else q_plogp
    # ½ KL(p‖m) + ½ KL(q‖m) = ½ (Σ p log p + Σ q log q) - Σ m log m, as Σ p log m + Σ q log m = 2 Σ m log m.
    js = (p_plogp + q_plogp) / 2 - x_log_x(p.add_(q).mul_(0.5))
    both = (p_mass[..., 0] > 0) & (q_mass[..., 0] > 0)
    # Rounding of long float32 rows can leave [0, log 2] by a few ulps (disjoint rows gave 0.6931481).
    return torch.where(both, js, 0.0).clamp(min=0, max=math.log(2))


def supported_rows(current_count: Tensor, reference_count: Tensor, min_support: int) -> Tensor:
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
    supported = supported_rows(current_count, reference_count, min_support)
    weights = torch.where(supported, current_count, 0).to(current.dtype)  # (Vq,): 0 for rows that do not count
    blocks, batch = row_blocks(current), current.shape[:-2]
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
        js_sum, change, norm = sum_by_blocks(
            lambda r: torch.cat([js_block(r)[None], change_block(r)]), blocks, current.new_zeros(3, *batch)
        )
        if rows_js is not None:
            rows_js = torch.where(supported, torch.cat(pieces_js, dim=-1), rows_js)
    else:  # JS only where it has weight (often a small share of the vocabulary), gathered a block of rows at a time
        rows, step = supported.nonzero()[:, 0], rows_per_block(current)
        pieces = [rows[start : start + step] for start in range(0, len(rows), step)]
        js_sum = sum_by_blocks(js_block, pieces, current.new_zeros(batch))
        change, norm = sum_by_blocks(change_block, blocks, current.new_zeros(2, *batch))
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
    supported = supported_rows(current_count, reference_count, min_support)
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
    return list(zip(order.tolist(), score[order].tolist(), strict=True))  # one transfer each, not one per row


def head_mean(heads: Tensor) -> Tensor:
    """``mean_h`` of ``(H, ...)``: a view of the one head when ``H = 1`` (``per_head=False``), not a second copy."""
    return heads[0] if heads.shape[0] == 1 else heads.mean(dim=0)


class Snapshot(NamedTuple):
    """One remembered epoch of one module, on the CPU."""

    attention_mass: Tensor  # P per head, (H, Vq, Vk)
    query_count: Tensor  # Q, (Vq,)
    row_plogp: Tensor  # Σ p log p of every row of P, (H, Vq)
    mean_mass: Tensor  # mean_h P, (Vq, Vk)

    @classmethod
    def of(cls, attention_mass: Tensor, query_count: Tensor) -> Snapshot:
        """A snapshot of ``P`` per head and ``Q``, with its derived parts computed."""
        return cls(attention_mass, query_count, row_plogp(attention_mass), head_mean(attention_mass))
