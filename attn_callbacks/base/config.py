"""Argument checks and per-stream normalisation: one implementation of each, shared by every argument.

Errors name the argument and the bad value: ``Expected argument `top_k` to be a positive integer, but got -3``. The
type aliases here are the ones ``LightningCLI`` reads from :class:`~attn_callbacks.AttentionMonitor`'s signature.
"""

from __future__ import annotations

import numbers
import os
import pickle
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

__all__ = [
    "DEFAULT_STREAM",
    "TokenLabels",
    "TokenLookup",
    "TokenSource",
    "Tokenizer",
    "batch_source",
    "check_attention_streams",
    "check_choice",
    "check_path",
    "check_patterns",
    "check_picklable",
    "flag",
    "format_bytes",
    "int_list",
    "labels_per_stream",
    "mask_getters",
    "non_empty_str",
    "parse_bytes",
    "per_stream",
    "positive_int",
    "resolve_vocab_sizes",
    "short_repr",
    "stream_getters",
    "unit_interval",
]

T = TypeVar("T")

#: The stream name used when ``token_ids`` is a single key or callable.
DEFAULT_STREAM = "tokens"

# A batch key, or a callable batch -> LongTensor (B, L). The callable is typed ``Callable[[Any], Any]`` on purpose:
# jsonargparse (LightningCLI) reads a callable returning a class as "build that class from a config dict", and would
# turn a mapping of streams into a ``Tensor`` factory.
TokenSource = str | int | Callable[[Any], Any]


@runtime_checkable
class Tokenizer(Protocol):
    """What labels need of a Hugging Face tokenizer: ``convert_ids_to_tokens`` (``None`` for an unknown id)."""

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]: ...


@runtime_checkable
class TokenLookup(Protocol):
    """What labels need of a ``tokenizers.Tokenizer`` (``Tokenizer.from_file("tokenizer.json")``, the fast
    tokenizer's backend): ``id_to_token`` (``None`` for an unknown id)."""

    def id_to_token(self, id: int) -> str | None: ...  # the parameter's name in tokenizers


TokenLabels = Sequence[str] | Mapping[int, str] | Callable[[int], str] | Tokenizer | TokenLookup | None


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` for an error message: whole up to ``limit`` characters, else its first ``limit - 1`` and "…",
    then the value's type (and length): a vocabulary, a batch's keys or a tokenizer never fills the screen.

    Example:
        >>> short_repr(list(range(100)), limit=12)
        '[0, 1, 2, 3… (list of length 100)'
    """
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not hide the error being reported
        return f"<{type(value).__name__} object>"
    if len(text) <= limit:
        return text
    try:
        size = f" of length {len(value)}"
    except Exception:  # no length (or a broken one)
        size = ""
    return f"{text[: max(limit - 1, 0)]}… ({type(value).__name__}{size})"


def _integer(value: Any) -> bool:
    """Whether ``value`` is an integer: Python's or numpy's (``np.int64`` from an array or a config), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def positive_int(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` as an int if it is an integer (not a bool) ``>= minimum``."""
    if not _integer(value) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"Expected argument `{name}` to be {what}, but got {short_repr(value)}")
    return int(value)


def int_list(name: str, value: Any) -> list[int]:
    """A sequence of integers (numpy's too), as sorted Python ints without repeats."""
    if not _iterable(value) or not all(_integer(i) for i in value):
        raise ValueError(f"Expected argument `{name}` to be a sequence of integers, but got {short_repr(value)}")
    return sorted({int(i) for i in value})


def _iterable(value: Any) -> bool:
    """Whether ``value`` is a collection of items to check one by one (a string is one item, not a collection)."""
    return isinstance(value, Iterable) and not isinstance(value, (str, bytes))


def flag(name: str, value: Any) -> bool:
    """``value`` if it is True or False (numpy's too): ``"False"`` or ``"no"`` would read as True."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"Expected argument `{name}` to be True or False, but got {short_repr(value)}")
    return bool(value)


def non_empty_str(name: str, value: Any) -> str:
    """``value`` if it is a non-empty string."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"Expected argument `{name}` to be a non-empty string, but got {short_repr(value)}")
    return value


def unit_interval(name: str, value: Any) -> float:
    """``value`` as a float if it is a number (numpy's too, not a bool) in ``[0, 1]``."""
    if isinstance(value, (bool, np.bool_)) or not (isinstance(value, numbers.Real) and 0 <= value <= 1):
        raise ValueError(f"Expected argument `{name}` to be in [0, 1], but got {short_repr(value)}")
    return float(value)


def check_picklable(**arguments: Any) -> None:
    """Raise ``TypeError`` naming the first argument that cannot be pickled, which ``strategy='ddp_spawn'`` needs."""
    for argument, value in arguments.items():
        try:
            pickle.dumps(value)
        except Exception as err:
            raise TypeError(
                f"AttentionMonitor argument `{argument}` cannot be pickled ({err}), which strategy='ddp_spawn' "
                "needs to start its processes: use a module-level function or a batch key instead of a lambda "
                "or local function, or strategy='ddp'"
            ) from err


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> Any:
    """``value`` if it is one of ``choices``."""
    if value not in choices:
        listed = ", ".join(map(repr, choices[:-1])) + f" or {choices[-1]!r}"
        raise ValueError(f"Expected argument `{name}` to be {listed}, but got {short_repr(value)}")
    return value


def per_stream(
    name: str, value: Any, streams: Sequence[str], check: Callable[[str, Any], T], default: Any = None
) -> dict[str, T]:
    """One argument per stream: a value for every stream, or a mapping stream name -> value (every key a stream).

    Args:
        name: the argument's name, for errors.
        value: the argument.
        streams: the stream names of ``token_ids``.
        check: ``check(name, value)`` validates and normalises one stream's value.
        default: what a stream left out of a mapping gets: a value to check, or None to leave the stream out.
    """
    if not isinstance(value, Mapping):
        checked = check(name, value)
        return dict.fromkeys(streams, checked)
    unknown = [s for s in value if s not in streams]
    if unknown:
        raise ValueError(
            f"Argument `{name}` names unknown stream(s) {short_repr(unknown)}; streams: {short_repr(list(streams))}"
        )
    given = {s: value[s] for s in streams if s in value}
    if default is not None:
        given = {s: given.get(s, default) for s in streams}
    return {s: check(name, v) for s, v in given.items()}


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
            raise ValueError(
                f"Expected the stream names in argument `token_ids` to be strings, but got {short_repr(stream)}"
            )
        batch_source("token_ids", source, stream)
    return getters


def mask_getters(token_mask: TokenSource | Mapping[str, TokenSource] | None, streams: Sequence[str]) -> dict[str, Any]:
    """Normalise ``token_mask`` to a mapping stream name -> batch key or callable (streams left out have none).

    Example:
        >>> mask_getters("attention_mask", ["tokens"])
        {'tokens': 'attention_mask'}
    """
    if token_mask is None:
        return {}
    if not isinstance(token_mask, Mapping):
        if len(streams) > 1:  # one mask for streams of other lengths: say which is which
            raise ValueError(
                f"Expected argument `token_mask` to be a mapping stream name -> batch key or callable, as "
                f"`token_ids` defines streams {short_repr(list(streams))}, but got {short_repr(token_mask)}"
            )
        token_mask = {streams[0]: token_mask}
    given = per_stream("token_mask", token_mask, streams, lambda _, source: source)  # refuses unknown streams
    return {stream: batch_source("token_mask", source, stream) for stream, source in given.items()}


def batch_source(name: str, source: Any, stream: Any) -> TokenSource:
    """``source`` if it is a batch key (a mapping key, sequence index or attribute name) or a callable."""
    if isinstance(source, bool) or not (isinstance(source, (str, int)) or callable(source)):
        raise ValueError(
            f"Expected argument `{name}` to be a batch key, a callable batch -> Tensor (B, L) or a mapping "
            f"of stream names to either, but got {short_repr(source)} for stream {short_repr(stream)}"
        )
    return source


def resolve_vocab_sizes(vocab_size: int | Mapping[str, int], streams: Sequence[str]) -> dict[str, int]:
    """Vocabulary size per stream from an int (shared) or a per-stream mapping, validated."""
    sizes = dict(vocab_size) if isinstance(vocab_size, Mapping) else dict.fromkeys(streams, vocab_size)
    missing = [s for s in streams if s not in sizes]
    if missing:
        raise ValueError(
            f"Argument `vocab_size` has no entry for stream(s) {short_repr(missing)}; "
            f"got {short_repr(dict(vocab_size))}"
        )
    unknown = [s for s in sizes if s not in streams]
    if unknown:
        raise ValueError(
            f"Argument `vocab_size` names stream(s) {short_repr(unknown)} that argument `token_ids` does not define; "
            f"streams: {short_repr(list(streams))}"
        )
    for stream, size in sizes.items():
        if not _integer(size) or size <= 0:
            where = "" if not isinstance(vocab_size, Mapping) else f" for stream {stream!r}"
            raise ValueError(
                f"Expected argument `vocab_size` to be a positive integer{where}, but got {short_repr(size)}"
            )
    return {s: int(sizes[s]) for s in streams}


def labels_per_stream(id_to_token: Any, streams: Sequence[str]) -> dict[str, TokenLabels]:
    """Every stream's labels: ``id_to_token`` for all, or a mapping stream name -> labels (every key a stream)."""
    if isinstance(id_to_token, Mapping) and any(key in streams for key in id_to_token):
        unknown = [key for key in id_to_token if key not in streams][:5]
        if unknown:
            raise ValueError(
                f"Argument `id_to_token` names unknown stream(s) {short_repr(unknown)}; streams: "
                f"{short_repr(list(streams))} (an id -> label mapping takes integer ids as keys)"
            )
        return {s: _labels(id_to_token.get(s), f" for stream {s!r}") for s in streams}
    return dict.fromkeys(streams, _labels(id_to_token))


def _labels(value: Any, where: str = "") -> TokenLabels:
    """One stream's ``id_to_token``, checked: None, a tokenizer (``transformers``' or ``tokenizers``'), a callable, a
    sequence of labels, or ids -> labels."""
    if value is None or isinstance(value, (Tokenizer, TokenLookup)):
        return value
    if isinstance(value, Mapping):
        keys = [key for key in value if not isinstance(key, numbers.Integral) or isinstance(key, bool)]
        if keys:
            raise ValueError(
                f"Argument `id_to_token`{where} maps ids to labels, so its keys must be integer ids, but it has keys "
                f"{short_repr(keys[:5])} (a tokenizer's get_vocab() maps tokens to ids: invert it, or pass the "
                "tokenizer)"
            )
        return value
    indexable = hasattr(value, "__getitem__") and hasattr(value, "__len__")  # a list, or a numpy array of labels
    if callable(value) or (indexable and not isinstance(value, (str, bytes))):
        return value
    raise ValueError(
        f"Expected argument `id_to_token`{where} to be a sequence of labels, a mapping id -> label, a callable, a "
        f"tokenizer (with convert_ids_to_tokens or id_to_token) or None, but got {short_repr(value)}"
    )


def check_patterns(name: str, value: Any) -> list[str] | None:
    """A list of fnmatch patterns, or None."""
    if value is not None and (not _iterable(value) or not all(isinstance(p, str) for p in value)):
        raise ValueError(f"Expected argument `{name}` to be a list of fnmatch patterns, but got {short_repr(value)}")
    return None if value is None else list(value)


def check_attention_streams(value: Any) -> dict[str, tuple[str, str]] | None:
    """``attention_streams``: fnmatch pattern -> (query stream, key stream), or None."""
    if value is None:
        return None
    if not (
        isinstance(value, Mapping)
        and all(
            isinstance(pattern, str)
            and isinstance(pair, Sequence)
            and not isinstance(pair, str)
            and len(pair) == 2
            and all(isinstance(stream, str) for stream in pair)
            for pattern, pair in value.items()
        )
    ):
        raise ValueError(
            "Expected argument `attention_streams` to map module name patterns to (query stream, key stream) "
            f"pairs, such as {{'decoder.*.multihead_attn': ('tgt', 'src')}}, but got {short_repr(value)}"
        )
    return {pattern: tuple(pair) for pattern, pair in value.items()} or None


def check_path(name: str, value: Any) -> str | os.PathLike | None:
    """A path (str or ``os.PathLike``) or None."""
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"Expected argument `{name}` to be a path (str or Path) or None, but got {short_repr(value)}")
    return value


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
    elif isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
        try:
            number = float(value)
        except OverflowError:  # an int past float's range
            number = None
    if number is None or not number >= 1 or number == float("inf"):  # 0.5 bytes would be a budget of 0
        raise ValueError(
            f"Expected argument `{name}` to be a positive number of bytes or a string such as '1GiB' or '512MB', "
            f"but got {short_repr(value)}"
        )
    return round(number)  # "4.1GB" is 4.1 * 10**9 = 4099999999.9999995 in floats


def format_bytes(size: float) -> str:
    """``1536`` -> ``"1.5 KiB"``: binary units, one decimal (bytes as a whole number)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
