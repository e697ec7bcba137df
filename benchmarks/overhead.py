"""How much the callback adds to a validation epoch of the reference workload, measured side by side in one run.

    python benchmarks/overhead.py [--batches 16] [--rounds 3]

Configurations, interleaved round by round so that machine noise hits them alike:

- model only: ``trainer.validate`` without callbacks;
- floor: every attention module forced to return weights, each weight read once (``weights.sum()``): the least any
  vocabulary × vocabulary accumulation could cost;
- AttentionMonitor (reference): the callback as users run it (tracked to 2,048 ids + <other>, per head, every image,
  table and scalar of the epoch logged), in its steady state: after three warm-up epochs (the first chooses the tracked
  ids and draws every figure in full; the first three fill the drift memory: reference, previous and the spare
  buffer that the next epoch's P is written into), as in every later epoch of a training run;
- AttentionMonitor per_head=False: the same keeping only the head-averaged sums (the cheapest knob);
- naive: the approach of the question in seeds/000 done naively, a Python loop over query positions adding each
  weight row into the vocabulary matrix (timed on 2 batches only: it is slow).

Target: AttentionMonitor / model only <= 1.20 on CPU (<= 1.05 on GPU). "epoch end" is the callback's once-per-epoch
work (sums to metrics, images, tables); "added ms/batch" is the rest, spread over the batches. The epoch end is paid
once per epoch whatever its length, so "x without epoch end" (each round's epoch less its own epoch end, over the
same round's model-only epoch) is where the ratio goes as validation epochs grow, and "1.20x from" the epoch length
at which it would reach the target: ``N`` batches with ``(N (m + a) + e) / (N m) <= 1.20`` for ``m`` the model-only
time per batch, ``a`` the added time per batch and ``e`` the epoch end (derived, not timed: per round, from that
round's own timings, then the median over rounds; "added ms/batch" is likewise the median of the rounds' own).
Two tables: wall clock (the target's measure) and CPU time of every thread of the process, which leaves out
the time a shared virtual machine's host takes away (steal time) and so varies less between runs there.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time

import torch
from lightning.pytorch import Callback

from _workload import BATCH, HEADS, LAYERS, LENGTH, VOCAB, Encoder, quiet, summary, token_ids, validate
from attn_callbacks import AttentionMonitor
from attn_callbacks.capture import AttentionCapture, find_attention_modules

WARM_UP_EPOCHS = 3


class WeightsReader(Callback):
    """Hooks every attention module like the monitor does and hands each batch's weights to ``consume``."""

    def __init__(self, consume):
        self.consume = consume
        self.capture: AttentionCapture | None = None
        self.ids: torch.Tensor | None = None

    def on_validation_epoch_start(self, trainer, pl_module):
        self.capture = AttentionCapture(find_attention_modules(pl_module), self._consume)
        self.capture.attach()

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.ids = batch["input_ids"]

    def _consume(self, name, module, weights):
        self.consume(name, weights, self.ids)

    def on_validation_epoch_end(self, trainer, pl_module):
        self.capture.detach()


def floor(name, weights, ids):
    weights.sum()


def naive_loop(sums: dict[str, torch.Tensor], vocab: int):
    """seeds/000 done naively: for every sample and query position, add the weight row at the key ids."""

    def consume(name, weights, ids):
        ids = ids.to(weights.device)
        matrix = sums.setdefault(name, weights.new_zeros(weights.shape[1], vocab, vocab))
        for n in range(weights.shape[0]):
            for i in range(weights.shape[2]):
                matrix[:, ids[n, i]].index_add_(1, ids[n], weights[n, :, i])

    return consume


def batches_for_target(model: float, added: float, end: float, target: float = 1.20) -> float:
    """The fewest batches per epoch with ``(N (model + added) + end) / (N model) <= target`` (seconds per batch,
    seconds per epoch end); infinity when the per-batch cost alone is over the target."""
    room = (target - 1) * model - added  # seconds per batch left to pay for the epoch end
    return math.inf if room <= 0 else max(1, math.ceil(end / room))


def batches_text(batches: float) -> str:
    return "never" if math.isinf(batches) else f"{int(batches)} batch" + ("es" if batches > 1 else "")


class TimedMonitor(AttentionMonitor):
    """The monitor, with the wall and CPU time of its epoch-end work (compute, metrics, images, tables) recorded."""

    epoch_end: list[tuple[float, float]]

    def on_validation_epoch_end(self, trainer, pl_module):
        start, cpu = time.perf_counter(), time.process_time()
        super().on_validation_epoch_end(trainer, pl_module)
        timing = (time.perf_counter() - start, time.process_time() - cpu)
        self.epoch_end = [*getattr(self, "epoch_end", []), timing]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=16, help="validation batches per epoch")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per configuration")
    args = parser.parse_args()
    quiet()
    torch.manual_seed(0)
    model = Encoder().eval()
    device = "cuda" if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"
    print(
        f"Reference workload: {LAYERS} x nn.TransformerEncoderLayer(d_model=256, nhead={HEADS}), batch {BATCH} x "
        f"length {LENGTH}, vocabulary {VOCAB} tracked to 2048 ids + <other>, {args.batches} batches per "
        f"epoch; torch {torch.__version__}, {device}, {platform.processor() or platform.machine()}"
    )
    header = (
        f"{'ids':8} {'configuration':32} {'epoch s':>8} {'x model only (min/med/max)':>27} {'epoch end s':>11} "
        f"{'added ms/batch':>14} {'x without epoch end':>22} {'1.20x from':>16}"
    )
    tables: dict[str, list[str]] = {"wall clock": [header], "CPU time (steal time left out)": [header]}
    for distribution in ("zipf", "uniform"):
        batches = token_ids(args.batches, distribution)
        monitors = {
            "AttentionMonitor (reference)": TimedMonitor(VOCAB, "input_ids", max_tracked_tokens=2048),
            "AttentionMonitor per_head=False": TimedMonitor(
                VOCAB, "input_ids", max_tracked_tokens=2048, per_head=False
            ),
        }
        for monitor in monitors.values():
            for _ in range(WARM_UP_EPOCHS):  # tracked ids chosen, figures drawn once, drift memory filled
                validate(model, batches, [monitor])
            monitor.epoch_end = []
        configs = {"model only": list, "floor (read weights once)": lambda: [WeightsReader(floor)]}
        configs.update({name: (lambda m=m: [m]) for name, m in monitors.items()})
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
        for _ in range(args.rounds):  # interleaved, so that machine noise hits every configuration alike
            for name, callbacks in configs.items():
                times[name].append(validate(model, batches, callbacks()))
        for clock, lines in enumerate(tables.values()):
            models = [timing[clock] for timing in times["model only"]]
            base = statistics.median(models)
            for name, timings in times.items():
                values = [timing[clock] for timing in timings]
                ratios = [t / b for t, b in zip(values, models, strict=True)]
                ends = [e[clock] for e in monitors[name].epoch_end] if name in monitors else [0.0] * len(values)
                loop = [(t - e) / b for t, e, b in zip(values, ends, models, strict=True)]
                end = statistics.median(ends)
                # Per round, from that round's own timings (rounds differ by more than the callback on a busy VM).
                per_round = [
                    ((t - e - b) / args.batches, b / args.batches, e)
                    for t, e, b in zip(values, ends, models, strict=True)
                ]
                added = statistics.median(a for a, _, _ in per_round) * 1e3
                target = (
                    batches_text(statistics.median(batches_for_target(m, a, e) for a, m, e in per_round))
                    if name in monitors
                    else "-"
                )
                lines.append(
                    f"{distribution:8} {name:32} {statistics.median(values):8.2f} {summary(ratios):>27} {end:11.2f} "
                    f"{added:14.1f} {summary(loop):>22} {target:>16}"
                )
    for title, lines in tables.items():
        print(f"\n{title}:", *lines, sep="\n")
    naive_batches = token_ids(2, "zipf")
    base, _ = validate(model, naive_batches, [])
    naive, _ = validate(model, naive_batches, [WeightsReader(naive_loop({}, VOCAB))])
    print(
        f"naive seeds/000 loop (full {VOCAB}^2 per head, 2 batches): {naive:.1f} s vs {base:.1f} s for the model "
        f"alone, {naive / base:.1f}x; {(naive - base) / 2:.2f} s added per batch"
    )


if __name__ == "__main__":
    main()
