"""Attention written by hand: the softmax a module takes over the scores ``q @ kᵀ`` made, read as it is.

Modules found by a softmax and a matrix product in their code (:func:`attn_callbacks.capture.sdpa.computes_attention`)
are watched by :class:`attn_callbacks.capture.sdpa.SdpaWatch`, which hands each op they run to a
:class:`HandReader` (one per watch, that is per batch). The reader follows the scores from the product that made them
to the softmax, tells them from a router's or an output head's logits, and hands the softmax's output on as the
weights the module applies, with the keys its input's mask allows. Nothing is recomputed. A decoder run step by step
(Bahdanau's or Luong's attention in an RNN decoder) attends one query position per call: its steps are gathered
over the batch and handed on as one call where they make the query stream's length.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from attn_callbacks.base.tensor_ops import float_mask_allows
from attn_callbacks.capture.sdpa import (
    ChunkConsumer,
    call_site,
    calls_sdpa,
    computes_attention,
    declared_heads,
    next_call,
)

__all__ = ["ByHand", "HandReader"]

#: The softmax functions a module computing attention by hand may call (``nn.Softmax`` calls the second).
_SOFTMAX = frozenset({torch.softmax, F.softmax, torch.Tensor.softmax, torch.special.softmax})

#: Ops that move a tensor's axes: scores laid out otherwise (:func:`_einsum_query_axis`) lose their layout there.
_MOVES_AXES = frozenset(
    {"permute", "transpose", "swapaxes", "swapdims", "movedim", "moveaxis", "t", "adjoint", "__get__"}
)

#: The matrix products that make attention scores, each with the operands of its arguments.
_PRODUCT_OPERANDS: dict[Any, Callable[[tuple], Iterable[Any]]] = {
    **dict.fromkeys(
        (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm),
        lambda args: args[:2],
    ),
    **dict.fromkeys((torch.baddbmm, torch.Tensor.baddbmm), lambda args: args[1:3]),
    torch.einsum: lambda args: args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:],
}


@dataclasses.dataclass
class ByHand:
    """What the watches of one capture share about its modules computing attention by hand (:func:`computes_attention`).

    Attributes:
        names: those modules.
        hand_only: those of them whose code calls no ``scaled_dot_product_attention``: one that read nothing is not
            attention (a router, a pooling, an output head), unless it took a softmax over its keys it could not read.
        expect: ``(site name, device)`` -> ``(B, Lq, Lk)``, the batch size and the query and key lengths of the
            site's token streams in the current batch (None: not known; outside Lightning).
        unread: module -> the shape of a softmax over its keys that was not read, and the expected ``(B, Lq, Lk)``:
            over scores that do not fit ``expect`` (a decoder loop's steps that do not make its query stream: their
            shape together), or over as many entries as the keys that came neither from scores nor from logits.
    """

    names: frozenset[str]
    hand_only: frozenset[str] = frozenset()
    expect: Callable[[str, torch.device], tuple[int, int, int] | None] | None = None
    unread: dict[str, tuple[tuple[int, ...], tuple[int, int, int]]] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(
        cls,
        watched: Mapping[str, nn.Module],
        expect: Callable[[str, torch.device], tuple[int, int, int] | None] | None = None,
        declared: Container[str] = (),
    ) -> ByHand:
        """The watched modules that compute attention by hand, and those of them that call no SDPA. Hugging Face
        attention modules ``declared`` in their model's ``_can_record_outputs`` are read their own ways; the other
        ``transformers`` modules watched lie in models that declare none (:func:`attn_callbacks.capture.find`)."""
        names = frozenset(
            name for name, module in watched.items() if computes_attention(module, undeclared=name not in declared)
        )
        return cls(names, frozenset(name for name in names if not calls_sdpa(watched[name])), expect)

    def reader(self, consumer: ChunkConsumer, calls: dict[str, int]) -> HandReader:
        """A reader for one watch, numbering reads in ``calls`` (the watch's calls per module) with its SDPA calls."""
        return HandReader(self, consumer, calls)


class HandReader:
    """One watch's reading of the modules computing attention by hand: every op they run passes :meth:`see`.

    Args:
        by_hand: the modules, and what the watches share about them.
        consumer: as :class:`attn_callbacks.capture.sdpa.SdpaWatch`'s.
        calls: calls per module in this watch, shared with its SDPA calls, so that a module's calls are numbered in
            one sequence.
    """

    def __init__(self, by_hand: ByHand, consumer: ChunkConsumer, calls: dict[str, int]) -> None:
        self.by_hand = by_hand
        self.names = by_hand.names
        self.consumer = consumer
        self.calls = calls
        # Their tensors (by id, with a weak reference to tell a reused id, dropped when the tensor is freed): the
        # scores, made by a product of two batched tensors or from scores by any other op; the logits of a weight
        # matrix (x @ W, a Linear); the outputs of their softmaxes.
        self.scores: dict[int, weakref.ref] = {}
        self.logits: dict[int, weakref.ref] = {}
        self.weights: dict[int, weakref.ref] = {}
        # Scores whose queries are not their next-to-last axis (einsum "bqhd,bkhd->bqhk"): that axis, by id.
        self.query_axis: dict[int, int] = {}
        # Scores that a product of two batched tensors made (not a one-output Linear): a 2-D softmax over them,
        # (B, Lk), is one query's (Luong's bmm(keys, query)), not a pooling's. By id.
        self.paired: dict[int, None] = {}
        # A decoder loop's steps in this batch, per module: the module, the loop's call index (taken at its first
        # step, so that calls keep the order they ran in) and the site's (B, Lq, Lk); each step's weights (B, H, 1, Lk)
        # (a copy: the model may change its own in place later) and the keys allowed (B, 1, Lk).
        self.steps: dict[str, tuple[nn.Module, int, tuple[int, int, int], list[tuple[Tensor, Tensor]]]] = {}

    def see(
        self,
        name: str,
        module: nn.Module,
        func: Any,
        owners: Iterator[Any],
        args: tuple,
        kwargs: dict,
        output: Any,
    ) -> None:
        """One op ``func(*args, **kwargs) -> output`` that module ``name`` ran (``owners``: the ``self`` of each method
        on its stack, innermost first)."""
        if func in _SOFTMAX:
            self._read_softmax(name, module, owners, args, kwargs, output)
        else:
            self._trace(func, args, kwargs, output)

    def _trace(self, func: Any, args: tuple, kwargs: dict, output: Any) -> None:
        """Follow attention scores through a by-hand module: a product of two batched tensors (``q @ kᵀ``: both at
        least 3-D) makes them, and so does a ``Linear`` or a product with one output (additive attention's
        ``vᵀ tanh(W q + U k)``); any other op keeps them (scaling, masking, a bias added in place or not, a cast, a
        reshape, heads mixed by a matrix); a product with a weight matrix (``x @ W``) or a ``Linear`` of anything
        else makes logits (a router's, an output head's); a product with the weights (``w @ v``) makes neither."""
        if not isinstance(output, Tensor):
            return
        inputs = list(_PRODUCT_OPERANDS[func](args)) if func in _PRODUCT_OPERANDS else list(_tensors(args, kwargs))
        if any(_kept(self.weights, t) for t in inputs):
            return
        made = next((t for t in inputs if _kept(self.scores, t)), None)
        axis, paired = None, False  # where the queries of scores laid out otherwise lie; made by q @ kᵀ
        if made is not None:
            if made.size(-1) == 1 < output.size(-1) and output.numel() > made.numel():
                return  # a one-output gate broadcast over the hidden states' last axis: not scores
            kind, paired = self.scores, id(made) in self.paired
            if output.shape == made.shape and getattr(func, "__name__", None) not in _MOVES_AXES:  # scaled, masked
                axis = self.query_axis.get(id(made))
        elif func in _PRODUCT_OPERANDS:
            paired = all(isinstance(t, Tensor) and t.dim() >= 3 for t in inputs)
            kind = self.scores if paired or _one_output(inputs, func, args[0] if args else None) else self.logits
        elif func is F.linear:
            kind = (
                self.scores if _one_output([args[1] if len(args) > 1 else kwargs.get("weight")], func) else self.logits
            )
        else:
            return
        (self.logits if kind is self.scores else self.scores).pop(id(output), None)  # an in-place op changed it
        if func is torch.einsum and kind is self.scores and made is None:
            axis = _einsum_query_axis(args[0])
        self.query_axis.pop(id(output), None)
        self.paired.pop(id(output), None)
        _keep(kind, output, self.query_axis, self.paired)
        if axis is not None:
            self.query_axis[id(output)] = axis
        if paired and kind is self.scores:
            self.paired[id(output)] = None

    def _read_softmax(
        self, name: str, module: nn.Module, owners: Iterator[Any], args: tuple, kwargs: dict, weights: Any
    ) -> None:
        """A softmax of a module computing attention by hand, read where it is one over the last dimension of scores
        (:meth:`_trace`), ``(B, H, Lq, Lk)``, or ``(B, Lq, Lk)`` (``(B · H, Lq, Lk)``, batch-major): its output is the
        weights the module applies, and its input the scores, whose masked keys (``-inf``, ``-1e9`` …) the float-mask
        rule reads (:func:`~attn_callbacks.base.tensor_ops.float_mask_allows`). One over a single query position,
        ``(B, [H,] 1, Lk)`` (or ``(B, Lk)`` that a product of two batched tensors made), where the site has more, is
        a decoder loop's step: kept for :meth:`finish`. Other softmaxes are not attention (a router's, a pooling's).
        One over scores that do not fit the site's tokens, or one over as many entries as the keys that came neither
        from scores nor from logits, is noted, not read."""
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        scores = args[0] if args else kwargs.get("input")
        if not isinstance(weights, Tensor) or not isinstance(dim, int) or weights.dim() < 2:
            return
        _keep(self.weights, weights)
        if dim % weights.dim() != weights.dim() - 1 or _kept(self.logits, scores):
            return
        site = call_site(name, self.calls.get(name, 0))
        expected = self.by_hand.expect(site, weights.device) if self.by_hand.expect is not None else None
        made = _kept(self.scores, scores)
        if made and id(scores) in self.query_axis:  # (B, Lq, H, Lk) -> (B, H, Lq, Lk)
            weights, scores = (t.movedim(self.query_axis[id(scores)], -2) for t in (weights, scores))
        if made and weights.dim() == 2 and id(scores) in self.paired:  # (B, Lk): one query's, a decoder's step
            weights, scores = weights.unsqueeze(1), scores.unsqueeze(1)
        heads = _heads(expected, owners, weights) if made and weights.dim() >= 3 else None
        step, loop = None, self.steps.get(name)
        fit = loop[2] if loop is not None else expected  # the tokens of the loop under way, or of this call's site
        if heads is None and made and fit is not None and fit[1] > 1 and weights.dim() >= 3:
            step = _heads((fit[0], 1, fit[2]), owners, weights)  # one query position, (B, [H,] 1, Lk): a step
            if weights.dim() == 3 and step != 1:
                step = None  # (B · k, 1, Lk) could be beams as well as heads: not split
        if heads is None and step is None:
            if expected is not None and weights.dim() >= 3 and (made or weights.size(-1) == expected[2]):
                self.by_hand.unread.setdefault(name, (tuple(weights.shape), expected))
            return
        with torch.no_grad():
            # (B, H, Lq, Lk), also from (B · H, Lq, Lk) or (B, Hk, G, Lq, Lk) (grouped-query heads in query order)
            weights = weights.detach().reshape(-1, heads or step, *weights.shape[-2:])
            # Over the heads' largest scores: one pass over the scores, not three (the masked keys are the same
            # unless two heads' rows lie more than BIAS_SPAN apart).
            allowed = float_mask_allows(scores.detach().reshape(weights.shape).amax(dim=1))  # (B, Lq, Lk)
            if step is not None:
                if loop is None:
                    loop = self.steps[name] = (module, next_call(self.calls, name), fit, [])
                loop[3].append((weights.clone(), allowed))
                return
            batch = weights.size(0)
            self.consumer(name, next_call(self.calls, name), module, weights, slice(0, batch), batch, allowed)

    def finish(self) -> None:
        """The batch's model has run: a decoder loop's steps that make its query stream's length, all of one shape,
        are read as one call, step ``t`` as query position ``t``; others (a loop of another length, two loops, a
        module shared by two layers of the loop, rows that change as a beam search's do) are noted, not read."""
        steps, self.steps = self.steps, {}
        for name, (module, index, expected, kept) in steps.items():
            weights = kept[0][0]
            if len(kept) != expected[1] or any(w.shape != weights.shape for w, _ in kept):
                shape = (weights.size(0), weights.size(1), len(kept), weights.size(-1))
                self.by_hand.unread.setdefault(name, (shape, expected))
                continue
            # (B, H, Lq, Lk) and (B, Lq, Lk)
            weights, allowed = torch.cat([w for w, _ in kept], dim=-2), torch.cat([a for _, a in kept], dim=-2)
            batch = weights.size(0)
            self.consumer(name, index, module, weights, slice(0, batch), batch, allowed)


def _heads(expected: tuple[int, int, int] | None, owners: Iterator[Any], weights: Tensor) -> int | None:
    """The heads of by-hand weights ``(B, H, Lq, Lk)``, ``(B, H1, H2 …, Lq, Lk)`` (``H1 · H2 …`` heads) or
    ``(B · H, Lq, Lk)``, from the site's tokens ``expected`` ``(B, Lq, Lk)`` where known (else from a ``num_heads`` …
    of the module or of a module calling it, among ``owners``, else 1); None where the weights do not fit them."""
    if expected is None:
        if weights.dim() >= 4:
            return math.prod(weights.shape[1:-2])
        declared = (declared_heads(o) for o in owners if isinstance(o, nn.Module))
        heads = next((h for h in declared if h is not None), 1)
        return heads if weights.size(0) % heads == 0 else 1
    batch, len_q, len_k = expected
    if tuple(weights.shape[-2:]) != (len_q, len_k):
        return None
    if weights.dim() >= 4:
        return math.prod(weights.shape[1:-2]) if weights.size(0) == batch else None
    return weights.size(0) // batch if batch and weights.size(0) % batch == 0 else None


def _one_output(operands: list[Any], func: Any, equation: Any = None) -> bool:
    """Whether a product's or a ``Linear``'s weight (the last of ``operands``) has one output (a vector ``v``,
    ``(D, 1)``; ``Linear(D, 1)``: ``(1, D)``; for an ``einsum``, a vector whose index ``equation`` sums over): it
    scores each position, as additive attention's ``vᵀ tanh(W q + U k)`` does."""
    if func is torch.einsum:
        if not isinstance(equation, str) or "->" not in equation:
            return False
        subscripts, output = equation.replace(" ", "").split("->")
        return any(
            isinstance(t, Tensor) and t.dim() == 1 and letters not in output
            for t, letters in zip(operands, subscripts.split(","), strict=False)
        )
    weight = operands[-1] if operands else None
    if not isinstance(weight, Tensor):
        return False
    return weight.dim() == 1 or (weight.dim() == 2 and weight.size(0 if func is F.linear else 1) == 1)


def _einsum_query_axis(equation: Any) -> int | None:
    """The axis of the queries in the output of scores made by ``einsum(equation, q, k)``, counted from the end, where
    it is not the next-to-last (``"bqhd,bkhd->bqhk"``: -3) while the keys are last; None otherwise. Queries: the
    output's letter that only ``q`` has; keys: the one that only ``k`` has."""
    if not isinstance(equation, str) or "->" not in equation:
        return None
    operands, output = equation.replace(" ", "").replace("...", "").split("->")
    first, _, second = operands.partition(",")
    queries = [c for c in output if c in first and c not in second]
    keys = [c for c in output if c in second and c not in first]
    if len(queries) != 1 or keys != [output[-1:]] or output[-2:-1] == queries[0]:
        return None
    return output.index(queries[0]) - len(output)


def _keep(kept: dict[int, weakref.ref], tensor: Tensor, *also: dict[int, Any]) -> None:
    """Keep ``tensor`` in ``kept`` by its id until it is freed (a long ``capture_attention`` block frees many), and
    then drop what ``also`` holds under that id."""
    key = id(tensor)

    def freed(_: Any, key: int = key) -> None:
        kept.pop(key, None)
        for other in also:
            other.pop(key, None)

    kept[key] = weakref.ref(tensor, freed)


def _kept(kept: Mapping[int, weakref.ref], tensor: Any) -> bool:
    """Whether ``tensor`` itself is in ``kept`` (an id of a tensor since freed may be another's now)."""
    ref = kept.get(id(tensor))
    return ref is not None and ref() is tensor


def _tensors(args: tuple, kwargs: Mapping[str, Any]) -> Iterator[Any]:
    """The arguments of a call, those in a list or tuple argument included (``torch.cat``, ``torch.where``)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value
