"""Which images each module gets at an epoch end, and their colour scales: the mean-of-heads attention mass, every
head's, the asymmetry ``P - Pᵀ``, ``log2`` lift, the change since the reference epoch and the probe maps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from attn_callbacks.base.tensor_ops import to_host_flat
from attn_callbacks.metrics.summary import lift
from attn_callbacks.output.dashboard import HEAD_METRICS, HeadMetric, head_grid_rows
from attn_callbacks.output.figure_cache import FigureCache
from attn_callbacks.output.figures import abs_max

__all__ = ["Images"]


class Images:
    """The figures of every image tag, redrawn with new data every epoch, and each tag's colour scale. With
    ``figures`` a :class:`~attn_callbacks.output.draw_worker.FigureJobs` (the drawing process runs), each method
    returns the jobs that draw its pictures instead of their RGBA arrays; the colour limits are kept here either way.

    Args:
        color_scale: ``"epoch"`` scales each image to its own largest value, rounded up
            (:func:`~attn_callbacks.output.figures.abs_max`); ``"shared"`` gives each image tag the largest such top
            any epoch drew under it so far.
    """

    def __init__(self, color_scale: str = "epoch") -> None:
        self.color_scale = color_scale
        self.limits: dict[str, float] = {}  # image tag -> top of its colour scale so far (color_scale="shared")
        self.figures = FigureCache()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "figures": FigureCache()}  # a cache, rebuilt where needed

    def limit(self, tag: str, values: np.ndarray) -> float | None:
        """Top of an image's colour scale: None for its own (``"epoch"``), or the largest rounded top any epoch drew
        under this tag so far (``"shared"``: the scale only widens, so maps of later epochs compare by eye)."""
        if self.color_scale == "epoch":
            return None
        # A top kept by an older version (a checkpoint) is rounded up as a new one is.
        limit = max(abs_max(np.array([self.limits.get(tag, 0.0)])), abs_max(values))
        self.limits[tag] = limit
        return limit

    def module_maps(
        self,
        tag: str,
        layer: str,
        *,
        mass: Tensor,
        mass_heads: Tensor | None,
        query_count: Tensor,
        uniform_sum: Tensor,
        rows: Tensor,
        cols: Tensor,
        row_labels: Sequence[str],
        col_labels: Sequence[str],
        square: bool,
        reference_mass: Tensor | None = None,
        reference_epoch: int | None = None,
        suffix: str = "",
    ) -> dict[str, np.ndarray]:
        """One module's heatmaps, by tag (``tag`` is ``{family}`` filled in: ``"{prefix}_{family}/{layer}"``), as RGBA
        arrays. Drawn from the shown block of ``rows`` × ``cols`` only: differences of whole V × V matrices would be
        wasted work. ``mass_heads`` None leaves out the per-head grid; ``reference_mass`` (``mean_h P`` of the
        reference epoch, anywhere) adds the drift map."""
        images: dict[str, np.ndarray] = {}

        def draw(family: str, shown: Tensor, title: str, colour: str, diverging: bool = False) -> None:
            name = tag.format(family=family)
            matrix = shown.float().cpu().numpy()
            images[name] = self.figures.heatmap(
                matrix,
                row_labels,
                col_labels,
                f"{layer}: {title}",
                colour,
                diverging,
                self.limit(name + suffix, matrix),
            )

        # The shown block's cells alone: gathering its whole rows first copies V / top_k times more (with torch's
        # threads, which wait for a core while the image writer thread encodes: ~5 ms a module).
        block = (rows[:, None], cols)
        shown = mass[block]  # (top rows, top cols)
        draw("mass", shown, "attention mass P (mean of heads)", "P[query, key]")
        if mass_heads is not None:
            name = tag.format(family="mass_heads")
            matrices = mass_heads[:, rows[:, None], cols].float().cpu().numpy()  # (H, top rows, top cols)
            images[name] = self.figures.head_grid(
                matrices,
                row_labels,
                col_labels,
                f"{layer}: attention mass P per head",
                "P[query, key]",
                vmax=self.limit(name + suffix, matrices),
            )
        if square:  # rows == cols, so the block of Pᵀ is the transposed block
            draw(
                "asymmetry_map",
                shown - shown.T,
                "P - Pᵀ (red: query attends to key more than back)",
                "P[a, b] - P[b, a]",
                True,
            )
        # S̄ = Q P̄ at the shown cells, as the tables' lifts take it.
        lifts = lift(query_count[rows, None].to(mass.dtype) * shown, uniform_sum[block])
        # log2 lift, blank where the pair was never visible (U = 0: no evidence either way). C counts pairs a mask hid
        # too (a causal model's later keys): their lift 0 would paint a saturated -20 and stretch the scale.
        log_lift = torch.where(uniform_sum[block] > 0, torch.log2(lifts.clamp(min=1e-6)), float("nan"))
        draw(
            "lift_map",
            log_lift,
            "log2 lift over uniform attention (red: more than chance)",
            "log2(S / U): 1 = twice chance",
            True,
        )
        if reference_mass is not None:
            ref_mass = reference_mass[rows.cpu()[:, None], cols.cpu()].to(mass.device)
            draw(
                "drift_map",
                shown - ref_mass,
                f"P now - P at epoch {reference_epoch} (red: attends more now)",
                "P_t - P_ref",
                True,
            )
        return images

    def metric_grid(
        self, tag: str, key: str, values: dict[str, Tensor], square: dict[str, bool], suffix: str = ""
    ) -> np.ndarray:
        """The head grid of one per-head metric (``key``, e.g. ``"position/entropy"``) as an RGBA array: a row per
        module (``values``: name -> ``(H,)``, in model order; self-attention rows first, then cross-attention ones
        below a line), a column per head, each cell's value printed in it. Metrics with a natural range keep it
        (:data:`~attn_callbacks.output.dashboard.HEAD_METRICS`); the others follow ``color_scale``."""
        metric = HEAD_METRICS.get(key, HeadMetric(key))
        flat = to_host_flat(values.values(), torch.float64).numpy()
        ends = np.cumsum([v.numel() for v in values.values()])
        numbers = dict(zip(values, np.split(flat, ends[:-1]), strict=True))
        rows, row_labels, groups = head_grid_rows(numbers, square)
        vmax = metric.vmax if metric.vmax is not None else self.limit(tag + suffix, rows)
        return self.figures.value_grid(
            rows,
            row_labels,
            [str(h) for h in range(rows.shape[1])],
            f"{metric.label}, per head",
            "",
            vmax=vmax,
            groups=groups,
        )

    def probe_maps(
        self,
        tag: str,
        layer: str,
        weights: Tensor,
        samples: Sequence[tuple[Tensor, Tensor, Sequence[str], Sequence[str]]],
    ) -> dict[str, np.ndarray]:
        """Position × position maps of the probe samples, ``{tag}/sample_{n}``: the mean of the heads, then every
        head. ``weights``: ``(n, H, Lq, Lk)``; ``samples``: per sample, the valid query and key positions and their
        labels."""
        images: dict[str, np.ndarray] = {}
        for sample, (q_pos, k_pos, q_labels, k_labels) in enumerate(samples):
            per_head = weights[sample][:, q_pos][:, :, k_pos]  # (H, valid Lq, valid Lk)
            panels = torch.cat([per_head.mean(dim=0, keepdim=True), per_head]).numpy()
            name = f"{tag}/sample_{sample}"
            images[name] = self.figures.head_grid(
                panels,
                q_labels,
                k_labels,
                f"{layer}: probe sample {sample}, attention weight (query position × key position)",
                "weight",
                titles=["mean of heads"] + [f"head {h}" for h in range(per_head.shape[0])],
                vmax=self.limit(name, panels),
            )
        return images
