"""AttentionMonitor end to end on the models it meets: compiled, activation-checkpointed, with unused modules,
another model after fit."""

import math
import warnings

import pytest
import torch
from _callback_helpers import PAD, VOCAB, TinyEncoder, last_scalars, loaders, no_hooks, trainer
from lightning.pytorch import seed_everything
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator
from torch import nn

from attn_callbacks import AttentionMonitor


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
def test_compiled_model_in_fit_with_sanity_check_logs_plain_models_tags_and_values(tmp_path, what, backend):
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


def test_hooked_modules_never_run_are_named_in_a_warning_the_empty_one_needs_a_run(tmp_path):
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD])
    _, val = loaders()
    with pytest.warns(UserWarning, match=r"'unused' were hooked for 4 monitored batch\(es\) but never ran"):
        trainer(tmp_path, [monitor]).validate(HalfUsed(), val, verbose=False)
    # Every id ignored: the modules ran, nothing counted -> the "no valid query token" warning, no silent module.
    everything = AttentionMonitor(VOCAB, "input_ids", ignore_ids=list(range(VOCAB)))
    with pytest.warns(UserWarning, match="no valid query token") as caught:
        trainer(tmp_path, [everything]).validate(TinyEncoder(), val, verbose=False)
    assert not any("never ran" in str(w.message) for w in caught)


def test_compiled_model_validated_after_fit_and_again_keeps_names_seen_each_time(tmp_path):
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


class MicroBatched(TinyEncoder):
    """Runs its encoder on micro-batches of 2: the attention of each sees part of the batch only."""

    def forward(self, ids):
        return self.head(torch.cat([self.encoder(part) for part in self.embed(ids).split(2)]))


def test_attention_run_on_part_of_the_batch_is_refused_naming_the_module_and_both_batch_sizes(tmp_path):
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD])
    _, val = loaders()
    expected = r"'encoder.layers.0.self_attn' ran on a batch of 2 samples.*\(4, 6\).*hold 4 and 4"
    with pytest.raises(ValueError, match=expected):
        trainer(tmp_path, [monitor]).validate(MicroBatched(), val, verbose=False)


class TrainModeLater(TinyEncoder):
    """Attention dropout 0.1, and ``self.train()`` in ``validation_step`` from the second epoch on (MC dropout, or a
    slip): the first call of each module (the sanity pass, the first epoch) runs in eval mode."""

    def __init__(self, switch: bool):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.1, batch_first=True)
        self.encoder, self.switch = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), switch

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        if self.switch and self.current_epoch >= 1:
            self.train()
        super().validation_step(batch, batch_idx, dataloader_idx)


@pytest.mark.parametrize("switch", [False, True])
def test_a_hooked_module_run_in_training_mode_in_a_later_epoch_is_named_with_its_dropout(tmp_path, switch):
    seed_everything(0)
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD])
    train, val = loaders()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, [monitor], num_sanity_val_steps=2).fit(TrainModeLater(switch), train, val)
    said = [str(w.message) for w in caught if "ran in training mode" in str(w.message)]
    if not switch:  # Lightning validates in eval mode: no dropout, nothing to say
        assert said == []
        return
    assert len(said) == 2, said  # once per module
    for layer, message in enumerate(said):
        assert f"module 'encoder.layers.{layer}.self_attn' ran in training mode" in message
        assert "carry its dropout (p = 0.1)" in message
