"""Attention computed by ``torch.nn.functional.scaled_dot_product_attention``, which never returns its weights.

While a monitored batch runs, a ``TorchFunctionMode`` sees every call of the function (however it was imported),
passes it through untouched, and recomputes the weights from the call's own arguments exactly as PyTorch defines
them::

    w = softmax(q @ k.transpose(-2, -1) * scale + bias)      # (..., Hq, Lq, Lk)

with ``scale = 1 / sqrt(E)`` unless given, ``bias`` 0 where a boolean ``attn_mask`` is True and ``-inf`` where it is
False, the float ``attn_mask`` itself otherwise, ``-inf`` above the diagonal of ``tril(ones(Lq, Lk))`` (top-left
aligned) for ``is_causal=True``, and key heads repeated ``Hq / Hk`` times for ``enable_gqa=True``. Dropout is
ignored, and a call with ``dropout_p > 0`` warned about once per module.
``attn_mask`` may also be one of PyTorch's ``CausalBias`` masks (``causal_upper_left`` / ``causal_lower_right``).
The weights are computed in float32 (float64 for float64 inputs), a few samples at a time so memory stays bounded.

A call belongs to the innermost watched module whose method made it (the frames of the call are walked up to it):
modules whose code calls the function (:func:`calls_sdpa`), and Hugging Face attention modules run with
``attn_implementation="sdpa"``, whose calls go through ``transformers``' own helpers. The monitor enters the mode only
while a watched module's forward runs (:class:`attn_callbacks.capture.hooks.AttentionCapture`), so the rest of the
model's ops never pass through it. Calls are numbered per module from the watch's making on (one watch per batch), so
that a module calling it several times per batch can name them apart.

The same watch hands the ops of modules computing attention by hand (:func:`computes_attention`: a softmax and a
matrix product in a module's code, as minGPT writes it) to :mod:`attn_callbacks.capture.by_hand`, which reads their
softmax.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import inspect
import math
import sys
import types
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.attention.bias import CausalBias
from torch.overrides import TorchFunctionMode

from attn_callbacks.capture.frames import method_owners
from attn_callbacks.capture.masks import sdpa_allowed

if TYPE_CHECKING:
    from attn_callbacks.capture.by_hand import ByHand

__all__ = [
    "CHUNK_BYTES",
    "SdpaCensus",
    "SdpaWatch",
    "calls_sdpa",
    "computes_attention",
    "next_call",
    "sdpa_weights",
    "unreadable_attention",
]

#: The function's name in code, as static detection looks for it.
SDPA_NAME = "scaled_dot_product_attention"

#: Names of attention functions that return no weights and that the watch cannot recompute.
_UNREADABLE = ("flex_attention", "flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func")

#: Attributes by which attention modules say how many heads they have: MHA, BERT, DistilBERT / T5, GPT-2.
HEAD_ATTRIBUTES = ("num_heads", "num_attention_heads", "n_heads", "n_head")

#: Names and the operator (``"@"``) of a matrix product, as :func:`computes_attention` looks for one.
_PRODUCTS = frozenset({"@", "matmul", "bmm", "baddbmm", "einsum"})

#: Python 3.10's opcodes of ``@`` (3.11 on: ``BINARY_OP`` with argrepr ``@``).
_MATMUL_OPS = ("BINARY_MATRIX_MULTIPLY", "INPLACE_MATRIX_MULTIPLY")

#: At most this many bytes of float32 weights (and their temporaries) per chunk of samples: one sample at least.
CHUNK_BYTES = 64 * 2**20

_SIGNATURE = inspect.signature(
    lambda query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False: None
)


def sdpa_weights(
    query: Tensor,
    key: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """The attention weights ``scaled_dot_product_attention(query, key, value, ...)`` applies to ``value``.

    ``softmax(q kᵀ · scale + bias)`` over the keys, with the bias of the mask (boolean: True may attend; float: added)
    and of ``is_causal`` (top-left aligned ``tril(ones(Lq, Lk))``); ``enable_gqa`` repeats each key head
    ``Hq / Hk`` times. A row with no key it may attend to is NaN (SDPA's math kernel outputs zeros there): the
    accumulator leaves such rows out and counts them as skipped.

    Args:
        query: ``(..., Hq, Lq, E)``.
        key: ``(..., Hk, Lk, E)``.
        attn_mask: broadcastable to ``(..., Hq, Lq, Lk)``, or None.
        is_causal: mask out keys after the query's position, counted from the top-left corner.
        scale: the factor of the dot products; ``1 / sqrt(E)`` when None.
        enable_gqa: grouped-query attention: ``Hk`` divides ``Hq``.

    Returns:
        ``(..., Hq, Lq, Lk)`` float32, or float64 for float64 inputs.

    Example:
        >>> q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # (H=1, L=2, E=2)
        >>> sdpa_weights(q, q, is_causal=True, scale=1.0).tolist()
        [[[1.0, 0.0], [0.2689414322376251, 0.7310585975646973]]]
    """
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    query, key = query.to(dtype), key.to(dtype)
    if enable_gqa and key.size(-3) != query.size(-3):
        key = key.repeat_interleave(query.size(-3) // key.size(-3), dim=-3)  # (..., Hq, Lk, E)
    factor = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    # The call runs inside the model's forward: under autocast (precision="bf16-mixed") the product and softmax
    # would be bf16 / fp16, 1e-2 off and underflowing ~17 logits down, not float32.
    with _autocast_off(query.device):
        scores = torch.matmul(query, key.transpose(-2, -1)).mul_(factor)  # (..., Hq, Lq, Lk)
        len_q, len_k = scores.shape[-2:]
        if is_causal:
            allowed = torch.ones(len_q, len_k, dtype=torch.bool, device=scores.device).tril_()
            scores = scores.masked_fill_(~allowed, -math.inf)
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                scores = scores.masked_fill_(~attn_mask, -math.inf)
            else:
                scores = scores.add_(attn_mask.to(dtype))
        return torch.softmax(scores, dim=-1)


def _autocast_off(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast switched off on ``device``'s kind, where autocast exists for it."""
    available = getattr(torch.amp, "is_autocast_available", lambda kind: kind in ("cpu", "cuda"))  # torch < 2.4
    return torch.autocast(device.type, enabled=False) if available(device.type) else contextlib.nullcontext()


def calls_sdpa(module: nn.Module) -> bool:
    """Whether the code of ``module``'s class (its methods and its bases' below ``nn.Module``) or a function stored on
    the module names ``scaled_dot_product_attention``, also under another name (``from torch.nn.functional import
    scaled_dot_product_attention as sdpa``) or through a helper function of the same file: static detection, read
    from the code, no call made."""
    return _names_in(module, SDPA_NAME, depth=2)


def computes_attention(module: nn.Module, undeclared: bool = False) -> bool:
    """Whether ``module`` computes attention by hand: the code of its class (as :func:`calls_sdpa` reads it) takes a
    softmax (``torch.softmax``, ``F.softmax``, ``Tensor.softmax`` or an ``nn.Softmax`` child) and a matrix product
    (``@``, ``matmul``, ``bmm``, ``baddbmm``, ``einsum``): minGPT, the Annotated Transformer, lucidrains-style
    modules. Modules of ``torch`` are read their own ways and never count, nor are those of ``transformers``, unless
    ``undeclared``: inside a Hugging Face model that declares no attention modules (DeBERTa, MPNet; see
    :func:`attn_callbacks.capture.hf.undeclared_models`). Static detection, no call made."""
    package = type(module).__module__.split(".")[0]
    if package == "torch" or (package == "transformers" and not undeclared):
        return False
    names = _class_names(type(module), 2) | frozenset().union(*(_code_names(v, 2) for v in vars(module).values()))
    softmax = "softmax" in names or any(isinstance(child, nn.Softmax) for child in module.children())
    return softmax and not names.isdisjoint(_PRODUCTS)


def declared_heads(module: nn.Module) -> int | None:
    """The number of heads ``module`` declares in one of :data:`HEAD_ATTRIBUTES`, or None."""
    for attribute in HEAD_ATTRIBUTES:
        value = getattr(module, attribute, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def unreadable_attention(module: nn.Module) -> str | None:
    """The attention function returning no weights (flex attention, the ``flash_attn`` package) that ``module``'s code
    names while it never names ``scaled_dot_product_attention``, or None."""
    if calls_sdpa(module):
        return None
    # Not through helpers: library code names them in branches never taken (transformers' loading checks).
    return next((name for name in _UNREADABLE if _names_in(module, name, depth=1)), None)


def _names_in(module: nn.Module, name: str, depth: int) -> bool:
    if name in _class_names(type(module), depth):
        return True
    # a function kept on the instance (torchtune's attention call), or the function itself
    return any(name in _code_names(value, depth) or _name_of(value) == name for value in vars(module).values())


@functools.cache
def _class_names(cls: type, depth: int) -> frozenset[str]:
    """The names the code of a module class and its bases below ``nn.Module`` refers to (once per class)."""
    return frozenset().union(
        *(
            _code_names(value, depth)
            for base in cls.__mro__
            if base not in (nn.Module, object) and issubclass(base, nn.Module)
            for value in vars(base).values()
        )
    )


def _code_names(function: Any, depth: int = 0) -> frozenset[str]:
    """Every global, attribute and enclosing-scope name the code of a function (nested functions included) refers to;
    with ``depth`` ≥ 1, for a name that is a function (a global, or a variable of the enclosing scope), its own name
    too (an alias: ``from torch.nn.functional import scaled_dot_product_attention as sdpa``), and with ``depth`` ≥ 2
    the names the code of such a function of the same file refers to (a helper that calls it), ``depth - 1`` deep.
    A decorated function (``functools.wraps``) adds the names of the function it wraps: a decorator of another file
    (transformers' ``deprecate_kwarg``) hides them otherwise."""
    function = getattr(function, "__func__", function)  # classmethod / staticmethod / bound method
    function = getattr(function, "func", function)  # functools.partial
    names = _own_code_names(function, depth)
    if inspect.isfunction(function) and hasattr(function, "__wrapped__"):
        try:
            wrapped = inspect.unwrap(function)
        except (ValueError, RecursionError):  # a __wrapped__ loop
            wrapped = function
        if wrapped is not function:
            names |= _own_code_names(wrapped, depth)
    return names


def _own_code_names(function: Any, depth: int) -> frozenset[str]:
    """:func:`_code_names` of one function's own code."""
    code = getattr(function, "__code__", None)
    if not isinstance(code, types.CodeType):
        return frozenset()
    names: set[str] = set()
    stack = [code]
    while stack:
        inner = stack.pop()
        names.update(inner.co_names + inner.co_freevars)
        if any(
            op.opname in _MATMUL_OPS or (op.opname == "BINARY_OP" and op.argrepr in ("@", "@="))
            for op in dis.get_instructions(inner)
        ):
            names.add("@")  # the operator has no name in the code: stands for it
        stack.extend(const for const in inner.co_consts if isinstance(const, types.CodeType))
    if depth:
        # What the names stand for: the variables of the enclosing scope, else the function's globals.
        cells = zip(code.co_freevars, getattr(function, "__closure__", None) or (), strict=False)
        enclosing = {free: cell.cell_contents for free, cell in cells if _full(cell)}
        scope = getattr(function, "__globals__", {})
        values = (enclosing[name] if name in enclosing else scope.get(name) for name in names)
        functions = (value for value in values if callable(value) and not isinstance(value, type))
        for value in {id(value): value for value in functions if value is not function}.values():
            names.update(filter(None, [_name_of(value)]))
            # Plain Python functions only: a numba dispatcher, say, has a __code__ but no closure.
            if depth > 1 and inspect.isfunction(value) and value.__module__ == getattr(function, "__module__", None):
                names |= _code_names(value, depth - 1)
    return frozenset(names)


def _name_of(value: Any) -> str | None:
    try:  # an object of the user's whose attributes are computed may raise anything
        name = getattr(value, "__name__", None)
    except Exception:
        return None
    return name if isinstance(name, str) else None


def _full(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018  (an empty cell raises)
    except ValueError:
        return False
    return True


# Consumer of weights: (module name, call index in the batch, module, weights (b, H, Lq, Lk), rows of the call's
# batch, the call's batch size, the keys the mask allows (b or 1, Lq, Lk)).
ChunkConsumer = Callable[[str, int, nn.Module, Tensor, slice, int, Tensor], None]


class SdpaWatch(TorchFunctionMode):
    """Sees ``scaled_dot_product_attention`` calls made inside watched modules while entered, and hands their
    recomputed weights on, a chunk of samples at a time; and reads the softmax of the modules computing attention by
    hand. Outputs are the functions' own, untouched.

    Args:
        modules: name -> module whose calls are watched; a call belongs to the innermost one whose method made it.
        consumer: called as ``consumer(name, index, module, weights, rows, batch)`` with ``weights``
            ``(b, Hq, Lq, Lk)`` for the samples ``rows`` of the call's ``batch`` samples (a 3-D call ``(B, L, E)``
            counts as one head); ``index`` counts the module's calls since this watch was made, from 0.
        chunk_bytes: the most bytes of weights per consumer call (at least one sample).
        warned: names of the modules already warned about calling with dropout (shared by the watches of one
            capture, so that each module is named once).
        by_hand: the modules computing attention by hand, and what the watches share about them
            (:class:`attn_callbacks.capture.by_hand.ByHand`).
    """

    def __init__(
        self,
        modules: Mapping[str, nn.Module],
        consumer: ChunkConsumer,
        chunk_bytes: int = CHUNK_BYTES,
        warned: set[str] | None = None,
        by_hand: ByHand | None = None,
    ):
        super().__init__()
        self.modules = {id(module): (name, module) for name, module in modules.items()}
        self.consumer = consumer
        self.chunk_bytes = chunk_bytes
        self.warned = set() if warned is None else warned
        self.calls: dict[str, int] = {}  # calls per watched module since this watch was made
        self.by_hand = by_hand.reader(consumer, self.calls) if by_hand is not None and by_hand.names else None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        # dynamo traces this mode: frames are not there to walk, and nothing is read while tracing
        if torch.compiler.is_compiling():
            return output
        if func is F.scaled_dot_product_attention:
            found = self._owner(sys._getframe(1))
            if found is not None:
                self._hand_on(*found, args, kwargs)
        elif self.by_hand is not None:
            frame = sys._getframe(1)
            found = self._owner(frame)
            if found is not None and found[0] in self.by_hand.names:
                self.by_hand.see(*found, func, method_owners(frame), args, kwargs, output)
        elif getattr(func, "__name__", None) == "flex_attention":
            found = self._owner(sys._getframe(1))
            if found is not None:
                raise RuntimeError(f"AttentionMonitor: {unreadable_message(found[0], found[1], 'flex_attention')}")
        return output

    def _owner(self, frame: types.FrameType | None) -> tuple[str, nn.Module] | None:
        """The innermost watched module with a method on the call's stack."""
        return next((self.modules[id(s)] for s in method_owners(frame) if id(s) in self.modules), None)

    def _hand_on(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        call = _SIGNATURE.bind(*args, **kwargs).arguments
        index = next_call(self.calls, name)
        query, key, mask = call["query"], call["key"], call.get("attn_mask")
        dropout = call.get("dropout_p", 0.0)
        if dropout and name not in self.warned:  # the weights below are dropout's expectation, not what was applied
            self.warned.add(name)
            warnings.warn(
                f"AttentionMonitor: module {name!r} called scaled_dot_product_attention with dropout_p={dropout} "
                "while monitored: its output had attention dropped out at random, while the weights read are those "
                "without dropout (their expectation). Pass dropout_p=0.0 when not self.training, as Hugging Face "
                "and nanoGPT do",
                stacklevel=2,
            )
        if isinstance(mask, CausalBias):  # PyTorch's causal_upper_left / causal_lower_right: (Lq, Lk) booleans
            mask = mask._materialize(query.device)
        if query.dim() == 3:  # (B, L, E): one head
            query, key = query.unsqueeze(1), key.unsqueeze(1)
            mask = mask.unsqueeze(-3) if mask is not None and mask.dim() == 3 else mask
        if query.dim() != 4:
            raise ValueError(
                f"AttentionMonitor: module {name!r} called scaled_dot_product_attention with a query of shape "
                f"{tuple(query.shape)}; only (B, H, L, E) and (B, L, E) are read. Leave it out with `modules`"
            )
        if query.size(0) != key.size(0):  # one side broadcast over the batch (learned queries, say)
            batch = max(query.size(0), key.size(0))
            query, key = query.expand(batch, *query.shape[1:]), key.expand(batch, *key.shape[1:])
        batch, heads, len_q = query.shape[:3]
        itemsize = 8 if query.dtype == torch.float64 else 4
        per_sample = 3 * heads * len_q * key.size(-2) * itemsize  # weights and two temporaries
        step = max(1, self.chunk_bytes // max(per_sample, 1))
        causal = bool(call.get("is_causal", False))
        with torch.no_grad():
            for start in range(0, batch, step):
                rows = slice(start, min(start + step, batch))
                part = _rows_of(mask, rows, batch)
                weights = sdpa_weights(
                    query[rows], key[rows], part, causal, call.get("scale"), bool(call.get("enable_gqa", False))
                )
                allowed = sdpa_allowed(part, causal, weights.size(-2), weights.size(-1), weights.device)
                self.consumer(name, index, module, weights, rows, batch, allowed)


class SdpaCensus(TorchFunctionMode):
    """Sees every ``scaled_dot_product_attention`` call while entered (the monitor enters it around one batch) and
    keeps the modules that made one outside every attention module found: attention no hook or watch reads.

    Args:
        names: id of each module of the model -> its name.
        found: the attention modules found (selected or not): calls inside them are theirs.
    """

    running: SdpaCensus | None = None  # the census on torch's mode stack in this process, if one is

    def __init__(self, names: Mapping[int, str], found: Iterable[nn.Module]) -> None:
        super().__init__()
        self.names = names
        self.found = {id(module) for module in found}
        self.unseen: dict[str, str] = {}  # module name -> its class's name

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        output = func(*args, **(kwargs or {}))
        if func is not F.scaled_dot_product_attention or torch.compiler.is_compiling():
            return output
        innermost = None
        for owner in method_owners(sys._getframe(1)):  # the innermost module of the model, unless one is found
            if id(owner) in self.found:
                return output
            if innermost is None and id(owner) in self.names:
                innermost = owner
        if innermost is not None:
            self.unseen.setdefault(self.names[id(innermost)], type(innermost).__name__)
        return output


def next_call(calls: dict[str, int], name: str) -> int:
    """The index of module ``name``'s next call in ``calls`` (calls so far, per module), counted."""
    index = calls.get(name, 0)
    calls[name] = index + 1
    return index


def call_site(name: str, index: int) -> str:
    """The sums' name of module ``name``'s ``index``-th call in a batch: the module's own, then ``{name}.call{k}``."""
    return name if index == 0 else f"{name}.call{index}"


def _rows_of(mask: Tensor | None, rows: slice, batch: int) -> Tensor | None:
    """The part of a broadcastable ``(B, H, Lq, Lk)`` mask that applies to samples ``rows``."""
    if mask is None or mask.dim() < 4 or mask.size(0) != batch or batch == 1:
        return mask
    return mask[rows]


def unreadable_message(name: str, module: nn.Module, function: str) -> str:
    """Why a module's attention cannot be read, and what to use instead."""
    return (
        f"Attention module {name!r} ({type(module).__name__}) calls {function}, which returns no "
        "attention weights and cannot be recomputed from its call. While monitored, run attention through "
        "torch.nn.functional.scaled_dot_product_attention or nn.MultiheadAttention (Hugging Face: "
        'attn_implementation="sdpa" or "eager"), or leave the module out with `modules`'
    )
