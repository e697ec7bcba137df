"""The one adapter to torchmetrics' private API: a ``Metric`` whose states are all large sums.

torchmetrics gives no public way to (a) keep no second copy of a large default state, (b) sum states across
processes in place instead of gathering every rank's copy, or (c) keep the shapes of a compute result that has
one-element tensors (it squeezes them). :class:`SummedMetric` does all three through the private members listed in
:data:`PRIVATE_API`; ``tests/test_summed_metric.py`` fails loudly when a torchmetrics release changes them, and
``pyproject.toml`` bounds torchmetrics to the releases tested.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.distributed import gather_all_tensors

__all__ = ["PRIVATE_API", "SummedMetric"]

#: The private ``Metric`` members this module relies on: attributes set by ``Metric.__init__`` / ``add_state`` and
#: methods it overrides.
PRIVATE_API = ("_defaults", "_reductions", "_cache", "_is_synced", "_wrap_compute", "_sync_dist")


class SummedMetric(Metric):
    """A ``Metric`` of sum states (``dist_reduce_fx="sum"``) allocated once and zeroed in place.

    Subclasses call :meth:`add_sum` for each state, and may override :meth:`shape_result` to restore the shapes of
    what ``compute`` returns after torchmetrics squeezed it.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._summed_in_place = False
        self._sum_shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._released: set[str] = set()  # states whose memory went elsewhere, empty until allocate()

    def add_sum(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Register a sum state of zeros. torchmetrics keeps (and deep-copies, and moves with ``.to()``) a copy of
        every default to reset from: a second full state. The default kept is empty; :meth:`reset` zeroes in place.
        Created as a normal tensor (never inside inference mode), so it can be updated in place anywhere."""
        with torch.inference_mode(False):
            self.add_state(name, torch.zeros(0, dtype=dtype), "sum")
            setattr(self, name, torch.zeros(shape, dtype=dtype))
        self._sum_shapes[name] = (shape, dtype)

    def shape_result(self, result: Any) -> Any:
        """What ``compute`` returns, given what torchmetrics made of it (one-element tensors squeezed)."""
        return result

    def _wrap_compute(self, compute: Callable) -> Callable:
        wrapped = super()._wrap_compute(compute)

        @functools.wraps(compute)
        def shaped(*args: Any, **kwargs: Any) -> Any:
            return self.shape_result(wrapped(*args, **kwargs))

        return shaped

    @property
    def summed_in_place(self) -> bool:
        """Whether :meth:`sum_in_place` summed the state across processes (until :meth:`reset`)."""
        return self._summed_in_place

    def sum_in_place(self) -> None:
        """Under DDP, sum every state across processes into the state itself, keeping no local copy; then, until
        :meth:`reset`, :attr:`summed_in_place` is true and torchmetrics' ``compute`` refuses. Nothing in a single
        process."""
        available = self.distributed_available_fn
        if callable(available) and available():
            # Set first: a collective that fails part-way leaves some states summed, and nothing may add to them.
            self._summed_in_place = True
            self._is_synced = True  # so that torchmetrics' compute() refuses too; reset() clears both
            self._cache = None  # no local copy to go back to (nor a stale one from a sync that failed)
            self._sync_dist(self.dist_sync_fn or gather_all_tensors, self.process_group)

    def _sync_dist(self, dist_sync_fn: Callable = gather_all_tensors, process_group: Any | None = None) -> None:
        """Sum every state across processes in place, one ``all_reduce`` per state.

        torchmetrics' default gathers each rank's copy and stacks them before summing: ``2 W + 1`` copies of the
        state at once for ``W`` processes. ``sync`` has already kept a copy of the local state, which ``unsync`` puts
        back, so in place the peak is 2 copies whatever ``W``. A caller's own ``dist_sync_fn`` takes torchmetrics'
        general path.
        """
        if dist_sync_fn is not gather_all_tensors:
            super()._sync_dist(dist_sync_fn, process_group)
            return
        group = process_group or self.process_group
        try:
            for name in self._reductions:
                torch.distributed.all_reduce(getattr(self, name), op=torch.distributed.ReduceOp.SUM, group=group)
        except BaseException:
            if self._cache is not None:  # sync() kept the local state: put it back, not a half-summed one
                for name, value in self._cache.items():
                    setattr(self, name, value)
            raise

    def release(self, name: str, buffer: Tensor | None = None) -> None:
        """Let the memory of sum state ``name`` go to something else that keeps it (drift memory keeps the ``P``
        computed where ``S`` lay). The state becomes ``buffer`` (memory of its shape and dtype, zeroed at the next
        :meth:`reset`) or, without one, stays empty until :meth:`allocate`: a fresh allocation then falls in the
        next epoch, not at the end of this one."""
        current = getattr(self, name)
        if buffer is None:
            with torch.inference_mode(False):
                buffer = torch.empty(0, dtype=current.dtype, device=current.device)
            self._released.add(name)
        else:
            self._released.discard(name)
        setattr(self, name, buffer)

    def release_all(self) -> None:
        """Release every sum state's memory now (a metric no longer used: see :meth:`release`)."""
        for name in self._sum_shapes:
            self.release(name)

    def allocate(self) -> None:
        """Zeroed memory for the states released without a buffer; nothing for the others."""
        with torch.inference_mode(False):
            for name in self._released:
                shape, _ = self._sum_shapes[name]
                current = getattr(self, name)
                setattr(self, name, torch.zeros(shape, dtype=current.dtype, device=current.device))
        self._released.clear()

    @property
    def allocated(self) -> bool:
        """Whether every state holds its memory (see :meth:`release`)."""
        return not self._released

    def reset(self) -> None:
        """Zero the sums in place (no new allocation, no fresh pages to fault in: a large vocabulary's state is
        hundreds of MB). States replaced by an inference tensor or a new shape are allocated anew, as normal tensors
        even when called inside inference mode; released ones stay empty until :meth:`allocate`."""
        with torch.inference_mode(False):
            current: dict[str, Tensor] = {name: getattr(self, name) for name in self._sum_shapes}
            super().reset()  # torchmetrics' counters and caches; the states become the empty defaults
            self._summed_in_place = False
            for name, (shape, _) in self._sum_shapes.items():
                tensor = current[name]
                if name in self._released:
                    setattr(self, name, tensor)
                elif tuple(tensor.shape) == shape and not tensor.is_inference():
                    setattr(self, name, tensor.zero_())
                else:
                    setattr(self, name, torch.zeros(shape, dtype=tensor.dtype, device=tensor.device))
