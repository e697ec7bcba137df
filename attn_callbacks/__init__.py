"""attn_callbacks: watch which vocabulary items attend to which while a transformer trains.

The public names: :class:`AttentionMonitor` (the Lightning callback), :class:`AttentionAccumulator` (the torchmetrics
state it keeps per attention module), :func:`capture_attention` (per-head weights outside Lightning, from
``nn.MultiheadAttention`` and Hugging Face eager attention alike) and the pure
functions in :mod:`attn_callbacks.functional`; :func:`save_epoch`, :func:`load_epoch` and :func:`export_graph` write
an epoch's sums to disk, read them back and export an attention graph (``python -m attn_callbacks`` compares epochs).
"""

from attn_callbacks import functional
from attn_callbacks.accumulate import AttentionAccumulator, AttentionStats
from attn_callbacks.callback import AttentionMonitor
from attn_callbacks.capture import AttentionCapture, capture_attention, find_attention_modules
from attn_callbacks.export import EpochRecord, export_graph, load_epoch, save_epoch

__version__ = "0.1.0"

__all__ = [
    "AttentionAccumulator",
    "AttentionCapture",
    "AttentionMonitor",
    "AttentionStats",
    "EpochRecord",
    "__version__",
    "capture_attention",
    "export_graph",
    "find_attention_modules",
    "functional",
    "load_epoch",
    "save_epoch",
]
