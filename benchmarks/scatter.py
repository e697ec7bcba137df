"""How much the GPU's scatter-add of a step loses to atomic adds aimed at one cell: ``index_add_`` of BERT-base's
13 channels (12 heads and the uniform baseline) × 32 × 128 × 128 pairs into ``(13, V²)`` sums, V = 1,025 (1,024
tracked ids and ``<other>``), with the pair indices of Zipf(1) ids over 30,522 (~10 % of the pairs in the one cell
``(<other>, <other>)``), of those with that cell's pairs spread over others, of uniform ids, and with 20 % of the
pairs ignored (padding) sent to one cell or spread by position as :func:`attn_callbacks.sums.step.pair_index` does;
last, what the torch step does with the Zipf ids: that cell's pairs summed apart (a masked sum per channel, then the
pairs zeroed and sent to their position's cell), everything included.

    python benchmarks/scatter.py [--repeats 50]

Printed: the share of the pairs in that cell, then per way of indexing the milliseconds of one call and their ratio to
the uniform ids' (``/ uniform``). Medians of ``--repeats`` (50) CUDA-event timed calls after 5 untimed ones; on a CPU
it runs the same ops (no atomics there: the numbers mean little).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from _presets import positive_int


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repeats", type=positive_int, default=50, help="timed calls per figure, after 5 untimed (default 50)"
    )
    return parser.parse_args()


if __name__ == "__main__":
    ARGS = arguments()  # before the imports below, so that --help needs nothing but Python

import torch

BATCH, LENGTH, CHANNELS, VOCAB, FULL_VOCAB = 32, 128, 13, 1025, 30522


def zipf_ids(device: torch.device, generator: torch.Generator) -> torch.Tensor:
    """``(B, L)`` ids by frequency rank, those past the tracked ones folded into ``<other>`` (the last id)."""
    ranks = torch.arange(1, FULL_VOCAB + 1, dtype=torch.float64)
    raw = torch.multinomial(1 / ranks, BATCH * LENGTH, replacement=True, generator=generator).view(BATCH, LENGTH)
    return raw.clamp(max=VOCAB - 1).to(device)


def milliseconds(fn: Callable[[], object], device: torch.device, repeats: int = 50) -> float:
    for _ in range(5):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(args: argparse.Namespace) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator().manual_seed(0)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"scatter-add of {CHANNELS} x {BATCH * LENGTH * LENGTH:,} values into ({CHANNELS}, {VOCAB}²); {name}")
    pairs = BATCH * LENGTH * LENGTH
    cells = VOCAB * VOCAB
    query, key = zipf_ids(device, generator), zipf_ids(device, generator)
    zipf = (query[:, :, None] * VOCAB + key[:, None, :]).reshape(-1)
    hot = cells - 1  # (<other>, <other>)
    spread = torch.where(zipf == hot, torch.randint(0, cells - 1, (pairs,), generator=generator).to(device), zipf)
    uniform = torch.randint(0, cells, (pairs,), generator=generator).to(device)
    ignored = (torch.rand(pairs, generator=generator) < 0.2).to(device)
    position = torch.arange(pairs, device=device) % (LENGTH * LENGTH) % cells
    indices = {
        "Zipf ids": zipf,
        "Zipf, (<other>, <other>) spread": spread,
        "uniform ids": uniform,
        "Zipf, 20 % ignored at one cell": torch.where(ignored, 0, zipf),
        "Zipf, 20 % ignored by position": torch.where(ignored, position, zipf),
    }
    share = float((zipf == hot).double().mean())
    print(f"pairs in the (<other>, <other>) cell: {share:.1%}\n")
    sums = torch.zeros(CHANNELS, cells, device=device)
    values = torch.rand(CHANNELS, pairs, generator=generator).to(device)
    base = milliseconds(lambda: sums.index_add_(1, uniform, values), device, args.repeats)
    print(f"{'pair indices':34} {'ms':>7} {'/ uniform':>10}")
    for label, index in indices.items():
        ms = milliseconds(lambda index=index: sums.index_add_(1, index, values), device, args.repeats)
        print(f"{label:34} {ms:7.3f} {ms / base:10.2f}")
    hot_pairs = zipf == hot
    apart_index = torch.where(hot_pairs, position, zipf)

    def apart() -> None:
        # the step's order: the sums of the cell, its pairs zeroed in place (idempotent: the same work every call),
        # the scatter
        sums[:, hot] += torch.where(hot_pairs, values, 0.0).sum(dim=1)
        values.masked_fill_(hot_pairs, 0.0)
        sums.index_add_(1, apart_index, values)

    ms = milliseconds(apart, device, args.repeats)
    print(f"{'Zipf, (<other>, <other>) apart':34} {ms:7.3f} {ms / base:10.2f}")


if __name__ == "__main__":
    main(ARGS)
