"""The memory drift compares against: the previous and the reference monitored epoch's ``P`` per module (with its own
``state_dict``), kept on the host (page-locked where the device is a GPU), with the memory of a retired epoch recycled.
The math that compares them is :mod:`attn_callbacks.metrics.drift`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from attn_callbacks.base.tensor_ops import row_plogp
from attn_callbacks.metrics.drift import Snapshot, head_mean

__all__ = ["DriftMemory"]


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

    def snapshots(
        self, name: str, shape: torch.Size
    ) -> tuple[Snapshot | None, Snapshot | None, list[tuple[int | None, tuple[int, ...]]]]:
        """(previous, reference, lost) of one module. ``lost``: the kept epochs whose ``P`` has another shape than
        ``shape`` (a resume into a monitor of another vocabulary or model under the same name), as (epoch, shape):
        nothing comparable, so None in their place, and both None when the previous one is lost."""
        previous, reference = self.previous.get(name), self.reference.get(name)
        lost: list[tuple[int | None, tuple[int, ...]]] = []
        for epoch, snapshot in ((self.previous_epoch, previous), (self.reference_epoch, reference)):
            if snapshot is not None and tuple(snapshot["attention_mass"].shape) != tuple(shape):
                if (epoch, tuple(snapshot["attention_mass"].shape)) not in lost:  # the previous epoch is the reference
                    lost.append((epoch, tuple(snapshot["attention_mass"].shape)))
                previous, reference = (None, None) if snapshot is previous else (previous, None)
        return _complete(previous), _complete(reference), lost

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
        """Keep this epoch as the previous one, and as the reference when it is the reference epoch. A module that saw
        no query token in this epoch (it did not run, or every row it gave was dropped) is left out: drift against
        it would compare with a ``P`` of zeros and read "nothing moved", so the next epoch logs no drift for that
        module against this one.

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
            if int(count.sum()) == 0:
                continue
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
        if not snapshot:  # no module saw a token (all NaN): no epoch to compare with, least of all the reference
            return
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
