import math

import pytest
import torch
from _reference import accumulate_attention_reference, naive_js

from attn_callbacks import blocks
from attn_callbacks import functional as F
from attn_callbacks.blocks import row_blocks, square_tiles
from attn_callbacks.kernels import weights_plogp


def naive_accumulate(weights, query_ids, key_ids, query_valid, key_valid, vq, vk):
    """float64 Python-loop reference of S, C, Q."""
    b_, h_, lq, lk = weights.shape
    S = torch.zeros(h_, vq, vk, dtype=torch.float64)
    C = torch.zeros(vq, vk, dtype=torch.float64)
    Q = torch.zeros(vq, dtype=torch.float64)
    skipped = 0
    for n in range(b_):
        for i in range(lq):
            if not query_valid[n, i]:
                continue
            if not torch.isfinite(weights[n, :, i]).all() or not (weights[n, :, i] > 0).any():
                skipped += 1
                continue
            a = int(query_ids[n, i])
            Q[a] += 1
            for j in range(lk):
                if not key_valid[n, j]:
                    continue
                b = int(key_ids[n, j])
                C[a, b] += 1
                for h in range(h_):
                    S[h, a, b] += float(weights[n, h, i, j])
    return S, C, Q, skipped


def random_case(b, h, lq, lk, vq, vk, causal=False, pad_id=-100, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(b, h, lq, lk, generator=g)
    if causal:
        scores = scores.masked_fill(torch.ones(lq, lk, dtype=torch.bool).triu(1), float("-inf"))
    weights = scores.softmax(-1)
    query_ids = torch.randint(0, vq, (b, lq), generator=g)  # small vocab: many repeated ids
    key_ids = torch.randint(0, vk, (b, lk), generator=g)
    query_ids[0, -2:] = pad_id
    key_ids[-1, -3:] = pad_id
    return weights, query_ids, key_ids, query_ids != pad_id, key_ids != pad_id


def run(weights, query_ids, key_ids, qv, kv, vq, vk):
    h = weights.shape[1]
    S = torch.zeros(h, vq, vk)
    C = torch.zeros(vq, vk, dtype=torch.long)
    Q = torch.zeros(vq, dtype=torch.long)
    skipped = accumulate_attention_reference(S, C, Q, weights, query_ids, key_ids, qv, kv)
    return S, C, Q, int(skipped)


def test_accumulate_attention_matches_naive_loop_self_attention_with_padding_and_causal_mask():
    for causal in (False, True):
        case = random_case(3, 4, 7, 7, 5, 5, causal=causal)
        S, C, Q, skipped = run(*case, 5, 5)
        rS, rC, rQ, rskipped = naive_accumulate(*case, 5, 5)
        torch.testing.assert_close(S.double(), rS, rtol=1e-5, atol=1e-6)
        assert torch.equal(C.double(), rC) and torch.equal(Q.double(), rQ) and skipped == rskipped == 0


def test_accumulate_attention_matches_naive_loop_cross_attention_different_lengths_and_vocabs():
    case = random_case(2, 3, 6, 9, 4, 11, seed=1)
    S, C, Q, _ = run(*case, 4, 11)
    rS, rC, rQ, _ = naive_accumulate(*case, 4, 11)
    torch.testing.assert_close(S.double(), rS, rtol=1e-5, atol=1e-6)
    assert torch.equal(C.double(), rC) and torch.equal(Q.double(), rQ)


def test_accumulate_attention_drops_and_counts_nan_rows():
    weights, qi, ki, qv, kv = random_case(2, 2, 4, 4, 3, 3, seed=2)
    weights[1, :, 2] = float("nan")  # a fully masked row, in every head
    weights[0, 1, 0, 1] = float("nan")  # one head only: the whole row goes
    S, C, Q, skipped = run(weights, qi, ki, qv, kv, 3, 3)
    rS, rC, rQ, rskipped = naive_accumulate(weights, qi, ki, qv, kv, 3, 3)
    assert torch.isfinite(S).all()
    torch.testing.assert_close(S.double(), rS, rtol=1e-5, atol=1e-6)
    assert torch.equal(C.double(), rC) and torch.equal(Q.double(), rQ) and skipped == rskipped == 2


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


def test_pairwise_asymmetry_and_one_way_pairs():
    p = torch.tensor([[0.2, 0.6, 0.2], [0.2, 0.8, 0.0], [0.1, 0.1, 0.8]])
    a = F.pairwise_asymmetry(p)
    assert math.isclose(float(a[0, 1]), (0.6 - 0.2) / 0.8, rel_tol=1e-6)
    torch.testing.assert_close(a, -a.T)
    counts = torch.full((3, 3), 10)
    pairs = F.one_way_pairs(p, counts, k=5, min_support=5)
    # (2,1): (0.1 - 0) / 0.1 = 1; (0,1): 0.4 / 0.8 = 0.5; (0,2): 0.1 / 0.3 = 1/3
    assert [(x, y) for x, y, _ in pairs] == [(2, 1), (0, 1), (0, 2)]
    assert math.isclose(pairs[0][2], 1.0, rel_tol=1e-6)
    counts[1, 2] = 1  # pair (2, 1) not seen both ways often enough
    assert [(x, y) for x, y, _ in F.one_way_pairs(p, counts, k=5, min_support=5)] == [(0, 1), (0, 2)]


def test_row_entropy_weighted_by_query_count():
    p = torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.0, 0.0]])
    q = torch.tensor([3, 1, 0])
    expected = 3 * math.log(2) / 4
    assert math.isclose(float(F.row_entropy(p, q)), expected, rel_tol=1e-6)


def test_top_tokens_orders_by_count_and_drops_unseen():
    assert F.top_tokens(torch.tensor([0, 5, 2, 5, 0]), 10).tolist() == [1, 3, 2]


# ---------------------------------------------------------------------------------------------------------------------
# Independent references for the uniform baseline, the position statistics and the epoch metrics.
# ---------------------------------------------------------------------------------------------------------------------


def _row_kept(weights, query_valid, n, i):
    return bool(query_valid[n, i]) and bool(torch.isfinite(weights[n, :, i]).all())


def _visible_keys(weights, key_valid, n, i):
    """Valid keys that at least one head gives a non-zero weight."""
    h_, lk = weights.shape[1], weights.shape[3]
    return [j for j in range(lk) if key_valid[n, j] and any(float(weights[n, h, i, j]) != 0.0 for h in range(h_))]


def naive_uniform(weights, query_ids, key_ids, query_valid, key_valid, vq, vk):
    """float64 Python-loop reference of U."""
    b_, _, lq, _ = weights.shape
    U = torch.zeros(vq, vk, dtype=torch.float64)
    for n in range(b_):
        for i in range(lq):
            if not _row_kept(weights, query_valid, n, i):
                continue
            visible = _visible_keys(weights, key_valid, n, i)
            for j in visible:
                U[int(query_ids[n, i]), int(key_ids[n, j])] += 1.0 / len(visible)
    return U


def naive_position_sums(weights, query_valid, key_valid):
    """float64 Python-loop reference of the position sums, rows in the order of F.POSITION_STATS."""
    b_, h_, lq, lk = weights.shape
    P = torch.zeros(6, h_, dtype=torch.float64)
    for n in range(b_):
        for i in range(lq):
            if not _row_kept(weights, query_valid, n, i):
                continue
            visible = _visible_keys(weights, key_valid, n, i)
            for h in range(h_):
                # weights restricted to valid keys; 0 outside the key range
                w = {j: float(weights[n, h, i, j]) if key_valid[n, j] else 0.0 for j in range(lk)}
                total = sum(w.values())  # entropy of the row renormalised over the valid keys
                P[0, h] += -sum(x / total * math.log(x / total) for x in w.values() if x > 0)
                P[1, h] += math.log(len(visible)) if visible else 0.0
                P[2, h] += w.get(i, 0.0)
                P[3, h] += w.get(i - 1, 0.0)
                P[4, h] += w.get(i + 1, 0.0)
                P[5, h] += sum(x * abs(i - j) for j, x in w.items())
    return P


def run_full(weights, query_ids, key_ids, qv, kv, vq, vk):
    h = weights.shape[1]
    S = torch.zeros(h, vq, vk)
    C = torch.zeros(vq, vk, dtype=torch.long)
    Q = torch.zeros(vq, dtype=torch.long)
    U = torch.zeros(vq, vk, dtype=torch.float64)
    P = torch.zeros(len(F.POSITION_STATS), h, dtype=torch.float64)
    skipped = accumulate_attention_reference(
        S, C, Q, weights, query_ids, key_ids, qv, kv, uniform_sum=U, position_sums=P
    )
    return S, C, Q, U, P, int(skipped)


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


def masked_case(b, h, lengths, vocab, causal=True, uniform=False, pad_id=-100, seed=0):
    """Self-attention batch whose weights are exactly 0 on padded (and causally masked) keys.

    ``lengths[n]`` real tokens per sequence, then padding. ``uniform``: weights uniform over the unmasked keys.
    """
    g = torch.Generator().manual_seed(seed)
    length = max(lengths)
    ids = torch.randint(0, vocab, (b, length), generator=g)
    valid = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    ids = torch.where(valid, ids, pad_id)
    allowed = valid[:, None, None, :].expand(b, h, length, length).clone()
    if causal:
        allowed &= torch.ones(length, length, dtype=torch.bool).tril()
    scores = torch.zeros(b, h, length, length) if uniform else torch.randn(b, h, length, length, generator=g)
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return weights, ids, ids, valid, valid


def test_accumulate_attention_uniform_sum_matches_naive_loop_with_padding_and_causal_mask():
    for causal in (False, True):
        case = random_case(3, 4, 7, 7, 5, 5, causal=causal, seed=4)
        S, C, Q, U, _, skipped = run_full(*case, 5, 5)
        torch.testing.assert_close(U, naive_uniform(*case, 5, 5), rtol=1e-6, atol=1e-7)
        # the new accumulators leave S, C, Q and the skipped count as before
        rS, rC, rQ, rskipped = naive_accumulate(*case, 5, 5)
        torch.testing.assert_close(S.double(), rS, rtol=1e-5, atol=1e-6)
        assert torch.equal(C.double(), rC) and torch.equal(Q.double(), rQ) and skipped == rskipped == 0
        # every valid row has a visible key (key 0 is valid everywhere), so it spreads exactly 1 over its keys
        seen = Q > 0
        torch.testing.assert_close(U.sum(dim=1)[seen], Q[seen].double(), rtol=1e-6, atol=1e-7)
        assert (U[~seen] == 0).all()


def test_accumulate_attention_uniform_sum_excludes_causally_masked_keys():
    case = random_case(2, 3, 5, 5, 4, 4, causal=True, seed=5)
    _, qi, ki, qv, kv = case
    _, _, _, U, _, _ = run_full(*case, 4, 4)
    # by hand: row i sees the valid keys among 0..i, never the future ones
    expected = torch.zeros(4, 4, dtype=torch.float64)
    for n in range(2):
        for i in range(5):
            if not qv[n, i]:
                continue
            keys = [j for j in range(i + 1) if kv[n, j]]
            for j in keys:
                expected[int(qi[n, i]), int(ki[n, j])] += 1 / len(keys)
    torch.testing.assert_close(U, expected, rtol=1e-6, atol=1e-7)


def test_accumulate_attention_uniform_sum_matches_naive_loop_cross_attention_with_nan_rows():
    weights, qi, ki, qv, kv = random_case(2, 3, 6, 9, 4, 11, causal=True, seed=6)
    weights[1, :, 2] = float("nan")
    weights[0, 2, 3, 0] = float("nan")  # one head: the whole row goes
    _, _, Q, U, _, skipped = run_full(weights, qi, ki, qv, kv, 4, 11)
    assert skipped == 2 and torch.isfinite(U).all()
    torch.testing.assert_close(U, naive_uniform(weights, qi, ki, qv, kv, 4, 11), rtol=1e-6, atol=1e-7)
    seen = Q > 0
    torch.testing.assert_close(U.sum(dim=1)[seen], Q[seen].double(), rtol=1e-6, atol=1e-7)


def test_accumulate_attention_visible_keys_are_valid_and_non_zero_in_some_head_hand_computed():
    # one query row, 4 keys; key 2 gets 0 in both heads, key 1 only in head 0, key 3 is padding (non-zero weight)
    weights = torch.tensor([[[[0.4, 0.4, 0.0, 0.2]], [[0.8, 0.0, 0.0, 0.2]]]])  # (B=1, H=2, Lq=1, Lk=4)
    query_ids, key_ids = torch.tensor([[1]]), torch.tensor([[0, 1, 2, -100]])
    _, _, _, U, P, _ = run_full(weights, query_ids, key_ids, torch.tensor([[True]]), key_ids != -100, 3, 3)
    torch.testing.assert_close(
        U, torch.tensor([[0.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    )
    # over the valid keys, renormalised: head 0 is [0.5, 0.5, 0], head 1 is [1, 0, 0]
    entropy = [math.log(2), 0.0]
    expected = torch.tensor(
        [
            entropy,
            [math.log(2), math.log(2)],  # 2 visible keys, whatever the head
            [0.4, 0.8],  # self: key 0
            [0.0, 0.0],  # no previous position
            [0.4, 0.0],  # next: key 1
            [0.4 * 1 + 0.0 * 2, 0.0],  # distance; key 3 is padding
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(P, expected, rtol=1e-6, atol=1e-7)


def test_accumulate_attention_new_accumulators_add_up_over_calls():
    case = random_case(2, 2, 5, 5, 4, 4, causal=True, seed=7)
    _, _, _, U1, P1, _ = run_full(*case, 4, 4)
    S = torch.zeros(2, 4, 4)
    C = torch.zeros(4, 4, dtype=torch.long)
    Q = torch.zeros(4, dtype=torch.long)
    U = torch.zeros(4, 4, dtype=torch.float64)
    P = torch.zeros(len(F.POSITION_STATS), 2, dtype=torch.float64)
    for _ in range(2):
        accumulate_attention_reference(S, C, Q, *case, uniform_sum=U, position_sums=P)
    torch.testing.assert_close(U, 2 * U1)
    torch.testing.assert_close(P, 2 * P1)


def test_accumulate_attention_position_sums_match_naive_loop_self_attention():
    assert F.POSITION_STATS == ("entropy", "max_entropy", "self", "previous", "next", "distance")
    for causal in (False, True):
        weights, qi, ki, qv, kv = random_case(3, 4, 7, 7, 5, 5, causal=causal, seed=8)
        *_, P, _ = run_full(weights, qi, ki, qv, kv, 5, 5)
        assert P.shape == (6, 4)
        torch.testing.assert_close(P, naive_position_sums(weights, qv, kv), rtol=1e-5, atol=1e-5)


def test_accumulate_attention_position_sums_match_naive_loop_cross_attention_with_nan_row():
    for lq, lk in ((5, 8), (8, 5)):
        weights, qi, ki, qv, kv = random_case(2, 3, lq, lk, 4, 6, seed=9)
        weights[1, :, 2] = float("nan")
        weights[0, 1, 0, 3] = float("nan")
        *_, P, skipped = run_full(weights, qi, ki, qv, kv, 4, 6)
        assert skipped == 2 and torch.isfinite(P).all()
        torch.testing.assert_close(P, naive_position_sums(weights, qv, kv), rtol=1e-5, atol=1e-5)


def test_accumulate_attention_position_sums_fully_masked_row_contributes_nothing():
    weights, qi, ki, qv, kv = random_case(1, 2, 4, 4, 3, 3, seed=10)
    _, _, _, U0, P0, _ = run_full(weights, qi, ki, qv, kv, 3, 3)
    qv_fewer = qv.clone()
    qv_fewer[0, 1] = False
    weights[0, :, 1] = float("nan")
    _, _, _, U1, P1, skipped = run_full(weights, qi, ki, qv, kv, 3, 3)
    _, _, _, U2, P2, _ = run_full(weights, qi, ki, qv_fewer, kv, 3, 3)  # the same row ignored as padding
    assert skipped == 1
    torch.testing.assert_close(P1, P2)
    torch.testing.assert_close(U1, U2)
    assert not torch.equal(P0, P1) and not torch.equal(U0, U1)


@pytest.mark.parametrize("path", ["reference", "fast"])
def test_accumulate_attention_drops_and_counts_all_zero_rows_like_padding(path):
    # A valid query row with no weight in any head (some attention code zeroes padded queries) is no occurrence of its
    # token's attention: counted in Q it would pull that token's row of P below 1.
    weights, qi, ki, qv, kv = random_case(2, 2, 5, 5, 3, 3, seed=11)
    weights[1, :, 2] = 0.0  # every head
    weights[0, 1, 3] = 0.0  # one head only: still attention, kept
    as_padding = qv.clone()
    as_padding[1, 2] = False

    def sums(query_valid):
        if path == "reference":
            return run_full(weights, qi, ki, query_valid, kv, 3, 3)
        pairs = F.pair_index(qi, ki, query_valid, kv, 3, 3)
        packed, C, Q = torch.zeros(3, 10, dtype=torch.float64), torch.zeros(10, dtype=torch.long), torch.zeros(4).long()
        P = torch.zeros(len(F.POSITION_STATS), 2, dtype=torch.float64)
        skipped = F.accumulate_attention(packed, C, Q, P, weights.double(), pairs, qi, query_valid, kv)
        return packed[:2, :9].view(2, 3, 3), C[:9].view(3, 3), Q[:3], packed[2, :9].view(3, 3), P, int(skipped)

    *dropped, skipped = sums(qv)
    *padded, none = sums(as_padding)
    assert skipped == 1 and none == 0
    for got, want in zip(dropped, padded, strict=True):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-6, atol=1e-6)


def test_lift_hand_computed_and_zero_where_uniform_is_zero():
    torch.testing.assert_close(
        F.lift(torch.tensor([[0.9, 0.1, 0.3]]), torch.tensor([[0.5, 0.5, 0.0]])), torch.tensor([[1.8, 0.2, 0.0]])
    )
    per_head = F.lift(torch.tensor([[[2.0, 1.0]], [[0.0, 4.0]]]), torch.tensor([[1.0, 2.0]]))
    torch.testing.assert_close(per_head, torch.tensor([[[2.0, 0.5]], [[0.0, 2.0]]]))


def test_lift_is_one_for_uniform_attention_over_visible_keys_with_causal_mask_and_padding():
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
def test_attention_drift_row_divergence_is_each_rows_js_and_nan_where_rows_do_not_count(heads):
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


def test_position_statistics_matches_loop_definitions():
    weights, qi, ki, qv, kv = random_case(3, 4, 7, 7, 5, 5, causal=True, seed=19)
    _, _, Q, _, P, _ = run_full(weights, qi, ki, qv, kv, 5, 5)
    ref = naive_position_sums(weights, qv, kv)
    rows = sum(1 for n in range(3) for i in range(7) if _row_kept(weights, qv, n, i))
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


def naive_pagerank(matrix, damping):
    """Leading left eigenvector of the Google matrix, in numpy float64."""
    import numpy as np

    p = np.asarray(matrix, dtype=np.float64)
    v = p.shape[0]
    out = p.sum(axis=1, keepdims=True)
    t = np.where(out > 0, p / np.where(out > 0, out, 1.0), 1.0 / v)
    google = damping * t + (1 - damping) / v
    values, vectors = np.linalg.eig(google.T)
    lead = vectors[:, np.argmin(np.abs(values - 1))].real
    return lead / lead.sum()


def test_pagerank_matches_numpy_eigenvector():
    g = torch.Generator().manual_seed(24)
    for v, damping in ((5, 0.85), (7, 0.5), (4, 0.0), (6, 0.95)):
        matrix = torch.rand(v, v, generator=g) * (torch.rand(v, v, generator=g) > 0.4)
        matrix[1] = 0  # a dangling token: jumps uniformly
        rank = F.pagerank(matrix, damping=damping)
        assert rank.dtype == torch.float64 and rank.shape == (v,)
        expected = torch.from_numpy(naive_pagerank(matrix.numpy(), damping))
        torch.testing.assert_close(rank, expected, rtol=0, atol=1e-8)
        assert math.isclose(float(rank.sum()), 1.0, rel_tol=1e-12)


def test_pagerank_of_sums_equals_pagerank_of_mass_and_does_not_depend_on_the_start():
    g = torch.Generator().manual_seed(7)
    sums = torch.rand(6, 6, generator=g, dtype=torch.float64) * (torch.rand(6, 6, generator=g) > 0.3)
    sums[2] = 0  # dangling
    counts = torch.tensor([3, 1, 0, 5, 2, 4])
    expected = torch.from_numpy(naive_pagerank(F.attention_mass(sums, counts).numpy(), 0.85))
    torch.testing.assert_close(F.pagerank(sums), expected, rtol=0, atol=1e-9)
    for start in (torch.rand(6, generator=g), torch.eye(6)[4], expected * 3):
        torch.testing.assert_close(F.pagerank(sums, start=start), expected, rtol=0, atol=1e-9)
    for bad in (torch.zeros(6), torch.ones(5), torch.full((6,), float("nan"))):
        with pytest.raises(ValueError, match="start"):
            F.pagerank(sums, start=bad)
    tiny = sums.clone()
    tiny[1] *= 1e-310  # a subnormal row sum, whose reciprocal overflows: normalised by division instead
    torch.testing.assert_close(F.pagerank(tiny), expected, rtol=0, atol=1e-9)


def test_pagerank_docstring_example_and_uniform_cases():
    rank = F.pagerank(torch.tensor([[0.0, 1.0], [0.0, 1.0]]), damping=0.5)
    # pi_0 = 0.25 + 0.5 * 0 ; pi_1 = 0.25 + 0.5 * (pi_0 + pi_1)
    torch.testing.assert_close(rank, torch.tensor([0.25, 0.75], dtype=torch.float64), rtol=0, atol=1e-9)
    torch.testing.assert_close(F.pagerank(torch.zeros(4, 4)), torch.full((4,), 0.25, dtype=torch.float64))
    torch.testing.assert_close(F.pagerank(torch.ones(3, 3)), torch.full((3,), 1 / 3, dtype=torch.float64))


def test_pagerank_rejects_bad_shape_and_damping():
    import pytest

    for bad in (torch.zeros(2, 3), torch.zeros(2, 2, 2), torch.zeros(3)):
        with pytest.raises(ValueError, match="shape"):
            F.pagerank(bad)
    for damping in (1.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="damping"):
            F.pagerank(torch.ones(2, 2), damping=damping)


def test_top_pairs_orders_by_score_and_filters_by_support():
    score = torch.tensor([[0.5, 3.0, 1.0], [2.0, 0.1, 3.0], [-1.0, 4.0, 2.0]], dtype=torch.float64)
    counts = torch.tensor([[5, 5, 1], [5, 5, 5], [5, 2, 5]])
    pairs = F.top_pairs(score, counts, k=10, min_support=3)
    # (2, 1) = 4.0 and (0, 2) = 1.0 are below support; ties at 3.0 and 2.0: smaller flat index first
    assert pairs == [(0, 1, 3.0), (1, 2, 3.0), (1, 0, 2.0), (2, 2, 2.0), (0, 0, 0.5), (1, 1, 0.1), (2, 0, -1.0)]
    assert F.top_pairs(score, counts, k=2, min_support=3) == [(0, 1, 3.0), (1, 2, 3.0)]
    assert F.top_pairs(score, counts, k=2, min_support=1)[0] == (2, 1, 4.0)
    assert F.top_pairs(score, counts, k=3, min_support=6) == []


def test_top_pairs_rectangular_matrix():
    score = torch.tensor([[0.2, 0.9, 0.4, 0.7], [0.8, 0.1, 0.3, 0.6]])
    counts = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]])
    assert F.top_pairs(score, counts, k=3) == [
        (1, 0, float(score[1, 0])),
        (0, 3, float(score[0, 3])),
        (1, 3, float(score[1, 3])),
    ]


def test_position_statistics_normalised_entropy_stays_at_most_one_when_ignored_keys_get_weight():
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


@pytest.mark.parametrize("exact", [True, False])
def test_row_plogp_one_pass_and_exact_paths_match_float64_loop(exact):
    g = torch.Generator().manual_seed(3)
    w = torch.rand(4, 6, generator=g)
    w[0] /= w[0].sum()  # mass 1: the one-pass formula
    w[1] *= 1e-3  # small mass: redone exactly on the one-pass path
    w[2] = torch.tensor([1e-40, 3e-41, 0.0, 0.0, 2e-42, 0.0])  # subnormal mass
    w[3] = 0.0  # nothing visible: 0
    got = weights_plogp(w, w.sum(dim=-1), exact=exact)
    expected = []
    for row in w.double().tolist():
        total = sum(row)
        expected.append(sum(x / total * math.log(x / total) for x in row if x > 0) if total > 0 else 0.0)
    torch.testing.assert_close(got.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-6)


def test_epoch_statistics_by_row_blocks_equal_the_whole_matrix_computation(monkeypatch):
    # Large vocabularies are processed a block of rows at a time on CPU; tiny blocks here take that path on a small
    # matrix, which must give the numbers of the one-block path (itself tested against float64 loops).
    g = torch.Generator().manual_seed(3)
    S = torch.rand(3, 11, 11, generator=g) ** 4
    S[:, 2] = 0  # an unseen query row
    Q = torch.randint(0, 9, (11,), generator=g)
    U = torch.rand(11, 11, generator=g) + 0.1
    P, P2 = F.attention_mass(S, Q), F.attention_mass(torch.rand(3, 11, 11, generator=g), Q)

    def statistics():
        return {
            "row_plogp": F.row_plogp(P),
            "asymmetry": F.asymmetry_index(P),
            "lift": F.mean_lift(S, U),
            "js": F.js_divergence(P, P2),
            "drift": torch.stack(F.attention_drift(P, P2, Q, Q.flip(0), 3)),
            "drift_plogp": torch.stack(F.attention_drift(P, P2, Q, Q, 1, F.row_plogp(P), F.row_plogp(P2))),
            "drift_rows_few": F.attention_drift(P, P2, Q, Q.flip(0), 3, row_divergence=True)[2].nan_to_num(-1.0),
            "drift_rows_all": F.attention_drift(P, P2, Q, Q, 1, row_divergence=True)[2].nan_to_num(-1.0),
        }

    whole = statistics()
    monkeypatch.setattr(blocks, "ROW_BLOCK_BYTES", 3 * 11 * 4 * 2)  # two rows (of all heads) per block
    assert len(row_blocks(P)) == 6
    assert len(square_tiles(P)) == 10  # tiles of 3 x 3 cells (and ragged edges) on or above the diagonal
    blocked = statistics()
    for name, value in whole.items():
        torch.testing.assert_close(blocked[name], value, rtol=1e-6, atol=1e-7, msg=name)
    assert float(F.attention_drift(P, P, Q, Q, 1)[0].abs().max()) == 0.0  # an epoch against itself: exactly 0


def test_mean_lift_refuses_a_plogp_that_is_not_one_value_per_row():
    sums, uniform = torch.rand(2, 3, 3), torch.rand(3, 3)
    torch.testing.assert_close(F.mean_lift(sums, uniform, F.row_plogp(sums)), F.mean_lift(sums, uniform))
    with pytest.raises(ValueError, match=r"`plogp` to have shape \(2, 3\).*\(3,\)"):
        F.mean_lift(sums, uniform, F.row_plogp(sums.mean(dim=0)))


@pytest.mark.parametrize("seed", range(4))
def test_top_pairs_and_one_way_pairs_equal_a_python_sort_of_every_pair_with_many_ties(seed):
    g = torch.Generator().manual_seed(seed)
    size = 40
    # Values on a coarse grid: many exact ties in the score, and in the gap that breaks them.
    p = torch.randint(0, 6, (size, size), generator=g).double() / 5
    counts = torch.randint(0, 4, (size, size), generator=g)
    score = torch.randint(-3, 4, (size, size), generator=g).double()
    score[0, :5] = float("nan")
    for k in (0, 1, 3, 10, 50, size * size):
        expected = sorted(
            ((-float(score[a, b]), a * size + b) for a in range(size) for b in range(size) if counts[a, b] >= 2),
            key=lambda item: item,
        )
        expected = [(i // size, i % size, -s) for s, i in expected if math.isfinite(s)][:k]
        assert F.top_pairs(score, counts, k, min_support=2) == expected, k
        one_way = []
        for a in range(size):
            for b in range(size):
                forward, backward = float(p[a, b]), float(p[b, a])
                if counts[a, b] >= 2 and counts[b, a] >= 2 and forward > backward:
                    gap = forward - backward
                    one_way.append((-(gap / (forward + backward)), -gap, a * size + b))
        expected = [(i // size, i % size, -s) for s, _, i in sorted(one_way)][:k]
        got = F.one_way_pairs(p, counts, k, min_support=2)
        assert [(a, b) for a, b, _ in got] == [(a, b) for a, b, _ in expected], k
        assert all(math.isclose(x[2], y[2], rel_tol=1e-12) for x, y in zip(got, expected, strict=True))


def test_one_way_pairs_keeps_a_nan_score_first_and_k_must_not_be_negative():
    inf = float("inf")
    p = torch.tensor([[0.0, inf, 0.5], [1.0, 0.0, 0.2], [0.1, 0.1, 0.0]])  # (0, 1): inf / inf = NaN
    counts = torch.ones(3, 3, dtype=torch.long)
    (a, b, score), *rest = F.one_way_pairs(p, counts, k=1)
    assert (a, b) == (0, 1) and math.isnan(score) and rest == []
    assert [(a, b) for a, b, _ in F.one_way_pairs(p, counts, k=5)] == [(0, 1), (0, 2), (1, 2)]
    with pytest.raises(ValueError, match="`k` to be a non-negative integer, but got -1"):
        F.one_way_pairs(p, counts, k=-1)
    with pytest.raises(ValueError, match="`k` to be a non-negative integer, but got -2"):
        F.top_pairs(p, counts, k=-2)
