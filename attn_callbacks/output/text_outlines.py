"""Texts drawn as glyph outlines: one :class:`OutlinedTexts` collection per group of labels, numbers or a title.

Matplotlib lays out and rasterises every ``Text`` on every draw (~1.5 ms each), and every tick label also costs a
``Tick`` object to create (~4 ms): for a heatmap's 60 token labels and the few texts a cached figure redraws, most of
an epoch's drawing time. An outline is made once per string and size (~0.6 ms) and kept; a collection of them draws
in one call, at the pixels of the figure's own transforms.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np
from matplotlib import transforms
from matplotlib.collections import PathCollection
from matplotlib.font_manager import FontProperties
from matplotlib.path import Path
from matplotlib.textpath import text_to_path

__all__ = ["OutlinedTexts", "outline"]

_FONT = FontProperties()  # the default font, as Text uses; a prop given: no font lookup per outline
_MAX_OUTLINES = 8192  # the most recently used kept (~2 KB an outline): token labels and numbers repeat
_LINE: dict[float, tuple[float, float]] = {}  # font size -> (height above the baseline, descent) of a line


def _line(size: float) -> tuple[float, float]:
    """The ascent and descent of a line of text at ``size`` points, as matplotlib measures a line ("lp")."""
    if size not in _LINE:
        _, height, descent = text_to_path.get_text_width_height_descent("lp", FontProperties(size=size), False)
        _LINE[size] = (height - descent, descent)
    return _LINE[size]


def outline(text: str, size: float, ha: str = "center", va: str = "center", rotation: float = 0.0) -> Path:
    """``text`` at ``size`` points as a path in points, rotated by ``rotation`` degrees and placed so that its
    ``(ha, va)`` anchor is at ``(0, 0)``: as matplotlib aligns a ``Text`` (the rotated box of the line, from the
    start of the text to its last glyph and from the font's descent to its ascent). ``va="ink"`` centres the
    glyphs' own box instead (a number in a cell). Cached."""
    # Every argument given: the cache keys calls by how they pass their arguments, and outline(t, 8, "left") would
    # make again what outline(t, 8, "left", "center", 0.0) made (a colour bar's numbers, measured then drawn).
    return _outline(text, float(size), ha, va, float(rotation))


@lru_cache(maxsize=_MAX_OUTLINES)
def _outline(text: str, size: float, ha: str, va: str, rotation: float) -> Path:
    # As TextPath lays it out, which fails on a text without any outline (a space, say): those are empty paths.
    vertices, codes = text_to_path.get_text_path(_FONT, text) if text else ([], [])
    if not len(vertices):
        path = Path(np.zeros((0, 2)))
    else:
        glyphs = Path(np.asarray(vertices) * (size / text_to_path.FONT_SCALE), codes)
        # The control points' box: exact enough, and Path.get_extents solves every curve's extrema (far slower).
        (left, low), (right, high) = glyphs.vertices.min(axis=0), glyphs.vertices.max(axis=0)
        if va != "ink":  # the line's box: texts of one collection line up whatever their glyphs
            (left, right), (high, low) = (0.0, right), _line(size)
            low = -low
        turn = transforms.Affine2D().rotate_deg(rotation)
        corners = turn.transform([(left, low), (right, low), (left, high), (right, high)])
        (x0, y0), (x1, y1) = corners.min(axis=0), corners.max(axis=0)
        x = {"left": x0, "center": (x0 + x1) / 2, "right": x1}[ha]
        y = {"bottom": y0, "center": (y0 + y1) / 2, "ink": (y0 + y1) / 2, "top": y1, "baseline": 0.0}[va]
        path = glyphs.transformed(turn.translate(-x, -y))
        path.should_simplify = False  # as TextPath: small glyphs keep every control point
    return path


class OutlinedTexts(PathCollection):
    """Texts of one size and alignment as outlines, each anchored at its offset: tick labels, a colour bar's
    numbers, a title. ``texts`` holds the strings (what a ``Text``'s ``get_text`` would give).

    Args:
        texts: the strings.
        offsets: ``(N, 2)`` anchor points, in ``offset_transform``'s coordinates.
        offset_transform: where the anchors live (``ax.transData``, ``ax.transAxes``, a blend of both ...).
        size: font size in points.
        ha, va: the anchor on each text's box: ``left``/``center``/``right``, ``bottom``/``center``/``top``/
            ``baseline``.
        rotation: degrees, counter-clockwise.
        shift: ``(x, y)`` points added to every anchor (a tick label's pad, say).
        dpi: the figure's, to draw points as pixels.
        **kwargs: :class:`~matplotlib.collections.PathCollection`'s (``gid``, ``zorder`` ...); ``facecolors``
            default black.
    """

    def __init__(
        self,
        texts: Sequence[str],
        offsets: Any,
        offset_transform: transforms.Transform,
        *,
        size: float,
        ha: str = "center",
        va: str = "center",
        rotation: float = 0.0,
        shift: tuple[float, float] = (0.0, 0.0),
        dpi: float = 100.0,
        **kwargs: Any,
    ) -> None:
        self._style = (size, ha, va, rotation)
        self.texts = list(texts)
        kwargs = {"facecolors": "black", "edgecolors": "none", "linewidths": 0, **kwargs}
        super().__init__(
            self._outlines(self.texts),
            offsets=np.asarray(offsets, dtype=float).reshape(-1, 2),
            offset_transform=offset_transform,
            transform=transforms.Affine2D().translate(*shift).scale(dpi / 72),  # outlines are in points
            **kwargs,
        )

    def _outlines(self, texts: Sequence[str]) -> list[Path]:
        return [outline(text, *self._style) for text in texts]

    def set_texts(self, texts: Sequence[str]) -> None:
        """New strings at the same anchors."""
        if len(texts) != len(self.texts):
            raise ValueError(f"Expected {len(self.texts)} texts for this collection's anchors, got {len(texts)}")
        self.texts = list(texts)
        self.set_paths(self._outlines(self.texts))

    def extents(self) -> list[transforms.Bbox]:
        """Each text's box in display pixels (its outline's control points), for layout checks."""
        anchors = self.get_offset_transform().transform(self.get_offsets())
        scale = self.get_transform()
        boxes = []
        for path, anchor in zip(self.get_paths(), anchors, strict=True):
            points = scale.transform(path.vertices) + anchor if len(path.vertices) else np.tile(anchor, (2, 1))
            boxes.append(transforms.Bbox([points.min(axis=0), points.max(axis=0)]))
        return boxes
