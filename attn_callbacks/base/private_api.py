"""Every private attribute of torch or Lightning the package reads, in one place (the pinned torchmetrics adapter,
:mod:`attn_callbacks.sums.summed_metric`, aside), each for a job no public API does. ``tests/test_private_api.py``
checks each one against the installed versions, so a release that changes them fails there, loudly."""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["epoch_end_step", "remove_function_mode"]


def remove_function_mode(mode: TorchFunctionMode) -> None:
    """Take ``mode`` off torch's function-mode stack wherever it is; the modes above it (entered after it by another
    callback's hook, and still active) stay, in their order. ``mode.__exit__`` would pop whatever is on top."""
    if not any(entry is mode for entry in torch.overrides._get_current_function_mode_stack()):
        return
    above = []
    while (top := torch._C._pop_torch_function_stack()) is not mode:
        above.append(top)
    for entry in reversed(above):
        torch._C._push_on_torch_function_stack(entry)


def epoch_end_step(trainer: Any) -> int:
    """The step Lightning logs epoch-end metrics at (its logger connector reads this counter): ``global_step`` differs
    from it with several optimizer steps per batch, and by one at the end of a training epoch."""
    return getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)
