"""The monitor's warnings about what it saw (or did not see) in an epoch: each said once per key, from rank 0."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

__all__ = ["Warnings"]


class Warnings:
    """Warnings said once per key (a module, a head, a set of names) for the monitor's lifetime.

    Args:
        entropy_collapse_threshold: :class:`~attn_callbacks.AttentionMonitor`'s argument of that name.
    """

    def __init__(self, entropy_collapse_threshold: float) -> None:
        self.entropy_collapse_threshold = entropy_collapse_threshold
        self._said: set[str] = set()

    def once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            rank_zero_warn(message)

    def unread(self, unread: Mapping[str, tuple[tuple[int, ...], tuple[int, int, int]]]) -> None:
        """Softmaxes over the keys that modules computing attention by hand took and the monitor could not read
        (:class:`~attn_callbacks.capture.by_hand.ByHand`), with their shapes and the tokens' (once per set)."""
        if not unread:
            return
        said = "; ".join(
            f"{name!r}: {shape} for tokens (B, Lq, Lk) = {expected}" for name, (shape, expected) in unread.items()
        )
        self.once(
            f"unread:{','.join(unread)}",
            f"AttentionMonitor: module(s) found by the softmax and matrix product in their code took softmaxes over "
            f"their keys that were not read ({said}). The scores read are made by a product of two batched tensors "
            "(q @ kᵀ) or a one-output Linear (additive attention), batch-major; a decoder loop, one query position "
            "per call, is read when its steps in a batch make the query stream's length. Attention in blocks or "
            "windows, over learned queries or over other tokens than the batch's cannot be matched to its tokens. If "
            "a module is not attention, or to silence this, leave it out with `modules`; for other streams see "
            "`attention_streams`.",
        )

    def silent(self, silent: list[str], batches: int, ran: Collection[str] = (), by_hand: Collection[str] = ()) -> None:
        """Hooked modules ``silent`` never ran in the epoch's ``batches`` monitored batches (once per set of names);
        or, those in ``ran``, ran without calling ``scaled_dot_product_attention``, or (those in ``by_hand``, found by
        a softmax and a product in their code) without a softmax the monitor reads."""
        if not batches:
            return
        hand = [name for name in silent if name in ran and name in by_hand]
        quiet = [name for name in silent if name in ran and name not in by_hand]
        silent = [name for name in silent if name not in ran]
        if hand:
            self.once(
                f"no_softmax:{','.join(hand)}",
                f"AttentionMonitor: module(s) {', '.join(map(repr, hand))}, found by the softmax and matrix product in "
                f"their code, ran in {batches} monitored batch(es) but took no softmax the monitor reads, and nothing "
                "else was read: it reads a softmax over the last dimension of scores that a product of two batched "
                "tensors made (q @ kᵀ, bmm, einsum), (B, H, Lq, Lk) or (B [· H], Lq, Lk). Nothing was seen of them; "
                "if they are not attention, leave them out with `modules=`.",
            )
        if quiet:
            self.once(
                f"no_sdpa:{','.join(quiet)}",
                f"AttentionMonitor: attention module(s) {', '.join(map(repr, quiet))} ran in {batches} monitored "
                "batch(es) but never called scaled_dot_product_attention, where setup found a call in their code: "
                "they compute attention another way on this path, which the monitor cannot read (a Hugging Face "
                "model that declares no attention outputs, run with attn_implementation='eager', say: load it with "
                "'sdpa'). Nothing was seen of them; leave them out with `modules=`.",
            )
        if not silent:
            return
        cause = (
            "a compiled graph that skips module hooks: this torch has no `torch.compiler.set_stance` to run it "
            "eagerly while monitored, so set `torch._dynamo.config.skip_nnmodule_hook_guards = False` before "
            "compiling"
            if not hasattr(torch.compiler, "set_stance")
            else "code run outside the LightningModule's modules (a copy of the model, a compiled function "
            "that does not call the modules' forward)"
        )
        self.once(
            f"silent:{','.join(silent)}",
            f"AttentionMonitor: attention module(s) {', '.join(map(repr, silent))} were hooked for {batches} "
            f"monitored batch(es) but never ran, so nothing was seen of them. Either validation_step does not call "
            f"them (leave them out with `modules=`), or {cause}.",
        )

    def training_mode(self, name: str, module: nn.Module) -> None:
        """Hooked module ``name`` (read from its own output: ``nn.MultiheadAttention``, Hugging Face eager) ran in
        training mode in a monitored batch, where the weights it returns carry its attention dropout; said once per
        module with dropout. Called at every call of a module in training mode: the flag is read per call, since
        ``self.train()`` in a later epoch's ``validation_step`` would escape a first-call check."""
        key = f"training:{name}"
        if key in self._said:
            return
        rate = _dropout(module)
        if rate == 0:
            self._said.add(key)  # nothing to say, nor to look up again
            return
        self.once(
            key,
            f"AttentionMonitor: attention module {name!r} ran in training mode in a monitored validation batch, "
            f"so the weights it returns carry its dropout (p = {rate:g}): zeroed and scaled by 1 / (1 - p), "
            "which every statistic then reads (rows no longer sum to 1). Lightning runs validation in eval mode: "
            "something switched the model back (`self.train()` in `validation_step`, a callback); switch it back "
            "to eval for the monitored batches, or leave the module out with `modules`.",
        )

    def repeated(self, name: str, calls: int, streams: tuple[str, str]) -> None:
        """Hooked module ``name`` ran ``calls`` times in one batch: the calls add into its one set of sums."""
        if calls > 1:
            self.once(
                f"repeated:{name}",
                f"AttentionMonitor: attention module {name!r} ran {calls} times in one validation batch; every call "
                f"adds into its one set of sums, read against its streams {streams}. That is right when each call "
                "attends over those tokens (one module shared by several layers, as in ALBERT, the model run twice "
                "on the batch: each query token then counts once per call; the probe shows the last call); when a "
                "call attends over other tokens (the same encoder run on a second input) its weights are mapped to "
                "the wrong ids: leave the module out with `modules`, or run it as `scaled_dot_product_attention`, "
                "whose calls are summed apart and can be given their own streams (`attention_streams`).",
            )

    def generated(self, generated: Mapping[str, int], methods: list[str], only: list[str], outside: bool) -> None:
        """Calls of attention modules (name -> calls) made inside ``generate`` ``methods``, left out; ``only``: the
        modules that ran there only; ``outside``: whether any module ran outside them."""
        if not generated:
            return
        where = " or ".join(f"`{method}`" for method in methods)
        end = "."
        if not outside:
            end = (
                f", and it ran none outside {where}, so nothing was seen: run the model on the batch outside any "
                "method named `generate` (the forward that gives the validation loss)."
            )
        elif only:
            end = f"; nothing was seen of {_names(only)}, which ran inside {'them' if len(methods) > 1 else 'it'} only."
        self.once(
            "generate",
            f"AttentionMonitor: {sum(generated.values())} call(s) of attention module(s) {_names(list(generated))} "
            f"made inside {where} in monitored batches were not read: generation attends over cached and generated "
            "tokens that the batch does not hold. The monitor reads the forward passes validation_step runs on the "
            f"batch itself{end}",
        )

    def unseen_sdpa(self, unseen: dict[str, str]) -> None:
        """Modules ``unseen`` (name -> class name) called ``scaled_dot_product_attention`` outside every attention
        module found: that attention is not summed."""
        if unseen:
            named = ", ".join(
                f"{name!r} ({cls})" if name else f"the LightningModule ({cls})" for name, cls in unseen.items()
            )
            self.once(
                "unseen_sdpa",
                f"AttentionMonitor: {named} called scaled_dot_product_attention in a monitored batch, but setup found "
                "no attention module there, so that attention is not read or summed. The monitor finds a module "
                "whose own code (or a helper function in its file) calls the function; call it from the attention "
                "module's forward so that it is found.",
            )

    def nothing_seen(self, batches: int, some_module_read: bool) -> None:
        """A monitored epoch has nothing to log, and why (where no module's weights were read, the warnings about
        those modules said so)."""
        if not batches:
            self.once(
                "no_batches",
                "AttentionMonitor: no batch ran in this monitored epoch (empty dataloaders?), so nothing is logged "
                "for it.",
            )
        elif some_module_read:  # its every query token was ignored
            self.once(
                "empty",
                "AttentionMonitor: no valid query token was seen in this epoch (every id in `ignore_ids`, or masked by "
                "`token_mask`?), so nothing is logged for it.",
            )

    def no_tensorboard(self, trainer: Trainer) -> None:
        """Rank 0 has no TensorBoard writer: only scalars are logged (nothing at all under ``barebones``)."""
        if getattr(trainer, "barebones", False):
            self.once(
                "no_tb",
                "AttentionMonitor: Trainer(barebones=True) turns logging off, so nothing the monitor computes is "
                "logged (Lightning warns at each of its scalars), while its hooks still cost the monitored batches: "
                "leave it out of barebones runs.",
            )
            return
        if trainer.fast_dev_run:
            self.once(
                "no_tb",
                "AttentionMonitor: fast_dev_run replaces the Trainer's loggers with a dummy one, so heatmaps, tables "
                "and `export` files are skipped; scalars reach `trainer.callback_metrics` only.",
            )
            return
        self.once(
            "no_tb",
            "AttentionMonitor: no TensorBoardLogger in the Trainer, so heatmaps and tables are skipped; scalars are "
            "still logged to the Trainer's loggers.",
        )

    def all_skipped(self, name: str, skipped: int) -> None:
        """Every query row module ``name`` produced this epoch was dropped."""
        self.once(
            f"all_skipped:{name}",
            f"AttentionMonitor: all {skipped} query rows that attention module {name!r} produced in this epoch had "
            "non-finite or all-zero weights (NaN or inf in the model or its inputs?), so nothing of it was summed: "
            "only its `skipped_rows` is logged.",
        )

    def incomparable(self, name: str, shape: tuple[int, ...], lost: list[tuple[int | None, tuple[int, ...]]]) -> None:
        """Drift memory's epochs ``lost`` (epoch, shape) cannot be compared with this epoch's ``P`` of ``shape``."""
        self.once(
            f"incomparable:{name}",
            f"AttentionMonitor: attention module {name!r} now gives P of shape {shape}, but the epoch(s) drift "
            f"compares against have another ({', '.join(f'epoch {e}: {s}' for e, s in lost)}): a resume into a "
            "monitor whose vocabulary, tracking or heads changed? Drift against them is not logged; it starts again "
            "from this epoch.",
        )

    def health(self, name: str, entropy_normalized: Tensor | None, skipped_rows: int) -> None:
        """Heads of module ``name`` whose normalised entropy is below the threshold, and rows left out of its sums."""
        if self.entropy_collapse_threshold > 0 and entropy_normalized is not None:
            for h, value in enumerate(entropy_normalized.tolist()):
                if value < self.entropy_collapse_threshold:
                    self.once(
                        f"collapse:{name}:{h}",
                        f"AttentionMonitor: head {h} of attention module {name!r} has normalised entropy {value:.3f} "
                        f"< entropy_collapse_threshold={self.entropy_collapse_threshold}: nearly every query looks at "
                        "a single key (attention collapse, or a sink).",
                    )
        if skipped_rows > 0:
            self.once(
                f"skipped:{name}",
                f"AttentionMonitor: {skipped_rows} query rows of attention module {name!r} had non-finite "
                "or all-zero weights (fully masked rows? padding that neither `ignore_ids` nor `token_mask` leaves "
                "out? NaN or inf in the model, a float16 overflow say?) and were left out of the sums",
            )

    def row_mass(self, name: str, weights: Tensor, query_valid: Tensor) -> None:
        """Once per module, at its first call: whether its weights ``(b, H, Lq, Lk)`` sum to 1 over the keys in every
        row of a valid query (``(b, Lq)``); said for the first module whose do not. Learned attention sinks (gpt-oss:
        one more logit per head in the softmax, its column dropped) send a share of each row to no token. One sync
        with the device per module, until the warning is said."""
        if "mass" in self._said or f"mass:{name}" in self._said:
            return
        sums = weights.detach().sum(dim=-1, dtype=torch.float64)  # (b, H, Lq)
        rows = sums[query_valid[:, None, :].expand_as(sums) & torch.isfinite(sums) & (sums > 0)]
        if rows.numel() == 0:  # nothing to look at in this call: the next one is
            return
        self._said.add(f"mass:{name}")
        low, high = torch.stack(rows.aminmax()).tolist()
        if low < 0.99 or high > 1.01:  # once for the model: a model with sinks has them in every layer
            self.once(
                "mass",
                f"AttentionMonitor: the attention weights of module {name!r} sum to {low:.3g}–{high:.3g} over the "
                "keys of a row, not 1 (other modules may too; this is said once): its softmax also covers something "
                "that is no key (learned attention sinks, as gpt-oss's), or the weights were changed after it. P's "
                "rows sum to that share, and the statistics of the weights as they are (lift, the position shares "
                "self / previous / next, the distance, the sink mass) read lower (or higher) by it; entropy and drift "
                "renormalise each row.",
            )

    def hidden_keys(
        self, name: str, stream: str, pair_count: Tensor, uniform_sum: Tensor, label: Callable[[list[int]], list[str]]
    ) -> None:
        """Key ids of ``stream`` that stood beside queries in module ``name`` (``C > 0``) but were never visible to any
        (``U = 0``: masked at every position, or weight 0 in every head): padding the monitor was not told of, whose
        positions still count as queries. Looked for in the first module read with each key stream only."""
        if f"checked:{stream}" in self._said:
            return
        self._said.add(f"checked:{stream}")
        hidden = (pair_count.sum(dim=0) > 0) & (uniform_sum.sum(dim=0) == 0)  # (Vk,)
        ids = hidden.nonzero()[:, 0].tolist()
        if ids:
            self.once(
                f"hidden:{stream}",
                f"AttentionMonitor: key token(s) {label(ids[:5])}{' ...' if len(ids) > 5 else ''} of stream "
                f"{stream!r} stood in attention module {name!r}'s sequences but no query ever saw them (masked "
                "everywhere, or weight 0 in every head): padding the monitor was not told of? Their positions still "
                "count as query tokens, in every map and number: add them to `ignore_ids`, or give the batch's "
                "padding mask as `token_mask`.",
            )

    def explorer_name(self, view: str) -> None:
        """View ``view``'s folder in the Attention tab's data would have a name file systems refuse."""
        self.once(
            f"explorer:{view}",
            f"AttentionMonitor: the Attention tab's folder for view {view!r} would be a name longer than 255 bytes, "
            "which file systems refuse; it is left out of the tab (a shorter `prefix`, or `explorer=False`)",
        )


def _names(names: list[str]) -> str:
    """The first two ``names`` quoted, and how many more."""
    return ", ".join(map(repr, names[:2])) + (f" and {len(names) - 2} more" if len(names) > 2 else "")


def _dropout(module: nn.Module) -> float:
    """The dropout rate an attention module applies to its weights in training mode, as far as its attributes tell:
    ``nn.MultiheadAttention``'s ``dropout``; for a Hugging Face module the first of ``attn_dropout`` (GPT-2),
    ``attention_dropout`` (Llama), ``dropout`` (BERT, T5, BART) it has, a rate or an ``nn.Dropout``; 0 when none.
    Other dropouts (GPT-2's ``resid_dropout``) act on the output, not on the weights."""
    if isinstance(module, nn.MultiheadAttention):
        return float(module.dropout)
    for attribute in ("attn_dropout", "attention_dropout", "dropout"):
        rate = getattr(module, attribute, None)
        rate = rate.p if isinstance(rate, nn.Dropout) else rate
        if isinstance(rate, (int, float)) and not isinstance(rate, bool):
            return float(rate)
    return 0.0
