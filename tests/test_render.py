import numpy as np

from attn_callbacks import render


def test_label_tokens_list_dict_callable_and_ids():
    assert render.label_tokens([0, 1, 9], ["a", "b"]) == ["a", "b", "9"]
    assert render.label_tokens([3], {3: "x|y"}) == ["x|y"]
    assert render.label_tokens([2], lambda i: f"t{i}") == ["t2"]
    assert render.label_tokens([5]) == ["5"]
    assert render.label_tokens([0], ["x" * 40])[0].endswith("…") and len(render.label_tokens([0], ["x" * 40])[0]) == 14


def test_heatmap_renders_labelled_rgb_image():
    matrix = np.array([[0.9, 0.1], [0.3, 0.7]])
    figure = render.heatmap(matrix, ["the", "cat"], ["the", "cat"], "layer 0", "P")
    ax = figure.axes[0]
    assert ax.get_ylabel().startswith("query token") and ax.get_xlabel().startswith("key token")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["the", "cat"]
    assert len(figure.axes) == 2  # the colour bar
    image = render.figure_to_array(figure)
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3 and image.shape[0] > 100


def test_head_grid_and_diverging_map_render():
    grid = render.head_grid(np.random.rand(3, 4, 4), list("abcd"), list("abcd"), "layer", "P")
    assert [ax.get_title() for ax in grid.axes[:3]] == ["head 0", "head 1", "head 2"]
    diverging = render.heatmap(np.array([[0.0, 0.5], [-0.5, 0.0]]), ["a", "b"], ["a", "b"], "d", "P-Pt", diverging=True)
    assert render.figure_to_array(diverging).shape[2] == 3


def test_markdown_table_escapes_pipes():
    table = render.markdown_table(["a", "b"], [("x|y", 0.12345)])
    assert table.splitlines() == ["| a | b |", "|---|---|", "| x\\|y | 0.123 |"]


def test_figure_cache_redraws_pixels_equal_to_a_fresh_render_and_respects_its_memory_cap():
    rng = np.random.default_rng(0)
    labels = [f"t{i}" for i in range(12)]
    cache = render.FigureCache()
    first, second = rng.random((12, 12)), 3 * rng.random((12, 12))
    assert np.array_equal(
        cache.heatmap("m", first, labels, labels, "T", "P"),
        render.figure_to_array(render.heatmap(first, labels, labels, "T", "P")),
    )
    again = cache.heatmap("m", second, labels, labels, "T", "P")  # reused figure, new data and colour scale
    assert np.array_equal(again, render.figure_to_array(render.heatmap(second, labels, labels, "T", "P")))
    diverging = rng.standard_normal((12, 12))
    diverging[0, 0] = np.nan
    cache.heatmap("d", -diverging, labels, labels, "T", "P", diverging=True)
    assert np.array_equal(
        cache.heatmap("d", diverging, labels, labels, "T", "P", diverging=True),
        render.figure_to_array(render.heatmap(diverging, labels, labels, "T", "P", diverging=True)),
    )
    heads = rng.random((3, 12, 12))
    cache.head_grid("g", heads[::-1], labels, labels, "G", "P")
    assert np.array_equal(
        cache.head_grid("g", heads, labels, labels, "G", "P"),
        render.figure_to_array(render.head_grid(heads, labels, labels, "G", "P")),
    )
    # new labels: a new figure for the tag
    other = cache.heatmap("m", first, labels[::-1], labels, "T", "P")
    assert np.array_equal(other, render.figure_to_array(render.heatmap(first, labels[::-1], labels, "T", "P")))
    assert len(cache._entries) == 3
    tiny = render.FigureCache(max_bytes=0)  # nothing kept, still drawn right
    assert np.array_equal(tiny.heatmap("m", second, labels, labels, "T", "P"), again) and not tiny._entries
