"""The keys each query of an attention call may attend to, read from the call's masks: ``(B or 1, Lq, Lk)`` bool,
for ``nn.MultiheadAttention`` and ``scaled_dot_product_attention`` calls (a float mask by the float-mask rule,
:func:`~attn_callbacks.base.tensor_ops.float_mask_allows`). Hugging Face eager calls:
:func:`attn_callbacks.capture.hf.eager_allowed`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from attn_callbacks.base.tensor_ops import float_mask_allows

__all__ = ["mha_allowed", "sdpa_allowed"]


def mha_allowed(call: Mapping[str, Any], weights: Tensor) -> Tensor | None:
    """The keys each query of an ``nn.MultiheadAttention`` call (its bound arguments ``call``) may attend to,
    ``(B or 1, Lq, Lk)`` bool, from its ``attn_mask`` (boolean: True masks; float: see
    :func:`~attn_callbacks.base.tensor_ops.float_mask_allows`) and
    ``key_padding_mask`` (likewise), for its weights ``(B, H, Lq, Lk)`` or ``(H, Lq, Lk)``; None for a nested-tensor
    call (``nn.TransformerEncoder``'s conversion drops its padding mask: only the weights tell which keys it had).

    Example:
        >>> causal = torch.nn.Transformer.generate_square_subsequent_mask(3)  # 0 on and below the diagonal, -inf above
        >>> mha_allowed({"query": torch.zeros(3, 4), "attn_mask": causal}, torch.zeros(1, 3, 3))[0].int().tolist()
        [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """
    if call["query"].is_nested:
        return None
    len_q, len_k = weights.shape[-2:]
    allowed = torch.ones(1, len_q, len_k, dtype=torch.bool, device=weights.device)
    attn_mask, padding = call.get("attn_mask"), call.get("key_padding_mask")
    if attn_mask is not None:
        free = _with_added_keys(~attn_mask if attn_mask.dtype == torch.bool else float_mask_allows(attn_mask), len_k)
        if free.dim() == 3:  # (B * H, Lq, Lk): allowed for some head
            free = free.view(-1, weights.size(-3), len_q, len_k).any(dim=1)
        allowed = allowed & free.to(weights.device)
    if padding is not None:
        free = _with_added_keys(~padding if padding.dtype == torch.bool else float_mask_allows(padding), len_k)
        allowed = allowed & free.to(weights.device).view(-1, 1, len_k)  # (B, 1, Lk); (1, 1, Lk) unbatched
    return allowed


def _with_added_keys(free: Tensor, len_k: int) -> Tensor:
    """A mask over the caller's keys, allowing the keys ``add_bias_kv`` / ``add_zero_attn`` append after them."""
    missing = len_k - free.size(-1)
    return torch.nn.functional.pad(free, (0, missing), value=True) if missing > 0 else free


def sdpa_allowed(attn_mask: Tensor | None, is_causal: bool, len_q: int, len_k: int, device: torch.device) -> Tensor:
    """The keys each query of a ``scaled_dot_product_attention`` call may attend to, ``(B or 1, Lq, Lk)`` bool: where a
    boolean ``attn_mask`` is True (for some head) or a float one allows it
    (:func:`~attn_callbacks.base.tensor_ops.float_mask_allows`: a bias such as T5's position bias or ALiBi allows;
    ``-inf``, ``finfo.min``, ``-1e9`` mask), below the diagonal with ``is_causal``.

    Example:
        >>> sdpa_allowed(torch.tensor([[0.0, float("-inf"), -0.5]]), False, 1, 3, torch.device("cpu")).tolist()
        [[[True, False, True]]]
    """
    allowed = torch.ones(1, len_q, len_k, dtype=torch.bool, device=device)
    if is_causal:
        allowed = allowed.tril_()
    if attn_mask is not None:
        free = attn_mask if attn_mask.dtype == torch.bool else float_mask_allows(attn_mask)
        free = free.reshape((1,) * (4 - free.dim()) + tuple(free.shape)).any(dim=1)  # (B or 1, Lq or 1, Lk or 1)
        allowed = allowed & free
    return allowed
