import io
import itertools

import numpy as np
import pytest
from _reference import figure_to_array, words
from PIL import Image

from attn_callbacks.base.labels import label_tokens
from attn_callbacks.output import figure_cache, figure_layout, figures
from attn_callbacks.output.writer import png_bytes


def test_label_tokens_list_dict_callable_and_ids():
    assert label_tokens([0, 1, 9], ["a", "b"]) == ["a", "b", "9"]
    assert label_tokens([3], {3: "x|y"}) == ["x|y"]
    assert label_tokens([2], lambda i: f"t{i}") == ["t2"]
    assert label_tokens([5]) == ["5"]
    assert label_tokens([0], ["x" * 40])[0].endswith("…") and len(label_tokens([0], ["x" * 40])[0]) == 14


def test_heatmap_renders_labelled_rgb_image():
    matrix = np.array([[0.9, 0.1], [0.3, 0.7]])
    figure = figures.heatmap(matrix, ["the", "cat"], ["the", "cat"], "layer 0", "P")
    ax = figure.axes[0]
    assert ax.get_ylabel().startswith("query token") and ax.get_xlabel().startswith("key token")
    assert words(ax, figure_layout.ROW_GID).texts == words(ax, figure_layout.COL_GID).texts == ["the", "cat"]
    assert words(figure, figure_layout.TITLE_GID).texts == ["layer 0"]
    assert len(figure.axes) == 2  # the colour bar
    image = figure_to_array(figure)
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 4 and image.shape[0] > 100


def test_head_grid_and_diverging_map_render():
    grid = figures.head_grid(np.random.rand(3, 4, 4), list("abcd"), list("abcd"), "layer", "P")
    assert [ax.get_title() for ax in grid.axes[:3]] == ["head 0", "head 1", "head 2"]
    diverging = figures.heatmap(
        np.array([[0.0, 0.5], [-0.5, 0.0]]), ["a", "b"], ["a", "b"], "d", "P-Pt", diverging=True
    )
    assert figure_to_array(diverging).shape[2] == 4


def test_figure_cache_redraws_pixels_equal_to_a_fresh_render_respects_its_memory_cap():
    rng = np.random.default_rng(0)
    labels = [f"t{i}" for i in range(12)]
    cache = figure_cache.FigureCache()
    first, second = rng.random((12, 12)), 3 * rng.random((12, 12))
    assert np.array_equal(
        cache.heatmap(first, labels, labels, "T", "P"),
        figure_to_array(figures.heatmap(first, labels, labels, "T", "P")),
    )
    again = cache.heatmap(second, labels, labels, "T", "P")  # reused figure, new data and colour scale
    assert np.array_equal(again, figure_to_array(figures.heatmap(second, labels, labels, "T", "P")))
    # numbers of another width: the colour bar's label moves with them, as in a fresh render
    tiny_scale = cache.heatmap(first * 1e-5, labels, labels, "T", "another label")
    fresh = figure_to_array(figures.heatmap(first * 1e-5, labels, labels, "T", "another label"))
    assert np.array_equal(tiny_scale, fresh)
    # another layer's map (same tokens, another title of the same length): the same figure, its own title
    other_layer = cache.heatmap(second, labels, labels, "U", "P")
    assert np.array_equal(other_layer, figure_to_array(figures.heatmap(second, labels, labels, "U", "P")))
    assert not np.array_equal(other_layer, again) and len(cache._entries) == 1
    diverging = rng.standard_normal((12, 12))
    diverging[0, 0] = np.nan
    cache.heatmap(-diverging, labels, labels, "T", "P", diverging=True)
    assert np.array_equal(
        cache.heatmap(diverging, labels, labels, "T", "P", diverging=True),
        figure_to_array(figures.heatmap(diverging, labels, labels, "T", "P", diverging=True)),
    )
    heads = rng.random((3, 12, 12))
    cache.head_grid(heads[::-1], labels, labels, "G", "P")
    assert np.array_equal(
        cache.head_grid(heads, labels, labels, "H", "P"),
        figure_to_array(figures.head_grid(heads, labels, labels, "H", "P")),
    )
    # new labels: a new figure
    other = cache.heatmap(first, labels[::-1], labels, "T", "P")
    assert np.array_equal(other, figure_to_array(figures.heatmap(first, labels[::-1], labels, "T", "P")))
    assert len(cache._entries) == 4
    # a cap that holds two of these figures keeps the two used last
    cost = cache._bytes[next(layout for layout in cache._entries if layout[2] == tuple(labels[::-1]))]
    small = figure_cache.FigureCache(max_bytes=2 * cost)
    for rows in (labels, labels[::-1], labels[1:] + labels[:1]):
        small.heatmap(first, rows, labels, "T", "P")
    assert [layout[2] for layout in small._entries] == [tuple(labels[::-1]), tuple(labels[1:] + labels[:1])]
    assert sum(small._bytes.values()) <= 2 * cost
    tiny = figure_cache.FigureCache(max_bytes=0)  # nothing kept, still drawn right
    assert np.array_equal(tiny.heatmap(second, labels, labels, "T", "P"), again) and not tiny._entries
    many = [f"t{i}" for i in range(60)]
    small.heatmap(rng.random((60, 60)), many, many, "T", "P")  # larger than the whole cap: evicts nothing
    assert len(small._entries) == 2
    # the canvas' opaque alpha channel, which PNG encoding drops
    assert again.shape[2] == 4 and (again[..., 3] == 255).all()
    decoded = np.asarray(Image.open(io.BytesIO(png_bytes(again))))
    assert decoded.shape == (*again.shape[:2], 3) and np.array_equal(decoded, again[..., :3])


def test_maps_whose_titles_fit_above_the_panel_share_a_figure_equal_fresh_renders():
    """A title narrower than the panel and colour bar leaves the figure as it is: every family's map of a layer
    (asymmetry, lift, drift: titles of other lengths) is drawn in one figure. A longer title widens the figure: a
    figure of its own. Every render equals a fresh one."""
    rng = np.random.default_rng(2)
    labels = [f"t{i}" for i in range(12)]
    cache = figure_cache.FigureCache()
    titles = ["L0: P - Pᵀ", "L0: log2 lift over uniform", "L10: P now - P at epoch 0", "L0: " + "wide title " * 8]
    assert [figure_layout.title_sets_width(t, labels, labels) for t in titles] == [False, False, False, True]
    for title in titles:
        matrix = rng.standard_normal((12, 12))
        got = cache.heatmap(matrix, labels, labels, title, title[-5:], diverging=True)
        assert np.array_equal(got, figure_to_array(figures.heatmap(matrix, labels, labels, title, title[-5:], True)))
    assert len(cache._entries) == 2
    heads = rng.random((8, 12, 12))
    for title in ("L0: P per head", "L11: attention mass P per head"):
        got = cache.head_grid(heads, labels, labels, title, "P")
        assert np.array_equal(got, figure_to_array(figures.head_grid(heads, labels, labels, title, "P")))
    assert len(cache._entries) == 3


def _no_overlap(boxes, axis):
    spans = sorted((b.y0, b.y1) if axis == "y" else (b.x0, b.x1) for b in boxes)
    return all(end <= start + 0.01 for (_, end), (start, _) in itertools.pairwise(spans))


def _inside(figure, box):
    return box.x0 >= 0 and box.y0 >= 0 and box.x1 <= figure.bbox.width + 0.5 and box.y1 <= figure.bbox.height + 0.5


@pytest.mark.parametrize("n", [3, 30, 60])
def test_tick_labels_never_overlap_and_titles_fit_in_the_image(n):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    labels = label_tokens(range(n), [f"word-piece-{i}-with-a-long-tail" for i in range(n)])
    layer = "model.encoder.layer.11.attention.self"
    for figure in (
        figures.heatmap(np.random.rand(n, n), labels, labels, f"{layer}: attention mass P (mean of heads)", "P"),
        figures.head_grid(np.random.rand(6, n, n), labels, labels, f"{layer}: attention mass P per head", "P"),
    ):
        FigureCanvasAgg(figure).draw()
        renderer = figure.canvas.get_renderer()
        labelled = 0
        for ax in figure.axes[:-1]:  # the last axes is the colour bar
            for gid, axis in ((figure_layout.ROW_GID, "y"), (figure_layout.COL_GID, "x")):
                if not ax.findobj(lambda a, gid=gid: a.get_gid() == gid):
                    continue  # an inner panel of a grid
                drawn = words(ax, gid)
                assert drawn.texts == labels
                boxes = drawn.extents()
                assert _no_overlap(boxes, axis) and all(_inside(figure, box) for box in boxes)
                # the axis name sits beyond the labels, inside the image
                name = (ax.xaxis if axis == "x" else ax.yaxis).label.get_window_extent(renderer)
                assert _inside(figure, name)
                assert all(name.y1 <= box.y0 + 0.5 if axis == "x" else name.x1 <= box.x0 + 0.5 for box in boxes)
                labelled += 1
            if ax.get_title():
                assert _inside(figure, ax.title.get_window_extent(renderer))
        assert labelled >= 2
        (title,) = words(figure, figure_layout.TITLE_GID).extents()
        # the layer is never cut
        assert layer in words(figure, figure_layout.TITLE_GID).texts[0] and _inside(figure, title)


def test_given_vmax_fixes_the_colour_scale_and_the_cache_honours_it():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    labels = [f"t{i}" for i in range(10)]
    small, large = np.full((10, 10), 0.2), np.full((10, 10), 0.8)
    small[0, 0] = large[0, 0] = 0.2  # one cell with the same value in both
    a = figures.heatmap(small, labels, labels, "T", "P", vmax=1.0)
    b = figures.heatmap(large, labels, labels, "T", "P", vmax=1.0)
    assert a.axes[0].collections[0].get_clim() == (0.0, 1.0)
    pixels_a, pixels_b = figure_to_array(a), figure_to_array(b)
    ax = a.axes[0]
    FigureCanvasAgg(a).draw()
    x, y = ax.transData.transform((0.5, 0.5))  # centre of cell [0, 0]
    row, col = int(a.bbox.height - y), int(x)
    assert np.array_equal(pixels_a[row, col], pixels_b[row, col])  # same value, same colour
    assert not np.array_equal(pixels_a[row, col + 40], pixels_b[row, col + 40])  # 0.2 vs 0.8
    cache = figure_cache.FigureCache()
    cache.heatmap(large, labels, labels, "T", "P", vmax=2.0)
    again = cache.heatmap(small, labels, labels, "T", "P", vmax=1.0)
    assert np.array_equal(again, pixels_a)
    grid = figures.head_grid(np.stack([small, large]), labels, labels, "G", "P", vmax=3.0)
    assert all(ax.collections[0].get_clim() == (0.0, 3.0) for ax in grid.axes[:2])


@pytest.mark.parametrize("shape", [(1, 1, 3), (1, 7, 4), (9, 1, 3), (37, 53, 3), (40, 31, 4)])
def test_png_bytes_decode_to_the_same_pixels_for_any_size_and_noise(shape):
    image = np.random.default_rng(sum(shape)).integers(0, 256, shape, dtype=np.uint8)
    decoded = Image.open(io.BytesIO(png_bytes(image)))
    assert decoded.mode == "RGB" and decoded.size == (shape[1], shape[0])
    assert np.array_equal(np.asarray(decoded), image[..., :3])


@pytest.mark.parametrize("shape", [(1, 1, 4), (2, 5, 3), (37, 53, 4)])
def test_png_bytes_numba_filter_writes_the_bytes_of_the_numpy_one(shape, monkeypatch):
    image = np.random.default_rng(sum(shape)).integers(0, 256, shape, dtype=np.uint8)
    fast = png_bytes(image)
    monkeypatch.setenv("ATTN_CALLBACKS_NUMBA", "0")
    assert png_bytes(image) == fast


def test_png_bytes_of_a_heatmap_is_smaller_than_pillows_and_bad_images_are_refused():
    labels = [f"tok{i}" for i in range(30)]
    figure = figures.heatmap(np.random.default_rng(0).random((30, 30)), labels, labels, "T", "P")
    pixels = figure_to_array(figure)[..., :3]
    ours = png_bytes(pixels)
    theirs = io.BytesIO()
    Image.fromarray(pixels).save(theirs, format="PNG", compress_level=1)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(ours))), pixels)
    assert len(ours) < 1.25 * len(theirs.getvalue())  # about as small (their zlib build may differ from Python's)
    with pytest.raises(ValueError, match=r"`image` to be a non-empty \(H, W, 3\) or .* uint8 array, but got float32"):
        png_bytes(np.zeros((4, 4, 3), dtype=np.float32))
    with pytest.raises(ValueError, match=r"but got uint8 \(4, 4\)"):
        png_bytes(np.zeros((4, 4), dtype=np.uint8))
    with pytest.raises(ValueError, match=r"non-empty .* but got uint8 \(0, 4, 3\)"):
        png_bytes(np.zeros((0, 4, 3), dtype=np.uint8))


@pytest.mark.parametrize("diverging", [False, True])
def test_every_cell_has_its_values_colour_row_zero_at_the_top_and_nan_blank(diverging):
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    rows, cols = 5, 7
    matrix = np.arange(rows * cols, dtype=float).reshape(rows, cols) / (rows * cols)  # every cell a different value
    if diverging:
        matrix -= 0.5
    matrix[2, 3] = np.nan
    labels_r, labels_c = [f"q{i}" for i in range(rows)], [f"k{j}" for j in range(cols)]
    figure = figures.heatmap(matrix, labels_r, labels_c, "T", "P", diverging=diverging, vmax=0.5 if diverging else 1.0)
    pixels = figure_to_array(figure)[..., :3]
    FigureCanvasAgg(figure).draw()
    ax, height = figure.axes[0], figure.bbox.height
    cmap = colormaps["RdBu_r" if diverging else "viridis"]
    background = pixels[int(height - ax.transAxes.transform((0.5, 1.0))[1]) + 3, 3]  # the figure's white
    for i in range(rows):
        # Tick label i sits on row i: the query labels are in matrix order, top to bottom.
        assert words(ax, figure_layout.ROW_GID).texts[i] == labels_r[i]
        label_box = words(ax, figure_layout.ROW_GID).extents()[i]
        assert label_box.y0 < ax.transData.transform((0, i + 0.5))[1] < label_box.y1
        for j in range(cols):
            x, y = ax.transData.transform((j + 0.5, i + 0.5))
            got = pixels[int(height - y), int(x)]
            if np.isnan(matrix[i, j]):
                assert np.array_equal(got, background), (i, j, got)
                continue
            value = (matrix[i, j] + 0.5) if diverging else matrix[i, j]  # both scales map [lo, hi] onto [0, 1]
            expected = np.round(np.array(cmap(value)[:3]) * 255)
            assert np.abs(got.astype(int) - expected).max() <= 1, (i, j, got, expected)
    top = ax.transData.transform((0.5, 0.5))[1]
    bottom = ax.transData.transform((0.5, rows - 0.5))[1]
    assert top > bottom  # display y grows upwards: row 0 is drawn above the last row


@pytest.mark.parametrize(
    ("values", "top"),
    [
        ([0.894, 0.1], 1.0), ([0.3], 0.3), ([-1.81, 0.5], 2.0), ([0.213], 0.24), ([123.0], 140.0), ([7.2e-5], 8e-5),
        ([9.99], 10.0), ([10.01], 12.0), ([3.01], 4.0), ([-6.01e-5, 1e-6], 8e-5),
        ([0.0, np.nan, np.inf], 1e-12), ([np.nan, 0.45, -np.inf], 0.5),
    ],
)  # fmt: skip
def test_default_colour_scale_is_the_largest_finite_value_rounded_up_so_its_quarters_read_short(values, top):
    """The bar is marked at quarters of its top: 0.894 would mark 0.224, 0.447, 0.671; rounded to 1, they read 0.25,
    0.5, 0.75. The top never cuts a value and spreads the colours over at least 75% of the scale
    (3.01 -> 4, 6.01 -> 8)."""
    got = figures.abs_max(np.array(values))
    assert got == top
    finite = np.abs(np.array(values)[np.isfinite(values)])
    assert finite.max() <= got <= 4 / 3 * max(finite.max(), 1e-12)
    assert all(len(number.lstrip("-")) <= 5 for number in figures.bar_labels(got, True)), figures.bar_labels(got, True)
    assert figures.abs_max(np.array([1.7e308])) == 1.7e308  # near float64's largest: kept, not rounded up to inf


@pytest.mark.parametrize(("diverging", "limit"), [(False, 0.213), (True, 1.23e-05), (True, 1.23e100)])
def test_colour_bar_reads_its_scale_at_five_marks_its_label_beside_the_numbers(diverging, limit):
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    # "-1.23e-05" and "-1.23e+100" are the longest numbers .3g writes for ordinary and absurd scales
    matrix = np.array([[0.0, limit], [-limit / 2 if diverging else limit / 2, limit / 4]])
    figure = figures.heatmap(matrix, ["a", "b"], ["a", "b"], "T", "attention mass P", diverging=diverging, vmax=limit)
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    pixels = np.asarray(canvas.buffer_rgba())[..., :3]
    bar = figure.axes[-1]
    numbers = words(bar, figure_layout.BAR_GID)
    low = -limit if diverging else 0.0
    if diverging:  # symmetric about 0
        assert numbers.texts[:2] == ["-" + t for t in numbers.texts[:2:-1]]
    assert [float(t) for t in numbers.texts] == pytest.approx(
        [low + (limit - low) * f for f in np.linspace(0, 1, 5)], rel=5e-3
    )
    label = words(bar, figure_layout.BAR_LABEL_GID)
    assert label.texts == ["attention mass P"]
    boxes = numbers.extents()
    (label_box,) = label.extents()
    assert all(_inside(figure, box) for box in [*boxes, label_box])
    assert _no_overlap(boxes, "y") and all(box.x1 < label_box.x0 for box in boxes)
    assert label_box.x0 - max(box.x1 for box in boxes) < 12  # next to the numbers, not far right of them
    cmap = colormaps["RdBu_r" if diverging else "viridis"]
    for fraction in (0.05, 0.3, 0.5, 0.7, 0.95):  # the colour at a height is the colour map at that fraction
        x, y = bar.transAxes.transform((0.5, fraction))
        got = pixels[int(figure.bbox.height - y), int(x)].astype(int)
        assert np.abs(got - np.round(np.array(cmap(fraction)[:3]) * 255)).max() <= 3, (fraction, got)
    for fraction, box in zip(np.linspace(0, 1, 5), boxes, strict=True):  # each number sits at its mark
        mark = bar.transAxes.transform((1.0, fraction))[1]
        assert box.y0 < mark < box.y1
