"""AttentionMonitor end to end, what reaches the loggers: tags, images, tables and scalars read back from
TensorBoard and CSV files."""

import copy
import csv
import io
import math
import warnings
from pathlib import Path

import pytest
import torch
from _callback_helpers import (
    PAD,
    VOCAB,
    TinyEncoder,
    last_scalars,
    loaders,
    make_batches,
    no_hooks,
    run_validate,
    trainer,
)
from _reference import ACCELERATOR, table_cells
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import IMAGES, SCALARS, TENSORS, EventAccumulator

from attn_callbacks import AttentionMonitor


def test_callback_fit_logs_images_and_scalars_read_back_from_event_files(tmp_path):
    seed_everything(0)
    labels = [f"tok{i}" for i in range(VOCAB)]
    monitor = AttentionMonitor(VOCAB, "input_ids", id_to_token=labels, ignore_ids=[PAD], top_k=8, min_support=1)
    model = TinyEncoder()
    train, val = loaders()
    t = trainer(tmp_path, [monitor], num_sanity_val_steps=2)
    t.fit(model, train, val)
    assert no_hooks(model) and torch.backends.mha.get_fastpath_enabled()

    events = EventAccumulator(t.logger.log_dir, size_guidance={IMAGES: 0, SCALARS: 0, TENSORS: 0})
    events.Reload()
    layers = ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
    every_epoch = ("mass", "mass_heads", "asymmetry_map", "lift_map")
    kinds = (*every_epoch, "drift_map")
    position = ("entropy", "entropy_normalized", "self", "previous", "next", "distance")
    grids = [f"attention_heads/{m}" for m in ("entropy", "asymmetry", "lift", *(f"position_{s}" for s in position))]
    drift_grids = [f"attention_heads/drift_{kind}_{which}" for kind in ("js", "frobenius") for which in ("prev", "ref")]
    assert sorted(events.Tags()["images"]) == sorted(
        [f"attention_{k}/{layer}" for k in kinds for layer in layers] + grids + drift_grids
    )
    for tag in grids + drift_grids:
        assert len(events.Images(tag)) == (1 if "drift" in tag else 2)
    for layer in layers:
        for kind in kinds:
            images = events.Images(f"attention_{kind}/{layer}")
            # two epochs, sanity check not logged; drift needs a previous epoch
            assert len(images) == (2 if kind in every_epoch else 1)
            png = Image.open(io.BytesIO(images[-1].encoded_image_string))
            assert png.size == (images[-1].width, images[-1].height) and png.width > 200 and png.height > 200
        stats = ("entropy_normalized", "entropy", "self", "previous", "next", "distance")
        every_epoch_scalars = ("asymmetry", "entropy", "lift", "skipped_rows", *(f"position/{s}" for s in stats))
        drift_scalars = [f"drift/{kind}_{which}" for kind in ("js", "frobenius") for which in ("prev", "ref")]
        for name in (*every_epoch_scalars, *drift_scalars):
            values = [e.value for e in events.Scalars(f"attention_{name}/{layer}")]
            assert len(values) == (1 if name.startswith("drift") else 2) and all(math.isfinite(v) for v in values)
            assert f"attention_{name}/{layer}" in t.callback_metrics
            if name != "skipped_rows":  # a per-layer count, no head
                for h in range(2):
                    # Straight to the loggers, at the layer scalar's steps; not in callback_metrics.
                    family, _, metric = f"{name}/".partition("/")
                    head = f"attention_{family}_heads/{metric}{layer}/head_{h}"
                    steps = [e.step for e in events.Scalars(head)]
                    assert steps == [e.step for e in events.Scalars(f"attention_{name}/{layer}")]
                    assert head not in t.callback_metrics
        epochs = [(e.step, e.value) for e in events.Scalars("epoch")]  # one point per epoch end: Lightning's
        assert len(epochs) == len({step for step, _ in epochs})
        for table, count in (("one_way_pairs", 2), ("lift_pairs", 2), ("hubs", 2), ("drift_tokens", 1)):
            text = events.Tensors(f"attention_{table}/{layer}/text_summary")  # add_text's own suffix
            assert len(text) == count and text[-1].tensor_proto.string_val[0].startswith(b"| ")
        text = events.Tensors(f"attention_one_way_pairs/{layer}/text_summary")
        assert b"| query a | key b |" in text[-1].tensor_proto.string_val[0]
        # epoch 0 is both the reference and the previous epoch: each moved token's two JS columns agree
        drift = events.Tensors(f"attention_drift_tokens/{layer}/text_summary")[-1].tensor_proto.string_val[0]
        rows = table_cells(drift.decode())
        assert rows and all(row[1] == row[2] for row in rows)
    js = events.Scalars(f"attention_drift/js_prev/{layers[0]}")[0].value
    assert 0 < js <= math.log(2)  # the model trained between the two epochs
    assert js == events.Scalars(f"attention_drift/js_ref/{layers[0]}")[0].value  # epoch 0 is both
    asym = [e.value for e in events.Scalars(f"attention_asymmetry/{layers[0]}")]
    assert all(0.0 <= v <= 1.0 for v in asym)
    entropy = [e.value for e in events.Scalars(f"attention_entropy/{layers[0]}")]
    assert all(0.0 < v <= math.log(VOCAB) for v in entropy)


def test_callback_without_tensorboard_logs_scalars_and_warns_once(tmp_path):
    seed_everything(0)
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD])
    train, val = loaders()
    t = trainer(tmp_path, [monitor], logger=CSVLogger(tmp_path))
    with pytest.warns(UserWarning, match="no TensorBoardLogger") as record:
        t.fit(TinyEncoder(), train, val)
    assert sum("no TensorBoardLogger" in str(w.message) for w in record) == 1
    with open(f"{t.logger.log_dir}/metrics.csv") as handle:
        text = handle.read()
    assert "attention_asymmetry/encoder.layers.0.self_attn" in text


def test_callback_under_fast_dev_run_says_why_there_are_no_images_and_writes_no_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the dummy logger's folder: the working directory
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], export="pt")
    train, val = loaders()
    t = trainer(tmp_path, [monitor], fast_dev_run=True)  # a TensorBoardLogger given, replaced by Lightning
    with pytest.warns(UserWarning, match="fast_dev_run replaces the Trainer's loggers with a dummy one, so heatmaps"):
        t.fit(TinyEncoder(), train, val)
    assert "attention_asymmetry/encoder.layers.0.self_attn" in t.callback_metrics
    assert not list(tmp_path.rglob("*.pt")), list(tmp_path.rglob("*"))


def test_callback_under_barebones_says_nothing_is_logged_not_that_scalars_are(tmp_path):
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD])
    train, val = loaders()
    t = Trainer(default_root_dir=tmp_path, accelerator=ACCELERATOR, max_epochs=1, barebones=True, callbacks=[monitor])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(TinyEncoder(), train, val)
    said = [str(w.message) for w in caught if str(w.message).startswith("AttentionMonitor")]
    assert sum("Trainer(barebones=True) turns logging off, so nothing the monitor computes" in m for m in said) == 1
    assert not [message for message in said if "scalars are still logged" in message], said


def test_callback_a_monitored_sanity_pass_logs_its_scalars_at_step_0(tmp_path):
    seed_everything(0)
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], log_sanity_check=True)
    train, val = loaders()
    model = TinyEncoder()
    untrained = copy.deepcopy(model)
    t = trainer(tmp_path / "fit", [monitor], max_epochs=1, num_sanity_val_steps=2)
    t.fit(model, train, val)
    events = EventAccumulator(t.logger.log_dir, size_guidance={SCALARS: 0})
    events.Reload()
    layer = "attention_entropy/encoder.layers.0.self_attn"
    head = "attention_entropy_heads/encoder.layers.0.self_attn/head_1"
    steps = [e.step for e in events.Scalars(layer)]
    assert len(steps) == 2 and steps[0] == 0 < steps[1]  # the sanity pass, then epoch 0 where Lightning logs it
    assert [e.step for e in events.Scalars(head)] == steps
    # the sanity pass's numbers: those of a validation of its 2 batches by the untrained model
    reference = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD])
    check = trainer(tmp_path / "reference", [reference], limit_val_batches=2)
    check.validate(untrained, val, verbose=False)
    expected = last_scalars(check.logger.log_dir)
    assert events.Scalars(layer)[0].value == pytest.approx(expected[layer], rel=1e-6)
    assert events.Scalars(head)[0].value == pytest.approx(expected[head], rel=1e-6)


def test_callback_scalars_equal_in_csv_and_tensorboard_images_only_in_tensorboard(tmp_path):
    seed_everything(0)
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], sink_ids=[1])
    train, val = loaders()
    csv_logger, tb_logger = CSVLogger(tmp_path, name="csv"), TensorBoardLogger(tmp_path, name="tb")
    t = trainer(tmp_path, [monitor], logger=[csv_logger, tb_logger])
    t.fit(TinyEncoder(), train, val)
    with open(f"{csv_logger.log_dir}/metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    events = EventAccumulator(tb_logger.log_dir, size_guidance={SCALARS: 0, IMAGES: 0})
    events.Reload()
    ours = [tag for tag in events.Tags()["scalars"] if tag.startswith("attention_")]
    assert ours and set(ours) <= set(rows[0])  # every scalar tag is a CSV column
    for tag in ours:
        from_csv = [(int(row["step"]), float(row[tag])) for row in rows if row[tag] != ""]
        from_tb = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in from_csv] == [s for s, _ in from_tb], tag
        assert [v for _, v in from_csv] == pytest.approx([v for _, v in from_tb], rel=1e-6, abs=1e-7), tag
    # All per-head scalars of an epoch end are one CSV row, with its epoch, as Lightning writes the layer scalars.
    heads = [tag for tag in ours if "/head_" in tag and "_drift_" not in tag]  # drift only from the second epoch
    head_rows = [row for row in rows if any(row[tag] != "" for tag in heads)]
    assert len(heads) > 10 and [row["epoch"] for row in head_rows] == ["0", "1"]
    assert all(row[tag] != "" for row in head_rows for tag in heads)
    assert len(events.Tags()["images"]) > 0
    assert not list(Path(csv_logger.log_dir).glob("*.png"))  # images go to TensorBoard only


def nan_layers(model, layers):
    with torch.no_grad():
        for i in layers:
            model.encoder.layers[i].self_attn.in_proj_weight.fill_(float("nan"))
    return model


@pytest.mark.parametrize("layers", [[1], [0, 1]])
def test_a_layer_of_nan_weights_logs_its_skipped_rows_and_warns(tmp_path, layers):
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], num_pairs=0)
    with pytest.warns(UserWarning) as caught:
        run_validate(tmp_path, monitor, make_batches(), nan_layers(TinyEncoder(), layers))
    scalars = last_scalars(tmp_path / "tb" / "version_0")
    valid_queries = 16 * 6 - 6 * 2  # 16 rows of 6 ids, 6 of them ending in 2 pads
    messages = [str(w.message) for w in caught]
    for i in layers:
        name = f"encoder.layers.{i}.self_attn"
        assert scalars[f"attention_skipped_rows/{name}"] == valid_queries
        assert any(f"all {valid_queries} query rows that attention module {name!r}" in m for m in messages)
    assert not any("ignore_ids" in m for m in messages)  # the cause is the weights, not the ids
    if layers == [1]:
        assert scalars["attention_skipped_rows/encoder.layers.0.self_attn"] == 0
        assert "attention_entropy/encoder.layers.0.self_attn" in scalars


def test_callback_tables_show_whole_labels(tmp_path):
    """Heatmap axes trim labels to 14 characters; a table cut there would show 'international…' for every token."""
    labels = [f"internationalization_{i}" for i in range(VOCAB)]
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], id_to_token=labels, num_pairs=4)
    t = trainer(tmp_path, [monitor])
    t.validate(TinyEncoder(), loaders()[1])
    events = EventAccumulator(t.logger.log_dir, size_guidance={TENSORS: 0})
    events.Reload()
    for table, columns in (("hubs", 1), ("lift_pairs", 2), ("one_way_pairs", 2)):
        text = events.Tensors(f"attention_{table}/encoder.layers.0.self_attn/text_summary")[-1]
        rows = table_cells(text.tensor_proto.string_val[0].decode())
        assert rows and all(cell in labels for row in rows for cell in row[:columns]), table


def test_padding_the_monitor_was_not_told_of_is_named_once(tmp_path):
    """Without `ignore_ids`, the pad id stands in the sequences (C > 0) but no query sees it (the model's padding mask:
    U = 0): one warning names it and both fixes. Told of it, nothing is said."""
    said = {}
    for case, kwargs in (("untold", {}), ("told", {"ignore_ids": [PAD]})):
        seed_everything(0)
        monitor = AttentionMonitor(VOCAB, "input_ids", id_to_token=[f"w{i}" for i in range(VOCAB)], **kwargs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer(tmp_path / case, [monitor]).validate(TinyEncoder(), loaders()[1])
        said[case] = [str(w.message) for w in caught if "no query ever saw them" in str(w.message)]
    assert said["told"] == [] and len(said["untold"]) == 1
    assert "key token(s) ['w0'] of stream 'tokens'" in said["untold"][0]
    assert "`ignore_ids`" in said["untold"][0] and "`token_mask`" in said["untold"][0]
