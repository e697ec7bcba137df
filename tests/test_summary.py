import math

import pytest
import torch
from _reference import (
    masked_case,
    naive_position_sums,
    random_case,
    row_kept,
    run,
    run_full,
)

from attn_callbacks import functional as F


def test_attention_mass_rows_sum_to_one_and_mean_weight_hand_computed():
    # one sequence [1, 2, 1]; head weights chosen by hand
    w = torch.tensor([[[[0.5, 0.5, 0.0], [0.2, 0.2, 0.6], [0.1, 0.3, 0.6]]]])
    ids = torch.tensor([[1, 2, 1]])
    valid = torch.ones(1, 3, dtype=torch.bool)
    S, C, Q, _ = run(w, ids, ids, valid, valid, 3, 3)
    P = F.attention_mass(S, Q)
    # token 1 occurs twice as query: row sums (0.5+0.0+0.1+0.6, 0.5+0.3) / 2
    torch.testing.assert_close(P[0, 1], torch.tensor([0.0, 1.2 / 2, 0.8 / 2]))
    torch.testing.assert_close(P[0, 2], torch.tensor([0.0, 0.8, 0.2]))
    assert P[0, 0].sum() == 0
    M = F.mean_weight(S, C)  # C[1,1] = 4 pairs, C[1,2] = 2
    torch.testing.assert_close(M[0, 1], torch.tensor([0.0, 1.2 / 4, 0.8 / 2]))


def test_asymmetry_index_hand_computed_values():
    assert float(F.asymmetry_index(torch.eye(3))) == 0.0
    assert float(F.asymmetry_index(torch.zeros(2, 2))) == 0.0
    strictly_lower = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    assert math.isclose(float(F.asymmetry_index(strictly_lower)), 1.0)
    p = torch.tensor([[0.0, 1.0], [0.0, 1.0]])  # <P,Pt> = 1, <P,P> = 2
    assert math.isclose(float(F.asymmetry_index(p)), math.sqrt(0.5), rel_tol=1e-6)
    batched = F.asymmetry_index(torch.stack([torch.eye(2), strictly_lower]))
    torch.testing.assert_close(batched, torch.tensor([0.0, 1.0]))


def test_row_entropy_weighted_by_query_count():
    p = torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.0, 0.0]])
    q = torch.tensor([3, 1, 0])
    expected = 3 * math.log(2) / 4
    assert math.isclose(float(F.row_entropy(p, q)), expected, rel_tol=1e-6)


def test_lift_hand_computed_and_zero_where_uniform_is_zero():
    torch.testing.assert_close(
        F.lift(torch.tensor([[0.9, 0.1, 0.3]]), torch.tensor([[0.5, 0.5, 0.0]])), torch.tensor([[1.8, 0.2, 0.0]])
    )
    per_head = F.lift(torch.tensor([[[2.0, 1.0]], [[0.0, 4.0]]]), torch.tensor([[1.0, 2.0]]))
    torch.testing.assert_close(per_head, torch.tensor([[[2.0, 0.5]], [[0.0, 2.0]]]))


def test_lift_is_one_for_uniform_attention_over_visible_keys_causal_mask_padding():
    case = masked_case(3, 2, [6, 4, 2], vocab=5, causal=True, uniform=True, seed=11)
    S, _, Q, U, _, skipped = run_full(*case, 5, 5)
    assert skipped == 0
    torch.testing.assert_close(U.sum(dim=1), Q.double())
    support = U > 0
    assert support.sum() > 5
    layer = F.lift(S.double().mean(dim=0), U)
    torch.testing.assert_close(layer[support], torch.ones(int(support.sum()), dtype=torch.float64))
    assert (layer[~support] == 0).all()
    heads = F.lift(S.double(), U)
    torch.testing.assert_close(heads[:, support], torch.ones(2, int(support.sum()), dtype=torch.float64))


def test_lift_of_a_one_hot_head_next_to_a_uniform_head_hand_computed():
    # causal, 2 sequences [0, x, x, x] with x in {1, 2}; head 0 one-hot on position 0 (token 0), head 1 uniform over
    # positions 0..i, so every causal key is visible and U[a, b] = Σ 1 / (i + 1) over rows i holding a, keys holding b
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(1, 3, (2, 4), generator=g)
    ids[:, 0] = 0
    valid = torch.ones(2, 4, dtype=torch.bool)
    uniform = torch.ones(4, 4).tril() / torch.arange(1, 5)[:, None]
    weights = torch.stack([torch.zeros(4, 4), uniform])[None].repeat(2, 1, 1, 1)
    weights[:, 0, :, 0] = 1.0
    S, _, Q, U, _, _ = run_full(weights, ids, ids, valid, valid, 3, 3)
    expected_u = torch.zeros(3, 3, dtype=torch.float64)
    for n in range(2):
        for i in range(4):
            for j in range(i + 1):
                expected_u[int(ids[n, i]), int(ids[n, j])] += 1 / (i + 1)
    torch.testing.assert_close(U, expected_u)
    lifts = F.lift(S.double(), U)
    torch.testing.assert_close(lifts[1][U > 0], torch.ones(int((U > 0).sum()), dtype=torch.float64))
    # head 0: all of each row's mass on token 0, Q[a] in all, against a baseline of U[a, 0]
    torch.testing.assert_close(lifts[0, :, 0], Q.double() / expected_u[:, 0])
    assert float(lifts[0, 0, 0]) == 1.0 and (lifts[0, 1:, 0] > 1).all() and (lifts[0, :, 1:] == 0).all()


def test_lift_is_one_when_the_only_head_is_one_hot():
    # documented consequence of "visible = non-zero weight in some head": a single one-hot head leaves one visible key
    weights, ids, _, valid, _ = masked_case(2, 1, [4, 4], vocab=3, causal=True, uniform=True, seed=12)
    ids[:, 0] = 0
    weights = torch.zeros_like(weights)
    weights[..., 0] = 1.0
    S, _, Q, U, _, _ = run_full(weights, ids, ids, valid, valid, 3, 3)
    torch.testing.assert_close(U, S[0].double())
    torch.testing.assert_close(U.sum(dim=1), Q.double())


def test_position_statistics_matches_loop_definitions():
    weights, qi, ki, qv, kv = random_case(3, 4, 7, 7, 5, 5, causal=True, seed=19)
    _, _, Q, _, P, _ = run_full(weights, qi, ki, qv, kv, 5, 5)
    ref = naive_position_sums(weights, qv, kv)
    rows = sum(1 for n in range(3) for i in range(7) if row_kept(weights, qv, n, i))
    assert int(Q.sum()) == rows
    stats = F.position_statistics(P, Q)
    assert set(stats) == {"entropy", "entropy_normalized", "self", "previous", "next", "distance"}
    expected = {
        "entropy": ref[0] / rows,
        "entropy_normalized": ref[0] / ref[1],
        "self": ref[2] / rows,
        "previous": ref[3] / rows,
        "next": ref[4] / rows,
        "distance": ref[5] / rows,
    }
    for name, value in expected.items():
        assert stats[name].shape == (4,)
        torch.testing.assert_close(stats[name], value, rtol=1e-5, atol=1e-6, msg=name)
    # causal: nothing on the next position, and a normalised entropy in (0, 1]
    assert (stats["next"] == 0).all()
    assert ((stats["entropy_normalized"] > 0) & (stats["entropy_normalized"] <= 1 + 1e-6)).all()


def test_position_statistics_hand_computed_previous_token_head_and_uniform_head():
    # 2 sequences of lengths 4 and 3 (one padded position), causal; head 0 one-hot on the previous position (row 0:
    # itself), head 1 uniform over positions 0..i, which makes every causal key visible.
    weights, ids, _, valid, _ = masked_case(2, 2, [4, 3], vocab=4, causal=True, uniform=True, seed=20)
    weights[:, 0] = 0.0
    for i in range(4):
        weights[:, 0, i, max(i - 1, 0)] = 1.0
    _, _, Q, _, P, _ = run_full(weights, ids, ids, valid, valid, 4, 4)
    stats = F.position_statistics(P, Q)
    rows = [0, 1, 2, 3, 0, 1, 2]  # positions of the 7 valid query rows
    r = len(rows)
    expected = {
        "entropy": [0.0, sum(math.log(i + 1) for i in rows) / r],
        "entropy_normalized": [0.0, 1.0],
        "self": [2 / r, sum(1 / (i + 1) for i in rows) / r],
        "previous": [5 / r, sum(1 / (i + 1) for i in rows if i > 0) / r],
        "next": [0.0, 0.0],
        "distance": [5 / r, sum(i / 2 for i in rows) / r],
    }
    for name, value in expected.items():
        torch.testing.assert_close(stats[name], torch.tensor(value, dtype=torch.float64), msg=name)


def test_position_statistics_no_rows_gives_zeros():
    stats = F.position_statistics(torch.zeros(6, 2, dtype=torch.float64), torch.zeros(3, dtype=torch.long))
    assert all((v == 0).all() and v.shape == (2,) for v in stats.values())


def test_sink_mass_is_one_when_every_query_attends_only_to_token_zero():
    g = torch.Generator().manual_seed(21)
    weights, ids, _, valid, _ = masked_case(3, 2, [5, 3, 4], vocab=4, causal=False, seed=21)
    ids = torch.where(valid, torch.randint(1, 4, ids.shape, generator=g), -100)
    sink_position = [2, 0, 3]
    weights = torch.zeros_like(weights)
    for n, j in enumerate(sink_position):
        ids[n, j] = 0
        weights[n, :, :, j] = 1.0
    S, _, Q, _, _, _ = run_full(weights, ids, ids, valid, valid, 4, 4)
    torch.testing.assert_close(F.sink_mass(S, Q, torch.tensor([0])), torch.ones(2))
    torch.testing.assert_close(F.sink_mass(S.mean(0), Q, torch.tensor([0])), torch.tensor(1.0))
    torch.testing.assert_close(F.sink_mass(S, Q, torch.tensor([1, 2, 3])), torch.zeros(2))
    torch.testing.assert_close(F.in_degree(S, Q), torch.tensor([[1.0, 0.0, 0.0, 0.0]] * 2))


def test_sink_mass_hand_computed():
    S = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]])  # (H=1, Vq=2, Vk=3)
    Q = torch.tensor([1, 1])
    torch.testing.assert_close(F.sink_mass(S, Q, torch.tensor([0])), torch.tensor([0.6 / 2]))
    torch.testing.assert_close(F.sink_mass(S, Q, torch.tensor([0, 2])), torch.tensor([1.6 / 2]))
    assert float(F.sink_mass(S, torch.zeros(2, dtype=torch.long), torch.tensor([0]))[0]) == 0.0


def test_in_degree_matches_loop_and_sums_to_one_over_keys():
    case = masked_case(3, 2, [6, 4, 5], vocab=5, causal=True, seed=22)  # padded keys get exactly 0
    S, _, Q, _, _, _ = run_full(*case, 5, 5)
    deg = F.in_degree(S, Q)
    assert deg.shape == (2, 5)
    total = float(Q.sum())
    expected = torch.tensor([[sum(float(S[h, a, b]) for a in range(5)) / total for b in range(5)] for h in range(2)])
    torch.testing.assert_close(deg, expected)
    torch.testing.assert_close(deg.sum(-1), torch.ones(2))
    # with key padding that still receives weight, the missing mass is the padding's share
    weights, qi, ki, qv, kv = random_case(3, 2, 6, 6, 5, 5, seed=23)
    S, _, Q, _ = run(weights, qi, ki, qv, kv, 5, 5)
    lost = sum(
        float(weights[n, h, i, j])
        for n in range(3)
        for h in range(2)
        for i in range(6)
        for j in range(6)
        if qv[n, i] and not kv[n, j]
    )
    torch.testing.assert_close(F.in_degree(S, Q).sum(), torch.tensor(2 - lost / float(Q.sum())))


def test_position_statistics_normalised_entropy_at_most_one_when_ignored_keys_weigh():
    # one query row, weights [0.3, 0.3, 0.4], the third key ignored: over the valid keys the row is [0.5, 0.5]
    weights = torch.tensor([[[[0.3, 0.3, 0.4]]]])
    ids = torch.tensor([[0]]), torch.tensor([[0, 1, 2]])
    valid = torch.tensor([[True]]), torch.tensor([[True, True, False]])
    *_, P, _ = run_full(weights, *ids, *valid, 1, 3)
    stats = F.position_statistics(P, torch.tensor([1]))
    assert math.isclose(float(stats["entropy"][0]), math.log(2), rel_tol=1e-6)  # float32 weights
    assert math.isclose(float(stats["entropy_normalized"][0]), 1.0, rel_tol=1e-6)
    with pytest.raises(ValueError, match="square \\(V, V\\) matrix for PageRank, but got shape \\(\\)"):
        F.pagerank(torch.tensor(1.0))


def test_mean_lift_of_a_large_float32_vocabulary_equals_float64():
    """Σ S log S and Σ S log U are large and close: the second, a float32 matrix-vector product over 9 million cells,
    was 1.5e-4 of the lift off at 3,000 ids. Summed in float64 it equals the float64 evaluation (1e-6)."""
    g = torch.Generator().manual_seed(0)
    vocab = 3000
    counts = torch.randint(1, 100_000, (vocab,), generator=g).float()
    raw = torch.rand(1, vocab, vocab, generator=g) ** 4
    S = raw / raw.sum(-1, keepdim=True) * counts[:, None]
    U = torch.rand(vocab, vocab, generator=g) + 0.5
    U = U / U.sum(-1, keepdim=True) * counts[:, None]
    exact = F.mean_lift(S.double(), U.double())
    assert float(F.mean_lift(S, U)) == pytest.approx(float(exact), rel=1e-6)


def test_mean_lift_refuses_a_plogp_that_is_not_one_value_per_row():
    sums, uniform = torch.rand(2, 3, 3), torch.rand(3, 3)
    torch.testing.assert_close(F.mean_lift(sums, uniform, F.row_plogp(sums)), F.mean_lift(sums, uniform))
    with pytest.raises(ValueError, match=r"`plogp` to have shape \(2, 3\).*\(3,\)"):
        F.mean_lift(sums, uniform, F.row_plogp(sums.mean(dim=0)))


def test_position_statistics_of_length_one_rows_leave_normalised_entropy_out():
    # 3 sequences of one token: each row sees one key, its entropy is 0 of a maximum log 1 = 0: undefined, and no
    # collapse (reporting 0 would warn of attention collapse for every head).
    weights = torch.ones(3, 2, 1, 1, dtype=torch.float64)
    valid = torch.ones(3, 1, dtype=torch.bool)
    sums = naive_position_sums(weights, valid, valid)
    stats = F.position_statistics(sums, torch.tensor([3]))
    assert "entropy_normalized" not in stats
    torch.testing.assert_close(stats["entropy"], torch.zeros(2, dtype=torch.float64))
    torch.testing.assert_close(stats["self"], torch.ones(2, dtype=torch.float64))
