import csv
import io
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import PIL.Image
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import IMAGES, SCALARS, EventAccumulator
from torch.utils.tensorboard import SummaryWriter

from attn_callbacks.output.writer import add_image, add_png, fast_record_checksums, log_heads, png_bytes


def test_add_image_writes_an_event_tensorboard_reads_back_beside_other_records(tmp_path):
    writer = SummaryWriter(str(tmp_path))
    image = np.random.default_rng(1).integers(0, 256, (40, 50, 4), dtype=np.uint8)
    add_image(writer, "picture", image, 3)
    for step in range(5):
        writer.add_scalar("loss", 0.5**step, step)
    writer.close()
    # The reader checks every record's two checksums: a wrong one raises DataLossError.
    events = EventAccumulator(str(tmp_path), size_guidance={IMAGES: 0, SCALARS: 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(s, 0.5**s) for s in range(5)]
    (picture,) = events.Images("picture")
    assert (picture.step, picture.width, picture.height) == (3, 50, 40)


def test_log_heads_gives_every_logger_the_values_at_lightnings_step(tmp_path):
    """Every logger, a TensorBoardLogger with or without a prefix and a CSV one, gets the per-head scalars through its
    own ``log_metrics``, at the step Lightning logs the layer scalars at."""
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
    read = EventAccumulator(plain.log_dir, size_guidance={SCALARS: 0})
    read.Reload()
    got = {tag: [(e.step, e.value) for e in read.Scalars(tag)] for tag in read.Tags()["scalars"]}
    # TensorBoard gets no `epoch`: Lightning writes it at this step beside the layer scalars (twice: 2 points)
    assert got == {tag: [(7, pytest.approx(value))] for tag, value in expected.items() if tag != "epoch"}
    read = EventAccumulator(prefixed.log_dir, size_guidance={SCALARS: 0})
    read.Reload()
    got = {tag: [(e.step, e.value) for e in read.Scalars(tag)] for tag in read.Tags()["scalars"]}
    assert got == {f"run-{tag}": [(7, pytest.approx(value))] for tag, value in expected.items() if tag != "epoch"}
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


@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 255, 4096, 100_003])
def test_numba_record_checksum_equals_tensorboards(length):
    pytest.importorskip("numba")
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as reference

    from attn_callbacks.output.checksum_numba import masked_crc32c

    data = np.random.default_rng(length).integers(0, 256, length, dtype=np.uint8).tobytes()
    assert masked_crc32c(data) == reference(data)
    assert masked_crc32c(b"123456789") == reference(b"123456789")  # CRC-32C's check value, masked


def test_fast_record_checksums_restores_tensorboards_function_and_writes_readable_records(tmp_path):
    pytest.importorskip("numba")
    from tensorboard.summary.writer import record_writer

    original = record_writer.masked_crc32c
    writer = SummaryWriter(tmp_path)
    image = np.random.default_rng(0).integers(0, 256, (40, 30, 3), dtype=np.uint8)
    with pytest.raises(RuntimeError, match="drawing failed"), fast_record_checksums(writer):
        assert record_writer.masked_crc32c is not original
        add_image(writer, "picture", image, 3)
        raise RuntimeError("drawing failed")
    assert record_writer.masked_crc32c is original  # on every exit path
    writer.close()
    events = EventAccumulator(str(tmp_path), size_guidance={IMAGES: 0})
    events.Reload()  # TensorBoard's reader checks every record's checksums
    (picture,) = events.Images("picture")
    assert picture.step == 3 and (picture.width, picture.height) == (30, 40)
    with fast_record_checksums(None):  # no SummaryWriter: nothing to speed up
        assert record_writer.masked_crc32c is original


def test_fast_record_checksums_overlapping_uses_put_tensorboards_function_back_after_the_last(tmp_path):
    pytest.importorskip("numba")
    from contextlib import ExitStack

    from tensorboard.summary.writer import record_writer

    original = record_writer.masked_crc32c
    first, second = SummaryWriter(tmp_path / "a"), SummaryWriter(tmp_path / "b")
    stack = ExitStack()
    stack.enter_context(fast_record_checksums(first))  # the drawing process's pictures, written after an epoch end
    with fast_record_checksums(second):  # the next epoch end, which ends first
        assert record_writer.masked_crc32c is not original
    assert record_writer.masked_crc32c is not original
    stack.close()
    assert record_writer.masked_crc32c is original
    first.close()
    second.close()


def test_add_png_into_a_writer_closed_since_the_drawing_reopens_it_with_the_same_pixels(tmp_path):
    """The drawing process's pictures arrive after the epoch end: a ``SummaryWriter`` closed meanwhile gets them as
    its own ``add_image`` would (reopened), the pixels unchanged, not an error."""
    writer = SummaryWriter(str(tmp_path))
    image = np.random.default_rng(2).integers(0, 256, (30, 20, 3), dtype=np.uint8)
    add_png(writer, "open", png_bytes(image), image.shape[:2], 1)
    writer.close()
    add_png(writer, "closed", png_bytes(image), image.shape[:2], 2)
    writer.close()
    events = EventAccumulator(str(tmp_path), size_guidance={IMAGES: 0})
    events.Reload()
    for tag, step in (("open", 1), ("closed", 2)):
        (picture,) = events.Images(tag)
        assert (picture.step, picture.width, picture.height) == (step, 20, 30)
        with PIL.Image.open(io.BytesIO(picture.encoded_image_string)) as read:
            np.testing.assert_array_equal(np.asarray(read.convert("RGB")), image)
