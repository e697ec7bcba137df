"""Where an epoch's pictures are drawn: in the monitor's process (a thread then encodes and writes them), or in a
drawing process (:mod:`.draw_worker`), so that the epoch end returns once its pictures are handed off and training
goes on while they are drawn; each is logged at its epoch's step when ready."""

from __future__ import annotations

import os
import pickle
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

import matplotlib
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.tensorboard import SummaryWriter

import attn_callbacks
from attn_callbacks.base.numba_loader import uses_numba
from attn_callbacks.output.draw_worker import FigureJob, FigureJobs
from attn_callbacks.output.figure_cache import FigureCache
from attn_callbacks.output.images import Images
from attn_callbacks.output.writer import BackgroundWriter, add_png, fast_record_checksums, tensorboard_writer

__all__ = ["Drawing", "DrawingProcess", "EpochPictures"]

# Seconds teardown waits for the pictures still being drawn, and then for the process to exit.
FINISH_TIMEOUT = 120.0
EXIT_TIMEOUT = 10.0


class DrawingProcess:
    """A drawing process (``python -m attn_callbacks.output.draw_worker``) and the two threads that feed it jobs and
    hand its PNG bytes to each job's ``deliver``. Its first error (a job's traceback, a failed delivery, the process
    gone) is kept and raised by :meth:`check`."""

    def __init__(self, numba: bool) -> None:
        package_root = str(Path(attn_callbacks.__file__).resolve().parent.parent)
        paths = [package_root, *filter(None, [os.environ.get("PYTHONPATH")])]
        self._process = subprocess.Popen(
            [sys.executable, "-m", "attn_callbacks.output.draw_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)},
        )
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[int, Callable[[bytes, tuple[int, int]], None]] = {}  # by job id, in submission order
        self.submitted = 0  # jobs submitted so far: the next job's id
        self._changed = threading.Condition()
        self._error: str | None = None
        self._closing = False
        self._outbox.put((numba, _changed_rc_params()))
        self._threads = [
            threading.Thread(target=target, name=f"attn_callbacks-drawing-{role}", daemon=True)
            for role, target in (("send", self._send), ("receive", self._receive))
        ]
        for thread in self._threads:
            thread.start()

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def pending(self) -> int:
        return len(self._pending)

    def submit(self, job: FigureJob, deliver: Callable[[bytes, tuple[int, int]], None]) -> None:
        """Send ``job`` to the process (a queue: never waits for it); ``deliver(png, (height, width))`` runs on the
        receiving thread once the picture is back. Raises the process's first error first."""
        self.check()
        with self._changed:
            job_id, self.submitted = self.submitted, self.submitted + 1
            self._pending[job_id] = deliver
        self._outbox.put((job_id, *job))

    def check(self) -> None:
        """Raise the process's first error, once."""
        with self._changed:
            error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"AttentionMonitor: the background drawing process failed:\n{error}")

    def wait(self, timeout: float | None, before: int | None = None) -> bool:
        """Wait until every picture submitted (``before``: of the jobs before that id) is delivered, or the process is
        gone; False when ``timeout`` ran out."""
        limit = self.submitted if before is None else before

        def done() -> bool:
            return next(iter(self._pending), limit) >= limit or self._error is not None

        with self._changed:
            return self._changed.wait_for(done, timeout)

    def stop(self, timeout: float | None = FINISH_TIMEOUT) -> int:
        """Wait for the pictures still pending (``timeout`` seconds at most; None: not at all), then stop the
        process (killed when it does not exit in time) and its threads; returns how many pictures were dropped."""
        finished = timeout is not None and self.wait(timeout)
        with self._changed:
            self._closing = True
            dropped = 0 if finished else len(self._pending)
        self._outbox.put(None)  # end of input: the process exits after its current job
        if not finished:
            self._process.kill()
        try:
            self._process.wait(EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        for thread in self._threads:
            thread.join(EXIT_TIMEOUT)
        return dropped

    def _send(self) -> None:
        stdin = self._process.stdin
        try:
            while (message := self._outbox.get()) is not None:
                pickle.dump(message, stdin, protocol=pickle.HIGHEST_PROTOCOL)
                stdin.flush()
        except OSError:
            pass  # the process is gone (a broken pipe): the receiving thread says so
        finally:
            with suppress(OSError):
                stdin.close()

    def _receive(self) -> None:
        stdout = self._process.stdout
        while True:
            try:
                job_id, png, size, error = pickle.load(stdout)
            except (EOFError, OSError, pickle.UnpicklingError):
                break
            with self._changed:
                deliver = self._pending.get(job_id)
            if error is None and deliver is not None:
                try:
                    deliver(png, size)
                except Exception as err:
                    error = f"writing the picture failed: {err!r}"
            self._settle(job_id, error)
        with self._changed:
            if not self._closing:
                code = self._process.wait()
                self._fail(
                    f"the process (pid {self._process.pid}) exited with code {code} with {len(self._pending)} "
                    "picture(s) not drawn; they are lost."
                )
            self._pending.clear()
            self._changed.notify_all()

    def _settle(self, job_id: int, error: str | None) -> None:
        with self._changed:
            self._pending.pop(job_id, None)
            if error is not None:
                self._fail(error)
            self._changed.notify_all()

    def _fail(self, error: str) -> None:
        if self._error is None:
            self._error = error


class EpochPictures:
    """What the drawing process returns of one epoch end: held until the epoch end succeeds (:meth:`release`), then
    written, as is every picture returned after; dropped when it fails (:meth:`drop`), as the other writes of a failed
    epoch end are. Deliveries come from the receiving thread, the release and the drop from the monitor's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[Callable[[], Any]] | None = []  # None once released
        self._dropped = False

    def deliver(self, write: Callable[[], Any]) -> None:
        with self._lock:
            if self._dropped:
                return
            if self._held is not None:
                self._held.append(write)
                return
        write()

    def release(self) -> None:
        with self._lock:
            held, self._held = self._held or [], None
        for write in held:
            write()

    def drop(self) -> None:
        """Drop the pictures of an epoch end never released (a no-op once it was)."""
        with self._lock:
            if self._held is not None:
                self._held, self._dropped = [], True


class Drawing:
    """Hands each picture of an epoch end on: to the writer thread of this process (``background``), or, once
    :meth:`start` has started one, as a job to the drawing process, ``images`` then recording jobs instead of
    drawing. The process is this Trainer stage's (``setup`` to ``teardown``), global rank 0's, with a TensorBoard
    ``SummaryWriter`` only."""

    def __init__(self, images: Images, background: BackgroundWriter) -> None:
        self.images, self.background = images, background
        self.process: DrawingProcess | None = None
        self._checksums = ExitStack()
        self._epoch = EpochPictures()
        self._epoch_start = 0  # the drawing process's first job of the last epoch end

    def __getstate__(self) -> dict[str, Any]:
        return {"images": self.images, "background": self.background}  # the process is the stage's

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["images"], state["background"])

    def start(self, trainer: Trainer, enabled: bool | None) -> None:
        """Start the drawing process when ``enabled`` (None: when the Trainer's device is not the CPU, whose cores the
        process would take from training) on global rank 0, writing to a TensorBoard ``SummaryWriter``."""
        self.stop(abort=True)  # a stage whose teardown never ran
        if enabled is None:
            enabled = trainer.strategy.root_device.type != "cpu"
        if not enabled or not trainer.is_global_zero:
            return
        writer = tensorboard_writer(trainer)
        if not isinstance(writer, SummaryWriter):
            return
        self.process, self._epoch_start = DrawingProcess(numba=uses_numba("cpu")), 0
        self.images.figures = FigureJobs()
        self._checksums.enter_context(fast_record_checksums(writer))  # the pictures are written after the epoch end

    def begin_epoch(self) -> None:
        """Start an epoch end: the pictures the process returns from now on are written once it succeeds (when the
        background writer makes its held writes), never if it fails. With a drawing process, first wait for the
        pictures of the epoch ends before the last: they may fall one epoch behind, not more (epochs shorter than their
        drawing would pile up pictures, and the process's memory, without end); ``FINISH_TIMEOUT`` at most, then on
        with a warning (a process that hangs must not stop training)."""
        if self.process is not None:
            if not self.process.wait(FINISH_TIMEOUT, before=self._epoch_start):
                rank_zero_warn(
                    f"AttentionMonitor: the background drawing process has not drawn the pictures of an epoch before "
                    f"the last after {FINISH_TIMEOUT:.0f} s ({self.process.pending} waiting); training goes on, and "
                    "they are logged when drawn (teardown waits for them once more, then drops what is left)."
                )
            self._epoch_start = self.process.submitted
        self._epoch.drop()
        self._epoch = EpochPictures()
        self.background.later(self._epoch.release)

    def image(self, writer: Any, tag: str, image: Any, step: int) -> None:
        """Log ``image`` (an RGB(A) array, or the job that draws it) under ``tag`` at ``step``."""
        if self.process is None:
            self.background.image(writer, tag, image, step)
        else:
            epoch = self._epoch
            self.process.submit(image, lambda png, size: epoch.deliver(lambda: add_png(writer, tag, png, size, step)))

    def drop_epoch(self) -> None:
        """Drop the pictures of a failed epoch end (a no-op after one that succeeded)."""
        self._epoch.drop()

    def check(self) -> None:
        """Raise the drawing process's first error (its traceback in the message), once."""
        if self.process is not None:
            self.process.check()

    def stop(self, abort: bool = False) -> None:
        """Stop the drawing process, if one runs: after its pending pictures are written (``FINISH_TIMEOUT`` at
        most; a warning says how many were dropped past it), and then raise its error; with ``abort``, at once,
        dropping the pictures and errors (the fit already failed)."""
        process, self.process = self.process, None
        if process is None:
            return
        self.images.figures = FigureCache()
        try:
            dropped = process.stop(None if abort else FINISH_TIMEOUT)
        finally:
            self._checksums.close()
        if abort:
            return
        process.check()
        if dropped:
            rank_zero_warn(
                f"AttentionMonitor: the background drawing process had not drawn {dropped} picture(s) after "
                f"{FINISH_TIMEOUT:.0f} s at teardown; it was stopped and they are not logged."
            )


def _changed_rc_params() -> dict[str, Any]:
    """Matplotlib settings of this process that differ from the defaults (and pickle): the drawing process uses them
    too, so that its pictures are this process's."""
    changed = {}
    for key in matplotlib.rcParams:  # keys first: reading "backend" may resolve (and import) one
        if key == "backend" or key not in matplotlib.rcParamsDefault:
            continue
        try:
            value = matplotlib.rcParams[key]
            if value == matplotlib.rcParamsDefault[key]:
                continue
            pickle.dumps(value)
        except Exception:
            continue
        changed[key] = value
    return changed
