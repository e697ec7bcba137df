"""attn_callbacks: watch which vocabulary items attend to which while a transformer trains.

The public names: :class:`AttentionMonitor` (the Lightning callback), :class:`AttentionAccumulator` (the torchmetrics
state it keeps per attention module), :func:`capture_attention` (per-head weights outside Lightning, from
``nn.MultiheadAttention``, Hugging Face attention and ``scaled_dot_product_attention`` calls alike) and the pure
functions in :mod:`attn_callbacks.functional`; :func:`save_epoch`, :func:`load_epoch` and :func:`export_graph` write
an epoch's sums to disk, read them back and export an attention graph (``python -m attn_callbacks`` compares epochs).
"""

from attn_callbacks import functional
from attn_callbacks.callback import AttentionMonitor
from attn_callbacks.capture.hooks import AttentionCapture, capture_attention, find_attention_modules
from attn_callbacks.output.export import EpochRecord, load_epoch, save_epoch
from attn_callbacks.output.graph import export_graph
from attn_callbacks.sums.accumulator import AttentionAccumulator, AttentionStats

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
