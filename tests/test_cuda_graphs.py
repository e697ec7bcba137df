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
def test_graphed_steps_equal_op_by_op_steps_across_shapes_states_and_resets(monkeypatch):
    """Replays (captured at a shape's second batch) give the eager sums: two modules' states updated in turn (their
    graphs share the static inputs and the scratch pool), two shapes interleaved, a reset between epochs (the state
    zeroed in place, so the graphs still write it), dropped rows counted alike."""
    heads, vocab = 4, 40
    modes = ("graphs", "eager")
    metrics = {mode: [AttentionAccumulator(heads, vocab, vocab).cuda() for _ in range(2)] for mode in modes}
    g = torch.Generator().manual_seed(0)
    batches = [_batch(g, 6, heads, length, vocab) for length in (16, 16, 16, 9, 16, 9, 9)]
    results = {}
    for mode, pair in metrics.items():
        monkeypatch.setenv(cuda_graphs.GRAPH_SWITCH, "1" if mode == "graphs" else "0")
        per_epoch = []
        for epoch in range(2):
            for w, ids, valid in batches[epoch * 2 :]:
                w, ids, valid = w.cuda(), ids.cuda(), valid.cuda()
                for k, metric in enumerate(pair):  # the second module sees other weights over the same ids
                    metric.update(w.roll(k, dims=-1), ids, ids, valid, valid)
            per_epoch.append([{f: getattr(m.stats(), f).clone() for f in SUM_FIELDS} for m in pair])
            for metric in pair:
                metric.reset()
        results[mode] = per_epoch
    assert [_graphs_writing(m) for m in metrics["graphs"]] == [2, 2]  # lengths 16 and 9
    assert [_graphs_writing(m) for m in metrics["eager"]] == [0, 0]
    for graphed, eager in zip(results["graphs"], results["eager"], strict=True):
        assert int(eager[0]["skipped_rows"]) > 0
        assert not torch.equal(eager[0]["attention_sum"], eager[1]["attention_sum"])
        for k in range(2):
            for field in SUM_FIELDS:
                torch.testing.assert_close(graphed[k][field], eager[k][field], rtol=1e-5, atol=1e-6, msg=field)


@cuda
def test_a_hot_cell_summed_apart_on_the_gpu_gives_the_cpu_sums_replayed_or_op_by_op(monkeypatch):
    """The (<other>, <other>) cell of tracked streams, summed apart from the GPU's scatter, replayed as a graph (kept
    apart from the graph of the same state and shapes without it) or op by op: the CPU's sums, which never do so."""
    heads, vocab = 4, 40
    g = torch.Generator().manual_seed(2)
    batches = []
    for _ in range(4):
        w, ids, valid = _batch(g, 6, heads, 16, vocab)
        ids[:, ::2] = vocab - 1  # a quarter of the pairs in the last cell
        batches.append((w, ids, valid))
    hot = vocab * vocab - 1
    results, graphed = {}, None
    for mode in ("cpu", "graphs", "eager"):
        monkeypatch.setenv(cuda_graphs.GRAPH_SWITCH, "0" if mode == "eager" else "1")
        device = "cpu" if mode == "cpu" else "cuda"
        metric = AttentionAccumulator(heads, vocab, vocab).to(device)
        for k, (w, ids, valid) in enumerate(batches):
            w, ids, valid = w.to(device), ids.to(device), valid.to(device)
            metric.update(w, ids, ids, valid, valid, hot_cell=hot if k >= 2 else None)  # 2 batches without it first
        results[mode] = {f: getattr(metric.stats(), f).cpu() for f in SUM_FIELDS}
        graphed = metric if mode == "graphs" else graphed
    assert _graphs_writing(graphed) == 2  # each captured at its second batch: one without the cell apart, one with
    state = (graphed.sums, graphed.pair_count, graphed.query_count, graphed.position_sums)
    constants = {key[2] for key, graph in cuda_graphs._CACHE.graphs.items() if graph.writes(state)}
    assert constants == {(None,), (hot,)}
    assert results["cpu"]["pair_count"][-1, -1] > 100
    for mode in ("graphs", "eager"):
        for field in SUM_FIELDS:
            torch.testing.assert_close(results[mode][field], results["cpu"][field], rtol=1e-5, atol=1e-6, msg=field)


def _graphs_writing(metric: AttentionAccumulator) -> int:
    state = (metric.sums, metric.pair_count, metric.query_count, metric.position_sums)
    return sum(1 for graph in cuda_graphs._CACHE.graphs.values() if graph.writes(state))


@cuda
def test_a_graph_never_writes_a_new_state_at_a_freed_one_s_address():
    """A state freed and its memory handed out again: the graph made for the old state is not replayed into the new
    one, which is captured anew once seen twice (into a fresh pool: the only graph's is gone with it)."""

    def step(total, x):
        total += x.sum()
        return x.sum()

    x = torch.ones(8, device="cuda")
    first = torch.zeros(4, device="cuda")
    returned = [cuda_graphs.graphed(step, (first,), (x,)) for _ in range(3)]
    assert returned[0] is None and [float(r) for r in returned[1:]] == [8.0, 8.0]  # eager (the caller's), 2 replays
    assert first.tolist() == [16.0] * 4
    address = first.data_ptr()
    del first
    candidates = [torch.zeros(4, device="cuda") for _ in range(256)]  # the allocator hands blocks out by address
    second = next(t for t in candidates if t.data_ptr() == address)
    assert cuda_graphs.graphed(step, (second,), (x,)) is None and second.tolist() == [0.0] * 4
    assert float(cuda_graphs.graphed(step, (second,), (x,))) == 8.0 and second.tolist() == [8.0] * 4
    assert cuda_graphs._CACHE.failure is None


def _sums_of(metric: AttentionAccumulator) -> dict:
    return {field: getattr(metric.stats(), field).cpu() for field in SUM_FIELDS}


@cuda
def test_an_accumulator_replaying_graphs_adds_each_batch_once():
    heads, vocab = 2, 30
    g = torch.Generator().manual_seed(1)
    w, ids, valid = _batch(g, 4, heads, 12, vocab)
    once = AttentionAccumulator(heads, vocab, vocab)
    once.update(w, ids, ids, valid, valid)
    w, ids, valid = w.cuda(), ids.cuda(), valid.cuda()
    metric = AttentionAccumulator(heads, vocab, vocab).cuda()
    for _ in range(3):
        metric.update(w, ids, ids, valid, valid)  # the second and third replay a graph
    assert _graphs_writing(metric) == 1
    got, want = _sums_of(metric), _sums_of(once)
    assert torch.equal(got["query_count"], 3 * want["query_count"])
    torch.testing.assert_close(got["attention_sum"], 3 * want["attention_sum"])


@cuda
def test_a_step_raising_its_own_error_while_captured_raises_it_and_leaves_graphs_on():
    calls = []

    def step(total, x):
        calls.append(len(calls))
        if len(calls) == 1:  # the capture: graphed runs nothing the first time a pair is seen
            raise ValueError("bad shapes")
        total += x.sum()
        return x.sum()

    total, x = torch.zeros(2, device="cuda"), torch.ones(3, device="cuda")
    assert cuda_graphs.graphed(step, (total,), (x,)) is None
    with pytest.raises(ValueError, match="bad shapes"):
        cuda_graphs.graphed(step, (total,), (x,))  # the capture ended all the same: the stream is usable
    assert cuda_graphs._CACHE.failure is None and cuda_graphs.graphs_apply(x)
    assert cuda_graphs.graphed(step, (total,), (x,)) is None  # seen once again
    assert float(cuda_graphs.graphed(step, (total,), (x,))) == 3.0 and total.tolist() == [3.0, 3.0]


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
        # The allocator is left sound: cached memory is freed, and a capture of another graph works.
        torch.cuda.empty_cache()
        graph, y = torch.cuda.CUDAGraph(), torch.zeros(3, device="cuda")
        with torch.cuda.graph(graph):
            y += x * 2
        graph.replay()
        graph.replay()
        assert y.tolist() == [4.0, 4.0, 4.0], y.tolist()
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
