"""Schedule: which evaluation epochs and batches are monitored, and which loaders a stage evaluates."""

import warnings
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader, TensorDataset

from attn_callbacks.schedule import Schedule


def fake_trainer(fn=TrainerFn.FITTING, epoch=0, sanity=False, testing=False, val_dataloaders=("val0", "val1")):
    return SimpleNamespace(
        sanity_checking=sanity,
        testing=testing,
        current_epoch=epoch,
        state=SimpleNamespace(fn=fn),
        val_dataloaders=list(val_dataloaders) if isinstance(val_dataloaders, tuple) else val_dataloaders,
        num_val_batches=[3, 4],
        test_dataloaders="test",
        num_test_batches=[5],
        num_sanity_val_batches=[2, 2],
    )


def test_schedule_counts_validation_epochs_not_training_epochs():
    schedule = Schedule(log_every_n_epochs=2)
    # check_val_every_n_epoch=2: validation after training epochs 1, 3, 5, 7; every 2nd of those is monitored.
    assert [schedule.epoch(fake_trainer(epoch=e)) for e in (1, 3, 5, 7)] == [True, False, True, False]
    assert schedule.validation_epochs == 4


def test_schedule_sanity_check_and_validate_calls():
    schedule = Schedule(log_every_n_epochs=3, log_sanity_check=False)
    assert not schedule.epoch(fake_trainer(sanity=True))
    assert Schedule(log_sanity_check=True).epoch(fake_trainer(sanity=True))
    # trainer.validate() is always monitored and never counted.
    assert all(schedule.epoch(fake_trainer(fn=TrainerFn.VALIDATING)) for _ in range(4))
    assert schedule.validation_epochs == 0


def test_schedule_resumed_without_a_count_keeps_the_epoch_rule():
    schedule = Schedule(log_every_n_epochs=2)
    schedule.validation_epochs = None  # a checkpoint saved before the count existed
    assert [schedule.epoch(fake_trainer(epoch=e)) for e in range(4)] == [True, False, True, False]


def test_schedule_batch_limit():
    assert all(Schedule().batch(i) for i in range(100))
    assert [Schedule(limit_batches=2).batch(i) for i in range(4)] == [True, True, False, False]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({}, (["val0", "val1"], [3, 4], 2)),
        ({"sanity": True}, (["val0", "val1"], [3, 4], 2)),
        ({"testing": True}, (["test"], [5], 1)),
        ({"val_dataloaders": {"a": "val0", "b": "val1"}}, (["val0", "val1"], [3, 4], 2)),  # a dict: its loaders
    ],
)
def test_schedule_loaders_of_the_running_stage(flags, expected):
    assert Schedule.loaders(fake_trainer(**flags)) == expected


def test_schedule_warns_once_when_a_limited_loader_shuffles():
    data = TensorDataset(torch.arange(8))
    shuffled, ordered = DataLoader(data, shuffle=True), DataLoader(data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Schedule().check_loaders([shuffled])  # no limit: every batch is watched, nothing to warn of
        Schedule(limit_batches=1).check_loaders([ordered])
        limited = Schedule(limit_batches=1)
        limited.check_loaders([ordered, shuffled])
        limited.check_loaders([shuffled])
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "`limit_batches`=1" in messages[0] and "shuffle=False" in messages[0]
