"""EpochSums: an accumulator per (module, dataloader), allocated once, agreed across ranks, within the budget."""

import torch

from attn_callbacks.sums.accumulator import AttentionAccumulator
from attn_callbacks.sums.epoch_sums import EpochSums


def _agree_rank(rank: int, store_path: str, out_path: str) -> None:
    """One of two gloo ranks, each having seen other SDPA calls: rank 0 "a" and "b.call1", rank 1 "b" and "a"."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        sums = EpochSums()
        sums.start({}, {}, loaders=2)
        seen = [("a", (2, 3, 3)), ("b.call1", (1, 3, 3))] if rank == 0 else [("b", (4, 3, 3)), ("a", (2, 3, 3))]
        for name, shape in seen:
            sums.allocate(name, shape, torch.device("cpu"))
            w, ids = torch.full((1, shape[0], 2, 2), 0.5), torch.tensor([[1, 2]])
            sums.add(name, 0, ("s", "s"), w, (ids, ids > 0), (ids, ids > 0))
        added = sums.agree(torch.device("cpu"))
        _, merged = sums.collect()
        torch.save(
            {
                "added": added,
                "order": list(sums.metrics),
                "heads": {name: stats.attention_sum.shape[0] for name, stats in merged.items()},
                "queries": {name: int(stats.query_count.sum()) for name, stats in merged.items()},
            },
            out_path.format(rank),
        )
    finally:
        dist.destroy_process_group()


def test_epoch_sums_allocated_mid_epoch_are_agreed_across_ranks_in_one_order(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_agree_rank, args=(str(tmp_path / "store"), str(tmp_path / "rank{}.pt")), nprocs=2)
    first, second = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert first["added"] == {"b": (4, 3, 3)} and second["added"] == {"b.call1": (1, 3, 3)}
    order = [(name, idx) for name in ("a", "b.call1", "b") for idx in range(2)]  # rank 0's first, then rank 1's new
    assert first["order"] == second["order"] == order
    assert first["heads"] == second["heads"] == {"a": 2, "b.call1": 1, "b": 4}
    assert first["queries"] == second["queries"] == {"a": 4, "b.call1": 2, "b": 2}  # summed over the ranks


def test_epoch_sums_log_their_bytes_again_when_a_first_call_adds_to_them_or_they_shrink(caplog):
    caplog.set_level("INFO")
    sums = EpochSums(memory_budget=10**9)
    sums.start({"mha": (2, 3, 3)}, {"mha": torch.device("cpu")}, loaders=1)
    sums.start({"mha": (2, 3, 3)}, {"mha": torch.device("cpu")}, loaders=1)  # the same figure: not again
    sums.allocate("sdpa", (4, 3, 3), torch.device("cpu"))  # mid-epoch, checked but logged at collect
    sums.collect()
    sums.start({"mha": (2, 2, 2)}, {"mha": torch.device("cpu")}, loaders=1)  # fewer ids tracked than the limit
    lines = [r.getMessage() for r in caplog.records if "of attention sums per device" in r.getMessage()]
    single = AttentionAccumulator.state_bytes(2, 3, 3)
    both = single + AttentionAccumulator.state_bytes(4, 3, 3)
    fewer = AttentionAccumulator.state_bytes(2, 2, 2)
    logged = [line.split(" will hold ")[1].split(" of ")[0] for line in lines]
    assert logged == [f"{x} B" for x in (single, both, fewer)]


def test_epoch_sums_start_frees_sums_of_modules_gone_or_reshaped_keeps_the_others():
    """Another stage's model (fit, then validate another): an accumulator of a module it lacks, or of another shape
    under a name it has, lets its memory go at once (torchmetrics' reference cycles would hold it until a garbage
    collection); the one that fits is kept, with its sums zeroed; the order is that of the new shapes."""
    cpu = torch.device("cpu")
    sums = EpochSums()
    sums.start({"a": (2, 3, 3), "b": (2, 3, 3), "c": (1, 4, 4)}, dict.fromkeys("abc", cpu), loaders=2)
    w, ids = torch.full((1, 1, 2, 2), 0.5), torch.tensor([[1, 2]])
    sums.add("c", 0, ("s", "s"), w, (ids, ids > 0), (ids, ids > 0))
    before = dict(sums.metrics)
    sums.start({"c": (1, 4, 4), "b": (4, 3, 3)}, dict.fromkeys("bc", cpu), loaders=1)
    assert list(sums.metrics) == [("c", 0), ("b", 0)]
    assert sums.metrics[("c", 0)] is before[("c", 0)] and int(sums.metrics[("c", 0)].query_count.sum()) == 0
    assert sums.metrics[("b", 0)] is not before[("b", 0)] and sums.metrics[("b", 0)].num_heads == 4
    for key in [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("c", 1)]:
        assert before[key].sums.numel() == before[key].pair_count.numel() == 0, key
