"""Token ids as a batch holds them: reading one stream's ``(B, L)`` ids, checking them against the vocabulary without
wrapping any integer dtype, and choosing the ids to track (the most frequent ones, a lookup table to compact indices,
an iterator over the validation loaders of the monitor's own). :mod:`attn_callbacks.capture.streams` keeps them per
stream.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset

from attn_callbacks.base.config import TokenSource, short_repr
from attn_callbacks.capture import hf

__all__ = [
    "as_int64",
    "check_ids_in_range",
    "compact_index",
    "most_frequent_ids",
    "own_iterator",
    "read_mask",
    "read_stream",
]


def read_stream(batch: Any, stream: str, source: TokenSource, batch_first: bool = True) -> Tensor:
    """The ``(B, L)`` integer token ids of one stream in ``batch``.

    Args:
        batch: what the dataloader yielded (a mapping, a sequence, or an object with attributes).
        stream: the stream's name, for error messages.
        source: a key (mapping key, sequence index or attribute name) or a callable ``batch -> Tensor``.
        batch_first: the layout of the ids in the batch: ``(B, L)`` if True, ``(L, B)`` if False.

    Raises:
        KeyError: the key is not in the batch.
        ValueError: the ids are not a 2-D integer tensor.
    """
    ids = _fetch(batch, stream, source, "token_ids")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"Expected integer token ids for stream {stream!r}, but got dtype {ids.dtype}")
    return _batch_major(ids, stream, "token ids", batch_first)


def read_mask(batch: Any, stream: str, source: TokenSource, shape: torch.Size, batch_first: bool = True) -> Tensor:
    """The ``(B, L)`` boolean mask of one stream's real tokens in ``batch``: True where the batch's mask (Hugging
    Face's ``attention_mask``, say) is nonzero.

    Args:
        batch, stream, batch_first: as for :func:`read_stream`.
        source: a key or a callable ``batch -> Tensor`` giving a bool or integer tensor, nonzero at real tokens.
        shape: the ``(B, L)`` shape of the stream's ids, which the mask must have.

    Raises:
        KeyError: the key is not in the batch.
        ValueError: the mask is not a bool or integer tensor of the ids' shape.
    """
    mask = _fetch(batch, stream, source, "token_mask")
    if mask.is_floating_point() or mask.is_complex():  # an additive float mask (0 / -inf) would read inverted
        raise ValueError(
            f"Expected argument `token_mask` to give a bool or integer tensor for stream {stream!r} (nonzero at real "
            f"tokens), but got dtype {mask.dtype}; pass a callable such as `lambda batch: batch[key] > 0`"
        )
    mask = _batch_major(mask, stream, "token mask", batch_first)
    if mask.shape != shape:
        raise ValueError(
            f"Expected the token mask of stream {stream!r} (argument `token_mask`) to have the shape of its token ids "
            f"{tuple(shape)}, but got {tuple(mask.shape)}"
        )
    return mask != 0


def _fetch(batch: Any, stream: str, source: TokenSource, argument: str) -> Tensor:
    """The tensor ``source`` names in ``batch``; errors name ``argument``."""
    if callable(source):
        try:
            found = source(batch)
        except Exception as err:
            raise RuntimeError(f"The `{argument}` callable for stream {stream!r} raised {short_repr(err)}") from err
    elif isinstance(batch, Mapping):
        if source not in batch:
            raise KeyError(
                f"Batch key {short_repr(source)} of argument `{argument}` (stream {stream!r}) is not in the batch; "
                f"keys: {short_repr(list(batch))}{hf.missing_key_hint(source, batch)}"
            )
        found = batch[source]
    elif isinstance(source, int) and isinstance(batch, Sequence):
        if not -len(batch) <= source < len(batch):
            raise KeyError(
                f"Batch index {source} of argument `{argument}` (stream {stream!r}) is out of range for a "
                f"batch of {len(batch)} items"
            )
        found = batch[source]
    elif isinstance(source, str) and hasattr(batch, source):
        found = getattr(batch, source)
    else:
        raise KeyError(
            f"Cannot read batch key {short_repr(source)} of argument `{argument}` (stream {stream!r}) from a batch of "
            f"type {type(batch).__name__}; pass {_index_hint(batch, argument)}a callable batch -> Tensor instead"
        )
    if not isinstance(found, Tensor):
        raise ValueError(
            f"Expected argument `{argument}` to give a Tensor for stream {stream!r}, but got {type(found).__name__}"
        )
    return found


def _batch_major(values: Tensor, stream: str, what: str, batch_first: bool) -> Tensor:
    """``values`` as ``(B, L)``, from the batch's layout."""
    if values.dim() != 2:
        layout = "(B, L)" if batch_first else "(L, B)"
        raise ValueError(
            f"Expected the {what} of stream {stream!r} to have shape {layout}, but got shape {tuple(values.shape)}"
        )
    return values if batch_first else values.T


def check_ids_in_range(ids: Tensor, valid: Tensor, vocab_size: int, stream: str) -> None:
    """Raise if a valid (not ignored) id is negative or ``>= vocab_size``, compared as int64 whatever the ids' integer
    dtype (in uint8, ``vocab_size=256`` would wrap to 0). One host sync; skip it for speed."""
    wide = as_int64(ids)
    bad = valid & ((wide < 0) | (wide >= vocab_size))
    if bool(bad.any()):
        value = int(ids.long()[bad][0])
        if value < 0 and not ids.dtype.is_signed:
            value += 2**64  # a uint64 id past int64's range, as the batch holds it
        raise ValueError(
            f"Token id {value} of stream {stream!r} is outside the vocabulary [0, {vocab_size}) given by "
            "argument `vocab_size`; add padding ids to `ignore_ids` or raise `vocab_size`"
        )


def as_int64(ids: Tensor) -> Tensor:
    """Integer ids as int64 (the same tensor when they are): compared there, no id or bound wraps as it would in a
    small dtype. A uint64 id past int64's range saturates at int64's maximum, out of every vocabulary.

    Example:
        >>> as_int64(torch.tensor([154, 255], dtype=torch.uint8)) < 256
        tensor([True, True])
    """
    wide = ids.long()
    if not ids.dtype.is_signed and ids.element_size() == 8:  # uint64: 2**64 - 1 would read as -1
        wide = wide.masked_fill(wide < 0, torch.iinfo(torch.long).max)
    return wide


def most_frequent_ids(counts: Tensor, k: int, always: Sequence[int] = ()) -> Tensor:
    """The ids to track: ``always`` first (in the order given), then the most frequent other ids seen at least once,
    up to ``k`` in all; ties go to the smaller id, so every process picks the same set from the same counts.

    Args:
        counts: ``(V,)`` occurrences of each id.
        k: how many ids to track at most.
        always: ids tracked whatever their count (special tokens whose sink mass is logged, say).

    Returns:
        1-D int64 tensor on the CPU: position ``c`` holds the id stored at compact index ``c``.

    Example:
        >>> most_frequent_ids(torch.tensor([5, 0, 9, 5, 1]), 3, always=[4]).tolist()
        [4, 2, 0]
    """
    counts = counts.detach().cpu().clone()
    forced = list(dict.fromkeys(always))
    counts[forced] = -1  # placed first anyway
    order = torch.sort(counts, descending=True, stable=True).indices
    frequent = order[counts[order] > 0][: max(k - len(forced), 0)]
    return torch.cat([torch.tensor(forced, dtype=torch.long), frequent])


def compact_index(tracked: Tensor, vocab_size: int) -> Tensor:
    """Lookup table id -> compact index: tracked id ``tracked[c]`` -> ``c``, every other id -> ``len(tracked)``, the
    "other" bucket.

    Example:
        >>> compact_index(torch.tensor([3, 0]), 5).tolist()
        [1, 2, 2, 0, 2]
    """
    table = torch.full((vocab_size,), len(tracked), dtype=torch.long)
    table[tracked] = torch.arange(len(tracked))
    return table


def own_iterator(loader: Any) -> Any:
    """An iterator of its own over a dataloader. A persistent-workers ``DataLoader`` hands every ``iter()`` the one
    iterator it keeps, the evaluation loop's: this iterates a new loader over the same dataset, batches and collation,
    whose workers stop when it is done."""
    if not (isinstance(loader, DataLoader) and loader.persistent_workers and loader.num_workers > 0):
        return iter(loader)
    if isinstance(loader.dataset, IterableDataset):
        batching: dict[str, Any] = {"batch_size": loader.batch_size, "drop_last": loader.drop_last}
    elif loader.batch_sampler is not None:
        batching = {"batch_sampler": loader.batch_sampler}
    else:  # automatic batching off: one sample at a time
        batching = {"batch_size": None, "sampler": loader.sampler}
    workers = {
        "num_workers": loader.num_workers,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "prefetch_factor": loader.prefetch_factor,
        "timeout": loader.timeout,
    }
    return iter(
        DataLoader(loader.dataset, collate_fn=loader.collate_fn, generator=loader.generator, **batching, **workers)
    )


def _index_hint(batch: Any, argument: str) -> str:
    """For a tuple or list batch read by ``token_ids``: where its 2-D integer (not bool) tensors are, the candidates
    for the index to pass. A mask cannot be told from ids by its type: for other arguments, no guess."""
    if not isinstance(batch, Sequence) or isinstance(batch, str):
        return ""
    found = [
        i for i, item in enumerate(batch)
        if isinstance(item, Tensor) and item.dim() == 2 and not item.is_floating_point() and not item.is_complex()
        and item.dtype != torch.bool
    ]  # fmt: skip
    if argument != "token_ids" or not found:
        return "an index into the batch, or "
    return f"the index of the ids instead of a key (the batch's 2-D integer tensors are at {found}), or "
