"""DriftMemory: the earlier epochs drift compares against, their shapes, the memory they reuse and where it lives."""

import pytest
import torch

from attn_callbacks.metrics import drift_memory
from attn_callbacks.metrics.drift_memory import DriftMemory


def test_drift_memory_drops_a_reference_of_another_shape_keeps_the_previous_epoch():

    memory = DriftMemory()
    memory.remember(0, {"enc": (torch.rand(2, 4, 3), torch.ones(4, dtype=torch.long), {})})  # the reference
    memory.remember(1, {"enc": (torch.rand(2, 4, 4), torch.ones(4, dtype=torch.long), {})})  # another model since
    previous, reference, lost = memory.snapshots("enc", torch.Size((2, 4, 4)))
    assert previous is not None and previous.attention_mass.shape == (2, 4, 4) and reference is None
    assert lost == [(0, (2, 4, 3))]
    assert memory.snapshots("enc", torch.Size((2, 4, 3))) == (None, None, [(1, (2, 4, 4))])
    assert memory.snapshots("enc", torch.Size((2, 4, 5))) == (None, None, [(1, (2, 4, 4)), (0, (2, 4, 3))])


def views_of(sums: torch.Tensor, heads: int = 2, vocab: int = 3) -> torch.Tensor:
    """P where S lay in packed sums ``(H + 1, V²)``."""
    return sums[:heads].view(heads, vocab, vocab)


def test_drift_memory_hands_the_sums_the_packed_state_a_retired_p_was_computed_in():
    """P computed where S lay (a view of the packed sums, U beside it): while a snapshot keeps it, the sums need other
    memory; that of a retired snapshot's packed state, once there is one, else fresh memory (None)."""

    heads, vocab = 2, 3
    memory, count, states, views = DriftMemory(), torch.ones(vocab, dtype=torch.long), [], []
    for epoch in range(4):
        sums = torch.rand(heads + 1, vocab * vocab)  # S per head, then U
        mass = sums[:heads].view(heads, vocab, vocab)  # P where S lay
        assert memory.state_buffer("enc", sums) is sums  # nothing keeps it yet
        memory.remember(epoch, {"enc": (mass, count, {})})
        states.append(sums)
        views.append(mass.clone())
        buffer = memory.state_buffer("enc", sums)
        if epoch < 2:  # epoch 0 is the reference, epoch 1 the previous: nothing retired yet
            assert buffer is None
        else:  # the previous epoch's packed state, retired: the same memory, as a normal (H + 1, V²) tensor
            assert buffer.shape == sums.shape and buffer.data_ptr() == states[epoch - 1].data_ptr()
            assert not buffer.is_inference()
    reference = memory.reference["enc"]["attention_mass"]
    alone = DriftMemory()
    alone.remember(0, {"enc": (views_of(states[0]), count, {})})
    state = alone.state_dict()  # the first epoch is both previous and reference: one copy, P alone in it
    saved = state["previous"]["enc"]["attention_mass"]
    assert saved is state["reference"]["enc"]["attention_mass"] and saved.untyped_storage().nbytes() == saved.nbytes
    assert torch.equal(reference, views[0]) and reference.data_ptr() == states[0].data_ptr()
    # A checkpoint holds each P alone, not the packed state (U beside it) it lies in.
    saved = memory.state_dict()["previous"]["enc"]["attention_mass"]
    assert torch.equal(saved, views[-1]) and saved.untyped_storage().nbytes() == saved.nbytes
    # A retired P of its own (a GPU run's copy, a resumed checkpoint's) lies in no packed state: fresh memory then.
    other = DriftMemory()
    other.remember(0, {"enc": (torch.rand(heads, vocab, vocab), count, {})})
    other.remember(1, {"enc": (torch.rand(heads, vocab, vocab), count, {})})
    sums = torch.rand(heads + 1, vocab * vocab)
    other.remember(2, {"enc": (sums[:heads].view(heads, vocab, vocab), count, {})})
    assert "enc" in other._spare and other.state_buffer("enc", sums) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_drift_memory_keeps_a_gpu_p_in_page_locked_host_memory_reuses_retired_ones():

    heads, vocab = 2, 5
    memory, kept = DriftMemory(), []
    for epoch in range(4):
        mass = torch.rand(heads, vocab, vocab, device="cuda")
        count = torch.arange(vocab, device="cuda")
        memory.remember(epoch, {"enc": (mass, count, {"mean_mass": mass.mean(dim=0)})})
        snapshot = memory.previous["enc"]
        assert all(part.device.type == "cpu" for part in snapshot.values())
        assert snapshot["attention_mass"].is_pinned() and snapshot["mean_mass"].is_pinned()
        assert torch.equal(snapshot["attention_mass"], mass.cpu()) and torch.equal(snapshot["query_count"], count.cpu())
        assert torch.equal(snapshot["mean_mass"], mass.mean(dim=0).cpu())
        assert torch.allclose(
            snapshot["row_plogp"],
            (mass / mass.sum(-1, keepdim=True)).xlogy_(mass / mass.sum(-1, keepdim=True)).sum(-1).cpu(),
            atol=1e-6,
        )
        kept.append(snapshot["attention_mass"].data_ptr())
    # Epoch 0 is the reference, so epoch 1's copy retires at epoch 2 and epoch 3 is copied into its memory.
    assert kept[3] == kept[1] and len(set(kept[:3])) == 3
    previous, reference, lost = memory.snapshots("enc", torch.Size((heads, vocab, vocab)))
    assert lost == []
    assert previous.attention_mass.data_ptr() == kept[3] and reference.attention_mass.data_ptr() == kept[0]
    # A resumed checkpoint's snapshots lie in pageable memory: the reference is pinned at the next epoch end, and
    # the retired previous one is not reused as a spare.
    state = memory.state_dict()
    for part in ("previous", "reference"):
        state[part] = {n: {k: torch.from_numpy(v.numpy().copy()) for k, v in m.items()} for n, m in state[part].items()}
    resumed = DriftMemory()
    resumed.load_state_dict(state)
    reference_mass = state["reference"]["enc"]["attention_mass"]
    for epoch in (4, 5, 6):
        mass = torch.rand(heads, vocab, vocab, device="cuda")
        resumed.remember(epoch, {"enc": (mass, torch.arange(vocab, device="cuda"), {})})
        assert all(part.is_pinned() for m in (resumed.previous, resumed.reference) for part in m["enc"].values())
        assert torch.equal(resumed.previous["enc"]["attention_mass"], mass.cpu())
    assert torch.equal(resumed.reference["enc"]["attention_mass"], reference_mass)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_drift_memory_falls_back_to_pageable_memory_with_one_warning(monkeypatch):
    empty = torch.empty

    def refusing(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("no page-locked memory")
        return empty(*args, **kwargs)

    monkeypatch.setattr(drift_memory.torch, "empty", refusing)
    monkeypatch.setattr(drift_memory, "_PAGEABLE", [])
    memory = DriftMemory()
    mass = torch.rand(2, 3, 3, device="cuda")
    with pytest.warns(UserWarning, match="no page-locked host memory"):
        memory.remember(0, {"enc": (mass, torch.ones(3, dtype=torch.long, device="cuda"), {})})
    kept = memory.previous["enc"]["attention_mass"]
    assert not kept.is_pinned() and torch.equal(kept, mass.cpu())


def test_drift_memory_keeps_its_epochs_when_no_module_saw_a_token():
    memory = DriftMemory()
    memory.remember(0, {"enc": (torch.rand(2, 4, 4), torch.ones(4, dtype=torch.long), {})})
    memory.remember(1, {"enc": (torch.zeros(2, 4, 4), torch.zeros(4, dtype=torch.long), {})})  # all NaN, say
    assert (memory.previous_epoch, memory.reference_epoch) == (0, 0)
    empty = DriftMemory()
    empty.remember(0, {"enc": (torch.zeros(2, 4, 4), torch.zeros(4, dtype=torch.long), {})})
    assert empty.reference_epoch is None and empty.previous_epoch is None  # epoch 1 can still be the reference
    empty.remember(1, {"enc": (torch.rand(2, 4, 4), torch.ones(4, dtype=torch.long), {})})
    assert empty.reference_epoch == 1 and empty.snapshots("enc", torch.Size((2, 4, 4)))[1] is not None


def test_drift_memory_names_an_epoch_both_previous_and_reference_once_when_lost():
    memory = DriftMemory()
    memory.remember(0, {"enc": (torch.rand(2, 4, 4), torch.ones(4, dtype=torch.long), {})})
    assert memory.snapshots("enc", torch.Size((2, 5, 5))) == (None, None, [(0, (2, 4, 4))])
