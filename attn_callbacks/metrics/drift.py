"""Drift: how far an epoch's attention mass moved from an earlier one, and the memory of those earlier epochs.

The math (:func:`js_divergence`, :func:`attention_drift`, :func:`moved_tokens`) is pure; :class:`DriftMemory` keeps
the previous and the reference monitored epoch's ``P`` (with its own ``state_dict``) and recycles the memory of a
retired one.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from attn_callbacks.base.tensor_ops import row_blocks, row_plogp, rows_per_block, safe_divide, sum_by_blocks, x_log_x

__all__ = ["DriftMemory", "Snapshot", "attention_drift", "head_mean", "js_divergence", "moved_tokens"]


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


class DriftMemory:
    """The previous and the reference monitored epoch's ``P`` per module, what drift compares against.

    Args:
        reference_epoch: the epoch to keep as the reference; the first remembered one when None. When it is never
            remembered, the first remembered epoch after it is the reference, with a warning.
        log_every_n_epochs: named in that warning.
    """

    def __init__(self, reference_epoch: int | None = None, log_every_n_epochs: int = 1) -> None:
        self.wanted_reference = reference_epoch
        self.log_every_n_epochs = log_every_n_epochs
        # module -> {"attention_mass": (H, Vq, Vk), "query_count": (Vq,), "row_plogp": (H, Vq), "mean_mass"} on CPU.
        self.previous: dict[str, dict[str, Tensor]] = {}
        self.reference: dict[str, dict[str, Tensor]] = {}
        self.previous_epoch: int | None = None
        self.reference_epoch: int | None = None
        self._warned = False
        # Per module, the P of a snapshot that no longer serves and that nothing else holds: its memory serves again,
        # as the next epoch's sums (P is computed where S lay, in the packed state; see state_buffer) or as the CPU
        # copy of a P on another device. A fresh tensor of hundreds of MB costs its page faults on every epoch
        # (measured 10x the division itself).
        self._spare: dict[str, Tensor] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_spare": {}}  # a cache, rebuilt where needed

    def snapshots(self, name: str, shape: torch.Size) -> tuple[Snapshot | None, Snapshot | None]:
        """(previous, reference) of one module, or None each; None for an epoch whose ``P`` had another shape (a
        different model under the same name, say after a resume: nothing comparable), and both None when the
        previous one had."""
        previous, reference = self.previous.get(name), self.reference.get(name)
        if previous is not None and tuple(previous["attention_mass"].shape) != tuple(shape):
            return None, None
        if reference is not None and tuple(reference["attention_mass"].shape) != tuple(shape):
            reference = None  # kept from before a resume into another model: nothing comparable
        return _complete(previous), _complete(reference)

    def incomparable(self, name: str, shape: torch.Size) -> list[tuple[int | None, tuple[int, ...]]]:
        """The kept epochs of a module (previous, reference) whose ``P`` has another shape than ``shape``, with that
        shape: drift against them cannot be computed (a resume into a monitor of another vocabulary, say)."""
        kept = ((self.previous_epoch, self.previous.get(name)), (self.reference_epoch, self.reference.get(name)))
        found = []
        for epoch, snapshot in kept:
            if snapshot is not None and tuple(snapshot["attention_mass"].shape) != tuple(shape):
                found.append((epoch, tuple(snapshot["attention_mass"].shape)))
        return found

    def take_spare(
        self, name: str, shape: torch.Size, dtype: torch.dtype, device: torch.device, pinned: bool = False
    ) -> Tensor | None:
        """The module's spare buffer, if it can receive a ``P`` of this shape, dtype and device here (an inference
        tensor can only be written inside inference mode, a normal one only outside), in page-locked memory when
        ``pinned``; a spare that no longer fits is dropped (a resumed checkpoint's pageable ``P`` included)."""
        spare = self._spare.get(name)
        if spare is None:
            return None
        if (spare.shape, spare.dtype, spare.device) != (shape, dtype, device) or (pinned and not spare.is_pinned()):
            del self._spare[name]
            return None
        if spare.is_inference() != torch.is_inference_mode_enabled():
            return None
        return self._spare.pop(name)

    def state_buffer(self, name: str, sums: Tensor) -> Tensor | None:
        """The memory for a module's next epoch of packed sums, given ``sums``, the packed state that held this
        epoch's: ``sums`` itself unless a snapshot keeps that memory (its ``P`` was computed where ``S`` lay); then
        the packed state that a retired snapshot's ``P`` was computed in, when there is one that fits; else None."""
        spare = self._spare.get(name)
        packed = spare is not None and _lies_at_start(spare, sums)
        if spare is not None and not packed and sums.device.type == "cpu":
            # A P of its own (several dataloaders', a resumed checkpoint's): on the CPU nothing would write into it.
            del self._spare[name]
        held = {_memory(m[n]["attention_mass"]) for m in (self.previous, self.reference) for n in m}
        if sums.numel() == 0 or _memory(sums) not in held:
            return sums
        if not packed:
            return None
        del self._spare[name]
        with torch.inference_mode(False):  # a normal tensor: the next epoch adds to it in and out of inference mode
            return torch.empty(0, dtype=sums.dtype, device=sums.device).set_(spare.untyped_storage(), 0, sums.shape)

    def remember(self, epoch: int, masses: Mapping[str, tuple[Tensor, Tensor, Mapping[str, Tensor]]]) -> None:
        """Keep this epoch as the previous one, and as the reference when it is the reference epoch.

        Args:
            epoch: the training epoch.
            masses: module -> (``P`` per head, ``Q``, what the epoch end already derived of them: ``row_plogp``,
                ``mean_mass``); ``P`` is kept as it is on the CPU (a tensor of its own, or a view of the module's
                packed sums, which the caller then lets go: see :meth:`state_buffer`); from another device every
                part is copied to the CPU, into page-locked memory from a GPU (a retired snapshot's where one
                fits); ``Q`` is copied.
        """
        snapshot = {}
        for name, (mass, count, derived) in masses.items():
            mass = mass.detach()
            parts = {**derived}
            if "row_plogp" not in parts:
                parts["row_plogp"] = row_plogp(mass)
            spare = None
            if mass.device.type != "cpu":
                spare = self.take_spare(name, mass.shape, mass.dtype, torch.device("cpu"), _pins(mass))
            parts = {key: _to_host(value) for key, value in parts.items()}
            count = count.clone() if count.device.type == "cpu" else _to_host(count)
            snapshot[name] = {"attention_mass": _to_host(mass, spare), "query_count": count, **parts}
            kept = self.reference.get(name)
            if _pins(mass) and kept is not None:  # a resumed checkpoint's reference: pinned once, for its copies back
                kept.update({key: _to_host(value, pin=True) for key, value in kept.items()})
        for device in {mass.device for mass, _, _ in masses.values() if mass.is_cuda}:
            torch.cuda.synchronize(device)  # the copies into pinned memory are asynchronous: done before any host read
        retired, kept = self.previous, self.reference
        self.previous, self.previous_epoch = snapshot, epoch
        wanted = self.wanted_reference
        if self.reference_epoch is None and (wanted is None or epoch >= wanted):
            self.reference, self.reference_epoch = snapshot, epoch
            if wanted is not None and epoch > wanted and not self._warned:
                self._warned = True
                rank_zero_warn(
                    f"AttentionMonitor: argument `drift_reference_epoch`={wanted} names an epoch that was not "
                    f"monitored (no validation then, `log_every_n_epochs`={self.log_every_n_epochs} skipped it, or it "
                    f"saw no token); epoch {epoch}, the first monitored one after it, is the drift reference instead",
                )
        self._recycle(retired, (kept, self.reference, snapshot))

    def _recycle(self, retired: dict[str, dict[str, Tensor]], live: tuple[dict[str, dict[str, Tensor]], ...]) -> None:
        """Keep a retired ``P`` as the next spare where no snapshot still in use shares its memory. The memory is
        drift memory's own: like ``nn.Module.state_dict``, :meth:`state_dict` hands out these tensors themselves, so
        a caller keeping one past the next epoch end copies it (Lightning's checkpoint IO, async included, has
        written or cloned it by then)."""
        in_use = {_memory(m[name]["attention_mass"]) for m in live for name in m}
        for name, memory in retired.items():
            mass = memory["attention_mass"]
            if _memory(mass) not in in_use:
                self._spare[name] = mass

    def state_dict(self) -> dict[str, Any]:
        """Snapshots without what is derived again (``mean_mass``), each tensor alone in its memory: checkpoints stay
        ``1 / H`` smaller. The tensors are drift memory's own, reused at a later epoch end: copy them to keep them."""
        copies: dict[tuple, Tensor] = {}  # one copy of a P that is both previous and reference
        return {
            "previous_epoch": self.previous_epoch,
            "reference_epoch": self.reference_epoch,
            "previous": _checkpointed(self.previous, copies),
            "reference": _checkpointed(self.reference, copies),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.previous_epoch, self.reference_epoch = state["previous_epoch"], state["reference_epoch"]
        self.previous, self.reference = state["previous"], state["reference"]
        self._spare.clear()


def _to_host(tensor: Tensor, out: Tensor | None = None, pin: bool = False) -> Tensor:
    """``tensor`` on the CPU: itself there (with ``pin``, a page-locked copy of it where it is not), else copied into
    ``out`` or into new page-locked memory, asynchronously from a GPU (the caller synchronises). From a GPU, a copy
    into pageable memory goes through a staging buffer at a fraction of the bus' speed (drift memory moves ``P`` out
    at every epoch end, and back in for the comparisons: ~0.2 s for a BERT-base model from pageable memory);
    page-locked memory cannot be swapped out, which memory read every epoch never should be anyway."""
    pin = (pin or tensor.is_cuda) and not _PAGEABLE
    if tensor.device.type == "cpu" and (not pin or tensor.is_pinned()):
        return tensor
    if out is None:
        out = _host_empty(tensor, pin)
    return out.copy_(tensor, non_blocking=tensor.is_cuda and out.is_pinned())


def _pins(tensor: Tensor) -> bool:
    """Whether host copies of ``tensor`` go to page-locked memory: from a CUDA device, unless the driver refused."""
    return tensor.is_cuda and not _PAGEABLE


def _host_empty(like: Tensor, pin: bool) -> Tensor:
    """Host memory for a copy of ``like``, page-locked when ``pin``; pageable, with one warning per process, when the
    driver refuses page-locked memory (and from then on)."""
    if pin:
        try:
            return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
        except RuntimeError as error:
            _PAGEABLE.append(error)
            # Every rank copies for itself: warned on each, not only on rank 0.
            warnings.warn(
                f"AttentionMonitor: no page-locked host memory for drift memory's copy of a {tuple(like.shape)} "
                f"tensor ({error}); keeping its copies in pageable memory, whose transfers are slower.",
                stacklevel=2,
            )
    return torch.empty(like.shape, dtype=like.dtype)


_PAGEABLE: list[BaseException] = []  # the error that refused page-locked memory, once one did (warned once)


def _memory(tensor: Tensor) -> tuple[torch.device, int]:
    """Where a tensor's memory lies (a GPU address may equal a host one)."""
    return tensor.device, tensor.untyped_storage().data_ptr()


def _lies_at_start(mass: Tensor, sums: Tensor) -> bool:
    """Whether ``mass`` is a ``P`` computed in place in a packed state of ``sums``' size: at the start of memory of
    exactly that many bytes, with its dtype and device."""
    memory = mass.untyped_storage()
    return (
        (mass.dtype, mass.device) == (sums.dtype, sums.device)
        and mass.storage_offset() == 0
        and memory.nbytes() == sums.numel() * sums.element_size()
    )


def _complete(memory: dict[str, Tensor] | None) -> Snapshot | None:
    """A snapshot with every part: ``row_plogp`` (left out by checkpoints of older versions) and ``mean_mass`` (left
    out by every checkpoint) computed once, then kept."""
    if memory is None:
        return None
    if "row_plogp" not in memory:
        memory["row_plogp"] = row_plogp(memory["attention_mass"])
    if "mean_mass" not in memory:
        memory["mean_mass"] = head_mean(memory["attention_mass"])
    return Snapshot(memory["attention_mass"], memory["query_count"], memory["row_plogp"], memory["mean_mass"])


def _checkpointed(snapshots: dict[str, dict[str, Tensor]], copies: dict[tuple, Tensor]) -> dict[str, dict[str, Tensor]]:
    kept = {name: {k: v for k, v in part.items() if k != "mean_mass"} for name, part in snapshots.items()}
    return {name: {k: _alone(v, copies) for k, v in part.items()} for name, part in kept.items()}


def _alone(tensor: Tensor, copies: dict[tuple, Tensor]) -> Tensor:
    """``tensor``, or a copy of it where it is a view of more memory (a ``P`` computed in the packed state, beside
    ``U``: a checkpoint holds the whole memory of every tensor it saves), made once per memory in ``copies``."""
    if tensor.untyped_storage().nbytes() <= tensor.numel() * tensor.element_size():
        return tensor
    key = (tensor.device, tensor.data_ptr(), tuple(tensor.shape))
    if key not in copies:
        copies[key] = tensor.clone()
    return copies[key]
