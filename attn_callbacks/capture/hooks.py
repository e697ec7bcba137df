"""Reading the per-head weights of attention modules (found by :mod:`attn_callbacks.capture.find`) through hooks.

Stock ``nn.Transformer*`` layers call attention with ``need_weights=False``. A forward pre-hook rewrites the call to
``need_weights=True, average_attn_weights=False``; a forward hook hands the per-head weights ``(B, H, Lq, Lk)`` to a
consumer and returns to the caller exactly what it asked for. While attached, the process-wide MHA fast path is
switched off (the encoder-layer fast path and ``nn.TransformerEncoder``'s nested-tensor conversion bypass the hooks);
detaching restores it and removes every hook, on every exit path.

Hugging Face attention modules (see :mod:`attn_callbacks.capture.hf`) return their weights by themselves when the model
runs eager attention: a forward hook alone reads them, and everything downstream is the same. Modules that call
``torch.nn.functional.scaled_dot_product_attention`` (Hugging Face ones run with ``attn_implementation="sdpa"``
included) are watched by :class:`attn_callbacks.capture.sdpa.SdpaWatch` instead, a watch per batch
(:meth:`AttentionCapture.watching`), entered while each of their forwards runs; so are modules computing attention by
hand, whose softmax the watch reads.

A capture may leave out what a module's ``generate`` method computes (the monitor does: cached decoding attends over
tokens the batch does not hold); it counts those calls instead.
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from attn_callbacks.capture import hf
from attn_callbacks.capture.by_hand import ByHand
from attn_callbacks.capture.find import (
    attention_candidates,
    named_modules,
    reads_output,
)
from attn_callbacks.capture.frames import in_generate
from attn_callbacks.capture.masks import mha_allowed
from attn_callbacks.capture.sdpa import SdpaCensus, SdpaWatch, call_site
from attn_callbacks.capture.switches import EagerCompile, FastpathOff, GlobalSwitch

__all__ = ["AttentionCapture"]

WeightsConsumer = Callable[[str, nn.Module, Tensor, slice, int, Tensor | None], None]

_MHA_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


class AttentionCapture:
    """Hooks that force per-head attention weights out of attention modules, and a watch over the
    ``scaled_dot_product_attention`` calls of the others.

    Use :meth:`attach` / :meth:`detach` (idempotent) or the object as a context manager; SDPA calls are seen only
    inside :meth:`watching` (the callback enters it around each monitored batch). The model's outputs are not
    changed: a caller of an ``nn.MultiheadAttention`` that did not ask for weights gets ``(out, None)``; one that
    asked for averaged weights gets the head average, as without the hooks. Hugging Face eager attention modules are
    only read; SDPA calls are passed through and their weights recomputed (:mod:`attn_callbacks.capture.sdpa`).

    Args:
        modules: name -> module, as from :func:`find_attention_modules`: ``nn.MultiheadAttention`` modules are
            hooked, Hugging Face eager ones read (those in ``output_index``), every other one watched for SDPA calls.
        consumer: called as ``consumer(name, module, weights, rows, batch, allowed)`` with ``weights`` of shape
            ``(b, H, Lq, Lk)`` (batch-major whatever ``batch_first`` says; ``(H, Lq, Lk)`` for an unbatched
            ``nn.MultiheadAttention`` call) for the samples ``rows`` (a ``slice``) of the call's ``batch`` samples:
            all of them, except for an SDPA call recomputed a few samples at a time. The k-th SDPA call of a module
            in one batch (k ≥ 1) is named ``f"{name}.call{k}"``. ``allowed``: the keys the call's mask lets each
            query attend to, broadcastable to ``(b, Lq, Lk)`` (see :func:`~attn_callbacks.capture.masks.mha_allowed` and
            :func:`~attn_callbacks.capture.masks.sdpa_allowed`, :func:`~attn_callbacks.capture.hf.eager_allowed`), or
            None where the capture cannot know (a nested-tensor call, a Hugging Face call without a mask it reads).
        disable_fastpath: switch ``torch.backends.mha`` fast path off while attached (restored when the last
            capture attached at the time detaches).
        output_index: for Hugging Face attention modules, the index of the weights in their output tuple
            (:func:`attn_callbacks.capture.hf.attention_outputs`); modules not named here are hooked or watched.
        expect: ``(site name, device)`` -> ``(B, Lq, Lk)`` of its token streams in the current batch: a softmax
            computed by hand is read only where it fits them (:class:`~attn_callbacks.capture.by_hand.ByHand`); None:
            not known (``(B · H, Lq, Lk)`` scores are then split by the ``num_heads`` their module or its caller has).
        skip_generate: leave out the calls made inside a ``generate`` method of a module (Hugging Face's
            ``generate()``, nanoGPT's): not read, counted per module in :attr:`generated` (the methods' owners
            in :attr:`generators`).
    """

    def __init__(
        self,
        modules: Mapping[str, nn.Module],
        consumer: WeightsConsumer,
        disable_fastpath: bool = True,
        output_index: Mapping[str, int] | None = None,
        expect: Callable[[str, torch.device], tuple[int, int, int] | None] | None = None,
        skip_generate: bool = False,
    ) -> None:
        self.modules = dict(modules)
        self.skip_generate = skip_generate
        self.consumer = consumer
        self.disable_fastpath = disable_fastpath
        self.output_index = dict(output_index or {})
        self.watched = {
            name: module
            for name, module in self.modules.items()
            if not isinstance(module, nn.MultiheadAttention) and not reads_output(module, name, self.output_index)
        }
        self.by_hand = ByHand.of(self.watched, expect, self.output_index)  # watched modules computing it by hand
        self._handles: list[RemovableHandle] = []
        self._held: list[type[GlobalSwitch]] = []  # the process-wide settings this capture holds
        self._watch: SdpaWatch | None = None  # the watch over SDPA calls, while watching
        self._dropout_warned: set[str] = set()  # modules named in the SDPA watch's dropout warning
        self._causal_warned: set[str] = set()  # modules called with is_causal=True and no mask, warned about
        self._mask_read: dict[str, bool] = {}  # Hugging Face eager modules: whether their mask explained their weights
        self._entered: SdpaWatch | None = None  # the watch on torch's mode stack, while a watched forward runs
        self._census: SdpaCensus | None = None  # the look for SDPA calls outside the modules found, while on
        self._depth = 0  # watched forwards running inside each other, while one entered the watch
        self.calls: dict[str, int] = dict.fromkeys(self.modules, 0)  # calls per module, until reset_calls()
        self.generated: dict[str, int] = {}  # calls per module left out inside generate(), likewise
        self.generators: set[str] = set()  # the generate methods they were made in ("GPT2LMHeadModel.generate")
        self._forwards: set[int] = set()  # ids of the watched modules whose forward ran while watching, likewise
        # What each in-flight call asked for (None: a call left unread), pushed by the pre-hook and popped by the hook
        # (calls may nest).
        self._requested: dict[str, list[tuple[bool, bool] | None]] = defaultdict(list)

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy``, pickle) is detached: hooks and the hold on the fast path stay with this one."""
        return {
            **self.__dict__,
            "_handles": [],
            "_held": [],
            "_watch": None,
            "_entered": None,
            "_census": None,
            "_depth": 0,
            "_requested": defaultdict(list),
        }

    @property
    def attached(self) -> bool:
        """Whether hooks are currently registered (or a process-wide setting is held)."""
        return bool(self._handles) or bool(self._held)

    def reset_calls(self) -> None:
        """Start counting calls per module (:attr:`calls`, :meth:`ran`) from 0."""
        self.calls = dict.fromkeys(self.modules, 0)
        self.generated, self.generators = {}, set()
        self._forwards.clear()
        self.by_hand.unread.clear()

    def ran(self) -> set[str]:
        """The watched modules whose forward ran in a watched batch since :meth:`reset_calls`, whether or not they
        called ``scaled_dot_product_attention``."""
        return {name for name, module in self.watched.items() if id(module) in self._forwards}

    def attach(self) -> AttentionCapture:
        """Register the hooks, switch the fast path off and have compiled code run eagerly (``torch.compiler``'s
        ``force_eager`` stance, so that its modules call the hooks and SDPA is called where the watch sees it).
        Attaching twice is a no-op."""
        if self.attached:
            return self
        try:
            for setting in ([FastpathOff] if self.disable_fastpath else []) + [EagerCompile]:
                setting.hold()
                self._held.append(setting)
            for name, module in self.modules.items():
                if isinstance(module, nn.MultiheadAttention):
                    pre_hook = _Hook(self._pre_hook(name))
                    self._handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
                    # Prepended: forward hooks then run in the reverse order of their pre-hooks, so with two captures
                    # attached (two monitors on one Trainer) the later one reads the weights before the earlier one,
                    # which saw the caller's own request, hands back what the caller asked for; and hooks the user
                    # registered before see the output they would see without us.
                    hook = _Hook(self._hook(name, module))
                    self._handles.append(module.register_forward_hook(hook, with_kwargs=True, prepend=True))
                elif name not in self.watched:
                    self._handles.append(
                        module.register_forward_hook(_Hook(self._read_hook(name, module)), with_kwargs=True)
                    )
                else:  # the watch is entered around the forward only, and left however the forward ends
                    enter = _Hook(functools.partial(self._enter_watch, name))
                    self._handles.append(module.register_forward_pre_hook(enter))
                    self._handles.append(module.register_forward_hook(_Hook(self._leave_watch), always_call=True))
        except BaseException:
            self.detach()
            raise
        return self

    def detach(self) -> None:
        """Stop watching, remove every hook and restore the fast-path flag. Safe to call any number of times."""
        self.stop_watching()
        # A watched forward interrupted by a BaseException (Ctrl+C) never ran its always_call hook, which catches
        # Exception only: its watch would stay on torch's mode stack, seeing every later call.
        entered, self._entered, self._depth = self._entered, None, 0
        if entered is not None:
            _leave(entered)
        self.stop_census()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._requested.clear()
        while self._held:
            self._held.pop().release()

    def __enter__(self) -> AttentionCapture:
        return self.attach()

    def __exit__(self, *exc_info: object) -> None:
        self.detach()

    def start_watching(self) -> None:
        """See the SDPA calls of the watched modules from now on, the calls of each numbered from 0 again: a
        ``TorchFunctionMode`` that the watched modules' hooks enter while their forward runs (modes of the user's
        entered around it nest as usual); a no-op without watched modules or when already watching."""
        if self.watched and self._watch is None:
            self._watch = SdpaWatch(self.watched, self._watched_call, warned=self._dropout_warned, by_hand=self.by_hand)

    def finish_batch(self) -> None:
        """The batch's model has run: read the steps of decoder loops computed by hand that the watch kept
        (:meth:`~attn_callbacks.capture.by_hand.HandReader.finish`); call it before the batch's streams end."""
        if self._watch is not None and self._watch.by_hand is not None:
            self._watch.by_hand.finish()

    def stop_watching(self) -> None:
        """Stop seeing SDPA calls (a forward already running keeps the watch until it returns); steps not read by
        :meth:`finish_batch` are dropped."""
        self._watch = None

    def start_census(self, model: nn.Module) -> None:
        """Look, until :meth:`stop_census`, for ``scaled_dot_product_attention`` calls made outside every attention
        module found in ``model`` (selected or not): attention the hooks and the watch cannot see. Every torch call
        then passes through a ``TorchFunctionMode`` (for one batch: that is its cost)."""
        # One at a time in the process: a second monitor's would be left above the first's at the batch's end.
        if self._census is None and SdpaCensus.running is None:
            names = {id(module): name for name, module in named_modules(model).items()}
            self._census = SdpaCensus.running = SdpaCensus(names, attention_candidates(model).values())
            self._census.__enter__()

    def stop_census(self) -> dict[str, str]:
        """Leave the census; the modules that called the function unseen, name -> class name. A census under
        another mode (one entered since and still on) stays until a later call (:meth:`detach`) finds it on top."""
        census = self._census
        if census is None:
            return {}
        if _leave(census):
            self._census = SdpaCensus.running = None
        return census.unseen

    def _enter_watch(self, name: str, module: nn.Module, args: tuple) -> None:
        if self._depth == 0 and self._watch is not None and self._generating(name):
            return  # left with the depth at 0: its forward hook does nothing either
        if self._watch is not None:
            self._forwards.add(id(module))
        if self._depth == 0:
            if self._watch is None:
                return
            self._watch.__enter__()
            self._entered = self._watch
        self._depth += 1

    def _leave_watch(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._depth == 0:  # a forward that began before the watch did
            return
        self._depth -= 1
        if self._depth == 0:
            entered, self._entered = self._entered, None
            entered.__exit__(None, None, None)

    @contextmanager
    def watching(self) -> Iterator[AttentionCapture]:
        """:meth:`start_watching` for the duration of a ``with`` block."""
        self.start_watching()
        try:
            yield self
        finally:
            self.stop_watching()

    def _watched_call(
        self, name: str, index: int, module: nn.Module, weights: Tensor, rows: slice, batch: int, allowed: Tensor
    ) -> None:
        if rows.start == 0:
            self.calls[name] += 1
        self.consumer(call_site(name, index), module, weights, rows, batch, allowed)

    def _generating(self, name: str) -> bool:
        """Whether the call of module ``name`` under way is one to leave out (made inside a ``generate`` method),
        counted if so."""
        method = in_generate(sys._getframe(2)) if self.skip_generate else None
        if method is None:
            return False
        self.generated[name] = self.generated.get(name, 0) + 1
        self.generators.add(method)
        return True

    def _pre_hook(self, name: str) -> Callable[..., tuple[tuple, dict] | None]:
        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if self._generating(name):
                self._requested[name].append(None)  # the call runs as asked, unread
                return None
            # Bind so that a positional need_weights (mha(q, k, v, None, False)) is seen and replaced too.
            bound = _MHA_SIGNATURE.bind(module, *args, **kwargs)
            bound.apply_defaults()
            arguments = bound.arguments
            self._requested[name].append((bool(arguments["need_weights"]), bool(arguments["average_attn_weights"])))
            if arguments["is_causal"] and arguments["attn_mask"] is None:
                arguments["is_causal"] = False  # what the fast path computes; with weights asked for, torch raises
                self._warn_causal_hint(name)
            arguments["need_weights"] = True
            arguments["average_attn_weights"] = False
            del arguments["self"]
            return (), dict(arguments)

        return pre_hook

    def _warn_causal_hint(self, name: str) -> None:
        if name in self._causal_warned:
            return
        self._causal_warned.add(name)
        warnings.warn(
            f"AttentionMonitor: nn.MultiheadAttention {name!r} was called with is_causal=True and no attn_mask. "
            "PyTorch takes is_causal as a hint only: its fast path (eval, no gradients) ignores it, so this attention "
            "is not causal, and a call that computes weights or gradients raises. The monitor reads the unmasked "
            "weights the model applies. For causal attention pass attn_mask=nn.Transformer."
            "generate_square_subsequent_mask(L) (tgt_mask for a decoder layer, mask for an encoder)",
            stacklevel=3,
        )

    def _hook(self, name: str, module: nn.MultiheadAttention) -> Callable[..., Any]:
        def hook(mod: nn.Module, args: tuple, kwargs: dict, output: tuple[Tensor, Tensor | None]) -> Any:
            requested = self._requested[name].pop()
            if requested is None:
                return None
            need_weights, average = requested
            out, weights = output
            if weights is None:  # cannot happen with need_weights=True, but never hand None on
                return (out, None) if not need_weights else output
            self.calls[name] += 1
            batch = weights.size(0) if weights.dim() == 4 else 1
            self.consumer(name, module, weights, slice(0, batch), batch, mha_allowed(kwargs, weights))
            if not need_weights:
                return out, None
            return (out, weights.mean(dim=-3)) if average else output

        return hook

    def _read_hook(self, name: str, module: nn.Module) -> Callable[..., None]:
        index = self.output_index.get(name, 1)
        try:
            signature: inspect.Signature | None = inspect.signature(module.forward)
        except (TypeError, ValueError):
            signature = None
        # Where the call's extra keyword arguments land (transformers' **kwargs): the mask may be among them.
        extra = next((p.name for p in getattr(signature, "parameters", {}).values() if p.kind is p.VAR_KEYWORD), None)

        def hook(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self._generating(name):
                return
            weights = output[index] if isinstance(output, (tuple, list)) and len(output) > index else None
            if not isinstance(weights, Tensor) or weights.dim() != 4:  # switched to SDPA, say: fail, not sum nothing
                raise RuntimeError(hf.no_weights_message(name, module, index=index, got=weights))
            self.calls[name] += 1
            allowed = self._eager_allowed(name, module, signature, extra, args, kwargs, weights)
            self.consumer(name, module, weights, slice(0, weights.size(0)), weights.size(0), allowed)

        return hook

    def _eager_allowed(
        self,
        name: str,
        module: nn.Module,
        signature: inspect.Signature | None,
        extra: str | None,
        args: tuple,
        kwargs: dict,
        weights: Tensor,
    ) -> Tensor | None:
        """:func:`hf.eager_allowed` of a Hugging Face eager call, or None: no mask read, or the module's mask once
        failed to explain its weights (:func:`hf.mask_explains`, checked at its first call with a mask; warned)."""
        if signature is None or self._mask_read.get(name) is False:
            return None
        try:
            call = signature.bind(*args, **kwargs).arguments
        except TypeError:
            return None
        mask = hf.eager_mask({**call.get(extra, {}), **call} if extra else call)
        allowed = hf.eager_allowed(mask, weights, module)
        if allowed is None or mask is None or self._mask_read.get(name):
            return allowed
        self._mask_read[name] = hf.mask_explains(allowed, weights)
        if self._mask_read[name]:
            return allowed
        warnings.warn(
            f"AttentionMonitor: Hugging Face attention module {name!r} ({type(module).__name__}) gave positive "
            "weights to keys its attention mask masks: the mask is not all it adds to its scores, so it is not read. "
            "A key counts as visible (in U and the entropy's maximum) where some head gives it a non-zero weight",
            stacklevel=2,
        )
        return None


def _leave(mode: torch.overrides.TorchFunctionMode) -> bool:
    """Take ``mode`` off torch's mode stack, where it is on top, and say whether it is off; under a mode entered after
    it and still on, it stays, rather than taking the wrong one off."""
    stack = torch.overrides._get_current_function_mode_stack()
    if stack and stack[-1] is mode:
        mode.__exit__(None, None, None)
        return True
    return mode not in stack


class _Hook:
    """A hook of the capture's on a user's module. Dynamo calls it but never traces it: where a compiled graph runs
    the hooks after all (compiled while they were attached), the monitor's code is a graph break at the hook, not
    graphs of its own. A copy of the module (``copy.deepcopy``, pickle, ``torch.save``) made while it is attached holds
    an :class:`_Inert` hook instead: the copy must not call into this capture, and a closure cannot be pickled."""

    def __init__(self, hook: Callable) -> None:
        self.hook = torch.compiler.disable(hook, recursive=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.hook(*args, **kwargs)

    def __reduce__(self) -> tuple[type, tuple]:
        return _Inert, ()


class _Inert:
    """What a copied module holds in place of a capture's hook: a hook that changes nothing."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None
