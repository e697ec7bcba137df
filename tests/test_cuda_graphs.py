import subprocess
import sys
import textwrap

import pytest
import torch

from attn_callbacks import cuda_graphs
from attn_callbacks.accumulate import SUM_FIELDS, AttentionAccumulator

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _batch(g: torch.Generator, batch: int, heads: int, length: int, vocab: int):
    """Softmax weights with padding, a NaN row and an all-zero row; ids over ``vocab``."""
    w = torch.randn(batch, heads, length, length, generator=g).softmax(-1)
    w[0, 1, 2] = float("nan")
    w[1, :, 3] = 0.0
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    valid = torch.rand(batch, length, generator=g) > 0.15
    return w, ids, valid


def test_graphs_do_not_apply_on_the_cpu():
    assert not cuda_graphs.graphs_apply(torch.zeros(2, 2))


@cuda
def test_graphed_steps_equal_op_by_op_steps_across_shapes_and_resets(monkeypatch):
    """Replays (captured at a shape's second batch) give the eager sums: two shapes interleaved, a reset between
    epochs (the state zeroed in place, so the graphs still write it), dropped rows counted alike."""
    heads, vocab = 4, 40
    metrics = {mode: AttentionAccumulator(heads, vocab, vocab).cuda() for mode in ("graphs", "eager")}
    g = torch.Generator().manual_seed(0)
    batches = [_batch(g, 6, heads, length, vocab) for length in (16, 16, 16, 9, 16, 9, 9)]
    results = {}
    for mode, metric in metrics.items():
        monkeypatch.setenv(cuda_graphs.GRAPH_SWITCH, "1" if mode == "graphs" else "0")
        per_epoch = []
        for epoch in range(2):
            for w, ids, valid in batches[epoch * 2 :]:
                w, ids, valid = w.cuda(), ids.cuda(), valid.cuda()
                metric.update(w, ids, ids, valid, valid)
            per_epoch.append({f: getattr(metric.stats(), f).clone() for f in SUM_FIELDS})
            metric.reset()
        results[mode] = per_epoch
    assert _graphs_writing(metrics["graphs"]) == 2 and _graphs_writing(metrics["eager"]) == 0  # lengths 16 and 9
    for graphed, eager in zip(results["graphs"], results["eager"], strict=True):
        assert int(eager["skipped_rows"]) > 0
        for field in SUM_FIELDS:
            torch.testing.assert_close(graphed[field], eager[field], rtol=1e-5, atol=1e-6, msg=field)


def _graphs_writing(metric: AttentionAccumulator) -> int:
    state = (metric.sums, metric.pair_count, metric.query_count, metric.position_sums)
    return sum(1 for graph in cuda_graphs._CACHE.graphs.values() if graph.writes(state))


@cuda
def test_a_graph_never_writes_a_new_state_at_a_freed_one_s_address():
    heads, vocab = 2, 30
    g = torch.Generator().manual_seed(1)
    w, ids, valid = _batch(g, 4, heads, 12, vocab)
    once = AttentionAccumulator(heads, vocab, vocab)
    once.update(w, ids, ids, valid, valid)
    w, ids, valid = w.cuda(), ids.cuda(), valid.cuda()
    first = AttentionAccumulator(heads, vocab, vocab).cuda()
    for _ in range(3):
        first.update(w, ids, ids, valid, valid)  # the second and third replay a graph
    assert _graphs_writing(first) == 1
    assert torch.equal(first.stats().query_count.cpu(), 3 * once.stats().query_count)
    torch.testing.assert_close(first.stats().attention_sum.cpu(), 3 * once.stats().attention_sum)
    del first
    second = AttentionAccumulator(heads, vocab, vocab).cuda()  # often at the same address
    second.update(w, ids, ids, valid, valid)
    assert _graphs_writing(second) == 0
    for field in SUM_FIELDS:
        torch.testing.assert_close(
            getattr(second.stats(), field).cpu(), getattr(once.stats(), field), rtol=1e-5, atol=1e-6, msg=field
        )
    # Captured again once every earlier graph is gone (a pool whose graphs all died cannot be shared).
    second.update(w, ids, ids, valid, valid)
    assert _graphs_writing(second) == 1 and cuda_graphs._CACHE.failure is None
    torch.testing.assert_close(second.stats().attention_sum.cpu(), 2 * once.stats().attention_sum)


@cuda
def test_a_step_that_cannot_be_captured_warns_and_runs_op_by_op():
    """A capture that fails (here a host sync inside the step) leaves the step to the caller, warns once, and
    switches graphs off; in a fresh process, since the flag is process-wide."""
    script = textwrap.dedent(
        """
        import warnings
        import torch
        from attn_callbacks import cuda_graphs

        def step(total, x):
            total += x.sum() * float(x.sum())  # .item(): not allowed while capturing
            return total.clone()

        total, x = torch.zeros((), device="cuda"), torch.ones(3, device="cuda")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = [cuda_graphs.graphed(step, (total,), (x,)) for _ in range(2)]
        assert results == [None, None], results
        assert cuda_graphs._CACHE.failure and not cuda_graphs.graphs_apply(x)
        assert any("CUDA graph failed" in str(w.message) for w in caught), [str(w.message) for w in caught]
        step(total, x)
        torch.cuda.synchronize()
        assert float(total) == 9.0, float(total)
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
