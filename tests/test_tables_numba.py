"""The numba passes behind the tables find exactly the cells torch's masks find, in the same (row-major) order."""

import pytest
import torch

from attn_callbacks.base.tensor_ops import safe_divide
from attn_callbacks.metrics import tables_numba

pytest.importorskip("numba")


def _sums(rows: int, cols: int, seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """Views of the leading block of larger matrices (as the tables slice off ``<other>``): a coarse grid of values
    with ties and zeros, pair counts with zeros, a NaN and an inf."""
    g = torch.Generator().manual_seed(seed)
    values = (torch.randint(0, 5, (rows + 1, cols + 1), generator=g).to(dtype) / 4)[:rows, :cols]
    other = (torch.randint(0, 4, (rows + 1, cols + 1), generator=g).to(dtype) / 2)[:rows, :cols]
    counts = torch.randint(0, 5, (rows + 1, cols + 1), generator=g)[:rows, :cols]
    values[1, 2], values[2, 1], values[3, 0] = float("nan"), float("inf"), float("inf")
    return values, other, counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("size, min_support", [(1, 1), (16, 2), (70, 1), (70, 3), (300, 2)])
def test_one_way_candidates_are_the_cells_of_torchs_masks_in_row_major_order(size, min_support, dtype):
    for seed in range(3):
        matrix, _, counts = _sums(max(size, 4), max(size, 4), seed, dtype)
        matrix, counts = matrix[:size, :size], counts[:size, :size]
        seen = counts >= min_support
        expected = (seen & seen.T & (matrix > matrix.T)).nonzero().unbind(dim=1)
        rows, cols = tables_numba.one_way_candidates(matrix, counts, min_support)
        assert rows.tolist() == expected[0].tolist() and cols.tolist() == expected[1].tolist()
    assert size == 1 or len(expected[0]) > 0


@pytest.mark.parametrize("layout", ["bottom-right slice", "transposed", "strided columns"])
def test_one_way_candidates_of_any_layout_equal_those_of_a_contiguous_copy(layout):
    """Slices whose rows are read in place from the parent (up to the end of its storage), and layouts copied."""
    matrix, _, counts = _sums(300, 300, 7)
    parent_m, parent_c = matrix._base, counts._base
    views = {
        "bottom-right slice": lambda t: t[-260:, -260:],
        "transposed": lambda t: t[:260, :260].T,
        "strided columns": lambda t: t[:150, :300:2],
    }[layout]
    m, c = views(parent_m), views(parent_c)
    got = tables_numba.one_way_candidates(m, c, 2)
    want = tables_numba.one_way_candidates(m.contiguous(), c.contiguous(), 2)
    assert not m.is_contiguous() and len(want[0]) > 0
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows, cols, min_support", [(1, 1, 1), (33, 20, 2), (20, 70, 1), (70, 70, 4)])
def test_lift_candidates_are_the_supported_cells_with_a_finite_lift_and_equal_lifts(rows, cols, min_support, dtype):
    for seed in range(3):
        mass, uniform, counts = _sums(max(rows, 4), max(cols, 4), seed, dtype)
        mass, uniform, counts = mass[:rows, :cols], uniform[:rows, :cols], counts[:rows, :cols]
        query_count = torch.randint(0, 7, (rows,), generator=torch.Generator().manual_seed(seed))
        sums = query_count[:, None].to(dtype) * mass  # S = Q P, as the tables had it
        r, c = (counts >= min_support).nonzero().unbind(dim=1)
        values = safe_divide(sums[r, c], uniform[r, c])  # the lift: 0 where U = 0
        keep = torch.isfinite(values)
        flat, lifts = tables_numba.lift_candidates(mass, query_count, uniform, counts, min_support)
        assert flat.tolist() == (r * cols + c)[keep].tolist()
        assert lifts.dtype == dtype and torch.equal(lifts, values[keep])
    assert rows * cols == 1 or ((uniform == 0).any() and len(flat) > 0)


@pytest.mark.parametrize("layout", ["bottom-right slice", "transposed", "strided columns"])
def test_lift_candidates_of_any_layout_equal_those_of_contiguous_copies(layout):
    parent_m, parent_u, counts = (t._base for t in _sums(300, 300, 5))
    views = {
        "bottom-right slice": lambda t: t[-260:, -260:],
        "transposed": lambda t: t[:260, :260].T,
        "strided columns": lambda t: t[:150, :300:2],
    }[layout]
    m, u, c = views(parent_m), views(parent_u), views(counts)
    query_count = torch.arange(m.shape[0]) % 5
    got = tables_numba.lift_candidates(m, query_count, u, c, 2)
    want = tables_numba.lift_candidates(m.contiguous(), query_count, u.contiguous(), c.contiguous(), 2)
    assert not m.is_contiguous() and len(want[0]) > 0
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))


def test_candidates_refuse_matrices_of_other_shapes():
    matrix, uniform, counts = _sums(6, 6, 0)
    with pytest.raises(ValueError, match=r"square matrices of one shape, got \(6, 5\) and \(6, 5\)"):
        tables_numba.one_way_candidates(matrix[:, :5], counts[:, :5], 1)
    query_count = torch.ones(6, dtype=torch.int64)
    with pytest.raises(
        ValueError, match=r"matrices and \(Vq,\) query counts, got \(6, 6\), \(6, 5\), \(6, 6\) and \(6,\)"
    ):
        tables_numba.lift_candidates(matrix, query_count, uniform[:, :5], counts, 1)
    with pytest.raises(ValueError, match=r"got \(6, 6\), \(6, 6\), \(6, 6\) and \(5,\)"):
        tables_numba.lift_candidates(matrix, query_count[:5], uniform, counts, 1)


def test_candidates_of_matrices_with_none_are_empty():
    matrix, uniform, counts = _sums(5, 5, 0)
    rows, cols = tables_numba.one_way_candidates(matrix, torch.zeros_like(counts), 1)
    flat, lifts = tables_numba.lift_candidates(matrix, torch.ones(5, dtype=torch.int64), uniform, counts, 100)
    assert rows.numel() == cols.numel() == flat.numel() == lifts.numel() == 0


@pytest.mark.parametrize("rows, cols", [(1, 1), (5, 9), (70, 70), (133, 40)])
def test_vector_matrix_equals_a_float64_product(rows, cols):
    g = torch.Generator().manual_seed(rows)
    matrix = torch.rand(rows, cols, generator=g) * (torch.rand(rows, cols, generator=g) < 0.5)
    vector = torch.rand(rows, generator=g, dtype=torch.float64)
    vector[::3] = 0  # rows skipped by the kernel
    product = tables_numba.vector_matrix(vector, matrix)
    assert product.dtype == torch.float64 and product.shape == (cols,)
    torch.testing.assert_close(product, vector @ matrix.double(), rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match=rf"\(V,\) vector and a \(V, W\) matrix, got \({rows + 1},\) and"):
        tables_numba.vector_matrix(torch.zeros(rows + 1, dtype=torch.float64), matrix)


def test_row_sums_equal_float64_sums():
    g = torch.Generator().manual_seed(0)
    for matrix in (
        torch.rand(70, 33, generator=g),
        torch.rand(1, 1, generator=g),
        torch.rand(9, 40, generator=g)[:, :30],
    ):
        torch.testing.assert_close(tables_numba.row_sums(matrix), matrix.double().sum(dim=1), rtol=1e-13, atol=0)
