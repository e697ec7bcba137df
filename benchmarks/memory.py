"""Accumulator memory per device for the reference model (4 attention modules, 8 heads) as the vocabulary grows.

    python benchmarks/memory.py [--budget 1GiB]

``bytes`` is what the callback computes before allocating (``AttentionAccumulator.state_bytes`` summed over the
modules) and checks against ``memory_budget``; ``allocated`` is what the states really take, measured by creating
the accumulators, for every configuration that fits in a few GiB of this machine's memory.
"""

from __future__ import annotations

import argparse

from attn_callbacks.base.config import format_bytes as _format_bytes
from attn_callbacks.metrics import AttentionAccumulator
from attn_callbacks.tokens import parse_bytes

MODULES, HEADS, TRACKED = 4, 8, 2048
VOCABS = (1000, 8000, 30522, 50257)
MEASURE_UP_TO = 4 << 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="1GiB", help="memory_budget to compare with (default 1GiB)")
    args = parser.parse_args()
    budget = parse_bytes("budget", args.budget)
    print(f"{MODULES} attention modules x {HEADS} heads; memory_budget {_format_bytes(budget)}")
    print(f"{'vocabulary':>10} {'configuration':44} {'bytes':>12} {'allocated':>12} {'vs budget':>10}")
    for vocab in VOCABS:
        tracked = min(vocab, TRACKED + 1)  # K ids + <other>
        configs = [
            ("dense, per head", vocab, False),
            (f"max_tracked_tokens={TRACKED}, per head", tracked, False),
            (f"max_tracked_tokens={TRACKED}, per_head=False", tracked, True),
        ]
        for name, size, mean_of_heads in configs:
            planned = MODULES * AttentionAccumulator.state_bytes(HEADS, size, size, mean_of_heads)
            measured = "-"
            if planned <= MEASURE_UP_TO:
                states = [AttentionAccumulator(HEADS, size, size, mean_of_heads) for _ in range(MODULES)]
                allocated = sum(t.numel() * t.element_size() for s in states for t in s.metric_state.values())
                measured = _format_bytes(allocated)
                del states
            verdict = "fits" if planned <= budget else "refused"
            print(f"{vocab:10} {name:44} {_format_bytes(planned):>12} {measured:>12} {verdict:>10}")


if __name__ == "__main__":
    main()
