"""The drawing process (attn_callbacks.output.drawing, .draw_worker): the same PNG bytes as drawing in process, its
errors raised with its traceback, no torch in it, and no process left after teardown or an exception."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _callback_helpers import PAD, VOCAB, TinyEncoder, loaders, no_hooks, trainer
from lightning.pytorch import Callback, seed_everything
from tensorboard.backend.event_processing.event_accumulator import IMAGES, EventAccumulator

import attn_callbacks.output.drawing as drawing
from attn_callbacks import AttentionMonitor
from attn_callbacks.output.draw_worker import FigureJob, FigureJobs
from attn_callbacks.output.figure_cache import FigureCache
from attn_callbacks.output.writer import png_bytes

LABELS = [f"t{i}" for i in range(6)]
BROKEN = FigureJob("heatmap", (np.zeros(3), [], [], "a vector is no heatmap", "P"), {})


class BrokenJobs(FigureJobs):
    """Every picture a job the drawing process fails on."""

    def __getattr__(self, method):
        return lambda *args, **kwargs: BROKEN


def children():
    """The process ids whose parent is this process (Linux: /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                found.append(int(entry.name))
    return found


@pytest.fixture
def started(monkeypatch):
    """Every DrawingProcess the test starts."""
    processes = []
    init = drawing.DrawingProcess.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        processes.append(self)

    monkeypatch.setattr(drawing.DrawingProcess, "__init__", spy)
    return processes


def gone(processes):
    """Each process started, and none of them is still a child of this one (running, or a zombie not reaped)."""
    return bool(processes) and not {p.pid for p in processes} & set(children())


def images(log_dir):
    """tag -> [(step, PNG bytes)] of every image in the event files under ``log_dir``."""
    events = EventAccumulator(str(log_dir), size_guidance={IMAGES: 0})
    events.Reload()
    return {tag: [(i.step, i.encoded_image_string) for i in events.Images(tag)] for tag in events.Tags()["images"]}


def fit(tmp_path, name, background, **kwargs):
    seed_everything(0)
    monitor = AttentionMonitor(
        VOCAB, "input_ids", ignore_ids=[PAD], probe="first", color_scale="shared", draw_in_background=background
    )
    train, val = loaders()
    t = trainer(tmp_path / name, [monitor], max_epochs=2, **kwargs)
    t.fit(TinyEncoder(), train, val)
    return t, monitor


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_drawing_process_logs_the_same_png_bytes_as_drawing_in_process(tmp_path, monkeypatch, started):
    sent = []
    submit = drawing.DrawingProcess.submit
    monkeypatch.setattr(drawing.DrawingProcess, "submit", lambda self, *args: sent.append(submit(self, *args)))
    here, _ = fit(tmp_path, "here", False)
    assert sent == []
    away, monitor = fit(tmp_path, "away", True)
    drawn_here, drawn_away = images(here.logger.log_dir), images(away.logger.log_dir)
    assert len(sent) == sum(map(len, drawn_away.values()))  # every picture drawn by the process
    # per layer mass, heads, asymmetry, lift and drift maps, the probe, the head grids; 2 epochs each
    assert len(drawn_here) > 20 and sorted(drawn_here) == sorted(drawn_away)
    for tag, logged in drawn_here.items():
        assert [step for step, _ in logged] == [step for step, _ in drawn_away[tag]], tag
        assert all(a == b for (_, a), (_, b) in zip(logged, drawn_away[tag], strict=True)), tag
    assert monitor._report.drawing.process is None and len(started) == 1 and gone(started)
    assert isinstance(monitor._report.images.figures, FigureCache)  # drawing in process again


def test_drawing_default_is_off_on_the_cpu_and_the_argument_is_checked(tmp_path):
    started = []
    seed_everything(0)
    monitor = AttentionMonitor(VOCAB, "input_ids")
    original = monitor._report.drawing.start

    def spy(trainer, enabled):
        original(trainer, enabled)
        started.append(monitor._report.drawing.process)

    monitor._report.drawing.start = spy
    trainer(tmp_path, [monitor]).validate(TinyEncoder(), loaders()[1], verbose=False)
    assert started == [None]
    with pytest.raises(ValueError, match="`draw_in_background` to be True or False, but got 'yes'"):
        AttentionMonitor(VOCAB, "input_ids", draw_in_background="yes")


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc")
def test_drawing_process_imports_neither_torch_nor_lightning():
    process = drawing.DrawingProcess(numba=False)
    try:
        drawn = []
        process.submit(FigureJobs().heatmap(np.eye(6), LABELS, LABELS, "t", "P"), lambda *a: drawn.append(a))
        assert process.wait(120) and len(drawn) == 1
        maps = Path(f"/proc/{process.pid}/maps").read_text()
        assert "matplotlib" in maps and "numpy" in maps  # drawn with them
        assert "libtorch" not in maps and "/torch/" not in maps
    finally:
        assert process.stop() == 0
    code = (  # the worker's module and what its serve() imports
        "import sys, attn_callbacks.output.draw_worker, attn_callbacks.output.figure_cache, attn_callbacks.output.png;"
        "print(sorted({'torch', 'lightning'} & set(sys.modules)))"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(drawing.__file__).parents[2])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == "[]"


def test_drawing_process_pngs_equal_in_process_ones_and_its_errors_carry_its_traceback():
    process = drawing.DrawingProcess(numba=False)
    matrix = np.random.default_rng(0).random((6, 6)).astype(np.float32)
    job = FigureJobs().heatmap(matrix, LABELS, LABELS, "title", "P[query, key]", False, 0.9)
    drawn = []
    try:
        process.submit(job, lambda png, size: drawn.append((png, size)))
        process.submit(BROKEN, lambda png, size: drawn.append("never"))
        assert process.wait(120)
        with pytest.raises(RuntimeError, match=r"(?s)background drawing process failed.*Traceback.*pcolormesh"):
            process.check()
        process.check()  # raised once
    finally:
        assert process.stop() == 0
    expected = FigureCache().heatmap(matrix, LABELS, LABELS, "title", "P[query, key]", False, 0.9)
    assert drawn == [(png_bytes(expected), expected.shape[:2])]


def test_drawing_process_killed_is_an_error_not_a_hang():
    process = drawing.DrawingProcess(numba=False)
    process.submit(FigureJobs().heatmap(np.eye(6), LABELS, LABELS, "t", "P"), lambda *a: None)
    assert process.wait(120)
    process._process.kill()
    receiving = process._threads[1]
    receiving.join(30)  # it saw the process go
    assert not receiving.is_alive()
    with pytest.raises(RuntimeError, match=r"exited with code -9 with 0 picture\(s\) not drawn"):
        process.submit(FigureJobs().heatmap(np.eye(6), LABELS, LABELS, "t", "P"), lambda *a: None)
    assert process.stop() == 0 and process.pid not in children()


def test_drawing_error_in_the_process_is_raised_at_teardown_with_its_traceback(tmp_path, monkeypatch, started):
    monkeypatch.setattr(drawing, "FigureJobs", BrokenJobs)
    model = TinyEncoder()
    monitor = AttentionMonitor(VOCAB, "input_ids", draw_in_background=True)
    with pytest.raises(RuntimeError, match=r"(?s)AttentionMonitor: the background drawing process failed.*Traceback"):
        trainer(tmp_path, [monitor]).validate(model, loaders()[1], verbose=False)
    assert no_hooks(model) and monitor._report.drawing.process is None and gone(started)


def test_drawing_error_is_raised_at_the_next_hook_of_a_fit(tmp_path, monkeypatch, started):
    monkeypatch.setattr(drawing, "FigureJobs", BrokenJobs)
    model = TinyEncoder()
    monitor = AttentionMonitor(VOCAB, "input_ids", draw_in_background=True)

    class Drawn(Callback):  # after the monitor's: the first epoch's pictures are back before training goes on
        def on_validation_epoch_end(self, trainer, pl_module):
            assert monitor._report.drawing.process.wait(120)

    t = trainer(tmp_path, [monitor, Drawn()], max_epochs=4, num_sanity_val_steps=0)
    with pytest.raises(RuntimeError, match=r"(?s)background drawing process failed.*pcolormesh") as raised:
        t.fit(model, *loaders())
    assert t.current_epoch == 1  # raised at the next validation epoch's start, not at teardown
    assert "on_validation_epoch_start" in [entry.name for entry in raised.traceback]
    assert no_hooks(model) and gone(started)


def test_drawing_exception_in_fit_stops_the_process(tmp_path, started):
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], draw_in_background=True)
    model = TinyEncoder(fail_in_validation=True)
    with pytest.raises(RuntimeError, match="validation failed"):
        trainer(tmp_path, [monitor], num_sanity_val_steps=0).fit(model, *loaders())
    assert no_hooks(model) and monitor._report.drawing.process is None and gone(started)
    assert isinstance(monitor._report.images.figures, FigureCache)


def test_epoch_pictures_are_written_once_released_and_never_once_dropped():
    written = []
    released = drawing.EpochPictures()
    released.deliver(lambda: written.append("before"))
    assert written == []  # held while the epoch end runs
    released.release()
    released.deliver(lambda: written.append("after"))
    released.drop()  # after a release: nothing to drop, and later pictures still come
    released.deliver(lambda: written.append("late"))
    dropped = drawing.EpochPictures()
    dropped.deliver(lambda: written.append("failed"))
    dropped.drop()
    dropped.deliver(lambda: written.append("failed, late"))
    dropped.release()  # never after a drop
    assert written == ["before", "after", "late"]


def test_drawing_process_waits_for_the_jobs_before_an_id():
    """wait(before=k) returns once no job with an id below k is pending, whatever came after; False at its timeout."""
    process = drawing.DrawingProcess(numba=False)
    try:
        with process._changed:  # jobs 0-2 delivered, 3 and 4 still drawn (no job is sent: the ids alone decide)
            process._pending.update({3: None, 4: None})
            process.submitted = 5
        assert process.wait(0.1, before=3)
        assert not process.wait(0.1, before=4)
        assert not process.wait(0.1)  # every job
        process._settle(3, None)
        assert process.wait(0.1, before=4) and not process.wait(0.1)
        process._settle(4, None)
        assert process.wait(0.1)
        drawn = []
        job = FigureJobs().heatmap(np.eye(6), LABELS, LABELS, "t", "P")
        process.submit(job, lambda png, size: drawn.append(size))
        assert process.wait(120, before=process.submitted) and len(drawn) == 1
    finally:
        assert process.stop() == 0


def test_drawing_lets_pictures_fall_one_epoch_behind_not_more():
    """Each epoch end first waits for the pictures of the epoch ends before the last: epochs shorter than their
    drawing cannot pile pictures up without end (the process's memory grew with them)."""

    class Process:  # stands in for the DrawingProcess: how far each epoch end waits
        submitted, pending, waits, drawing = 0, 3, [], True

        def wait(self, timeout, before=None):
            self.waits.append((timeout, before))
            return self.drawing

    class Background:
        def later(self, write):
            pass

    pictures = drawing.Drawing(images=None, background=Background())
    pictures.process = Process()
    for submitted in (5, 9, 12):  # an epoch end, then its pictures handed to the process
        pictures.begin_epoch()
        pictures.process.submitted = submitted
    pictures.begin_epoch()
    assert pictures.process.waits == [(drawing.FINISH_TIMEOUT, k) for k in (0, 0, 5, 9)]
    pictures.process.drawing = False  # a process that hangs: the epoch end goes on after the timeout, and says so
    with pytest.warns(UserWarning, match=r"has not drawn the pictures of an epoch before the last after 120 s \(3 "):
        pictures.begin_epoch()
