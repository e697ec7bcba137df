"""What the monitor costs a validation epoch, as four figures from one interleaved run.

    python benchmarks/overhead.py [--batches 16] [--rounds 3] [--models stress,heavy] [--preset bert-base]
        [--configs per-head,mean]

Workloads (benchmarks/_workload.py): 4 × nn.TransformerEncoderLayer(256, 8 heads, feed-forward 1024), batch 32 ×
length 128, Zipf(1) ids over 8,000 tracked to 2,048 + <other>; "stress" is the encoder alone, "heavy" adds a
language-model head and its loss, "sdpa" is the stress shapes in blocks calling ``F.scaled_dot_product_attention``,
"hand" the same blocks with their attention written out (``softmax(q kᵀ / √d) v``, read from its softmax).
``--preset bert-base`` gives the models BERT-base shapes instead (12 layers of d_model 768, 12 heads, feed-forward
3072, a 30,522-id vocabulary tracked to 1,024: what fits the default memory budget), for a GPU; ``--preset tiny``
gives them toy shapes (1 layer of d_model 32, 2 heads, batch 4 × length 16, 64 ids tracked to 32), for a smoke run
whose figures mean little: ``--preset tiny --batches 2 --rounds 1 --models stress --configs per-head``.
Configurations, interleaved round by round so that machine noise hits them alike (after each fresh monitor, an
untimed floor epoch: the allocator, once that monitor's memory is freed, hands the next epoch fresh pages to fault in):

- none: ``trainer.validate`` without callbacks;
- floor: every attention module forced to return weights (SDPA calls: seen and their weights recomputed), each weight
  read once (``weights.sum()``): what any capture pays, since a stock layer loses PyTorch's fused fast path and an
  SDPA call's weights must be computed again;
- monitor (per head, the default), monitor ``per_head=False``, monitor ``explorer=False`` (``--configs
  per-head,no-explorer`` gives what the Attention tab's data costs the epoch end), monitor ``compile_step=True``
  (``compiled``: the compiled step against the eager one, on a GPU), monitor ``draw_in_background=True``
  (``background``) and ``False`` (``in-process``). The drawing process starts at every ``validate``'s set-up,
  overlapping the batches; "drawn after s" is teardown's wait for the pictures left after the epoch end, which the
  other figures leave out, since in a fit it overlaps the next training epoch. On a GPU the default draws in the
  background, so "monitor" does too there. Steady: a monitor past its first three epochs (tracked ids chosen, figures
  drawn, drift memory full), epoch end included, the model's weights nudged before each of its epochs as a training
  step would change them (so that drift compares rows that moved); cold, a fresh monitor's first epoch, set-up, the
  tracked-id pass and the sums' allocation included (loading the compiled kernels and making the glyph outlines of the
  labels are once per process: the steady monitors' warm-up pays them first).

Printed per workload and configuration (min / median / max over the rounds, each ratio from the same round):
floor / none, steady / floor, cold / none, and the steady epoch end in seconds (the monitor's once-per-epoch work:
summary, images, tables, with the image writer thread waited for); then steady / none, what a user pays in all, and
batches / none, the steady epoch without its epoch end (on a GPU the epoch end is the CPU's: it does not grow with
the number of batches), and monitor s, the seconds a steady epoch takes over the floor's: the monitor's own work,
which unlike the ratios does not move with the speed of the model's matrix products.
Targets (issue "Performance"): steady <= 1.30 × floor, cold <= 1.75 × none, epoch end <= 0.5 s.
Also peak resident memory of the process.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import platform
import resource
import statistics
import time

from _presets import PRESETS, positive_int

# --configs name -> (the configuration's name in the output, the monitor's arguments)
CONFIGS = {
    "per-head": ("monitor", {}),
    "mean": ("monitor per_head=False", {"per_head": False}),
    "no-explorer": ("monitor explorer=False", {"explorer": False}),
    "compiled": ("monitor compile_step=True", {"compile_step": True}),
    "background": ("monitor draw_in_background", {"draw_in_background": True}),
    "in-process": ("monitor drawn in process", {"draw_in_background": False}),
}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=positive_int, default=16, help="validation batches per epoch")
    parser.add_argument("--rounds", type=positive_int, default=3, help="timed rounds (interleaved)")
    parser.add_argument(
        "--models", default="stress,heavy,sdpa", help="comma-separated: stress, heavy, sdpa, hand (written out)"
    )
    parser.add_argument("--preset", default="stress", choices=sorted(PRESETS), help="the models' shapes")
    parser.add_argument(
        "--configs",
        default="per-head,mean",
        help="comma-separated: per-head (the default), mean (per_head=False), no-explorer (explorer=False: "
        "with per-head, what writing the Attention tab's data costs), compiled (compile_step=True), background "
        "(draw_in_background=True), in-process (draw_in_background=False)",
    )
    args = parser.parse_args()
    chosen = tuple(args.configs.split(","))
    unknown = [key for key in chosen if key not in CONFIGS]
    if unknown:
        parser.error(f"--configs: expected a comma-separated choice of {', '.join(CONFIGS)}, got {args.configs!r}")
    args.configs = chosen
    return args


if __name__ == "__main__":
    ARGS = arguments()  # before the imports below, so that --help needs nothing but Python

import torch
from lightning.pytorch import Callback

from _workload import Encoder, SdpaEncoder, device_label, nudge, quiet, token_ids, validate
from attn_callbacks import AttentionMonitor
from attn_callbacks.capture.find import find_attention_modules
from attn_callbacks.capture.hooks import AttentionCapture
from attn_callbacks.sums.step_compiled import compile_failed

WARM_UP_EPOCHS = 3


class WeightsReader(Callback):
    """Hooks every attention module like the monitor does and reads each weight once: the floor."""

    def __init__(self) -> None:
        self.capture: AttentionCapture | None = None

    def on_validation_epoch_start(self, trainer, pl_module):
        modules = find_attention_modules(pl_module)
        self.capture = AttentionCapture(modules, lambda name, module, weights, *where: weights.sum())
        self.capture.attach()

    def on_validation_batch_start(self, *args, **kwargs):
        self.capture.start_watching()  # SDPA calls, as the monitor watches them: batch by batch

    def on_validation_batch_end(self, *args, **kwargs):
        self.capture.stop_watching()

    def on_validation_epoch_end(self, trainer, pl_module):
        self.capture.detach()


class TimedMonitor(AttentionMonitor):
    """The monitor, with the wall time of its epoch end recorded, and of the wait for its drawing process after it."""

    def on_validation_epoch_end(self, trainer, pl_module):
        start = time.perf_counter()
        super().on_validation_epoch_end(trainer, pl_module)
        self.epoch_end = time.perf_counter() - start

    drawn_after: float | None = None  # None: drawn in process (the default on the CPU)

    def teardown(self, trainer, pl_module, stage):
        background = self._report.drawing.process is not None
        start = time.perf_counter()
        super().teardown(trainer, pl_module, stage)
        self.drawn_after = time.perf_counter() - start if background else None


def summary(values: list[float], digits: int = 2) -> str:
    return f"{min(values):.{digits}f} / {statistics.median(values):.{digits}f} / {max(values):.{digits}f}"


def timed(model: Encoder | SdpaEncoder, batches: list[dict], callbacks: list) -> float:
    """One validation epoch's seconds, after collecting the garbage of the runs before (a cold monitor's sums, held
    by reference cycles, would otherwise stay in memory while the next configuration runs)."""
    gc.collect()
    return validate(model, batches, callbacks)[0]


def run(
    model: Encoder | SdpaEncoder,
    batches: list[dict],
    rounds: int,
    vocab: int,
    tracked: int,
    chosen: tuple[str, ...] = tuple(CONFIGS),
) -> dict[str, dict[str, list[float]]]:
    """Per configuration (``chosen`` of :data:`CONFIGS`), the figures of every round."""
    configs = dict(CONFIGS[key] for key in chosen)
    steady = {name: TimedMonitor(vocab, "input_ids", max_tracked_tokens=tracked, **kw) for name, kw in configs.items()}
    seeds = itertools.count()  # of the nudges

    def steady_epoch(name: str) -> float:
        nudge(model, next(seeds))  # every epoch's attention differs from the last one's, as in a fit
        return timed(model, batches, [steady[name]])

    for name in steady:
        for _ in range(WARM_UP_EPOCHS):
            steady_epoch(name)
    figures: dict[str, dict[str, list[float]]] = {name: {} for name in ("floor", *configs)}
    for _ in range(rounds):
        none = timed(model, batches, [])
        floor = timed(model, batches, [WeightsReader()])
        figures["floor"].setdefault("floor / none", []).append(floor / none)
        for name, kw in configs.items():
            # With draw_in_background, teardown waits for the pictures still being drawn ("drawn after s"): in a fit
            # that overlaps the next training epoch, so the training loop's figures leave it out.
            warm = steady_epoch(name) - (steady[name].drawn_after or 0.0)
            fresh = TimedMonitor(vocab, "input_ids", max_tracked_tokens=tracked, **kw)
            cold = timed(model, batches, [fresh]) - (fresh.drawn_after or 0.0)
            # Untimed: the cold monitor's memory, freed, leaves the allocator handing out fresh pages for a while
            # (hundreds of thousands of page faults in the next epoch's batches); no configuration should pay that.
            timed(model, batches, [WeightsReader()])
            rows = figures[name]
            rows.setdefault("steady / floor", []).append(warm / floor)
            rows.setdefault("cold / none", []).append(cold / none)
            rows.setdefault("epoch end s", []).append(steady[name].epoch_end)
            if steady[name].drawn_after is not None:
                rows.setdefault("drawn after s", []).append(steady[name].drawn_after)
            rows.setdefault("steady / none", []).append(warm / none)
            rows.setdefault("batches / none", []).append((warm - steady[name].epoch_end) / none)
            rows.setdefault("monitor s", []).append(warm - floor)
            rows.setdefault("none s", []).append(none)
    return figures


def main(args: argparse.Namespace) -> None:
    chosen = args.configs
    quiet()
    vocab, d_model, heads, layers, feedforward, batch, length, tracked = PRESETS[args.preset]
    print(
        f"{layers} x nn.TransformerEncoderLayer({d_model}, {heads} heads, ff {feedforward}), batch {batch} x length "
        f"{length}, Zipf ids over {vocab} tracked to {tracked} + <other>, {args.batches} batches per epoch, "
        f"{args.rounds} rounds; torch {torch.__version__}, {device_label()}, "
        f"{platform.processor() or platform.machine()}"
    )
    batches = token_ids(args.batches, "zipf", vocab, batch=batch, length=length)
    print(f"\n{'model':8} {'configuration':26} {'figure':16} {'min / median / max':>24}")
    for model_name in args.models.split(","):
        torch.manual_seed(0)
        shapes = {"vocab": vocab, "d_model": d_model, "heads": heads, "layers": layers, "feedforward": feedforward}
        if model_name in ("sdpa", "hand"):
            model = SdpaEncoder(**shapes, by_hand=model_name == "hand")
        else:
            model = Encoder(**shapes, head=model_name == "heavy")
        for config, rows in run(model.eval(), batches, args.rounds, vocab, tracked, chosen).items():
            for figure, values in rows.items():
                digits = 3 if figure.endswith(" s") else 2  # a tiny preset's epoch takes a few ms
                print(f"{model_name:8} {config:26} {figure:16} {summary(values, digits):>24}")
    if "compiled" in chosen and compile_failed():  # its warning is silenced with the others: the row ran eagerly
        print(f"\ncompile_step fell back to the eager step, so its rows are eager figures: {compile_failed()}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\npeak resident memory of the process: {peak:.0f} MiB")


if __name__ == "__main__":
    main(ARGS)
