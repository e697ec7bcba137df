import csv
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import IMAGES, SCALARS, EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tensorboard_crc
from tensorboard.summary.writer.record_writer import RecordWriter
from torch.utils.tensorboard import SummaryWriter

from attn_callbacks.kernels import NUMBA_SWITCH, uses_numba
from attn_callbacks.numba_kernels import masked_crc32c
from attn_callbacks.writer import _record_writer, add_image, log_heads, quick_checksums


def test_masked_crc32c_equals_tensorboards_for_any_length():
    rng = np.random.default_rng(0)
    for size in (0, 1, 3, 8, 255, 4096, 100_003):
        data = rng.integers(0, 256, size, dtype=np.uint8)
        assert int(masked_crc32c(data)) == tensorboard_crc(data.tobytes()), size


def test_quick_checksums_write_records_tensorboard_reads_back_and_leave_the_writer_as_it_was(tmp_path):
    writer = SummaryWriter(str(tmp_path))
    record = _record_writer(writer)
    assert isinstance(record, RecordWriter) and "write" not in vars(record)
    image = np.random.default_rng(1).integers(0, 256, (40, 50, 4), dtype=np.uint8)
    with quick_checksums(writer):
        assert ("write" in vars(record)) == uses_numba("cpu")  # this writer's records only; none with numba off
        add_image(writer, "picture", image, 3)
        for step in range(5):
            writer.add_scalar("loss", 0.5**step, step)
    assert "write" not in vars(record) and record.write.__func__ is RecordWriter.write
    writer.add_scalar("loss", 0.125, 7)  # TensorBoard's own checksums again, in the same file
    writer.close()
    # The reader checks every record's two checksums: a wrong one raises DataLossError.
    events = EventAccumulator(str(tmp_path), size_guidance={IMAGES: 0, SCALARS: 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(s, 0.5**s) for s in range(5)] + [(7, 0.125)]
    (picture,) = events.Images("picture")
    assert (picture.step, picture.width, picture.height) == (3, 50, 40)


def test_quick_checksums_leave_other_writers_alone():
    with quick_checksums(None):
        pass
    assert _record_writer(object()) is None


def test_quick_checksums_change_nothing_with_numba_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv(NUMBA_SWITCH, "0")
    writer = SummaryWriter(str(tmp_path))
    record = _record_writer(writer)
    with quick_checksums(writer):
        assert "write" not in vars(record)
        writer.add_scalar("loss", 0.5, 1)
    writer.close()
    events = EventAccumulator(str(tmp_path), size_guidance={SCALARS: 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 0.5)]


def test_log_heads_writes_one_tensorboard_event_of_every_value_and_other_loggers_as_lightning_does(tmp_path):
    """A TensorBoardLogger gets every per-head scalar of the epoch end in one event (an event per scalar cost ~36 µs
    each); one with a prefix, and any other logger, get them through their own ``log_metrics``: the same values."""
    heads = {
        ("attention_entropy_heads/enc", ""): torch.tensor([0.5, 0.25]),
        ("attention_position_heads/self/enc", "/dataloader_1"): torch.tensor([1.0]),
    }
    expected = {
        "attention_entropy_heads/enc/head_0": 0.5,
        "attention_entropy_heads/enc/head_1": 0.25,
        "attention_position_heads/self/enc/head_0/dataloader_1": 1.0,
        "epoch": 2.0,
    }
    plain = TensorBoardLogger(tmp_path, name="plain")
    prefixed = TensorBoardLogger(tmp_path, name="prefixed", prefix="run")
    table = CSVLogger(tmp_path, name="csv")
    loop = SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=7))
    trainer = SimpleNamespace(
        sanity_checking=False,
        is_global_zero=True,
        loggers=[plain, prefixed, table],
        fit_loop=loop,
        global_step=7,
        current_epoch=2,
    )
    log_heads(trainer, heads)
    for logger in (plain, prefixed, table):
        logger.finalize("success")
    (events,) = Path(plain.log_dir).glob("events.*")
    summaries = [event for event in LegacyEventFileLoader(str(events)).Load() if event.HasField("summary")]
    assert len(summaries) == 1 and summaries[0].step == 7
    assert {value.tag: value.simple_value for value in summaries[0].summary.value} == pytest.approx(expected)
    read = EventAccumulator(prefixed.log_dir, size_guidance={SCALARS: 0})
    read.Reload()
    got = {tag: [(e.step, e.value) for e in read.Scalars(tag)] for tag in read.Tags()["scalars"]}
    assert got == {f"run-{tag}": [(7, pytest.approx(value))] for tag, value in expected.items()}
    with open(Path(table.log_dir) / "metrics.csv", newline="") as handle:
        (row,) = csv.DictReader(handle)
    assert {tag: float(row[tag]) for tag in expected} == expected and row["step"] == "7"


def test_log_heads_leaves_a_tensorboard_logger_with_its_own_log_metrics_to_it(tmp_path):
    class OnlyFirstHeads(TensorBoardLogger):
        def log_metrics(self, metrics, step=None):
            super().log_metrics({k: v for k, v in metrics.items() if k.endswith("head_0")}, step)

    logger = OnlyFirstHeads(tmp_path)
    loop = SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=3))
    trainer = SimpleNamespace(
        sanity_checking=False, is_global_zero=True, loggers=[logger], fit_loop=loop, global_step=3, current_epoch=0
    )
    log_heads(trainer, {("attention_entropy_heads/enc", ""): torch.tensor([0.5, 0.25])})
    logger.finalize("success")
    read = EventAccumulator(logger.log_dir, size_guidance={SCALARS: 0})
    read.Reload()
    assert read.Tags()["scalars"] == ["attention_entropy_heads/enc/head_0"]
