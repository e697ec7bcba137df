"""Pure functions from an epoch's sums to every number the monitor logs: the one place the callback gets its numbers,
and the offline CLI its drift.

Notation (see docs/reading.md): ``S`` attention sum, ``C`` pair count, ``Q`` query count, ``U`` uniform baseline,
``P = S / Q`` attention mass. Adding a metric: one function here, one line in :func:`summarize`, one test.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from attn_callbacks.base.tensor_ops import (
    attention_mass,
    mean_weight,
    row_blocks,
    row_plogp,
    safe_divide,
    square_tiles,
    sum_by_blocks,
    x_log_x,
)
from attn_callbacks.metrics.drift import Snapshot, attention_drift, head_mean, supported_rows
from attn_callbacks.sums.step import POSITION_STATS

__all__ = [
    "Drift",
    "ModuleSummary",
    "asymmetry_from_sums",
    "asymmetry_index",
    "attention_mass",
    "drift_between",
    "in_degree",
    "lift",
    "mean_lift",
    "mean_weight",
    "pairwise_asymmetry",
    "position_statistics",
    "row_entropy",
    "sink_mass",
    "summarize",
]


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

    cross, norm = sum_by_blocks(tile_sums, square_tiles(matrix), matrix.new_zeros(2, *matrix.shape[:-2]))
    return asymmetry_from_sums(cross, norm).to(matrix.dtype)


def asymmetry_from_sums(cross: Tensor, norm: Tensor) -> Tensor:
    """``sqrt(1 - <P, Pᵀ> / <P, P>)`` from the two sums (any shape), 0 where ``<P, P> = 0``: the one formula behind
    :func:`asymmetry_index` and the numba pass."""
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


# Bytes of a float64 block of rows of the sums that mean_lift converts at a time.
_FLOAT64_BLOCK_BYTES = 64 << 20


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
    # cells with S = 0 add 0 to both. The two are large and close for a lift near 1: Σ S log U is summed in float64
    # (in float32 its rounding was 1e-3 of the log lift at 8,000 ids), a block of rows at a time.
    tiny = torch.finfo(torch.float32).tiny  # U = 0 where S = 0; the numba pass clamps it alike
    rows_at_once = max(1, _FLOAT64_BLOCK_BYTES // max(8 * attention_sum[..., :1, :].numel(), 1))
    s_log_u = sum_by_blocks(
        lambda r: (attention_sum[..., r, :].double() * uniform_sum[r].double().clamp(min=tiny).log()).sum((-2, -1)),
        (slice(a, a + rows_at_once) for a in range(0, attention_sum.shape[-2], rows_at_once)),
        attention_sum.new_zeros(attention_sum.shape[:-2]),
    )
    if plogp is None:
        s_log_s = sum_by_blocks(
            lambda r: x_log_x(attention_sum[..., r, :]).sum(dim=-1),
            row_blocks(attention_sum),
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
    exponent = safe_divide(s_log_s - s_log_u, attention_sum.sum(dim=(-2, -1)).double())
    return torch.exp(exponent).to(attention_sum.dtype)


def position_statistics(position_sums: Tensor, query_count: Tensor) -> dict[str, Tensor]:
    """Per-head position-level statistics from the ``position_sums`` state, averaged over query rows.

    With ``R = Σ_a Q[a]`` valid query rows and the per-head sums of :data:`POSITION_STATS`:

    - ``entropy = Σ_i H_i / R``, the mean row entropy in nats, ``H_i = -Σ_j p_ij log p_ij`` with
      ``p_ij = w_ij / Σ_j' w_ij'`` over the valid keys (the row as the model computed it when no attended key is
      ignored);
    - ``entropy_normalized = Σ_i H_i / Σ_i log n_i`` with ``n_i`` the visible keys of row ``i``: 1 = uniform over
      what the query could see, 0 = one key only (rows with one visible key add 0 to both sums; left out when
      every row saw one key, as in length-1 sequences);
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
    result = {
        "entropy": safe_divide(stats["entropy"], rows),
        "entropy_normalized": safe_divide(stats["entropy"], stats["max_entropy"]),
        "self": safe_divide(stats["self"], rows),
        "previous": safe_divide(stats["previous"], rows),
        "next": safe_divide(stats["next"], rows),
        "distance": safe_divide(stats["distance"], rows),
    }
    if not bool((stats["max_entropy"] > 0).any()):  # every row saw one key: 0 / 0, undefined, not a collapse
        del result["entropy_normalized"]
    return result


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


@dataclass
class Drift:
    """Drift of one module's ``P`` against an earlier epoch (see :func:`attention_drift`)."""

    js: Tensor  # weighted row JS of mean_h P, 0-dim
    frobenius: Tensor  # relative Frobenius change of mean_h P, 0-dim
    rows: Tensor  # every row's JS of mean_h P, (Vq,), NaN where a row does not count
    js_heads: Tensor  # (H,)
    frobenius_heads: Tensor  # (H,)


def drift_between(
    mass_heads: Tensor, query_count: Tensor, then: Snapshot, min_support: int, plogp_heads: Tensor | None = None
) -> Drift:
    """Drift of ``P`` per head and of ``mean_h P`` from an earlier epoch's snapshot (moved to ``P``'s device).

    Args:
        mass_heads: ``P`` now, ``(H, Vq, Vk)``.
        query_count: ``Q`` now, ``(Vq,)``.
        then: the earlier epoch.
        min_support: the least query count, in both epochs, of a row that counts.
        plogp_heads: :func:`row_plogp` of ``mass_heads`` when the caller has it.
    """
    device = mass_heads.device

    def here(tensor: Tensor) -> Tensor:  # to a GPU from page-locked memory: asynchronous, in stream order
        return tensor.to(device, non_blocking=device.type == "cuda" and tensor.is_pinned())

    args = (query_count, here(then.query_count), min_support)
    js, frobenius, rows = attention_drift(head_mean(mass_heads), here(then.mean_mass), *args, row_divergence=True)
    then_plogp = here(then.row_plogp) if plogp_heads is not None else None
    js_heads, frobenius_heads = attention_drift(mass_heads, here(then.attention_mass), *args, plogp_heads, then_plogp)
    return Drift(js, frobenius, rows, js_heads, frobenius_heads)


@dataclass
class ModuleSummary:
    """Every scalar of one module's epoch: ``layer[name]`` (0-dim) and, for most, ``heads[name]`` (``(H,)``), named
    as their tags after the prefix (``"entropy"``, ``"position/self"``, ``"drift/js_prev"`` ...)."""

    layer: dict[str, Tensor] = field(default_factory=dict)
    heads: dict[str, Tensor] = field(default_factory=dict)
    drifts: dict[str, Drift] = field(default_factory=dict)  # "prev" / "ref"
    plogp_heads: Tensor | None = None  # row_plogp of P per head, (H, Vq)
    mean_mass: Tensor | None = None  # mean_h P, (Vq, Vk)

    def add(self, name: str, layer: Tensor, heads: Tensor | None = None) -> None:
        self.layer[name] = layer
        if heads is not None:
            self.heads[name] = heads


def _row_pass(mass_heads: Tensor) -> Any:
    """:mod:`attn_callbacks.metrics.summary_numba` where it serves ``P`` (float32 on the CPU, numba running), else
    None."""
    from attn_callbacks.base.numba_loader import uses_numba

    if mass_heads.dtype != torch.float32 or not uses_numba(mass_heads.device):
        return None
    from attn_callbacks.metrics import summary_numba  # imports numba: only once it is known to work

    return summary_numba


def summarize(
    mass_heads: Tensor,
    uniform_sum: Tensor,
    query_count: Tensor,
    position_sums: Tensor,
    skipped_rows: Tensor,
    *,
    square: bool,
    sink_ids: Sequence[int] = (),
    previous: Snapshot | None = None,
    reference: Snapshot | None = None,
    min_support: int = 1,
) -> ModuleSummary:
    """Every scalar the monitor logs for one module: ``skipped_rows``, ``entropy``, ``asymmetry`` (self-attention),
    ``lift``, ``position/{stat}``, ``position/sink_mass`` (with sinks) and ``drift/{js,frobenius}_{prev,ref}`` (with
    snapshots). Layer values are of ``mean_h P`` (position statistics: the mean of the heads).

    On the CPU, where numba runs, the row statistics (entropy, lift, drift) and the asymmetry come from the fused
    passes of :mod:`attn_callbacks.metrics.summary_numba`; elsewhere (and for a non-finite ``P``) from the functions of
    this module and :mod:`attn_callbacks.metrics.drift`, which the tests hold them equal to.

    Args:
        mass_heads: ``P`` per head, ``(H, Vq, Vk)``. The epoch end computes it in the memory of ``S``, so ``Q * P``
            stands in for ``S`` where needed (the torch path's lift, the sink mass).
        uniform_sum: ``U``, ``(Vq, Vk)``.
        query_count: ``Q``, ``(Vq,)``.
        position_sums: ``(len(POSITION_STATS), H)``.
        skipped_rows: 0-dim count.
        square: self-attention (one vocabulary on both axes).
        sink_ids: key indices whose share of attention is ``sink_mass``.
        previous: the previous monitored epoch, for ``drift/*_prev``.
        reference: the reference epoch, for ``drift/*_ref``.
        min_support: the least query count, in both epochs, of a row that counts in the drift.
    """
    out = ModuleSummary()
    out.add("skipped_rows", skipped_rows.float())
    earlier = {id(then.attention_mass): then for then in (previous, reference) if then is not None}
    fast = _row_pass(mass_heads)
    # One fused pass over the rows (numba, CPU); None where P is not finite.
    rows = (
        None if fast is None else fast.row_pass(mass_heads, query_count, uniform_sum, [*earlier.values()], min_support)
    )
    if rows is not None:
        mass, plogp_heads, plogp = rows.mean_mass, rows.plogp[:-1], rows.plogp[-1]
        lift_layer, lift_heads = rows.lift[-1], rows.lift[:-1]
        compared = {
            key: Drift(
                rows.js[k, -1], rows.frobenius[k, -1], rows.rows_js[k, -1], rows.js[k, :-1], rows.frobenius[k, :-1]
            )
            for k, key in enumerate(earlier)
        }
    else:
        attention_sum = mass_heads * query_count[:, None].to(mass_heads.dtype)  # S = Q * P, (H, Vq, Vk)
        mass, sum_mean = head_mean(mass_heads), head_mean(attention_sum)  # P̄ = mean_h S[h] / Q = mean_h P[h]
        # Σ p log p of every row, (H, Vq) and (Vq,): shared by the entropy, the lift and every drift comparison.
        plogp_heads, plogp = row_plogp(mass_heads), row_plogp(mass)
        lift_layer, lift_heads = (
            mean_lift(sum_mean, uniform_sum, plogp),
            mean_lift(attention_sum, uniform_sum, plogp_heads),
        )
        compared = {
            key: drift_between(mass_heads, query_count, then, min_support, plogp_heads) for key, then in earlier.items()
        }
    out.plogp_heads, out.mean_mass = plogp_heads, mass
    out.add("entropy", row_entropy(mass, query_count, plogp), row_entropy(mass_heads, query_count, plogp_heads))
    if square:
        if rows is not None:
            cross, norm = fast.cross_and_norm_sums(mass[None])
            cross_heads, norm_heads = fast.cross_and_norm_sums(mass_heads)
            asymmetry = asymmetry_from_sums(cross[0], norm[0]), asymmetry_from_sums(cross_heads, norm_heads)
            out.add("asymmetry", *(value.to(mass.dtype) for value in asymmetry))
        else:
            out.add("asymmetry", asymmetry_index(mass), asymmetry_index(mass_heads))
    out.add("lift", lift_layer, lift_heads)
    for stat, values in position_statistics(position_sums, query_count).items():
        out.add(f"position/{stat}", values.mean(), values)
    if sink_ids:
        columns = torch.tensor(list(sink_ids), device=mass.device)
        on_sinks = mass_heads[..., columns] * query_count[:, None].to(mass_heads.dtype)  # the sinks' columns of Q * P
        sinks = sink_mass(on_sinks, query_count, torch.arange(len(columns), device=mass.device))
        out.add("position/sink_mass", sinks.mean(), sinks)
    for which, then in (("prev", previous), ("ref", reference)):
        if then is not None:  # the previous epoch is often the reference too: compared once
            drift = out.drifts[which] = compared[id(then.attention_mass)]
            # JS weighs only rows seen min_support times in both epochs: with none, its 0 would read "nothing moved"
            if bool(supported_rows(query_count, then.query_count.to(query_count.device), min_support).any()):
                out.add(f"drift/js_{which}", drift.js, drift.js_heads)
            out.add(f"drift/frobenius_{which}", drift.frobenius, drift.frobenius_heads)
    return out
