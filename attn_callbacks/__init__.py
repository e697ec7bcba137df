"""attn_callbacks: watch which vocabulary items attend to which while a transformer trains.

The public names: :class:`AttentionMonitor` (the Lightning callback), :class:`AttentionAccumulator` (the torchmetrics
state it keeps per attention module), :func:`capture_attention` (per-head weights outside Lightning, from
``nn.MultiheadAttention``, Hugging Face attention and ``scaled_dot_product_attention`` calls alike) and the pure
functions in :mod:`attn_callbacks.functional`; :func:`save_epoch`, :func:`load_epoch` and :func:`export_graph` write
an epoch's sums to disk, read them back and export an attention graph (``python -m attn_callbacks`` compares epochs).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attn_callbacks import functional
    from attn_callbacks.callback import AttentionMonitor
    from attn_callbacks.capture.collect import capture_attention
    from attn_callbacks.capture.find import find_attention_modules
    from attn_callbacks.capture.hooks import AttentionCapture
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

# Public name -> the module that defines it. Imported on first use (PEP 562), so that TensorBoard, which imports the
# explorer plugin (attn_callbacks.explorer) at start, does not import torch and Lightning with this package.
_HOMES = {
    "functional": "attn_callbacks.functional",
    "AttentionMonitor": "attn_callbacks.callback",
    "AttentionCapture": "attn_callbacks.capture.hooks",
    "capture_attention": "attn_callbacks.capture.collect",
    "find_attention_modules": "attn_callbacks.capture.find",
    "EpochRecord": "attn_callbacks.output.export",
    "load_epoch": "attn_callbacks.output.export",
    "save_epoch": "attn_callbacks.output.export",
    "export_graph": "attn_callbacks.output.graph",
    "AttentionAccumulator": "attn_callbacks.sums.accumulator",
    "AttentionStats": "attn_callbacks.sums.accumulator",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'attn_callbacks' has no attribute {name!r}")
    module = importlib.import_module(home)
    value = module if home.endswith(f".{name}") else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
