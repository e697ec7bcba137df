"""AttentionMonitor end to end, drift across epochs: a resumed run, drift memory and its reuse, the moved-tokens
table."""

import gc
import math
import re
import warnings

import pytest
import torch
from _callback_helpers import PAD, VOCAB, TinyEncoder, last_scalars, loaders, saved_and_loaded, trainer
from _reference import ACCELERATOR, copied, naive_js, returned, table_cells
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import SCALARS, TENSORS, EventAccumulator

from attn_callbacks import AttentionMonitor, load_epoch
from attn_callbacks.functional import attention_mass


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


def test_callback_memory_stays_flat_across_batches_and_epochs(tmp_path):
    class Counter(AttentionMonitor):
        def on_validation_epoch_end(self, trainer, pl_module):
            super().on_validation_epoch_end(trainer, pl_module)
            gc.collect()
            self.counts = getattr(self, "counts", [])
            with warnings.catch_warnings():  # isinstance on torch.distributed.reduce_op warns that it is deprecated
                warnings.simplefilter("ignore", FutureWarning)
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
                got = self._drift.previous[name]["attention_mass"]
                # Divided on the sums' device: a GPU divides where the CPU multiplies by reciprocals.
                want = attention_mass(stats.attention_sum.to(got.device), stats.query_count.to(got.device))
                assert torch.equal(got, want), (trainer.current_epoch, name)
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


def test_callback_drift_table_lists_most_moved_tokens_with_loop_js_against_both(tmp_path):
    layer = "encoder.layers.0.self_attn"
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], min_support=2, num_pairs=4, export="pt")
    train, val = loaders()
    fitted = trainer(tmp_path, [monitor], max_epochs=3, num_sanity_val_steps=0)
    fitted.fit(TinyEncoder(), train, val)
    events = EventAccumulator(fitted.logger.log_dir, size_guidance={TENSORS: 0})
    events.Reload()
    table = events.Tensors(f"attention_drift_tokens/{layer}/text_summary")[-1].tensor_proto.string_val[0].decode()
    rows = table_cells(table)
    # each epoch's P̄ and Q, from the exported sums
    epochs = [load_epoch(path).modules[layer] for path in sorted(tmp_path.rglob("*.pt"))]
    (ref, ref_q), (prev, prev_q), (now, now_q) = [(s.attention_mass.double().mean(0), s.query_count) for s in epochs]
    supported = [a for a in range(VOCAB) if now_q[a] >= 2 and ref_q[a] >= 2]
    expected = sorted((-naive_js(now[a].tolist(), ref[a].tolist()), a) for a in supported)[:4]
    assert [int(row[0]) for row in rows] == [a for _, a in expected]
    for row, (js, a) in zip(rows, expected, strict=True):
        assert abs(float(row[1]) + js) < 1e-3
        against_previous = naive_js(now[a].tolist(), prev[a].tolist()) if prev_q[a] >= 2 else None
        assert (row[2] == "") if against_previous is None else abs(float(row[2]) - against_previous) < 1e-3
        assert int(row[5]) == int(now_q[a])


def test_callback_a_reference_epoch_beyond_the_fit_is_warned_about(tmp_path):
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], drift_reference_epoch=5, num_pairs=0)
    with pytest.warns(UserWarning, match=r"`drift_reference_epoch`=5 is not an epoch of this fit \(max_epochs=2\)"):
        trainer(tmp_path, [monitor], max_epochs=2, num_sanity_val_steps=0).fit(TinyEncoder(), *loaders())
    drift = [tag for tag in last_scalars(tmp_path / "tb" / "version_0") if "drift" in tag]
    assert "attention_drift/js_prev/encoder.layers.0.self_attn" in drift
    assert not [tag for tag in drift if "_ref" in tag]


def fitted_state(tmp_path, **kwargs):
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], num_pairs=0, **kwargs)
    trainer(tmp_path, [monitor], max_epochs=1, num_sanity_val_steps=0).fit(TinyEncoder(), *loaders())
    return saved_and_loaded(monitor.state_dict())


def test_callback_resuming_into_another_vocabulary_warns_that_drift_restarts(tmp_path):
    state = fitted_state(tmp_path / "first")
    wider = AttentionMonitor(VOCAB + 3, "input_ids", ignore_ids=[PAD], num_pairs=0)
    wider.load_state_dict(state)
    with pytest.warns(UserWarning, match=r"now gives P of shape \(2, 15, 15\).*epoch 0: \(2, 12, 12\)"):
        trainer(tmp_path / "second", [wider], max_epochs=1).validate(TinyEncoder(), loaders()[1], verbose=False)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tracked_tokens": 6}, "this monitor's `max_tracked_tokens`=6 is not used"),
        ({}, "this monitor's no tracking is not used"),
        ({"tracked_ids": [1, 2]}, r"this monitor's `tracked_ids` \(2 ids\) is not used"),
    ],
)
def test_callback_resuming_with_other_tracking_keeps_the_checkpoints_and_says_so(tmp_path, kwargs, message):
    state = fitted_state(tmp_path, max_tracked_tokens=4)
    kept = state["tracked_ids"]["tokens"]
    assert len(kept) == 4
    resumed = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], **kwargs)
    with pytest.warns(UserWarning, match=f"the checkpoint tracks 4 ids of stream 'tokens'.*{message}"):
        resumed.load_state_dict(state)
    assert torch.equal(resumed.state_dict()["tracked_ids"]["tokens"], kept)


def test_callback_resuming_with_a_sink_the_checkpoint_does_not_track_is_refused(tmp_path):
    state = fitted_state(tmp_path, max_tracked_tokens=4)
    outside = sorted(set(range(1, VOCAB)) - set(state["tracked_ids"]["tokens"].tolist()))[:2]
    resumed = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], max_tracked_tokens=4, sink_ids=outside)
    message = re.escape(f"`sink_ids` names ids {outside} of stream 'tokens'") + ".*tracks 4 ids"
    with pytest.raises(ValueError, match=message):
        resumed.load_state_dict(state)


def test_callback_resuming_into_a_smaller_vocabulary_is_refused(tmp_path):
    state = fitted_state(tmp_path, tracked_ids=[2, 11])
    with pytest.raises(
        ValueError, match="tracks stream 'tokens' with ids up to 11, but this monitor has `vocab_size`=8"
    ):
        AttentionMonitor(8, "input_ids").load_state_dict(state)


def test_callback_leaves_js_drift_out_when_no_token_has_the_support_and_keeps_frobenius(tmp_path):
    seed_everything(0)
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], min_support=10**6, num_pairs=0)
    train, val = loaders()
    fit = trainer(tmp_path, [monitor], max_epochs=2, limit_train_batches=2)
    fit.fit(TinyEncoder(), train, val)
    logged = drift_scalars(fit.logger.log_dir)
    assert logged and not any("/js_" in tag for tag in logged)  # a 0 here would read "nothing moved"
    assert logged["attention_drift/frobenius_prev/encoder.layers.0.self_attn"] > 0  # the weights did change


class SkipsLayerOne(TinyEncoder):
    """Validation of epoch ``skip`` runs the encoder's first layer only: layer 1 sees nothing that epoch."""

    def __init__(self, skip):
        super().__init__()
        self.skip = skip

    def forward(self, ids):
        if self.training or self.trainer.current_epoch != self.skip:
            return super().forward(ids)
        return self.head(self.encoder.layers[0](self.embed(ids), src_key_padding_mask=ids == PAD))


@pytest.mark.parametrize("skip", [0, 1])
def test_callback_an_epoch_a_module_saw_nothing_of_is_no_drift_snapshot_for_it(tmp_path, skip):
    seed_everything(0)
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], min_support=1, num_pairs=3, export="pt")
    fit = trainer(tmp_path, [monitor], max_epochs=3, num_sanity_val_steps=0, limit_train_batches=2)
    with pytest.warns(UserWarning, match=r"'encoder.layers.1.self_attn' were hooked for .* but never ran"):
        fit.fit(SkipsLayerOne(skip), *loaders())
    events = EventAccumulator(fit.logger.log_dir, size_guidance={SCALARS: 0, TENSORS: 0})
    events.Reload()
    tags = events.Tags()["scalars"]

    def values(kind, layer):
        tag = f"attention_drift/{kind}/encoder.layers.{layer}.self_attn"
        return [event.value for event in events.Scalars(tag)] if tag in tags else []

    layer = "encoder.layers.1.self_attn"
    masses = [load_epoch(path).modules[layer] for path in sorted(tmp_path.rglob("*.pt"))]
    assert [int(stats.query_count.sum()) > 0 for stats in masses] == [epoch != skip for epoch in range(3)]
    p = [stats.attention_mass.double().mean(0) for stats in masses]
    assert len(values("frobenius_prev", 0)) == 2  # layer 0 ran every epoch
    if skip == 0:  # no reference for layer 1: nothing against it, never a 0 that reads "nothing moved"
        assert values("frobenius_ref", 1) == [] and values("js_ref", 1) == []
        then = 1  # epoch 2 against epoch 1, the previous one
        (frobenius,) = values("frobenius_prev", 1)
    else:  # epoch 2 has no previous epoch for layer 1, and its reference is still epoch 0
        assert values("frobenius_prev", 1) == [] and values("js_prev", 1) == []
        then = 0
        # Its drift table has no column against epoch 1 (which layer 0's has): there is nothing to compare with.
        headers = {}
        for layer in (0, 1):
            tag = f"attention_drift_tokens/encoder.layers.{layer}.self_attn/text_summary"
            headers[layer] = events.Tensors(tag)[-1].tensor_proto.string_val[0].decode().splitlines()[0]
        assert headers[0] == (
            "| query token | JS vs reference (epoch 0) | JS vs previous (epoch 1) | top key now | top key at reference "
            "| Q now |"
        )
        assert headers[1] == headers[0].replace(" JS vs previous (epoch 1) |", "")
        (frobenius,) = values("frobenius_ref", 1)
    assert frobenius == pytest.approx(float((p[2] - p[then]).norm() / p[then].norm()), rel=1e-4) and frobenius > 0
