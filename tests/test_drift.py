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
