"""Matplotlib figures: labelled heatmaps and grids of them (the object API on the Agg canvas; pyplot untouched)."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from matplotlib import transforms
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import QuadMesh
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.text import Text

__all__ = ["FigureCache", "abs_max", "head_grid", "heatmap"]


# Fixed layout in inches, computed from the labels: matplotlib's constrained layout measures every tick label
# several times and was most of the cost of an epoch's images.
_CELL = 0.22  # inches per heatmap row or column
_CHAR = 0.6 / 72  # inches per character per point of font size (a generous average glyph width)
_TITLE = 0.45  # inches above an axes for its title
_AXIS_LABEL = 0.3  # inches for "query token (attending)" / "key token (attended to)"
_COLORBAR = 1.2  # inches right of the panels for the colour bar, its tick labels and its label
_BAR_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)  # where the colour bar is marked, as fractions of its height
_BAR_FONT = 8
_BAR_GID = "colour bar number"  # marks the colour bar's numbers, which FigureCache redraws
_TITLE_GID = "figure title"  # marks the title (it names the layer), which FigureCache redraws


def _font_size(rows: int, cols: int) -> int:
    return 7 if max(rows, cols) <= 30 else 5


def _label_inches(labels: Sequence[str], size: int) -> float:
    """Room for tick labels of this font size: the longest label, plus the tick."""
    return max((len(label) for label in labels), default=1) * size * _CHAR + 0.1


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
) -> QuadMesh:
    """One heatmap on ``ax`` with colour scale ``[0, limit]`` (``[-limit, limit]`` when ``diverging``), row 0 at the
    top; tick labels only for the axes given (``None``: no ticks, as for inner grid panels).

    Cells are a mesh of flat quads, not an image: matplotlib resamples an image to the output pixels and colour-maps
    every pixel, ~4× slower at 30 × 30 cells (measured). NaN cells are left blank: matplotlib masks invalid values
    when the mesh is made and at every ``set_array``.
    """
    norm = TwoSlopeNorm(0.0, -limit, limit) if diverging else None
    vmin, vmax = (None, None) if diverging else (0.0, limit)
    mesh = ax.pcolormesh(matrix, cmap=_cmap(diverging), norm=norm, vmin=vmin, vmax=vmax, antialiased=False, snap=True)
    ax.invert_yaxis()
    if cols is None:
        ax.set_xticks([])
    else:
        ax.set_xticks(np.arange(len(cols)) + 0.5, cols, rotation=90, fontsize=size)  # cell j spans [j, j + 1]
        ax.set_xlabel("key token (attended to)", fontsize=8)
    if rows is None:
        ax.set_yticks([])
    else:
        ax.set_yticks(np.arange(len(rows)) + 0.5, rows, fontsize=size)
        ax.set_ylabel("query token (attending)", fontsize=8)
    return mesh


def _bar_labels(limit: float, diverging: bool) -> list[str]:
    """The numbers at :data:`_BAR_FRACTIONS` of a colour bar over ``[0, limit]`` (``[-limit, limit]``)."""
    # 2f - 1 and f are exact, so the diverging bar's numbers are symmetric about 0.
    return [f"{limit * (2 * fraction - 1 if diverging else fraction):.3g}" for fraction in _BAR_FRACTIONS]


def _colorbar(
    figure: Figure, rect: tuple[float, float, float, float], label: str, limit: float, diverging: bool
) -> None:
    """A colour bar in ``rect`` (figure fractions), marked at :data:`_BAR_FRACTIONS` of its scale, the top mark
    reading ``limit``.

    Its gradient, marks and label do not depend on the scale (both scales map their range linearly onto the colour
    map), only the five numbers do: :class:`FigureCache` keeps the rest and redraws those. Matplotlib's own colour bar
    places "nice" ticks and its label after measuring every tick label, which was most of a cached redraw's time.
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
    ax.yaxis.tick_right()
    ax.set_yticks(_BAR_FRACTIONS, [""] * len(_BAR_FRACTIONS))
    pad = transforms.offset_copy(ax.transAxes, figure, x=6, units="points")  # past the tick marks
    for fraction, text in zip(_BAR_FRACTIONS, _bar_labels(limit, diverging), strict=True):
        ax.text(1.0, fraction, text, transform=pad, fontsize=_BAR_FONT, va="center", gid=_BAR_GID)
    # A fixed place, right of the longest number .3g writes ("-1.23e+100"), so it never moves with the scale.
    right = transforms.offset_copy(ax.transAxes, figure, x=8 + 10 * _BAR_FONT * _CHAR * 72, units="points")
    ax.text(1.0, 0.5, label, transform=right, rotation=90, fontsize=_BAR_FONT, va="center", ha="left")


def _text_inches(text: str, size: int) -> float:
    return len(text) * size * _CHAR


def abs_max(matrix: np.ndarray) -> float:
    """Largest finite absolute value, at least a tiny positive number: the default top of a colour scale (NaN cells
    are drawn blank)."""
    finite = np.abs(matrix[np.isfinite(matrix)])
    return max(float(finite.max()) if finite.size else 0.0, 1e-12)


def _grid_figure(
    nrows: int,
    ncols: int,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    title_lines: int,
    cell: float = _CELL,
    title_inches: float = 0.0,
    title_at_panel: bool = False,
) -> tuple[Figure, list[list[tuple[float, float, float, float]]], tuple[float, float, float, float], int]:
    """A figure sized for ``nrows × ncols`` heatmap panels, the panels' rectangles and the colour bar's (figure
    fractions), and the tick font size. One row (column) of cells is at least as tall (wide) as a tick label's font,
    so labels never overlap; the figure is at least as wide as its title, so the layer name is never cut."""
    size = _font_size(len(row_labels), len(col_labels))
    panel_w, panel_h = cell * max(len(col_labels), 8), cell * max(len(row_labels), 8)
    left = _label_inches(row_labels, size) + _AXIS_LABEL
    bottom = _label_inches(col_labels, size) + _AXIS_LABEL
    gap_w, gap_h = 0.2, _TITLE
    top = _TITLE * title_lines
    panels_right = left + ncols * panel_w + (ncols - 1) * gap_w
    # The title starts at the panel's left edge (one heatmap) or near the figure's (a grid's suptitle).
    width = max(panels_right + _COLORBAR, title_inches + (left if title_at_panel else 0))
    height = bottom + nrows * panel_h + (nrows - 1) * gap_h + top
    panels = [
        [
            (
                (left + c * (panel_w + gap_w)) / width,
                (bottom + (nrows - 1 - r) * (panel_h + gap_h)) / height,
                panel_w / width,
                panel_h / height,
            )
            for c in range(ncols)
        ]
        for r in range(nrows)
    ]
    panels_height = nrows * panel_h + (nrows - 1) * gap_h
    colorbar = ((panels_right + 0.15) / width, bottom / height, 0.15 / width, panels_height / height)
    return Figure(figsize=(width, height), dpi=100), panels, colorbar, size


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
    figure, panels, colorbar, size = _grid_figure(
        1, 1, row_labels, col_labels, 1, title_inches=_text_inches(title, 9) + 0.2, title_at_panel=True
    )
    limit = abs_max(matrix) if vmax is None else vmax
    ax = figure.add_axes(panels[0][0])
    _draw(ax, matrix, row_labels, col_labels, diverging, limit, size)
    ax.set_title(title, fontsize=9, loc="left", gid=_TITLE_GID)
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
        vmax: top of the shared colour scale (symmetric limit when diverging); the largest value if None.
    """
    heads = matrices.shape[0]
    titles = [f"head {h}" for h in range(heads)] if titles is None else list(titles)
    ncols = min(heads, 4)
    nrows = math.ceil(heads / ncols)
    title_inches = _text_inches(title, 10) + 0.4
    figure, panels, colorbar, size = _grid_figure(
        nrows, ncols, row_labels, col_labels, 2, cell=_CELL * 0.75, title_inches=title_inches
    )
    limit = abs_max(matrices) if vmax is None else vmax
    for h in range(heads):
        r, c = divmod(h, ncols)
        bottom_of_column = h + ncols >= heads
        ax = figure.add_axes(panels[r][c])
        rows = row_labels if c == 0 else None
        _draw(ax, matrices[h], rows, col_labels if bottom_of_column else None, diverging, limit, size)
        ax.set_title(titles[h], fontsize=9)
    figure.suptitle(title, fontsize=10, x=0.02, ha="left", y=1 - 0.1 / figure.get_figheight(), va="top", gid=_TITLE_GID)
    _colorbar(figure, colorbar, colorbar_label, limit, diverging)
    return figure


class FigureCache:
    """Renders heatmaps to RGB arrays, reusing a figure for every render of the same layout.

    The first render of a layout (figure size, labels, panel titles, colour map) draws the whole figure and keeps the
    pixels of everything but the colour cells, the colour bar's numbers and the title. Later renders of that layout,
    for any tag, only set the new data, colour scale and title and redraw those parts on top: the pixels equal a fresh
    render's. Tick labels are most of matplotlib's drawing time, so the heatmaps of every layer of a model (the same
    tokens on their axes, another title) cost one full drawing, not one each.

    Args:
        max_bytes: the most memory the kept figures may take (two RGBA buffers each); the least recently used layouts
            are dropped to stay under it.
    """

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        # layout -> (figure, canvas, meshes, numbers, title, background), least recently used first
        self._entries: OrderedDict[tuple, tuple[Figure, FigureCanvasAgg, list, list, Any, Any]] = OrderedDict()
        self._bytes: dict[tuple, int] = {}

    def heatmap(
        self,
        matrix: np.ndarray,
        row_labels: Sequence[str],
        col_labels: Sequence[str],
        title: str,
        colorbar_label: str,
        diverging: bool = False,
        vmax: float | None = None,
        alpha: bool = False,
    ) -> np.ndarray:
        """:func:`heatmap` of ``matrix`` as an ``(H, W, 3)`` uint8 array (``(H, W, 4)`` with an opaque alpha channel
        when ``alpha``: a plain copy of the canvas, many times faster than leaving the channel out; :func:`png_bytes`
        drops it)."""
        # The title's length, not its text: it sets the figure's width.
        layout = ("heatmap", matrix.shape, tuple(row_labels), tuple(col_labels), len(title), colorbar_label, diverging)
        limit = abs_max(matrix) if vmax is None else vmax
        return self._render(
            layout,
            title,
            [matrix],
            limit,
            diverging,
            lambda: heatmap(matrix, row_labels, col_labels, title, colorbar_label, diverging, vmax=limit),
            alpha,
        )

    def head_grid(
        self,
        matrices: np.ndarray,
        row_labels: Sequence[str],
        col_labels: Sequence[str],
        title: str,
        colorbar_label: str,
        titles: Sequence[str] | None = None,
        diverging: bool = False,
        vmax: float | None = None,
        alpha: bool = False,
    ) -> np.ndarray:
        """:func:`head_grid` of ``matrices`` as an ``(H, W, 3)`` uint8 array (``(H, W, 4)`` when ``alpha``, as for
        :meth:`heatmap`)."""
        layout = (
            "grid",
            matrices.shape,
            tuple(row_labels),
            tuple(col_labels),
            len(title),
            colorbar_label,
            tuple(titles or ()),
            diverging,
        )
        limit = abs_max(matrices) if vmax is None else vmax
        return self._render(
            layout,
            title,
            list(matrices),
            limit,
            diverging,
            lambda: head_grid(matrices, row_labels, col_labels, title, colorbar_label, titles, diverging, limit),
            alpha,
        )

    def _render(
        self,
        layout: tuple,
        title: str,
        panels: list[np.ndarray],
        limit: float,
        diverging: bool,
        build: Callable,
        alpha: bool = False,
    ) -> np.ndarray:
        entry = self._entries.get(layout)
        if entry is None:
            figure = build()
            numbers = [text for text in figure.axes[-1].texts if text.get_gid() == _BAR_GID]  # the colour bar's
            heading = next(text for text in figure.findobj(Text) if text.get_gid() == _TITLE_GID)
            meshes = [mesh for ax in figure.axes[:-1] for mesh in ax.collections if isinstance(mesh, QuadMesh)]
            spines = [spine for mesh in meshes for spine in mesh.axes.spines.values()]
            for artist in [*meshes, *spines, *numbers, heading]:
                artist.set_animated(True)  # left out of the full draw: the kept background has no data in it
            canvas = FigureCanvasAgg(figure)
            canvas.draw()
            entry = (figure, canvas, meshes, numbers, heading, canvas.copy_from_bbox(figure.bbox))
            cost = 2 * 4 * int(figure.bbox.width) * int(figure.bbox.height)  # canvas and background, RGBA
            if cost <= self.max_bytes:  # a figure larger than the cap is drawn afresh each time, evicting nothing
                while self._entries and sum(self._bytes.values()) + cost > self.max_bytes:
                    del self._bytes[self._entries.popitem(last=False)[0]]
                self._entries[layout], self._bytes[layout] = entry, cost
        else:
            self._entries.move_to_end(layout)
            figure, canvas, meshes, numbers, heading, background = entry
            for mesh, matrix in zip(meshes, panels, strict=True):
                mesh.set_array(matrix)
                mesh.set_clim(-limit if diverging else 0.0, limit)
            for text, number in zip(numbers, _bar_labels(limit, diverging), strict=True):
                text.set_text(number)
            heading.set_text(title)
            canvas.restore_region(background)
        figure, canvas, meshes, numbers, heading, _ = entry
        for mesh in meshes:
            figure.draw_artist(mesh)
            for spine in mesh.axes.spines.values():  # the frame goes over the cells, as in a full draw
                figure.draw_artist(spine)
        for text in [*numbers, heading]:
            figure.draw_artist(text)
        pixels = np.asarray(canvas.buffer_rgba())  # (H, W, 4), the canvas' own buffer: copied before it is reused
        return pixels.copy() if alpha else pixels[..., :3].copy()
