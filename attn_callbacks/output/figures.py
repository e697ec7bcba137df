"""Matplotlib figures: labelled heatmaps and grids of them (the object API on the Agg canvas; pyplot untouched)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from matplotlib import transforms
from matplotlib.collections import QuadMesh
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.markers import TICKDOWN, TICKLEFT, TICKRIGHT

from attn_callbacks.output import figure_layout as layout
from attn_callbacks.output.text_outlines import OutlinedTexts, outline

__all__ = [
    "abs_max",
    "bar_label_place",
    "bar_labels",
    "cell_colours",
    "cell_text",
    "head_grid",
    "heatmap",
    "value_grid",
]


# The colour bar's marks and the ticks' sizes (the figure's layout in inches is in figure_layout).
_BAR_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)  # where the colour bar is marked, as fractions of its height
_BAR_FONT = 8
_BAR_PAD = 6  # points from the colour bar to its numbers, past its tick marks
_TICK = 3.5  # points: a tick mark's length, and the gap between it and its label (matplotlib's defaults)
_TICK_PAD = 3.5
_LABEL_PAD = 4  # points between the tick labels and the axis name


def _cmap(diverging: bool) -> str:
    return "RdBu_r" if diverging else "viridis"


def _draw(
    ax,
    matrix: np.ndarray,
    rows: Sequence[str] | None,
    cols: Sequence[str] | None,
    diverging: bool,
    limit: float,
    size: int,
    axis_names: tuple[str, str] = ("query token (attending)", "key token (attended to)"),
    col_rotation: float = 90,
) -> QuadMesh:
    """One heatmap on ``ax`` with colour scale ``[0, limit]`` (``[-limit, limit]`` when ``diverging``), row 0 at the
    top; tick labels only for the axes given (``None``: no ticks, as for inner grid panels), the axes named by
    ``axis_names`` (rows, columns).

    Cells are a mesh of flat quads, not an image: matplotlib resamples an image to the output pixels and colour-maps
    every pixel, ~4× slower at 30 × 30 cells (measured). NaN cells are left blank: matplotlib masks invalid values
    when the mesh is made and at every ``set_array``. Tick labels are
    :class:`~attn_callbacks.output.text_outlines.OutlinedTexts` and the tick marks one line of markers, placed as
    matplotlib places its own (3.5 points long, labels 3.5 points further): a ``Tick`` costs ~4 ms to create and its
    label ~1.5 ms to draw.
    """
    norm = TwoSlopeNorm(0.0, -limit, limit) if diverging else None
    vmin, vmax = (None, None) if diverging else (0.0, limit)
    mesh = ax.pcolormesh(matrix, cmap=_cmap(diverging), norm=norm, vmin=vmin, vmax=vmax, antialiased=False, snap=True)
    ax.invert_yaxis()
    ax.set_xticks([])
    ax.set_yticks([])
    away = _TICK + _TICK_PAD  # points from the spine to a tick label
    if cols is not None:
        at = np.arange(len(cols)) + 0.5  # cell j spans [j, j + 1]
        under = transforms.blended_transform_factory(ax.transData, ax.transAxes)
        offsets = np.column_stack([at, np.zeros_like(at)])
        labels = _labels(ax, cols, offsets, under, size, ("center", "top"), col_rotation, (0, -away), layout.COL_GID)
        _marks(ax, at, np.zeros_like(at), under, TICKDOWN)
        ax.set_xlabel(axis_names[1], fontsize=8)
        below = away + _reach(labels, 1) + _LABEL_PAD
        ax.xaxis.set_label_coords(0.5, 0, transforms.offset_copy(ax.transAxes, ax.figure, y=-below, units="points"))
    if rows is not None:
        at = np.arange(len(rows)) + 0.5
        left = transforms.blended_transform_factory(ax.transAxes, ax.transData)
        offsets = np.column_stack([np.zeros_like(at), at])
        labels = _labels(ax, rows, offsets, left, size, ("right", "center"), 0, (-away, 0), layout.ROW_GID)
        _marks(ax, np.zeros_like(at), at, left, TICKLEFT)
        ax.set_ylabel(axis_names[0], fontsize=8)
        beside = away + _reach(labels, 0) + _LABEL_PAD
        ax.yaxis.set_label_coords(0, 0.5, transforms.offset_copy(ax.transAxes, ax.figure, x=-beside, units="points"))
    return mesh


def _labels(ax, texts, offsets, where, size, align, rotation, shift, gid) -> OutlinedTexts:
    """Tick labels of ``ax`` as outlines aligned ``(ha, va)`` at ``offsets``, ``shift`` points from them (outside the
    axes: not clipped)."""
    ha, va = align
    words = OutlinedTexts(
        texts, offsets, where, size=size, ha=ha, va=va, rotation=rotation, shift=shift, dpi=ax.figure.dpi
    )
    words.set(clip_on=False, gid=gid)
    ax.add_collection(words, autolim=False)
    return words


def _reach(words: OutlinedTexts, axis: int) -> float:
    """How far (points) the longest of ``words`` reaches from its anchor along ``axis`` (0: x, 1: y)."""
    return max((float(np.ptp(path.vertices[:, axis])) for path in words.get_paths() if len(path.vertices)), default=0)


def _marks(ax, x, y, where, marker: int) -> None:
    """Tick marks at ``(x, y)`` in ``where``'s coordinates, drawn as matplotlib draws its ticks."""
    line = Line2D(x, y, transform=where, linestyle="none", marker=marker, markersize=_TICK, markeredgewidth=0.8)
    line.set(color="black", clip_on=False, gid=layout.TICK_GID)
    ax.add_artist(line)  # not a data line: no autoscaling


def bar_labels(limit: float, diverging: bool) -> list[str]:
    """The numbers at :data:`_BAR_FRACTIONS` of a colour bar over ``[0, limit]`` (``[-limit, limit]``)."""
    # 2f - 1 and f are exact, so the diverging bar's numbers are symmetric about 0.
    return [f"{limit * (2 * fraction - 1 if diverging else fraction):.3g}" for fraction in _BAR_FRACTIONS]


def _colorbar(
    figure: Figure, rect: tuple[float, float, float, float], label: str, limit: float, diverging: bool
) -> None:
    """A colour bar in ``rect`` (figure fractions), marked at :data:`_BAR_FRACTIONS` of its scale, the top mark
    reading ``limit``.

    Its gradient and marks do not depend on the scale (both scales map their range linearly onto the colour map),
    only the five numbers and the label's place beside them do: :class:`~attn_callbacks.output.figure_cache.FigureCache`
    keeps the rest and redraws those. Matplotlib's own colour bar places "nice" ticks and its label after measuring
    every tick label, which was most of a cached redraw's time.
    """
    ax = figure.add_axes(rect)
    ax.imshow(
        np.linspace(0.0, 1.0, 256)[:, None],
        cmap=_cmap(diverging),
        vmin=0.0,
        vmax=1.0,
        aspect="auto",
        origin="lower",
        extent=(0.0, 1.0, 0.0, 1.0),
        interpolation="nearest",
    )
    ax.set_xticks([])
    ax.set_yticks([])
    fractions = np.array(_BAR_FRACTIONS)
    _marks(ax, np.ones_like(fractions), fractions, ax.transAxes, TICKRIGHT)
    numbers = bar_labels(limit, diverging)
    offsets = np.column_stack([np.ones_like(fractions), fractions])
    bar_numbers = OutlinedTexts(
        numbers, offsets, ax.transAxes, size=_BAR_FONT, ha="left", shift=(_BAR_PAD, 0), dpi=figure.dpi
    )
    label_words = OutlinedTexts(
        [label], [(1.0, 0.5)], bar_label_place(ax, numbers), size=_BAR_FONT, ha="left", rotation=90, dpi=figure.dpi
    )
    for words, gid in ((bar_numbers, layout.BAR_GID), (label_words, layout.BAR_LABEL_GID)):
        words.set(gid=gid, clip_on=False)
        ax.add_collection(words, autolim=False)


def bar_label_place(bar, numbers: Sequence[str]) -> transforms.Transform:
    """The colour bar label's place: right of the widest of its numbers (the figure leaves room for the widest
    number .3g writes, "-1.23e+100")."""
    widest = max(float(np.ptp(outline(number, _BAR_FONT, "left").vertices[:, 0])) for number in numbers)
    return transforms.offset_copy(bar.transAxes, bar.figure, x=_BAR_PAD + widest + 4, units="points")


def _title(ax, text: str) -> None:
    """The title of one heatmap, left above its panel, as outlines (the figure cache redraws it for every layer)."""
    title = OutlinedTexts(
        [text], [(0.0, 1.0)], ax.transAxes, size=9, ha="left", va="baseline", shift=(0, 6), dpi=ax.figure.dpi
    )
    title.set(gid=layout.TITLE_GID, clip_on=False)
    ax.add_collection(title, autolim=False)


#: Mantissas of a colour scale's top: each quarter of the scale, where the bar is marked, is a short number too.
_ROUND_TOPS = (1.0, 1.2, 1.4, 1.6, 2.0, 2.4, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0)


def abs_max(matrix: np.ndarray) -> float:
    """The default top of a colour scale: the largest finite absolute value (at least a tiny positive number; NaN
    cells are drawn blank), rounded up to a number whose quarters read short on the bar (0.894 -> 1, so the marks
    read 0.25, 0.5, 0.75, 1; 1.81 -> 2). The colours then use at least 75% of the scale (3.01 -> 4)."""
    finite = np.abs(matrix[np.isfinite(matrix)])
    top = max(float(finite.max()) if finite.size else 0.0, 1e-12)
    power = 10.0 ** math.floor(math.log10(top))
    # A relative 1e-5 is allowed (float32 rounding, invisible in 256 colours): 0.5 - 0.45 in float32 tops at 0.05.
    rounded = next(float(f"{m * power:.3g}") for m in _ROUND_TOPS if m * power >= top * (1 - 1e-5))
    return rounded if math.isfinite(rounded) else top  # near float64's largest, rounding up would overflow


def heatmap(
    matrix: np.ndarray,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    title: str,
    colorbar_label: str,
    diverging: bool = False,
    vmax: float | None = None,
) -> Figure:
    """One labelled heatmap: queries on rows, keys on columns, with a colour bar.

    Args:
        matrix: ``(R, C)``.
        row_labels: ``R`` query token labels.
        col_labels: ``C`` key token labels.
        title: figure title (name the layer and head).
        colorbar_label: what the colour means.
        diverging: a red/blue scale centred on 0 (for differences such as ``P - Pᵀ``).
        vmax: top of the colour scale (symmetric limit when diverging); the data's maximum if None. NaN cells are
            drawn blank.
    """
    figure, panels, colorbar, size = layout.grid_figure(
        1, 1, row_labels, col_labels, 1, title_inches=layout.heatmap_title(title), title_at_panel=True
    )
    limit = abs_max(matrix) if vmax is None else vmax
    ax = figure.add_axes(panels[0][0])
    _draw(ax, matrix, row_labels, col_labels, diverging, limit, size)
    _title(ax, title)
    _colorbar(figure, colorbar, colorbar_label, limit, diverging)
    return figure


def head_grid(
    matrices: np.ndarray,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    title: str,
    colorbar_label: str,
    titles: Sequence[str] | None = None,
    diverging: bool = False,
    vmax: float | None = None,
) -> Figure:
    """Per-head heatmaps ``(H, R, C)`` in a grid sharing one colour scale, so heads compare by eye.

    Query labels are on the first column of panels and key labels under the bottom panel of each column.

    Args:
        matrices: ``(H, R, C)``.
        row_labels: ``R`` query token labels.
        col_labels: ``C`` key token labels.
        title: figure title (name the layer).
        colorbar_label: what the colour means.
        titles: one title per panel; ``head 0``, ``head 1`` ... if None.
        diverging: a red/blue scale centred on 0.
        vmax: top of the shared colour scale (symmetric limit when diverging); :func:`abs_max` if None.
    """
    heads = matrices.shape[0]
    titles = [f"head {h}" for h in range(heads)] if titles is None else list(titles)
    ncols = min(heads, layout.GRID_COLUMNS)
    nrows = math.ceil(heads / ncols)
    title_inches = layout.grid_title(title)
    figure, panels, colorbar, size = layout.grid_figure(
        nrows, ncols, row_labels, col_labels, 2, cell=layout.GRID_CELL, title_inches=title_inches
    )
    limit = abs_max(matrices) if vmax is None else vmax
    for h in range(heads):
        r, c = divmod(h, ncols)
        bottom_of_column = h + ncols >= heads
        ax = figure.add_axes(panels[r][c])
        rows = row_labels if c == 0 else None
        _draw(ax, matrices[h], rows, col_labels if bottom_of_column else None, diverging, limit, size)
        ax.set_title(titles[h], fontsize=9)
    top = (0.02, 1 - 0.1 / figure.get_figheight())
    figure.add_artist(
        OutlinedTexts(
            [title], [top], figure.transFigure, size=10, ha="left", va="top", dpi=figure.dpi, gid=layout.TITLE_GID
        )
    )
    _colorbar(figure, colorbar, colorbar_label, limit, diverging)
    return figure


def cell_text(value: float) -> str:
    """A value printed in a grid cell, at most 6 characters: 2 decimals from 0.01 to 100, then whole numbers,
    one significant digit outside; blank for NaN.

    Example:
        >>> [cell_text(v) for v in (0.0, 0.4567, 12.345, 1234.5, 0.00123, float("nan"))]
        ['0', '0.46', '12.35', '1234', '0.001', '']
    """
    if not math.isfinite(value):
        return ""
    if value == 0:
        return "0"
    if 0.01 <= abs(value) < 100:
        return f"{value:.2f}"
    if 100 <= abs(value) < 10_000:
        return f"{value:.0f}"
    return f"{value:.0e}" if abs(value) >= 10_000 else f"{value:.1g}"


def cell_colours(mesh: QuadMesh, values: np.ndarray) -> list[str]:
    """Black on light cells, white on dark ones (by the cell colour's luma)."""
    rgb = mesh.cmap(mesh.norm(np.nan_to_num(values.ravel())))[:, :3]
    luma = rgb @ np.array([0.299, 0.587, 0.114])
    return ["black" if y > 0.5 else "white" for y in luma]


def value_grid(
    values: np.ndarray,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    title: str,
    colorbar_label: str,
    vmax: float | None = None,
    groups: Sequence[int] = (),
    axis_names: tuple[str, str] = ("attention module", "head"),
) -> Figure:
    """A grid of numbers, each cell coloured on a ``[0, vmax]`` scale with its value printed in it (black or
    white, whichever reads on the cell), and a colour bar: the layer × head view of one metric.

    Args:
        values: ``(R, C)``; NaN cells are blank.
        row_labels: ``R`` row labels.
        col_labels: ``C`` column labels.
        title: figure title.
        colorbar_label: what the colour and the numbers mean.
        vmax: top of the colour scale; :func:`abs_max` if None.
        groups: rows where a new group starts: a white line is drawn above each.
        axis_names: the (rows, columns) axis names.
    """
    figure, panels, colorbar, size = layout.grid_figure(
        1,
        1,
        row_labels,
        col_labels,
        1,
        cell=layout.CELL * 1.1,
        title_inches=layout.text_inches(title, 9) + 0.2
        if len(title) > layout.GRID_TITLE
        else layout.text_inches("x" * layout.GRID_TITLE, 9),
        title_at_panel=True,
        cell_width=layout.CELL * 2,
        min_cells=1,
    )
    limit = abs_max(values) if vmax is None else vmax
    ax = figure.add_axes(panels[0][0])
    mesh = _draw(ax, values, row_labels, col_labels, False, limit, size, axis_names, col_rotation=0)
    for row in groups:
        ax.axhline(row, color="white", linewidth=2.5)
    rows, cols = np.indices(values.shape)
    numbers = OutlinedTexts(
        [cell_text(float(value)) for value in values.ravel()],
        np.column_stack([cols.ravel() + 0.5, rows.ravel() + 0.5]),  # cell (i, j) spans [j, j+1] x [i, i+1]
        ax.transData,
        size=size,
        va="ink",  # a number's digits centred in its cell
        dpi=figure.dpi,
        facecolors=cell_colours(mesh, values),
        zorder=3,
        gid=layout.CELL_GID,
    )
    ax.add_collection(numbers, autolim=False)
    _title(ax, title)
    _colorbar(figure, colorbar, colorbar_label, limit, False)
    return figure
