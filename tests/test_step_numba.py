"""The numba kernel of the CPU fast path against the torch code it replaces (and the float64 loops), and the dispatch
between them."""

import math
import warnings

import pytest
import torch
from _reference import naive_accumulate, naive_position_sums, naive_uniform

pytest.importorskip("numba")

from attn_callbacks.base import numba_loader
from attn_callbacks.sums import step as kernels
from attn_callbacks.sums import step_numba
from attn_callbacks.sums.accumulator import AttentionAccumulator
from attn_callbacks.sums.epoch_sums import EpochSums
from attn_callbacks.sums.step import POSITION_STATS, accumulate_attention, pair_index
from attn_callbacks.sums.step_numba import accumulate_attention_numba
from attn_callbacks.sums.step_torch import accumulate_attention_torch

PAD = -100


def make_case(
    batch=4,
    heads=3,
    len_q=9,
    len_k=9,
    vocab_q=7,
    vocab_k=7,
    causal=False,
    distribution="uniform",
    special_rows=True,
    mask_ignored_keys=True,
    dtype=torch.float32,
    seed=0,
):
    """Softmax weights ``(B, H, Lq, Lk)`` with padded queries and keys (id -100 there) and, with ``special_rows``,
    rows the kernels must treat alike: all zero, NaN in one head, inf at an ignored key, and one whose only positive
    weight sits at an ignored key (kept, with no visible key)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, heads, len_q, len_k, generator=g, dtype=torch.float64)
    if causal:
        scores = scores.masked_fill(torch.ones(len_q, len_k, dtype=torch.bool).triu(1), -math.inf)

    def ids(length, vocab):
        if distribution == "zipf":
            probs = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
        else:
            probs = torch.ones(vocab, dtype=torch.float64)
        return torch.multinomial(probs, batch * length, replacement=True, generator=g).view(batch, length)

    def valid(length):
        lengths = torch.randint(max(length // 2, 1), length + 1, (batch,), generator=g)
        lengths[0] = length  # one sample without padding
        return torch.arange(length)[None, :] < lengths[:, None]

    query_valid, key_valid = valid(len_q), valid(len_k)
    key_valid[:, 0] = True  # every row keeps a valid key under a causal mask
    if mask_ignored_keys:
        scores = scores.masked_fill(~key_valid[:, None, None, :], -math.inf)
    weights = scores.softmax(dim=-1)
    if special_rows and batch > 1 and len_q > 3 and len_k > 1:
        n = batch - 1
        query_valid[n, :4] = True
        key_valid[n, -1] = False
        weights[n, :, 0] = 0.0  # no weight in any head: dropped
        weights[n, heads - 1, 1, 0] = math.nan  # one head: the whole row is dropped
        weights[n, 0, 2, -1] = math.inf  # at an ignored key: dropped all the same
        weights[n, :, 3] = 0.0
        weights[n, :, 3, -1] = 1.0  # positive only at an ignored key: kept, nothing visible
    query_ids = torch.where(query_valid, ids(len_q, vocab_q), PAD)
    key_ids = torch.where(key_valid, ids(len_k, vocab_k), PAD)
    return weights.to(dtype), query_ids, key_ids, query_valid, key_valid


def new_state(heads, vocab_q, vocab_k, mean_of_heads=False, dtype=torch.float32):
    plane = vocab_q * vocab_k
    return {
        "sums": torch.zeros((1 if mean_of_heads else heads) + 1, plane, dtype=dtype),
        "pair_count": torch.zeros(plane, dtype=torch.long),
        "query_count": torch.zeros(vocab_q, dtype=torch.long),
        "position_sums": torch.zeros(len(POSITION_STATS), heads, dtype=dtype),
        "skipped": 0,
    }


def add_numba(state, case):
    skipped = accumulate_attention_numba(
        state["sums"], state["pair_count"], state["query_count"], state["position_sums"], *case
    )
    assert skipped.dtype == torch.int64 and skipped.dim() == 0
    state["skipped"] += int(skipped)
    return state


def add_torch(state, case):
    weights, query_ids, key_ids, query_valid, key_valid = case
    vocab_q = state["query_count"].numel()
    vocab_k = state["pair_count"].numel() // vocab_q
    pairs = pair_index(query_ids, key_ids, query_valid, key_valid, vocab_q, vocab_k)
    skipped = accumulate_attention_torch(
        state["sums"],
        state["pair_count"],
        state["query_count"],
        state["position_sums"],
        weights,
        pairs,
        query_ids,
        query_valid,
        key_valid,
    )
    state["skipped"] += int(skipped)
    return state


def assert_same(got, want, rtol=1e-6, atol=1e-6):
    assert torch.equal(got["pair_count"], want["pair_count"]), "C is exact"
    assert torch.equal(got["query_count"], want["query_count"]), "Q is exact"
    assert got["skipped"] == want["skipped"]
    torch.testing.assert_close(got["sums"], want["sums"], rtol=rtol, atol=atol, msg="S and U")
    torch.testing.assert_close(got["position_sums"], want["position_sums"], rtol=rtol, atol=atol, msg="positions")


def both(case, vocab_q, vocab_k, mean_of_heads=False, dtype=torch.float32, calls=1):
    heads = case[0].shape[1]
    got, want = (
        new_state(heads, vocab_q, vocab_k, mean_of_heads, dtype),
        new_state(heads, vocab_q, vocab_k, mean_of_heads, dtype),
    )
    for _ in range(calls):
        add_numba(got, case)
        add_torch(want, case)
    return got, want


@pytest.mark.parametrize("mean_of_heads", [False, True])
@pytest.mark.parametrize("distribution", ["uniform", "zipf"])
@pytest.mark.parametrize("causal", [False, True])
def test_numba_kernel_matches_torch_with_padding_causal_masks_and_dropped_rows(causal, distribution, mean_of_heads):
    for mask_ignored_keys in (True, False):
        case = make_case(causal=causal, distribution=distribution, mask_ignored_keys=mask_ignored_keys, seed=1)
        got, want = both(case, 7, 7, mean_of_heads)
        assert got["skipped"] == 3  # the zero, NaN and inf rows; not the one weighted at an ignored key only
        assert torch.isfinite(got["sums"]).all() and torch.isfinite(got["position_sums"]).all()
        assert_same(got, want)


@pytest.mark.parametrize("accumulator", [torch.float32, torch.float64])
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.float64])
def test_numba_kernel_matches_torch_for_float32_and_float64_weights_and_sums(weights_dtype, accumulator):
    case = make_case(causal=True, dtype=weights_dtype, seed=2)
    got, want = both(case, 7, 7, dtype=accumulator)
    assert_same(
        got,
        want,
        rtol=1e-6 if accumulator == torch.float32 else 1e-12,
        atol=1e-6 if accumulator == torch.float32 else 1e-12,
    )


def test_numba_kernel_rounds_float64_weights_like_float32_sums():
    # 1e-50 is positive in float64 but 0 in float32 sums: as in the torch path, no weight for that row or key
    case = make_case(batch=2, special_rows=False, dtype=torch.float64, seed=3)
    weights = case[0]
    weights[0, :, 1] = 0.0
    weights[0, :, 1, 0] = 1e-50  # the row's only weight: dropped
    weights[0, :, 2, 1] = 1e-50  # a key no head weights as stored: not visible
    got, want = both((weights, *case[1:]), 7, 7)
    assert got["skipped"] == 1
    assert_same(got, want)


def test_numba_kernel_entropy_of_rows_with_tiny_valid_mass_matches_torch():
    # most of the mass at an ignored key; the valid keys' share near float64's subnormals (and float32's)
    case = make_case(batch=2, special_rows=False, mask_ignored_keys=False, dtype=torch.float64, seed=17)
    weights, _, _, query_valid, key_valid = case
    key_valid[0, -1] = False
    for i, share in enumerate((1e-300, 1e-310, 1e-40, 1e-44)):
        weights[0, :, i] *= share
        weights[0, :, i, -1] = 1.0
    assert query_valid[0, :4].all()
    for dtype in (torch.float64, torch.float32):
        got, want = both((weights.to(dtype), *case[1:]), 7, 7, dtype=dtype)
        assert_same(got, want, rtol=1e-6, atol=1e-6)


def test_numba_kernel_matches_torch_for_a_tracked_vocabulary_with_an_other_bucket():
    # ids beyond the 5 tracked ones fold into <other> = 5, which then dominates the counts
    weights, query_ids, key_ids, query_valid, key_valid = make_case(
        batch=6, len_q=16, len_k=16, vocab_q=40, vocab_k=40, distribution="zipf", seed=4
    )
    fold = lambda ids: torch.where(ids >= 5, 5, ids)  # noqa: E731  (ignored positions keep -100)
    case = (weights, fold(query_ids), fold(key_ids), query_valid, key_valid)
    got, want = both(case, 6, 6)
    assert got["query_count"][5] > got["query_count"][:5].max()
    assert_same(got, want)


@pytest.mark.parametrize("mean_of_heads", [False, True])
def test_numba_kernel_matches_torch_for_cross_attention(mean_of_heads):
    for len_q, len_k, vocab_q, vocab_k in ((5, 11, 4, 9), (12, 6, 13, 3)):
        case = make_case(len_q=len_q, len_k=len_k, vocab_q=vocab_q, vocab_k=vocab_k, causal=True, seed=5)
        got, want = both(case, vocab_q, vocab_k, mean_of_heads)
        assert_same(got, want)


def test_numba_kernel_adds_up_over_calls():
    case = make_case(causal=True, distribution="zipf", seed=6)
    once, _ = both(case, 7, 7)
    got, want = both(case, 7, 7, calls=3)
    assert_same(got, want)
    assert torch.equal(got["pair_count"], 3 * once["pair_count"]) and got["skipped"] == 3 * once["skipped"]
    torch.testing.assert_close(got["sums"], 3 * once["sums"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("batch", "heads", "len_q", "len_k"),
    [(1, 1, 1, 1), (1, 1, 1, 5), (1, 2, 4, 1), (1, 1, 6, 6), (3, 1, 1, 7), (2, 4, 1, 1)],
)
def test_numba_kernel_matches_torch_on_small_shapes(batch, heads, len_q, len_k):
    for mean_of_heads in (False, True):
        case = make_case(batch, heads, len_q, len_k, 3, 4, causal=len_q == len_k, special_rows=False, seed=7)
        got, want = both(case, 3, 4, mean_of_heads)
        assert_same(got, want)


def test_numba_kernel_matches_naive_float64_loops():
    case = make_case(batch=3, heads=2, len_q=6, len_k=8, vocab_q=4, vocab_k=5, causal=True, seed=8)
    weights, query_ids, key_ids, query_valid, key_valid = case
    got = add_numba(new_state(2, 4, 5, dtype=torch.float64), case)
    S, C, Q, skipped = naive_accumulate(*case, 4, 5)
    plane = got["sums"].view(3, 4, 5)
    torch.testing.assert_close(plane[:2], S, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(plane[2], naive_uniform(*case, 4, 5), rtol=1e-12, atol=1e-12)
    assert torch.equal(got["pair_count"].view(4, 5).double(), C)
    assert torch.equal(got["query_count"].double(), Q) and got["skipped"] == skipped == 3
    # the naive loops know no row kept with nothing visible: leave that one out for the position sums
    query_valid = query_valid.clone()
    query_valid[-1, 3] = False
    positions = add_numba(
        new_state(2, 4, 5, dtype=torch.float64), (weights, query_ids, key_ids, query_valid, key_valid)
    )
    torch.testing.assert_close(
        positions["position_sums"], naive_position_sums(weights, query_valid, key_valid), rtol=1e-10, atol=1e-12
    )


@pytest.mark.parametrize("mean_of_heads", [False, True])
def test_numba_kernel_adds_the_rows_of_one_query_id_in_a_sample_as_the_loops_do(mean_of_heads):
    # one query id: every sample's valid rows form one group, the dropped rows (zero, NaN, inf) among them
    case = make_case(batch=3, heads=2, len_q=7, len_k=8, vocab_q=1, vocab_k=3, causal=True, seed=13)
    got = add_numba(new_state(2, 1, 3, mean_of_heads, dtype=torch.float64), case)
    S, C, Q, skipped = naive_accumulate(*case, 1, 3)
    want = S.mean(dim=0, keepdim=True) if mean_of_heads else S
    torch.testing.assert_close(got["sums"][:-1].view_as(want), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got["sums"][-1].view(1, 3), naive_uniform(*case, 1, 3), rtol=1e-12, atol=1e-12)
    assert torch.equal(got["pair_count"].view(1, 3).double(), C)
    assert torch.equal(got["query_count"].double(), Q) and got["skipped"] == skipped == 3
    assert Q[0] > case[0].shape[0], "groups of several rows"


@pytest.mark.parametrize(("where", "bad"), [("query", 7), ("query", -1), ("key", 7), ("key", -100)])
def test_numba_kernel_rejects_out_of_range_ids_at_valid_positions(where, bad):
    weights, query_ids, key_ids, query_valid, key_valid = make_case(special_rows=False, seed=9)
    ids, valid = (query_ids, query_valid) if where == "query" else (key_ids, key_valid)
    ids[0, 0] = bad
    assert valid[0, 0]
    state = new_state(3, 7, 7)
    with pytest.raises(ValueError, match=f"Expected `{where}_ids` in \\[0, 7\\) at valid positions, but got {bad}"):
        add_numba(state, (weights, query_ids, key_ids, query_valid, key_valid))
    assert not state["sums"].any() and not state["pair_count"].any(), "nothing added"


def test_numba_kernel_accepts_other_dtypes_and_non_contiguous_inputs():
    weights, query_ids, key_ids, query_valid, key_valid = make_case(causal=True, special_rows=False, seed=10)
    strided = weights.transpose(2, 3).contiguous().transpose(2, 3)  # the same values, not contiguous
    assert not strided.is_contiguous()
    got = add_numba(new_state(3, 7, 7), (strided, query_ids.int(), key_ids.short(), query_valid, key_valid))
    want = add_torch(new_state(3, 7, 7), (weights, query_ids, key_ids, query_valid, key_valid))
    assert_same(got, want)
    # half precision weights: converted to float32 first, as the torch path casts them to the sums' dtype
    half = weights.bfloat16()
    got = add_numba(new_state(3, 7, 7), (half, query_ids, key_ids, query_valid, key_valid))
    want = add_torch(new_state(3, 7, 7), (half, query_ids, key_ids, query_valid, key_valid))
    assert_same(got, want)


def test_numba_kernel_result_does_not_depend_on_the_number_of_threads():
    import numba

    case = make_case(batch=8, len_q=16, len_k=16, vocab_q=11, vocab_k=11, distribution="zipf", seed=11)
    before = numba.get_num_threads(), torch.get_num_threads()
    results = []
    try:
        for threads in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
            numba.set_num_threads(threads)
            torch.set_num_threads(threads)
            results.append(add_numba(new_state(3, 11, 11), case))
    finally:
        numba.set_num_threads(before[0])
        torch.set_num_threads(before[1])
    one, two = results
    # each cell of S, U, C and Q is written by one thread, in the same order: exact; position sums add up per thread
    for name in ("sums", "pair_count", "query_count"):
        assert torch.equal(one[name], two[name]), name
    assert one["skipped"] == two["skipped"]
    torch.testing.assert_close(one["position_sums"], two["position_sums"], rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------------------------------
# dispatch


def dispatch(case, vocab_q=7, vocab_k=7, pairs=False):
    """:func:`accumulate_attention`, with the key ids (as the accumulator calls it) or a pair index only."""
    weights, query_ids, key_ids, query_valid, key_valid = case
    state = new_state(weights.shape[1], vocab_q, vocab_k)
    index = pair_index(query_ids, key_ids, query_valid, key_valid, vocab_q, vocab_k) if pairs else None
    skipped = accumulate_attention(
        state["sums"],
        state["pair_count"],
        state["query_count"],
        state["position_sums"],
        weights,
        index,
        query_ids,
        query_valid,
        key_valid,
        key_ids=None if pairs else key_ids,
    )
    state["skipped"] = int(skipped)
    return state


@pytest.fixture
def calls(monkeypatch):
    """Which of the two kernels :func:`accumulate_attention` ran."""
    ran = []
    torch_path, numba_path = kernels.accumulate_attention_torch, accumulate_attention_numba
    monkeypatch.setattr(
        kernels, "accumulate_attention_torch", lambda *a, **k: ran.append("torch") or torch_path(*a, **k)
    )
    monkeypatch.setattr(step_numba, "accumulate_attention_numba", lambda *a: ran.append("numba") or numba_path(*a))
    return ran


def test_accumulate_attention_runs_numba_on_cpu_from_key_ids_or_pairs(calls, monkeypatch):
    monkeypatch.delenv(numba_loader.NUMBA_SWITCH, raising=False)
    weights, query_ids, key_ids, query_valid, key_valid = make_case(causal=True, seed=12)
    query_valid[1] = False  # a sample without a valid query: its keys cannot be read back from the pair index
    query_ids[1] = PAD
    case = (weights, query_ids, key_ids, query_valid, key_valid)
    from_ids, from_pairs = dispatch(case), dispatch(case, pairs=True)
    assert calls == ["numba", "numba"] and numba_loader.uses_numba("cpu") and not numba_loader.uses_numba("meta")
    assert_same(from_ids, from_pairs, rtol=0, atol=0)
    assert_same(from_ids, add_torch(new_state(3, 7, 7), case))


def test_accumulate_attention_switch_selects_the_torch_code(calls, monkeypatch):
    monkeypatch.setenv(numba_loader.NUMBA_SWITCH, "0")
    case = make_case(causal=True, seed=13)
    assert not numba_loader.uses_numba(torch.device("cpu"))
    from_ids, from_pairs = dispatch(case), dispatch(case, pairs=True)  # the pair index is computed when missing
    assert calls == ["torch", "torch"]
    assert_same(from_ids, from_pairs, rtol=0, atol=0)


@pytest.mark.parametrize("switch", ["1", "0"])
def test_accumulate_attention_needs_pairs_or_key_ids(switch, monkeypatch):
    monkeypatch.setenv(numba_loader.NUMBA_SWITCH, switch)
    weights, query_ids, _, query_valid, key_valid = make_case(seed=16)
    state = new_state(3, 7, 7)
    with pytest.raises(ValueError, match="give `pairs` or `key_ids`"):
        accumulate_attention(
            state["sums"],
            state["pair_count"],
            state["query_count"],
            state["position_sums"],
            weights,
            None,
            query_ids,
            query_valid,
            key_valid,
        )


def test_accumulate_attention_warns_once_and_runs_torch_when_numba_cannot_import(monkeypatch):
    def broken():
        raise ImportError("No module named 'numba'")

    monkeypatch.delenv(numba_loader.NUMBA_SWITCH, raising=False)
    monkeypatch.setattr(numba_loader, "_NUMBA", {})
    monkeypatch.setattr(numba_loader, "_import_numba", broken)
    case = make_case(causal=True, seed=14)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [dispatch(case), dispatch(case, pairs=True)]
        assert not numba_loader.uses_numba("cpu")
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert "No module named 'numba'" in messages[0] and "ATTN_CALLBACKS_NUMBA=0" in messages[0]
    want = add_torch(new_state(3, 7, 7), case)
    for got in results:
        assert_same(got, want, rtol=0, atol=0)


def test_accumulator_and_epoch_sums_compute_the_pair_index_only_for_the_torch_path(monkeypatch):
    weights, query_ids, key_ids, query_valid, key_valid = make_case(causal=True, seed=15)
    built = []
    for where in (
        "attn_callbacks.sums.epoch_sums.pair_index",
        "attn_callbacks.sums.step.pair_index",
    ):  # EpochSums, update
        monkeypatch.setattr(where, lambda *a: built.append(1) or pair_index(*a))
    results = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(numba_loader.NUMBA_SWITCH, switch)
        built.clear()
        metric = AttentionAccumulator(3, 7, 7)
        metric.update(weights, query_ids, key_ids, query_valid, key_valid)
        sums = EpochSums()
        modules = ("first", "second")  # two modules reading the same streams: one pair index per batch (torch path)
        sums.start(dict.fromkeys(modules, (3, 7, 7)), dict.fromkeys(modules, torch.device("cpu")), loaders=1)
        sums.start_batch()
        for name in modules:
            sums.add(name, 0, ("q", "k"), weights, (query_ids, query_valid), (key_ids, key_valid))
        assert len(built) == (0 if switch == "1" else 2)
        results[switch] = (metric.compute(), *(sums.metrics[(name, 0)].compute() for name in modules))
    for numba_stats, torch_stats in zip(results["1"], results["0"], strict=True):
        for field in ("pair_count", "query_count", "skipped_rows"):
            assert torch.equal(getattr(numba_stats, field), getattr(torch_stats, field)), field
        for field in ("attention_sum", "uniform_sum", "position_sums"):
            torch.testing.assert_close(getattr(numba_stats, field), getattr(torch_stats, field), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mean_of_heads", [False, True])
def test_numba_kernel_keeps_frequent_cells_exact_over_many_batches(mean_of_heads):
    """A float32 cell that has summed many batches is large: added position by position or row by row, most of each
    small addition rounds away. Id 0 fills 90 % of the positions (a frequent query and key id, as `<other>` is);
    id 2 holds one position per batch (a rare query id facing the frequent key). After 300 batches, S, U and the
    pair counts equal float64 sums (1e-6; added position by position, 2e-5 off here, 3 % over 1,500 larger batches)."""
    from attn_callbacks.sums.step_numba import accumulate_attention_numba

    g = torch.Generator().manual_seed(0)
    batch, length, vocab = 16, 64, 3
    pool = [torch.randn(batch, 2, length, length, generator=g).softmax(-1) for _ in range(4)]
    valid = torch.ones(batch, length, dtype=torch.bool)
    channels = 1 if mean_of_heads else 2
    sums, pairs = torch.zeros(channels + 1, vocab * vocab), torch.zeros(vocab * vocab, dtype=torch.long)
    counts, position = torch.zeros(vocab, dtype=torch.long), torch.zeros(6, 2)
    S = torch.zeros(channels, vocab, vocab, dtype=torch.float64)
    U = torch.zeros(vocab, vocab, dtype=torch.float64)
    for k in range(300):
        weights = pool[k % 4]
        ids = (torch.rand(batch, length, generator=g) > 0.9).long()  # 0 at 90 % of the positions, else 1
        ids[k % batch, k % length] = 2
        accumulate_attention_numba(sums, pairs, counts, position, weights, ids, ids, valid, valid)
        hot = torch.nn.functional.one_hot(ids, vocab).double()  # (B, L, V)
        w = weights.double().mean(dim=1, keepdim=True) if mean_of_heads else weights.double()
        S += torch.einsum("bia,bhij,bjc->hac", hot, w, hot)
        U += torch.einsum("bia,bjc->ac", hot, hot) / length  # every key visible
    torch.testing.assert_close(sums[:channels].view(channels, vocab, vocab).double(), S, rtol=1e-6, atol=0)
    torch.testing.assert_close(sums[channels].view(vocab, vocab).double(), U, rtol=1e-6, atol=0)
    assert pairs.sum() == 300 * batch * length * length


def test_ids_are_dealt_to_threads_by_their_rows_most_first():
    import numpy as np

    from attn_callbacks.sums.step_numba import _deal_ids

    # rows per id: 0 -> 5, 1 -> 1, 2 -> 4, 3 -> 0 (only in a padded sample), 4 -> 2
    ids = np.array([[0, 0, 0, 2, 2, 1], [0, 0, 2, 2, 4, 4], [3, 0, 0, 0, 0, 0]])
    valid = np.ones_like(ids, dtype=bool)
    valid[2] = False  # a padded sample: its ids count for nothing
    owner, rows = _deal_ids(ids, valid, 6, 2)
    assert rows.tolist() == [5, 1, 4, 0, 2, 0]
    # 0 (5 rows) -> thread 0; 2 (4) -> thread 1; 4 (2) -> thread 1 (4 < 5); 1 (1) -> thread 0 (5 < 6)
    assert owner[[0, 2, 4, 1]].tolist() == [0, 1, 1, 0]
    loads = [sum(int(((ids == a) & valid).sum()) for a in range(6) if owner[a] == t) for t in range(2)]
    assert loads == [6, 6]
    assert _deal_ids(ids, valid, 6, 1)[0].tolist() == [0] * 6
