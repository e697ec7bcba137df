"""Token labels: the text shown for a token id on heatmap axes, in tables, exports and the CLI."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from attn_callbacks.base.config import Tokenizer, TokenLabels, TokenLookup, short_repr

__all__ = ["MAX_LABEL", "OTHER_LABEL", "drawable", "label_tokens"]

#: Label of the bucket that all untracked ids of a stream fold into (see ``max_tracked_tokens``).
OTHER_LABEL = "<other>"

#: Labels longer than this are trimmed on heatmap axes.
MAX_LABEL = 14

# What a lookup raises for an id it does not hold: a slow tokenizer past its vocabulary (IndexError), a dict's
# __getitem__ (KeyError), ``tokenizers``' id_to_token for a negative id or one past 2**32 (OverflowError).
_NO_ENTRY = (IndexError, KeyError, OverflowError)


def label_tokens(ids: Sequence[int], id_to_token: TokenLabels = None, max_length: int | None = MAX_LABEL) -> list[str]:
    """Readable labels for token ids: from a list, dict, callable or tokenizer, else the id itself.

    Args:
        ids: token ids.
        id_to_token: a list, dict or callable id -> str, a Hugging Face tokenizer (anything with
            ``convert_ids_to_tokens``, which is called once for all ``ids``), or a ``tokenizers.Tokenizer`` (anything
            with ``id_to_token``). The id is shown where it has no entry: a label of None, an id out of range, an id
            the lookup raises IndexError, KeyError or OverflowError for (or when ``id_to_token`` is None).
        max_length: longer labels are trimmed to this many characters, ending in "…", and lone surrogates (bytes
            decoded with ``surrogateescape``), which no font draws, are written as escapes (``\\xff``); None keeps
            labels whole and as they are.

    Raises:
        RuntimeError: a callable ``id_to_token`` raised another error (the id and the error named).

    Example:
        >>> label_tokens([0, 2], ["<pad>", "the", "a-very-long-word-piece"])
        ['<pad>', 'a-very-long-w…']
    """
    ids = [int(i) for i in ids]
    labels = []
    for token, found in zip(ids, _lookup(ids, id_to_token), strict=True):
        text = str(token) if found is None else str(found)
        text = text.replace("\n", "\\n") or repr(text)
        if max_length is not None:  # shown: a lone surrogate (bytes decoded with surrogateescape) cannot be drawn
            text = drawable(text)
        labels.append(text if max_length is None or len(text) <= max_length else text[: max_length - 1] + "…")
    return labels


def drawable(text: str) -> str:
    """``text`` with each lone surrogate written as an escape: ``\\xff`` for a byte that ``surrogateescape`` decoded,
    ``\\ud800`` for another; text that has none is returned as it is."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return "".join(
            ch
            if not 0xD800 <= ord(ch) <= 0xDFFF
            else f"\\x{ord(ch) - 0xDC00:02x}"
            if 0xDC80 <= ord(ch) <= 0xDCFF
            else f"\\u{ord(ch):04x}"
            for ch in text
        )


def _lookup(ids: list[int], id_to_token: TokenLabels) -> list[Any]:
    """Every id's label from ``id_to_token``, None where it has none."""
    if id_to_token is None:
        return [None] * len(ids)
    # A tokenizer is callable too (text -> ids): it must be recognised before the callable case.
    if isinstance(id_to_token, Tokenizer):
        known = [i for i in ids if i >= 0]  # a fast tokenizer cannot take a negative id
        try:
            found = iter(id_to_token.convert_ids_to_tokens(known))
        except _NO_ENTRY:  # a slow tokenizer, past its vocabulary: one id at a time
            convert = id_to_token.convert_ids_to_tokens
            found = iter([_call(lambda i: convert([i])[0], i) for i in known])
        return [next(found) if i >= 0 else None for i in ids]
    if isinstance(id_to_token, TokenLookup):
        return [_call(id_to_token.id_to_token, i) if i >= 0 else None for i in ids]
    if isinstance(id_to_token, Mapping):
        return [id_to_token.get(i) for i in ids]
    if callable(id_to_token) and not isinstance(id_to_token, Sequence):
        return [_call(id_to_token, i) for i in ids]
    return [id_to_token[i] if 0 <= i < len(id_to_token) else None for i in ids]  # -1 is no index from the end


def _call(lookup: Callable[[int], Any], token: int) -> Any:
    """``lookup(token)``; None for an id it holds no entry for; another error names ``id_to_token`` and the id."""
    try:
        return lookup(token)
    except _NO_ENTRY:
        return None
    except Exception as err:
        raise RuntimeError(f"Argument `id_to_token` raised {short_repr(err)} for token id {token}") from err
