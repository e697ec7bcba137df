"""The benchmarks' model shapes and option types, in a module that imports nothing but argparse, so that each script
answers ``--help`` on a bare Python before it imports torch."""

import argparse

VOCAB, D_MODEL, HEADS, LAYERS, FEEDFORWARD, BATCH, LENGTH = 8000, 256, 8, 4, 1024, 32, 128

# name -> (vocabulary, d_model, heads, layers, feed-forward, batch, length, tracked ids)
PRESETS = {
    "stress": (VOCAB, D_MODEL, HEADS, LAYERS, FEEDFORWARD, BATCH, LENGTH, 2048),
    "bert-base": (30522, 768, 12, 12, 3072, BATCH, LENGTH, 1024),
    "tiny": (64, 32, 2, 1, 64, 4, 16, 32),
}


def positive_int(text: str) -> int:
    """An argparse type: a count of at least 1 (batches, rounds, epochs ...)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value
