"""Epoch sums: one :class:`AttentionAccumulator` per (attention module, dataloader), the memory budget they may hold,
and the per-batch dispatch of weights to them."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor

from attn_callbacks.base.config import format_bytes
from attn_callbacks.base.numba_loader import uses_numba
from attn_callbacks.base.tensor_ops import attention_mass, mean_weight
from attn_callbacks.sums.step import POSITION_STATS, accumulate_attention, pair_index
from attn_callbacks.sums.summed_metric import SummedMetric

__all__ = ["SUM_FIELDS", "AttentionAccumulator", "AttentionStats", "EpochSums", "merge_stats"]


@dataclass(eq=False)
class AttentionStats:
    """What :meth:`AttentionAccumulator.compute` returns; see the glossary in docs/reading.md.

    The raw sums are fields; ``P`` and ``M`` are derived on first access (each is as large as ``S``, and the
    callback never needs ``M``).

    Attributes:
        attention_sum: ``S``, ``(H, Vq, Vk)`` float32; None in the callback's epoch end once ``P`` was computed in
            its memory (``S`` is not needed again, and ``Q * P`` gives it back).
        pair_count: ``C``, ``(Vq, Vk)`` int64.
        query_count: ``Q``, ``(Vq,)`` int64.
        skipped_rows: number of valid query rows dropped because their weights were not finite, or all zero
            (0-dim int64).
        uniform_sum: ``U``, the uniform-attention baseline, ``(Vq, Vk)`` float32 (see
            :func:`attn_callbacks.functional.lift`).
        position_sums: ``(len(POSITION_STATS), H)`` float32 position-level sums (see
            :func:`attn_callbacks.functional.position_statistics`).
    """

    attention_sum: Tensor | None
    pair_count: Tensor
    query_count: Tensor
    skipped_rows: Tensor
    uniform_sum: Tensor
    position_sums: Tensor

    @cached_property
    def attention_mass(self) -> Tensor:
        """``P = S / Q[:, None]`` per head, ``(H, Vq, Vk)`` (see :func:`attn_callbacks.functional.attention_mass`)."""
        return attention_mass(self.attention_sum, self.query_count)

    @cached_property
    def mean_weight(self) -> Tensor:
        """``M = S / C`` per head, ``(H, Vq, Vk)`` (see :func:`attn_callbacks.functional.mean_weight`)."""
        return mean_weight(self.attention_sum, self.pair_count)


#: The raw sums of :class:`AttentionStats`, in field order. This is also the export file format (see
#: :func:`attn_callbacks.save_epoch`): never reorder or rename.
SUM_FIELDS = tuple(field.name for field in fields(AttentionStats))


def merge_stats(parts: Sequence[AttentionStats]) -> AttentionStats:
    """The statistics of the union of several disjoint sets of batches (e.g. validation dataloaders): every raw sum
    added, ``P`` and ``M`` derived again (never averaged)."""
    if not parts:
        raise ValueError("Expected at least one AttentionStats to merge, but got none")
    return AttentionStats(*(sum(getattr(part, field) for part in parts) for field in SUM_FIELDS))


class AttentionAccumulator(SummedMetric):
    """Running vocabulary × vocabulary attention sums for one attention module.

    States (all ``dist_reduce_fx="sum"``, so DDP ranks add up), packed for the fast path of
    :func:`attn_callbacks.functional.accumulate_attention`: ``sums (H + 1, Vq * Vk)`` holds ``S`` per head and the
    uniform baseline ``U``, ``pair_count (Vq * Vk,)`` and ``query_count (Vq,)``; plus ``skipped_rows`` and
    ``position_sums (len(POSITION_STATS), H)``. Updates never sync with the host. Division happens only in
    :meth:`compute`, which returns the usual shapes.

    Args:
        num_heads: number of attention heads ``H``.
        query_vocab_size: size ``Vq`` of the vocabulary of the query tokens.
        key_vocab_size: size ``Vk`` of the vocabulary of the key tokens.
        mean_of_heads: keep ``mean_h S[h]`` only (``attention_sum`` then has one row): ``16·Vq·Vk`` bytes of sums
            instead of ``(4H + 12)·Vq·Vk``, and a lighter update; position sums stay per head.

    Example:
        >>> acc = AttentionAccumulator(num_heads=1, query_vocab_size=3, key_vocab_size=3)
        >>> ids = torch.tensor([[1, 2]])
        >>> valid = torch.ones(1, 2, dtype=torch.bool)
        >>> acc.update(torch.tensor([[[[0.25, 0.75], [1.0, 0.0]]]]), ids, ids, valid, valid)
        >>> acc.compute().attention_mass[0, 1].tolist()
        [0.0, 0.25, 0.75]
    """

    is_differentiable = False
    higher_is_better = None
    full_state_update = False

    sums: Tensor
    pair_count: Tensor
    query_count: Tensor
    skipped_rows: Tensor
    position_sums: Tensor

    def __init__(
        self, num_heads: int, query_vocab_size: int, key_vocab_size: int, mean_of_heads: bool = False, **kwargs
    ) -> None:
        super().__init__(**kwargs)
        for name, value in (
            ("num_heads", num_heads),
            ("query_vocab_size", query_vocab_size),
            ("key_vocab_size", key_vocab_size),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Expected argument `{name}` to be a positive integer, but got {value!r}")
        self.num_heads = num_heads
        self.query_vocab_size = query_vocab_size
        self.key_vocab_size = key_vocab_size
        self.mean_of_heads = bool(mean_of_heads)
        for name, (shape, dtype) in self._state_shapes(num_heads, query_vocab_size, key_vocab_size, mean_of_heads):
            self.add_sum(name, shape, dtype)

    @staticmethod
    def _state_shapes(
        num_heads: int, query_vocab_size: int, key_vocab_size: int, mean_of_heads: bool
    ) -> list[tuple[str, tuple[tuple[int, ...], torch.dtype]]]:
        """Every state's shape and dtype: the one definition that allocation and :meth:`state_bytes` share."""
        plane = query_vocab_size * key_vocab_size
        return [
            ("sums", (((1 if mean_of_heads else num_heads) + 1, plane), torch.float32)),
            ("pair_count", ((plane,), torch.long)),
            ("query_count", ((query_vocab_size,), torch.long)),
            ("skipped_rows", ((), torch.long)),
            # float32 like the other sums: float64 states would not move to MPS devices.
            ("position_sums", ((len(POSITION_STATS), num_heads), torch.float32)),
        ]

    @staticmethod
    def state_bytes(num_heads: int, query_vocab_size: int, key_vocab_size: int, mean_of_heads: bool = False) -> int:
        """Bytes of state one accumulator holds: ``(H + 1) · Vq · Vk · 4 + Vq · Vk · 8 + Vq · 8``
        plus a few scalars (float32 sums, int64 counts); ``H`` counts as 1 with ``mean_of_heads``."""
        shapes = AttentionAccumulator._state_shapes(num_heads, query_vocab_size, key_vocab_size, mean_of_heads)
        return sum(math.prod(shape) * dtype.itemsize for _, (shape, dtype) in shapes)

    def update(
        self,
        weights: Tensor,
        query_ids: Tensor,
        key_ids: Tensor,
        query_valid: Tensor,
        key_valid: Tensor,
        pairs: Tensor | None = None,
        hot_cell: int | None = None,
        compiled: bool = False,
    ) -> None:
        """Add one batch of weights ``(B, H, Lq, Lk)`` with the ``(B, Lq)`` / ``(B, Lk)`` ids and validity of its
        queries and keys (ids in ``[0, Vq)`` / ``[0, Vk)`` at valid positions).

        ``pairs`` is :func:`attn_callbacks.functional.pair_index` of the ids, when the caller already has it (it
        depends on the ids only, so modules reading the same streams can share it); computed from the ids when the
        torch kernel needs it. The numba kernel (on CPU, see :func:`attn_callbacks.base.numba_loader.uses_numba`) reads
        the ids instead. ``hot_cell`` and ``compiled``: see :func:`attn_callbacks.sums.step.accumulate_attention`.
        """
        if self.summed_in_place:
            raise RuntimeError(
                "AttentionAccumulator.update: the state holds every process's sums (stats(in_place=True)); adding to "
                "it would count them again. reset() first"
            )
        if not self.allocated:
            raise RuntimeError("AttentionAccumulator.update: the sums' memory was released; allocate() first")
        skipped = accumulate_attention(
            self.sums,
            self.pair_count,
            self.query_count,
            self.position_sums,
            weights,
            pairs,
            query_ids,
            query_valid,
            key_valid,
            key_ids=key_ids,
            hot_cell=hot_cell,
            compiled=compiled,
        )
        self.skipped_rows += skipped

    def compute(self) -> AttentionStats:
        """The (process-summed) sums and counts in their usual shapes; ``P = S / Q`` and
        ``M = S / C`` per head are derived on access. torchmetrics returns a copy; see :meth:`stats` for views."""
        return self._unpack()

    def shape_result(self, result: AttentionStats) -> AttentionStats:
        """Undo torchmetrics' squeeze of every one-element tensor in the result (a vocabulary of one id): each field
        keeps the shape :class:`AttentionStats` documents."""
        heads, vocab_q, vocab_k = self.sums.shape[0] - 1, self.query_vocab_size, self.key_vocab_size
        return AttentionStats(
            result.attention_sum.reshape(heads, vocab_q, vocab_k),
            result.pair_count.reshape(vocab_q, vocab_k),
            result.query_count.reshape(vocab_q),
            result.skipped_rows,
            result.uniform_sum.reshape(vocab_q, vocab_k),
            result.position_sums,  # (len(POSITION_STATS), H): never one element
        )

    def stats(self, in_place: bool = False) -> AttentionStats:
        """What :meth:`compute` returns, summed across processes like it, but as views of the state, without the copy
        torchmetrics makes (hundreds of MB for a large vocabulary). Valid until the next update or reset.

        Args:
            in_place: under DDP, sum across processes into the state itself. The usual sync first copies the local
                state to restore afterwards (a second copy of the state on each device); in place keeps none, for a
                caller that resets right after. Until :meth:`reset`, :attr:`summed_in_place` is true and
                :meth:`update` and :meth:`stats` refuse. The same as the default in a single process.
        """
        if self.summed_in_place:
            raise RuntimeError(
                "AttentionAccumulator.stats: the state was already summed across processes in place; reset() first"
            )
        if not in_place:
            with self.sync_context(dist_sync_fn=self.dist_sync_fn):
                return self._unpack()
        self.sum_in_place()
        return self._unpack()

    def _unpack(self) -> AttentionStats:
        heads, vocab_q, vocab_k = self.sums.shape[0] - 1, self.query_vocab_size, self.key_vocab_size
        plane = self.sums.view(heads + 1, vocab_q, vocab_k)  # (channels + 1, Vq, Vk)
        return AttentionStats(
            attention_sum=plane[:heads],
            pair_count=self.pair_count.view(vocab_q, vocab_k),
            query_count=self.query_count,
            skipped_rows=self.skipped_rows,
            uniform_sum=plane[heads],
            position_sums=self.position_sums,
        )


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
        self._calls: set[str] = set()  # modules that ran in this batch
        self._warned: set[str] = set()  # modules warned of for running more than once in a batch
        self._logged_total = 0  # the bytes of sums last logged: logged again when SDPA calls add to them

    def state_bytes(self, shapes: Mapping[str, tuple[int, int, int]], loaders: int) -> dict[str, int]:
        """Bytes of sums each module will hold per device (all its dataloaders); ``shapes``: module -> ``(H, Vq,
        Vk)``."""
        return {
            name: loaders * AttentionAccumulator.state_bytes(*shape, not self.per_head)
            for name, shape in shapes.items()
        }

    def check_budget(self, shapes: Mapping[str, tuple[int, int, int]], loaders: int, log: bool = True) -> None:
        """Log the bytes the sums will hold (once, and again when they grow: SDPA calls allocate theirs at the first
        call), and refuse with the figure and the knobs when over budget."""
        per_module = self.state_bytes(shapes, loaders)
        total = sum(per_module.values())
        budget = self.memory_budget
        if log and total > self._logged_total and loaders > 0 and per_module:
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
        self._calls.clear()

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
    ) -> None:
        """Add one call's weights ``(b, H, Lq, Lk)`` with the ``(ids, valid)`` of its query and key stream, for the
        samples ``rows`` of the batch (all when None; the later chunks of a call are not another call). ``other``: the
        accumulated ids of ``<other>`` in both streams, where both are tracked (their cell is summed apart on a GPU)."""
        first = rows is None or rows.start == 0
        if first and name in self._calls and name not in self._warned:
            self._warned.add(name)
            rank_zero_warn(
                f"AttentionMonitor: attention module {name!r} ran more than once in one batch (one module shared "
                "by several layers, as in ALBERT, or called in a loop): its sums add up every call, so its maps "
                "and numbers mix those calls; the probe shows the last one. Every call is read against the batch's "
                "ids of the module's streams: a call over other tokens of the same shape (one encoder run on a "
                "second input, say) is summed as if it saw those ids; leave such a module out with `modules`.",
            )
        self._calls.add(name)
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
            weights, query[0], key[0], query[1], key[1], pairs=pairs, hot_cell=hot_cell, compiled=self.compile_step
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
