import numpy as np
from tensorboard.backend.event_processing.event_accumulator import IMAGES, SCALARS, EventAccumulator
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tensorboard_crc
from tensorboard.summary.writer.record_writer import RecordWriter
from torch.utils.tensorboard import SummaryWriter

from attn_callbacks.kernels import NUMBA_SWITCH, uses_numba
from attn_callbacks.numba_kernels import masked_crc32c
from attn_callbacks.writer import _record_writer, add_image, quick_checksums


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
