"""The layout of the figures in :mod:`attn_callbacks.output.figures`, in inches computed from the labels (matplotlib's
constrained layout measures every tick label several times and was most of the cost of an epoch's images), and the
gids that mark the parts :class:`~attn_callbacks.output.figure_cache.FigureCache` redraws."""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure

__all__ = [
    "AXIS_LABEL",
    "BAR_GID",
    "BAR_LABEL_GID",
    "CELL",
    "CELL_GID",
    "CHAR",
    "COLORBAR",
    "COL_GID",
    "GAP",
    "GRID_CELL",
    "GRID_COLUMNS",
    "GRID_TITLE",
    "MIN_CELLS",
    "ROW_GID",
    "TICK_GID",
    "TITLE",
    "TITLE_GID",
    "font_size",
    "grid_figure",
    "grid_title",
    "heatmap_title",
    "label_inches",
    "text_inches",
    "title_sets_width",
    "widths",
]

CELL = 0.22  # inches per heatmap row or column
GRID_CELL = CELL * 0.75  # ... in a grid of heads' panels
GRID_COLUMNS = 4  # panels a row of a head grid holds
MIN_CELLS = 8  # a heatmap panel is at least this many cells each way
GAP = 0.2  # inches between the panels of a grid
CHAR = 0.6 / 72  # inches per character per point of font size (a generous average glyph width)
TITLE = 0.45  # inches above an axes for its title
AXIS_LABEL = 0.3  # inches for "query token (attending)" / "key token (attended to)"
COLORBAR = 1.2  # inches right of the panels for the colour bar, its tick labels and its label
BAR_GID = "colour bar number"  # marks the colour bar's numbers, which FigureCache redraws
BAR_LABEL_GID = "colour bar label"  # marks the colour bar's label, placed beside its numbers
CELL_GID = "cell value"  # marks the numbers printed in a value grid's cells
ROW_GID, COL_GID = "row labels", "column labels"  # mark a heatmap's tick labels
TICK_GID = "tick marks"  # drawn once with the layout, unlike the axes' other lines
GRID_TITLE = 48  # characters of title a value grid always has room for
TITLE_GID = "figure title"  # marks the title (it names the layer), which FigureCache redraws


def font_size(rows: int, cols: int) -> int:
    return 7 if max(rows, cols) <= 30 else 5


def label_inches(labels: Sequence[str], size: int) -> float:
    """Room for tick labels of this font size: the longest label, plus the tick."""
    return max((len(label) for label in labels), default=1) * size * CHAR + 0.1


def text_inches(text: str, size: int) -> float:
    return len(text) * size * CHAR


def grid_figure(
    nrows: int,
    ncols: int,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    title_lines: int,
    cell: float = CELL,
    title_inches: float = 0.0,
    title_at_panel: bool = False,
    cell_width: float | None = None,
    min_cells: int = MIN_CELLS,
) -> tuple[Figure, list[list[tuple[float, float, float, float]]], tuple[float, float, float, float], int]:
    """A figure sized for ``nrows × ncols`` heatmap panels, the panels' rectangles and the colour bar's (figure
    fractions), and the tick font size. One row (column) of cells is at least as tall (wide) as a tick label's font,
    so labels never overlap; the figure is at least as wide as its title, so the layer name is never cut. Cells are
    ``cell`` inches high and ``cell_width`` (default ``cell``) wide, a panel at least ``min_cells`` each way."""
    size = font_size(len(row_labels), len(col_labels))
    cell_w = cell if cell_width is None else cell_width
    left, panel_w, panels_right, title_right = widths(
        ncols, row_labels, col_labels, cell_w, min_cells, title_inches, title_at_panel
    )
    panel_h = cell * max(len(row_labels), min_cells)
    bottom = label_inches(col_labels, size) + AXIS_LABEL
    gap_w, gap_h = GAP, TITLE
    top = TITLE * title_lines
    width = max(panels_right + COLORBAR, title_right)
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


def widths(
    ncols: int,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    cell_w: float,
    min_cells: int,
    title_inches: float,
    title_at_panel: bool,
) -> tuple[float, float, float, float]:
    """Inches across a grid figure: the left margin (tick labels and axis name), a panel's width, and from the
    figure's left edge to the panels' right edge and to the title's (which starts at the panel's left edge for one
    heatmap, near the figure's for a grid's suptitle)."""
    left = label_inches(row_labels, font_size(len(row_labels), len(col_labels))) + AXIS_LABEL
    panel_w = cell_w * max(len(col_labels), min_cells)
    panels_right = left + ncols * panel_w + (ncols - 1) * GAP
    return left, panel_w, panels_right, title_inches + (left if title_at_panel else 0)


def heatmap_title(title: str) -> float:
    return text_inches(title, 9) + 0.2


def grid_title(title: str) -> float:
    return text_inches(title, 10) + 0.4


def title_sets_width(title: str, row_labels: Sequence[str], col_labels: Sequence[str], heads: int = 0) -> bool:
    """Whether a :func:`heatmap`'s (``heads`` 0) or :func:`head_grid`'s figure is as wide as its title needs rather
    than as its panels and colour bar: only then does the title's length change the figure's layout."""
    if heads:  # head_grid's panels and title
        ncols, cell_w, title_inches, at_panel = min(heads, GRID_COLUMNS), GRID_CELL, grid_title(title), False
    else:  # heatmap's
        ncols, cell_w, title_inches, at_panel = 1, CELL, heatmap_title(title), True
    _, _, panels_right, title_right = widths(ncols, row_labels, col_labels, cell_w, MIN_CELLS, title_inches, at_panel)
    return title_right > panels_right + COLORBAR
