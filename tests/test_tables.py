import html
import math
import re

import pytest
import torch
from _reference import table_cells

from attn_callbacks import functional as F
from attn_callbacks.metrics.tables import markdown_table


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


def test_top_tokens_orders_by_count_and_drops_unseen():
    assert F.top_tokens(torch.tensor([0, 5, 2, 5, 0]), 10).tolist() == [1, 3, 2]


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


def test_pagerank_of_a_float32_matrix_is_the_same_with_and_without_numba(monkeypatch):
    g = torch.Generator().manual_seed(11)
    matrix = torch.rand(150, 150, generator=g) * (torch.rand(150, 150, generator=g) < 0.2)
    matrix[3] = 0  # dangling
    ranks = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("ATTN_CALLBACKS_NUMBA", switch)
        ranks[switch] = F.pagerank(matrix)
    torch.testing.assert_close(ranks["1"], ranks["0"], rtol=0, atol=1e-12)
    expected = torch.from_numpy(naive_pagerank(matrix.numpy(), 0.85))
    torch.testing.assert_close(ranks["1"], expected, rtol=0, atol=1e-8)


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


@pytest.mark.parametrize("numba", ["1", "0"])
@pytest.mark.parametrize("seed", range(4))
def test_top_pairs_and_one_way_pairs_equal_a_python_sort_of_all_pairs_many_ties(seed, numba, monkeypatch):
    monkeypatch.setenv("ATTN_CALLBACKS_NUMBA", numba)  # the torch code and, where numba runs, its kernels
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


@pytest.mark.parametrize("numba", ["1", "0"])
def test_one_way_pairs_keeps_a_nan_score_first_and_k_must_not_be_negative(numba, monkeypatch):
    monkeypatch.setenv("ATTN_CALLBACKS_NUMBA", numba)
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


def five_pair_tables(sums, counts, query_count, uniform, mass, *, square, min_support):
    """The tables of one module with these sums (``sums`` per head) and ``P̄ = mass``: every token shown, labelled by
    its id, 5 pairs a table."""
    from attn_callbacks.metrics.tables import module_tables
    from attn_callbacks.sums.accumulator import AttentionStats

    vocab_q, vocab_k = mass.shape
    stats = AttentionStats(sums, counts, query_count, torch.tensor(0), uniform, torch.zeros(6, sums.shape[0]))
    tables, _ = module_tables(
        stats,
        mass,
        square=square,
        query_tokens=slice(0, vocab_q),
        key_tokens=slice(0, vocab_k),
        query_labels=lambda ids: [str(i) for i in ids],
        key_labels=lambda ids: [str(i) for i in ids],
        num_pairs=5,
        min_support=min_support,
    )
    return tables


@pytest.mark.parametrize("numba", ["1", "0"])
def test_lift_pairs_table_ranks_every_supported_pairs_lift_as_a_python_sort_does(numba, monkeypatch):
    monkeypatch.setenv("ATTN_CALLBACKS_NUMBA", numba)
    gen = torch.Generator().manual_seed(3)
    heads, vocab = 2, 9
    sums = torch.rand(heads, vocab, vocab, generator=gen).round(decimals=1)  # ties
    uniform = torch.rand(vocab, vocab, generator=gen).round(decimals=1)  # zeros: lift 0 there
    counts = torch.randint(0, 4, (vocab, vocab), generator=gen)
    query_count = torch.randint(1, 5, (vocab,), generator=gen)
    sum_mean = sums.mean(dim=0)
    mass = sum_mean / query_count[:, None]
    tables = five_pair_tables(sums, counts, query_count, uniform, mass, square=True, min_support=2)
    # every pair seen at least twice, by lift (S̄ / U, 0 where U = 0) descending, then by flat index
    scored = [
        (-(float(sum_mean[a, b] / uniform[a, b]) if uniform[a, b] > 0 else 0.0), a * vocab + b)
        for a in range(vocab)
        for b in range(vocab)
        if counts[a, b] >= 2
    ]
    expected = [(flat // vocab, flat % vocab, -score) for score, flat in sorted(scored)[:5]]
    got = [line.split(" | ") for line in tables["lift_pairs"].splitlines()[2:]]
    assert [(int(row[0][2:]), int(row[1]), float(row[2])) for row in got] == [
        (a, b, pytest.approx(score, abs=5e-4)) for a, b, score in expected
    ]


@pytest.mark.parametrize("numba", ["1", "0"])
def test_pagerank_of_a_matrix_with_an_inf_or_nan_is_nan_on_either_path(numba, monkeypatch):
    monkeypatch.setenv("ATTN_CALLBACKS_NUMBA", numba)
    for bad in (float("inf"), float("nan")):
        matrix = torch.rand(6, 6, generator=torch.Generator().manual_seed(1))
        matrix[2, 4] = bad
        assert F.pagerank(matrix).isnan().any(), bad


@pytest.mark.parametrize("numba", ["1", "0"])
def test_hubs_of_cross_attention_rank_equal_in_degrees_by_token(numba, monkeypatch):
    """Uniform attention (an untrained model): every key's in-degree is the same, exactly, so the hubs table lists
    the first tokens by id, on either path (a BLAS product may add a matrix's last columns in another order)."""
    monkeypatch.setenv("ATTN_CALLBACKS_NUMBA", numba)
    vocab_q, vocab_k = 33, 72
    mass = torch.full((vocab_q, vocab_k), 1.0 / vocab_k)
    # counts whose float32 product with P̄ comes out larger in its last 8 columns than in the others
    query_count = torch.randint(1, 9, (vocab_q,), generator=torch.Generator().manual_seed(5))
    sums = (mass * query_count[:, None])[None]
    counts = torch.ones(vocab_q, vocab_k, dtype=torch.int64)
    tables = five_pair_tables(sums, counts, query_count, counts.float() / vocab_k, mass, square=False, min_support=1)
    rows = [line.split(" | ") for line in tables["hubs"].splitlines()[2:]]
    assert [row[0].strip("| ") for row in rows] == ["0", "1", "2", "3", "4"]
    assert [float(row[1].strip(" |")) for row in rows] == [pytest.approx(1 / vocab_k, abs=5e-4)] * 5


@pytest.mark.parametrize("numba", ["1", "0"])
def test_one_way_table_leaves_out_pairs_never_visible_one_way(numba, monkeypatch):
    """Under a causal mask token 0 (always first) never sees token 2: C[0, 2] counts the masked pair but U[0, 2] = 0,
    so (2, 0) is no evidence of one-way attention. (1, 0), met in both orders, is."""
    monkeypatch.setenv("ATTN_CALLBACKS_NUMBA", numba)
    mass = torch.tensor([[1.0, 0.0, 0.0], [0.9, 0.1, 0.0], [1.0, 0.0, 0.0]])
    uniform = torch.tensor([[1.0, 0.5, 0.0], [0.5, 1.0, 0.0], [0.3, 0.3, 0.3]])  # 0 never saw 2
    counts = torch.full((3, 3), 4, dtype=torch.int64)  # every pair counted, masked or not
    query_count = torch.full((3,), 4)
    tables = five_pair_tables(mass[None] * 4, counts, query_count, uniform, mass, square=True, min_support=1)
    rows = [line.split(" | ") for line in tables["one_way_pairs"].splitlines()[2:]]
    assert [(row[0].strip("| "), row[1]) for row in rows] == [("1", "0")]  # (2, 0) and (2, 1): 2 was never visible
    assert float(rows[0][2]) == pytest.approx(1.0)


def test_markdown_table_escapes_pipes():
    table = markdown_table(["a", "b"], [("x|y", 0.12345)])
    assert table.splitlines() == ["| a | b |", "|---|---|", "| x\\|y | 0.123 |"]


def test_markdown_table_prints_small_numbers_with_significant_digits_and_labels_whole():
    values = [0.0, 0.5, 12.3456, -0.25, 0.01, 0.000119, 1.13e-05, -0.004567, float("nan")]
    long_label = "internationalization_" + "x" * 40 + "\udcff"  # a byte decoded with surrogateescape
    cells = table_cells(markdown_table(["token", "value"], [(long_label, value) for value in values]))
    expected = ["0.000", "0.500", "12.346", "-0.250", "0.010", "0.000119", "1.13e-05", "-0.00457", "nan"]
    assert [row[1] for row in cells] == expected
    assert [row[0] for row in cells] == [long_label.replace("\udcff", "\\xff")] * len(values)  # whole, drawable


def test_markdown_table_cells_render_in_tensorboard_as_written():
    from tensorboard import plugin_util

    labels = ["__init__", "*args*", "`x`", "\\*", "[CLS](x)", "![i](x)", "<s>", "<em>", "a|b", "&amp;", "x\\|y"]
    labels += ["<other>", "▁the", "1.", "- x", "#tag", "0.125", "-3", "a  b", "a\rb", "a\nb"]
    labels += [" the", "the ", " ", "\tx"]
    # A line break would end the row, a tab at an end would be trimmed: both shown as escapes.
    shown = [label.replace("\r", "\\r").replace("\n", "\\n").replace("\t", "\\t") for label in labels]
    page = plugin_util.markdown_to_safe_html(markdown_table(["token", "P"], [(label, 0.5) for label in labels]))
    cells = [html.unescape(re.sub(r"<[^>]+>", "", cell)) for cell in re.findall(r"<td>(.*?)</td>", page, re.S)]
    cells = [cell.replace("\xa0", " ") for cell in cells]  # edge spaces are no-break spaces: Markdown trims spaces
    assert cells[::2] == shown and cells[1::2] == ["0.500"] * len(labels)
    assert table_cells(markdown_table(["token", "P"], [(label, 0.5) for label in labels])) == [
        [label, "0.500"] for label in shown
    ]
