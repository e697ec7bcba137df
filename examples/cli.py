"""The toy translation of ``toy_translation.py`` as a ``LightningCLI`` app: ``AttentionMonitor`` set up from YAML.

    python examples/cli.py fit --config examples/attention_monitor.yaml     # then: tensorboard --logdir runs

Any option can be overridden on the command line, e.g. ``--trainer.max_epochs 1``; ``--print_config`` shows the
full configuration and ``--trainer.callbacks.help attn_callbacks.AttentionMonitor`` the callback's arguments.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))  # toy_translation.py, also when imported from elsewhere
from toy_translation import TRAIN_SIZE, VAL_SIZE, ToyTranslator, collate, make_pairs


class ToyTranslationData(LightningDataModule):
    """Random French -> English sentence pairs as in ``toy_translation.py``; the validation loader does not shuffle
    (``probe: first`` reads its first batch every epoch)."""

    def __init__(
        self, train_size: int = TRAIN_SIZE, val_size: int = VAL_SIZE, batch_size: int = 64, seed: int = 0
    ) -> None:
        super().__init__()
        self.train_size, self.val_size, self.batch_size, self.seed = train_size, val_size, batch_size, seed

    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(self.seed)
        self.train_pairs = make_pairs(self.train_size, generator)
        self.val_pairs = make_pairs(self.val_size, generator)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_pairs, batch_size=self.batch_size, shuffle=True, collate_fn=collate)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_pairs, batch_size=2 * self.batch_size, collate_fn=collate)


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    """Build the CLI (and with ``run``, run its subcommand); ``args`` as on the command line, ``sys.argv`` if None."""
    warnings.filterwarnings("ignore", ".*does not have many workers.*")  # toy data: worker processes cost more
    warnings.filterwarnings("ignore", r".*isinstance\(treespec, LeafSpec\).*")  # lightning vs newer torch
    return LightningCLI(ToyTranslator, ToyTranslationData, args=args, run=run)


if __name__ == "__main__":
    main()
