"""Where a steady monitored epoch's time goes, op by op, in place: torch.profiler over one epoch of a warm monitor and
one of the floor, and the difference per op (on a GPU: per kernel, by device time).

    python benchmarks/profile_epoch.py [--preset bert-base] [--model heavy] [--batches 16] [--mean-of-heads]
        [--rows 25]

``benchmarks/scaling.py --profile`` profiles one accumulation step alone; this profiles it where it runs, beside the
model: on a GPU the model keeps the device busy, and what a monitored batch pays is the device time of the monitor's
kernels in between the model's. The ranges ``attn_callbacks.add`` (every accumulation call, from the hook) and
``attn_callbacks.epoch_end`` are marked here, by wrapping the callback's methods in this script only.

Printed: the wall seconds of the floor epoch and of the monitored one, the host milliseconds inside each marked range
(on a GPU also the device milliseconds launched from it), the total time of all ops of either epoch, then the
``--rows`` ops the monitored epoch spends the most time on over the floor's, with their calls. ``--preset`` takes the
shapes of ``overhead.py``'s presets (``tiny`` for a smoke run: ``--preset tiny --batches 1 --rows 5``).
"""

from __future__ import annotations

import argparse
import platform
from collections.abc import Callable
from typing import Any

from _presets import PRESETS, positive_int


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="stress", choices=sorted(PRESETS), help="the model's shapes")
    parser.add_argument("--model", default="heavy", choices=("stress", "heavy", "sdpa"))
    parser.add_argument("--batches", type=positive_int, default=16, help="validation batches per epoch")
    parser.add_argument("--mean-of-heads", action="store_true", help="per_head=False")
    parser.add_argument("--rows", type=positive_int, default=25, help="ops listed")
    return parser.parse_args()


if __name__ == "__main__":
    ARGS = arguments()  # before the imports below, so that --help needs nothing but Python

import torch
from overhead import WeightsReader
from torch.profiler import ProfilerActivity, profile, record_function

from _workload import Encoder, SdpaEncoder, device_label, nudge, quiet, token_ids, validate
from attn_callbacks import AttentionMonitor
from attn_callbacks.sums.epoch_sums import EpochSums

RANGES = ("attn_callbacks.add", "attn_callbacks.epoch_end")


def marked(method: Callable, label: str) -> Callable:
    """``method`` inside a profiler range named ``label``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return method(*args, **kwargs)

    return wrapper


def times(prof: profile, on_device: bool) -> dict[str, tuple[float, int]]:
    """Per op (or kernel) name: its own time in ms (device time on a GPU, else CPU time) and its calls."""
    result = {}
    for event in prof.key_averages():
        if on_device:
            own = getattr(event, "self_device_time_total", None)
            own = event.self_cuda_time_total if own is None else own
        else:
            own = event.self_cpu_time_total
        result[event.key] = (own / 1e3, event.count)
    return result


def range_times(prof: profile, on_device: bool) -> dict[str, tuple[float, float]]:
    """Per marked range: host ms (CPU time inside it) and, on a GPU, the device ms of what it launched."""
    result = {}
    for event in prof.key_averages():
        if event.key in RANGES:
            device = getattr(event, "device_time_total", None)
            device = event.cuda_time_total if device is None else device
            result[event.key] = (event.cpu_time_total / 1e3, device / 1e3 if on_device else 0.0)
    return result


def main(args: argparse.Namespace) -> None:
    quiet()
    vocab, d_model, heads, layers, feedforward, batch, length, tracked = PRESETS[args.preset]
    on_device = torch.cuda.is_available()
    print(
        f"{args.model}, preset {args.preset}, {args.batches} batches, per_head={not args.mean_of_heads}; torch "
        f"{torch.__version__}, {device_label()}, {platform.processor() or platform.machine()}"
    )
    torch.manual_seed(0)
    shapes = {"vocab": vocab, "d_model": d_model, "heads": heads, "layers": layers, "feedforward": feedforward}
    model = SdpaEncoder(**shapes) if args.model == "sdpa" else Encoder(**shapes, head=args.model == "heavy")
    model.eval()
    batches = token_ids(args.batches, "zipf", vocab, batch=batch, length=length)
    EpochSums.add = marked(EpochSums.add, RANGES[0])
    AttentionMonitor.on_validation_epoch_end = marked(AttentionMonitor.on_validation_epoch_end, RANGES[1])
    monitor = AttentionMonitor(vocab, "input_ids", max_tracked_tokens=tracked, per_head=not args.mean_of_heads)
    for seed in range(3):  # tracked ids chosen, figures drawn, drift memory full
        nudge(model, seed)  # as a training step would: drift compares rows that moved
        validate(model, batches, [monitor])
    nudge(model, 3)
    validate(model, batches, [WeightsReader()])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    profiles = {}
    for name, callbacks in (("floor", [WeightsReader()]), ("monitor", [monitor])):
        with profile(activities=activities) as prof:
            seconds = validate(model, batches, callbacks)[0]
            if on_device:
                torch.cuda.synchronize()
        profiles[name] = prof
        print(f"{name}: {seconds:.2f} s wall")
    unit = "device" if on_device else "CPU"
    for label, (host, device) in range_times(profiles["monitor"], on_device).items():
        extra = f", {device:.1f} ms of device time launched from it" if on_device else ""
        print(f"{label}: {host:.1f} ms of host time{extra}")
    floor, monitored = (times(profiles[name], on_device) for name in ("floor", "monitor"))
    total = {
        name: sum(ms for key, (ms, _) in t.items() if key not in RANGES)
        for name, t in (("floor", floor), ("monitor", monitored))
    }
    print(f"{unit} time of all ops: floor {total['floor']:.1f} ms, monitor {total['monitor']:.1f} ms")
    print(f"\n{'ms more with the monitor':>24} {'calls':>7}  op ({unit} time, self)")
    more = {key: ms - floor.get(key, (0.0, 0))[0] for key, (ms, _) in monitored.items() if key not in RANGES}
    for key in sorted(more, key=more.__getitem__, reverse=True)[: args.rows]:
        print(f"{more[key]:24.1f} {monitored[key][1]:7d}  {key[:100]}")


if __name__ == "__main__":
    main(ARGS)
