"""How TensorBoard shows the per-head numbers: their tag names, the head grid images' contents, and the
custom-scalars layout (one multiline chart per module and metric). Pure functions of names and values."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "HEAD_METRICS",
    "HeadMetric",
    "grid_tag",
    "head_grid_rows",
    "head_tag",
    "layer_tag",
    "scalars_layout",
    "short_names",
]

# TensorBoard's scalar tags for several validation dataloaders end in this (see the callback's docs).
_LOADER = r"(/dataloader_idx_\d+)?"


@dataclass(frozen=True)
class HeadMetric:
    """How a per-head metric is drawn in its head grid.

    Attributes:
        label: the colour bar's label (what a cell's number is).
        vmax: the fixed top of the colour scale (the scale then starts at 0 and is the same every epoch, so
            TensorBoard's step slider shows change); None scales by the ``color_scale`` option.
    """

    label: str
    vmax: float | None = None


#: Every per-head metric the monitor logs, by its key (the scalar tag between the prefix and the module), in the
#: order the head grids are written. Shares and normalised values lie in [0, 1]; the JS divergence in [0, log 2].
HEAD_METRICS: dict[str, HeadMetric] = {
    "entropy": HeadMetric("entropy of P's rows (nats)"),
    "asymmetry": HeadMetric("asymmetry index", 1.0),
    "lift": HeadMetric("mean lift (x chance)"),
    "position/entropy": HeadMetric("position entropy (nats)"),
    "position/entropy_normalized": HeadMetric("position entropy / its maximum", 1.0),
    "position/self": HeadMetric("share on the own position", 1.0),
    "position/previous": HeadMetric("share on the previous position", 1.0),
    "position/next": HeadMetric("share on the next position", 1.0),
    "position/distance": HeadMetric("mean distance (positions)"),
    "position/sink_mass": HeadMetric("share on sink tokens", 1.0),
    "drift/js_prev": HeadMetric("JS divergence (nats)", math.log(2.0)),
    "drift/js_ref": HeadMetric("JS divergence (nats)", math.log(2.0)),
    "drift/frobenius_prev": HeadMetric("relative Frobenius change"),
    "drift/frobenius_ref": HeadMetric("relative Frobenius change"),
}


def layer_tag(prefix: str, key: str, layer: str) -> str:
    """A module's scalar: ``{prefix}_{key}/{layer}`` (``attention_position/entropy/enc.0``)."""
    return f"{prefix}_{key}/{layer}"


def head_tag(prefix: str, key: str, layer: str) -> str:
    """Where a module's per-head series of ``key`` live, before ``/head_{h}``: the family (the key's first part)
    with ``_heads`` added, so that no TensorBoard section mixes per-head and layer charts.

    Example:
        >>> head_tag("attention", "position/entropy", "enc.0")
        'attention_position_heads/entropy/enc.0'
        >>> head_tag("attention", "lift", "enc.0")
        'attention_lift_heads/enc.0'
    """
    family, _, name = key.partition("/")
    return f"{prefix}_{family}_heads/{name + '/' if name else ''}{layer}"


def grid_tag(prefix: str, key: str) -> str:
    """The head grid image of ``key``: ``{prefix}_heads/{key with "/" as "_"}``.

    Example:
        >>> grid_tag("attention", "drift/js_prev")
        'attention_heads/drift_js_prev'
    """
    return f"{prefix}_heads/{key.replace('/', '_')}"


def short_names(names: Sequence[str]) -> list[str]:
    """Row labels for module names: the dotted parts every name shares at the start and at the end are dropped,
    keeping the part before a layer number (``encoder.layer.3.attention.self`` among its siblings reads
    ``layer.3``). A lone name is kept whole; the empty name (the LightningModule itself) reads ``attention``."""
    parts = [name.split(".") if name else ["attention"] for name in names]
    if len(parts) < 2:
        return [".".join(p) for p in parts]
    shortest = min(len(p) for p in parts)
    lead = 0
    while lead < shortest - 1 and len({p[lead] for p in parts}) == 1:
        lead += 1
    trail = 0
    while trail < shortest - lead - 1 and len({p[len(p) - 1 - trail] for p in parts}) == 1:
        trail += 1
    if lead and all(p[lead].isdigit() for p in parts):
        lead -= 1  # "layer.3", not "3"
    return [".".join(p[lead : len(p) - trail]) for p in parts]


def head_grid_rows(
    values: Mapping[str, np.ndarray], square: Mapping[str, bool]
) -> tuple[np.ndarray, list[str], list[int]]:
    """One metric's head grid: a row per module, self-attention modules first, then cross-attention ones, each
    group in model order (the order of ``values``).

    Args:
        values: module name -> its ``(H,)`` values of the metric, in model order.
        square: module name -> whether it is self-attention (its queries and keys are one stream).

    Returns:
        ``(M, max H)`` values (NaN where a module has fewer heads), the row labels (cross-attention ones end in
        ``(cross)``), and the rows where a new group starts (``[]`` or ``[first cross row]``).
    """
    names = [name for name in values if square[name]] + [name for name in values if not square[name]]
    labels = dict(zip(values, short_names(list(values)), strict=True))
    rows = np.full((len(names), max((len(v) for v in values.values()), default=0)), np.nan)
    for row, name in enumerate(names):
        rows[row, : len(values[name])] = values[name]
    selfs = sum(square[name] for name in names)
    return (
        rows,
        [labels[name] + ("" if square[name] else " (cross)") for name in names],
        [selfs] if 0 < selfs < len(names) else [],
    )


def scalars_layout(prefix: str, modules: Mapping[str, Sequence[str]], per_head: bool) -> dict[str, dict[str, list]]:
    """TensorBoard's custom-scalars layout (``SummaryWriter.add_custom_scalars``'s argument) for one tag prefix.

    For each per-head metric a category ``{prefix} heads: {key}`` with one multiline chart per module holding every
    head and the module's value; then ``{prefix} overview``, one chart per metric with every module's value. The
    plugin picks a chart's series with ``re.match`` of each regex: every one here is anchored at both ends and
    allows the ``/dataloader_idx_{k}`` suffix.

    Args:
        prefix: the tags' prefix (``attention``, or ``attention_test`` for test epochs).
        modules: metric key -> the modules (their tag names) logging it, in model order.
        per_head: whether per-head series are logged.
    """
    layout: dict[str, dict[str, list]] = {}
    if per_head:
        for key, layers in modules.items():
            if key in HEAD_METRICS:
                layout[f"{prefix} heads: {key}"] = {
                    f"{key} · {layer}": [
                        "Multiline",
                        [
                            f"^{re.escape(head_tag(prefix, key, layer))}/head_\\d+{_LOADER}$",
                            f"^{re.escape(layer_tag(prefix, key, layer))}{_LOADER}$",
                        ],
                    ]
                    for layer in layers
                }
    layout[f"{prefix} overview"] = {
        key: ["Multiline", [f"^{re.escape(f'{prefix}_{key}/')}({'|'.join(map(re.escape, layers))}){_LOADER}$"]]
        for key, layers in modules.items()
    }
    return layout
