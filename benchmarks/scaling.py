"""Time of one accumulation step (one attention module, one batch) as B, L, H and the vocabulary vary.

    python benchmarks/scaling.py [--profile] [--quick]

Each row times :func:`attn_callbacks.functional.accumulate_attention` (the fast path the callback runs: the numba kernel
on CPU, where numba runs; the torch code on a CUDA device, where there is one) on softmax weights with Zipf(1) token
ids, median of 5 after a warm-up. ``ns/weight`` divides by the B·H·L² weights read: flat down a column means the cost is
linear in B·H·L²; flat across the vocabulary block means V only costs memory. A last section times, on CPU, the numba
kernel against the torch code (:func:`attn_callbacks.sums.step_torch.accumulate_attention_torch`, with its pair index)
at the base shape, or on a GPU the step at the base shape and BERT-base's, its wall time against its host time, with and
without the ``(<other>, <other>)`` cell summed apart; ``--profile`` prints torch.profiler's table of a step (on a GPU:
the time of each kernel). ``--quick`` runs the base row, the ``per_head=False`` row and the last section at a small base
shape (B 4, L 32, H 2, V 257) only: a smoke run of a few seconds.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true", help="also print torch.profiler's table of one step")
    parser.add_argument(
        "--quick", action="store_true", help="the base rows and the last section at a small base shape only"
    )
    return parser.parse_args()


if __name__ == "__main__":
    ARGS = arguments()  # before the imports below, so that --help needs nothing but Python

import torch

from _workload import best_of, device_label
from attn_callbacks import functional as F
from attn_callbacks.base.numba_loader import uses_numba
from attn_callbacks.sums.step_torch import accumulate_attention_torch

BASE = {"B": 32, "L": 128, "H": 8, "V": 2049}
QUICK_BASE = {"B": 4, "L": 32, "H": 2, "V": 257}  # --quick
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the callback's sums live on the model's device


def make_step(
    batch: int,
    length: int,
    heads: int,
    vocab: int,
    mean_of_heads: bool = False,
    distribution: str = "zipf",
    path: str = "dispatch",
    full_vocab: int | None = None,
    apart: bool = True,
) -> Callable[[], None]:
    """One step on fresh sums; ``path``: ``dispatch`` (what the callback runs), ``torch`` (the torch code, with its
    pair index) or ``numba`` (the kernel, from the ids). With ``full_vocab``, ids are drawn over that many and all
    past the first ``vocab - 1`` fold into ``<other>`` (the last id), as a tracked stream's do; ``apart``: the
    ``(<other>, <other>)`` cell is then summed apart off the CPU, as the callback does."""
    g = torch.Generator().manual_seed(0)
    weights = torch.randn(batch, heads, length, length, generator=g).softmax(dim=-1).to(DEVICE)
    drawn = full_vocab or vocab
    if distribution == "zipf":
        probs = 1.0 / torch.arange(1, drawn + 1, dtype=torch.float64)
    else:
        probs = torch.ones(drawn, dtype=torch.float64)
    ids = torch.multinomial(probs, batch * length, replacement=True, generator=g).view(batch, length)
    ids = ids.clamp(max=vocab - 1).to(DEVICE)
    hot_cell = vocab * vocab - 1 if full_vocab and apart else None
    valid = torch.ones(batch, length, dtype=torch.bool, device=DEVICE)
    channels = 1 if mean_of_heads else heads
    sums = torch.zeros(channels + 1, vocab * vocab, device=DEVICE)
    pair_count = torch.zeros(vocab * vocab, dtype=torch.long, device=DEVICE)
    query_count = torch.zeros(vocab, dtype=torch.long, device=DEVICE)
    position_sums = torch.zeros(len(F.POSITION_STATS), heads, device=DEVICE)
    state = (sums, pair_count, query_count, position_sums)

    def step() -> None:
        if path == "torch":
            pairs = F.pair_index(ids, ids, valid, valid, vocab, vocab)  # once per batch, shared by the modules
            accumulate_attention_torch(*state, weights, pairs, ids, valid, valid)
        elif path == "numba" or uses_numba(weights.device):  # as EpochSums.add: the numba kernel reads the ids
            F.accumulate_attention(*state, weights, None, ids, valid, valid, key_ids=ids)
        else:  # off the CPU the step reads the pair index, made once per batch and shared by the modules
            pairs = F.pair_index(ids, ids, valid, valid, vocab, vocab)
            F.accumulate_attention(*state, weights, pairs, ids, valid, valid, key_ids=ids, hot_cell=hot_cell)

    return step


def step_seconds(*args, **kwargs) -> float:
    """Seconds of one step (:func:`make_step`'s arguments)."""
    return best_of(make_step(*args, **kwargs))


def profile_step(base: dict[str, int], steps: int = 10) -> None:
    """torch.profiler's table of one step's operations at the base shape and at BERT-base's (12 heads, Zipf ids over
    30,522 tracked to 1,025), by their time on the device: on a GPU, which kernels the time goes to."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    for name, (heads, vocab, full) in {"base": (base["H"], base["V"], None), "bert-base": (12, 1025, 30522)}.items():
        step = make_step(base["B"], base["L"], heads, vocab, full_vocab=full)
        step()
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            if DEVICE == "cuda":
                torch.cuda.synchronize()
        print(f"\n{name}: B={base['B']} L={base['L']} H={heads} V={vocab}, {steps} steps")
        sort = "self_cuda_time_total" if DEVICE == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=25))


def compare_paths(base: dict[str, int]) -> None:
    """The numba kernel against the torch code at the base shape, per call."""
    if not uses_numba("cpu"):
        print("numba vs torch: numba is not running (not installed, or ATTN_CALLBACKS_NUMBA=0)")
        return
    b, length, h, v = base["B"], base["L"], base["H"], base["V"]
    print(f"\nnumba vs torch at B={b} L={length} H={h} V={v}, cpu ({torch.get_num_threads()} threads), ms per call")
    print(f"{'ids':8} {'sums':9} {'numba':>8} {'torch':>8} {'torch/numba':>12}")
    for distribution in ("zipf", "uniform"):
        for mean_of_heads in (False, True):
            ms = {
                path: step_seconds(b, length, h, v, mean_of_heads, distribution, path) * 1e3
                for path in ("numba", "torch")
            }
            sums = "mean" if mean_of_heads else "per head"
            numba, torch_ms = _ms(ms["numba"] / 1e3), _ms(ms["torch"] / 1e3)
            print(f"{distribution:8} {sums:9} {numba:>8} {torch_ms:>8} {ms['torch'] / ms['numba']:11.1f}x")


def gpu_step(base: dict[str, int], steps: int = 20, rounds: int = 5) -> None:
    """On a GPU: the step at the base shape and BERT-base's, median of ``rounds`` rounds. ``wall`` waits for the
    device after each step (the step's latency); ``host`` is the time the Python thread spends issuing a step when it
    does not wait: what a model's own launches wait for. At BERT-base's shapes the ids are Zipf over 30,522 tracked to
    1,025, as in ``overhead.py --preset bert-base``; the row ``not apart`` scatters the ``(<other>, <other>)`` cell
    with the rest instead of summing it apart."""
    bert = (12, 1025, 30522)
    shapes = {
        "base": (base["H"], base["V"], None, False, True),
        "bert-base": (*bert, False, True),
        "bert-base mean": (*bert, True, True),
        "not apart": (*bert, False, False),
    }
    print(f"\nthe step on the GPU, B={base['B']} L={base['L']}, ms per step, median of {rounds} rounds")
    print(f"{'shape':15} {'wall':>8} {'host':>8}")
    for name, (heads, vocab, full, mean_of_heads, apart) in shapes.items():
        ms: dict[str, list[float]] = {}
        for _ in range(rounds):
            step = make_step(base["B"], base["L"], heads, vocab, mean_of_heads, full_vocab=full, apart=apart)
            ms.setdefault("wall", []).append(best_of(step) * 1e3)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                step()
            ms.setdefault("host", []).append((time.perf_counter() - start) / steps * 1e3)
            torch.cuda.synchronize()
        print(f"{name:15} {statistics.median(ms['wall']):8.3f} {statistics.median(ms['host']):8.3f}")


def _ms(seconds: float) -> str:
    """Milliseconds to one decimal, three below 1 ms: a quick run's small steps must not print 0.0."""
    return f"{seconds * 1e3:.1f}" if seconds >= 1e-3 else f"{seconds * 1e3:.3f}"


def main(args: argparse.Namespace) -> None:
    base = QUICK_BASE if args.quick else BASE
    print(
        f"accumulate_attention, one module and batch; torch {torch.__version__}, "
        f"{device_label()}, "
        f"{platform.processor() or platform.machine()}"
    )
    print(f"{'varied':7} {'B':>4} {'L':>5} {'H':>4} {'V':>6} {'B·H·L² (M)':>11} {'ms':>8} {'ns/weight':>10}")
    rows = [("base", dict(base))]
    if not args.quick:
        rows += [("B", {**base, "B": b}) for b in (8, 16, 64)]
        rows += [("L", {**base, "L": n}) for n in (32, 64, 256)]
        rows += [("H", {**base, "H": h}) for h in (2, 4, 16)]
        rows += [("V", {**base, "V": v}) for v in (256, 1024, 4096, 8000)]
    for varied, c in rows:
        seconds = step_seconds(c["B"], c["L"], c["H"], c["V"])
        weights = c["B"] * c["H"] * c["L"] ** 2
        print(
            f"{varied:7} {c['B']:4} {c['L']:5} {c['H']:4} {c['V']:6} {weights / 1e6:11.1f} {_ms(seconds):>8} "
            f"{seconds / weights * 1e9:10.2f}"
        )
    seconds = step_seconds(base["B"], base["L"], base["H"], base["V"], mean_of_heads=True)
    weights = base["B"] * base["H"] * base["L"] ** 2
    print(
        f"{'per_head=False (head-mean sums only)':37} {weights / 1e6:11.1f} {_ms(seconds):>8} "
        f"{seconds / weights * 1e9:10.2f}"
    )
    if DEVICE == "cpu":
        compare_paths(base)
    else:
        gpu_step(base)
    if args.profile:
        profile_step(base)


if __name__ == "__main__":
    main(ARGS)
