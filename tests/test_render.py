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
