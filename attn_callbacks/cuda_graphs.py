"""The per-batch step on a GPU, replayed as a CUDA graph: one launch per module and batch instead of ~40.

On a GPU the torch step (:func:`attn_callbacks.kernels.accumulate_attention_torch`) issues ~40 small ops from
Python: 0.65 ms of host time for a BERT-base step whose kernels take ~0.5 ms. A step whose shapes recur is captured
once per (state, shapes) and then replayed (0.05 ms of host time): the batch's inputs are copied into static buffers
that the graph reads, and the graph adds to the state tensors in place. A (state, shapes) pair is captured the second
time it is seen, in any epoch, at most :data:`MAX_GRAPHS_PER_STATE` shapes per state, on the one stream per device
that ran the first capture; anything else runs eagerly, with the same result. Graphs are dropped once their state
is gone (looked for before each capture and at every epoch end: :func:`forget_dead`).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Sequence

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

__all__ = [
    "GRAPH_SWITCH",
    "MAX_GRAPHS_PER_STATE",
    "MAX_GRAPH_ELEMENTS",
    "forget_dead",
    "graph_status",
    "graphed",
    "graphs_apply",
]

#: Set to ``0`` to run the GPU step eagerly, op by op (read at every call).
GRAPH_SWITCH = "ATTN_CALLBACKS_CUDA_GRAPHS"
#: Steps whose first input holds more elements run eagerly: they are not launch-bound, and a graph's static copy of
#: the weights would cost their size again in device memory (2**24 float32 weights: 64 MB).
MAX_GRAPH_ELEMENTS = 1 << 24
#: Distinct input shapes captured per state; others run eagerly (validation batches of varying length).
MAX_GRAPHS_PER_STATE = 4
# Keys of (state, shapes) seen once, not yet captured: forgotten past this many (lengths that never repeat).
_MAX_SEEN = 1024

_Signature = tuple  # the inputs' shapes and dtypes, and the device


class _Inputs:
    """Static copies of one signature's inputs, shared by every state's graph of that signature: replays run one
    at a time on one stream, each after copying its own inputs in."""

    def __init__(self, inputs: Sequence[Tensor]) -> None:
        with torch.inference_mode(False):
            self.tensors = tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in inputs)

    def load(self, inputs: Sequence[Tensor]) -> None:
        for static, tensor in zip(self.tensors, inputs, strict=True):
            static.copy_(tensor)


class _Graph:
    """One captured step: the graph, the static inputs it reads, its output, and weak references to the state it
    writes (replayed only while that very state is alive: a new tensor at a freed one's address is not it)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: _Inputs, output: Tensor, state: Sequence[Tensor]) -> None:
        self.graph = graph
        self.inputs = inputs
        self.output = output
        self.state = tuple(weakref.ref(t) for t in state)

    @property
    def device(self) -> torch.device:
        return self.inputs.tensors[0].device

    def writes(self, state: Sequence[Tensor]) -> bool:
        return all(ref() is tensor for ref, tensor in zip(self.state, state, strict=True))


class _Cache:
    """Every graph of the process, the input buffers they share, and the capture stream per device."""

    def __init__(self) -> None:
        self.graphs: dict[tuple, _Graph] = {}  # (state addresses, signature) -> graph
        self.seen: dict[tuple, int] = {}  # (state addresses, signature) -> times seen without a graph
        self.inputs: weakref.WeakValueDictionary[_Signature, _Inputs] = weakref.WeakValueDictionary()
        self.streams: dict[torch.device, torch.cuda.Stream] = {}  # the side stream that captures, per device
        self.home: dict[torch.device, torch.cuda.Stream] = {}  # the stream that replays, per device
        self.failure: str | None = None  # why a capture failed: op by op from then on (warned once)
        self.failed: list[torch.cuda.CUDAGraph] = []  # kept: the allocator may still refer to a failed capture


_CACHE = _Cache()


def graphs_apply(first: Tensor) -> bool:
    """Whether a step whose first input is ``first`` may run as a CUDA graph: a CUDA tensor of at most
    :data:`MAX_GRAPH_ELEMENTS`, graphs not switched off (``ATTN_CALLBACKS_CUDA_GRAPHS=0``) nor failed before, no
    deterministic algorithms asked for, and no capture of the caller's own under way."""
    return (
        first.is_cuda
        and first.numel() <= MAX_GRAPH_ELEMENTS
        and _CACHE.failure is None
        and os.environ.get(GRAPH_SWITCH, "").strip() != "0"
        and not torch.are_deterministic_algorithms_enabled()
        and not _capturing(first.device)
    )


def _capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` (not of the current device: model parallel) is being captured."""
    if device.index is None or device.index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def graphed(
    step: Callable[..., Tensor], state: Sequence[Tensor], inputs: Sequence[Tensor], constants: tuple = ()
) -> Tensor | None:
    """``step(*state, *inputs)`` as a replay of a CUDA graph, where one is captured or due; None where the caller must
    run ``step`` itself (the first time a (state, shapes) pair is seen, or past the limits). ``constants`` are the
    Python values ``step`` is specialised on: a graph is kept per (state, shapes, constants).

    ``step`` must add to ``state`` in place, depend on nothing but its arguments' values and shapes, never sync with
    the host, call no cuBLAS routine (a graph holding one reads a per-stream workspace that torch frees when another
    graph captured on the stream is destroyed: pytorch/pytorch#193402), and return one tensor, which is returned here
    as a copy. Call only where :func:`graphs_apply` holds.
    """
    device = inputs[0].device
    if _CACHE.home.setdefault(device, torch.cuda.current_stream(device)) != torch.cuda.current_stream(device):
        return None  # replays on two streams could overlap in the shared inputs and scratch memory
    signature = (device, *((tuple(t.shape), t.dtype) for t in inputs))
    key = (tuple(t.data_ptr() for t in state), signature, constants)
    found = _CACHE.graphs.get(key)
    if found is not None and not found.writes(state):  # the state it wrote was freed and its address reused
        forget_dead()
        if key in _CACHE.graphs:  # another tensor over the same memory: not the state the graph was made for
            _drop([key])
        found = None
    if found is None:
        times = _CACHE.seen.get(key, 0) + 1
        per_state = sum(1 for other, graph in _CACHE.graphs.items() if other[0] == key[0] and graph.writes(state))
        if times < 2 or per_state >= MAX_GRAPHS_PER_STATE:
            if len(_CACHE.seen) >= _MAX_SEEN:
                _CACHE.seen.clear()
            _CACHE.seen[key] = times
            return None
        _CACHE.seen.pop(key, None)
        forget_dead()
        found = _capture(step, state, inputs, signature)
        if found is None:
            return None
        _CACHE.graphs[key] = found
    found.inputs.load(inputs)
    found.graph.replay()
    return found.output.clone()


def forget_dead() -> None:
    """Drop the graphs of states that no longer exist (a finished monitor's), with the memory they hold: their share
    of the scratch pool (~4 times the weights of one step) and static inputs (once the weights' size)."""
    _drop([key for key, graph in _CACHE.graphs.items() if any(ref() is None for ref in graph.state)])


def _drop(keys: list[tuple]) -> None:
    """Destroy these graphs once the device has finished their last replays."""
    if keys:
        for device in {_CACHE.graphs[key].device for key in keys}:
            torch.cuda.synchronize(device)
        for key in keys:
            del _CACHE.graphs[key]


def _capture(
    step: Callable[..., Tensor], state: Sequence[Tensor], inputs: Sequence[Tensor], signature: _Signature
) -> _Graph | None:
    """Capture ``step`` on a side stream (the default stream cannot be captured) into the device's shared pool:
    replays never overlap, so every graph's scratch memory can be the same. Nothing runs while capturing."""
    device = inputs[0].device
    static = _CACHE.inputs.get(signature)
    if static is None:
        static = _Inputs(inputs)
        _CACHE.inputs[signature] = static
    stream = _CACHE.streams.get(device)
    if stream is None:
        stream = _CACHE.streams[device] = torch.cuda.Stream(device)
    # Share the pool of a graph alive on this device. A pool lives only while a graph captured into it does: a
    # handle whose graphs are all gone cannot be captured into again (an internal assert of the caching allocator).
    pool = next((g.graph.pool() for g in _CACHE.graphs.values() if g.device == device), None)
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream(device)
    stream.wait_stream(current)
    failure: BaseException | None = None
    try:
        with torch.cuda.stream(stream):
            # thread_local: another thread's CUDA calls (a loader pinning memory) must not break this capture.
            graph.capture_begin(pool=pool or torch.cuda.graph_pool_handle(), capture_error_mode="thread_local")
            try:
                output = step(*state, *static.tensors)
            except BaseException as error:  # the cause; the capture must end all the same
                failure = error
            try:
                graph.capture_end()
            except RuntimeError as error:  # a broken capture raises an error of its own
                failure = failure or error
                _stop_allocating_to_pool(device, graph)
    except RuntimeError as error:  # capture_begin
        failure = error
    finally:
        current.wait_stream(stream)
    if failure is not None and not isinstance(failure, RuntimeError):
        _CACHE.failed.append(graph)
        raise failure  # the step's own error (bad shapes, an interrupt), as op by op
    if failure is not None:
        _CACHE.failure = str(failure).strip()
        _CACHE.failed.append(graph)
        rank_zero_warn(
            f"attn_callbacks: capturing the per-batch step as a CUDA graph failed ({_CACHE.failure}); running it op "
            f"by op from now on. Set {GRAPH_SWITCH}=0 to choose that and silence this warning."
        )
        return None
    return _Graph(graph, static, output, state)


def _stop_allocating_to_pool(device: torch.device, graph: torch.cuda.CUDAGraph) -> None:
    """After a capture that could not end: torch ends it before telling its allocator, which then keeps sending the
    capture stream's allocations to the graph's pool (and stops freeing cached memory); tell it, through torch's
    private hook where there is one (nothing to do where the capture ended the allocation itself)."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is not None:
        with contextlib.suppress(RuntimeError):  # "not currently recording": the capture's own end did it
            end(device.index, graph.pool())


def graph_status() -> str:
    """One line for benchmarks and bug reports: graphs held, and why capturing stopped, if it did."""
    held = len(_CACHE.graphs)
    return f"CUDA graphs: {held} held" + (f"; capturing failed: {_CACHE.failure}" if _CACHE.failure else "")
