"""attn_callbacks: watch which vocabulary items attend to which while a transformer trains.

The public names: :class:`AttentionMonitor` (the Lightning callback), :class:`AttentionAccumulator` (the torchmetrics
state it keeps per attention module), :func:`capture_attention` (per-head weights outside Lightning) and the pure
functions in :mod:`attn_callbacks.functional`.
"""

from attn_callbacks import functional
from attn_callbacks.callback import AttentionMonitor
from attn_callbacks.capture import AttentionCapture, capture_attention, find_attention_modules
from attn_callbacks.metrics import AttentionAccumulator, AttentionStats

__version__ = "0.1.0"

__all__ = [
    "AttentionAccumulator",
    "AttentionCapture",
    "AttentionMonitor",
    "AttentionStats",
    "__version__",
    "capture_attention",
    "find_attention_modules",
    "functional",
]
