"""Independent float64 references shared by the test files (plain loops, nothing from the package)."""

import torch


def add_loop_sums(S: torch.Tensor, Q: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, pad: int) -> None:
    """Add one batch to ``S (H, V, V)`` and ``Q (V,)`` by explicit loops: every non-pad query position ``i`` holding
    ``a`` counts once in ``Q[a]`` and adds ``weights[n, :, i, j]`` to ``S[:, a, b]`` for every non-pad key ``j``
    holding ``b``. ``ids (B, L)``, ``weights (B, H, L, L)``."""
    batch, length = ids.shape
    for n in range(batch):
        for i in range(length):
            if ids[n, i] == pad:
                continue
            Q[ids[n, i]] += 1
            for j in range(length):
                if ids[n, j] != pad:
                    S[:, ids[n, i], ids[n, j]] += weights[n, :, i, j].double()
