"""Epoch sums: the per-batch step that adds one batch of weights to the packed running sums (:mod:`.step`, the torch
definition, and its numba twin :mod:`.step_numba` for the CPU), the torchmetrics state that holds them per module
and dataloader with the memory budget (:mod:`.accumulator`) and the pinned torchmetrics adapter
(:mod:`.summed_metric`). Imports :mod:`..base` only."""
