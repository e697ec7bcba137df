"""AttentionMonitor end to end, which epochs and batches are watched: log_every_n_epochs, validate() calls,
limit_batches."""

from typing import ClassVar

import pytest
import torch
from _callback_helpers import PAD, VOCAB, Recorder, TinyEncoder, collate, loaders, make_batches, trainer
from _reference import SAME_SUMS
from lightning.pytorch import seed_everything
from lightning.pytorch.callbacks import Callback
from tensorboard.backend.event_processing.event_accumulator import IMAGES, SCALARS, EventAccumulator
from torch.utils.data import DataLoader

from attn_callbacks import AttentionMonitor
from attn_callbacks.sums.accumulator import SUM_FIELDS


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


def test_callback_log_every_n_epochs_counts_validations_skipped_reference_moves_on(tmp_path):
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


def test_callback_validate_always_watched_uncounted_old_checkpoints_keep_epoch_rule(tmp_path):
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
    assert [epochs[e.step] for e in events.Scalars(layer)] == [0.0, 2.0]
    assert monitor.state_dict()["validation_epochs"] == 3
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
    assert [epochs[e.step] for e in events.Scalars(layer)] == [4.0]
    assert resumed.state_dict()["validation_epochs"] is None


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
    with pytest.warns(UserWarning, match="`limit_batches`=2 watches the first batches of a validation loader that"):
        named = {"in_order": first, "shuffled": shuffled}  # a dict of loaders: its values are checked, not its keys
        trainer(tmp_path, [AttentionMonitor(VOCAB, "input_ids", limit_batches=2)]).validate(model, named)
    with pytest.raises(ValueError, match="`limit_batches` to be a positive integer, but got 0"):
        AttentionMonitor(VOCAB, "input_ids", limit_batches=0)
