"""What attn_callbacks 0.1.0 wrote still works: its checkpoint resumes with its drift reference, tracked ids, probe ids
and colour limits and logs what 0.1.0 logged; its exports load and the command line compares them as 0.1.0 did.

The files in tests/data were written by the 0.1.0 code (tests/data/make_data.py; the run is in
tests/data/compat_model.py) and v0_1_0.json holds what that code made of them.
"""

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import seed_everything
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import IMAGES, SCALARS, TENSORS, EventAccumulator

from attn_callbacks import load_epoch
from attn_callbacks.__main__ import main
from attn_callbacks.output.figures import abs_max

DATA = Path(__file__).resolve().parent / "data"
EXPECTED = json.loads((DATA / "v0_1_0.json").read_text())
CHECKPOINT = DATA / EXPECTED["checkpoint"]["file"]
RTOL, ATOL = 1e-5, 1e-7


def _load_compat_model():
    spec = importlib.util.spec_from_file_location("attn_compat_model", DATA / "compat_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


compat = _load_compat_model()


def close(got, expected):
    return math.isclose(got, expected, rel_tol=RTOL, abs_tol=ATOL)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """The 0.1.0 checkpoint (after epochs 0 and 1) resumed by today's code for epoch 2, as make_data.py did."""
    tmp_path = tmp_path_factory.mktemp("resumed")
    seed_everything(0)
    monitor = compat.make_monitor()
    fresh = monitor.state_dict()
    trainer = compat.make_trainer(tmp_path, monitor, TensorBoardLogger(tmp_path), EXPECTED["resumed"]["max_epochs"])
    trainer.fit(compat.CompatEncoder(), compat.train_loader(), compat.resume_val_loader(), ckpt_path=CHECKPOINT)
    events = EventAccumulator(trainer.logger.log_dir, size_guidance={IMAGES: 0, SCALARS: 0, TENSORS: 0})
    events.Reload()
    return trainer, monitor, fresh, events


def test_checkpoint_from_0_1_0_state_loads():
    # Tensors and numbers only: it loads with weights_only=True, and a monitor takes every part of it.
    saved = torch.load(CHECKPOINT, weights_only=True)["callbacks"][EXPECTED["checkpoint"]["state_key"]]
    monitor = compat.make_monitor()
    monitor.load_state_dict(saved)
    state = monitor.state_dict()
    expected = EXPECTED["checkpoint"]["state"]
    for key in ("previous_epoch", "reference_epoch", "validation_epochs", "color_limits"):
        assert state[key] == saved[key] == expected[key], key
    assert (state["previous_epoch"], state["reference_epoch"], state["validation_epochs"]) == (1, 0, 2)
    for key in ("probe_ids", "tracked_ids"):
        assert {s: t.tolist() for s, t in state[key].items()} == expected[key], key
    for key in ("previous", "reference"):  # the drift snapshots of epochs 1 and 0
        assert {m: {k: list(t.shape) for k, t in s.items()} for m, s in state[key].items()} == expected[key]
        for layer, snapshot in saved[key].items():
            for name, tensor in snapshot.items():
                assert torch.equal(state[key][layer][name], tensor), (key, layer, name)


def test_checkpoint_from_0_1_0_resumes_with_its_reference(resumed):
    trainer, monitor, fresh, _ = resumed
    saved = torch.load(CHECKPOINT, weights_only=True)["callbacks"]
    assert monitor.state_key == EXPECTED["checkpoint"]["state_key"] and monitor.state_key in saved
    saved = saved[monitor.state_key]
    assert fresh["reference_epoch"] is None and fresh["tracked_ids"] == {} and fresh["probe_ids"] is None
    assert trainer.current_epoch == 3

    state = monitor.state_dict()
    expected = EXPECTED["resumed"]["state"]
    # Epoch 0 stays the reference: its snapshot is the checkpoint's, untouched; epoch 2 is the previous one now.
    assert (state["reference_epoch"], state["previous_epoch"], state["validation_epochs"]) == (0, 2, 3)
    assert (expected["reference_epoch"], expected["previous_epoch"], expected["validation_epochs"]) == (0, 2, 3)
    assert state["reference"].keys() == saved["reference"].keys() == set(compat.LAYERS)
    for layer in compat.LAYERS:
        assert state["reference"][layer].keys() == saved["reference"][layer].keys()
        for key, tensor in saved["reference"][layer].items():
            assert torch.equal(state["reference"][layer][key], tensor), (layer, key)
    # Tracked and probe ids are the checkpoint's (counting this run's validation set would track other ids).
    tracked = state["tracked_ids"][compat.STREAM].tolist()
    assert tracked == saved["tracked_ids"][compat.STREAM].tolist() == expected["tracked_ids"][compat.STREAM]
    assert tracked != EXPECTED["resumed"]["tracked_ids_if_recounted"]
    assert state["probe_ids"].keys() == saved["probe_ids"].keys() == {compat.STREAM}
    assert torch.equal(state["probe_ids"][compat.STREAM], saved["probe_ids"][compat.STREAM])
    # The shared colour scales went on from the checkpoint's: each at least as wide, and as 0.1.0 left them.
    assert saved["color_limits"].keys() == expected["color_limits"].keys()
    new = state["color_limits"].keys() - saved["color_limits"].keys()  # the head grids came after 0.1.0
    assert saved["color_limits"].keys() <= state["color_limits"].keys()
    assert all(tag.startswith("attention_heads/") for tag in new)
    # This version rounds a scale's top up (figures.abs_max), the checkpoint's too: each is 0.1.0's, rounded up.
    for tag, limit in saved["color_limits"].items():
        limit, before, after = state["color_limits"][tag], saved["color_limits"][tag], expected["color_limits"][tag]
        assert limit >= before and close(limit, abs_max(np.array([after]))), tag

    # The drift 0.1.0 logged for epoch 2 against epoch 1 (prev) and epoch 0 (ref), per layer.
    drift = {tag: v for tag, v in EXPECTED["resumed"]["callback_metrics"].items() if tag.startswith("attention_drift/")}
    kinds = ("js_prev", "js_ref", "frobenius_prev", "frobenius_ref")
    assert drift.keys() == {f"attention_drift/{kind}/{layer}" for kind in kinds for layer in compat.LAYERS}
    for tag, value in drift.items():
        assert close(float(trainer.callback_metrics[tag]), value), (tag, float(trainer.callback_metrics[tag]), value)
    layer = compat.LAYERS[0]
    assert drift[f"attention_drift/js_prev/{layer}"] != drift[f"attention_drift/js_ref/{layer}"]


def renamed(tag):
    """0.1.0's tag as it is logged now: per-head series moved from ``{family}/...`` to ``{family}_heads/...``."""
    family, *rest = tag.split("/")
    return "/".join([f"{family}_heads", *rest]) if rest[-1].startswith("head_") else tag


def test_checkpoint_from_0_1_0_logs_every_tag_0_1_0_logged(resumed):
    trainer, _, _, events = resumed
    expected = EXPECTED["resumed"]
    for tag, value in expected["callback_metrics"].items():
        assert tag in trainer.callback_metrics, tag
        assert close(float(trainer.callback_metrics[tag]), value), (tag, float(trainer.callback_metrics[tag]), value)
    tags = events.Tags()
    missing = {renamed(tag) for tag in expected["scalars"]} - set(tags["scalars"])
    assert not missing, sorted(missing)
    for tag, want in expected["scalars"].items():  # layer and per-head scalars, one monitored epoch
        [event] = events.Scalars(renamed(tag))
        assert event.step == want["step"] and close(event.value, want["value"]), (tag, event.value, want)
    assert set(expected["images"]) <= set(tags["images"]), sorted(set(expected["images"]) - set(tags["images"]))
    assert set(expected["texts"]) <= set(tags["tensors"]), sorted(set(expected["texts"]) - set(tags["tensors"]))
    exports = Path(trainer.logger.log_dir) / "attention_epochs"
    assert sorted(p.name for p in exports.iterdir()) == expected["exports"]


@pytest.mark.parametrize("name", sorted(EXPECTED["exports"]))
def test_export_from_0_1_0_loads(name):
    expected = EXPECTED["exports"][name]
    record = load_epoch(DATA / name)
    assert (record.epoch, record.global_step) == (expected["epoch"], expected["global_step"])
    assert record.streams == {m: tuple(pair) for m, pair in expected["streams"].items()}
    assert record.labels == expected["labels"]
    assert record.vocab_ids == {}  # 0.1.0 stored none: each index is read as its id
    assert list(record.modules) == list(expected["modules"]) == compat.LAYERS
    for layer, want in expected["modules"].items():
        stats = record.modules[layer]
        assert list(stats.attention_sum.shape) == want["attention_sum_shape"] == [2, 9, 9]  # 8 tracked + <other>
        assert torch.equal(stats.attention_sum, torch.tensor(want["attention_sum"], dtype=torch.float32))
        assert torch.equal(stats.pair_count, torch.tensor(want["pair_count"], dtype=torch.int64))
        assert torch.equal(stats.query_count, torch.tensor(want["query_count"], dtype=torch.int64))
        assert int(stats.skipped_rows) == want["skipped_rows"]
        assert math.isclose(float(stats.uniform_sum.double().sum()), want["uniform_sum_total"], rel_tol=1e-12)
        assert torch.equal(stats.position_sums, torch.tensor(want["position_sums"], dtype=torch.float32))
        seen = stats.query_count > 0
        assert torch.allclose(
            stats.attention_mass[:, seen], stats.attention_sum[:, seen] / stats.query_count[seen, None], rtol=1e-6
        )


def _cells(text):
    """The printed words, line by line, the numbers as floats."""

    def cell(word):
        try:
            return float(word)
        except ValueError:
            return word

    return [[cell(word) for word in line.split()] for line in text.splitlines()]


def test_cli_compares_exports_from_0_1_0(capsys):
    cli = EXPECTED["cli_compare"]
    old, new = DATA / cli["old"], DATA / cli["new"]
    assert old.suffix == ".pt" and new.suffix == ".npz"
    assert main(["compare", str(old), str(new), *cli["args"]]) == 0
    out = capsys.readouterr().out.replace(str(old), "{old}").replace(str(new), "{new}")
    got, expected = _cells(out), _cells(cli["stdout"])
    assert len(got) == len(expected), out
    for line, want in zip(got, expected, strict=True):
        assert len(line) == len(want), (line, want)
        for a, b in zip(line, want, strict=True):
            assert close(a, b) if isinstance(b, float) else a == b, (line, want)
    # The head-averaged JS row of each layer, as 0.1.0 printed it.
    rows = [line for line in got if line[:1] in ([layer] for layer in compat.LAYERS)]
    assert [row[:2] for row in rows] == [[layer, "mean"] for layer in compat.LAYERS]
    assert all(0 < row[2] < math.log(2) for row in rows)


def test_cli_compare_of_0_1_0_exports_finds_their_labels_equal(capsys):
    # The exports of 0.1.0 carry their tracked tokens' labels: compare checks them and has nothing to warn about.
    old, new = (DATA / EXPECTED["cli_compare"][which] for which in ("old", "new"))
    assert load_epoch(old).labels == load_epoch(new).labels != {}
    assert main(["compare", str(old), str(new)]) == 0
    assert capsys.readouterr().err == ""


def test_export_names_of_0_1_0_are_what_the_default_prefix_still_writes():
    from attn_callbacks.output.epoch_files import export_name

    for name, values in EXPECTED["exports"].items():
        suffix = Path(name).suffix
        assert export_name("attention", values["epoch"], values["global_step"], suffix) == name
