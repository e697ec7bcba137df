"""Accumulator memory per device for the reference model (4 attention modules, 8 heads) as the vocabulary grows.

    python benchmarks/memory.py [--budget 1GiB] [--vocabs 1000,8000,30522,50257] [--measure-up-to 4GiB]

``bytes`` is what the callback computes before allocating (``AttentionAccumulator.state_bytes`` summed over the
modules) and checks against ``memory_budget``; ``allocated`` is what the states really take, measured by creating
the accumulators, for every configuration whose planned bytes are at most ``--measure-up-to`` (``-`` for the
others).
"""

from __future__ import annotations

import argparse

MODULES, HEADS, TRACKED = 4, 8, 2048
VOCABS = "1000,8000,30522,50257"


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="1GiB", help="memory_budget to compare with (default 1GiB)")
    parser.add_argument("--vocabs", default=VOCABS, help=f"comma-separated vocabulary sizes (default {VOCABS})")
    parser.add_argument(
        "--measure-up-to", default="4GiB", help="allocate the states of configurations up to this size (default 4GiB)"
    )
    args = parser.parse_args()
    try:
        vocabs = [int(v) for v in args.vocabs.split(",")]
    except ValueError:
        parser.error(f"--vocabs: expected comma-separated positive integers, got {args.vocabs!r}")
    if min(vocabs) < 1:
        parser.error(f"--vocabs: expected comma-separated positive integers, got {args.vocabs!r}")
    args.vocabs = vocabs
    return args


if __name__ == "__main__":
    ARGS = arguments()  # before the imports below, so that --help needs nothing but Python

from attn_callbacks.base.config import format_bytes, parse_bytes
from attn_callbacks.sums.accumulator import AttentionAccumulator


def main(args: argparse.Namespace) -> None:
    budget = parse_bytes("budget", args.budget)
    measure_up_to = parse_bytes("measure_up_to", args.measure_up_to)
    print(f"{MODULES} attention modules x {HEADS} heads; memory_budget {format_bytes(budget)}")
    print(f"{'vocabulary':>10} {'configuration':44} {'bytes':>12} {'allocated':>12} {'vs budget':>10}")
    for vocab in args.vocabs:
        tracked = min(vocab, TRACKED + 1)  # K ids + <other>
        configs = [
            ("dense, per head", vocab, False),
            (f"max_tracked_tokens={TRACKED}, per head", tracked, False),
            (f"max_tracked_tokens={TRACKED}, per_head=False", tracked, True),
        ]
        for name, size, mean_of_heads in configs:
            planned = MODULES * AttentionAccumulator.state_bytes(HEADS, size, size, mean_of_heads)
            measured = "-"
            if planned <= measure_up_to:
                states = [AttentionAccumulator(HEADS, size, size, mean_of_heads) for _ in range(MODULES)]
                allocated = sum(t.numel() * t.element_size() for s in states for t in s.metric_state.values())
                measured = format_bytes(allocated)
                del states
            verdict = "fits" if planned <= budget else "refused"
            print(f"{vocab:10} {name:44} {format_bytes(planned):>12} {measured:>12} {verdict:>10}")


if __name__ == "__main__":
    main(ARGS)
