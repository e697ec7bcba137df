"""Renders figures to RGB arrays, reusing a drawn figure for every render of the same layout: only the parts that
change (cells, colour-bar numbers and label, title, a value grid's numbers) are redrawn on its kept background."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import QuadMesh
from matplotlib.figure import Figure

from attn_callbacks.output.figure_layout import (
    BAR_GID,
    BAR_LABEL_GID,
    CELL_GID,
    GRID_TITLE,
    TICK_GID,
    TITLE_GID,
    title_sets_width,
)
from attn_callbacks.output.figures import (
    abs_max,
    bar_label_place,
    bar_labels,
    cell_colours,
    cell_text,
    head_grid,
    heatmap,
    value_grid,
)
from attn_callbacks.output.text_outlines import OutlinedTexts

__all__ = ["FigureCache"]


class FigureCache:
    """Renders heatmaps to RGB arrays, reusing a figure for every render of the same layout.

    The first render of a layout (figure size, labels, panel titles, colour map) draws the whole figure and keeps the
    pixels of everything but the colour cells, the colour bar's numbers and label, the title and a value grid's
    numbers. Later renders of that layout, for any tag, set the new data, colour scale and texts and redraw those
    parts on top: the pixels equal a fresh render's. Tick labels are most of matplotlib's drawing time, so the
    heatmaps of every layer of a model (the same tokens on their axes, another title) cost one full drawing, not one
    each; so do a layer's diverging maps (asymmetry, lift, drift), whose titles differ in length only, as long as a
    title is narrower than the panel and colour bar (a wider one widens the figure: a layout of its own).

    Args:
        max_bytes: the most memory the kept figures may take (two RGBA buffers each, and about one more of
            matplotlib's objects); the least recently used layouts are dropped to stay under it.
    """

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple, _Kept] = OrderedDict()  # least recently used first
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
    ) -> np.ndarray:
        """:func:`heatmap` of ``matrix`` as an ``(H, W, 4)`` uint8 array with an opaque alpha channel: a plain copy of
        the canvas, many times faster than leaving the channel out; :func:`png_bytes` drops it."""
        # The title's length where it sets the figure's width; else every family's map shares one figure.
        room = len(title) if title_sets_width(title, row_labels, col_labels) else 0
        layout = ("heatmap", matrix.shape, tuple(row_labels), tuple(col_labels), room, diverging)
        limit = abs_max(matrix) if vmax is None else vmax
        return self._render(
            layout,
            _Texts(title, colorbar_label),
            [matrix],
            limit,
            diverging,
            lambda: heatmap(matrix, row_labels, col_labels, title, colorbar_label, diverging, vmax=limit),
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
    ) -> np.ndarray:
        """:func:`head_grid` of ``matrices`` as an ``(H, W, 4)`` uint8 array, as :meth:`heatmap`."""
        layout = (
            "grid",
            matrices.shape,
            tuple(row_labels),
            tuple(col_labels),
            len(title) if title_sets_width(title, row_labels, col_labels, heads=len(matrices)) else 0,
            tuple(titles or ()),
            diverging,
        )
        limit = abs_max(matrices) if vmax is None else vmax
        return self._render(
            layout,
            _Texts(title, colorbar_label),
            list(matrices),
            limit,
            diverging,
            lambda: head_grid(matrices, row_labels, col_labels, title, colorbar_label, titles, diverging, limit),
        )

    def value_grid(
        self,
        values: np.ndarray,
        row_labels: Sequence[str],
        col_labels: Sequence[str],
        title: str,
        colorbar_label: str,
        vmax: float | None = None,
        groups: Sequence[int] = (),
        axis_names: tuple[str, str] = ("attention module", "head"),
    ) -> np.ndarray:
        """:func:`value_grid` of ``values`` as an ``(H, W, 4)`` uint8 array, as :meth:`heatmap`: the grids of every
        metric share one figure."""
        # Titles up to GRID_TITLE characters get the same room: every metric's grid shares one figure.
        room = max(len(title), GRID_TITLE)
        layout = ("values", values.shape, tuple(row_labels), tuple(col_labels), room, tuple(groups), axis_names)
        limit = abs_max(values) if vmax is None else vmax
        cells = [cell_text(float(value)) for value in values.ravel()]
        return self._render(
            layout,
            _Texts(title, colorbar_label, cells),
            [values],
            limit,
            False,
            lambda: value_grid(values, row_labels, col_labels, title, colorbar_label, limit, groups, axis_names),
        )

    def _render(
        self,
        layout: tuple,
        texts: _Texts,
        panels: list[np.ndarray],
        limit: float,
        diverging: bool,
        build: Callable,
    ) -> np.ndarray:
        kept = self._entries.get(layout)
        if kept is None:
            kept = _Kept.of(build())
            # Canvas and background, RGBA, and about as much again in the figure's artists (measured: a process's
            # memory grew 1.55 times the two buffers' bytes).
            cost = 3 * 4 * int(kept.figure.bbox.width) * int(kept.figure.bbox.height)
            if cost <= self.max_bytes:  # a figure larger than the cap is drawn afresh each time, evicting nothing
                while self._entries and sum(self._bytes.values()) + cost > self.max_bytes:
                    del self._bytes[self._entries.popitem(last=False)[0]]
                self._entries[layout], self._bytes[layout] = kept, cost
        else:
            self._entries.move_to_end(layout)
            numbers = bar_labels(limit, diverging)
            for mesh, matrix in zip(kept.meshes, panels, strict=True):
                mesh.set_array(matrix)
                mesh.set_clim(-limit if diverging else 0.0, limit)
            kept.numbers.set_texts(numbers)
            kept.heading.set_texts([texts.title])
            kept.label.set_texts([texts.colorbar_label])
            kept.label.set_offset_transform(bar_label_place(kept.label.axes, numbers))
            if kept.cells is not None:
                kept.cells.set_texts(texts.cells)
                kept.cells.set_facecolor(cell_colours(kept.meshes[0], panels[0]))
            kept.canvas.restore_region(kept.background)
        figure = kept.figure
        for mesh in kept.meshes:
            figure.draw_artist(mesh)
            for artist in _overlays(mesh):  # over the cells, as in a full draw
                figure.draw_artist(artist)
        cells = [] if kept.cells is None else [kept.cells]
        for artist in [*cells, kept.numbers, kept.heading, kept.label]:
            figure.draw_artist(artist)
        pixels = np.asarray(kept.canvas.buffer_rgba())  # (H, W, 4), the canvas' own buffer: copied before it is reused
        return pixels.copy()


@dataclass
class _Texts:
    """The texts of one render that a kept figure redraws: its title, colour bar label and cell numbers."""

    title: str
    colorbar_label: str
    cells: list[str] = field(default_factory=list)


@dataclass
class _Kept:
    """A drawn figure and the artists :class:`FigureCache` redraws on its kept background."""

    figure: Figure
    canvas: FigureCanvasAgg
    meshes: list[QuadMesh]
    numbers: OutlinedTexts  # the colour bar's
    heading: OutlinedTexts
    label: OutlinedTexts  # the colour bar's
    cells: OutlinedTexts | None  # a value grid's numbers, row by row
    background: Any

    @classmethod
    def of(cls, figure: Figure) -> _Kept:
        """Draw ``figure`` without the parts that change, keep those pixels, and draw it whole."""
        words = {text.get_gid(): text for text in figure.findobj(OutlinedTexts)}
        numbers, heading, label = words[BAR_GID], words[TITLE_GID], words[BAR_LABEL_GID]
        cells = words.get(CELL_GID)
        meshes = [mesh for ax in figure.axes[:-1] for mesh in ax.collections if isinstance(mesh, QuadMesh)]
        overlays = [artist for mesh in meshes for artist in _overlays(mesh)]
        for artist in [*meshes, *overlays, numbers, heading, label, *([] if cells is None else [cells])]:
            artist.set_animated(True)  # left out of the full draw: the kept background has none of them
        canvas = FigureCanvasAgg(figure)
        canvas.draw()
        return cls(figure, canvas, meshes, numbers, heading, label, cells, canvas.copy_from_bbox(figure.bbox))


def _overlays(mesh: QuadMesh) -> list[Any]:
    """What a full draw puts over a panel's cells: its lines (a value grid's group lines) and spines, not its tick
    marks (outside the panel, part of the kept background)."""
    lines = [line for line in mesh.axes.lines if line.get_gid() != TICK_GID]
    return [*lines, *mesh.axes.spines.values()]
