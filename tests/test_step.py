import math

import pytest
import torch
from _reference import (
    accumulate_attention_reference,
    naive_accumulate,
    naive_position_sums,
    naive_uniform,
    random_case,
    run,
    run_full,
)

from attn_callbacks import functional as F
from attn_callbacks.sums import step as kernels
from attn_callbacks.sums import step_torch
from attn_callbacks.sums.step_torch import accumulate_attention_torch, weights_plogp

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_accumulate_attention_matches_naive_loop_self_attention_padding_causal_mask():
    for causal in (False, True):
        case = random_case(3, 4, 7, 7, 5, 5, causal=causal)
        S, C, Q, skipped = run(*case, 5, 5)
        rS, rC, rQ, rskipped = naive_accumulate(*case, 5, 5)
        torch.testing.assert_close(S.double(), rS, rtol=1e-5, atol=1e-6)
        assert torch.equal(C.double(), rC) and torch.equal(Q.double(), rQ) and skipped == rskipped == 0


def test_accumulate_attention_matches_naive_loop_cross_attn_other_lengths_and_vocabs():
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


def test_accumulate_attention_uniform_sum_matches_naive_loop_padding_causal_mask():
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


def test_accumulate_attention_uniform_sum_matches_naive_loop_cross_attn_nan_rows():
    weights, qi, ki, qv, kv = random_case(2, 3, 6, 9, 4, 11, causal=True, seed=6)
    weights[1, :, 2] = float("nan")
    weights[0, 2, 3, 0] = float("nan")  # one head: the whole row goes
    _, _, Q, U, _, skipped = run_full(weights, qi, ki, qv, kv, 4, 11)
    assert skipped == 2 and torch.isfinite(U).all()
    torch.testing.assert_close(U, naive_uniform(weights, qi, ki, qv, kv, 4, 11), rtol=1e-6, atol=1e-7)
    seen = Q > 0
    torch.testing.assert_close(U.sum(dim=1)[seen], Q[seen].double(), rtol=1e-6, atol=1e-7)


def test_accumulate_attention_visible_keys_are_valid_and_non_zero_in_some_head():
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


def test_accumulate_attention_position_sums_match_naive_loop_cross_attention_nan_row():
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


@pytest.mark.parametrize("path", ["reference", "fast", "torch"])  # fast: the numba kernel on CPU, where numba runs
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
        packed, C, Q = torch.zeros(3, 9, dtype=torch.float64), torch.zeros(9, dtype=torch.long), torch.zeros(3).long()
        P = torch.zeros(len(F.POSITION_STATS), 2, dtype=torch.float64)
        fast = accumulate_attention_torch if path == "torch" else F.accumulate_attention
        skipped = fast(packed, C, Q, P, weights.double(), pairs, qi, query_valid, kv)
        return packed[:2].view(2, 3, 3), C.view(3, 3), Q, packed[2].view(3, 3), P, int(skipped)

    *dropped, skipped = sums(qv)
    *padded, none = sums(as_padding)
    assert skipped == 1 and none == 0
    for got, want in zip(dropped, padded, strict=True):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("path", ["numba", "torch", "compiled"])
def test_accumulate_attention_counts_keys_the_mask_allows_as_visible_where_every_head_rounds_to_0(path):
    """A sharp softmax rounds the weights of keys far below the top to exactly 0 in every head: without the call's
    mask they look masked (U and the maximum entropy would count only the keys with weight); with `allowed` they count.
    Causal mask and padding, against the float64 loop; float32 weights as a model stores them."""
    from attn_callbacks.base.numba_loader import uses_numba

    if path == "numba" and not uses_numba(torch.device("cpu")):
        pytest.skip("numba is not installed or switched off")
    weights, qi, ki, qv, kv = random_case(3, 2, 6, 6, 4, 4, causal=True, seed=13)
    weights = (weights.log() * 200).softmax(-1)  # logits 200 times apart: most allowed keys underflow in both heads
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()[None]  # (1, Lq, Lk): every sample's causal mask
    underflowed = allowed & (weights.amax(dim=1) == 0)
    assert underflowed.sum() > 10  # the case this test is about
    pairs = F.pair_index(qi, ki, qv, kv, 4, 4)
    packed, C, Q = torch.zeros(3, 16), torch.zeros(16, dtype=torch.long), torch.zeros(4).long()
    P = torch.zeros(len(F.POSITION_STATS), 2)
    if path == "numba":
        F.accumulate_attention(packed, C, Q, P, weights, None, qi, qv, kv, key_ids=ki, allowed=allowed)
    else:
        accumulate_attention_torch(
            packed, C, Q, P, weights, pairs, qi, qv, kv, allowed=allowed, compiled=path == "compiled"
        )
    U = naive_uniform(weights, qi, ki, qv, kv, 4, 4, allowed.expand(3, 6, 6))
    torch.testing.assert_close(packed[2].view(4, 4).double(), U, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        P.double(), naive_position_sums(weights, qv, kv, allowed.expand(3, 6, 6)), rtol=1e-5, atol=1e-5
    )
    assert not torch.allclose(U, naive_uniform(weights, qi, ki, qv, kv, 4, 4))  # what the weights alone would say


@pytest.mark.parametrize("path", ["numba", "torch", "compiled"])
def test_accumulate_attention_drops_and_counts_rows_whose_mask_allows_no_key(path):
    """A Hugging Face eager model adds the dtype's minimum where it masks: a left-padded query row, masked whole, comes
    out uniform over every key, not NaN as from SDPA. With `allowed` saying so, the row is dropped and counted like a
    NaN row; the other rows are summed as the float64 loop sums them."""
    from attn_callbacks.base.numba_loader import uses_numba

    if path == "numba" and not uses_numba(torch.device("cpu")):
        pytest.skip("numba is not installed or switched off")
    weights, qi, ki, qv, kv = random_case(3, 2, 5, 5, 4, 4, causal=True, seed=21)
    allowed = torch.ones(3, 5, 5, dtype=torch.bool).tril()
    allowed[1, :, :2] = False  # sample 1 left-padded by two: its keys 0 and 1 masked...
    allowed[1, :2] = False  # ...and its query rows 0 and 1 masked whole
    weights[1, :, :2] = 0.2  # uniform over all 5 keys, as finfo.min everywhere gives
    pairs = F.pair_index(qi, ki, qv, kv, 4, 4)
    packed, C, Q = torch.zeros(3, 16), torch.zeros(16, dtype=torch.long), torch.zeros(4).long()
    P = torch.zeros(len(F.POSITION_STATS), 2)
    if path == "numba":
        skipped = F.accumulate_attention(packed, C, Q, P, weights, None, qi, qv, kv, key_ids=ki, allowed=allowed)
    else:
        skipped = accumulate_attention_torch(
            packed, C, Q, P, weights, pairs, qi, qv, kv, allowed=allowed, compiled=path == "compiled"
        )
    S, C_ref, Q_ref, skipped_ref = naive_accumulate(weights, qi, ki, qv, kv, 4, 4, allowed)
    assert int(skipped) == skipped_ref == int(qv[1, :2].sum()) > 0
    assert torch.equal(Q.double(), Q_ref) and torch.equal(C.view(4, 4).double(), C_ref)
    torch.testing.assert_close(packed[:2].view(2, 4, 4).double(), S, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        packed[2].view(4, 4).double(), naive_uniform(weights, qi, ki, qv, kv, 4, 4, allowed), rtol=1e-6, atol=1e-6
    )
    torch.testing.assert_close(P.double(), naive_position_sums(weights, qv, kv, allowed), rtol=1e-5, atol=1e-5)


def test_accumulate_attention_refuses_an_allowed_mask_of_another_shape_or_dtype():
    weights, qi, ki, qv, kv = random_case(2, 2, 3, 4, 3, 3, seed=1)
    state = (torch.zeros(3, 9), torch.zeros(9, dtype=torch.long), torch.zeros(3).long(), torch.zeros(6, 2))
    for bad in (torch.ones(2, 4, 3, dtype=torch.bool), torch.ones(1, 3, 4)):
        with pytest.raises(
            ValueError, match=r"`allowed` to be a bool tensor broadcastable to \(B, Lq, Lk\) = \(2, 3, 4\)"
        ):
            F.accumulate_attention(*state, weights, None, qi, qv, kv, key_ids=ki, allowed=bad)


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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_row_plogp_paths_agree_and_stay_finite_for_a_negative_weight(device):
    # Not attention (softmax weights are >= 0), but a custom module's weights: both paths (GPU and CPU) must give the
    # same finite value, never a positive Σ p log p (a negative entropy). 0 here: the negative weight meets the clamp.
    w = torch.tensor([[0.5, 0.6, -0.1, 0.0], [0.05, 0.06, -0.01, 0.0]])  # mass 1 (one pass) and 0.1 (exact, redone)
    exact = weights_plogp(w.to(device), w.sum(dim=-1).to(device), exact=True).cpu()  # on CUDA: x log x by xlogy
    one_pass = weights_plogp(w, w.sum(dim=-1), exact=False)
    torch.testing.assert_close(exact, one_pass)
    assert torch.isfinite(exact).all() and (exact <= 0).all()


def test_pair_index_points_ignored_pairs_at_their_position_where_they_add_nothing():
    """Ignored pairs spread over the cells by their position in the sample (one cell would serialise a GPU's atomic
    adds), and the sums of the torch path equal those without them at all (a batch of the valid sample alone)."""
    weights, qi, ki, qv, kv = random_case(3, 2, 6, 5, 4, 3, seed=5)
    qv[0, 1], kv[0, 4], kv[2, :2] = False, False, False
    qi[0, 1], ki[0, 4] = -100, 99  # any id at an ignored position
    pairs = F.pair_index(qi, ki, qv, kv, 4, 3)
    ignored = ~(qv[:, :, None] & kv[:, None, :])
    position = (torch.arange(6 * 5) % 12).view(6, 5).expand(3, -1, -1)
    assert torch.equal(pairs[ignored], position[ignored])
    assert torch.equal(pairs[~ignored], (qi[:, :, None] * 3 + ki[:, None, :])[~ignored])

    def torch_sums(w, q, k, q_valid, k_valid):
        packed, C, Q = torch.zeros(3, 12, dtype=torch.float64), torch.zeros(12, dtype=torch.long), torch.zeros(4).long()
        P = torch.zeros(len(F.POSITION_STATS), 2, dtype=torch.float64)
        index = F.pair_index(q, k, q_valid, k_valid, 4, 3)
        accumulate_attention_torch(packed, C, Q, P, w.double(), index, q, q_valid, k_valid)
        return packed, C, Q

    got = torch_sums(weights, qi, ki, qv, kv)
    want = run_full(weights, qi.clamp(0, 3), ki.clamp(0, 2), qv, kv, 4, 3)
    torch.testing.assert_close(got[0][:2].view(2, 4, 3), want[0].double(), rtol=1e-6, atol=1e-7)  # float32 there
    assert torch.equal(got[1].view(4, 3), want[1]) and torch.equal(got[2], want[2])
    torch.testing.assert_close(got[0][2].view(4, 3), want[3], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunk_bytes", [None, 700])  # 700: one sample per chunk on CPU
@pytest.mark.parametrize("mean_of_heads", [False, True])
def test_a_hot_cell_summed_apart_gives_the_naive_sums(mean_of_heads, chunk_bytes, monkeypatch):
    """Off the CPU the torch step sums the pairs of one cell, (<other>, <other>) of tracked streams, apart from the
    scatter; its sums, counts and position sums stay those of the float64 loops, with padding, an ignored id that
    points at the hot cell and a dropped (NaN) row among that cell's pairs, in one chunk or sample by sample."""
    if chunk_bytes is not None:
        monkeypatch.setattr(step_torch, "_CPU_CHUNK_BYTES", chunk_bytes)
    weights, qi, ki, qv, kv = random_case(3, 2, 7, 6, 4, 3, causal=True, seed=8)
    qi[:, ::2], ki[:, 1::2] = 3, 2  # (3, 2), the last cell, takes about a quarter of the pairs
    weights[1, :, 4] = float("nan")  # a dropped row holding id 3
    qv[2, 6], qi[2, 6] = False, 3  # an ignored query holding the hot id
    hot = 3 * 3 + 2
    pairs = F.pair_index(qi, ki, qv, kv, 4, 3)
    assert (pairs == hot).sum() > 20

    def step(hot_cell):
        channels = 1 if mean_of_heads else 2
        packed, C, Q = torch.zeros(channels + 1, 12), torch.zeros(12, dtype=torch.long), torch.zeros(4).long()
        P = torch.zeros(len(F.POSITION_STATS), 2, dtype=torch.float64)
        skipped = accumulate_attention_torch(packed, C, Q, P, weights, pairs, qi, qv, kv, hot_cell=hot_cell)
        return packed, C, Q, P, int(skipped)

    packed, C, Q, P, skipped = step(hot)
    S, rC, rQ, U, rP, rskipped = run_full(weights, qi, ki, qv, kv, 4, 3)
    rS = S.double().mean(dim=0, keepdim=True) if mean_of_heads else S.double()
    torch.testing.assert_close(packed[:-1].double().view_as(rS), rS, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(packed[-1].double().view(4, 3), U, rtol=1e-6, atol=1e-6)
    assert torch.equal(C.view(4, 3), rC) and torch.equal(Q, rQ) and skipped == rskipped == 1
    torch.testing.assert_close(P, rP, rtol=1e-5, atol=1e-6)
    assert rC[3, 2] > 10 and rS[:, 3, 2].min() > 0  # the cell did get pairs
    # and the same as scattering it with the rest
    for got, want in zip(step(hot)[:4], step(None)[:4], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_hot_cell_in_an_empty_batch_adds_nothing():
    packed, C, Q = torch.zeros(3, 12), torch.zeros(12, dtype=torch.long), torch.zeros(4).long()
    P = torch.zeros(len(F.POSITION_STATS), 2, dtype=torch.float64)
    weights, ids, valid = torch.zeros(0, 2, 5, 5), torch.zeros(0, 5, dtype=torch.long), torch.zeros(0, 5).bool()
    pairs = F.pair_index(ids, ids, valid, valid, 4, 3)
    skipped = accumulate_attention_torch(packed, C, Q, P, weights, pairs, ids, valid, valid, hot_cell=11)
    assert int(skipped) == 0 and not packed.any() and not C.any() and not Q.any() and not P.any()


def test_pair_index_points_pairs_of_ids_outside_the_vocabulary_past_the_last_cell():
    # Vq = 4, Vk = 3: the key id 3 would be cell a * 3 + 3 = (a + 1, 0), another pair's cell, counted silently.
    ids, valid = torch.tensor([[1, 3]]), torch.tensor([[True, True]])
    index = kernels.pair_index(ids, ids, valid, valid, 4, 3)
    assert index.tolist() == [[[4, 12], [10, 12]]]  # (1, 1) = 4, (3, 1) = 10; a pair with key 3 at 12 = 4 * 3
    ignored = kernels.pair_index(ids, ids, valid, torch.tensor([[True, False]]), 4, 3)
    assert ignored.tolist() == [[[4, 1], [10, 3]]]  # an ignored key position keeps its spread cell (i * 2 + j)
    packed, C, Q = torch.zeros(2, 12, dtype=torch.float64), torch.zeros(12, dtype=torch.long), torch.zeros(4).long()
    P = torch.zeros(len(F.POSITION_STATS), 1, dtype=torch.float64)
    with pytest.raises((IndexError, RuntimeError)):  # the scatter refuses the pair, rather than count it elsewhere
        accumulate_attention_torch(packed, C, Q, P, torch.full((1, 1, 2, 2), 0.5).double(), index, ids, valid, valid)


def test_torch_step_keeps_each_weight_of_a_cell_many_batches_made_large():
    """One id: every weight lands in one cell, whose float32 sum reaches 2^15. Added pair by pair to the running sum,
    a weight ~1/512 rounds away (half an ulp and less); each batch summed apart, then added, keeps them all."""
    g = torch.Generator().manual_seed(0)
    batch, length, batches = 2, 512, 32
    sums, pair_count = torch.zeros(2, 1), torch.zeros(1, dtype=torch.long)
    query_count, position_sums = torch.zeros(1, dtype=torch.long), torch.zeros(6, 1)
    ids, valid = torch.zeros(batch, length, dtype=torch.long), torch.ones(batch, length, dtype=torch.bool)
    pairs = torch.zeros(batch, length, length, dtype=torch.long)
    expected = 0.0
    for _ in range(batches):
        weights = torch.randn(batch, 1, length, length, generator=g).softmax(-1)
        expected += float(weights.double().sum())
        accumulate_attention_torch(sums, pair_count, query_count, position_sums, weights, pairs, ids, valid, valid)
    assert int(query_count) == batch * length * batches == 2**15
    # Pair by pair into the running sums: S 31,836 (-2.8 %); each batch apart: within 3e-6.
    assert float(sums[0, 0]) == pytest.approx(expected, rel=1e-5)  # S: every row's weights, 1 each
    assert float(sums[1, 0]) == pytest.approx(2**15, rel=1e-5)  # U: 1 / 512 per visible key, 1 a row
