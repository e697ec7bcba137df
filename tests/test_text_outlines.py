import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.textpath import TextPath

from attn_callbacks.output.text_outlines import OutlinedTexts, outline


@pytest.mark.parametrize(
    ("ha", "va", "rotation"),
    [("left", "baseline", 0), ("right", "center", 0), ("center", "top", 90), ("left", "center", 90)],
)
def test_words_sit_where_matplotlib_puts_the_same_text(ha, va, rotation):
    figure = Figure(figsize=(4, 3), dpi=100)
    ax = figure.add_axes((0.2, 0.2, 0.6, 0.6))
    texts = ["tok", "query", "Ag|y"]
    anchors = np.array([[0.2, 0.3], [0.5, 0.5], [0.8, 0.7]])
    words = OutlinedTexts(texts, anchors, ax.transAxes, size=9, ha=ha, va=va, rotation=rotation, dpi=figure.dpi)
    ax.add_collection(words, autolim=False)
    reference = [
        ax.text(x, y, text, transform=ax.transAxes, fontsize=9, ha=ha, va=va, rotation=rotation)
        for text, (x, y) in zip(texts, anchors, strict=True)
    ]
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    for ours, theirs in zip(words.extents(), reference, strict=True):
        box = theirs.get_window_extent(canvas.get_renderer())
        # Matplotlib's box is the line's (advance and line height); ours is the ink's control points: the ink
        # lies inside the line's box, and the anchors agree to a pixel or two.
        assert box.x0 - 2 <= ours.x0 and ours.x1 <= box.x1 + 2 and box.y0 - 2 <= ours.y0 and ours.y1 <= box.y1 + 2
        along = 1 if rotation else 0  # the text's length: the same to a couple of pixels
        assert abs((ours.x1 - ours.x0, ours.y1 - ours.y0)[along] - (box.width, box.height)[along]) < 3


def test_outline_is_cached_and_centred_on_its_ink_for_numbers():
    path = outline("0.25", 7, "center", "ink")
    assert outline("0.25", 7, "center", "ink") is path
    low, high = path.vertices.min(axis=0), path.vertices.max(axis=0)
    np.testing.assert_allclose((low + high) / 2, 0, atol=1e-9)
    assert len(outline("", 7).vertices) == 0
    assert len(outline(" ", 7).vertices) == 0 and len(outline("\u200b", 7, "left", "top", 90).vertices) == 0
    # the same outline as matplotlib's TextPath, shifted by the anchor
    glyphs = TextPath((0, 0), "0.25", size=7).vertices
    np.testing.assert_allclose(path.vertices - path.vertices.min(axis=0), glyphs - glyphs.min(axis=0), atol=1e-9)


def test_set_texts_replaces_the_strings_and_refuses_another_count():
    figure = Figure(dpi=100)
    ax = figure.add_axes((0, 0, 1, 1))
    words = OutlinedTexts(["a", "b"], [[0.1, 0.1], [0.5, 0.5]], ax.transAxes, size=8, dpi=figure.dpi)
    words.set_texts(["0.5", "1"])
    assert words.texts == ["0.5", "1"] and words.get_paths()[0] is outline("0.5", 8, "center", "center", 0.0)
    with pytest.raises(ValueError, match="Expected 2 texts for this collection's anchors, got 3"):
        words.set_texts(["a", "b", "c"])
