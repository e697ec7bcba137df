import math

import torch

from attn_callbacks import functional as F


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
            if not torch.isfinite(weights[n, :, i]).all():
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
    skipped = F.accumulate_attention(S, C, Q, weights, query_ids, key_ids, qv, kv)
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
