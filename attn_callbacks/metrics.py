"""torchmetrics state for one attention module: the on-device sums and counts, summed across processes."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.distributed import gather_all_tensors

from attn_callbacks import functional as F

__all__ = ["AttentionAccumulator", "AttentionStats", "merge_stats", "stats_from_sums"]


@dataclass(eq=False)
class AttentionStats:
    """What :meth:`AttentionAccumulator.compute` returns; see the glossary in the README.

    The raw sums are fields; ``P`` and ``M`` are derived on first access (each is as large as ``S``, and the
    callback never needs ``M``).

    Attributes:
        attention_sum: ``S``, ``(H, Vq, Vk)`` float32.
        pair_count: ``C``, ``(Vq, Vk)`` int64.
        query_count: ``Q``, ``(Vq,)`` int64.
        skipped_rows: number of valid query rows dropped because their weights were not finite, or all zero
            (0-dim int64).
        uniform_sum: ``U``, the uniform-attention baseline, ``(Vq, Vk)`` float32 (see
            :func:`attn_callbacks.functional.lift`).
        position_sums: ``(len(POSITION_STATS), H)`` float32 position-level sums (see
            :func:`attn_callbacks.functional.position_statistics`).
    """

    attention_sum: Tensor
    pair_count: Tensor
    query_count: Tensor
    skipped_rows: Tensor
    uniform_sum: Tensor
    position_sums: Tensor

    @cached_property
    def attention_mass(self) -> Tensor:
        """``P = S / Q[:, None]`` per head, ``(H, Vq, Vk)`` (see :func:`attn_callbacks.functional.attention_mass`)."""
        return F.attention_mass(self.attention_sum, self.query_count)

    @cached_property
    def mean_weight(self) -> Tensor:
        """``M = S / C`` per head, ``(H, Vq, Vk)`` (see :func:`attn_callbacks.functional.mean_weight`)."""
        return F.mean_weight(self.attention_sum, self.pair_count)


# The raw sums, in the order stats_from_sums takes them; also the export file format: never reorder or rename.
_SUMS = tuple(field.name for field in fields(AttentionStats))


def stats_from_sums(
    attention_sum: Tensor,
    pair_count: Tensor,
    query_count: Tensor,
    skipped_rows: Tensor,
    uniform_sum: Tensor,
    position_sums: Tensor,
) -> AttentionStats:
    """An :class:`AttentionStats` from the raw sums (``P = S / Q`` and ``M = S / C`` derived per head on access)."""
    return AttentionStats(attention_sum, pair_count, query_count, skipped_rows, uniform_sum, position_sums)


def merge_stats(parts: Sequence[AttentionStats]) -> AttentionStats:
    """The statistics of the union of several disjoint sets of batches (e.g. validation dataloaders): every raw sum
    added, ``P`` and ``M`` derived again (never averaged)."""
    if not parts:
        raise ValueError("Expected at least one AttentionStats to merge, but got none")
    return stats_from_sums(*(sum(getattr(part, field) for part in parts) for field in _SUMS))


class AttentionAccumulator(Metric):
    """Running vocabulary × vocabulary attention sums for one attention module.

    States (all ``dist_reduce_fx="sum"``, so DDP ranks add up), packed for the fast path of
    :func:`attn_callbacks.functional.accumulate_attention`: ``sums (H + 1, Vq * Vk + 1)`` holds ``S`` per head and the
    uniform baseline ``U``, ``pair_count (Vq * Vk + 1,)`` and ``query_count (Vq + 1,)``, each with one discard cell
    where ignored positions go; plus ``skipped_rows`` and ``position_sums (len(POSITION_STATS), H)``. Updates never
    sync with the host. Division happens only in :meth:`compute`, which returns the usual shapes.

    Args:
        num_heads: number of attention heads ``H``.
        query_vocab_size: size ``Vq`` of the vocabulary of the query tokens.
        key_vocab_size: size ``Vk`` of the vocabulary of the key tokens.
        mean_of_heads: keep ``mean_h S[h]`` only (``attention_sum`` then has one row), ``H`` times less memory and a
            faster update; position sums stay per head.

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
        self._summed_in_place = False
        self._shapes = self._state_shapes(num_heads, query_vocab_size, key_vocab_size, self.mean_of_heads)
        # Created as normal tensors (never inside inference mode) so they can be updated in place anywhere.
        with torch.inference_mode(False):
            for name, (shape, dtype) in self._shapes.items():
                self.add_state(name, torch.zeros(shape, dtype=dtype), "sum")
                # torchmetrics keeps a copy of every default to reset from (and moves it with .to()): a second full
                # state. Keep an empty one instead; reset() allocates the zeros.
                self._defaults[name] = torch.zeros(0, dtype=dtype)

    @staticmethod
    def _state_shapes(
        num_heads: int, query_vocab_size: int, key_vocab_size: int, mean_of_heads: bool
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every state's shape and dtype: the one definition that allocation and :meth:`state_bytes` share."""
        plane = query_vocab_size * key_vocab_size + 1  # the vocabulary plane plus the discard cell
        return {
            "sums": (((1 if mean_of_heads else num_heads) + 1, plane), torch.float32),
            "pair_count": ((plane,), torch.long),
            "query_count": ((query_vocab_size + 1,), torch.long),
            "skipped_rows": ((), torch.long),
            # float32 like the other sums: float64 states would not move to MPS devices.
            "position_sums": ((len(F.POSITION_STATS), num_heads), torch.float32),
        }

    @staticmethod
    def state_bytes(num_heads: int, query_vocab_size: int, key_vocab_size: int, mean_of_heads: bool = False) -> int:
        """Bytes of state one accumulator holds: ``(H + 1) · (Vq · Vk + 1) · 4 + (Vq · Vk + 1) · 8 + (Vq + 1) · 8``
        plus a few scalars (float32 sums, int64 counts); ``H`` counts as 1 with ``mean_of_heads``."""
        shapes = AttentionAccumulator._state_shapes(num_heads, query_vocab_size, key_vocab_size, mean_of_heads)
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in shapes.values())

    def update(
        self,
        weights: Tensor,
        query_ids: Tensor,
        key_ids: Tensor,
        query_valid: Tensor,
        key_valid: Tensor,
        pairs: Tensor | None = None,
    ) -> None:
        """Add one batch; arguments as in :func:`attn_callbacks.functional.accumulate_attention_reference`.

        ``pairs`` is :func:`attn_callbacks.functional.pair_index` of the ids, when the caller already has it (it
        depends on the ids only, so modules reading the same streams can share it).
        """
        if self.summed_in_place:
            raise RuntimeError(
                "AttentionAccumulator.update: the state holds every process's sums (stats(in_place=True)); adding to "
                "it would count them again. reset() first"
            )
        if pairs is None:
            pairs = F.pair_index(query_ids, key_ids, query_valid, key_valid, self.query_vocab_size, self.key_vocab_size)
        skipped = F.accumulate_attention(
            self.sums,
            self.pair_count,
            self.query_count,
            self.position_sums,
            weights,
            pairs,
            query_ids,
            query_valid,
            key_valid,
        )
        self.skipped_rows += skipped

    def compute(self) -> AttentionStats:
        """The (process-summed) sums and counts in their usual shapes (discard cells dropped); ``P = S / Q`` and
        ``M = S / C`` per head are derived on access. torchmetrics returns a copy; see :meth:`stats` for views."""
        return self._unpack()

    def _wrap_compute(self, compute: Callable) -> Callable:
        """torchmetrics' wrapper (sync, cache, copy), whose squeeze of every one-element tensor in the result (a
        vocabulary of one id) is undone: each field keeps the shape :class:`AttentionStats` documents."""
        wrapped = super()._wrap_compute(compute)

        @functools.wraps(compute)
        def shaped(*args: Any, **kwargs: Any) -> AttentionStats:
            stats = wrapped(*args, **kwargs)
            heads, vocab_q, vocab_k = self.sums.shape[0] - 1, self.query_vocab_size, self.key_vocab_size
            return stats_from_sums(
                stats.attention_sum.reshape(heads, vocab_q, vocab_k),
                stats.pair_count.reshape(vocab_q, vocab_k),
                stats.query_count.reshape(vocab_q),
                stats.skipped_rows,
                stats.uniform_sum.reshape(vocab_q, vocab_k),
                stats.position_sums,  # (len(POSITION_STATS), H): never one element
            )

        return shaped

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
        available = self.distributed_available_fn
        if callable(available) and available():
            # Set first: a collective that fails part-way leaves some states summed, and nothing may add to them.
            self._summed_in_place = True
            self._is_synced = True  # so that torchmetrics' compute() refuses too; reset() clears both
            self._cache = None  # no local copy to go back to (nor a stale one from a sync that failed)
            self._sync_dist(self.dist_sync_fn or gather_all_tensors, self.process_group)
        return self._unpack()

    @property
    def summed_in_place(self) -> bool:
        """Whether :meth:`stats` summed the state across processes in place (until :meth:`reset`)."""
        return self._summed_in_place

    def _sync_dist(self, dist_sync_fn: Callable = gather_all_tensors, process_group: Any | None = None) -> None:
        """Sum every state across processes in place, one ``all_reduce`` per state.

        torchmetrics' default gathers each rank's copy and stacks them before summing: ``2 W + 1`` copies of the
        state at once per module for ``W`` processes (hundreds of MB each for a large vocabulary, and slower to send
        than a reduction). :meth:`sync` has already kept a copy of the local state, which ``unsync`` puts back, so in
        place the peak is 2 copies whatever ``W``. A caller's own ``dist_sync_fn`` takes torchmetrics' general path.
        """
        if dist_sync_fn is not gather_all_tensors:
            super()._sync_dist(dist_sync_fn, process_group)
            return
        group = process_group or self.process_group
        try:
            for name in self._reductions:
                torch.distributed.all_reduce(getattr(self, name), op=torch.distributed.ReduceOp.SUM, group=group)
        except BaseException:
            if self._cache is not None:  # sync() kept the local state: put it back, not a half-summed one
                for name, value in self._cache.items():
                    setattr(self, name, value)
            raise

    def _unpack(self) -> AttentionStats:
        heads, vocab_q, vocab_k = self.sums.shape[0] - 1, self.query_vocab_size, self.key_vocab_size
        plane = self.sums[:, : vocab_q * vocab_k].view(heads + 1, vocab_q, vocab_k)  # (channels + 1, Vq, Vk)
        return AttentionStats(
            attention_sum=plane[:heads],
            pair_count=self.pair_count[: vocab_q * vocab_k].view(vocab_q, vocab_k),
            query_count=self.query_count[:vocab_q],
            skipped_rows=self.skipped_rows,
            uniform_sum=plane[heads],
            position_sums=self.position_sums,
        )

    def reset(self) -> None:
        """Zero the sums in place (no new allocation, no fresh pages to fault in: the state of a large vocabulary is
        hundreds of MB); tensors from :meth:`stats` are zeroed with it. States replaced by an inference tensor or a
        new shape are allocated anew, as normal tensors even when called inside inference mode."""
        with torch.inference_mode(False):
            current = {name: getattr(self, name) for name in self._shapes}
            super().reset()  # torchmetrics' counters and caches; the states become the empty defaults
            self._summed_in_place = False
            for name, (shape, _) in self._shapes.items():
                tensor = current[name]
                if tuple(tensor.shape) == shape and not tensor.is_inference():
                    setattr(self, name, tensor.zero_())
                else:
                    setattr(self, name, torch.zeros(shape, dtype=tensor.dtype, device=tensor.device))
