"""Token labels: the text shown for a token id on heatmap axes, in tables, exports and the CLI."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from attn_callbacks.base.config import Tokenizer, TokenLabels

__all__ = ["MAX_LABEL", "OTHER_LABEL", "label_tokens"]

#: Label of the bucket that all untracked ids of a stream fold into (see ``max_tracked_tokens``).
OTHER_LABEL = "<other>"

#: Labels longer than this are trimmed on heatmap axes.
MAX_LABEL = 14


def label_tokens(ids: Sequence[int], id_to_token: TokenLabels = None, max_length: int | None = MAX_LABEL) -> list[str]:
    """Readable labels for token ids: from a list, dict, callable or Hugging Face tokenizer, else the id itself.

    Args:
        ids: token ids.
        id_to_token: a list, dict or callable id -> str, or a tokenizer (anything with ``convert_ids_to_tokens``, which
            is called once for all ``ids``); ids are used where it has no entry (or when None).
        max_length: longer labels are trimmed to this many characters, ending in "…"; None keeps them whole.

    Example:
        >>> label_tokens([0, 2], ["<pad>", "the", "a-very-long-word-piece"])
        ['<pad>', 'a-very-long-w…']
    """
    labels = []
    # A tokenizer is callable too (text -> ids): it must be recognised before the callable case.
    tokens = None
    if isinstance(id_to_token, Tokenizer):
        known = [int(i) for i in ids if int(i) >= 0]  # a fast tokenizer cannot take a negative id
        found = iter(id_to_token.convert_ids_to_tokens(known))
        tokens = [next(found) if int(i) >= 0 else None for i in ids]
    for position, token in enumerate(ids):
        if tokens is not None:
            text = str(token) if tokens[position] is None else str(tokens[position])
        elif id_to_token is None:
            text = str(token)
        elif callable(id_to_token) and not isinstance(id_to_token, (Mapping, Sequence)):
            text = str(id_to_token(token))
        elif isinstance(id_to_token, Mapping):
            text = str(id_to_token.get(token, token))
        else:
            text = str(id_to_token[token]) if 0 <= token < len(id_to_token) else str(token)
        text = text.replace("\n", "\\n") or repr(text)
        labels.append(text if max_length is None or len(text) <= max_length else text[: max_length - 1] + "…")
    return labels
