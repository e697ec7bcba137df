"""The drawing process: renders the epoch's figures and PNG-encodes them, away from the training loop's process.

``python -m attn_callbacks.output.draw_worker`` reads jobs from its stdin and writes replies to its stdout, each a
pickle: first ``(numba, rc)``, then ``(job, method, args, kwargs)`` per picture, a :class:`FigureCache` method and
its arguments (numpy arrays, labels, titles, colour limits: all computed by the monitor's process); it replies
``(job, png, (height, width), None)``, or ``(job, None, None, traceback)`` when drawing failed; end of input stops it.
This module and what it imports need numpy and matplotlib (and numba for the PNG filter, when told), never torch or
Lightning: a fresh interpreter, not a ``multiprocessing`` child, which would import the parent's ``__main__`` (a
training script, torch and all, or one without a main guard run again)."""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from typing import Any, BinaryIO, NamedTuple

__all__ = ["FigureJob", "FigureJobs", "serve"]

# The FigureCache methods a job may call.
METHODS = ("heatmap", "head_grid", "value_grid")


class FigureJob(NamedTuple):
    """One picture to draw: a :class:`~attn_callbacks.output.figure_cache.FigureCache` method and its arguments."""

    method: str
    args: tuple
    kwargs: dict[str, Any]


class FigureJobs:
    """:class:`~attn_callbacks.output.figure_cache.FigureCache`'s drawing methods, recorded instead of run: each call
    returns the :class:`FigureJob` the drawing process runs."""

    def __getattr__(self, method: str) -> Any:
        if method not in METHODS:
            raise AttributeError(method)
        return lambda *args, **kwargs: FigureJob(method, args, kwargs)


def serve(jobs: BinaryIO, replies: BinaryIO) -> None:
    """Draw every job read from ``jobs`` until its end, each reply written to ``replies`` as soon as it is ready."""
    import matplotlib

    from attn_callbacks.output.figure_cache import FigureCache
    from attn_callbacks.output.png import encode_png

    numba, rc = pickle.load(jobs)
    matplotlib.rcParams.update(rc)  # the monitor's process's settings, which its own drawings would use
    figures = FigureCache()
    while True:
        try:
            job, method, args, kwargs = pickle.load(jobs)
        except EOFError:
            return
        try:
            image = getattr(figures, method)(*args, **kwargs)
            reply = (job, encode_png(image, numba=numba), image.shape[:2], None)
        except Exception:
            reply = (job, None, None, traceback.format_exc())
        pickle.dump(reply, replies, protocol=pickle.HIGHEST_PROTOCOL)
        replies.flush()


def main() -> None:
    replies = os.fdopen(os.dup(1), "wb")  # stdout carries replies only: anything printed goes to stderr
    os.dup2(2, 1)
    serve(sys.stdin.buffer, replies)


if __name__ == "__main__":
    main()
