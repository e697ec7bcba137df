"""Reading token ids from a batch, and deciding which token stream feeds the queries and keys of each module.

A *stream* is one sequence of token ids per sample: ``"src"`` and ``"tgt"`` for a translation model, or a single
stream for an encoder-only model. Self-attention reads one stream for queries and keys; cross-attention reads a query
stream and a key stream.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "DEFAULT_STREAM",
    "OTHER_LABEL",
    "TokenSource",
    "compact_index",
    "most_frequent_ids",
    "parse_bytes",
    "read_stream",
    "resolve_streams",
    "resolve_vocab_sizes",
    "stream_getters",
]

#: The stream name used when ``token_ids`` is a single key or callable.
DEFAULT_STREAM = "tokens"

# A batch key, or a callable batch -> LongTensor (B, L). The callable is typed ``Callable[[Any], Any]`` on purpose:
# jsonargparse (LightningCLI) reads a callable returning a class as "build that class from a config dict", and would
# turn a mapping of streams into a ``Tensor`` factory.
TokenSource = str | int | Callable[[Any], Any]


def stream_getters(token_ids: TokenSource | Mapping[str, TokenSource]) -> dict[str, TokenSource]:
    """Normalise ``token_ids`` to a mapping stream name -> batch key or callable, validating it.

    Example:
        >>> stream_getters("input_ids")
        {'tokens': 'input_ids'}
    """
    if isinstance(token_ids, Mapping):
        if not token_ids:
            raise ValueError("Expected argument `token_ids` to name at least one stream, but got an empty mapping")
        getters = dict(token_ids)
    else:
        getters = {DEFAULT_STREAM: token_ids}
    for stream, source in getters.items():
        if not isinstance(stream, str):
            raise ValueError(f"Expected the stream names in argument `token_ids` to be strings, but got {stream!r}")
        if isinstance(source, bool) or not (isinstance(source, (str, int)) or callable(source)):
            raise ValueError(
                "Expected argument `token_ids` to be a batch key, a callable batch -> LongTensor (B, L) or a mapping "
                f"of stream names to either, but got {source!r} for stream {stream!r}"
            )
    return getters


def resolve_vocab_sizes(vocab_size: int | Mapping[str, int], streams: Sequence[str]) -> dict[str, int]:
    """Vocabulary size per stream from an int (shared) or a per-stream mapping, validated."""
    sizes = dict(vocab_size) if isinstance(vocab_size, Mapping) else dict.fromkeys(streams, vocab_size)
    missing = [s for s in streams if s not in sizes]
    if missing:
        raise ValueError(f"Argument `vocab_size` has no entry for stream(s) {missing}; got {dict(vocab_size)!r}")
    unknown = [s for s in sizes if s not in streams]
    if unknown:
        raise ValueError(
            f"Argument `vocab_size` names stream(s) {unknown} that argument `token_ids` does not define; "
            f"streams: {list(streams)}"
        )
    for stream, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            where = "" if not isinstance(vocab_size, Mapping) else f" for stream {stream!r}"
            raise ValueError(f"Expected argument `vocab_size` to be a positive integer{where}, but got {size!r}")
    return {s: sizes[s] for s in streams}


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
    if callable(source):
        try:
            ids = source(batch)
        except Exception as err:
            raise RuntimeError(f"The `token_ids` callable for stream {stream!r} raised {err!r}") from err
    elif isinstance(batch, Mapping):
        if source not in batch:
            raise KeyError(
                f"Batch key {source!r} of argument `token_ids` (stream {stream!r}) is not in the batch; "
                f"keys: {list(batch)}"
            )
        ids = batch[source]
    elif isinstance(source, int) and isinstance(batch, Sequence):
        if not -len(batch) <= source < len(batch):
            raise KeyError(
                f"Batch index {source} of argument `token_ids` (stream {stream!r}) is out of range for a "
                f"batch of {len(batch)} items"
            )
        ids = batch[source]
    elif isinstance(source, str) and hasattr(batch, source):
        ids = getattr(batch, source)
    else:
        raise KeyError(
            f"Cannot read batch key {source!r} of argument `token_ids` (stream {stream!r}) from a batch of type "
            f"{type(batch).__name__}; pass a callable batch -> LongTensor instead"
        )
    if not isinstance(ids, Tensor):
        raise ValueError(f"Expected the token ids of stream {stream!r} to be a Tensor, but got {type(ids).__name__}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"Expected integer token ids for stream {stream!r}, but got dtype {ids.dtype}")
    if ids.dim() != 2:
        layout = "(B, L)" if batch_first else "(L, B)"
        raise ValueError(
            f"Expected the token ids of stream {stream!r} to have shape {layout}, but got shape {tuple(ids.shape)}"
        )
    return ids if batch_first else ids.T


def check_ids_in_range(ids: Tensor, valid: Tensor, vocab_size: int, stream: str) -> None:
    """Raise if a valid (not ignored) id is negative or ``>= vocab_size``. One host sync; skip it for speed."""
    bad = valid & ((ids < 0) | (ids >= vocab_size))
    if bool(bad.any()):
        value = int(ids[bad][0])
        raise ValueError(
            f"Token id {value} of stream {stream!r} is outside the vocabulary [0, {vocab_size}) given by "
            "argument `vocab_size`; add padding ids to `ignore_ids` or raise `vocab_size`"
        )


def _stock_role(name: str, named: Mapping[str, nn.Module]) -> tuple[str, str] | None:
    """(query stream, key stream) for attention inside stock ``nn.Transformer*`` layers, named as ``forward``'s args."""
    parent_name, _, attr = name.rpartition(".")
    parent = named.get(parent_name)
    if isinstance(parent, nn.TransformerEncoderLayer) and attr == "self_attn":
        return "src", "src"
    if isinstance(parent, nn.TransformerDecoderLayer):
        if attr == "self_attn":
            return "tgt", "tgt"
        if attr == "multihead_attn":
            return "tgt", "src"
    return None


def resolve_streams(
    modules: Sequence[str],
    model: nn.Module,
    streams: Sequence[str],
    attention_streams: Mapping[str, tuple[str, str]] | None = None,
) -> dict[str, tuple[str, str]]:
    """Which (query stream, key stream) feeds each attention module.

    Rules, in order: the first fnmatch pattern of ``attention_streams`` matching the module name; with a single
    stream, that stream for queries and keys; for stock ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer``
    attention with streams named ``src`` and ``tgt`` (as in ``nn.Transformer.forward``): encoder self-attention
    src→src, decoder self-attention tgt→tgt, decoder cross-attention (``multihead_attn``) tgt→src.

    Raises:
        ValueError: a module no rule covers, or a rule naming an unknown stream; the message names both.
    """
    rules = dict(attention_streams or {})
    for pattern, pair in rules.items():
        if not (isinstance(pair, Sequence) and not isinstance(pair, str) and len(pair) == 2):
            raise ValueError(
                f"Expected argument `attention_streams` to map patterns to (query_stream, key_stream), but got "
                f"{pair!r} for pattern {pattern!r}"
            )
        unknown = [s for s in pair if s not in streams]
        if unknown:
            raise ValueError(
                f"Argument `attention_streams` maps pattern {pattern!r} to unknown stream(s) {unknown}; the streams "
                f"of `token_ids` are {list(streams)}"
            )
    named = dict(model.named_modules())
    resolved: dict[str, tuple[str, str]] = {}
    for name in modules:
        pair = next((tuple(p) for pattern, p in rules.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if pair is None and len(streams) == 1:
            pair = (streams[0], streams[0])
        if pair is None:
            pair = _stock_role(name, named)
            if pair is not None and not set(pair) <= set(streams):
                pair = None
        if pair is None:
            raise ValueError(
                f"No token stream for attention module {name!r}: add a pattern for it to argument "
                f"`attention_streams` (pattern -> (query_stream, key_stream)); streams: {list(streams)}"
            )
        resolved[name] = pair  # type: ignore[assignment]
    return resolved


#: Label of the bucket that all untracked ids of a stream fold into (see ``max_tracked_tokens``).
OTHER_LABEL = "<other>"


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


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_UNITS["tib"] = 2**40


def parse_bytes(name: str, value: int | float | str) -> int:
    """A byte count from an int or a string such as ``"1GiB"``, ``"512 MB"`` or ``"2e9"``; errors name ``name``.

    Example:
        >>> parse_bytes("memory_budget", "1.5 GiB")
        1610612736
    """
    text = value.strip().lower().replace(" ", "") if isinstance(value, str) else None
    number: float | None = None
    if text is not None:
        unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if text.endswith(u)), None)
        digits = text[: -len(unit)] if unit else text
        try:
            number = float(digits) * _UNITS[unit or "b"]
        except ValueError:
            number = None
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    if number is None or not number >= 1 or number == float("inf"):  # 0.5 bytes would be a budget of 0
        raise ValueError(
            f"Expected argument `{name}` to be a positive number of bytes or a string such as '1GiB' or '512MB', "
            f"but got {value!r}"
        )
    return int(number)
