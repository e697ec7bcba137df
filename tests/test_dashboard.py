import math
import re

import numpy as np
import pytest
import torch
from _reference import ACCELERATOR
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import IMAGES, SCALARS, TENSORS, EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from torch import nn
from torch.utils.data import DataLoader

from attn_callbacks import AttentionMonitor
from attn_callbacks.output import dashboard, figure_cache, figure_layout, figures
from attn_callbacks.output.images import Images


def test_per_head_series_move_to_a_heads_section_grids_are_named_by_family_metric():
    assert dashboard.head_tag("attention", "position/entropy", "enc.0") == "attention_position_heads/entropy/enc.0"
    assert dashboard.head_tag("attention", "drift/js_prev", "enc.0") == "attention_drift_heads/js_prev/enc.0"
    assert dashboard.head_tag("attention_test", "entropy", "") == "attention_test_entropy_heads/"
    assert dashboard.layer_tag("attention", "position/self", "enc.0") == "attention_position/self/enc.0"
    assert dashboard.grid_tag("attention", "position/sink_mass") == "attention_heads/position_sink_mass"
    assert dashboard.grid_tag("attention", "lift") == "attention_heads/lift"


@pytest.mark.parametrize(
    ("names", "short"),
    [
        ([f"bert.encoder.layer.{i}.attention.self" for i in range(3)], ["layer.0", "layer.1", "layer.2"]),
        (
            ["t.encoder.layers.0.self_attn", "t.decoder.layers.0.self_attn", "t.decoder.layers.0.multihead_attn"],
            ["encoder.layers.0.self_attn", "decoder.layers.0.self_attn", "decoder.layers.0.multihead_attn"],
        ),
        (["blocks.1.attn", "blocks.10.attn"], ["blocks.1", "blocks.10"]),
        (["attn"], ["attn"]),
        (["", "inner.attn"], ["attention", "inner.attn"]),
        (["a.x", "a.x.y"], ["x", "x.y"]),  # a name never shrinks to nothing
    ],
)
def test_short_names_drop_what_every_name_shares(names, short):
    assert dashboard.short_names(names) == short


def test_head_grid_rows_put_self_attention_first_and_pad_missing_heads():
    values = {
        "dec.0.self": np.array([1.0, 2.0]),
        "dec.0.cross": np.array([3.0, 4.0, 5.0]),
        "dec.1.self": np.array([6.0, 7.0]),
    }
    square = {"dec.0.self": True, "dec.0.cross": False, "dec.1.self": True}
    rows, labels, groups = dashboard.head_grid_rows(values, square)
    expected = np.array([[1.0, 2.0, np.nan], [6.0, 7.0, np.nan], [3.0, 4.0, 5.0]])
    np.testing.assert_array_equal(rows, expected)
    assert labels == ["dec.0.self", "dec.1.self", "dec.0.cross (cross)"] and groups == [2]
    only_self = dashboard.head_grid_rows({"a.0": np.ones(2), "a.1": np.zeros(2)}, {"a.0": True, "a.1": True})
    assert only_self[2] == []


def _universe(prefix, modules, metrics, heads, loaders):
    """Every scalar tag a run would log, written out by hand (not with the functions under test)."""
    tags = set()
    for suffix in ["", *(f"/dataloader_idx_{k}" for k in range(loaders))]:
        for module in modules:
            for metric in metrics:
                family, _, name = metric.partition("/")
                tags.add(f"{prefix}_{metric}/{module}{suffix}")
                for h in range(heads):
                    middle = f"{name}/" if name else ""
                    tags.add(f"{prefix}_{family}_heads/{middle}{module}/head_{h}{suffix}")
    return tags


def test_scalars_layout_regexes_match_exactly_one_modules_heads_and_cover_every_tag():
    modules = ["enc.1", "enc.10", "enc.1x"]  # names that are prefixes of each other, and "." in regexes
    metrics = ["entropy", "position/entropy", "position/entropy_normalized", "drift/js_prev"]
    tags = _universe("attention", modules, metrics, heads=3, loaders=2) | {"val_loss", "attention_skipped_rows/enc.1"}
    layout = dashboard.scalars_layout("attention", {m: modules for m in metrics}, per_head=True)
    assert list(layout)[-1] == "attention overview"
    covered = set()
    for category, charts in layout.items():
        for title, (kind, regexes) in charts.items():
            assert kind == "Multiline"
            matched = [{tag for tag in tags if re.match(regex, tag)} for regex in regexes]
            assert all(matched), (title, regexes)
            covered |= set().union(*matched)
            if category != "attention overview":
                heads, layer = matched
                module = title.split(" · ")[1]
                metric = category.removeprefix("attention heads: ")
                family, _, name = metric.partition("/")
                middle = f"{name}/" if name else ""
                want = {t for t in tags if t.startswith(f"attention_{family}_heads/{middle}{module}/head_")}
                assert heads == want and len(heads) == 3 * 3  # 3 heads, combined + 2 loaders
                assert layer == {
                    f"attention_{metric}/{module}{s}" for s in ("", "/dataloader_idx_0", "/dataloader_idx_1")
                }
            else:
                assert not any("/head_" in t for t in matched[0]) and len(matched[0]) == 3 * 3
    assert covered == tags - {"val_loss", "attention_skipped_rows/enc.1"}
    without_heads = dashboard.scalars_layout("attention", {m: modules for m in metrics}, per_head=False)
    assert list(without_heads) == ["attention overview"]


def test_value_grid_prints_every_value_readably_and_the_cache_redraws_it_exactly():
    from _reference import figure_to_array, words
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.textpath import TextPath

    values = np.array([[0.0, 0.25, 0.5], [0.75, 1.0, np.nan]])
    rows, cols = ["layer.0", "layer.1"], ["0", "1", "2"]
    figure = figures.value_grid(values, rows, cols, "share on the own position, per head", "", vmax=1.0, groups=[1])
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    ax = figure.axes[0]
    (numbers,) = [c for c in ax.collections if c.get_gid() == figure_layout.CELL_GID]
    # One outline per cell, centred on the cell: "0", "0.25", "0.50", "0.75", "1.00" and nothing for NaN.
    widths = [np.ptp(path.vertices[:, 0]) if len(path.vertices) else 0.0 for path in numbers.get_paths()]
    size = figure_layout.font_size(len(rows), len(cols))
    for text, width in zip(["0", "0.25", "0.50", "0.75", "1.00", ""], widths, strict=True):
        expected = np.ptp(TextPath((0, 0), text, size=size).vertices[:, 0]) if text else 0.0
        assert width == pytest.approx(expected)
    np.testing.assert_array_equal(numbers.get_offsets(), [[j + 0.5, i + 0.5] for i in range(2) for j in range(3)])
    # Dark cells (viridis' low end) get white numbers, light ones black.
    colours = numbers.get_facecolor()
    assert colours[0][:3].tolist() == [1.0, 1.0, 1.0] and colours[4][:3].tolist() == [0.0, 0.0, 0.0]
    pixels = np.asarray(canvas.buffer_rgba())[..., :3].astype(int)

    def cell(i, j):  # the middle of a cell's pixels
        x, y = ax.transData.transform((j + 0.5, i + 0.5))
        row, col = int(figure.bbox.height - y), int(x)
        return pixels[row - 4 : row + 4, col - 10 : col + 10]

    assert (cell(1, 1).sum(axis=-1) < 150).any()  # black ink on the yellow 1.00 cell
    assert (cell(1, 2) == 255).all()  # the NaN cell is blank, no number
    groups = [line.get_ydata()[0] for line in ax.lines if line.get_gid() != figure_layout.TICK_GID]
    assert groups == [1]  # the group line above row 1
    assert words(ax, figure_layout.ROW_GID).texts == rows and ax.get_xlabel() == "head"
    cache = figure_cache.FigureCache()
    cache.value_grid(values[::-1].copy(), rows, cols, "another title of the same length..... per head", "", 1.0, [1])
    again = cache.value_grid(values, rows, cols, "share on the own position, per head", "", 1.0, [1])
    assert np.array_equal(again, figure_to_array(figure)) and len(cache._entries) == 1


@pytest.mark.parametrize(
    ("value", "text"),
    [(0.0, "0"), (0.004, "0.004"), (0.01, "0.01"), (-0.5, "-0.50"), (99.994, "99.99"), (123.4, "123"), (2e5, "2e+05")],
)
def test_cell_text_is_short(value, text):
    assert figures.cell_text(value) == text and len(text) <= 6


def test_metric_grid_uses_the_metrics_natural_range_else_the_colour_scale_option():
    seen = []

    class Spy(figure_cache.FigureCache):
        def value_grid(self, values, *args, vmax=None, **kwargs):
            seen.append(vmax)
            return super().value_grid(values, *args, vmax=vmax, **kwargs)

    images = Images("shared")
    images.figures = Spy()
    square = {"a": True}
    images.metric_grid("attention_heads/drift_js_prev", "drift/js_prev", {"a": torch.tensor([0.1, 0.2])}, square)
    images.metric_grid("attention_heads/lift", "lift", {"a": torch.tensor([3.0, 2.0])}, square)
    images.metric_grid("attention_heads/lift", "lift", {"a": torch.tensor([1.0, 2.0])}, square)  # shared: keeps 3
    assert seen == [pytest.approx(math.log(2)), 3.0, 3.0]


VOCAB, PAD, LENGTH, HEADS = 12, 0, 6, 2
MODULES = ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]


class Encoder(LightningModule):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        layer = nn.TransformerEncoderLayer(16, HEADS, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.encoder(self.embed(batch), src_key_padding_mask=batch == PAD)


def _loader(seed):
    ids = torch.randint(1, VOCAB, (8, LENGTH), generator=torch.Generator().manual_seed(seed))
    ids[::3, -2:] = PAD
    return DataLoader(list(ids.split(4)), batch_size=None)


def test_validate_only_run_writes_head_grids_of_logged_values_layout_of_every_head(tmp_path, monkeypatch):
    drawn = {}  # grid tag -> the values drawn
    metric_grid = Images.metric_grid

    def spy(self, tag, key, values, square, suffix=""):
        spied = figure_cache.FigureCache.value_grid

        def capture(cache, grid, *args, **kwargs):
            drawn[tag + suffix] = grid.copy()
            return spied(cache, grid, *args, **kwargs)

        monkeypatch.setattr(figure_cache.FigureCache, "value_grid", capture)
        try:
            return metric_grid(self, tag, key, values, square, suffix)
        finally:
            monkeypatch.setattr(figure_cache.FigureCache, "value_grid", spied)

    monkeypatch.setattr(Images, "metric_grid", spy)
    seed_everything(0)
    # Drawn in this process, where the spy sees it (on a GPU the default draws in a background process).
    monitor = AttentionMonitor(VOCAB, lambda batch: batch, ignore_ids=[PAD], min_support=1, draw_in_background=False)
    t = Trainer(
        default_root_dir=tmp_path,
        accelerator=ACCELERATOR,
        logger=TensorBoardLogger(tmp_path, name="tb"),
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Encoder()
    for _ in range(2):  # the second validate compares with the first: drift grids too
        t.validate(model, [_loader(0), _loader(1)], verbose=False)

    events = EventAccumulator(t.logger.log_dir, size_guidance={IMAGES: 0, SCALARS: 0, TENSORS: 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    grids = sorted(tag for tag in events.Tags()["images"] if tag.startswith("attention_heads/"))
    # 9 metrics combined and per dataloader; the 4 drift metrics combined only (drift compares the combined view).
    assert len(grids) == 9 * 3 + 4 and sorted(drawn) == grids
    assert (
        len(events.Images("attention_heads/entropy")) == 2 and len(events.Images("attention_heads/drift_js_ref")) == 1
    )
    # Every cell is the per-head scalar logged in the same epoch end (rows: modules in model order).
    for grid, values in drawn.items():
        metric, _, suffix = grid.removeprefix("attention_heads/").partition("/")
        family, _, name = metric.partition("_") if metric.startswith(("position_", "drift_")) else (metric, "", "")
        for row, module in enumerate(MODULES):
            for h in range(HEADS):
                tag = f"attention_{family}_heads/{name + '/' if name else ''}{module}/head_{h}"
                logged = events.Scalars(tag + (f"/{suffix}" if suffix else ""))[-1].value
                assert values[row, h] == pytest.approx(logged, rel=1e-6, abs=1e-7), (grid, tag)

    # The layout: the last one written is what the plugin shows; its regexes find tags, and cover every head.
    (point,) = events.Tensors("custom_scalars__config__")[-1:]
    layout = layout_pb2.Layout()
    layout.ParseFromString(point.tensor_proto.string_val[0])
    covered = set()
    for category in layout.category:
        for chart in category.chart:
            for regex in chart.multiline.tag:
                matched = {tag for tag in scalars if re.match(regex, tag)}
                assert matched, (category.title, chart.title, regex)
                covered |= matched
    heads = {tag for tag in scalars if "/head_" in tag}
    assert len(heads) == (9 * 3 + 4) * len(MODULES) * HEADS and heads <= covered
    sections = {}
    for tag in scalars:
        sections.setdefault(tag.split("/")[0], set()).add("/head_" in tag)
    assert all(len(kinds) == 1 for kinds in sections.values()), sections


def test_two_monitors_on_one_run_keep_both_parts_of_the_layout(tmp_path):
    seed_everything(0)
    monitors = [
        AttentionMonitor(VOCAB, lambda batch: batch, ignore_ids=[PAD], min_support=1, prefix=prefix)
        for prefix in ("first", "second")
    ]
    t = Trainer(
        default_root_dir=tmp_path,
        accelerator=ACCELERATOR,
        logger=TensorBoardLogger(tmp_path, name="tb"),
        callbacks=monitors,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    t.validate(Encoder(), _loader(0), verbose=False)
    events = EventAccumulator(t.logger.log_dir, size_guidance={TENSORS: 0})
    events.Reload()
    layout = layout_pb2.Layout()  # the plugin shows the last one a run wrote
    layout.ParseFromString(events.Tensors("custom_scalars__config__")[-1].tensor_proto.string_val[0])
    titles = [category.title for category in layout.category]
    assert "first overview" in titles and "second overview" in titles
    assert {title.split(" ")[0] for title in titles} == {"first", "second"}
