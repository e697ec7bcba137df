"""Attention weights collected for use outside Lightning: :func:`capture_attention`, a context manager around an
:class:`~attn_callbacks.capture.hooks.AttentionCapture` whose consumer keeps every call's weights."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from attn_callbacks.capture.find import find_attention_modules, output_indices
from attn_callbacks.capture.hooks import AttentionCapture

__all__ = ["capture_attention"]


@contextmanager
def capture_attention(model: nn.Module, modules: Sequence[str] | None = None) -> Iterator[dict[str, list[Tensor]]]:
    """Collect the per-head attention weights of every forward call, for use outside Lightning.

    Args:
        model: any ``nn.Module`` containing ``nn.MultiheadAttention`` modules (stock transformer layers included),
            Hugging Face attention modules (eager or sdpa attention), modules calling
            ``scaled_dot_product_attention`` or modules computing attention by hand (a softmax and a matrix product).
        modules: optional fnmatch patterns over module names, as in :func:`find_attention_modules`.

    Yields:
        A dict: module name -> list of weight tensors ``(B, H, Lq, Lk)``, one per call, detached (SDPA calls: the
        weights recomputed; a softmax computed by hand: its output, checked against no token lengths here, so a
        softmax over scores of another layout comes back as it is; a module's k-th call of the block under
        ``f"{name}.call{k}"``).

    Example:
        >>> layer = nn.TransformerEncoderLayer(8, 2, batch_first=True)
        >>> model = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()
        >>> with torch.no_grad(), capture_attention(model) as weights:
        ...     _ = model(torch.randn(3, 5, 8))
        >>> weights["layers.0.self_attn"][0].shape
        torch.Size([3, 2, 5, 5])
    """
    collected: dict[str, list[Tensor]] = defaultdict(list)

    def keep(name: str, module: nn.Module, weights: Tensor, rows: slice, batch: int, allowed: Tensor | None) -> None:
        if rows.start == 0:
            collected[name].append(weights.detach())
        else:  # the next samples of the same SDPA call
            collected[name][-1] = torch.cat([collected[name][-1], weights.detach()])

    capture = AttentionCapture(find_attention_modules(model, modules), keep, output_index=output_indices(model))
    with capture, capture.watching():
        yield collected
