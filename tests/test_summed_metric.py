"""The torchmetrics private API that attn_callbacks.sums.summed_metric relies on. When a torchmetrics release changes
it, these fail loudly: adapt summed_metric.py, then move the upper bound in pyproject.toml."""

import inspect

import pytest
import torch
from torchmetrics import Metric
from torchmetrics.utilities.distributed import gather_all_tensors

from attn_callbacks.sums.summed_metric import PRIVATE_API, SummedMetric


class Counts(SummedMetric):
    def __init__(self):
        super().__init__()
        self.add_sum("total", (2, 3), torch.float32)
        self.add_sum("seen", (), torch.long)

    def update(self, x):
        self.total += x
        self.seen += 1

    def compute(self):
        return {"total": self.total, "seen": self.seen}

    def shape_result(self, result):
        return {**result, "shape": tuple(result["total"].shape)}


def test_private_members_are_still_there():
    metric = Counts()
    for name in PRIVATE_API:
        assert hasattr(metric, name), f"torchmetrics.Metric no longer has {name}"
    assert set(metric._defaults) == set(metric._reductions) == {"total", "seen"}
    assert metric._cache is None and metric._is_synced is False
    assert list(inspect.signature(Metric._wrap_compute).parameters) == ["self", "compute"]
    sync = inspect.signature(Metric._sync_dist).parameters
    assert list(sync) == ["self", "dist_sync_fn", "process_group"]
    assert sync["dist_sync_fn"].default is gather_all_tensors


def test_defaults_kept_empty_and_reset_zeroes_in_place():
    metric = Counts()
    assert metric._defaults["total"].numel() == 0  # no second full copy of the state
    state = metric.total
    metric.update(torch.ones(2, 3))
    assert metric.total.data_ptr() == state.data_ptr() and float(metric.total.sum()) == 6
    metric.reset()
    assert metric.total is state and float(state.sum()) == 0 and int(metric.seen) == 0 and metric.total.shape == (2, 3)


def test_released_memory_goes_elsewhere_and_comes_back_zeroed():
    metric = Counts()
    metric.update(torch.ones(2, 3))
    kept = metric.total
    metric.release("total")  # someone else keeps that memory now: the state waits, empty, for allocate()
    metric.reset()
    assert not metric.allocated and metric.total.numel() == 0 and float(kept.sum()) == 6  # not zeroed: not ours
    metric.allocate()
    assert metric.allocated and metric.total.shape == (2, 3) and not metric.total.any()
    assert metric.total.data_ptr() != kept.data_ptr()
    other = torch.full((2, 3), 7.0)
    metric.release("total", other)  # memory of the right shape given instead: the state's from the next reset on
    metric.reset()
    assert metric.allocated and metric.total is other and not other.any() and float(kept.sum()) == 6


def test_compute_goes_through_shape_result():
    metric = Counts()
    metric.update(torch.full((2, 3), 2.0))
    assert metric.compute()["shape"] == (2, 3)
    assert float(metric.compute()["total"].sum()) == 12


def test_sum_in_place_is_a_no_op_in_one_process():
    metric = Counts()
    metric.update(torch.ones(2, 3))
    metric.sum_in_place()
    assert not metric.summed_in_place and float(metric.total.sum()) == 6


@pytest.mark.parametrize("name", PRIVATE_API)
def test_each_private_member_belongs_to_torchmetrics_metric(name):
    class Plain(Metric):  # torchmetrics' own class, none of ours
        def update(self):
            pass

        def compute(self):
            return 0

    member = getattr(Plain(), name)
    if name.startswith(("_wrap", "_sync")):
        assert callable(member) and name in vars(Metric)
    else:
        assert member is None or isinstance(member, (bool, dict))
