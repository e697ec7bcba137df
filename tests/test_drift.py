import math

import pytest
import torch
from _reference import naive_js

from attn_callbacks import functional as F


def naive_drift(current, reference, current_count, reference_count, min_support):
    """float64 loop reference of (js, frobenius) for one (V, V) pair of matrices."""
    vq, vk = current.shape
    num = den = 0.0
    for a in range(vq):
        if current_count[a] >= min_support and reference_count[a] >= min_support:
            wa = float(current_count[a])
            num += wa * naive_js(current[a].tolist(), reference[a].tolist())
            den += wa
    diff = sum((float(current[a, b]) - float(reference[a, b])) ** 2 for a in range(vq) for b in range(vk))
    ref = sum(float(reference[a, b]) ** 2 for a in range(vq) for b in range(vk))
    return (num / den if den else 0.0), (math.sqrt(diff) / math.sqrt(ref) if ref else 0.0)


def test_js_divergence_hand_computed_values():
    p = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    q = torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64)
    # m = [0.25, 0.5, 0.25]; KL(p||m) = 0.5 log 2 + 0.5 log 1 = KL(q||m)
    expected = 0.5 * (0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.5)) * 2
    assert math.isclose(float(F.js_divergence(p, q)), expected, rel_tol=1e-12)
    assert math.isclose(float(F.js_divergence(p, q)), 0.5 * math.log(2), rel_tol=1e-12)
    # unnormalised rows are renormalised first
    assert math.isclose(float(F.js_divergence(4 * p, 0.1 * q)), expected, rel_tol=1e-12)
    # an asymmetric case: p = [0.2, 0.8], q = [0.6, 0.4], m = [0.4, 0.6]
    a, b = [0.2, 0.8], [0.6, 0.4]
    by_hand = 0.5 * (0.2 * math.log(0.2 / 0.4) + 0.8 * math.log(0.8 / 0.6)) + 0.5 * (
        0.6 * math.log(0.6 / 0.4) + 0.4 * math.log(0.4 / 0.6)
    )
    got = float(F.js_divergence(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)))
    assert math.isclose(got, by_hand, rel_tol=1e-12)
    assert math.isclose(got, naive_js(a, b), rel_tol=1e-12)


def test_js_divergence_identical_disjoint_and_zero_rows():
    p = torch.tensor([[0.1, 0.2, 0.7], [1.0, 0.0, 0.0], [0.3, 0.3, 0.4], [0.0, 0.0, 0.0], [0.5, 0.5, 0.0]])
    q = torch.tensor([[0.2, 0.4, 1.4], [0.0, 0.5, 0.5], [0.0, 0.0, 0.0], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0]])
    js = F.js_divergence(p, q)
    assert js.shape == (5,)
    torch.testing.assert_close(js, torch.tensor([0.0, math.log(2), 0.0, 0.0, math.log(2)]), rtol=1e-6, atol=1e-6)
    assert float(F.js_divergence(torch.zeros(3), torch.zeros(3))) == 0.0


def test_js_divergence_matches_naive_on_random_rows():
    g = torch.Generator().manual_seed(13)
    p = torch.rand(3, 4, 6, generator=g, dtype=torch.float64)
    q = torch.rand(3, 4, 6, generator=g, dtype=torch.float64)
    p[0, 1, :3] = 0
    q[2, 2, 3:] = 0
    js = F.js_divergence(p, q)
    expected = torch.tensor(
        [[naive_js(p[x, y].tolist(), q[x, y].tolist()) for y in range(4)] for x in range(3)], dtype=torch.float64
    )
    torch.testing.assert_close(js, expected, rtol=1e-10, atol=1e-12)
    assert (js >= 0).all() and (js <= math.log(2) + 1e-12).all()


def test_js_divergence_stays_within_log_2_in_float32():
    # Disjoint rows are exactly log 2 apart; float32 rounding over 1,500 keys used to give up to 0.6931481.
    g = torch.Generator().manual_seed(0)
    p, q = torch.rand(20, 1500, generator=g), torch.rand(20, 1500, generator=g)
    p[:, 750:], q[:, :750] = 0, 0
    js = F.js_divergence(p, q)
    log_2 = torch.tensor(math.log(2))  # float32, like js
    assert (js <= log_2).all() and (js >= log_2 - 2e-6).all()


def _random_drift_case(seed, heads=None, v=6):
    g = torch.Generator().manual_seed(seed)
    shape = (v, v) if heads is None else (heads, v, v)
    current = torch.rand(shape, generator=g, dtype=torch.float64)
    reference = torch.rand(shape, generator=g, dtype=torch.float64)
    current_count = torch.tensor([5, 1, 7, 0, 3, 9])[:v]
    reference_count = torch.tensor([4, 6, 2, 8, 3, 0])[:v]
    return current, reference, current_count, reference_count


def test_attention_drift_is_zero_for_identical_epochs():
    current, _, current_count, reference_count = _random_drift_case(14)
    js, frob = F.attention_drift(current, current.clone(), current_count, reference_count, min_support=1)
    assert abs(float(js)) < 1e-12 and float(frob) == 0.0


def test_attention_drift_matches_naive_loop_with_rows_below_min_support():
    current, reference, current_count, reference_count = _random_drift_case(15)
    for min_support in (1, 3, 5):
        js, frob = F.attention_drift(current, reference, current_count, reference_count, min_support=min_support)
        rjs, rfrob = naive_drift(current, reference, current_count, reference_count, min_support)
        assert math.isclose(float(js), rjs, rel_tol=1e-10), min_support
        assert math.isclose(float(frob), rfrob, rel_tol=1e-10)
    # min_support = 3 keeps rows 0, 2, 4 only: weights Q_t = 5, 0 (Q_s[2] = 2 < 3), 3 -> rows 0 and 4
    js, _ = F.attention_drift(current, reference, current_count, reference_count, min_support=3)
    by_rows = (5 * naive_js(current[0].tolist(), reference[0].tolist())) + 3 * naive_js(
        current[4].tolist(), reference[4].tolist()
    )
    assert math.isclose(float(js), by_rows / 8, rel_tol=1e-10)


def test_attention_drift_no_supported_row_and_zero_reference_give_zero():
    current, reference, current_count, reference_count = _random_drift_case(16)
    js, frob = F.attention_drift(current, reference, current_count, reference_count, min_support=100)
    assert float(js) == 0.0 and float(frob) > 0
    js, frob = F.attention_drift(current, torch.zeros_like(reference), current_count, reference_count)
    assert float(js) == 0.0 and float(frob) == 0.0


def test_attention_drift_batched_heads_gives_per_head_values():
    current, reference, current_count, reference_count = _random_drift_case(17, heads=3)
    js, frob = F.attention_drift(current, reference, current_count, reference_count, min_support=2)
    assert js.shape == (3,) and frob.shape == (3,)
    for h in range(3):
        rjs, rfrob = naive_drift(current[h], reference[h], current_count, reference_count, 2)
        assert math.isclose(float(js[h]), rjs, rel_tol=1e-10)
        assert math.isclose(float(frob[h]), rfrob, rel_tol=1e-10)


def test_moved_tokens_orders_by_js_and_keeps_supported_rows_only():
    current, reference, current_count, reference_count = _random_drift_case(18)
    moved = F.moved_tokens(current, reference, current_count, reference_count, k=10, min_support=3)
    supported = [a for a in range(6) if current_count[a] >= 3 and reference_count[a] >= 3]
    assert supported == [0, 4]
    expected = sorted(
        ((a, naive_js(current[a].tolist(), reference[a].tolist())) for a in supported), key=lambda t: -t[1]
    )
    assert [a for a, _ in moved] == [a for a, _ in expected]
    for (_, got), (_, ref) in zip(moved, expected, strict=True):
        assert math.isclose(got, ref, rel_tol=1e-10)
    everything = F.moved_tokens(current, reference, current_count, reference_count, k=10, min_support=1)
    assert sorted(a for a, _ in everything) == [0, 1, 2, 4]  # Q_t[3] = 0 and Q_s[5] = 0 drop rows 3 and 5
    scores = [s for _, s in everything]
    assert scores == sorted(scores, reverse=True)
    top = F.moved_tokens(current, reference, current_count, reference_count, k=1, min_support=1)
    assert top == everything[:1]


@pytest.mark.parametrize("heads", [None, 3])
def test_attention_drift_row_divergence_is_each_rows_js_nan_where_rows_do_not_count(heads):
    current, reference, current_count, reference_count = _random_drift_case(19, heads=heads)
    # min_support 1 keeps 4 of 6 rows (the one-pass path), 3 keeps 2 (the gathered rows)
    for min_support in (1, 3):
        js, frob, rows = F.attention_drift(
            current, reference, current_count, reference_count, min_support, row_divergence=True
        )
        expected = F.attention_drift(current, reference, current_count, reference_count, min_support)
        assert torch.equal(js, expected[0]) and torch.equal(frob, expected[1])
        for h in range(1 if heads is None else heads):
            now, then = (current, reference) if heads is None else (current[h], reference[h])
            got = rows if heads is None else rows[h]
            for a in range(6):
                if current_count[a] >= min_support and reference_count[a] >= min_support:
                    assert math.isclose(float(got[a]), naive_js(now[a].tolist(), then[a].tolist()), rel_tol=1e-10)
                else:
                    assert math.isnan(float(got[a])), (min_support, a)
        if heads is None:
            args = (current, reference, current_count, reference_count, 10, min_support)
            assert F.moved_tokens(*args, row_divergence=rows) == F.moved_tokens(*args)
            # Given the rows' JS, the reference matrix is not needed (the callback keeps it off the device).
            alone = (current, None, current_count, reference_count, 10, min_support)
            assert F.moved_tokens(*alone, row_divergence=rows) == F.moved_tokens(*args)
            with pytest.raises(ValueError, match="`reference` may be None only when `row_divergence` is given"):
                F.moved_tokens(*alone)


def test_moved_tokens_hand_computed_with_ties():
    current = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, 1.0], [1.0, 0.0]])
    reference = torch.tensor([[0.0, 1.0], [0.5, 0.5], [1.0, 0.0], [0.0, 1.0]])
    counts = torch.tensor([2, 2, 2, 1])
    moved = F.moved_tokens(current, reference, counts, counts, k=5, min_support=2)
    # rows 0 and 2 are disjoint (log 2, tie: smaller id first), row 1 unchanged, row 3 unsupported
    assert [a for a, _ in moved] == [0, 2, 1]
    assert all(math.isclose(s, math.log(2), rel_tol=1e-6) for _, s in moved[:2])
    assert abs(moved[2][1]) < 1e-7
    assert F.moved_tokens(current, reference, counts, counts, k=5, min_support=3) == []


def test_drift_memory_drops_a_reference_of_another_shape_keeps_the_previous_epoch():
    from attn_callbacks.metrics.drift import DriftMemory

    memory = DriftMemory()
    memory.remember(0, {"enc": (torch.rand(2, 4, 3), torch.ones(4, dtype=torch.long), {})})  # the reference
    memory.remember(1, {"enc": (torch.rand(2, 4, 4), torch.ones(4, dtype=torch.long), {})})  # another model since
    previous, reference = memory.snapshots("enc", torch.Size((2, 4, 4)))
    assert previous is not None and previous.attention_mass.shape == (2, 4, 4) and reference is None
    assert memory.snapshots("enc", torch.Size((2, 4, 3))) == (None, None)


def views_of(sums: torch.Tensor, heads: int = 2, vocab: int = 3) -> torch.Tensor:
    """P where S lay in packed sums ``(H + 1, V²)``."""
    return sums[:heads].view(heads, vocab, vocab)


def test_drift_memory_hands_the_sums_the_packed_state_a_retired_p_was_computed_in():
    """P computed where S lay (a view of the packed sums, U beside it): while a snapshot keeps it, the sums need other
    memory; that of a retired snapshot's packed state, once there is one, else fresh memory (None)."""
    from attn_callbacks.metrics.drift import DriftMemory

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
    from attn_callbacks.metrics.drift import DriftMemory

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
    previous, reference = memory.snapshots("enc", torch.Size((heads, vocab, vocab)))
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
    from attn_callbacks.metrics import drift

    empty = torch.empty

    def refusing(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("no page-locked memory")
        return empty(*args, **kwargs)

    monkeypatch.setattr(drift.torch, "empty", refusing)
    monkeypatch.setattr(drift, "_PAGEABLE", [])
    memory = drift.DriftMemory()
    mass = torch.rand(2, 3, 3, device="cuda")
    with pytest.warns(UserWarning, match="no page-locked host memory"):
        memory.remember(0, {"enc": (mass, torch.ones(3, dtype=torch.long, device="cuda"), {})})
    kept = memory.previous["enc"]["attention_mass"]
    assert not kept.is_pinned() and torch.equal(kept, mass.cpu())
