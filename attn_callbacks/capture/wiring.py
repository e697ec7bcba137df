"""Wiring: which token streams feed the queries and the keys of each attention module."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from attn_callbacks.capture import hf
from attn_callbacks.capture.find import clean_name, named_modules

__all__ = ["first_rule", "resolve_streams"]

_CROSS = re.compile(r"encoder|cross|src|enc_?dec", re.IGNORECASE)  # a decoder module attending to the encoder


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

    Rules, in order: the first fnmatch pattern of ``attention_streams`` matching the module name; for stock
    ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` attention and the attention modules of Hugging
    Face encoder-decoder models (T5, BART, Marian...), the streams named ``src`` and ``tgt`` (as in
    ``nn.Transformer.forward``): encoder self-attention src→src, decoder self-attention tgt→tgt, decoder
    cross-attention tgt→src; with a single stream, that stream for queries and keys, except for a decoder's attention
    (above), which reads target tokens that one stream rarely holds.

    Raises:
        ValueError: a module no rule covers, a decoder's attention with a single stream and no rule, or a rule naming
            an unknown stream; the message names the module and the streams.
    """
    rules = dict(attention_streams or {})
    for pattern, pair in rules.items():  # their shape is checked with the other arguments (check_attention_streams)
        unknown = [s for s in pair if s not in streams]
        if unknown:
            raise ValueError(
                f"Argument `attention_streams` maps pattern {pattern!r} to unknown stream(s) {unknown}; the streams "
                f"of `token_ids` are {list(streams)}"
            )
    named = named_modules(model)  # clean names, as the modules are named
    seq2seq = {clean_name(name): pair for name, pair in hf.seq2seq_streams(model).items()}
    parts = {clean_name(name): stream for name, stream in hf.seq2seq_parts(model).items()}
    resolved: dict[str, tuple[str, str]] = {}
    for name in modules:
        pair = first_rule(name, rules)
        if pair is None:
            # An encoder's attention reads the source, declared or not (a decoder's may be self- or cross-attention).
            prefix, part = hf.part_of(name, parts) or (None, None)
            role = _stock_role(name, named) or seq2seq.get(name) or (("src", "src") if part == "src" else None)
            # A decoder's attention reads target tokens (an undeclared decoder's too, self- or cross-attention): not
            # the one stream, unless that is the stream it reads.
            decoder = part == "tgt" if role is None else "tgt" in role
            if len(streams) == 1 and decoder and (role is None or not set(role) <= set(streams)):
                raise ValueError(_one_stream_message(name, role, streams[0]))
            pair = (streams[0], streams[0]) if len(streams) == 1 else role
            if pair is not None and not set(pair) <= set(streams):
                pair = None
        if pair is None:
            raise ValueError(
                f"No token stream for attention module {name!r}: add a pattern for it to argument "
                f"`attention_streams` (pattern -> (query_stream, key_stream)); streams: {list(streams)}"
                + _decoder_hint(prefix if part == "tgt" else None, modules, streams)
            )
        resolved[name] = pair  # type: ignore[assignment]
    return resolved


def _one_stream_message(name: str, role: tuple[str, str] | None, stream: str) -> str:
    """Why a decoder's attention module (``role``: its streams; None: a Hugging Face decoder's, self- or
    cross-attention) cannot read the one stream ``stream``."""
    both = "token_ids={'src': <source ids' key>, 'tgt': <target ids' key>}"
    if role is None:
        return (
            f"Attention module {name!r} lies in a Hugging Face decoder: its queries are target tokens, but "
            f"`token_ids` names one stream, {stream!r}, whose ids its weights would be mapped to. Name both streams, "
            f"as the model takes them: {both}; or leave the module out with `modules`"
        )
    if role == ("tgt", "tgt"):
        return (
            f"Attention module {name!r} is a decoder's self-attention: its queries are target tokens, but `token_ids` "
            f"names one stream, {stream!r}, whose ids its weights would be mapped to. Name both streams, as `forward` "
            f"takes them: {both}; or, if the decoder reads {stream!r} itself (a decoder-only model built from "
            f"nn.TransformerDecoderLayer), say so: attention_streams={{'*': ({stream!r}, {stream!r})}}; or leave the "
            "module out with `modules`"
        )
    return (
        f"Attention module {name!r} is a decoder's cross-attention (target → source): its queries are target tokens "
        f"and its keys source tokens, but `token_ids` names one stream, {stream!r}. Name both streams, as `forward` "
        f"takes them: {both}; or leave the module out with `modules` (cross-attention over what is not tokens, such "
        "as audio frames or image patches, cannot be mapped to a vocabulary)"
    )


def _decoder_hint(decoder: str | None, modules: Sequence[str], streams: Sequence[str]) -> str:
    """For a module in ``decoder``, the decoder of a Hugging Face encoder-decoder that declares no attention modules
    (FSMT, LED, ProphetNet), a mapping of that decoder's modules by their last name to check and give; ``""`` for
    None."""
    if decoder is None or not {"src", "tgt"} <= set(streams):
        return ""
    last = dict.fromkeys(m.rpartition(".")[2] for m in modules if m.startswith(f"{decoder}."))
    guess = {f"{decoder}.*.{n}": ("tgt", "src") if _CROSS.search(n) else ("tgt", "tgt") for n in last}
    return (
        f". It lies in a Hugging Face decoder ({decoder!r}) whose model does not declare which of its attention "
        f"modules attend to the encoder; by their names, probably attention_streams={guess} (check the "
        "cross-attention: its keys are source tokens)"
    )


def first_rule(name: str, rules: Mapping[str, Any]) -> tuple[str, str] | None:
    """The ``(query_stream, key_stream)`` of the first ``attention_streams`` pattern matching a module name."""
    return next((tuple(p) for pattern, p in rules.items() if fnmatch.fnmatchcase(name, pattern)), None)
