"""Epoch sums: one :class:`~attn_callbacks.sums.accumulator.AttentionAccumulator` per (attention module, dataloader),
the memory budget they may hold, and the per-batch dispatch of weights to them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from attn_callbacks.base.config import format_bytes
from attn_callbacks.base.numba_loader import uses_numba
from attn_callbacks.sums.accumulator import AttentionAccumulator, AttentionStats, merge_stats
from attn_callbacks.sums.step import pair_index

__all__ = ["EpochSums"]


class EpochSums:
    """The sums of the epoch being monitored: an :class:`AttentionAccumulator` per (module, dataloader index), on the
    module's device, allocated once and zeroed in place between epochs.

    Args:
        per_head: keep ``S`` per head (else the mean of the heads only).
        memory_budget: the most bytes of sums per device, or None for no limit.
        compile_step: run the torch step's per-batch terms through ``torch.compile``.
    """

    def __init__(self, per_head: bool = True, memory_budget: int | None = None, compile_step: bool = False) -> None:
        self.per_head = per_head
        self.memory_budget = memory_budget
        self.compile_step = compile_step
        self.metrics: dict[tuple[str, int], AttentionAccumulator] = {}
        self.loaders = 1  # dataloaders of the epoch being monitored
        self._pairs: dict[tuple, Tensor] = {}  # this batch's pair index per (query, key) stream and rows
        self._logged_total = 0  # the bytes of sums last logged: logged again when SDPA calls add to them

    def state_bytes(self, shapes: Mapping[str, tuple[int, int, int]], loaders: int) -> dict[str, int]:
        """Bytes of sums each module will hold per device (all its dataloaders); ``shapes``: module -> ``(H, Vq,
        Vk)``."""
        return {
            name: loaders * AttentionAccumulator.state_bytes(*shape, not self.per_head)
            for name, shape in shapes.items()
        }

    def check_budget(self, shapes: Mapping[str, tuple[int, int, int]], loaders: int, log: bool = True) -> None:
        """Log the bytes the sums will hold (once, and again when the figure changes: SDPA calls allocate theirs at the
        first call; a tracked stream counts with its limit until its ids are chosen, often fewer), and refuse with the
        figure and the knobs when over budget."""
        per_module = self.state_bytes(shapes, loaders)
        total = sum(per_module.values())
        budget = self.memory_budget
        if log and total != self._logged_total and loaders > 0 and per_module:
            self._logged_total = total
            rank_zero_info(
                f"AttentionMonitor: {len(per_module)} attention module(s) × {loaders} dataloader(s) will hold "
                f"{format_bytes(total)} of attention sums per device (memory_budget: "
                f"{'none' if budget is None else format_bytes(budget)})"
            )
        if budget is None or total <= budget:
            return
        largest = max(per_module, key=per_module.__getitem__)
        _, vocab_q, vocab_k = shapes[largest]
        raise MisconfigurationException(
            f"AttentionMonitor would hold {format_bytes(total)} of attention sums per device "
            f"({len(per_module)} module(s) × {loaders} dataloader(s); the largest, {largest!r}, "
            f"{format_bytes(per_module[largest])} for a {vocab_q} × {vocab_k} vocabulary), over argument "
            f"`memory_budget`={format_bytes(budget)}. Sums grow with the square of the vocabulary: set "
            "`max_tracked_tokens` (e.g. 2048 keeps exact sums for the 2048 most frequent ids and folds the rest into "
            "<other>), or `per_head=False` (the mean of the heads only), or select fewer modules with `modules`, or "
            "raise `memory_budget` (None disables the check)."
        )

    def start(
        self, shapes: Mapping[str, tuple[int, int, int]], devices: Mapping[str, torch.device], loaders: int
    ) -> None:
        """Zeroed sums for every (module, dataloader) on the module's device; budget checked before any allocation."""
        self.check_budget(shapes, loaders)
        self.loaders = loaders
        kept = {}
        for key, metric in self.metrics.items():
            if key[0] in shapes and key[1] < loaders and _shape_of(metric) == tuple(shapes[key[0]]):
                kept[key] = metric
            else:  # fewer loaders than last time, or a module of an earlier stage's model (fit, then validate another)
                metric.release_all()  # before the new sums: torchmetrics' reference cycles would hold it until a GC
        self.metrics = {}  # in the order of `shapes`: the modules' order in what is logged
        with torch.inference_mode(False):  # state tensors must be normal tensors, not inference tensors
            for name, shape in shapes.items():
                for idx in range(loaders):
                    metric = kept.get((name, idx))
                    if metric is None:
                        metric = self._accumulator(shape)
                    self.metrics[(name, idx)] = metric
                    metric.to(devices[name])
                    metric.allocate()  # memory released at the last epoch's end (see reset)
                    if metric.update_count or metric.summed_in_place:  # an interrupted epoch's; else zero
                        metric.reset()

    def allocate(self, name: str, shape: tuple[int, int, int], device: torch.device) -> None:
        """Zeroed sums ``(H, Vq, Vk)`` for every dataloader of a module first seen mid-epoch (an SDPA call), with the
        budget checked over all the sums held. Under DDP the check waits for :meth:`collect`, after :meth:`agree`, so
        that every process refuses together (processes may see different calls; one refusing alone would leave the
        others waiting in a collective)."""
        if not _distributed():
            self.check_budget({**self._shapes(), name: shape}, self.loaders, log=False)  # logged by collect()
        self._add(name, shape, device)

    def _accumulator(self, shape: tuple[int, int, int]) -> AttentionAccumulator:
        return AttentionAccumulator(*shape, mean_of_heads=not self.per_head)

    def _add(self, name: str, shape: tuple[int, int, int], device: torch.device) -> None:
        """Zeroed sums of a module for every dataloader of the epoch, on ``device``."""
        with torch.inference_mode(False):  # state tensors must be normal tensors, not inference tensors
            for idx in range(self.loaders):
                self.metrics[(name, idx)] = self._accumulator(shape).to(device)

    def start_batch(self) -> None:
        self._pairs.clear()

    def add(
        self,
        name: str,
        dataloader_idx: int,
        streams: tuple[str, str],
        weights: Tensor,
        query: tuple[Tensor, Tensor],
        key: tuple[Tensor, Tensor],
        rows: slice | None = None,
        other: tuple[int, int] | None = None,
        allowed: Tensor | None = None,
    ) -> None:
        """Add one call's weights ``(b, H, Lq, Lk)`` with the ``(ids, valid)`` of its query and key stream, for the
        samples ``rows`` of the batch (all when None; the later chunks of a call are not another call). ``other``: the
        accumulated ids of ``<other>`` in both streams, where both are tracked (their cell is summed apart on a GPU).
        ``allowed``: the keys the call's mask allows, broadcastable to ``(b, Lq, Lk)``, or None."""
        metric = self.metrics[(name, dataloader_idx)]
        # The pair index depends on the ids only: one per batch for all modules reading the same streams. The numba
        # kernel reads the ids themselves and needs none.
        pairs = None
        if not uses_numba(weights.device):
            where = (*streams, None) if rows is None else (*streams, rows.start, rows.stop)
            pairs = self._pairs.get(where)
            if pairs is None or pairs.device != weights.device:
                pairs = pair_index(query[0], key[0], query[1], key[1], metric.query_vocab_size, metric.key_vocab_size)
                self._pairs[where] = pairs
        hot_cell = None if other is None else other[0] * metric.key_vocab_size + other[1]
        metric.update(
            weights,
            query[0],
            key[0],
            query[1],
            key[1],
            pairs=pairs,
            hot_cell=hot_cell,
            compiled=self.compile_step,
            allowed=allowed,
        )

    def agree(self, device: torch.device) -> dict[str, tuple[int, int, int]]:
        """Under DDP, give every process the sums that any process allocated mid-epoch (zeroed where it never saw that
        SDPA call), all in one order, so that they are reduced alike; a collective. Returns the modules added here and
        their ``(H, Vq, Vk)``; nothing without a process group of several processes."""
        dist = torch.distributed
        if not _distributed():
            return {}
        shapes = self._shapes()
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, list(shapes.items()))
        agreed = dict(pair for part in everyone for pair in part)  # first seen first: the same order everywhere
        added = {name: shape for name, shape in agreed.items() if name not in shapes}
        for name, shape in added.items():
            self._add(name, shape, device)
        self.metrics = {(name, idx): self.metrics[(name, idx)] for name in agreed for idx in range(self.loaders)}
        return added

    def _shapes(self) -> dict[str, tuple[int, int, int]]:
        return {name: _shape_of(metric) for (name, _), metric in self.metrics.items()}

    def collect(self) -> tuple[dict[tuple[str, int], AttentionStats], dict[str, AttentionStats]]:
        """Every (module, dataloader)'s statistics and every module's over all dataloaders. A collective under DDP:
        views of the state, summed in place with no copy, valid until :meth:`reset`."""
        self.check_budget(self._shapes(), self.loaders)  # logs the figure again where SDPA calls added sums
        per_loader = {key: metric.stats(in_place=True) for key, metric in self.metrics.items()}
        loaders = 1 + max((idx for _, idx in per_loader), default=0)
        merged = {
            name: merge_stats([per_loader[(name, idx)] for idx in range(loaders)]) if loaders > 1 else stats
            for (name, idx), stats in per_loader.items()
            if idx == 0
        }
        return per_loader, merged

    def reset(self, recycle: Callable[[str, Tensor], Tensor | None] | None = None) -> None:
        """Zero the sums for the next epoch. ``recycle(module, sums)`` gives the memory for a module's next packed
        sums: ``sums`` itself, or another buffer of its shape when something else now keeps ``sums`` (drift memory
        keeps the ``P`` computed where ``S`` lay), both zeroed here; or None for fresh memory at the next
        :meth:`start`."""
        for (name, _), metric in self.metrics.items():
            buffer = metric.sums if recycle is None else recycle(name, metric.sums)
            if buffer is not metric.sums:
                metric.release("sums", buffer)
            metric.reset()
        self._pairs.clear()


def _shape_of(metric: AttentionAccumulator) -> tuple[int, int, int]:
    """The ``(H, Vq, Vk)`` an accumulator was made for."""
    return metric.num_heads, metric.query_vocab_size, metric.key_vocab_size


def _distributed() -> bool:
    """Whether this process is one of several in a process group."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
