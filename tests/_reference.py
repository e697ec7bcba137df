"""Independent float64 references shared by the test files (plain loops, nothing from the package)."""

import math

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


def naive_js(p, q):
    """Jensen–Shannon divergence in nats of two lists, renormalised; 0 when either is all zero."""
    sp, sq = sum(p), sum(q)
    if sp == 0 or sq == 0:
        return 0.0
    p = [x / sp for x in p]
    q = [x / sq for x in q]
    m = [(x + y) / 2 for x, y in zip(p, q, strict=True)]
    kl_p = sum(x * math.log(x / z) for x, z in zip(p, m, strict=True) if x > 0)
    kl_q = sum(y * math.log(y / z) for y, z in zip(q, m, strict=True) if y > 0)
    return (kl_p + kl_q) / 2
