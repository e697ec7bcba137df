"""The numba epoch-end pass (attn_callbacks/metrics/summary_numba.py) against the torch functions it replaces on the
CPU."""

import math

import pytest
import torch

pytest.importorskip("numba")

from attn_callbacks.metrics import summary_numba
from attn_callbacks.metrics.drift import Snapshot, head_mean
from attn_callbacks.metrics.summary import summarize


def sums(heads, vocab_q, vocab_k, density=0.3, seed=0):
    """Sparse ``S``, ``Q`` (some ids unseen) and ``U`` (positive wherever some head is) as an epoch would give."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 9, (vocab_q,), generator=g)
    counts[::5] = 0
    hits = torch.rand(heads, vocab_q, vocab_k, generator=g) < density
    raw = torch.rand(heads, vocab_q, vocab_k, generator=g) ** 3 * hits
    rows = raw.sum(dim=-1, keepdim=True)
    attention_sum = torch.where(rows > 0, raw / rows.clamp(min=1e-30), 0) * counts[:, None] * 0.9  # 10 % ignored
    uniform = ((attention_sum > 0).any(dim=0) | (torch.rand(vocab_q, vocab_k, generator=g) < 0.1)).float()
    uniform = uniform * torch.rand(vocab_q, vocab_k, generator=g) * counts[:, None]
    return attention_sum.float(), counts, uniform.float()


def mass_of(attention_sum, counts):
    return torch.where(counts[:, None] > 0, attention_sum / counts.clamp(min=1)[:, None], 0)


def summary_both_ways(monkeypatch, mass_heads, uniform, counts, square, previous, reference, support):
    args = (mass_heads, uniform, counts, torch.rand(6, mass_heads.shape[0]), torch.tensor(3))
    kw = dict(square=square, previous=previous, reference=reference, min_support=support, sink_ids=[0, 2])
    monkeypatch.setenv("ATTN_CALLBACKS_NUMBA", "0")
    reference_summary = summarize(*args, **kw)
    monkeypatch.setenv("ATTN_CALLBACKS_NUMBA", "1")
    fast = summarize(*args, **kw)
    return fast, reference_summary


@pytest.mark.parametrize(
    ("heads", "vocab_q", "vocab_k", "support"), [(4, 37, 37, 1), (1, 50, 50, 3), (3, 20, 45, 2), (2, 300, 300, 1)]
)
def test_summarize_numba_pass_equals_torch_functions(monkeypatch, heads, vocab_q, vocab_k, support):
    attention_sum, counts, uniform = sums(heads, vocab_q, vocab_k)
    mass_heads = mass_of(attention_sum, counts)
    then_sum, then_counts, _ = sums(heads, vocab_q, vocab_k, seed=1)
    previous = Snapshot.of(mass_of(then_sum, then_counts), then_counts)
    older_sum, older_counts, _ = sums(heads, vocab_q, vocab_k, density=0.1, seed=2)
    reference = Snapshot.of(mass_of(older_sum, older_counts), older_counts)
    square = vocab_q == vocab_k
    fast, slow = summary_both_ways(monkeypatch, mass_heads, uniform, counts, square, previous, reference, support)
    assert fast.layer.keys() == slow.layer.keys() and fast.heads.keys() == slow.heads.keys()
    assert {"entropy", "lift", "drift/js_prev", "drift/frobenius_ref"} <= fast.layer.keys()
    assert ("asymmetry" in fast.layer) == square
    for name in slow.layer:
        torch.testing.assert_close(fast.layer[name], slow.layer[name], rtol=1e-5, atol=1e-6, msg=name)
    for name in slow.heads:
        torch.testing.assert_close(fast.heads[name], slow.heads[name], rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(fast.plogp_heads, slow.plogp_heads, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fast.mean_mass, head_mean(mass_heads), rtol=1e-6, atol=1e-7)
    for which in ("prev", "ref"):  # every row's JS, NaN where the row does not count
        torch.testing.assert_close(
            fast.drifts[which].rows, slow.drifts[which].rows, rtol=1e-5, atol=1e-6, equal_nan=True
        )
        assert fast.drifts[which].rows.isnan().any()


def test_summarize_numba_pass_lift_and_asymmetry_equal_float64_definitions(monkeypatch):
    attention_sum, counts, uniform = sums(3, 40, 40, seed=4)
    mass_heads = mass_of(attention_sum, counts)
    fast, _ = summary_both_ways(monkeypatch, mass_heads, uniform, counts, True, None, None, 1)
    s, u, p = attention_sum.double(), uniform.double(), mass_heads.double()
    for h in range(3):
        seen = s[h] > 0
        lift = math.exp(float((s[h][seen] * (s[h][seen] / u[seen]).log()).sum() / s[h].sum()))
        assert fast.heads["lift"][h].item() == pytest.approx(lift, rel=1e-5)
        asymmetry = math.sqrt(1 - float((p[h] * p[h].T).sum() / (p[h] * p[h]).sum()))
        assert fast.heads["asymmetry"][h].item() == pytest.approx(asymmetry, rel=1e-5)


def test_summarize_numba_pass_epoch_compared_with_itself_has_no_drift(monkeypatch):
    attention_sum, counts, uniform = sums(4, 64, 64, seed=5)
    mass_heads = mass_of(attention_sum, counts)
    monkeypatch.setenv("ATTN_CALLBACKS_NUMBA", "1")
    first = summarize(mass_heads, uniform, counts, torch.zeros(6, 4), torch.tensor(0), square=True)
    same = Snapshot(mass_heads.clone(), counts.clone(), first.plogp_heads, first.mean_mass.clone())
    again = summarize(mass_heads, uniform, counts, torch.zeros(6, 4), torch.tensor(0), square=True, previous=same)
    for name in ("drift/js_prev", "drift/frobenius_prev"):
        assert again.layer[name].item() == 0.0 and again.heads[name].eq(0).all(), name


def test_row_pass_threads_split_rows_without_changing_results():
    numba = pytest.importorskip("numba")
    attention_sum, counts, uniform = sums(3, 101, 101, seed=6)
    mass_heads = mass_of(attention_sum, counts)
    then_sum, then_counts, _ = sums(3, 101, 101, seed=7)
    earlier = [Snapshot.of(mass_of(then_sum, then_counts), then_counts)]
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = summary_numba.row_pass(mass_heads, counts, uniform, earlier, 1)
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        two = summary_numba.row_pass(mass_heads, counts, uniform, earlier, 1)
    finally:
        numba.set_num_threads(before)
    for a, b in zip(one, two, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, equal_nan=True)


def test_summarize_uses_torch_functions_when_numba_is_switched_off(monkeypatch):
    attention_sum, counts, uniform = sums(2, 30, 30)
    calls = []
    monkeypatch.setattr(summary_numba, "row_pass", lambda *a, **k: calls.append(1))
    monkeypatch.setenv("ATTN_CALLBACKS_NUMBA", "0")
    summarize(mass_of(attention_sum, counts), uniform, counts, torch.zeros(6, 2), torch.tensor(0), square=True)
    assert calls == []


def test_row_pass_refuses_an_earlier_epoch_of_another_shape():
    attention_sum, counts, uniform = sums(2, 40, 40)
    mass_heads = mass_of(attention_sum, counts)
    other_sum, other_counts, _ = sums(2, 40, 30, seed=1)  # another key vocabulary: the kernel would read past it
    with pytest.raises(ValueError, match=r"earlier\[0\]\.attention_mass.*\(2, 40, 40\).*\(2, 40, 30\)"):
        summary_numba.row_pass(mass_heads, counts, uniform, [Snapshot.of(mass_of(other_sum, other_counts), counts)], 1)
    with pytest.raises(ValueError, match="uniform_sum"):
        summary_numba.row_pass(mass_heads, counts, uniform[:, :30], [], 1)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_summarize_numba_pass_leaves_a_non_finite_p_to_the_torch_functions(monkeypatch, value):
    attention_sum, counts, uniform = sums(3, 30, 30)
    mass_heads = mass_of(attention_sum, counts)
    mass_heads[1, 4, 7] = value
    assert summary_numba.row_pass(mass_heads, counts, uniform, [], 1) is None
    fast, slow = summary_both_ways(monkeypatch, mass_heads, uniform, counts, True, None, None, 1)
    assert slow.heads["entropy"][1].isnan() and slow.layer["asymmetry"].isnan()
    for name in slow.heads:
        torch.testing.assert_close(fast.heads[name], slow.heads[name], equal_nan=True, msg=name)


@pytest.mark.parametrize("size", [1, 63, 64, 65, 130, 256, 257, 600])
def test_cross_and_norm_sums_equal_float64_sums_across_tile_and_block_edges(size):
    g = torch.Generator().manual_seed(size)
    matrices = torch.rand(3, size, size, generator=g) * (torch.rand(3, size, size, generator=g) < 0.4)
    cross, norm = summary_numba.cross_and_norm_sums(matrices)
    p = matrices.double()
    torch.testing.assert_close(cross, (p * p.transpose(1, 2)).sum(dim=(1, 2)), rtol=1e-12, atol=0)
    torch.testing.assert_close(norm, (p * p).sum(dim=(1, 2)), rtol=1e-12, atol=0)


def test_cross_and_norm_sums_of_a_symmetric_matrix_are_equal():
    g = torch.Generator().manual_seed(0)
    for size in (5, 65, 200):
        half = torch.rand(2, size, size, generator=g)
        cross, norm = summary_numba.cross_and_norm_sums(half + half.transpose(1, 2))
        assert torch.equal(cross, norm)  # asymmetry exactly 0
