"""Attention sites: every place the monitor reads attention from, and what it knows of each.

A *site* is an attention module found in ``setup`` (``nn.MultiheadAttention``, a Hugging Face attention module) or,
for a module that calls ``scaled_dot_product_attention``, each of its calls in a batch: its first call goes by the
module's name, its k-th by ``f"{module}.call{k}"``. A module's heads are known from the module; a call's only once
it runs, from its weights. Sites seen in one stage (fit) are kept for the next (validate), so that their sums are
allocated when epochs start.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

import torch
from torch import Tensor, nn

from attn_callbacks.capture.find import module_device, num_heads

__all__ = ["AttentionSites"]


class AttentionSites:
    """The attention modules of the model, the SDPA calls seen so far, and the heads and device of each site."""

    def __init__(self) -> None:
        self.modules: dict[str, nn.Module] = {}
        self.heads: dict[str, int] = {}  # site -> number of heads, for the sites whose heads are known
        self.devices: dict[str, torch.device] = {}  # SDPA call -> the device of its weights (a module may hold none)

    def setup(self, modules: Mapping[str, nn.Module], watched: Collection[str]) -> list[str]:
        """Take this stage's modules (``watched``: those whose SDPA calls are read). Returns the SDPA calls an earlier
        stage saw beyond a module's first, kept with their heads."""
        kept = {name: heads for name, heads in self.heads.items() if self.base(name, modules) in watched}
        self.modules = dict(modules)
        self.heads = {name: num_heads(module, name) for name, module in modules.items() if name not in watched}
        self.heads.update(kept)
        self.devices = {}  # this stage's model may live elsewhere: learnt again at the first calls
        return [name for name in kept if name not in self.modules]

    def base(self, name: str, modules: Mapping[str, nn.Module] | None = None) -> str:
        """The module of a site: ``name`` itself, or the module whose k-th SDPA call it is."""
        return name if name in (self.modules if modules is None else modules) else name.rpartition(".call")[0]

    def device(self, name: str, home: torch.device) -> torch.device:
        """Where a site's sums go: the device its weights came on, else its module's, else ``home``."""
        return self.devices.get(name) or module_device(self.modules[self.base(name)], home)

    def shapes(self, size: Callable[[str], int], streams_of: Mapping[str, tuple[str, str]]) -> dict:
        """Every site's ``(H, Vq, Vk)`` whose heads are known, from ``size(stream)``."""
        return {name: (heads, *(size(s) for s in streams_of[name])) for name, heads in self.heads.items()}

    def check(self, name: str, weights: Tensor) -> tuple[Tensor, bool]:
        """``weights`` batch-major ``(B, H, Lq, Lk)`` (an unbatched call's ``(H, Lq, Lk)`` gets a batch of one), and
        whether the site is an SDPA call seen for the first time (its heads and device are noted here).

        Raises:
            RuntimeError: the site returned another number of heads than before.
        """
        if weights.dim() == 3:
            weights = weights.unsqueeze(0)
        if name not in self.heads:
            self.heads[name], self.devices[name] = weights.size(1), weights.device
            return weights, True
        if weights.size(1) != self.heads[name]:
            raise RuntimeError(
                f"AttentionMonitor: attention module {name!r} returned weights with {weights.size(1)} heads, where its "
                f"earlier calls had {self.heads[name]}"
            )
        return weights, False
