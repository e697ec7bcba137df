"""Token streams: reading each batch's token ids, the ids tracked exactly, and the labels shown for them.

A *stream* is one sequence of token ids per sample: ``"src"`` and ``"tgt"`` for a translation model, or a single
stream for an encoder-only model. Self-attention reads one stream for queries and keys; cross-attention reads a query
stream and a key stream.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn

from attn_callbacks.base.config import (
    TokenSource,
    int_list,
    labels_per_stream,
    mask_getters,
    per_stream,
    positive_int,
    resolve_vocab_sizes,
    short_repr,
    stream_getters,
)
from attn_callbacks.base.labels import MAX_LABEL, OTHER_LABEL, label_tokens
from attn_callbacks.capture.token_ids import (
    as_int64,
    check_ids_in_range,
    compact_index,
    most_frequent_ids,
    own_iterator,
    read_mask,
    read_stream,
)
from attn_callbacks.capture.wiring import first_rule, resolve_streams

#: The ids int64 holds: an ignore id outside can match no id (every id is compared as int64).
_INT64_RANGE = range(-(2**63), 2**63)

__all__ = ["Streams"]


class Streams:
    """Every stream's configuration and the current batch's ids, read once per batch and stream.

    Args are :class:`~attn_callbacks.AttentionMonitor`'s of the same names, validated here.
    """

    def __init__(
        self,
        token_ids: Any,
        vocab_size: Any,
        id_to_token: Any = None,
        ignore_ids: Sequence[int] = (),
        batch_first: bool = True,
        validate_args: bool = True,
        sink_ids: Any = (),
        max_tracked_tokens: Any = None,
        tracked_ids: Any = None,
        token_mask: Any = None,
    ) -> None:
        self.getters: dict[str, TokenSource] = stream_getters(token_ids)
        self.names = list(self.getters)
        self.masks: dict[str, TokenSource] = mask_getters(token_mask, self.names)
        self.vocab = resolve_vocab_sizes(vocab_size, self.names)
        self.labels = labels_per_stream(id_to_token, self.names)
        for stream, labels in self.labels.items():
            if isinstance(labels, Sequence) and not isinstance(labels, str) and len(labels) != self.vocab[stream]:
                rank_zero_info(
                    f"AttentionMonitor: argument `id_to_token` has {len(labels)} labels for the {self.vocab[stream]} "
                    f"ids of stream {stream!r} (`vocab_size`): "
                    + (
                        f"ids from {len(labels)} on are shown as numbers"
                        if len(labels) < self.vocab[stream]
                        else f"labels from {self.vocab[stream]} on are never shown"
                    )
                )
        self.ignore_ids = int_list("ignore_ids", ignore_ids)
        self.batch_first = batch_first
        self.validate_args = validate_args
        self.sinks: dict[str, list[int]] = per_stream("sink_ids", sink_ids, self.names, int_list, default=())
        self.track_limit: dict[str, int] = (
            {}
            if max_tracked_tokens is None
            else per_stream("max_tracked_tokens", max_tracked_tokens, self.names, positive_int)
        )
        # stream -> the tracked ids, compact index c holding id tracked[c] (CPU int64); frozen once set.
        self.tracked: dict[str, Tensor] = {}
        if tracked_ids is not None:
            for stream, ids in per_stream("tracked_ids", tracked_ids, self.names, int_list).items():
                self.tracked[stream] = self._tracked_tensor(stream, ids)
        for stream, limit in self.track_limit.items():
            if len(self.sinks[stream]) > limit:
                raise ValueError(
                    f"Argument `max_tracked_tokens`={limit} for stream {stream!r} is smaller than its "
                    f"{len(self.sinks[stream])} `sink_ids`, which are always tracked"
                )
        self.of: dict[str, tuple[str, str]] = {}  # attention module -> (query stream, key stream)
        self.batch: Any = None  # the batch being read, while one runs
        self._ids: dict[str, tuple[Tensor, Tensor, Tensor]] = {}  # this batch's ids per stream
        self._tables: dict[str, Tensor] = {}  # stream -> id -> compact index (V + 1 entries), on the device
        self._ignored: dict[torch.device, Tensor] = {}  # ignore_ids as int64 on a device

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "batch": None, "_ids": {}, "_tables": {}, "_ignored": {}}  # per-batch, device caches

    def _tracked_tensor(self, stream: str, ids: list[int]) -> Tensor:
        bad = [i for i in ids if not 0 <= i < self.vocab[stream]]
        if bad or not ids:
            raise ValueError(
                f"Expected argument `tracked_ids` to hold ids in [0, {self.vocab[stream]}) for stream {stream!r}, "
                f"but got {short_repr(bad or ids)}"
            )
        always = [i for i in self.sinks[stream] if i not in ids]
        return torch.tensor(always + ids, dtype=torch.long)

    def check_sinks(self) -> None:
        """Raise ``ValueError`` for a sink id outside its stream's vocabulary."""
        for stream, ids in self.sinks.items():
            bad = [i for i in ids if not 0 <= i < self.vocab[stream]]
            if bad:
                raise ValueError(
                    f"argument `sink_ids` has id(s) {short_repr(bad)} outside the vocabulary [0, {self.vocab[stream]}) "
                    f"of stream {stream!r}"
                )

    def wire(self, modules: Sequence[str], model: nn.Module, attention_streams: Mapping[str, Any] | None) -> None:
        """Decide the (query stream, key stream) of every attention module (see :func:`resolve_streams`)."""
        self.of = resolve_streams(modules, model, self.names, attention_streams)

    def wire_call(self, name: str, base: str, attention_streams: Mapping[str, Any] | None) -> bool:
        """The streams of an SDPA call named apart from its module ``base`` (``base.call1``...): the first pattern of
        ``attention_streams`` matching the call's name, else the module's own. A site already wired keeps its own.
        Returns whether the call was wired here to its module's streams for want of a pattern."""
        if name in self.of:
            return False
        rule = first_rule(name, attention_streams or {})
        self.of[name] = rule or self.of[base]
        return rule is None

    def check_call(self, name: str) -> None:
        """Refuse an SDPA call first seen mid-epoch that reads a stream whose tracked ids are not chosen yet."""
        pending = [stream for stream in self.of[name] if self.pending(stream)]
        if pending:
            raise RuntimeError(
                f"AttentionMonitor: SDPA call {name!r} reads stream(s) {pending}, whose tracked ids are chosen "
                "when the first monitored epoch starts, from the streams of the modules found in setup; map the call "
                "to those streams in `attention_streams`, or give `tracked_ids` for these streams"
            )

    def other_cell(self, streams: tuple[str, str]) -> tuple[int, int] | None:
        """The accumulated ``(query, key)`` index of ``(<other>, <other>)`` where both streams are tracked (it comes
        right after a tracked stream's tokens), else None."""
        query_other, key_other = (self.tokens(stream).stop for stream in streams)
        return None if query_other is None or key_other is None else (query_other, key_other)

    def used(self) -> list[str]:
        """The streams some module reads, in order."""
        return list(dict.fromkeys(s for pair in self.of.values() for s in pair))

    # ------------------------------------------------------------------------------------------------ vocabulary
    def size(self, stream: str) -> int:
        """Vocabulary size of a stream as accumulated: tracked ids + ``<other>``, or the whole vocabulary."""
        tracked = self.tracked.get(stream)
        return self.vocab[stream] if tracked is None else len(tracked) + 1

    def planned_size(self, stream: str) -> int:
        """:meth:`size`, counting a stream whose tracked ids are not chosen yet with its limit."""
        return self.track_limit[stream] + 1 if self.pending(stream) else self.size(stream)

    def pending(self, stream: str) -> bool:
        """Whether the stream will be tracked but its ids are not chosen yet."""
        limit = self.track_limit.get(stream)
        return stream not in self.tracked and limit is not None and self.vocab[stream] > limit

    def tokens(self, stream: str) -> slice:
        """The accumulated indices that are tokens: all but the last, ``<other>``, of a tracked stream (slicing it off
        the end keeps every index as it is). The bucket counts in every scalar, but it is no token to show in a
        heatmap or a table (it would lead them all)."""
        return slice(0, len(self.tracked[stream])) if stream in self.tracked else slice(None)

    def vocab_ids(self, stream: str) -> list[int] | None:
        """The vocabulary id of each accumulated index of a tracked stream but the last, ``<other>``; None for an
        untracked stream, whose indices are its ids."""
        tracked = self.tracked.get(stream)
        return None if tracked is None else tracked.tolist()

    def sink_indices(self, stream: str) -> list[int]:
        """The accumulated indices of a key stream's ``sink_ids`` (compact indices when tracked: sinks always are)."""
        sinks, tracked = self.sinks.get(stream, []), self.vocab_ids(stream)
        return sinks if tracked is None else [tracked.index(i) for i in sinks]

    # ------------------------------------------------------------------------------------------------- batches
    def valid(self, ids: Tensor) -> Tensor:
        """Positions whose id is not in ``ignore_ids``, compared as int64: in the ids' own dtype an ignore id would
        wrap (-100 is byte 156 in uint8) or overflow (40000 in int16)."""
        ignored = self._ignored.get(ids.device)
        if ignored is None:  # made once: a copy from a Python list to a GPU waits for the device to finish its work
            ignore = [i for i in self.ignore_ids if i in _INT64_RANGE]  # one outside can match no id
            with torch.inference_mode(False):  # usable in and out of inference mode
                ignored = torch.tensor(ignore, device=ids.device, dtype=torch.long)
            self._ignored[ids.device] = ignored
        if ignored.numel() == 0:
            return torch.ones_like(ids, dtype=torch.bool)
        return ~torch.isin(as_int64(ids), ignored)

    def valid_in(self, batch: Any, stream: str, ids: Tensor) -> Tensor:
        """Positions of a stream's int64 ``ids`` read from ``batch`` that count: not in ``ignore_ids``, and real tokens
        by the stream's ``token_mask`` when it has one (a mask copied like the ids: the batch's may be edited)."""
        valid = self.valid(ids)
        source = self.masks.get(stream)
        if source is not None:
            valid &= read_mask(batch, stream, source, ids.shape, self.batch_first).to(ids.device)
        return valid

    def start_batch(self, batch: Any) -> None:
        self.batch = batch
        self._ids.clear()

    def end_batch(self) -> None:
        self.batch = None
        self._ids.clear()

    def read(self, stream: str, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """(ids as accumulated, valid, ids as in the batch) of one stream of the current batch, read once per batch,
        all int64 (compared, looked up and summed without wrapping, whatever the batch's integer dtype). Accumulated ids
        are compact indices (``<other>`` last) for a tracked stream, the batch's ids otherwise."""
        if stream not in self._ids:
            as_read = read_stream(self.batch, stream, self.getters[stream], self.batch_first).to(device)
            ids = as_int64(as_read)  # uint8 ids of a 256-byte vocabulary: 154 >= 256 would be compared as 154 >= 0
            if ids is as_read:  # the batch's own memory: a validation_step editing it in place would change the pairs
                ids = ids.clone()
            valid = self.valid_in(self.batch, stream, ids)
            if self.validate_args:
                check_ids_in_range(as_read, valid, self.vocab[stream], stream)
            compact = ids
            if stream in self.tracked:
                vocab = self.vocab[stream]
                table = self._tables.get(stream)
                if table is None or table.device != ids.device:
                    other = torch.tensor([len(self.tracked[stream])])
                    table = torch.cat([compact_index(self.tracked[stream], vocab), other]).to(ids.device)  # (V + 1,)
                    self._tables[stream] = table
                # An id outside [0, V) is none of the tracked ids: clamped to -1 or V, it looks up the last entry,
                # <other>. So are ignored positions (pad = -100), which add nothing, and, with validate_args=False,
                # ids beyond the vocabulary: counted in <other>, the bucket of every untracked id, never as a token.
                compact = table[ids.clamp(-1, vocab)]
            self._ids[stream] = (compact, valid, ids)
        return self._ids[stream]

    def expected(
        self, name: str, base: str, attention_streams: Mapping[str, Any] | None, device: torch.device
    ) -> tuple[int, int, int] | None:
        """``(B, Lq, Lk)`` of the current batch's token ids of the streams of site ``name`` (a call not yet wired: as
        :meth:`wire_call` would wire it; ids not read yet are read onto ``device``), or None outside a batch."""
        if self.batch is None:
            return None
        streams = self.of.get(name) or first_rule(name, attention_streams or {}) or self.of[base]
        (batch, len_q), (_, len_k) = (self.read(stream, device)[0].shape for stream in streams)
        return batch, len_q, len_k

    def read_pair(
        self, name: str, streams: tuple[str, str], weights: Tensor, rows: slice | None = None, batch: int | None = None
    ) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
        """``(ids, valid)`` of the query and the key stream of module ``name``'s weights ``(b, H, Lq, Lk)``, the samples
        ``rows`` of a call on ``batch`` samples (the whole call when None), on the weights' device, checked against
        the batch's ids: a call on fewer samples than the batch has (micro-batches, a per-sample loop) has no way to
        say which samples it saw, so it is refused rather than mapped to the first ones."""
        query_stream, key_stream = streams
        # .to() is a no-op unless the module lives on another device than the LightningModule's (model parallel).
        query_ids, query_valid, _ = (t.to(weights.device) for t in self.read(query_stream, weights.device))
        key_ids, key_valid, _ = (t.to(weights.device) for t in self.read(key_stream, weights.device))
        calls_batch = weights.size(0) if batch is None else batch
        if calls_batch != query_ids.size(0) or calls_batch != key_ids.size(0):
            raise ValueError(
                f"AttentionMonitor: attention module {name!r} ran on a batch of {calls_batch} samples, but the "
                f"batch's token ids of its query stream {query_stream!r} {tuple(query_ids.shape)} and key stream "
                f"{key_stream!r} {tuple(key_ids.shape)} hold {query_ids.size(0)} and {key_ids.size(0)}: a module run "
                "on part of the batch (micro-batches, a loop over samples) cannot be matched to its tokens. While "
                "monitored, run it on the whole batch, or leave it out with `modules` (see also `batch_first`)"
            )
        if rows is not None and rows != slice(0, calls_batch):
            query_ids, query_valid, key_ids, key_valid = (t[rows] for t in (query_ids, query_valid, key_ids, key_valid))
        _, _, len_q, len_k = weights.shape
        if query_ids.shape[1] != len_q or key_ids.shape[1] != len_k:
            raise ValueError(
                f"AttentionMonitor: attention module {name!r} returned weights of shape (B, H, Lq, Lk) = "
                f"{tuple(weights.shape)}, which does not match the token ids of its query stream {query_stream!r} "
                f"{tuple(query_ids.shape)} and key stream {key_stream!r} {tuple(key_ids.shape)} (expected (B, Lq) and "
                "(B, Lk); see arguments `attention_streams` and `batch_first`). A module that attends over other "
                "tokens than the batch's, or one query position per call, as a decoder loop does, cannot be "
                "monitored in `validation_step` (calls inside a `generate` method of a module are left out): decode "
                "in a method named `generate` or in `on_validation_epoch_end`, or leave the module out with `modules`"
            )
        return (query_ids, query_valid), (key_ids, key_valid)

    def choose_tracked(self, loaders: Sequence[Any], limits: Sequence[int | float], strategy: Any) -> None:
        """Count the ids of every pending stream some module reads over the evaluation ``loaders`` (ids only, no
        forward; at most ``limits`` batches each; summed over processes by ``strategy``) and freeze the most frequent
        ones. An id outside the vocabulary is refused here even with ``validate_args=False``: it has no cell to be
        counted in, and this pass runs once, before the first monitored epoch, on ids only: its check slows no epoch."""
        pending = [stream for stream in self.used() if self.pending(stream)]
        if not pending:
            return
        device = strategy.root_device
        counts = {s: torch.zeros(self.vocab[s] + 1, dtype=torch.long, device=device) for s in pending}
        for loader, limit in zip(loaders, limits, strict=False):
            for index, batch in enumerate(own_iterator(loader)):
                if index >= limit:
                    break
                for stream in pending:
                    as_read = read_stream(batch, stream, self.getters[stream], self.batch_first).to(device)
                    ids = as_int64(as_read)
                    valid = self.valid_in(batch, stream, ids)
                    check_ids_in_range(as_read, valid, self.vocab[stream], stream)  # no cell to count it in
                    where = torch.where(valid, ids, self.vocab[stream]).reshape(-1)  # ignored -> last cell
                    counts[stream].index_add_(0, where, valid.reshape(-1).long())
        for stream in pending:
            total = strategy.reduce(counts[stream], reduce_op="sum")[:-1]  # same counts on every rank
            self.tracked[stream] = most_frequent_ids(total, self.track_limit[stream], self.sinks[stream])
            rank_zero_info(
                f"AttentionMonitor: tracking {len(self.tracked[stream])} of {self.vocab[stream]} ids of stream "
                f"{stream!r} ({float(total[self.tracked[stream]].sum()) / max(float(total.sum()), 1):.1%} of its "
                "validation tokens); the rest fold into <other>"
            )

    def load_tracked(self, tracked: Mapping[str, Tensor]) -> None:
        """Tracked ids from a checkpoint: frozen when the checkpointed run chose them, so epochs stay comparable."""
        self.tracked.update(tracked)
        self._tables.clear()

    # -------------------------------------------------------------------------------------------------- labels
    def label(self, ids: Sequence[int], stream: str, max_length: int | None = MAX_LABEL) -> list[str]:
        """Labels of accumulated ids (compact indices of a tracked stream: ``<other>`` for the bucket)."""
        originals = self.vocab_ids(stream)
        if originals is None:
            return label_tokens(list(ids), self.labels[stream], max_length=max_length)
        ids = list(ids)
        known = [originals[c] for c in ids if c < len(originals)]  # one lookup for all (a tokenizer call, say)
        labels = iter(label_tokens(known, self.labels[stream], max_length=max_length))
        return [next(labels) if c < len(originals) else OTHER_LABEL for c in ids]

    def batch_label(self, ids: Sequence[int], stream: str) -> list[str]:
        """Labels of ids as they are in the batch."""
        return label_tokens(list(ids), self.labels[stream])

    def full_labels(self, stream: str) -> list[str] | None:
        """Whole labels of every accumulated id, as an export stores them; None for a stream without labels or
        tracking (ids are their own labels)."""
        if self.labels[stream] is None and stream not in self.tracked:
            return None
        return self.label(range(self.size(stream)), stream, max_length=None)
