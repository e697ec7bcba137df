"""AttentionMonitor end to end, hooks on and off: what the model sees, exit paths, exceptions and interrupts,
stages not watched."""

import signal

import pytest
import torch
from _callback_helpers import LENGTH, PAD, VOCAB, TinyEncoder, loaders, make_batches, no_hooks, trainer
from lightning.pytorch import seed_everything
from torch.utils.data import DataLoader

from attn_callbacks import AttentionMonitor


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


@pytest.mark.parametrize(
    ("error", "where", "background"),
    [
        (RuntimeError, "_draw", False),
        (KeyboardInterrupt, "_draw", False),
        (RuntimeError, "_dashboard", False),
        (RuntimeError, "_draw", True),
        (KeyboardInterrupt, "_dashboard", True),
    ],
)
@pytest.mark.parametrize("sanity", [False, True])
def test_callback_a_failed_epoch_end_logs_nothing_of_it(tmp_path, monkeypatch, error, where, background, sanity):
    """The second module's pictures fail, after every table, the Attention tab's data and the first module's pictures
    were made (or the head grids, after every module's): none of them reaches the run, nor do its scalars (per head
    too; a monitored sanity pass's go straight to the loggers), as for an epoch that never ended. With the drawing
    process, the pictures it returned before the failure are not written either."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from attn_callbacks.output.report import Reporter

    made, original = [], getattr(Reporter, where)

    def fails(self, *args):
        if made or where == "_dashboard":
            if background:
                assert self.drawing.process.pending and self.drawing.process.wait(60)  # every picture returned
            raise error("drawing failed")
        made.append(args)
        original(self, *args)

    monkeypatch.setattr(Reporter, where, fails)
    monitor = AttentionMonitor(
        VOCAB, "input_ids", ignore_ids=[PAD], num_pairs=3, log_sanity_check=sanity, draw_in_background=background
    )
    fitted = trainer(tmp_path, [monitor], num_sanity_val_steps=2 if sanity else 0)
    handler = signal.getsignal(signal.SIGINT)
    try:  # Ctrl+C: Lightning's graceful shutdown
        with pytest.raises(SystemExit if error is KeyboardInterrupt else error):
            fitted.fit(TinyEncoder(), *loaders()) if sanity else fitted.validate(TinyEncoder(), loaders()[1])
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores further Ctrl+C from then on
    events = EventAccumulator(fitted.logger.log_dir)
    events.Reload()
    assert {kind: tags for kind, tags in events.Tags().items() if tags and kind != "meta_graph"} == {}
    assert not list(tmp_path.rglob("epoch=*"))  # no Attention tab files
