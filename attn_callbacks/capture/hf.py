"""Hugging Face ``transformers`` attention modules: finding them and reading their weights (the ``[hf]`` extra).

A model of the BERT family (``BertModel``, ``RobertaModel``, ``DistilBertModel``, ``ElectraModel``, ...) declares in
``_can_record_outputs`` which module classes produce its ``attentions`` (and ``cross_attentions``) and at which index
of their output tuple. With ``attn_implementation="eager"`` those modules return the softmaxed weights
``(B, H, Lq, Lk)`` on every call, whether or not ``output_attentions`` was asked for, so a plain forward hook reads
them without changing the call. SDPA, flash and flex attention return ``None`` there: nothing to read. Under SDPA
the weights are recomputed from the calls instead (:mod:`attn_callbacks.capture.sdpa`), under the same module names;
flash and flex attention are refused. :func:`seq2seq_streams` wires an encoder-decoder's modules to the streams
``src`` and ``tgt``.

Nothing here imports ``transformers``: a model can only hold its modules if the user has imported it already.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from attn_callbacks.base.tensor_ops import float_mask_allows

__all__ = [
    "attention_outputs",
    "attention_records",
    "check_readable",
    "eager_allowed",
    "eager_mask",
    "implementation",
    "is_model",
    "missing_key_hint",
    "no_weights_message",
    "part_of",
    "seq2seq_parts",
    "seq2seq_streams",
    "undeclared_models",
    "unsupported_hint",
]

_ATTENTION_KEYS = ("attentions", "cross_attentions")


def attention_outputs(model: nn.Module) -> dict[str, int]:
    """Every Hugging Face attention module in ``model`` by its ``named_modules()`` name -> the index of the
    attention weights in that module's output tuple (see :func:`attention_records`)."""
    return {name: index for name, (index, _) in attention_records(model).items()}


def attention_records(model: nn.Module) -> dict[str, tuple[int, bool]]:
    """Every Hugging Face attention module in ``model`` by its ``named_modules()`` name -> (the index of the attention
    weights in its output tuple, whether it is recorded as cross-attention). Empty when ``transformers`` is not
    imported.

    Matched as transformers matches ``output_attentions``: each module by the ``_can_record_outputs`` of the nearest
    Hugging Face model holding it (an encoder inside an encoder-decoder by its own), names relative to the outermost
    one. A class recorded under both keys is read at its ``attentions`` index, as self-attention.
    """
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return {}
    found: dict[str, tuple[int, bool]] = {}

    def visit(module: nn.Module, name: str, relative: str | None, specs: list[tuple]) -> None:
        if isinstance(module, transformers.PreTrainedModel):
            recordable = getattr(type(module), "_can_record_outputs", None) or {}
            specs = [(*_spec(spec), key) for key in _ATTENTION_KEYS for spec in _as_list(recordable.get(key))]
            relative = "" if relative is None else relative
        if relative is not None:
            for target_class, class_name, layer_name, index, key in specs:
                matches = (target_class is not None and isinstance(module, target_class)) or (
                    class_name is not None and relative.endswith(class_name)
                )
                if matches and (layer_name is None or f".{layer_name.strip('.')}." in f"{relative}."):
                    found.setdefault(name, (index, key == "cross_attentions"))
        for child_name, child in module.named_children():
            child_relative = None if relative is None else f"{relative}.{child_name}"
            visit(child, f"{name}.{child_name}" if name else child_name, child_relative, specs)

    visit(model, "", None, [])
    return found


def unsupported_hint(model: nn.Module) -> str:
    """Why a model holding Hugging Face models has no attention module we can read, or ``""``."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return ""
    roots = [type(m).__name__ for m in model.modules() if isinstance(m, transformers.PreTrainedModel)]
    if not roots:
        return ""
    return (
        f"; it holds the Hugging Face model {roots[0]}, which declares no attention modules in "
        f"`_can_record_outputs` (transformers {transformers.__version__}) and none of whose modules takes a softmax "
        "and a matrix product in its own code (attention computed by hand)"
    )


def is_model(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face model (``transformers.PreTrainedModel``); False when ``transformers`` is
    not imported."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(module, transformers.PreTrainedModel)


def undeclared_models(named: Mapping[str, nn.Module], declared: Iterable[str]) -> list[str]:
    """The names (as in ``named``) of the Hugging Face models holding none of the ``declared`` attention modules
    (:func:`attention_outputs`): models whose ``_can_record_outputs`` names no attention (DeBERTa, MPNet, XLNet in
    transformers 5), whose modules compute attention by hand, read as such."""
    declared = list(declared)
    return [
        name
        for name, module in named.items()
        if is_model(module) and not any(name == "" or d.startswith(f"{name}.") for d in declared)
    ]


def seq2seq_parts(model: nn.Module) -> dict[str, str]:
    """The encoder and the decoder of every Hugging Face encoder-decoder model in ``model``: their
    ``named_modules()`` names -> the stream their queries read, ``"src"`` or ``"tgt"``."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return {}
    parts: dict[str, str] = {}
    ids = {id(module): name for name, module in model.named_modules()}
    for module in model.modules():
        if isinstance(module, transformers.PreTrainedModel) and getattr(module.config, "is_encoder_decoder", False):
            for stream, part in (("src", _part(module, "get_encoder")), ("tgt", _part(module, "get_decoder"))):
                if id(part) in ids:
                    parts.setdefault(ids[id(part)], stream)
    return parts


def part_of(name: str, parts: Mapping[str, str]) -> tuple[str, str] | None:
    """``(name prefix, query stream)`` of the encoder or decoder in ``parts`` (:func:`seq2seq_parts`) that holds
    module ``name``, or None."""
    return next(((prefix, stream) for prefix, stream in parts.items() if name.startswith(f"{prefix}.")), None)


def seq2seq_streams(model: nn.Module) -> dict[str, tuple[str, str]]:
    """(query stream, key stream) of the attention modules (:func:`attention_records`) of every Hugging Face
    encoder-decoder model in ``model``, by ``named_modules()`` name, with the streams ``nn.Transformer`` names:
    encoder self-attention ``("src", "src")``, decoder self-attention ``("tgt", "tgt")``, cross-attention
    ``("tgt", "src")``."""
    parts = seq2seq_parts(model)  # name prefix of each encoder / decoder -> its query stream
    roles: dict[str, tuple[str, str]] = {}
    for name, (_, cross) in attention_records(model).items():
        part = part_of(name, parts)
        if part is not None:
            roles[name] = ("tgt", "src") if cross else (part[1], part[1])
    return roles


def missing_key_hint(key: Any, batch: Any) -> str:
    """Why a seq2seq batch may lack ``key``, and how to add it: ``""`` unless ``key`` is ``decoder_input_ids`` and the
    batch holds ``labels``."""
    if key != "decoder_input_ids" or "labels" not in batch:
        return ""
    return (
        ". A Hugging Face encoder-decoder given `labels` alone derives decoder_input_ids inside forward (labels "
        "shifted right), where the monitor cannot read them: put them in the batch, with "
        "transformers.DataCollatorForSeq2Seq(tokenizer, model=model), or in the LightningModule's "
        'on_after_batch_transfer: batch["decoder_input_ids"] = '
        'model.prepare_decoder_input_ids_from_labels(labels=batch["labels"])'
    )


def _part(model: nn.Module, getter: str) -> nn.Module | None:
    try:
        return getattr(model, getter)()
    except (AttributeError, NotImplementedError, TypeError):
        return None


def implementation(module: nn.Module) -> Any:
    """The ``attn_implementation`` a Hugging Face attention module runs, from its own ``config`` or the first inner
    module's that has one (T5's recorded layer holds its attention), or None."""
    for inner in module.modules():
        found = getattr(getattr(inner, "config", None), "_attn_implementation", None)
        if found is not None:
            return found
    return None


def check_readable(name: str, module: nn.Module) -> None:
    """Raise when ``module`` runs attention whose weights can be neither read (eager) nor recomputed (sdpa): flash or
    flex attention, or a kernel of the user's.

    Raises:
        ValueError: naming the module, the implementation and what to set instead.
    """
    if implementation(module) not in (None, "eager", "sdpa"):
        raise ValueError(no_weights_message(name, module))


def no_weights_message(
    name: str, module: nn.Module, running: Any = None, index: int | None = None, got: Any = None
) -> str:
    """Why a Hugging Face attention module gives no weights, and what to set (``index``, ``got``: what its output held
    where the weights should be)."""
    running = implementation(module) if running is None else running
    if running in (None, "eager"):
        what = f"a tensor of shape {tuple(got.shape)}" if hasattr(got, "shape") else type(got).__name__
        return (
            f"Hugging Face attention module {name!r} ({type(module).__name__}) returned {what} at index {index} of "
            "its output, where attention weights (B, H, Lq, Lk) were expected; select other modules with `modules`"
        )
    if running == "sdpa":  # switched after the monitor's setup decided how to read the module
        return (
            f"Hugging Face attention module {name!r} ({type(module).__name__}) was switched to "
            "attn_implementation='sdpa' after the monitor's setup, which read it as eager attention: choose the "
            "implementation before calling fit / validate / test"
        )
    return (
        f"Hugging Face attention module {name!r} ({type(module).__name__}) runs attn_implementation="
        f"{running!r}, which returns no attention weights. Load the model with "
        '`from_pretrained(..., attn_implementation="sdpa")` (or "eager"; or a config saying so), '
        'or call `model.set_attn_implementation("sdpa")` before training'
    )


def eager_mask(call: Mapping[str, Any]) -> Any:
    """The mask a Hugging Face eager attention call (its bound arguments ``call``) adds to its scores: its
    ``attention_mask``, or GPT-2's cross-attention's ``encoder_attention_mask``; None when it has none."""
    if call.get("encoder_hidden_states") is not None and "encoder_attention_mask" in call:
        return call["encoder_attention_mask"]
    return call.get("attention_mask")


def eager_allowed(mask: Any, weights: Tensor, module: nn.Module) -> Tensor | None:
    """The keys each query of a Hugging Face eager attention call with ``mask`` (:func:`eager_mask`) may attend to,
    ``(B or 1, Lq, Lk)`` bool, for its weights ``(B, H, Lq, Lk)``; None where the mask does not tell.

    In transformers >= 5 an eager module adds the mask it is handed to its scores, ``(B or 1, 1 or H, Lq, Lk)``: 0
    where a key is allowed and the dtype's minimum where not, causal and sliding windows included (read as
    :func:`~attn_callbacks.base.tensor_ops.float_mask_allows`); a bool mask is True where allowed, as SDPA's. No mask
    (an encoder's batch without padding) allows every key of a module whose ``is_causal`` is False. A mask of another
    shape is not read, and :func:`mask_explains` checks a mask against the weights.

    Example:
        >>> mask = torch.tensor([0.0, torch.finfo(torch.float32).min]).expand(1, 1, 2, 2)
        >>> eager_allowed(mask, torch.full((1, 4, 2, 2), 0.5), nn.Identity())[0].tolist()
        [[True, False], [True, False]]
    """
    if mask is None:  # nothing added: every key allowed, unless the module is causal (masked where, unknown)
        return None if _causal(module) is not False else weights.new_ones((1, *weights.shape[-2:]), dtype=torch.bool)
    if not isinstance(mask, Tensor) or mask.dim() != 4 or mask.shape[-2:] != weights.shape[-2:]:
        return None
    if mask.size(0) not in (1, weights.size(0)) or mask.size(1) not in (1, weights.size(1)):
        return None
    free = mask if mask.dtype == torch.bool else float_mask_allows(mask)
    return free.any(dim=1).to(weights.device)  # (B or 1, Lq, Lk): allowed for some head


def _causal(module: nn.Module) -> bool | None:
    """A Hugging Face attention module's ``is_causal``, from it or the first inner module that has one (T5's recorded
    layer holds its attention), or None."""
    flags = (getattr(inner, "is_causal", None) for inner in module.modules())
    return next((flag for flag in flags if isinstance(flag, bool)), None)


def mask_explains(allowed: Tensor, weights: Tensor) -> bool:
    """Whether every positive weight ``(B, H, Lq, Lk)`` lies on a key ``allowed`` allows, in the rows where it allows
    some key (a row it masks whole, padding, holds uniform weights): False when the mask is not what the module added
    to its scores (a bias folded into it, say). One sync with the device."""
    some = allowed.any(dim=-1, keepdim=True)  # (B or 1, Lq, 1)
    return not bool(((weights > 0).any(dim=1) & ~allowed & some).any())


def _as_list(spec: Any) -> list[Any]:
    if spec is None:
        return []
    return list(spec) if isinstance(spec, (list, tuple)) else [spec]


def _spec(spec: Any) -> tuple[type | None, str | None, str | None, int]:
    """(target class, class-name suffix, layer name, output index) of one ``_can_record_outputs`` entry: a class, a
    class-name string, or an ``OutputRecorder``; attention weights sit at index 1 unless the recorder says otherwise."""
    if isinstance(spec, type):
        return spec, None, None, 1
    if isinstance(spec, str):
        return None, spec, None, 1
    return (
        getattr(spec, "target_class", None),
        getattr(spec, "class_name", None),
        getattr(spec, "layer_name", None),
        int(getattr(spec, "index", 1)),
    )
