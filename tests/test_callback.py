import copy
import csv
import gc
import io
import math
import pickle
import signal
from pathlib import Path, PurePosixPath
from typing import ClassVar

import numpy as np
import pytest
import torch
from _reference import (
    ACCELERATOR,
    SAME_SUMS,
    accumulate_attention_reference,
    add_loop_sums,
    copied,
    naive_js,
    returned,
    spying,
)
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import IMAGES, SCALARS, TENSORS, EventAccumulator
from torch import nn
from torch.utils.data import DataLoader

from attn_callbacks import AttentionMonitor, capture_attention, load_epoch
from attn_callbacks.accumulate import SUM_FIELDS, AttentionAccumulator
from attn_callbacks.functional import attention_mass
from attn_callbacks.streams import most_frequent_ids

VOCAB, PAD, LENGTH = 12, 0, 6


def make_batches(n=16, batch_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
    ids[::3, -2:] = PAD  # some padding
    return [{"input_ids": ids[i : i + batch_size]} for i in range(0, n, batch_size)]


class TinyEncoder(LightningModule):
    def __init__(self, fail_in_validation=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(16, VOCAB)
        self.fail_in_validation = fail_in_validation
        self.val_outputs = []

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids), src_key_padding_mask=ids == PAD))

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        return nn.functional.cross_entropy(self(ids).flatten(0, 1), ids.flatten(), ignore_index=PAD)

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        if self.fail_in_validation:
            raise RuntimeError("validation failed")
        logits = self(batch["input_ids"])
        self.val_outputs.append(logits)
        self.log("val_loss", nn.functional.cross_entropy(logits.flatten(0, 1), batch["input_ids"].flatten()))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def collate(items):
    return items[0]


def loaders():
    return DataLoader(make_batches(), batch_size=1, collate_fn=collate), DataLoader(
        make_batches(seed=1), batch_size=1, collate_fn=collate
    )


def trainer(tmp_path, callbacks, logger=None, **kwargs):
    kwargs.setdefault("max_epochs", 2)
    return Trainer(
        default_root_dir=tmp_path,
        accelerator=ACCELERATOR,
        logger=logger if logger is not None else TensorBoardLogger(tmp_path, name="tb"),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **kwargs,
    )


def no_hooks(model):
    return not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


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
        for table, count in (("one_way_pairs", 2), ("lift_pairs", 2), ("hubs", 2), ("drift_tokens", 1)):
            text = events.Tensors(f"attention_{table}/{layer}/text_summary")  # add_text's own suffix
            assert len(text) == count and text[-1].tensor_proto.string_val[0].startswith(b"| ")
        text = events.Tensors(f"attention_one_way_pairs/{layer}/text_summary")
        assert b"| query a | key b |" in text[-1].tensor_proto.string_val[0]
        # epoch 0 is both the reference and the previous epoch: each moved token's two JS columns agree
        drift = events.Tensors(f"attention_drift_tokens/{layer}/text_summary")[-1].tensor_proto.string_val[0]
        rows = [line.split(" | ") for line in drift.decode().splitlines()[2:]]
        assert rows and all(row[1] == row[2] for row in rows)
    js = events.Scalars(f"attention_drift/js_prev/{layers[0]}")[0].value
    assert 0 < js <= math.log(2)  # the model trained between the two epochs
    assert js == events.Scalars(f"attention_drift/js_ref/{layers[0]}")[0].value  # epoch 0 is both
    asym = [e.value for e in events.Scalars(f"attention_asymmetry/{layers[0]}")]
    assert all(0.0 <= v <= 1.0 for v in asym)
    entropy = [e.value for e in events.Scalars(f"attention_entropy/{layers[0]}")]
    assert all(0.0 < v <= math.log(VOCAB) for v in entropy)


class Recorder(AttentionMonitor):
    """Keeps the computed stats of the last epoch to compare against an independent reference."""

    def on_validation_epoch_end(self, trainer, pl_module):
        self.last = getattr(self, "last", {})

        def keep(result):
            self.last.update({name: copied(stats) for name, stats in result[1].items()})

        with returned(self._sums, "collect", keep):
            super().on_validation_epoch_end(trainer, pl_module)


def test_callback_sums_equal_reference_from_manually_captured_weights(tmp_path):
    seed_everything(0)
    monitor = Recorder(VOCAB, "input_ids", ignore_ids=[PAD])
    model = TinyEncoder()
    _, val = loaders()
    t = trainer(tmp_path, [monitor])
    t.validate(model, val)
    stats = monitor.last["encoder.layers.1.self_attn"]
    # reference: per-head weights recomputed directly from the layer with need_weights=True, loop-accumulated
    S = torch.zeros(2, VOCAB, VOCAB, dtype=torch.float64)
    Q = torch.zeros(VOCAB, dtype=torch.float64)
    with torch.no_grad():
        for batch in make_batches(seed=1):
            ids = batch["input_ids"]
            x = model.encoder.layers[0](model.embed(ids), src_key_padding_mask=ids == PAD)
            attn = model.encoder.layers[1].self_attn
            _, w = attn(x, x, x, key_padding_mask=ids == PAD, need_weights=True, average_attn_weights=False)
            add_loop_sums(S, Q, ids, w, PAD)
    torch.testing.assert_close(stats.attention_sum.double(), S, rtol=1e-4, atol=1e-5)
    assert torch.equal(stats.query_count.double(), Q)
    P = stats.attention_mass
    seen = Q > 0
    torch.testing.assert_close(P.sum(-1)[:, seen], torch.ones(2, int(seen.sum())), rtol=1e-5, atol=1e-5)
    assert no_hooks(model)


def test_callback_does_not_change_validation_outputs(tmp_path):
    outputs = []
    for callbacks in ([], [AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD])]):
        seed_everything(0)
        model = TinyEncoder()
        _, val = loaders()
        trainer(tmp_path, callbacks).validate(model, val, verbose=False)
        outputs.append(torch.cat(model.val_outputs))
    ids = torch.cat([b["input_ids"] for b in make_batches(seed=1)])
    real = ids != PAD  # padded positions: zeros on the nested-tensor fast path, computed densely while hooked
    assert float((outputs[0] - outputs[1])[real].abs().max()) <= 1e-6


def test_callback_exception_in_validation_leaves_no_hooks_and_restores_fastpath(tmp_path):
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD])
    model = TinyEncoder(fail_in_validation=True)
    train, val = loaders()
    with pytest.raises(RuntimeError, match="validation failed"):
        trainer(tmp_path, [monitor], num_sanity_val_steps=0).fit(model, train, val)
    assert no_hooks(model) and torch.backends.mha.get_fastpath_enabled()
    assert all(int(m.query_count.sum()) == 0 for m in monitor._sums.metrics.values())


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


def test_callback_under_fast_dev_run_says_why_there_are_no_images(tmp_path):
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD])
    train, val = loaders()
    t = trainer(tmp_path, [monitor], fast_dev_run=True)  # a TensorBoardLogger given, replaced by Lightning
    with pytest.warns(UserWarning, match="fast_dev_run replaces the Trainer's loggers with a dummy one"):
        t.fit(TinyEncoder(), train, val)


def test_two_monitors_on_one_trainer_log_the_same_numbers_and_restore_the_fastpath(tmp_path):
    # The first monitor's hook used to hand the caller's (out, None) on to the second, which then saw no weights.
    seed_everything(0)
    first = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], prefix="first")
    second = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], prefix="second", per_head=False)
    model = TinyEncoder()
    train, val = loaders()
    t = trainer(tmp_path, [first, second])
    t.fit(model, train, val)
    assert no_hooks(model) and torch.backends.mha.get_fastpath_enabled()
    metrics = t.callback_metrics
    layer_scalars = [tag for tag in metrics if tag.startswith("first_")]
    assert len(layer_scalars) > 10
    for tag in layer_scalars:  # per_head=False keeps the mean of the heads: the layer scalars are the same
        torch.testing.assert_close(metrics[tag.replace("first_", "second_", 1)], metrics[tag], rtol=1e-5, atol=1e-6)


def test_callback_per_head_scalars_skip_the_sanity_check_like_lightnings_own_scalars(tmp_path):
    seed_everything(0)
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], log_sanity_check=True)
    train, val = loaders()
    t = trainer(tmp_path, [monitor], max_epochs=1, num_sanity_val_steps=2)
    t.fit(TinyEncoder(), train, val)
    events = EventAccumulator(t.logger.log_dir, size_guidance={SCALARS: 0})
    events.Reload()
    layer = "attention_entropy/encoder.layers.0.self_attn"
    assert len(events.Scalars(layer)) == 1  # epoch 0 only: Lightning drops what the sanity check logs
    head = "attention_entropy_heads/encoder.layers.0.self_attn/head_1"
    assert [e.step for e in events.Scalars(head)] == [events.Scalars(layer)[0].step]


def test_callback_scalars_reach_csv_and_tensorboard_with_the_same_values_and_images_only_tensorboard(tmp_path):
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


def test_callback_log_every_n_epochs_hooks_only_logged_epochs(tmp_path):
    seed_everything(0)
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], log_every_n_epochs=2, per_head=False)
    train, val = loaders()
    t = trainer(tmp_path, [monitor], num_sanity_val_steps=0)
    t.fit(TinyEncoder(), train, val)
    events = EventAccumulator(t.logger.log_dir, size_guidance={IMAGES: 0, SCALARS: 0})
    events.Reload()
    assert len(events.Scalars("attention_entropy/encoder.layers.0.self_attn")) == 1  # epoch 0 only of 0, 1
    assert "attention_mass_heads/encoder.layers.0.self_attn" not in events.Tags()["images"]


def test_callback_log_every_n_epochs_counts_validation_epochs_and_a_skipped_reference_epoch_moves_on(tmp_path):
    # Validation after training epochs 1, 3, 5 only: the 1st and 3rd are monitored (epoch % 2 never was 0, so nothing
    # was). drift_reference_epoch=3 is not monitored: epoch 5, the next monitored one, becomes the reference.
    seed_everything(0)
    monitor = AttentionMonitor(
        VOCAB, "input_ids", ignore_ids=[PAD], log_every_n_epochs=2, per_head=False, drift_reference_epoch=3
    )
    train, val = loaders()
    t = trainer(tmp_path, [monitor], num_sanity_val_steps=0, max_epochs=6, check_val_every_n_epoch=2)
    with pytest.warns(UserWarning, match="`drift_reference_epoch`=3 .* epoch 5, the first monitored one after it"):
        t.fit(TinyEncoder(), train, val)
    events = EventAccumulator(t.logger.log_dir, size_guidance={SCALARS: 0})
    events.Reload()
    layer = "encoder.layers.0.self_attn"
    epochs = {e.step: e.value for e in events.Scalars("epoch")}
    assert [epochs[e.step] for e in events.Scalars(f"attention_entropy/{layer}")] == [1.0, 5.0]
    assert [epochs[e.step] for e in events.Scalars(f"attention_drift/js_prev/{layer}")] == [5.0]
    assert f"attention_drift/js_ref/{layer}" not in events.Tags()["scalars"]  # compared from the epoch after it on
    assert monitor.state_dict()["validation_epochs"] == 3 and monitor.state_dict()["reference_epoch"] == 5


def test_callback_validate_is_always_monitored_and_not_counted_and_old_checkpoints_keep_the_epoch_rule(tmp_path):
    seed_everything(0)
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], log_every_n_epochs=2, per_head=False)
    model, (train, val) = TinyEncoder(), loaders()
    layer = "attention_entropy/encoder.layers.0.self_attn"
    for _ in range(2):  # a baseline before fit: asked for, so watched, and fit's count does not move
        trainer(tmp_path, [monitor]).validate(model, val, verbose=False)
        assert monitor.state_dict()["validation_epochs"] == 0
    t = trainer(tmp_path, [monitor], num_sanity_val_steps=0, max_epochs=3)
    t.fit(model, train, val)
    events = EventAccumulator(t.logger.log_dir, size_guidance={SCALARS: 0})
    events.Reload()
    epochs = {e.step: e.value for e in events.Scalars("epoch")}
    assert [epochs[e.step] for e in events.Scalars(layer)] == [0.0, 2.0] and monitor._schedule.validation_epochs == 3
    # A checkpoint from before the count, resumed after epoch 2: training epochs % n, the rule it was saved under,
    # monitors epoch 4 (a count from 0 would monitor epoch 3).
    path = tmp_path / "old.ckpt"
    t.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    del checkpoint["callbacks"][monitor.state_key]["validation_epochs"]
    torch.save(checkpoint, path)
    resumed = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], log_every_n_epochs=2, per_head=False)
    t = trainer(tmp_path / "resumed", [resumed], num_sanity_val_steps=0, max_epochs=5)
    t.fit(model, train, val, ckpt_path=path)
    events = EventAccumulator(t.logger.log_dir, size_guidance={SCALARS: 0})
    events.Reload()
    epochs = {e.step: e.value for e in events.Scalars("epoch")}
    assert [epochs[e.step] for e in events.Scalars(layer)] == [4.0] and resumed._schedule.validation_epochs is None


class Seq2Seq(LightningModule):
    def __init__(self, src_vocab=7, tgt_vocab=9, batch_first=True):
        super().__init__()
        self.src_embed, self.tgt_embed = nn.Embedding(src_vocab, 16), nn.Embedding(tgt_vocab, 16)
        self.transformer = nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=batch_first)
        self.batch_first = batch_first

    def validation_step(self, batch, batch_idx):
        src, tgt = batch["src"], batch["tgt"]  # (B, L) when batch_first else (L, B)
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1 if self.batch_first else 0], tgt.device)
        self.transformer(self.src_embed(src), self.tgt_embed(tgt), tgt_mask=mask, tgt_is_causal=True)


@pytest.mark.parametrize("batch_first", [True, False])
def test_callback_cross_attention_streams_for_nn_transformer(tmp_path, batch_first):
    seed_everything(0)
    g = torch.Generator().manual_seed(0)
    batches = [{"src": torch.randint(0, 7, (3, 5), generator=g), "tgt": torch.randint(0, 9, (3, 4), generator=g)}]
    if not batch_first:
        batches = [{k: v.T for k, v in b.items()} for b in batches]
    monitor = Recorder({"src": 7, "tgt": 9}, {"src": "src", "tgt": "tgt"}, batch_first=batch_first)
    model = Seq2Seq(batch_first=batch_first)
    trainer(tmp_path, [monitor]).validate(model, DataLoader(batches, batch_size=None))
    cross = monitor.last["transformer.decoder.layers.0.multihead_attn"]
    assert cross.attention_sum.shape == (2, 9, 7)
    b = batches[0] if batch_first else {k: v.T for k, v in batches[0].items()}
    assert torch.equal(cross.query_count, torch.bincount(b["tgt"].flatten(), minlength=9))
    # cross-attention rows sum to 1 over the source vocabulary for every target token seen
    seen = cross.query_count > 0
    torch.testing.assert_close(cross.attention_mass[:, seen].sum(-1), torch.ones(2, int(seen.sum())))
    # decoder self-attention is causal: the first target token attends only to itself
    dec = monitor.last["transformer.decoder.layers.0.self_attn"]
    assert dec.attention_sum.shape == (2, 9, 9)
    # reference from the captured weights through the functional core
    with torch.no_grad():
        src, tgt = b["src"], b["tgt"]
        memory = model.transformer.encoder(model.src_embed(src if batch_first else src.T))
        x = model.transformer.decoder.layers[0]
        tgt_x = model.tgt_embed(tgt if batch_first else tgt.T)
        mask = nn.Transformer.generate_square_subsequent_mask(4)
        h = x.norm1(tgt_x + x._sa_block(tgt_x, mask, None, is_causal=True))
        _, w = x.multihead_attn(h, memory, memory, need_weights=True, average_attn_weights=False)
    S, C, Q = torch.zeros(2, 9, 7), torch.zeros(9, 7, dtype=torch.long), torch.zeros(9, dtype=torch.long)
    ones = torch.ones_like
    accumulate_attention_reference(S, C, Q, w, tgt, src, ones(tgt, dtype=torch.bool), ones(src, dtype=torch.bool))
    torch.testing.assert_close(cross.attention_mass, attention_mass(S, Q), rtol=1e-5, atol=1e-6)


class BareModel(LightningModule):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def validation_step(self, batch, batch_idx):
        pass


def run_validate(tmp_path, monitor, batches, model=None):
    model = model or TinyEncoder()
    trainer(tmp_path, [monitor]).validate(model, DataLoader(batches, batch_size=None), verbose=False)
    return model


@pytest.mark.parametrize(
    ("kwargs", "batches", "error", "match"),
    [
        ({}, [{"input_ids": torch.full((2, LENGTH), VOCAB)}], ValueError, f"Token id {VOCAB} of stream 'tokens'"),
        ({}, [{"input_ids": torch.full((2, LENGTH), -3)}], ValueError, "Token id -3 .*outside the vocabulary"),
        ({}, [{"input_ids": torch.ones(2, LENGTH)}], ValueError, "integer token ids for stream 'tokens'.*float32"),
        (
            {},
            [{"other": torch.ones(2, LENGTH, dtype=torch.long)}],
            KeyError,
            "Batch key 'input_ids'.*keys: \\['other'\\]",
        ),
        (
            {"token_ids": lambda b: b["input_ids"][:, :-1]},
            [{"input_ids": torch.ones(2, LENGTH, dtype=torch.long)}],
            ValueError,
            "module 'encoder.layers.0.self_attn'.*\\(2, 2, 6, 6\\).*\\(2, 5\\)",
        ),
        ({}, [{"input_ids": torch.ones(2, LENGTH, 1, dtype=torch.long)}], ValueError, "\\(B, L\\).*\\(2, 6, 1\\)"),
        ({}, [{"input_ids": torch.ones(2, LENGTH, dtype=torch.bool)}], ValueError, "integer token ids.*torch.bool"),
        ({}, [{"input_ids": [[1, 2]]}], ValueError, "stream 'tokens' to be a Tensor, but got list"),
        (
            {"token_ids": lambda b: b["missing"]},
            [{"input_ids": torch.ones(2, LENGTH, dtype=torch.long)}],
            RuntimeError,
            "The `token_ids` callable for stream 'tokens' raised KeyError\\('missing'\\)",
        ),
        (
            {"token_ids": 3},
            [(torch.ones(2, LENGTH, dtype=torch.long),)],
            KeyError,
            "Batch index 3 of argument `token_ids`.*batch of 1 items",
        ),
    ],
)
def test_callback_bad_batch_input_raises_clear_error(tmp_path, kwargs, batches, error, match):
    monitor = AttentionMonitor(VOCAB, **{"token_ids": "input_ids", **kwargs})
    model = TinyEncoder()
    with pytest.raises(error, match=match):
        run_validate(tmp_path, monitor, batches, model)
    assert no_hooks(model) and torch.backends.mha.get_fastpath_enabled()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"vocab_size": 0}, "`vocab_size` to be a positive integer, but got 0"),
        ({"vocab_size": -3}, "`vocab_size` to be a positive integer, but got -3"),
        ({"vocab_size": {"src": 5}, "token_ids": {"src": "a", "tgt": "b"}}, "`vocab_size` has no entry for .*'tgt'"),
        ({"vocab_size": 5, "token_ids": 3.5}, "`token_ids`.*but got 3.5"),
        ({"vocab_size": 5, "top_k": 0}, "`top_k` to be a positive integer, but got 0"),
        ({"vocab_size": 5, "ignore_ids": [0.5]}, "`ignore_ids`.*\\[0.5\\]"),
        ({"vocab_size": 5, "log_every_n_epochs": -1}, "`log_every_n_epochs`.*-1"),
        ({"vocab_size": {"tokens": 5, "tgt": 3}}, "`vocab_size` names stream\\(s\\) \\['tgt'\\] that argument"),
        ({"vocab_size": True}, "`vocab_size` to be a positive integer, but got True"),
        ({"vocab_size": 5, "modules": "encoder.*"}, "`modules` to be a list of fnmatch patterns, but got 'encoder"),
        ({"vocab_size": 5, "prefix": ""}, "`prefix` to be a non-empty string, but got ''"),
        ({"vocab_size": 5, "probe_samples": 0}, "`probe_samples` to be a positive integer, but got 0"),
        ({"vocab_size": 5, "per_head": "False"}, "`per_head` to be True or False, but got 'False'"),
        ({"vocab_size": 5, "batch_first": None}, "`batch_first` to be True or False, but got None"),
        ({"vocab_size": 5, "validate_args": 0}, "`validate_args` to be True or False, but got 0"),
        ({"vocab_size": 5, "id_to_token": 5}, "`id_to_token` to be a sequence of labels.*but got 5"),
        ({"vocab_size": 5, "id_to_token": "abc"}, "`id_to_token` to be a sequence of labels.*but got 'abc'"),
        (
            {"vocab_size": 5, "id_to_token": {f"w{i}": i for i in range(100)}},  # get_vocab(): token -> id
            "`id_to_token` maps ids to labels.*keys \\['w0', 'w1', 'w2', 'w3', 'w4'\\] \\(a tokenizer's get_vocab",
        ),
        (
            {
                "vocab_size": {"src": 5, "tgt": 5},
                "token_ids": {"src": "s", "tgt": "t"},
                "id_to_token": {"src": ["x"], "target": ["y"]},
            },
            "`id_to_token` names unknown stream\\(s\\) \\['target'\\]",
        ),
        (
            {"vocab_size": 5, "id_to_token": {1: "a", "b": "c"}},
            "`id_to_token` maps ids to labels, so its keys must be integer ids, but it has keys \\['b'\\]",
        ),
        (
            {"vocab_size": {"src": 5}, "token_ids": {"src": "s"}, "id_to_token": {"src": {"the": 1}}},
            "`id_to_token` for stream 'src' maps ids to labels.*keys \\['the'\\].*get_vocab",
        ),
        ({"vocab_size": 5, "export_dir": 5}, "`export_dir` to be a path \\(str or Path\\) or None, but got 5"),
        (
            {"vocab_size": 5, "attention_streams": ["x"]},
            "`attention_streams` to map module name patterns.*but got \\['x'\\]",
        ),
        (
            {"vocab_size": 5, "attention_streams": {"*": "src"}},
            "`attention_streams` to map.*but got \\{'\\*': 'src'\\}",
        ),
        ({"vocab_size": 5, "memory_budget": 0.5}, "`memory_budget` to be a positive number of bytes.*but got 0.5"),
    ],
)
def test_callback_bad_arguments_raise_naming_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AttentionMonitor(**kwargs)


def test_callback_accepts_numpy_and_path_like_arguments():
    labels = np.array([f"tok{i}" for i in range(VOCAB)])
    monitor = AttentionMonitor(VOCAB, "input_ids", id_to_token=labels, per_head=np.bool_(False))
    assert monitor.per_head is False and monitor._streams.label([3], "tokens") == ["tok3"]
    monitor = AttentionMonitor(VOCAB, "input_ids", id_to_token={np.int64(3): "three"}, export_dir=PurePosixPath("x"))
    assert monitor._streams.label([3, 4], "tokens") == ["three", "4"]


def test_callback_misconfigured_model_fails_in_setup_naming_module(tmp_path):
    with pytest.raises(
        MisconfigurationException,
        match="No torch.nn.MultiheadAttention, Hugging Face attention module or module calling "
        "scaled_dot_product_attention "
        "found in the model",
    ):
        run_validate(
            tmp_path, AttentionMonitor(VOCAB), [{"input_ids": torch.ones(1, 2, dtype=torch.long)}], BareModel()
        )
    two_streams = AttentionMonitor({"a": VOCAB, "b": VOCAB}, {"a": "input_ids", "b": "input_ids"})
    with pytest.raises(MisconfigurationException, match="No token stream for attention module 'encoder.layers.0"):
        run_validate(tmp_path, two_streams, make_batches())
    unknown = AttentionMonitor(VOCAB, "input_ids", attention_streams={"*": ("tokens", "nope")})
    with pytest.raises(MisconfigurationException, match="unknown stream\\(s\\) \\['nope'\\]"):
        run_validate(tmp_path, unknown, make_batches())
    no_match = AttentionMonitor(VOCAB, "input_ids", modules=["decoder.*"])
    with pytest.raises(MisconfigurationException, match="Pattern 'decoder.\\*' in argument `modules` matched no "):
        run_validate(tmp_path, no_match, make_batches())
    not_attention = AttentionMonitor(VOCAB, "input_ids", modules=["head"])
    with pytest.raises(MisconfigurationException, match="Pattern 'head'.*only modules that are not attention modules"):
        run_validate(tmp_path, not_attention, make_batches())


class MaskedRowModel(LightningModule):
    """Query position 1 may see no key at all: its attention row is NaN on PyTorch's normal path."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def validation_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        mask = torch.zeros(ids.shape[1], ids.shape[1], dtype=torch.bool, device=ids.device)
        mask[1] = True  # True = not allowed to attend
        x = self.embed(ids)
        self.attn(x, x, x, attn_mask=mask, need_weights=False)


def test_callback_nan_rows_are_counted_skipped_and_warned_once(tmp_path):
    ids = torch.randint(1, VOCAB, (3, LENGTH), generator=torch.Generator().manual_seed(0))
    monitor = Recorder(VOCAB, "input_ids")
    t = trainer(tmp_path, [monitor])
    with pytest.warns(
        UserWarning, match="6 query rows of attention module 'attn' had non-finite or all-zero weights"
    ) as record:
        t.validate(MaskedRowModel(), DataLoader([{"input_ids": ids}] * 2, batch_size=None), verbose=False)
    assert sum("non-finite" in str(w.message) for w in record) == 1
    stats = monitor.last["attn"]
    assert int(stats.skipped_rows) == 6 and float(t.callback_metrics["attention_skipped_rows/attn"]) == 6.0
    assert int(stats.query_count.sum()) == 2 * 3 * (LENGTH - 1)  # the NaN rows are not counted as queries
    assert torch.isfinite(stats.attention_sum).all()
    seen = stats.query_count > 0
    torch.testing.assert_close(stats.attention_mass.sum(-1)[:, seen], torch.ones(2, int(seen.sum())))


def last_scalars(log_dir, part=""):
    """The last value of every scalar tag containing ``part`` in the event files under ``log_dir``."""
    events = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0})
    events.Reload()
    return {tag: events.Scalars(tag)[-1].value for tag in events.Tags()["scalars"] if part in tag}


def drift_scalars(log_dir):
    return {**last_scalars(log_dir, "_drift/"), **last_scalars(log_dir, "_drift_heads/")}


def checkpointed_fit(tmp_path, name, max_epochs, ckpt_path=None):
    seed_everything(0)
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], min_support=1)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0)
    train, val = loaders()
    t = Trainer(
        default_root_dir=tmp_path,
        max_epochs=max_epochs,
        accelerator=ACCELERATOR,
        logger=TensorBoardLogger(tmp_path, name=name),
        callbacks=[monitor, checkpoint],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    t.fit(TinyEncoder(), train, val, ckpt_path=ckpt_path)
    return t, monitor


def test_callback_resumed_run_logs_the_same_drift_as_an_uninterrupted_one(tmp_path):
    straight, _ = checkpointed_fit(tmp_path / "a", "straight", max_epochs=3)
    expected = drift_scalars(straight.logger.log_dir)
    _, monitor = checkpointed_fit(tmp_path / "b", "first", max_epochs=2)
    last = tmp_path / "b" / "ckpt" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=True)  # the callback state is plain tensors and numbers
    state = checkpoint["callbacks"][monitor.state_key]
    assert state["previous_epoch"] == 1 and state["reference_epoch"] == 0
    resumed, _ = checkpointed_fit(tmp_path / "b", "resumed", max_epochs=3, ckpt_path=last)
    got = drift_scalars(resumed.logger.log_dir)
    assert len(expected) == 2 * 4 * 3  # 2 layers x {js, frobenius} x {prev, ref} x (layer + 2 heads)
    assert got.keys() == expected.keys()
    for tag, value in expected.items():
        assert math.isclose(got[tag], value, rel_tol=1e-5, abs_tol=1e-7), tag
    assert (
        expected["attention_drift/js_prev/encoder.layers.0.self_attn"]
        != expected["attention_drift/js_ref/encoder.layers.0.self_attn"]
    )  # epoch 2 against epoch 1 and against epoch 0 really differ


class SinkModel(LightningModule):
    """Every query may only see key position 0, which always holds token 0 (BOS): all attention is on the sink."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def validation_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        mask = torch.full((ids.shape[1], ids.shape[1]), float("-inf"), device=ids.device)
        mask[:, 0] = 0.0
        x = self.embed(ids)
        self.attn(x, x, x, attn_mask=mask, need_weights=False)


def test_callback_sink_mass_and_position_statistics_of_a_model_forced_onto_token_0(tmp_path):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (8, LENGTH), generator=g)
    ids[:, 0] = 0
    batches = [{"input_ids": ids[:4]}, {"input_ids": ids[4:]}]
    monitor = Recorder(VOCAB, "input_ids", sink_ids=[0], entropy_collapse_threshold=0.1)
    t = trainer(tmp_path, [monitor])
    with pytest.warns(UserWarning, match="head 0 of attention module 'attn' has normalised entropy 0.000"):
        t.validate(SinkModel(), DataLoader(batches, batch_size=None), verbose=False)
    logged = last_scalars(t.logger.log_dir)
    expected = {
        "sink_mass": 1.0,  # every row puts all its weight on token 0
        "entropy": 0.0,
        "entropy_normalized": 0.0,
        "self": 1 / LENGTH,  # only row i = 0 looks at itself
        "previous": 1 / LENGTH,  # only row i = 1 looks at i - 1 = 0
        "next": 0.0,
        "distance": sum(range(LENGTH)) / LENGTH,  # row i looks |i - 0| = i away
    }
    for stat, value in expected.items():
        for tag in ("attention_position/{}/attn", "attention_position_heads/{}/attn/head_0", "{}/attn/head_1"):
            tag = tag if tag.startswith("attention") else f"attention_position_heads/{tag}"
            assert math.isclose(logged[tag.format(stat)], value, abs_tol=1e-6), stat
    # The mask leaves one visible key per row, so uniform attention would do the same: lift exactly 1.
    assert math.isclose(logged["attention_lift/attn"], 1.0, rel_tol=1e-6)
    stats = monitor.last["attn"]
    assert torch.equal(stats.uniform_sum[:, 0], stats.query_count.float())


def test_callback_rejects_bad_insight_arguments():
    with pytest.raises(ValueError, match="`probe` to be 'first', a batch or None, but got 'last'"):
        AttentionMonitor(VOCAB, probe="last")
    with pytest.raises(ValueError, match="needs argument `probe_forward`"):
        AttentionMonitor(VOCAB, probe={"input_ids": torch.ones(1, 2, dtype=torch.long)})
    with pytest.raises(ValueError, match="`export` to be 'pt', 'npz' or None, but got 'csv'"):
        AttentionMonitor(VOCAB, export="csv")
    with pytest.raises(ValueError, match="`entropy_collapse_threshold` to be in \\[0, 1\\], but got 2"):
        AttentionMonitor(VOCAB, entropy_collapse_threshold=2)
    with pytest.raises(ValueError, match="`sink_ids` names unknown stream\\(s\\) \\['nope'\\]"):
        AttentionMonitor(VOCAB, sink_ids={"nope": [0]})
    with pytest.raises(ValueError, match="`drift_reference_epoch` to be an integer >= 0, but got -1"):
        AttentionMonitor(VOCAB, drift_reference_epoch=-1)
    with pytest.raises(MisconfigurationException, match="`sink_ids` has id\\(s\\) \\[99\\] outside the vocabulary"):
        AttentionMonitor(VOCAB, sink_ids=[99]).setup(None, TinyEncoder(), "fit")


class ProbeRecorder(AttentionMonitor):
    """Keeps the probe weights each epoch renders."""

    def on_validation_epoch_end(self, trainer, pl_module):
        self.probes = getattr(self, "probes", [])

        def keep(name, *args):
            self.probes.append((name, self._probe.weights.get(name)))

        with spying(self._report, "_probe_maps", keep):
            super().on_validation_epoch_end(trainer, pl_module)


def test_callback_probe_first_batch_is_frozen_and_equals_the_models_attention(tmp_path):
    seed_everything(0)
    monitor = ProbeRecorder(VOCAB, "input_ids", ignore_ids=[PAD], probe="first", probe_samples=2)
    model = TinyEncoder()
    train, val = loaders()
    t = trainer(tmp_path, [monitor], num_sanity_val_steps=0)
    t.fit(model, train, val)
    events = EventAccumulator(t.logger.log_dir, size_guidance={IMAGES: 0})
    events.Reload()
    for sample in range(2):
        assert len(events.Images(f"attention_probe/encoder.layers.1.self_attn/sample_{sample}")) == 2
    frozen = make_batches(seed=1)[0]["input_ids"][:2]
    assert torch.equal(monitor._probe.ids["tokens"], frozen)
    with torch.no_grad(), capture_attention(model.eval(), ["encoder.layers.1.self_attn"]) as weights:
        model(frozen)
    name, last = monitor.probes[-1]
    assert name == "encoder.layers.1.self_attn"
    torch.testing.assert_close(last, weights[name][0], rtol=1e-5, atol=1e-6)


def test_callback_probe_first_warns_when_the_validation_loader_shuffles(tmp_path):
    seed_everything(0)
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], probe="first")
    train, _ = loaders()
    val = DataLoader(make_batches(seed=1), batch_size=1, collate_fn=collate, shuffle=True)
    with pytest.warns(UserWarning, match="no longer starts with the frozen probe samples"):
        trainer(tmp_path, [monitor], num_sanity_val_steps=0, max_epochs=4).fit(TinyEncoder(), train, val)


def test_callback_probe_batch_with_probe_forward_does_not_touch_the_sums(tmp_path):
    g = torch.Generator().manual_seed(0)
    batches = [{"src": torch.randint(0, 7, (3, 5), generator=g), "tgt": torch.randint(0, 9, (3, 4), generator=g)}]
    probe = {"src": torch.tensor([[1, 2, 3]]), "tgt": torch.tensor([[4, 5]])}
    results = []
    for kwargs in ({}, {"probe": probe, "probe_forward": lambda module, batch: module.validation_step(batch, 0)}):
        seed_everything(0)
        monitor = Recorder({"src": 7, "tgt": 9}, {"src": "src", "tgt": "tgt"}, **kwargs)
        t = trainer(tmp_path, [monitor])
        t.validate(Seq2Seq(), DataLoader(batches, batch_size=None), verbose=False)
        results.append((monitor.last, t))
    (plain, _), (probed, t) = results
    for name, stats in plain.items():
        torch.testing.assert_close(stats.attention_sum, probed[name].attention_sum, **SAME_SUMS, msg=name)
    events = EventAccumulator(t.logger.log_dir, size_guidance={IMAGES: 0})
    events.Reload()
    image = events.Images("attention_probe/transformer.decoder.layers.0.multihead_attn/sample_0")[0]
    assert Image.open(io.BytesIO(image.encoded_image_string)).width > 200


class StageModel(TinyEncoder):
    """Asserts inside its own steps whether attention is hooked."""

    def __init__(self, hooked_in_test=False):
        super().__init__()
        self.hooked_in_test = hooked_in_test
        self.train_losses = []

    def training_step(self, batch, batch_idx):
        assert no_hooks(self), "training must never be hooked"
        loss = super().training_step(batch, batch_idx)
        self.train_losses.append(loss.detach())
        return loss

    def test_step(self, batch, batch_idx):
        assert no_hooks(self) != self.hooked_in_test
        self(batch["input_ids"])

    def predict_step(self, batch, batch_idx):
        assert no_hooks(self), "predict is never hooked"
        return self(batch["input_ids"])


def test_callback_test_and_predict_are_not_hooked_unless_asked(tmp_path):
    _, val = loaders()
    t = trainer(tmp_path, [AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD])])
    t.test(StageModel(), val, verbose=False)
    t.predict(StageModel(), val)
    assert not any(k.startswith("attention") for k in t.callback_metrics)
    asked = trainer(tmp_path, [AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], monitor_test=True)])
    model = StageModel(hooked_in_test=True)
    asked.test(model, val, verbose=False)
    assert no_hooks(model) and torch.backends.mha.get_fastpath_enabled()
    assert "attention_test_entropy/encoder.layers.0.self_attn" in asked.callback_metrics
    assert not any(k.startswith(("attention_drift", "attention_test_drift")) for k in asked.callback_metrics)


def test_callback_keyboard_interrupt_in_validation_leaves_no_hooks_and_no_sums(tmp_path):
    class Interrupted(TinyEncoder):
        def validation_step(self, batch, batch_idx):
            if batch_idx == 1:
                raise KeyboardInterrupt
            return super().validation_step(batch, batch_idx)

    handler = signal.getsignal(signal.SIGINT)
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD])
    model = Interrupted()
    train, val = loaders()
    try:
        with pytest.raises(SystemExit):  # Lightning's graceful shutdown after Ctrl+C
            trainer(tmp_path, [monitor], num_sanity_val_steps=0).fit(model, train, val)
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores further Ctrl+C from then on
    assert no_hooks(model) and torch.backends.mha.get_fastpath_enabled()
    assert monitor._sums.metrics and all(int(m.query_count.sum()) == 0 for m in monitor._sums.metrics.values())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"limit_val_batches": 0},
        {"fast_dev_run": True},
        {"num_sanity_val_steps": 2, "limit_val_batches": 1},
    ],
    ids=["limit_val_batches=0", "fast_dev_run", "sanity_steps"],
)
def test_callback_trainer_exit_paths_leave_no_hooks_and_train_identically(tmp_path, kwargs):
    losses = []
    for callbacks in ([], [AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD])]):
        seed_everything(0)
        model = StageModel()
        train, val = loaders()
        trainer(tmp_path, callbacks, **kwargs).fit(model, train, val)
        assert no_hooks(model) and torch.backends.mha.get_fastpath_enabled()
        losses.append((torch.stack(model.train_losses), [p.detach().clone() for p in model.parameters()]))
    (loss_a, params_a), (loss_b, params_b) = losses
    assert float((loss_a - loss_b).abs().max()) <= 1e-6
    assert all(float((a - b).abs().max()) <= 1e-6 for a, b in zip(params_a, params_b, strict=True))


def test_callback_empty_validation_set_and_all_padding_epoch_log_nothing(tmp_path):
    train, _ = loaders()
    model = TinyEncoder()
    empty = trainer(tmp_path, [AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD])])
    empty.fit(model, train, DataLoader([], batch_size=None))
    assert no_hooks(model) and torch.backends.mha.get_fastpath_enabled()
    assert not any(k.startswith("attention") for k in empty.callback_metrics)
    padding = [{"input_ids": torch.full((2, LENGTH), PAD)}]
    t = trainer(tmp_path, [AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD])])
    with pytest.warns(UserWarning, match="no valid query token was seen in this epoch"):
        t.validate(TinyEncoder(), DataLoader(padding, batch_size=None), verbose=False)
    assert not any(k.startswith("attention") for k in t.callback_metrics)


class LoaderRecorder(AttentionMonitor):
    def on_validation_epoch_end(self, trainer, pl_module):
        self.views = getattr(self, "views", {})

        def keep(result):
            per_loader, merged = result
            self.views.update({(name, ""): copied(stats) for name, stats in merged.items()})
            if len(per_loader) > len(merged):
                self.views.update({(name, f"/dataloader_idx_{k}"): copied(s) for (name, k), s in per_loader.items()})

        with returned(self._sums, "collect", keep):
            super().on_validation_epoch_end(trainer, pl_module)


def test_callback_multiple_validation_dataloaders_kept_apart_and_combined(tmp_path):
    seed_everything(0)
    model = TinyEncoder()
    first, second = make_batches(seed=1), make_batches(n=8, seed=2)
    monitor = LoaderRecorder(VOCAB, "input_ids", ignore_ids=[PAD], per_head=False)
    loader = lambda batches: DataLoader(batches, batch_size=None)  # noqa: E731
    t = trainer(tmp_path, [monitor])
    t.validate(model, [loader(first), loader(second)], verbose=False)
    alone = []
    for batches in (first, second):
        single = LoaderRecorder(VOCAB, "input_ids", ignore_ids=[PAD], per_head=False)
        trainer(tmp_path, [single]).validate(model, loader(batches), verbose=False)
        alone.append(single.views[("encoder.layers.0.self_attn", "")])
    views = {suffix: stats for (name, suffix), stats in monitor.views.items() if name == "encoder.layers.0.self_attn"}
    assert sorted(views) == ["", "/dataloader_idx_0", "/dataloader_idx_1"]
    for idx in range(2):
        torch.testing.assert_close(views[f"/dataloader_idx_{idx}"].attention_sum, alone[idx].attention_sum)
    combined = views[""]
    torch.testing.assert_close(combined.attention_sum, alone[0].attention_sum + alone[1].attention_sum)
    assert torch.equal(combined.query_count, alone[0].query_count + alone[1].query_count)
    torch.testing.assert_close(
        combined.attention_mass, attention_mass(combined.attention_sum, combined.query_count), rtol=0, atol=0
    )
    tags = [k for k in t.callback_metrics if k.startswith("attention_entropy/encoder.layers.0.self_attn")]
    assert sorted(tags) == [
        "attention_entropy/encoder.layers.0.self_attn",
        "attention_entropy/encoder.layers.0.self_attn/dataloader_idx_0",
        "attention_entropy/encoder.layers.0.self_attn/dataloader_idx_1",
    ]


def test_callback_memory_stays_flat_across_batches_and_epochs(tmp_path):
    class Counter(AttentionMonitor):
        def on_validation_epoch_end(self, trainer, pl_module):
            super().on_validation_epoch_end(trainer, pl_module)
            gc.collect()
            self.counts = getattr(self, "counts", [])
            self.counts.append(sum(isinstance(o, torch.Tensor) for o in gc.get_objects()))

    class Lean(TinyEncoder):  # keeps no outputs of its own
        def validation_step(self, batch, batch_idx):
            self(batch["input_ids"])

    monitor = Counter(VOCAB, "input_ids", ignore_ids=[PAD], probe="first")
    train, val = loaders()
    trainer(tmp_path, [monitor], max_epochs=5, num_sanity_val_steps=0, logger=CSVLogger(tmp_path)).fit(
        Lean(), train, val
    )
    # Drift memory fills up over the first two epochs (reference, then a distinct previous); then nothing grows.
    assert len(monitor.counts) == 5 and len(set(monitor.counts[2:])) == 1, monitor.counts
    # Between epochs, sums whose memory drift memory took (P computed where S lay) wait for the next epoch's start.
    assert len(monitor._sums.metrics) == 2 and all(
        m.sums.device.type == ("cpu" if ACCELERATOR == "cpu" else "cuda")
        and m.sums.shape == ((3, VOCAB * VOCAB) if m.allocated else (0,))
        for m in monitor._sums.metrics.values()
    )


def test_callback_options_that_ddp_spawn_cannot_pickle_raise_naming_the_argument():
    monitor = AttentionMonitor(VOCAB, token_ids=lambda batch: batch["input_ids"])
    with pytest.raises(TypeError, match="argument `token_ids` cannot be pickled.*ddp_spawn"):
        pickle.dumps(monitor)
    assert (
        copy.deepcopy(monitor)._streams.getters.keys() == monitor._streams.getters.keys()
    )  # deep copies need no pickling
    assert pickle.loads(pickle.dumps(AttentionMonitor(VOCAB, "input_ids")))._streams.vocab == {"tokens": VOCAB}


# ---------------------------------------------------------------------------------------------------------------------
# tracked vocabulary and memory budget
# ---------------------------------------------------------------------------------------------------------------------


def fold(tracked, vocab):
    """(K + 1, V) float64 0/1 matrix sending id tracked[c] to row c and every other id to row K: the independent
    reference of the <other> bucket, S_tracked = F S Fᵀ, Q_tracked = F Q."""
    matrix = torch.zeros(len(tracked) + 1, vocab, dtype=torch.float64)
    matrix[len(tracked)] = 1
    for c, token in enumerate(tracked):
        matrix[:, token] = 0
        matrix[c, token] = 1
    return matrix


def test_callback_tracked_vocabulary_equals_dense_on_the_tracked_block_and_other_is_the_folded_mass(tmp_path):
    seed_everything(0)
    model, batches = TinyEncoder(), make_batches()
    dense, tracked = Recorder(VOCAB, "input_ids", ignore_ids=[PAD]), None
    run_validate(tmp_path / "dense", dense, batches, model)
    tracked = Recorder(VOCAB, "input_ids", ignore_ids=[PAD], max_tracked_tokens=4, sink_ids=[1])
    mean_only = Recorder(VOCAB, "input_ids", ignore_ids=[PAD], max_tracked_tokens=4, sink_ids=[1], per_head=False)
    run_validate(tmp_path / "tracked", tracked, batches, model)
    run_validate(tmp_path / "mean", mean_only, batches, model)

    # sink id 1 first, then the 3 most frequent other ids (ties: smaller id), counted by hand over the whole set
    ids = torch.cat([b["input_ids"] for b in batches]).flatten()
    counts = torch.bincount(ids[ids != PAD], minlength=VOCAB).tolist()
    frequent = sorted((i for i in range(VOCAB) if i not in (PAD, 1) and counts[i]), key=lambda i: (-counts[i], i))
    expected = [1, *frequent[:3]]
    assert tracked._streams.tracked["tokens"].tolist() == expected
    F_ = fold(expected, VOCAB)
    for name in ("encoder.layers.0.self_attn", "encoder.layers.1.self_attn"):
        d, t, m = dense.last[name], tracked.last[name], mean_only.last[name]
        assert t.attention_sum.shape == (2, 5, 5) and m.attention_sum.shape == (1, 5, 5)
        S = F_ @ d.attention_sum.double() @ F_.T
        torch.testing.assert_close(t.attention_sum.double(), S, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(m.attention_sum[0].double(), S.mean(0), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(t.uniform_sum.double(), F_ @ d.uniform_sum.double() @ F_.T, rtol=1e-5, atol=1e-6)
        assert torch.equal(t.pair_count.double(), F_ @ d.pair_count.double() @ F_.T)
        assert torch.equal(t.query_count.double(), F_ @ d.query_count.double())
        # the tracked block is the dense sums themselves; rows still sum to 1 with <other>; no mass lost
        block = torch.tensor(expected)
        torch.testing.assert_close(t.attention_sum[:, :4, :4], d.attention_sum[:, block][:, :, block], **SAME_SUMS)
        seen = t.query_count > 0
        torch.testing.assert_close(t.attention_mass[:, seen].sum(-1), torch.ones(2, int(seen.sum())))
        torch.testing.assert_close(t.position_sums, d.position_sums)  # positions do not depend on the vocabulary
    labels = tracked._streams.label(range(5), "tokens")
    assert labels == [str(i) for i in expected] + ["<other>"]


@pytest.mark.parametrize("tracked", [{"src": 3, "tgt": 4}, {"src": 3}, {"tgt": 4}])
def test_callback_hands_the_step_the_other_cell_where_both_streams_are_tracked(tmp_path, monkeypatch, tracked):
    """The step gets the flat index of (<other>, <other>), the last cell, for the modules whose query and key streams
    are both tracked (a GPU sums that cell's pairs apart), and None for the others: the sums cannot show it."""
    seen = []
    update = AttentionAccumulator.update

    def spy(self, *args, hot_cell=None, **kwargs):
        seen.append((self.query_vocab_size, self.key_vocab_size, hot_cell))
        return update(self, *args, hot_cell=hot_cell, **kwargs)

    monkeypatch.setattr(AttentionAccumulator, "update", spy)
    g = torch.Generator().manual_seed(0)
    batches = [{"src": torch.randint(0, 7, (3, 5), generator=g), "tgt": torch.randint(0, 9, (3, 4), generator=g)}]
    monitor = AttentionMonitor({"src": 7, "tgt": 9}, {"src": "src", "tgt": "tgt"}, max_tracked_tokens=tracked)
    trainer(tmp_path, [monitor]).validate(Seq2Seq(), DataLoader(batches, batch_size=None), verbose=False)
    # a tracked stream: its tracked ids and <other>; an untracked one: its whole vocabulary, 7 or 9 ids
    src, tgt = tracked.get("src", 6) + 1, tracked.get("tgt", 8) + 1
    expected = {
        (src, src, src * src - 1 if "src" in tracked else None),  # encoder self-attention
        (tgt, tgt, tgt * tgt - 1 if "tgt" in tracked else None),  # decoder self-attention
        (tgt, src, tgt * src - 1 if len(tracked) == 2 else None),  # cross-attention: queries tgt, keys src
    }
    assert set(seen) == expected


def test_callback_heatmaps_and_tables_show_tokens_not_the_other_bucket(tmp_path):
    # 3 tracked ids of 11: <other> holds most queries and keys and would lead every ranking.
    seed_everything(0)
    monitor = AttentionMonitor(
        VOCAB, "input_ids", ignore_ids=[PAD], max_tracked_tokens=3, top_k=VOCAB, num_pairs=50, min_support=1
    )
    drawn = []
    heatmap = monitor._report.images.figures.heatmap

    def record(matrix, row_labels, col_labels, *args, **kwargs):
        drawn.append((list(row_labels), list(col_labels)))
        return heatmap(matrix, row_labels, col_labels, *args, **kwargs)

    monitor._report.images.figures.heatmap = record
    train, val = loaders()
    t = trainer(tmp_path, [monitor], num_sanity_val_steps=0)
    t.fit(TinyEncoder(), train, val)
    tracked = [str(i) for i in monitor._streams.tracked["tokens"].tolist()]
    assert drawn and all(rows == cols == tracked for rows, cols in drawn)  # every token shown, no <other>
    events = EventAccumulator(t.logger.log_dir, size_guidance={TENSORS: 0})
    events.Reload()
    tables = [tag for tag in events.Tags()["tensors"] if tag.endswith("/text_summary")]
    assert {tag.split("/")[0] for tag in tables} == {
        f"attention_{table}" for table in ("one_way_pairs", "lift_pairs", "hubs", "drift_tokens")
    }
    for tag in tables:
        text = events.Tensors(tag)[-1].tensor_proto.string_val[0].decode()
        assert "<other>" not in text and any(f"| {token} |" in text for token in tracked), (tag, text)


def test_callback_tracked_ids_are_frozen_across_epochs_and_carried_by_the_checkpoint_state(tmp_path):
    seed_everything(0)
    batches = make_batches()
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], max_tracked_tokens=3)
    model = TinyEncoder()
    run_validate(tmp_path / "a", monitor, batches, model)
    first = monitor._streams.tracked["tokens"].clone()
    # the same run sees other data next time: the tracked ids stay, the data is not counted again
    flipped = [{"input_ids": torch.where(b["input_ids"] == PAD, PAD, VOCAB - b["input_ids"])} for b in batches]
    ids = torch.cat([b["input_ids"] for b in flipped]).flatten()
    assert most_frequent_ids(torch.bincount(ids[ids != PAD], minlength=VOCAB), 3).tolist() != first.tolist()
    run_validate(tmp_path / "b", monitor, flipped, model)
    assert torch.equal(monitor._streams.tracked["tokens"], first)
    assert all(m.query_vocab_size == 4 for m in monitor._sums.metrics.values())
    # a resumed run gets them from the state dict
    resumed = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], max_tracked_tokens=3)
    state = torch.load(io.BytesIO(_saved(monitor.state_dict())), weights_only=True)
    resumed.load_state_dict(state)
    assert torch.equal(resumed._streams.tracked["tokens"], first)


def _saved(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def test_callback_memory_budget_refuses_before_any_allocation_with_the_figure_and_the_knobs(tmp_path):
    # 10^6 ids, 2 heads: 12 TB of sums, which no allocation could survive, so the error must come first
    monitor = AttentionMonitor(10**6, "input_ids", ignore_ids=[PAD])
    with pytest.raises(MisconfigurationException, match=r"would hold 36\.4 TiB .*memory_budget`=1\.0 GiB") as info:
        run_validate(tmp_path, monitor, make_batches())
    for knob in ("max_tracked_tokens", "per_head=False", "`modules`"):
        assert knob in str(info.value)
    assert monitor._sums.metrics == {}
    # per module: (H + 1) · V² · 4 + V² · 8 + V · 8 + 8 + 6 · H · 4 bytes; 2 modules
    small = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], memory_budget="1KiB")
    per_module = 3 * 144 * 4 + 144 * 8 + 12 * 8 + 8 + 6 * 2 * 4
    model = TinyEncoder()
    with pytest.raises(MisconfigurationException, match=f"would hold {2 * per_module / 1024:.1f} KiB"):
        trainer(tmp_path, [small], max_epochs=1).fit(model, *loaders())
    assert model.global_step == 0 and small._sums.metrics == {}  # refused at setup, before training
    assert AttentionMonitor(VOCAB, "input_ids", memory_budget=None).memory_budget is None


def test_callback_bert_sized_vocabulary_runs_end_to_end_within_the_default_budget(tmp_path):
    vocab = 30_522
    seed_everything(0)
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)  # Zipf(1) ids, as in real text
    ids = torch.multinomial(weights, 64 * 128, replacement=True, generator=torch.Generator().manual_seed(0))
    batches = [{"input_ids": ids.view(64, 128)[i : i + 16]} for i in range(0, 64, 16)]  # ~2,800 distinct ids

    class Bert(TinyEncoder):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(vocab, 16), nn.Linear(16, vocab)

    dense = AttentionMonitor(vocab, "input_ids")
    with pytest.raises(MisconfigurationException, match="would hold 34\\.7 GiB .*max_tracked_tokens"):
        trainer(tmp_path / "dense", [dense], max_epochs=1).fit(Bert(), batches, batches)
    monitor = Recorder(vocab, "input_ids", max_tracked_tokens=2048, sink_ids=[101, 102], top_k=8)
    logger = TensorBoardLogger(tmp_path, name="bert")
    t = trainer(tmp_path, [monitor], logger=logger, max_epochs=2, num_sanity_val_steps=0, limit_train_batches=1)
    t.fit(Bert(), DataLoader(batches, batch_size=None), DataLoader(batches, batch_size=None))
    assert sum(monitor._sums.state_bytes(monitor._shapes(), 1).values()) < 2**30
    stats = monitor.last["encoder.layers.1.self_attn"]
    assert stats.attention_sum.shape == (2, 2049, 2049)
    assert (
        int(stats.query_count.sum()) == 64 * 128
        and float(stats.attention_mass.sum(-1)[:, stats.query_count > 0].min()) > 0.999
    )
    events = EventAccumulator(t.logger.log_dir, size_guidance={SCALARS: 0})
    events.Reload()
    js = events.Scalars("attention_drift/js_prev/encoder.layers.1.self_attn")
    assert len(js) == 1 and math.isfinite(js[0].value)


def test_callback_per_stream_sink_ids_may_leave_streams_out():
    # streams without sinks get none, also where tracking needs every stream's sinks
    two = {"vocab_size": {"a": 5, "b": 6}, "token_ids": {"a": "a", "b": "b"}, "sink_ids": {"b": [1]}}
    monitor = AttentionMonitor(**two, max_tracked_tokens={"a": 3}, tracked_ids={"a": [4]})
    assert monitor.state_dict()["tracked_ids"]["a"].tolist() == [4]
    with pytest.raises(ValueError, match="`max_tracked_tokens`=1 for stream 'b' is smaller than its 2 `sink_ids`"):
        AttentionMonitor(**{**two, "sink_ids": {"b": [1, 2]}}, max_tracked_tokens={"b": 1})


def test_callback_shared_colour_scale_is_the_largest_value_drawn_so_far_and_checkpointed(tmp_path):
    seed_everything(0)
    monitor = AttentionMonitor(
        VOCAB, "input_ids", ignore_ids=[PAD], top_k=VOCAB, color_scale="shared", export="pt", per_head=True
    )
    train, val = loaders()
    trainer(tmp_path, [monitor], max_epochs=3).fit(TinyEncoder(), train, val)
    limits = monitor.state_dict()["color_limits"]
    layer = "encoder.layers.1.self_attn"
    tops, head_tops, asymmetry_tops = [], [], []
    for path in sorted(tmp_path.rglob("*.pt")):  # the exported epochs: an independent record of what was drawn
        stats = load_epoch(path).modules[layer]
        seen = stats.query_count > 0  # heatmaps show the tokens seen as queries (top_k covers all)
        heads = stats.attention_mass[:, seen][:, :, seen].double()
        tops.append(float(heads.mean(0).max()))
        head_tops.append(float(heads.max()))
        asymmetry_tops.append(float((heads.mean(0) - heads.mean(0).T).abs().max()))
    assert len(tops) == 3
    assert limits[f"attention_mass/{layer}"] == pytest.approx(max(tops), rel=1e-5)
    assert limits[f"attention_mass_heads/{layer}"] == pytest.approx(max(head_tops), rel=1e-5)
    assert limits[f"attention_asymmetry_map/{layer}"] == pytest.approx(max(asymmetry_tops), rel=1e-5)
    restored = AttentionMonitor(VOCAB, "input_ids", color_scale="shared")
    restored.load_state_dict(torch.load(io.BytesIO(_saved(monitor.state_dict())), weights_only=True))
    assert restored.state_dict()["color_limits"] == limits
    per_epoch = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD])
    trainer(tmp_path / "b", [per_epoch], max_epochs=1).fit(TinyEncoder(), train, val)
    assert per_epoch.state_dict()["color_limits"] == {}
    with pytest.raises(ValueError, match="`color_scale` to be 'epoch' or 'shared', but got 'fixed'"):
        AttentionMonitor(VOCAB, "input_ids", color_scale="fixed")


def test_callback_images_are_the_events_add_image_writes_and_other_writers_get_add_image(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    from attn_callbacks.writer import add_image as _add_image

    image = np.random.default_rng(0).integers(0, 256, (37, 53, 3), dtype=np.uint8)
    rgba = np.concatenate([image, np.full((37, 53, 1), 255, dtype=np.uint8)], axis=-1)  # what the canvas holds
    for name, write in (
        ("ours", lambda w: _add_image(w, "img", image, 3)),
        ("ours_rgba", lambda w: _add_image(w, "img", rgba, 3)),
        ("stock", lambda w: w.add_image("img", image, 3, dataformats="HWC")),
    ):
        with SummaryWriter(tmp_path / name) as writer:
            write(writer)
    read = {}
    for name in ("ours", "ours_rgba", "stock"):
        events = EventAccumulator(str(tmp_path / name), size_guidance={IMAGES: 0})
        events.Reload()
        (event,) = events.Images("img")
        read[name] = (
            event.step,
            event.width,
            event.height,
            np.asarray(Image.open(io.BytesIO(event.encoded_image_string))),
        )
    assert read["ours"][:3] == read["ours_rgba"][:3] == read["stock"][:3] == (3, 53, 37)
    for name in ("ours", "ours_rgba", "stock"):
        assert np.array_equal(read[name][3], image), name

    class OtherWriter:  # tensorboardX's SummaryWriter, say: its own protobuf classes
        def __init__(self):
            self.calls = []

        def add_image(self, *args, **kwargs):
            self.calls.append((args, kwargs))

    other = OtherWriter()
    _add_image(other, "img", rgba, 3)
    ((tag, written, step), kwargs), *more = other.calls
    assert (tag, step, kwargs, more) == ("img", 3, {"dataformats": "HWC"}, [])
    assert np.array_equal(written, image)  # RGB: the alpha channel left out


def test_callback_images_are_written_by_a_worker_thread_and_its_errors_reach_the_caller(tmp_path, monkeypatch):
    import threading

    import attn_callbacks.writer as callback_module

    written_by = []
    original = callback_module.add_image

    def spy(*args):
        written_by.append(threading.current_thread().name)
        return original(*args)

    def workers():
        return [t for t in threading.enumerate() if t.name.startswith("attn_callbacks-images")]

    monkeypatch.setattr(callback_module, "add_image", spy)
    model = TinyEncoder()
    logger = TensorBoardLogger(tmp_path, name="tb")
    trainer(tmp_path, [AttentionMonitor(VOCAB, "input_ids")], logger=logger).validate(model, loaders()[1])
    events = EventAccumulator(logger.log_dir, size_guidance={IMAGES: 0})
    events.Reload()
    # Every picture was written, each by the worker, and the worker is gone once the epoch end returns.
    assert len(written_by) == len(events.Tags()["images"]) > 0
    assert all(name.startswith("attn_callbacks-images") for name in written_by)
    assert workers() == []

    def broken(*args):
        raise RuntimeError("writing failed")

    monkeypatch.setattr(callback_module, "add_image", broken)
    with pytest.raises(RuntimeError, match="writing failed"):
        trainer(tmp_path, [AttentionMonitor(VOCAB, "input_ids")]).validate(model, loaders()[1])
    assert no_hooks(model) and workers() == []


def test_callback_interrupted_wait_for_the_writer_thread_stops_it_and_drops_what_is_left(tmp_path, monkeypatch):
    import threading
    import time

    import attn_callbacks.writer as callback_module

    monitor = AttentionMonitor(VOCAB, "input_ids")
    started, done = threading.Event(), []

    def slow(name, seconds=1.0):
        started.set()
        time.sleep(seconds)
        done.append(name)

    # Drawing may outrun encoding: at most MAX_PENDING pictures wait, the oldest are waited for.
    for k in range(3 * callback_module.MAX_PENDING):
        monitor._report.background.submit(lambda k=k: slow(k, 0.01))
        assert sum(not job.done() for job in monitor._report.background._jobs) <= callback_module.MAX_PENDING
    monitor._report.background.finish()
    assert done == list(range(3 * callback_module.MAX_PENDING))
    started.clear()
    done.clear()

    monitor._report.background.submit(lambda: slow("first"))
    for name in ("second", "third"):
        monitor._report.background.submit(lambda name=name: slow(name))
    assert started.wait(5)
    real_shutdown = callback_module.ThreadPoolExecutor.shutdown
    calls = []

    def interrupted_once(self, wait=True, *, cancel_futures=False):
        calls.append(cancel_futures)
        if len(calls) == 1:
            raise KeyboardInterrupt  # Ctrl+C while the hook waits for the writer
        return real_shutdown(self, wait=wait, cancel_futures=cancel_futures)

    monkeypatch.setattr(callback_module.ThreadPoolExecutor, "shutdown", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        monitor._report.background.finish()
    # The job in progress finished, the queued ones were dropped, and no worker is left.
    assert calls == [False, True] and done == ["first"]
    assert not [t for t in threading.enumerate() if t.name.startswith("attn_callbacks-images")]
    assert monitor._report.background._pool is None and monitor._report.background._jobs == []
    pickle.dumps(monitor)  # nothing of the thread is carried
    copy.deepcopy(monitor)


@pytest.mark.parametrize("per_head", [True, False])
def test_callback_sums_reuse_retired_snapshots_never_the_reference(tmp_path, per_head):
    """P is computed where S lay; drift memory keeps it, and the sums take a retired snapshot's memory."""

    class Recorder(AttentionMonitor):
        def on_validation_epoch_end(self, trainer, pl_module):
            epoch_sums = {}

            def keep(result):
                epoch_sums.update({name: copied(stats) for name, stats in result[1].items()})

            with returned(self._sums, "collect", keep):
                super().on_validation_epoch_end(trainer, pl_module)
            # The sums wait zeroed for the next epoch, in the memory of a retired snapshot or their own, or empty.
            assert all(not m.allocated or not m.sums.any() for m in self._sums.metrics.values())
            if trainer.sanity_checking:  # monitored, but never a drift epoch: no snapshot, no spare used
                assert not self._drift.previous and not self._drift._spare
                return
            self.seen = getattr(self, "seen", [])
            mass = self._drift.previous["encoder.layers.0.self_attn"]["attention_mass"]
            # Drift memory holds exactly S / Q of this epoch's sums, also in memory that held an earlier epoch's.
            for name, stats in epoch_sums.items():
                want = attention_mass(stats.attention_sum, stats.query_count)
                assert torch.equal(self._drift.previous[name]["attention_mass"], want), (trainer.current_epoch, name)
            self.seen.append((mass.data_ptr(), mass.clone()))
            reference = self._drift.reference["encoder.layers.0.self_attn"]["attention_mass"]
            assert torch.equal(reference, self.seen[0][1])  # the reference epoch's P is never overwritten
            if trainer.current_epoch == 2:
                # A checkpoint holds P alone, not the packed sums (U beside it) that it was computed in.
                saved = self.state_dict()["previous"]["encoder.layers.0.self_attn"]["attention_mass"]
                assert torch.equal(saved, mass) and saved.untyped_storage().nbytes() == saved.nbytes

    monitor = Recorder(VOCAB, "input_ids", ignore_ids=[PAD], per_head=per_head, log_sanity_check=True)
    train, val = loaders()
    trainer(tmp_path, [monitor], max_epochs=6, num_sanity_val_steps=2, logger=CSVLogger(tmp_path)).fit(
        TinyEncoder(), train, val
    )
    pointers = [pointer for pointer, _ in monitor.seen]
    # Epoch 1's P retires at epoch 3: its memory holds epoch 3's sums, then P; epoch 2's serves epoch 4, and so on.
    # The reference (epoch 0) keeps its own memory, and its values (checked above at every epoch).
    assert len(set(pointers[:3])) == 3 and pointers[0] not in pointers[1:]
    assert len(pointers) == 6 and pointers[1] == pointers[3] == pointers[5] and pointers[2] == pointers[4]


def test_callback_drift_table_lists_the_most_moved_tokens_with_their_loop_js_against_both_epochs(tmp_path):
    layer = "encoder.layers.0.self_attn"

    class Snapshots(AttentionMonitor):
        def on_validation_epoch_end(self, trainer, pl_module):
            super().on_validation_epoch_end(trainer, pl_module)
            memory = self._drift.previous[layer]
            self.kept = [*getattr(self, "kept", []), (memory["attention_mass"].double().mean(0), memory["query_count"])]

    monitor = Snapshots(VOCAB, "input_ids", ignore_ids=[PAD], min_support=2, num_pairs=4)
    train, val = loaders()
    fitted = trainer(tmp_path, [monitor], max_epochs=3, num_sanity_val_steps=0)
    fitted.fit(TinyEncoder(), train, val)
    events = EventAccumulator(fitted.logger.log_dir, size_guidance={TENSORS: 0})
    events.Reload()
    table = events.Tensors(f"attention_drift_tokens/{layer}/text_summary")[-1].tensor_proto.string_val[0].decode()
    rows = [line.strip("| ").split(" | ") for line in table.splitlines()[2:]]
    (ref, ref_q), (prev, prev_q), (now, now_q) = monitor.kept
    supported = [a for a in range(VOCAB) if now_q[a] >= 2 and ref_q[a] >= 2]
    expected = sorted((-naive_js(now[a].tolist(), ref[a].tolist()), a) for a in supported)[:4]
    assert [int(row[0]) for row in rows] == [a for _, a in expected]
    for row, (js, a) in zip(rows, expected, strict=True):
        assert abs(float(row[1]) + js) < 1e-3
        against_previous = naive_js(now[a].tolist(), prev[a].tolist()) if prev_q[a] >= 2 else None
        assert (row[2] == "") if against_previous is None else abs(float(row[2]) - against_previous) < 1e-3
        assert int(row[5]) == int(now_q[a])


def test_callback_limit_batches_unhooks_after_n_batches_and_sums_only_those(tmp_path):
    seed_everything(0)
    model = TinyEncoder().eval()
    attn = model.encoder.layers[0].self_attn

    class Spy(Callback):  # runs after the monitor's hook: what the batch's forward sees
        seen: ClassVar[list] = []

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            hooks = len(attn._forward_hooks) + len(attn._forward_pre_hooks)
            self.seen.append((batch_idx, hooks > 0, torch.backends.mha.get_fastpath_enabled()))

    limited = Recorder(VOCAB, "input_ids", ignore_ids=[PAD], limit_batches=2)
    val = DataLoader(make_batches(seed=1), batch_size=1, collate_fn=collate)
    trainer(tmp_path, [limited, Spy()]).validate(model, val)
    assert [hooked for _, hooked, _ in Spy.seen] == [True, True, False, False]
    assert [fast for _, _, fast in Spy.seen] == [False, False, True, True]
    assert torch.backends.mha.get_fastpath_enabled() and not attn._forward_hooks and not attn._forward_pre_hooks

    alone = Recorder(VOCAB, "input_ids", ignore_ids=[PAD])
    first = DataLoader(make_batches(seed=1)[:2], batch_size=1, collate_fn=collate)
    trainer(tmp_path, [alone]).validate(model, first)
    for name, stats in alone.last.items():
        for field in SUM_FIELDS:
            got, want = getattr(limited.last[name], field), getattr(stats, field)
            torch.testing.assert_close(got, want, **SAME_SUMS, msg=f"{name} {field}")

    shuffled = DataLoader(make_batches(seed=1), batch_size=1, collate_fn=collate, shuffle=True)
    with pytest.warns(UserWarning, match="`limit_batches`=2 watches the first batches of a validation loader that"):
        trainer(tmp_path, [AttentionMonitor(VOCAB, "input_ids", limit_batches=2)]).validate(model, shuffled)
    with pytest.raises(ValueError, match="`limit_batches` to be a positive integer, but got 0"):
        AttentionMonitor(VOCAB, "input_ids", limit_batches=0)


class CompiledEncoder(TinyEncoder):
    """TinyEncoder whose encoder is compiled (a submodule: its names get ``_orig_mod`` from torch.compile)."""

    def __init__(self, backend):
        super().__init__()
        self.encoder = torch.compile(self.encoder, backend=backend)


def fitted_scalars(tmp_path, name, model):
    seed_everything(0)
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], min_support=1)
    train, val = loaders()
    t = trainer(tmp_path, [monitor], logger=TensorBoardLogger(tmp_path, name=name), num_sanity_val_steps=2)
    t.fit(model, train, val)  # the sanity check compiles the eval graph before any hook exists
    assert no_hooks(model) and torch._dynamo.eval_frame._stance.stance == "default"
    return last_scalars(t.logger.log_dir, "attention_")


@pytest.mark.parametrize(
    ("what", "backend"), [("submodule", "eager"), ("whole", "eager"), ("submodule", "inductor"), ("whole", "inductor")]
)
def test_compiled_model_in_fit_with_the_sanity_check_logs_the_plain_models_tags_and_values(tmp_path, what, backend):
    torch._dynamo.reset()
    seed_everything(0)
    expected = fitted_scalars(tmp_path, "plain", TinyEncoder())
    seed_everything(0)
    model = CompiledEncoder(backend) if what == "submodule" else torch.compile(TinyEncoder(), backend=backend)
    got = fitted_scalars(tmp_path, "compiled", model)
    assert got.keys() == expected.keys() and len(got) > 50  # the same names: no "_orig_mod"
    for tag, value in expected.items():
        assert math.isclose(got[tag], value, rel_tol=1e-5, abs_tol=1e-6), (tag, got[tag], value)


class Checkpointed(TinyEncoder):
    """TinyEncoder with activation-checkpointed layers (their names get ``_checkpoint_wrapped_module``)."""

    def __init__(self):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        super().__init__()
        self.encoder.layers = nn.ModuleList(checkpoint_wrapper(layer) for layer in self.encoder.layers)


def test_activation_checkpointed_model_logs_the_plain_models_tags_and_values(tmp_path):
    seed_everything(0)
    expected = fitted_scalars(tmp_path, "plain", TinyEncoder())
    seed_everything(0)
    got = fitted_scalars(tmp_path, "checkpointed", Checkpointed())
    assert got.keys() == expected.keys() and len(got) > 50
    for tag, value in expected.items():
        assert math.isclose(got[tag], value, rel_tol=1e-5, abs_tol=1e-6), (tag, got[tag], value)


class HalfUsed(TinyEncoder):
    """Holds a second attention module that validation_step never calls."""

    def __init__(self):
        super().__init__()
        self.unused = nn.MultiheadAttention(16, 2, batch_first=True)


def test_hooked_modules_that_never_run_are_named_in_a_warning_and_the_empty_warning_needs_a_module_that_ran(tmp_path):
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD])
    _, val = loaders()
    with pytest.warns(UserWarning, match=r"'unused' were hooked for 4 monitored batch\(es\) but never ran"):
        trainer(tmp_path, [monitor]).validate(HalfUsed(), val, verbose=False)
    # Every id ignored: the modules ran, nothing counted -> the "no valid query token" warning, no silent module.
    everything = AttentionMonitor(VOCAB, "input_ids", ignore_ids=list(range(VOCAB)))
    with pytest.warns(UserWarning, match="no valid query token") as caught:
        trainer(tmp_path, [everything]).validate(TinyEncoder(), val, verbose=False)
    assert not any("never ran" in str(w.message) for w in caught)


def test_compiled_model_validated_after_fit_and_again_keeps_its_names_and_is_seen_every_time(tmp_path):
    torch._dynamo.reset()
    seed_everything(0)
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], min_support=1)
    train, val = loaders()
    t = trainer(tmp_path, [monitor], max_epochs=1, num_sanity_val_steps=2)
    model = CompiledEncoder("eager")
    t.fit(model, train, val)
    for _ in range(2):
        t.validate(model, val, verbose=False)
    events = EventAccumulator(t.logger.log_dir, size_guidance={SCALARS: 0})
    events.Reload()
    ours = {tag for tag in events.Tags()["scalars"] if tag.startswith("attention_")}
    assert ours and not any("_orig_mod" in tag for tag in ours)
    # fit's epoch and both validate calls: three points each (drift from the second on)
    assert all(len(events.Scalars(tag)) == (2 if "drift" in tag else 3) for tag in ours)
    entropy = [e.value for e in events.Scalars("attention_entropy/encoder.layers.0.self_attn")]
    assert entropy[1] == pytest.approx(entropy[2], rel=1e-6)  # the same weights, the same numbers


class WideOneLayer(TinyEncoder):
    """One encoder layer of 4 heads: one attention module of the 2-layer, 2-head model's names, another shape."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1)


def test_monitor_validating_another_model_after_fit_sums_only_that_models_modules(tmp_path):
    """A monitor fitted on one model, then used to validate a model with fewer modules, and heads of another number
    under a name it saw, gives the numbers a fresh monitor gives that model (drift aside: it has earlier epochs)."""
    seed_everything(0)
    reused = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], min_support=1)
    train, val = loaders()
    trainer(tmp_path / "fit", [reused], max_epochs=1, num_sanity_val_steps=0).fit(TinyEncoder(), train, val)
    model = WideOneLayer()
    logged = {}
    for name, monitor in (
        ("reused", reused),
        ("fresh", AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], min_support=1)),
    ):
        t = trainer(tmp_path / name, [monitor])
        t.validate(model, val, verbose=False)
        logged[name] = {k: float(v) for k, v in t.callback_metrics.items() if k.startswith("attention_")}
    layer = "encoder.layers.0.self_attn"
    assert f"attention_entropy/{layer}" in logged["fresh"]
    assert not any("layers.1" in tag for tag in logged["reused"])
    shared = {k: v for k, v in logged["reused"].items() if "drift" not in k}
    assert shared.keys() == logged["fresh"].keys()
    assert shared == pytest.approx(logged["fresh"], rel=1e-6)
