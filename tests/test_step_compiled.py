"""The compiled per-batch terms (attn_callbacks/sums/step_compiled.py) against the float64 loops and the eager torch
step: on CPU inductor generates C++, so these run wherever the tests run."""

import warnings

import pytest
import torch
from _callback_helpers import TinyEncoder, last_scalars, make_batches, run_validate
from _reference import random_case, run_full

from attn_callbacks import AttentionMonitor
from attn_callbacks import functional as F
from attn_callbacks.sums import step_compiled
from attn_callbacks.sums.step_torch import accumulate_attention_torch, batch_terms


@pytest.fixture
def fresh_compile(monkeypatch):
    """A process-wide compiled function of each test's own (and no fallback left over from another test)."""
    monkeypatch.setattr(step_compiled, "_compiled", None)
    monkeypatch.setattr(step_compiled, "_failed", None)
    torch._dynamo.reset()


def step(case, vocab, compiled, mean_of_heads=False, hot_cell=None):
    weights, qi, ki, qv, kv = case
    heads, vq, vk, on = weights.shape[1], *vocab, {"device": weights.device}
    packed = torch.zeros((1 if mean_of_heads else heads) + 1, vq * vk, **on)
    C, Q = torch.zeros(vq * vk, dtype=torch.long, **on), torch.zeros(vq, dtype=torch.long, **on)
    P = torch.zeros(len(F.POSITION_STATS), heads, dtype=torch.float64, **on)
    pairs = F.pair_index(qi, ki, qv, kv, vq, vk)
    skipped = accumulate_attention_torch(
        packed, C, Q, P, weights, pairs, qi, qv, kv, hot_cell=hot_cell, compiled=compiled
    )
    return packed, C, Q, P, int(skipped)


def a_case_with_everything(seed):
    """Cross-attention with padding, a causal mask, a NaN row, an all-zero row and an ignored id on the hot cell."""
    weights, qi, ki, qv, kv = random_case(3, 2, 7, 6, 4, 3, causal=True, seed=seed)
    qi[:, ::2], ki[:, 1::2] = 3, 2  # (3, 2), the last cell, takes about a quarter of the pairs
    weights[1, :, 4] = float("nan")
    weights[2, :, 1] = 0.0
    qv[2, 6], qi[2, 6] = False, 3
    return weights, qi, ki, qv, kv


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("hot_cell", [None, 11])
@pytest.mark.parametrize("mean_of_heads", [False, True])
def test_compiled_step_equals_float64_loops_and_eager_step(fresh_compile, mean_of_heads, hot_cell, device):
    case = [tensor.to(device) for tensor in a_case_with_everything(seed=3)]
    got = step(case, (4, 3), compiled=True, mean_of_heads=mean_of_heads, hot_cell=hot_cell)
    assert step_compiled.compile_failed() is None  # it did compile
    S, rC, rQ, U, rP, rskipped = run_full(*(tensor.cpu() for tensor in case), 4, 3)
    rS = S.double().mean(dim=0, keepdim=True) if mean_of_heads else S.double()
    packed, C, Q, P, skipped = (value.cpu() if isinstance(value, torch.Tensor) else value for value in got)
    torch.testing.assert_close(packed[:-1].double().view_as(rS), rS, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed[-1].double().view(4, 3), U, rtol=1e-5, atol=1e-6)
    assert torch.equal(C.view(4, 3), rC) and torch.equal(Q, rQ) and skipped == rskipped == 2
    torch.testing.assert_close(P, rP, rtol=1e-5, atol=1e-5)
    eager = step(case, (4, 3), compiled=False, mean_of_heads=mean_of_heads, hot_cell=hot_cell)
    for compiled_value, eager_value in zip(got, eager, strict=True):
        if isinstance(compiled_value, torch.Tensor):
            torch.testing.assert_close(compiled_value, eager_value, rtol=1e-5, atol=1e-5)
        else:
            assert compiled_value == eager_value


def test_compiled_step_compiles_twice_at_most_however_the_lengths_vary(fresh_compile, monkeypatch):
    graphs = []

    def counting(graph, example_inputs):  # dynamo's backend protocol: run the captured graph as it is
        graphs.append(graph)
        return graph.forward

    monkeypatch.setattr(step_compiled, "_compiled", torch.compile(batch_terms, fullgraph=True, backend=counting))
    for length in (5, 7, 9, 12, 16, 3):
        case = random_case(2, 2, length, length, 5, 5, causal=True, seed=length)
        for got, want in zip(step(case, (5, 5), True), step(case, (5, 5), False), strict=True):
            torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), rtol=1e-5, atol=1e-5)
    assert len(graphs) <= 2  # the first shape, then one graph with dynamic lengths


def test_a_failed_compile_warns_once_and_runs_the_eager_step(fresh_compile, monkeypatch):
    def broken(graph, example_inputs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(step_compiled, "_compiled", torch.compile(batch_terms, fullgraph=True, backend=broken))
    case = a_case_with_everything(seed=4)
    with pytest.warns(RuntimeWarning, match="torch.compile failed on the per-batch step .*no compiler here"):
        got = step(case, (4, 3), compiled=True)
    assert "no compiler here" in step_compiled.compile_failed()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        again = step(case, (4, 3), compiled=True)
    for result in (got, again):
        for value, eager_value in zip(result, step(case, (4, 3), compiled=False), strict=True):
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(eager_value))


def test_monitor_with_compile_step_logs_the_eager_monitors_numbers(tmp_path, fresh_compile, monkeypatch):
    monkeypatch.setenv("ATTN_CALLBACKS_NUMBA", "0")  # the torch step, which compile_step compiles, on CPU
    logged = {}
    for compiled in (False, True):
        monitor = AttentionMonitor(vocab_size=12, ignore_ids=[0], compile_step=compiled, num_pairs=0, top_k=5)
        torch.manual_seed(0)  # the same model twice
        run_validate(tmp_path / str(compiled), monitor, make_batches(), TinyEncoder())
        logged[compiled] = last_scalars(tmp_path / str(compiled) / "tb" / "version_0")
    assert step_compiled._compiled is not None and step_compiled.compile_failed() is None  # compiled and ran
    assert len(logged[True]) > 20 and logged[True].keys() == logged[False].keys()
    for tag, value in logged[False].items():
        assert logged[True][tag] == pytest.approx(value, rel=1e-5, abs=1e-6), tag
