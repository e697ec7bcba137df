import pytest
import torch

from attn_callbacks.sums.accumulator import SUM_FIELDS, AttentionAccumulator


def batches():
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        w = torch.randn(2, 3, 4, 5, generator=g).softmax(-1)
        yield w, torch.randint(0, 6, (2, 4), generator=g), torch.randint(0, 4, (2, 5), generator=g)


def test_accumulator_sums_batches_and_divides_only_at_compute():
    metric = AttentionAccumulator(3, 6, 4)
    S = torch.zeros(3, 6, 4, dtype=torch.float64)
    Q = torch.zeros(6, dtype=torch.long)
    for w, q, k in batches():
        metric.update(w, q, k, torch.ones_like(q, dtype=torch.bool), torch.ones_like(k, dtype=torch.bool))
        for n in range(2):
            for i in range(4):
                Q[q[n, i]] += 1
                for j in range(5):
                    S[:, q[n, i], k[n, j]] += w[n, :, i, j].double()
    stats = metric.compute()
    torch.testing.assert_close(stats.attention_sum.double(), S)
    assert torch.equal(stats.query_count, Q) and int(stats.pair_count.sum()) == 3 * 2 * 4 * 5
    seen = Q > 0
    torch.testing.assert_close(stats.attention_mass[:, seen].sum(-1), torch.ones(3, int(seen.sum())))
    metric.reset()
    assert float(metric.sums.abs().sum()) == 0 and int(metric.query_count.sum()) == 0


def test_accumulator_compute_keeps_shapes_for_a_one_id_vocabulary():
    # torchmetrics squeezes one-element results: with one query id, Q, C and U would come back 0-dim.
    for heads, vocab_q, vocab_k, mean in ((1, 1, 1, False), (2, 1, 1, False), (2, 1, 3, False), (2, 1, 1, True)):
        metric = AttentionAccumulator(heads, vocab_q, vocab_k, mean_of_heads=mean)
        keys = torch.arange(3) % vocab_k
        valid_q, valid_k = torch.ones(1, 2, dtype=torch.bool), torch.ones(1, 3, dtype=torch.bool)
        metric.update(
            torch.full((1, heads, 2, 3), 1 / 3), torch.zeros(1, 2, dtype=torch.long), keys[None], valid_q, valid_k
        )
        stats, views = metric.compute(), metric.stats()
        assert tuple(stats.attention_sum.shape) == (1 if mean else heads, vocab_q, vocab_k)
        assert tuple(stats.pair_count.shape) == tuple(stats.uniform_sum.shape) == (vocab_q, vocab_k)
        assert tuple(stats.query_count.shape) == (vocab_q,) and stats.query_count.tolist() == [2]
        for field in SUM_FIELDS:
            assert torch.equal(getattr(stats, field), getattr(views, field)), field
        # P = S / Q: the 3 keys' thirds, folded onto the key ids they hold
        expected = torch.bincount(keys, minlength=vocab_k).float() / 3
        torch.testing.assert_close(stats.attention_mass, expected.expand_as(stats.attention_mass))


def test_accumulator_updates_inside_and_outside_inference_mode():
    w, q, k = next(batches())
    valid_q, valid_k = torch.ones_like(q, dtype=torch.bool), torch.ones_like(k, dtype=torch.bool)
    with torch.inference_mode():
        metric = AttentionAccumulator(3, 6, 4)
        metric.reset()  # must still create normal tensors
        metric.update(w, q, k, valid_q, valid_k)
    metric.update(w.clone(), q.clone(), k.clone(), valid_q.clone(), valid_k.clone())
    assert int(metric.query_count.sum()) == 2 * 2 * 4


def test_accumulator_rejects_bad_sizes():
    import pytest

    with pytest.raises(ValueError, match="`query_vocab_size` to be a positive integer, but got 0"):
        AttentionAccumulator(1, 0, 3)


def test_accumulator_state_bytes_is_what_the_states_hold():
    metric = AttentionAccumulator(3, 6, 4)
    held = sum(t.numel() * t.element_size() for t in metric.metric_state.values())
    assert AttentionAccumulator.state_bytes(3, 6, 4) == held
    # 8 heads over a 2,049-token tracked vocabulary: (9 · 4 + 8) bytes per cell of the 2,049² plane, about 185 MB
    assert AttentionAccumulator.state_bytes(8, 2049, 2049) == 9 * 2049**2 * 4 + 2049**2 * 8 + 2049 * 8 + 8 + 6 * 8 * 4


def test_accumulator_shared_pair_index_gives_the_same_sums():
    from attn_callbacks.functional import pair_index

    own, shared = AttentionAccumulator(3, 6, 4), AttentionAccumulator(3, 6, 4)
    for w, q, k in batches():
        qv, kv = q != 5, k != 0  # some ignored positions
        own.update(w, q, k, qv, kv)
        shared.update(w, q, k, qv, kv, pairs=pair_index(q, k, qv, kv, 6, 4))
    for field in (*SUM_FIELDS, "attention_mass", "mean_weight"):
        assert torch.equal(getattr(own.compute(), field), getattr(shared.compute(), field)), field
        # stats(): the same numbers as views of the state, without torchmetrics' copy
        assert torch.equal(getattr(own.stats(), field), getattr(own.compute(), field)), field
    assert own.stats().attention_sum.untyped_storage().data_ptr() == own.sums.untyped_storage().data_ptr()


def test_accumulator_holds_one_copy_of_its_state_and_reset_zeroes_it():
    acc = AttentionAccumulator(3, 6, 4)
    # torchmetrics would keep a full-size default of every state to reset from: state_bytes must be the whole cost
    held = sum(t.numel() * t.element_size() for t in acc.metric_state.values())
    defaults = sum(t.numel() for t in acc._defaults.values())
    assert held == AttentionAccumulator.state_bytes(3, 6, 4) and defaults == 0
    for w, q, k in batches():
        acc.update(w, q, k, torch.ones_like(q, dtype=torch.bool), torch.ones_like(k, dtype=torch.bool))
    assert float(acc.sums.sum()) > 0
    acc.reset()
    assert acc.sums.shape == (4, 24) and acc.sums.dtype == torch.float32 and not acc.sums.any()
    assert acc.pair_count.dtype == torch.long and acc.skipped_rows.shape == () and not acc.query_count.any()
    assert sum(t.numel() * t.element_size() for t in acc.metric_state.values()) == held


def _sync_rank(rank: int, store_path: str, out_path: str) -> None:
    """One of two gloo ranks: rank r updates with every second batch, from batch r on."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        acc, local = AttentionAccumulator(3, 6, 4), AttentionAccumulator(3, 6, 4)
        for n, (w, q, k) in enumerate(batches()):
            if n % 2 == rank:
                for metric in (acc, local):
                    metric.update(w, q, k, q != 5, k != 0)

        def no_gather(*args, **kwargs):
            raise AssertionError("the state was gathered")

        dist.all_gather = no_gather  # this process only: the sync must be a reduction, never a gather
        first = {field: getattr(acc.stats(), field).clone() for field in SUM_FIELDS}
        second = {field: getattr(acc.stats(), field).clone() for field in SUM_FIELDS}  # the local state came back
        restored = all(torch.equal(getattr(acc, name), getattr(local, name)) for name in acc._reductions)
        # in place: the same sums, in the state itself (no local copy kept), and nothing adds to them until reset
        summed = acc.stats(in_place=True)
        third = {field: getattr(summed, field).clone() for field in SUM_FIELDS}
        no_copy = summed.attention_sum.untyped_storage().data_ptr() == acc.sums.untyped_storage().data_ptr()
        refused = []
        w, q, k = next(batches())
        for call in (lambda: acc.update(w, q, k, q != 5, k != 0), acc.stats, acc.compute):
            try:
                call()
            except Exception as error:  # which calls refuse, and with what message, is the result
                refused.append(str(error))
        acc.reset()
        reset = not acc.summed_in_place and not acc.sums.any()
        # A collective failing part-way: the default sync puts the local state back; in place, nothing adds to it.
        acc.update(w, q, k, q != 5, k != 0)
        before = {name: getattr(acc, name).clone() for name in acc._reductions}
        reduce, calls = dist.all_reduce, []

        def fail_every_second(*args, **kwargs):
            calls.append(1)
            if len(calls) % 2 == 0:
                raise RuntimeError("lost a rank")
            return reduce(*args, **kwargs)

        dist.all_reduce = fail_every_second
        for in_place in (False, True):
            try:
                acc.stats(in_place=in_place)
            except RuntimeError as error:
                refused.append(str(error))
            if not in_place:
                restored = restored and all(torch.equal(getattr(acc, n), before[n]) for n in acc._reductions)
        dist.all_reduce = reduce
        partial_refused = acc.summed_in_place
        try:
            acc.update(w, q, k, q != 5, k != 0)
        except RuntimeError as error:
            refused.append(str(error))
        torch.save(
            {
                "first": first,
                "second": second,
                "third": third,
                "restored": restored,
                "no_copy": no_copy,
                "refused": refused,
                "reset": reset,
                "partial_refused": partial_refused,
            },
            out_path.format(rank),
        )
    finally:
        dist.destroy_process_group()


def test_accumulator_sync_sums_ranks_in_place_without_gathering(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_sync_rank, args=(str(tmp_path / "store"), str(tmp_path / "rank{}.pt")), nprocs=2)
    single = AttentionAccumulator(3, 6, 4)
    for w, q, k in batches():
        single.update(w, q, k, q != 5, k != 0)
    expected = single.compute()
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        assert saved["restored"] and saved["no_copy"] and saved["reset"], rank
        assert saved["partial_refused"] and len(saved["refused"]) == 6, saved["refused"]
        assert saved["refused"][3:5] == ["lost a rank"] * 2 and "count them again" in saved["refused"][5]
        assert "count them again" in saved["refused"][0] and "already summed" in saved["refused"][1]
        for field in SUM_FIELDS:
            for which in ("first", "second", "third"):
                torch.testing.assert_close(saved[which][field], getattr(expected, field), msg=f"{rank} {which} {field}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_accumulator_and_summary_on_cuda_equal_the_cpu_kernels():
    """The GPU path (torch code) gives the CPU path's sums and epoch numbers (numba there, where it runs)."""
    from attn_callbacks.metrics.drift import Snapshot
    from attn_callbacks.metrics.summary import summarize

    g = torch.Generator().manual_seed(1)
    heads, vocab, results = 4, 50, {}
    for device in ("cpu", "cuda"):
        metric = AttentionAccumulator(heads, vocab, vocab).to(device)
        for _ in range(3):
            w = torch.randn(8, heads, 24, 24, generator=g).softmax(-1)
            ids = torch.randint(0, vocab, (8, 24), generator=g)
            valid = torch.rand(8, 24, generator=g) > 0.1
            metric.update(w.to(device), ids.to(device), ids.to(device), valid.to(device), valid.to(device))
        results[device] = metric.compute()
        g = torch.Generator().manual_seed(1)  # the same batches on the other device
    cpu, cuda = results["cpu"], results["cuda"]
    for field in SUM_FIELDS:
        torch.testing.assert_close(getattr(cuda, field).cpu(), getattr(cpu, field), rtol=1e-5, atol=1e-6, msg=field)
    earlier = Snapshot.of(cpu.attention_mass.flip(-1).contiguous(), cpu.query_count)
    summaries = {}
    for device, stats in results.items():
        then = Snapshot(*(part.to(device) for part in earlier))
        args = (stats.uniform_sum, stats.query_count, stats.position_sums, stats.skipped_rows)
        summaries[device] = summarize(stats.attention_mass, *args, square=True, previous=then, reference=then)
    for name, value in summaries["cpu"].layer.items():
        torch.testing.assert_close(summaries["cuda"].layer[name].cpu(), value, rtol=1e-4, atol=1e-6, msg=name)
    for name, value in summaries["cpu"].heads.items():
        torch.testing.assert_close(summaries["cuda"].heads[name].cpu(), value, rtol=1e-4, atol=1e-6, msg=name)
