"""Matrices -> labelled heatmap images (matplotlib's object API on the Agg canvas; pyplot's global state untouched)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure

__all__ = ["TokenLabels", "figure_to_array", "head_grid", "heatmap", "label_tokens", "markdown_table"]

TokenLabels = Sequence[str] | Mapping[int, str] | Callable[[int], str] | None

MAX_LABEL = 14


def label_tokens(ids: Sequence[int], id_to_token: TokenLabels = None, max_length: int | None = MAX_LABEL) -> list[str]:
    """Readable labels for token ids: from a list, dict or callable, else the id itself.

    Args:
        ids: token ids.
        id_to_token: a list, dict or callable id -> str; ids are used where it has no entry (or when None).
        max_length: longer labels are trimmed to this many characters, ending in "…"; None keeps them whole.

    Example:
        >>> label_tokens([0, 2], ["<pad>", "the", "a-very-long-word-piece"])
        ['<pad>', 'a-very-long-w…']
    """
    labels = []
    for token in ids:
        if id_to_token is None:
            text = str(token)
        elif callable(id_to_token) and not isinstance(id_to_token, (Mapping, Sequence)):
            text = str(id_to_token(token))
        elif isinstance(id_to_token, Mapping):
            text = str(id_to_token.get(token, token))
        else:
            text = str(id_to_token[token]) if 0 <= token < len(id_to_token) else str(token)
        text = text.replace("\n", "\\n") or repr(text)
        labels.append(text if max_length is None or len(text) <= max_length else text[: max_length - 1] + "…")
    return labels


def _draw(ax, matrix: np.ndarray, rows: Sequence[str], cols: Sequence[str], diverging: bool, vmax: float | None):
    if diverging:
        limit = vmax if vmax is not None else _abs_max(matrix)
        image = ax.imshow(
            matrix, cmap="RdBu_r", norm=TwoSlopeNorm(0.0, -limit, limit), aspect="auto", interpolation="nearest"
        )
    else:
        image = ax.imshow(matrix, cmap="viridis", vmin=0.0, vmax=vmax, aspect="auto", interpolation="nearest")
    size = 7 if max(len(rows), len(cols)) <= 30 else 5
    ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=size)
    ax.set_yticks(range(len(rows)), rows, fontsize=size)
    ax.set_xlabel("key token (attended to)")
    ax.set_ylabel("query token (attending)")
    return image


def _abs_max(matrix: np.ndarray) -> float:
    """Largest finite absolute value (NaN cells are drawn blank), at least a tiny positive number."""
    finite = np.abs(matrix[np.isfinite(matrix)])
    return max(float(finite.max()) if finite.size else 0.0, 1e-12)


def _figsize(rows: int, cols: int) -> tuple[float, float]:
    return 2.5 + 0.22 * max(cols, 8), 2.0 + 0.22 * max(rows, 8)


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
    figure = Figure(figsize=_figsize(len(row_labels), len(col_labels)), dpi=100, layout="constrained")
    ax = figure.add_subplot()
    image = _draw(ax, matrix, row_labels, col_labels, diverging, vmax)
    ax.set_title(title, fontsize=9)
    figure.colorbar(image, ax=ax, label=colorbar_label, shrink=0.8)
    return figure


def head_grid(
    matrices: np.ndarray,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    title: str,
    colorbar_label: str,
    titles: Sequence[str] | None = None,
    diverging: bool = False,
) -> Figure:
    """Per-head heatmaps ``(H, R, C)`` in a grid sharing one colour scale, so heads compare by eye.

    Args:
        matrices: ``(H, R, C)``.
        row_labels: ``R`` query token labels.
        col_labels: ``C`` key token labels.
        title: figure title (name the layer).
        colorbar_label: what the colour means.
        titles: one title per panel; ``head 0``, ``head 1`` ... if None.
        diverging: a red/blue scale centred on 0.
    """
    heads = matrices.shape[0]
    titles = [f"head {h}" for h in range(heads)] if titles is None else list(titles)
    ncols = min(heads, 4)
    nrows = math.ceil(heads / ncols)
    width, height = _figsize(len(row_labels), len(col_labels))
    figure = Figure(figsize=(width * ncols * 0.8, height * nrows * 0.8), dpi=100, layout="constrained")
    axes = figure.subplots(nrows, ncols, squeeze=False)
    vmax = _abs_max(matrices)
    image = None
    for h, ax in enumerate(axes.flat):
        if h >= heads:
            ax.set_axis_off()
            continue
        image = _draw(ax, matrices[h], row_labels, col_labels, diverging, vmax)
        ax.set_title(titles[h], fontsize=9)
    figure.suptitle(title, fontsize=10)
    figure.colorbar(image, ax=axes, label=colorbar_label, shrink=0.6)
    return figure


def figure_to_array(figure: Figure) -> np.ndarray:
    """Render a figure to an ``(H, W, 3)`` uint8 RGB array (for ``SummaryWriter.add_image(..., dataformats="HWC")``)."""
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (TensorBoard's text plugin renders it); ``|`` in cells escaped."""

    def cell(value: object) -> str:
        text = f"{value:.3f}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|")

    lines = ["| " + " | ".join(map(cell, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
    return "\n".join(lines)
