import io
import re
import warnings

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn

from attn_callbacks.capture.probe import Probe
from attn_callbacks.capture.streams import Streams

HEADS, LENGTH, VOCAB = 2, 3, 10


class Model(LightningModule):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(4, HEADS, batch_first=True)
        self.embed = nn.Embedding(VOCAB, 4)


def _streams(**kwargs):
    streams = Streams({"src": "src", "tgt": "tgt"}, VOCAB, **kwargs)
    streams.of = {"attn": ("src", "src")}  # the module reads src only
    return streams


def _recorded(run):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run()
    return result, [str(w.message) for w in caught]


def test_probe_rejects_a_string_other_than_first():
    with pytest.raises(ValueError, match=re.escape("`probe` to be 'first', a batch or None, but got 'last'")):
        Probe("last")


def test_probe_first_takes_no_probe_forward():
    with pytest.raises(ValueError, match=re.escape("`probe_forward`")):
        Probe("first", forward=lambda module, batch: None)


@pytest.mark.parametrize("forward", [None, 3])
def test_probe_own_batch_needs_a_callable_probe_forward(forward):
    with pytest.raises(ValueError, match=re.escape("needs argument `probe_forward`") + ".*" + f"={forward!r}$"):
        Probe({"src": torch.zeros(1, 2, dtype=torch.long)}, forward=forward)


@pytest.mark.parametrize(("batch", "own"), [(None, False), ("first", False), ([torch.ones(1, 2)], True)])
def test_probe_own_batch_only_for_a_batch_of_the_users(batch, own):
    forward = (lambda module, b: None) if own else None
    assert Probe(batch, forward).own_batch is own


def test_probe_keep_ignores_weights_unless_capturing_or_running_the_probe():
    probe = Probe("first")
    probe.keep("attn", torch.ones(1, HEADS, 2, 2))
    assert probe.weights == {}
    probe.only = True
    probe.keep("attn", torch.ones(1, HEADS, 2, 2))
    assert list(probe.weights) == ["attn"]


def test_probe_keep_copies_the_first_samples_as_float32_on_cpu():
    probe = Probe("first", samples=2)
    probe.capturing = True
    weights = torch.arange(4 * HEADS * 2 * 2, dtype=torch.float64).reshape(4, HEADS, 2, 2).requires_grad_()
    probe.keep("attn", weights)
    kept = probe.weights["attn"]
    assert kept.dtype == torch.float32 and kept.device.type == "cpu" and not kept.requires_grad
    assert kept.shape == (2, HEADS, 2, 2) and kept[1, 1, 0, 1].item() == 1 * 8 + 1 * 4 + 0 * 2 + 1


def test_probe_keep_assembles_the_samples_from_calls_a_few_samples_at_a_time():
    probe = Probe("first", samples=3)
    probe.capturing = True
    chunks = [torch.full((2, HEADS, 2, 2), float(n)) for n in range(3)]  # samples 0-1, 2-3, 4-5 of the batch
    for n, chunk in enumerate(chunks):
        probe.keep("attn", chunk, rows=slice(2 * n, 2 * n + 2))
    kept = probe.weights["attn"]
    assert kept.shape == (3, HEADS, 2, 2)
    assert [kept[n].unique().tolist() for n in range(3)] == [[0.0], [0.0], [1.0]]  # sample 3 on is not kept


def _match(probe, ids):
    """``probe.match`` of a batch whose positions all count, as ``Streams.read`` gives each stream."""
    return probe.match({stream: (t, torch.ones_like(t, dtype=torch.bool), t) for stream, t in ids.items()})


def test_probe_match_freezes_a_copy_of_the_first_samples_and_their_valid_positions():
    probe = Probe("first", samples=2)
    ids = {"src": torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])}
    valid = {"src": ids["src"] < 6}
    assert probe.match({"src": (ids["src"], valid["src"], ids["src"])})
    ids["src"][0, 0], valid["src"][0, 0] = 9, False  # the loader's tensors change later: the frozen ones do not
    assert probe.ids["src"].tolist() == [[1, 2, 3], [4, 5, 6]]
    assert probe.valid["src"].tolist() == [[True, True, True], [True, True, False]]


def test_probe_match_compares_only_the_probe_samples():
    probe = Probe("first", samples=1)
    _match(probe, {"src": torch.tensor([[1, 2], [3, 4]])})
    same, messages = _recorded(lambda: _match(probe, {"src": torch.tensor([[1, 2], [0, 0], [5, 5]])}))
    assert same and messages == []


def test_probe_match_is_false_and_warns_once_for_other_samples():
    probe = Probe("first", samples=1)
    _match(probe, {"src": torch.tensor([[1, 2]])})
    results, messages = _recorded(
        lambda: [_match(probe, {"src": torch.tensor([[2, 1]])}), _match(probe, {"src": torch.tensor([[3, 1]])})]
    )
    assert results == [False, False] and len(messages) == 1
    assert "no longer starts with the frozen probe samples" in messages[0]
    assert probe.ids["src"].tolist() == [[1, 2]]  # still the first sight's


def test_probe_match_is_false_for_other_streams():
    probe = Probe("first", samples=1)
    _match(probe, {"src": torch.tensor([[1, 2]])})
    same, _ = _recorded(lambda: _match(probe, {"src": torch.tensor([[1, 2]]), "tgt": torch.tensor([[1, 2]])}))
    assert not same


def test_probe_run_runs_the_forward_keeping_weights_and_the_read_streams_ids():
    batch = {"src": torch.tensor([[1, 2, 3], [4, 5, 6]]), "tgt": torch.tensor([[7, 7], [8, 8]])}
    seen = {}

    def forward(module, given):
        seen.update(batch=given, only=probe.only, grad=torch.is_grad_enabled())
        x = module.embed(given["src"])
        _, weights = module.attn(x, x, x, need_weights=True, average_attn_weights=False)  # (B, H, L, L)
        seen["weights"] = weights
        probe.keep("attn", weights)  # what the forward hook does

    probe, streams, model = Probe(batch, forward, samples=1), _streams(), Model()
    probe.run(model, streams)
    assert seen["batch"]["src"] is batch["src"] and seen["only"] and not seen["grad"]
    assert torch.equal(probe.weights["attn"], seen["weights"][:1])
    assert probe.weights["attn"].shape == (1, HEADS, LENGTH, LENGTH)
    assert list(probe.ids) == ["src"] and probe.ids["src"].tolist() == [[1, 2, 3]]  # tgt is read by no module
    assert not probe.only and streams.batch is None


def test_probe_run_resets_its_state_when_the_forward_raises():
    def forward(module, batch):
        raise RuntimeError("model failed")

    probe, streams = Probe({"src": torch.ones(1, 2, dtype=torch.long)}, forward), _streams()
    with pytest.raises(RuntimeError, match="model failed"):
        probe.run(Model(), streams)
    assert not probe.only and streams.batch is None


def test_probe_run_freezes_a_copy_of_the_probe_samples():
    batch = {"src": torch.arange(64 * 8).reshape(64, 8) % VOCAB, "tgt": torch.zeros(64, 8, dtype=torch.long)}
    probe = Probe(batch, lambda module, given: None, samples=1)
    _recorded(lambda: probe.run(Model(), _streams()))  # its forward runs no attention: warned, not tested here
    saved = io.BytesIO()
    torch.save(probe.ids, saved)
    reference = io.BytesIO()
    torch.save({"src": batch["src"][:1].clone()}, reference)
    assert len(saved.getvalue()) == len(reference.getvalue())  # one sample's ids, not the 64 of the batch


def test_probe_run_names_the_probe_when_its_batch_lacks_the_ids():
    probe = Probe({"tgt": torch.tensor([[1, 2]])}, lambda module, batch: None)  # no "src"
    with pytest.raises(ValueError, match="the probe batch given in argument `probe` does not hold the token ids"):
        probe.run(Model(), _streams())
    assert not probe.only


def test_probe_run_warns_once_when_the_forward_runs_no_attention():
    probe = Probe({"src": torch.tensor([[1, 2, 3]])}, lambda module, batch: module.embed(batch["src"]))
    _, first = _recorded(lambda: probe.run(Model(), _streams()))
    _, second = _recorded(lambda: probe.run(Model(), _streams()))
    assert len(first) == 1 and "no attention of a monitored module was read in it, so no probe" in first[0]
    assert second == [] and probe.weights == {}
