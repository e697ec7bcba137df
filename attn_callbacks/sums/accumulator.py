"""One module's running sums (:class:`AttentionAccumulator`, a torchmetrics ``Metric``) and what they give at an
epoch's end (:class:`AttentionStats`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import cached_property

import torch
from torch import Tensor

from attn_callbacks.base.tensor_ops import attention_mass, mean_weight
from attn_callbacks.sums.step import POSITION_STATS, accumulate_attention
from attn_callbacks.sums.summed_metric import SummedMetric

__all__ = ["SUM_FIELDS", "AttentionAccumulator", "AttentionStats", "merge_stats"]


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
        allowed: Tensor | None = None,
    ) -> None:
        """Add one batch of weights ``(B, H, Lq, Lk)`` with the ``(B, Lq)`` / ``(B, Lk)`` ids and validity of its
        queries and keys (ids in ``[0, Vq)`` / ``[0, Vk)`` at valid positions).

        ``pairs`` is :func:`attn_callbacks.functional.pair_index` of the ids, when the caller already has it (it
        depends on the ids only, so modules reading the same streams can share it); computed from the ids when the
        torch kernel needs it. The numba kernel (on CPU, see :func:`attn_callbacks.base.numba_loader.uses_numba`) reads
        the ids instead. ``allowed`` (the keys the attention's mask lets each query see, broadcastable to
        ``(B, Lq, Lk)``), ``hot_cell`` and ``compiled``: see :func:`attn_callbacks.sums.step.accumulate_attention`.
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
            allowed=allowed,
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
