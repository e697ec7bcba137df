"""The benchmarks' model shapes, in a module that imports nothing, so that each script answers ``--help`` on a bare
Python before it imports torch."""

VOCAB, D_MODEL, HEADS, LAYERS, FEEDFORWARD, BATCH, LENGTH = 8000, 256, 8, 4, 1024, 32, 128

# name -> (vocabulary, d_model, heads, layers, feed-forward, batch, length, tracked ids)
PRESETS = {
    "stress": (VOCAB, D_MODEL, HEADS, LAYERS, FEEDFORWARD, BATCH, LENGTH, 2048),
    "bert-base": (30522, 768, 12, 12, 3072, BATCH, LENGTH, 1024),
    "tiny": (64, 32, 2, 1, 64, 4, 16, 32),
}
