"""Finding the attention modules of a model: stock ``nn.MultiheadAttention``, Hugging Face attention and modules that
call ``scaled_dot_product_attention``, named as the model names them without the parts wrappers insert; their heads
and device. :mod:`attn_callbacks.capture.hooks` reads their weights.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from attn_callbacks.capture import hf
from attn_callbacks.capture.sdpa import (
    HEAD_ATTRIBUTES,
    calls_sdpa,
    computes_attention,
    declared_heads,
    unreadable_attention,
    unreadable_message,
)

__all__ = [
    "WRAPPER_PARTS",
    "clean_name",
    "find_attention_modules",
    "module_device",
    "named_modules",
    "num_heads",
    "output_indices",
    "reads_output",
]


#: Parts that wrappers insert into ``named_modules()`` names: ``torch.compile``'s ``OptimizedModule``, activation
#: checkpointing's ``CheckpointWrapper`` and FSDP1's ``FullyShardedDataParallel``. They never reach a tag.
WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def clean_name(name: str) -> str:
    """A module name without the parts wrappers insert (:data:`WRAPPER_PARTS`): compiling, checkpointing or sharding
    a model does not rename its tags.

    Example:
        >>> clean_name("enc._orig_mod.layers.0._checkpoint_wrapped_module.self_attn")
        'enc.layers.0.self_attn'
    """
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def named_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``model.named_modules()`` by :func:`clean_name`; where a wrapper and the module it wraps get one name, the
    wrapped module (it comes later)."""
    return {clean_name(name): module for name, module in model.named_modules()}


def output_indices(model: nn.Module) -> dict[str, int]:
    """:func:`attn_callbacks.capture.hf.attention_outputs` by :func:`clean_name`."""
    return {clean_name(name): index for name, index in hf.attention_outputs(model).items()}


def find_attention_modules(model: nn.Module, patterns: Sequence[str] | None = None) -> dict[str, nn.Module]:
    """Every attention module in ``model`` by its ``named_modules()`` name without wrapper parts (:func:`clean_name`),
    optionally filtered: each ``nn.MultiheadAttention``, each Hugging Face attention module (``attn_callbacks[hf]``;
    eager or sdpa attention), each other module whose code calls ``scaled_dot_product_attention``
    (:func:`attn_callbacks.capture.sdpa.calls_sdpa`) and each one computing attention by hand, a softmax and a matrix
    product in its code (:func:`attn_callbacks.capture.sdpa.computes_attention`; not one holding attention modules);
    not the model itself, nor one inside the first two kinds.

    Args:
        model: the model to search.
        patterns: fnmatch patterns over (clean) module names (``"encoder.layers.*.self_attn"``); a module is kept when
            any pattern matches. ``None`` keeps all.

    Raises:
        ValueError: no attention module found or kept, or a pattern matches only modules that are not attention
            modules, or matches nothing at all (the message names the pattern); or a kept module runs attention that
            returns no weights and cannot be recomputed: Hugging Face flash / flex attention, ``flex_attention`` or the
            ``flash_attn`` package (the message says what to use instead).

    Example:
        >>> layer = nn.TransformerEncoderLayer(8, 2)
        >>> list(find_attention_modules(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)))
        ['layers.0.self_attn', 'layers.1.self_attn']
    """
    named = named_modules(model)
    hf_modules = output_indices(model)
    found = _candidates(named, hf_modules)
    if not found:
        move = "attention is read from the modules inside the model: move it into an nn.Module of its own, stored on it"
        if calls_sdpa(model):
            itself = f"; {type(model).__name__} itself calls scaled_dot_product_attention, but {move}"
        elif computes_attention(model):
            itself = f"; if {type(model).__name__} computes attention itself (a softmax and a matrix product), {move}"
        else:
            itself = ""
        raise ValueError(
            "No torch.nn.MultiheadAttention, Hugging Face attention module, module calling "
            "scaled_dot_product_attention or module computing attention by hand (a softmax and a matrix product) "
            f"found in the model ({type(model).__name__}){itself}{hf.unsupported_hint(model)}"
        )
    if patterns is not None:
        found = _filter(named, found, patterns)
    for name, module in found.items():
        if name in hf_modules:
            hf.check_readable(name, module)
        elif not isinstance(module, nn.MultiheadAttention) and (function := unreadable_attention(module)):
            raise ValueError(unreadable_message(name, module, function))
    return found


def attention_candidates(model: nn.Module) -> dict[str, nn.Module]:
    """The attention modules :func:`find_attention_modules` finds with no pattern, in model order, none refused yet."""
    return _candidates(named_modules(model), output_indices(model))


def _candidates(named: Mapping[str, nn.Module], hf_modules: Mapping[str, int]) -> dict[str, nn.Module]:
    found = {name: m for name, m in named.items() if isinstance(m, nn.MultiheadAttention) or name in hf_modules}
    inside = tuple(f"{name}." for name in found)  # their inner modules' calls are theirs
    # Hugging Face models declaring no attention modules compute it by hand in their own (DeBERTa, MPNet)
    undeclared = hf.undeclared_models(named, hf_modules)
    by_hand = set()
    for name, module in named.items():
        if name and name not in found and not name.startswith(inside):
            if _calls_attention(module):
                found[name] = module
            elif computes_attention(module, undeclared=not hf.is_model(module) and _within(name, undeclared)):
                found[name] = module
                by_hand.add(name)
    # A module taking a softmax and a product that holds attention modules is their container (a model whose
    # generate() samples from a softmax, say), not attention of its own.
    holders = {name for name in by_hand if any(other.startswith(f"{name}.") for other in found)}
    return {name: found[name] for name in named if name in found and name not in holders}


def _within(name: str, prefixes: Sequence[str]) -> bool:
    """Whether module ``name`` lies inside a module named in ``prefixes`` ("" being the whole model)."""
    return any(prefix == "" or name.startswith(f"{prefix}.") for prefix in prefixes)


def _calls_attention(module: nn.Module) -> bool:
    return calls_sdpa(module) or unreadable_attention(module) is not None


def reads_output(module: nn.Module, name: str, output_index: Mapping[str, int]) -> bool:
    """Whether a Hugging Face attention module returns its weights (eager attention), read by a forward hook."""
    return name in output_index and hf.implementation(module) in (None, "eager")


def _filter(named: dict[str, nn.Module], found: dict[str, nn.Module], patterns: Sequence[str]) -> dict[str, nn.Module]:
    kept: dict[str, nn.Module] = {}
    for pattern in patterns:
        matched = [name for name in named if fnmatch.fnmatchcase(name, pattern)]
        attention = [name for name in matched if name in found]
        if not attention:
            what = f"only modules that are not attention modules ({', '.join(matched[:5])})" if matched else "no module"
            raise ValueError(
                f"Pattern {pattern!r} in argument `modules` matched {what}; attention modules: {', '.join(found)}"
            )
        kept.update((name, found[name]) for name in attention)
    return {name: m for name, m in found.items() if name in kept}  # model order, not pattern order


def module_device(module: nn.Module, default: torch.device | None = None) -> torch.device:
    """The device of a module's first parameter (or buffer); ``default`` (the CPU when None) for a module holding
    neither."""
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu") if default is None else default


def num_heads(module: nn.Module, name: str = "") -> int:
    """Number of heads of an attention module: ``nn.MultiheadAttention`` or a Hugging Face one (from the module, its
    ``config``, or else its first child that says: T5's layer holding its attention). ``name`` is for the error
    message.

    Raises:
        ValueError: the module says nowhere how many heads it has.
    """
    owners = [module, getattr(module, "config", None)]
    owners += [owner for child in module.children() for owner in (child, getattr(child, "config", None))]
    for owner in owners:
        if (heads := declared_heads(owner)) is not None:
            return heads
    raise ValueError(
        f"Cannot tell the number of heads of attention module {name!r} ({type(module).__name__}): none of "
        f"{', '.join(HEAD_ATTRIBUTES)} is a positive integer on the module, its `config` or its children"
    )
