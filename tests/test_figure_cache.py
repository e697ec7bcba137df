import numpy as np
from _reference import figure_to_array

from attn_callbacks.output import figure_layout, figures
from attn_callbacks.output.figure_cache import FigureCache

LABELS = ["a", "b", "c"]
FIRST = np.array([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.0, 0.25, 0.75]])
SECOND = np.array([[0.2, 0.2, 0.6], [0.9, 0.05, 0.05], [0.3, 0.3, 0.4]])


def _heatmap(cache, matrix, title="enc.0: P", **kwargs):
    return cache.heatmap(matrix, LABELS, LABELS, title, "P[query, key]", **kwargs)


def test_figure_cache_redraw_reuses_the_figure_and_equals_a_fresh_draw():
    cache = FigureCache()
    _heatmap(cache, FIRST)
    (kept,) = cache._entries.values()
    again = _heatmap(cache, SECOND, title="enc.1: P")  # another layer: same layout
    assert list(cache._entries.values()) == [kept]
    assert np.array_equal(again, _heatmap(FigureCache(), SECOND, title="enc.1: P"))


def test_figure_cache_first_draw_equals_matplotlibs_own_render():
    got = _heatmap(FigureCache(), FIRST)
    assert np.array_equal(got, figure_to_array(figures.heatmap(FIRST, LABELS, LABELS, "enc.0: P", "P[query, key]")))


def test_figure_cache_different_data_gives_different_pixels():
    cache = FigureCache()
    first, second = _heatmap(cache, FIRST), _heatmap(cache, SECOND)
    assert first.shape == second.shape and not np.array_equal(first, second)


def test_figure_cache_returns_a_copy_the_next_draw_does_not_touch():
    cache = FigureCache()
    first = _heatmap(cache, FIRST)
    kept = first.copy()
    _heatmap(cache, SECOND)
    assert np.array_equal(first, kept)


def test_figure_cache_returns_rgba_with_an_opaque_alpha_channel():
    rgba = _heatmap(FigureCache(), FIRST)
    assert rgba.dtype == np.uint8 and rgba.shape[2] == 4 and (rgba[..., 3] == 255).all()


def test_figure_cache_redraw_with_a_scale_equals_a_fresh_draw_with_it():
    cache = FigureCache()
    _heatmap(cache, FIRST)
    scaled = _heatmap(cache, SECOND, vmax=2.0)
    assert np.array_equal(scaled, _heatmap(FigureCache(), SECOND, vmax=2.0))
    assert not np.array_equal(scaled, _heatmap(FigureCache(), SECOND))


def test_figure_cache_redraw_blanks_and_fills_nan_cells_as_a_fresh_draw():
    cache, holes = FigureCache(), FIRST.copy()
    holes[1, 2] = np.nan
    _heatmap(cache, FIRST, diverging=True)
    assert np.array_equal(_heatmap(cache, holes, diverging=True), _heatmap(FigureCache(), holes, diverging=True))
    assert np.array_equal(_heatmap(cache, FIRST, diverging=True), _heatmap(FigureCache(), FIRST, diverging=True))


def test_figure_cache_keeps_a_layout_per_labels_and_colour_map():
    cache = FigureCache()
    _heatmap(cache, FIRST)
    _heatmap(cache, FIRST, diverging=True)
    cache.heatmap(FIRST, ["x", "y", "z"], LABELS, "enc.0: P", "P")
    cache.heatmap(FIRST[:2], LABELS[:2], LABELS, "enc.0: P", "P")
    assert len(cache._entries) == 4


def test_figure_cache_a_title_wider_than_the_figure_gets_a_layout_of_its_own():
    cache, wide = FigureCache(), "enc.0: " + "a long title " * 8
    assert figure_layout.title_sets_width(wide, LABELS, LABELS)
    assert not figure_layout.title_sets_width("enc.0: P", LABELS, LABELS)
    narrow, widened = _heatmap(cache, FIRST), _heatmap(cache, FIRST, title=wide)
    assert len(cache._entries) == 2 and widened.shape[1] > narrow.shape[1]
    assert np.array_equal(widened, _heatmap(FigureCache(), FIRST, title=wide))


def test_figure_cache_head_grid_redraw_equals_a_fresh_draw():
    cache, heads = FigureCache(), np.stack([FIRST, SECOND, FIRST.T])
    cache.head_grid(heads, LABELS, LABELS, "enc.0: P per head", "P")
    again = cache.head_grid(heads[::-1].copy(), LABELS, LABELS, "enc.1: P per head", "P")
    assert len(cache._entries) == 1
    assert np.array_equal(again, FigureCache().head_grid(heads[::-1].copy(), LABELS, LABELS, "enc.1: P per head", "P"))


def test_figure_cache_value_grid_redraw_prints_the_new_numbers():
    cache, rows, cols = FigureCache(), ["enc.0", "enc.1"], ["0", "1"]
    values = np.array([[0.25, 0.5], [0.75, np.nan]])
    cache.value_grid(values, rows, cols, "entropy, per head", "", groups=[1])
    again = cache.value_grid(values[::-1].copy(), rows, cols, "mean lift, per head", "", groups=[1])
    assert len(cache._entries) == 1
    fresh = FigureCache().value_grid(values[::-1].copy(), rows, cols, "mean lift, per head", "", groups=[1])
    assert np.array_equal(again, fresh)


def test_figure_cache_drops_the_least_recently_used_layout_over_its_cap():
    one = _heatmap(FigureCache(), FIRST)
    cost = 3 * 4 * one.shape[0] * one.shape[1]  # canvas, background and the figure's objects, as RGBA
    cache = FigureCache(max_bytes=2 * cost)
    _heatmap(cache, FIRST)
    cache.heatmap(FIRST, ["x", "y", "z"], LABELS, "enc.0: P", "P[query, key]")  # same size: a second layout
    _heatmap(cache, SECOND)  # touches the first layout
    cache.heatmap(FIRST, LABELS, ["x", "y", "z"], "enc.0: P", "P[query, key]")  # a third layout evicts the second
    kept = [(layout[2], layout[3]) for layout in cache._entries]  # (row labels, column labels), oldest first
    assert kept == [(tuple(LABELS), tuple(LABELS)), (tuple(LABELS), ("x", "y", "z"))]
    assert sum(cache._bytes.values()) == 2 * cost


def test_figure_cache_draws_a_figure_over_its_cap_afresh_keeping_nothing():
    cache = FigureCache(max_bytes=0)
    first, second = _heatmap(cache, FIRST), _heatmap(cache, SECOND)
    assert cache._entries == {} and cache._bytes == {}
    assert np.array_equal(first, _heatmap(FigureCache(), FIRST))
    assert np.array_equal(second, _heatmap(FigureCache(), SECOND))
