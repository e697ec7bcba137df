import pickle

import matplotlib
import numpy as np
import pytest
import torch
from _reference import figure_to_array

from attn_callbacks.output import figures
from attn_callbacks.output.dashboard import head_grid_rows
from attn_callbacks.output.images import Images

TAG, LAYER = "attention_{family}/enc.0", "enc.0"
# One module's sums over a vocabulary of 3; the maps show the block of rows = cols = ids [2, 0].
MASS = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.25, 0.25, 0.5]], dtype=torch.float64)
QUERY_COUNT = torch.tensor([4.0, 2.0, 2.0], dtype=torch.float64)
UNIFORM_SUM = torch.ones(3, 3, dtype=torch.float64)
SHOWN, LABELS = torch.tensor([2, 0]), ["c", "a"]


def _maps(images, mass=MASS, uniform_sum=UNIFORM_SUM, **kwargs):
    arguments = {"mass_heads": None, "square": True, **kwargs}
    return images.module_maps(
        TAG,
        LAYER,
        mass=mass,
        query_count=QUERY_COUNT,
        uniform_sum=uniform_sum,
        rows=SHOWN,
        cols=SHOWN,
        row_labels=LABELS,
        col_labels=LABELS,
        **arguments,
    )


def _pixel(image, figure, i, j, panel=0):
    """The pixel in the middle of cell (i, j) of a panel, found on ``figure``: a figure of the same panels and labels
    (the panels' places do not depend on the title or the data)."""
    figure_to_array(figure)  # settles the axes' limits
    x, y = figure.axes[panel].transData.transform((j + 0.5, i + 0.5))
    return image[int(figure.bbox.height - y), int(x), :3].astype(int)


def _colour(name, fraction):
    """``name``'s colour map at ``fraction`` of its range, as 0-255 RGB."""
    return np.array(matplotlib.colormaps[name](fraction, bytes=True)[:3], dtype=int)


def _assert_colour(got, want):
    assert np.abs(got - want).max() <= 1, (got, want)  # Agg rounds where the colour map truncates


def test_images_limit_is_none_under_the_epoch_scale():
    images = Images("epoch")
    assert images.limit("t", np.array([3.0])) is None and images.limits == {}


def test_images_limit_shared_is_the_largest_absolute_value_so_far_per_tag():
    images = Images("shared")
    assert images.limit("a", np.array([0.2, -0.7, np.nan])) == 0.8  # rounded up: the bar reads 0.2, 0.4, 0.6
    assert images.limit("a", np.array([0.5])) == 0.8  # only widens
    assert images.limit("b", np.array([[0.1]])) == 0.1
    assert images.limit("a", np.array([np.inf, 0.9])) == 1.0  # only finite values count
    assert images.limits == {"a": 1.0, "b": 0.1}
    images.limits["old"] = 0.7  # an unrounded top, as a checkpoint of an older version holds: rounded up too
    assert images.limit("old", np.array([0.1])) == 0.8 and images.limits["old"] == 0.8


def test_images_limit_shared_of_an_all_blank_image_is_tiny_but_positive():
    images = Images("shared")
    assert 0 < images.limit("a", np.array([np.nan, 0.0])) <= 1e-12


def test_images_pickle_keeps_the_limits_and_starts_an_empty_figure_cache():
    images = Images("shared")
    _maps(images)
    assert images.figures._entries
    copy = pickle.loads(pickle.dumps(images))
    assert copy.limits == images.limits and copy.color_scale == "shared" and not copy.figures._entries


def test_images_module_maps_draws_every_family_as_an_rgba_image():
    heads = torch.stack([MASS, MASS.T])
    got = _maps(Images(), mass_heads=heads, reference_mass=MASS.flip(0), reference_epoch=0)
    families = ["mass", "mass_heads", "asymmetry_map", "lift_map", "drift_map"]
    assert list(got) == [f"attention_{family}/enc.0" for family in families]
    for image in got.values():
        assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 4 and (image[..., 3] == 255).all()


def test_images_module_maps_leaves_out_the_asymmetry_of_a_cross_attention():
    assert list(_maps(Images(), square=False)) == ["attention_mass/enc.0", "attention_lift_map/enc.0"]


def test_images_module_maps_shared_limits_are_the_hand_computed_maxima():
    images = Images("shared")
    reference = torch.zeros(3, 3, dtype=torch.float64)
    reference[0, 0] = 0.9  # shown cell (1, 1): 0.5 - 0.9
    uniform = UNIFORM_SUM.clone()
    uniform[2, 2] = 0  # never visible: cell (2, 2) is blank
    heads = torch.stack([MASS, 2 * MASS])
    _maps(images, uniform_sum=uniform, mass_heads=heads, reference_mass=reference, reference_epoch=0, suffix="/x")
    # Shown block (rows, cols = 2, 0): [[P22, P20], [P02, P00]] = [[0.5, 0.25], [0.2, 0.5]].
    # log2 lift = log2(Q[a] P[a, b] / 1): cells (2, 0) 2 * 0.25 -> -1, (0, 2) 4 * 0.2 -> log2(0.8), (0, 0) 4 * 0.5 -> 1.
    want = {"mass": 0.5, "mass_heads": 1.0, "asymmetry_map": 0.05, "lift_map": 1.0, "drift_map": 0.5}
    assert images.limits == pytest.approx({f"attention_{k}/enc.0/x": v for k, v in want.items()}, rel=1e-6)


def test_images_module_maps_shared_scale_keeps_an_earlier_epochs_top():
    shared, epoch = Images("shared"), Images("epoch")
    for images in (shared, epoch):
        _maps(images, mass=MASS * 1.6)  # epoch 1: top 0.8
    latest = [_maps(images, mass=MASS / 2)["attention_mass/enc.0"] for images in (shared, epoch)]  # largest 0.25
    at = figures.heatmap(np.zeros((2, 2)), LABELS, LABELS, "t", "")
    # Cell (0, 1) holds P[2, 0] / 2 = 0.125: on the shared scale 0.125 / 0.8 of the top, on its own scale (0.25
    # rounded up to 0.3) 0.125 / 0.3.
    _assert_colour(_pixel(latest[0], at, 0, 1), _colour("viridis", 0.125 / 0.8))
    _assert_colour(_pixel(latest[1], at, 0, 1), _colour("viridis", 0.125 / 0.3))
    _assert_colour(_pixel(latest[1], at, 0, 0), _colour("viridis", 0.25 / 0.3))
    assert shared.limits["attention_mass/enc.0"] == pytest.approx(0.8)


def test_images_asymmetry_map_is_red_where_the_query_attends_more():
    got = _maps(Images())["attention_asymmetry_map/enc.0"]
    at = figures.heatmap(np.zeros((2, 2)), LABELS, LABELS, "t", "", diverging=True)
    # P - Pᵀ on the block: [[0, 0.05], [-0.05, 0]], limit 0.05: the top and the bottom of RdBu_r, white between.
    _assert_colour(_pixel(got, at, 0, 1), _colour("RdBu_r", 1.0))
    _assert_colour(_pixel(got, at, 1, 0), _colour("RdBu_r", 0.0))
    _assert_colour(_pixel(got, at, 0, 0), _colour("RdBu_r", 0.5))


def test_images_lift_map_leaves_never_visible_pairs_blank():
    mass, uniform = MASS.clone(), UNIFORM_SUM.clone()
    mass[0, 2] = uniform[0, 2] = 0  # shown cell (1, 0): counted in C, but a mask hid it (as a causal one hides)
    got = _maps(Images(), mass=mass, uniform_sum=uniform)["attention_lift_map/enc.0"]
    at = figures.heatmap(np.zeros((2, 2)), LABELS, LABELS, "t", "", diverging=True)
    assert (_pixel(got, at, 1, 0) == 255).all()
    _assert_colour(_pixel(got, at, 0, 1), _colour("RdBu_r", 0.5 + 0.5 * -1.0))  # log2(2 * 0.25) = -1 = -limit


def _grid(images, values, key="lift", suffix=""):
    return images.metric_grid(
        f"attention_heads/{key.replace('/', '_')}", key, values, dict.fromkeys(values, True), suffix
    )


def test_images_metric_grid_natural_range_sets_no_limit():
    images = Images("shared")
    image = _grid(images, {"enc.0": torch.tensor([0.2, 0.4])}, key="asymmetry")
    assert images.limits == {} and image.dtype == np.uint8 and image.shape[2] == 4


def test_images_metric_grid_follows_the_shared_scale_per_tag_and_suffix():
    images = Images("shared")
    _grid(images, {"enc.0": torch.tensor([3.0, 2.0])}, suffix="/dataloader_idx_0")
    _grid(images, {"enc.0": torch.tensor([1.0, 2.5])}, suffix="/dataloader_idx_0")
    _grid(images, {"enc.0": torch.tensor([1.0, 1.5])}, suffix="/dataloader_idx_1")
    assert images.limits == {"attention_heads/lift/dataloader_idx_0": 3.0, "attention_heads/lift/dataloader_idx_1": 1.6}


def test_images_metric_grid_colours_a_cell_on_the_metrics_range():
    values = {"enc.0.attn": torch.tensor([0.2, 0.6]), "enc.1.attn": torch.tensor([0.9])}
    image = _grid(Images(), values, key="asymmetry")  # natural range [0, 1]
    rows, row_labels, groups = head_grid_rows({k: v.numpy() for k, v in values.items()}, dict.fromkeys(values, True))
    at = figures.value_grid(np.zeros_like(rows), row_labels, ["0", "1"], "t", "", 1.0, groups)

    def corner(i, j):  # near a cell's top left corner, away from the number printed in its middle
        figure_to_array(at)
        x, y = at.axes[0].transData.transform((j + 0.15, i + 0.2))
        return image[int(at.bbox.height - y), int(x), :3].astype(int)

    _assert_colour(corner(0, 1), _colour("viridis", 0.6))
    _assert_colour(corner(1, 0), _colour("viridis", 0.9))
    assert (corner(1, 1) == 255).all()  # enc.1 has one head: blank


def test_images_probe_maps_draw_the_mean_of_heads_then_every_head():
    weights = torch.tensor(
        [[[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0]], [[0.1, 0.9, 0.0], [0.6, 0.2, 0.2], [1.0, 0.0, 0.0]]]]
    )  # (n=1, H=2, Lq=3, Lk=3); position 2 is padding
    positions = torch.tensor([0, 1])
    images = Images("shared")
    got = images.probe_maps("attention_probe/enc.0", LAYER, weights, [(positions, positions, ["x", "y"], ["x", "y"])])
    (name,) = got
    assert name == "attention_probe/enc.0/sample_0" and images.limits == {name: 1.0}  # 0.9 rounded up
    at = figures.head_grid(np.zeros((3, 2, 2)), ["x", "y"], ["x", "y"], "t", "")
    mean = {(0, 1): (0.5 + 0.9) / 2, (1, 0): (0.2 + 0.6) / 2}
    for (i, j), value in mean.items():
        _assert_colour(_pixel(got[name], at, i, j, panel=0), _colour("viridis", value))
    _assert_colour(_pixel(got[name], at, 1, 1, panel=2), _colour("viridis", 0.2))  # head 1
