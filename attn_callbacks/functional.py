"""The pure tensor functions, in one namespace: accumulating attention weights into vocabulary × vocabulary sums, and
every epoch metric computed from the sums. Each lives in the module of its idea (:mod:`~attn_callbacks.sums.step`,
:mod:`~attn_callbacks.metrics.summary`, :mod:`~attn_callbacks.metrics.drift`, :mod:`~attn_callbacks.metrics.tables`,
:mod:`~attn_callbacks.base.tensor_ops`); nothing here knows about Lightning or hooks.
"""

from attn_callbacks.base.tensor_ops import row_plogp, safe_divide
from attn_callbacks.metrics.drift import attention_drift, js_divergence, moved_tokens
from attn_callbacks.metrics.summary import (
    asymmetry_index,
    attention_mass,
    in_degree,
    lift,
    mean_lift,
    mean_weight,
    pairwise_asymmetry,
    position_statistics,
    row_entropy,
    sink_mass,
)
from attn_callbacks.metrics.tables import one_way_pairs, pagerank, top_pairs, top_tokens
from attn_callbacks.sums.step import POSITION_STATS, accumulate_attention, pair_index

__all__ = [
    "POSITION_STATS",
    "accumulate_attention",
    "asymmetry_index",
    "attention_drift",
    "attention_mass",
    "in_degree",
    "js_divergence",
    "lift",
    "mean_lift",
    "mean_weight",
    "moved_tokens",
    "one_way_pairs",
    "pagerank",
    "pair_index",
    "pairwise_asymmetry",
    "position_statistics",
    "row_entropy",
    "row_plogp",
    "safe_divide",
    "sink_mass",
    "top_pairs",
    "top_tokens",
]
