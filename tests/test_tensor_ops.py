import pytest
import torch

from attn_callbacks import functional as F
from attn_callbacks.base import tensor_ops as blocks
from attn_callbacks.base.tensor_ops import row_blocks, safe_divide, square_tiles

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("into", [False, True, "numerator"])
def test_safe_divide_is_the_quotient_and_0_where_the_denominator_is_0(device, into):
    """Broadcast rows (CPU: reciprocals, then a product; CUDA: a division, no host sync), a subnormal row count whose
    reciprocal overflows (the division instead), equal shapes; into a given tensor, the numerator's own memory too."""
    numerator = torch.tensor([[1.0, 2.0, 0.0], [3.0, -4.0, 5.0], [6.0, 7.0, 8.0], [1e-39, 2e-39, 0.0]])
    rows = torch.tensor([[2.0], [0.0], [4.0], [1e-39]])  # 1 / 1e-39 overflows float32
    normal = torch.tensor([[2.0], [0.0], [4.0], [0.5]])
    same = torch.tensor([[2.0, 0.0, 1.0], [1.0, 1.0, 0.0], [4.0, 8.0, 16.0], [1.0, 2.0, 3.0]])
    for denominator in (rows, normal, same):
        expected = [
            [0.0 if d == 0 else n / d for n, d in zip(row, den * len(row) if len(den) == 1 else den, strict=True)]
            for row, den in zip(numerator.double().tolist(), denominator.double().tolist(), strict=True)
        ]
        num, den = numerator.to(device), denominator.to(device)
        out = {False: None, True: torch.empty_like(num), "numerator": num}[into]
        got = safe_divide(num, den, out=out)
        assert out is None or got.data_ptr() == out.data_ptr()
        torch.testing.assert_close(got.double().cpu(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_safe_divide_into_the_denominator_or_a_tensor_of_another_dtype(device):
    numerator = torch.tensor([1.0, 2.0, 0.0, 3.0], device=device)
    denominator = torch.tensor([2.0, 0.0, 0.0, 1.0], device=device)
    assert safe_divide(numerator, denominator, out=denominator).tolist() == [0.5, 0.0, 0.0, 3.0]
    counts, total = torch.tensor([3, 0, 6], device=device), torch.tensor([2, 0, 4], device=device)
    into = torch.empty(3, device=device)  # float32: the float64 quotient is cast, as a copy would
    assert safe_divide(counts, total, out=into).tolist() == [1.5, 0.0, 1.5] and into.dtype == torch.float32


def test_to_host_flat_puts_every_tensor_flattened_into_one_cpu_tensor():
    got = blocks.to_host_flat([torch.tensor(1.5), torch.tensor([2, 3]), torch.ones(2, 1)], torch.float64)
    assert got.dtype == torch.float64 and got.device.type == "cpu" and got.tolist() == [1.5, 2.0, 3.0, 1.0, 1.0]
