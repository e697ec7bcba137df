"""What drawing the pictures in a process of their own (``draw_in_background=True``) changes in a fit.

    python benchmarks/background.py [--epochs 4] [--train-batches 8] [--batches 16] [--rounds 3] [--preset stress]

The stress encoder of ``overhead.py`` (its LM head trained with SGD), ``--epochs`` epochs of ``--train-batches``
training batches, each followed by a monitored validation epoch of ``--batches``; the two configurations alternate
round by round. Printed (min / median / max over the rounds): the fit's seconds, the epoch end's blocking seconds
(median over the fit's epochs), and the seconds of the training steps run while a previous epoch's pictures may
still be drawn (the first ``--train-batches`` of every epoch after the first): where the process competes with
training for the cores.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from _presets import PRESETS, positive_int


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=positive_int, default=4)
    parser.add_argument("--train-batches", type=positive_int, default=8)
    parser.add_argument("--batches", type=positive_int, default=16, help="validation batches per epoch")
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--preset", default="stress", choices=sorted(PRESETS))
    return parser.parse_args()


if __name__ == "__main__":
    ARGS = arguments()  # before the imports below, so that --help needs nothing but Python

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from overhead import summary
from torch import nn

from _workload import Encoder, device_label, quiet, token_ids
from attn_callbacks import AttentionMonitor


class Trained(Encoder):
    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        return nn.functional.cross_entropy(self.head(self.encoder(self.embed(ids))).flatten(0, 1), ids.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class Clock(Callback):
    """Epoch ends' seconds (the monitor's, it runs first) and training steps' seconds after the first epoch."""

    def __init__(self) -> None:
        self.epoch_ends: list[float] = []
        self.steps = 0.0

    def on_validation_epoch_end(self, trainer, pl_module):
        self.epoch_ends.append(time.perf_counter() - self.start)

    def on_validation_epoch_start(self, trainer, pl_module):
        self.start = float("inf")

    def on_validation_batch_end(self, *args, **kwargs):
        self.start = time.perf_counter()

    def on_train_batch_start(self, trainer, *args):
        self.step_start = time.perf_counter()

    def on_train_batch_end(self, trainer, *args):
        if trainer.current_epoch > 0:
            self.steps += time.perf_counter() - self.step_start


def fit(background: bool, args, shapes, tracked, train, val) -> tuple[float, float, float]:
    torch.manual_seed(0)
    model = Trained(**shapes, head=True)
    clock = Clock()
    monitor = AttentionMonitor(shapes["vocab"], "input_ids", max_tracked_tokens=tracked, draw_in_background=background)
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(
            max_epochs=args.epochs,
            logger=TensorBoardLogger(root),
            callbacks=[monitor, clock],
            num_sanity_val_steps=0,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        start = time.perf_counter()
        trainer.fit(
            model,
            torch.utils.data.DataLoader(train, batch_size=None),
            torch.utils.data.DataLoader(val, batch_size=None),
        )
        return time.perf_counter() - start, statistics.median(clock.epoch_ends), clock.steps


def main(args: argparse.Namespace) -> None:
    quiet()
    vocab, d_model, heads, layers, feedforward, batch, length, tracked = PRESETS[args.preset]
    shapes = {"vocab": vocab, "d_model": d_model, "heads": heads, "layers": layers, "feedforward": feedforward}
    train = token_ids(args.train_batches, "zipf", vocab, seed=1, batch=batch, length=length)
    val = token_ids(args.batches, "zipf", vocab, batch=batch, length=length)
    print(
        f"preset {args.preset}, {args.epochs} epochs of {args.train_batches} + {args.batches} batches; {device_label()}"
    )
    figures: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
    for _ in range(args.rounds):
        for background in (False, True):
            figures[background].append(fit(background, args, shapes, tracked, train, val))
            print(
                f"  draw_in_background={background}: " + " / ".join(f"{v:.2f}" for v in figures[background][-1]),
                flush=True,
            )
    for background, rows in figures.items():
        for k, figure in enumerate(("fit s", "epoch end s", "steps after s")):
            print(f"draw_in_background={background!s:5} {figure:14} {summary([row[k] for row in rows]):>24}")


if __name__ == "__main__":
    main(ARGS)
