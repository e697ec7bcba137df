"""Finding ``nn.MultiheadAttention`` modules and reading their per-head weights through hooks.

Stock ``nn.Transformer*`` layers call attention with ``need_weights=False``. A forward pre-hook rewrites the call to
``need_weights=True, average_attn_weights=False``; a forward hook hands the per-head weights ``(B, H, Lq, Lk)`` to a
consumer and returns to the caller exactly what it asked for. While attached, the process-wide MHA fast path is
switched off (the encoder-layer fast path and ``nn.TransformerEncoder``'s nested-tensor conversion bypass the hooks);
detaching restores it and removes every hook, on every exit path.
"""

from __future__ import annotations

import fnmatch
import inspect
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = ["AttentionCapture", "capture_attention", "find_attention_modules"]

WeightsConsumer = Callable[[str, nn.MultiheadAttention, Tensor], None]

_MHA_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


def find_attention_modules(model: nn.Module, patterns: Sequence[str] | None = None) -> dict[str, nn.MultiheadAttention]:
    """Every ``nn.MultiheadAttention`` in ``model`` by its ``named_modules()`` name, optionally filtered.

    Args:
        model: the model to search.
        patterns: fnmatch patterns over module names (``"encoder.layers.*.self_attn"``); a module is kept when any
            pattern matches. ``None`` keeps all.

    Raises:
        ValueError: no attention module found or kept, or a pattern matches only modules that are not
            ``nn.MultiheadAttention``, or matches nothing at all. The message names the pattern.

    Example:
        >>> layer = nn.TransformerEncoderLayer(8, 2)
        >>> list(find_attention_modules(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)))
        ['layers.0.self_attn', 'layers.1.self_attn']
    """
    named = dict(model.named_modules())
    found = {name: m for name, m in named.items() if isinstance(m, nn.MultiheadAttention)}
    if not found:
        raise ValueError(f"No torch.nn.MultiheadAttention found in the model ({type(model).__name__})")
    if patterns is None:
        return found
    kept: dict[str, nn.MultiheadAttention] = {}
    for pattern in patterns:
        matched = [name for name in named if fnmatch.fnmatchcase(name, pattern)]
        attention = [name for name in matched if name in found]
        if not attention:
            what = (
                f"only modules that are not nn.MultiheadAttention ({', '.join(matched[:5])})"
                if matched
                else "no module"
            )
            raise ValueError(
                f"Pattern {pattern!r} in argument `modules` matched {what}; attention modules: {', '.join(found)}"
            )
        kept.update((name, found[name]) for name in attention)
    return {name: m for name, m in found.items() if name in kept}  # model order, not pattern order


class AttentionCapture:
    """Hooks that force per-head attention weights out of ``nn.MultiheadAttention`` modules.

    Use :meth:`attach` / :meth:`detach` (idempotent) or the object as a context manager. The model's outputs are not
    changed: a caller that did not ask for weights gets ``(out, None)``; one that asked for averaged weights gets the
    head average, as without the hooks.

    Args:
        modules: name -> module, as from :func:`find_attention_modules`.
        consumer: called as ``consumer(name, module, weights)`` with ``weights`` of shape ``(B, H, Lq, Lk)``
            (batch-major whatever ``batch_first`` says; ``(H, Lq, Lk)`` for an unbatched call).
        disable_fastpath: switch ``torch.backends.mha`` fast path off while attached (restored on detach).
    """

    def __init__(
        self,
        modules: Mapping[str, nn.MultiheadAttention],
        consumer: WeightsConsumer,
        disable_fastpath: bool = True,
    ) -> None:
        self.modules = dict(modules)
        self.consumer = consumer
        self.disable_fastpath = disable_fastpath
        self._handles: list[RemovableHandle] = []
        self._fastpath_before: bool | None = None
        # What each in-flight call asked for, pushed by the pre-hook and popped by the hook (calls may nest).
        self._requested: dict[str, list[tuple[bool, bool]]] = defaultdict(list)

    @property
    def attached(self) -> bool:
        """Whether hooks are currently registered."""
        return bool(self._handles)

    def attach(self) -> AttentionCapture:
        """Register the hooks and switch the fast path off. Attaching twice is a no-op."""
        if self._handles:
            return self
        try:
            if self.disable_fastpath:
                self._fastpath_before = torch.backends.mha.get_fastpath_enabled()
                torch.backends.mha.set_fastpath_enabled(False)
            for name, module in self.modules.items():
                self._handles.append(module.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._hook(name, module), with_kwargs=True))
        except BaseException:
            self.detach()
            raise
        return self

    def detach(self) -> None:
        """Remove every hook and restore the fast-path flag. Safe to call any number of times."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._requested.clear()
        if self._fastpath_before is not None:
            torch.backends.mha.set_fastpath_enabled(self._fastpath_before)
            self._fastpath_before = None

    def __enter__(self) -> AttentionCapture:
        return self.attach()

    def __exit__(self, *exc_info: object) -> None:
        self.detach()

    def _pre_hook(self, name: str) -> Callable[..., tuple[tuple, dict]]:
        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            # Bind so that a positional need_weights (mha(q, k, v, None, False)) is seen and replaced too.
            bound = _MHA_SIGNATURE.bind(module, *args, **kwargs)
            bound.apply_defaults()
            arguments = bound.arguments
            self._requested[name].append((bool(arguments["need_weights"]), bool(arguments["average_attn_weights"])))
            arguments["need_weights"] = True
            arguments["average_attn_weights"] = False
            del arguments["self"]
            return (), dict(arguments)

        return pre_hook

    def _hook(self, name: str, module: nn.MultiheadAttention) -> Callable[..., Any]:
        def hook(mod: nn.Module, args: tuple, kwargs: dict, output: tuple[Tensor, Tensor | None]) -> Any:
            need_weights, average = self._requested[name].pop()
            out, weights = output
            if weights is None:  # cannot happen with need_weights=True, but never hand None on
                return (out, None) if not need_weights else output
            self.consumer(name, module, weights)
            if not need_weights:
                return out, None
            return (out, weights.mean(dim=-3)) if average else output

        return hook


@contextmanager
def capture_attention(model: nn.Module, modules: Sequence[str] | None = None) -> Iterator[dict[str, list[Tensor]]]:
    """Collect the per-head attention weights of every forward call, for use outside Lightning.

    Args:
        model: any ``nn.Module`` containing ``nn.MultiheadAttention`` modules (stock transformer layers included).
        modules: optional fnmatch patterns over module names, as in :func:`find_attention_modules`.

    Yields:
        A dict: module name -> list of weight tensors ``(B, H, Lq, Lk)``, one per call, detached.

    Example:
        >>> layer = nn.TransformerEncoderLayer(8, 2, batch_first=True)
        >>> model = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()
        >>> with torch.no_grad(), capture_attention(model) as weights:
        ...     _ = model(torch.randn(3, 5, 8))
        >>> weights["layers.0.self_attn"][0].shape
        torch.Size([3, 2, 5, 5])
    """
    collected: dict[str, list[Tensor]] = defaultdict(list)

    def keep(name: str, module: nn.MultiheadAttention, weights: Tensor) -> None:
        collected[name].append(weights.detach())

    with AttentionCapture(find_attention_modules(model, modules), keep):
        yield collected
