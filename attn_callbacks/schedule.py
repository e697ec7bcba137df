"""Which evaluation epochs, and which of their batches, the monitor watches."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

__all__ = ["Schedule"]


class Schedule:
    """The epoch cadence (``log_every_n_epochs``, ``log_sanity_check``) and the batch limit (``limit_batches``).

    Args are :class:`~attn_callbacks.AttentionMonitor`'s of the same names, validated there.
    """

    def __init__(self, log_every_n_epochs: int = 1, log_sanity_check: bool = False, limit_batches: int | None = None):
        self.log_every_n_epochs = log_every_n_epochs
        self.log_sanity_check = log_sanity_check
        self.limit_batches = limit_batches
        # Validation epochs of trainer.fit seen, monitored or not: log_every_n_epochs counts them. None for a run
        # resumed from a checkpoint saved before the count, which keeps the epoch rule it was saved under.
        self.validation_epochs: int | None = 0
        self._warned = False

    def epoch(self, trainer: Trainer) -> bool:
        """Whether this validation epoch is monitored (counting it when ``trainer.fit`` runs it)."""
        if trainer.sanity_checking:
            return self.log_sanity_check
        if trainer.state.fn != TrainerFn.FITTING:
            return True  # trainer.validate(): asked for explicitly, and not counted
        if self.validation_epochs is None:
            return trainer.current_epoch % self.log_every_n_epochs == 0
        # Validation epochs, not training ones: with check_val_every_n_epoch = 2, say, validation runs after training
        # epochs 1, 3, 5 ... only, and current_epoch % n could never be 0.
        seen, self.validation_epochs = self.validation_epochs, self.validation_epochs + 1
        return seen % self.log_every_n_epochs == 0

    @staticmethod
    def loaders(trainer: Trainer) -> tuple[list[Any], list[int | float], int]:
        """The evaluation dataloaders of the running stage as a list (a dict's values, in order), their batch limits,
        and how many there are; known before the epoch starts, and the same on every rank (so DDP ranks hold the same
        metrics)."""
        if trainer.testing:
            loaders, limits = trainer.test_dataloaders, trainer.num_test_batches
        else:
            loaders, limits = trainer.val_dataloaders, trainer.num_val_batches
        batches = trainer.num_sanity_val_batches if trainer.sanity_checking else limits
        if loaders is None:
            loaders = []
        elif isinstance(loaders, Mapping):
            loaders = list(loaders.values())
        elif not isinstance(loaders, (list, tuple)):
            loaders = [loaders]
        return list(loaders), limits, max(len(batches), 1)

    def batch(self, batch_idx: int) -> bool:
        """Whether batch ``batch_idx`` of a dataloader of a monitored epoch is monitored."""
        return self.limit_batches is None or batch_idx < self.limit_batches

    def check_loaders(self, loaders: list[Any]) -> None:
        """With a batch limit, warn (once) when one of the ``loaders`` shuffles: each epoch would watch other samples,
        and drift would compare different batches."""
        if self.limit_batches is None or self._warned:
            return
        for loader in loaders:
            sampler = getattr(loader, "sampler", None) if isinstance(loader, DataLoader) else None
            if isinstance(sampler, RandomSampler) or (isinstance(sampler, DistributedSampler) and sampler.shuffle):
                self._warned = True
                rank_zero_warn(
                    f"AttentionMonitor: argument `limit_batches`={self.limit_batches} watches the first batches of a "
                    "validation loader that shuffles, so every epoch watches other samples and drift compares "
                    "different batches; use a validation loader with shuffle=False."
                )
                return
