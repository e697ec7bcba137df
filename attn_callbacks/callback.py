"""AttentionMonitor: the Lightning callback, wiring hooks, token streams, epoch sums, drift memory and writers."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from typing_extensions import override

from attn_callbacks import config
from attn_callbacks.accumulate import EpochSums
from attn_callbacks.capture import AttentionCapture, find_attention_modules, module_device, num_heads, output_indices
from attn_callbacks.config import Tokenizer, TokenSource
from attn_callbacks.drift import DriftMemory
from attn_callbacks.probe import Probe
from attn_callbacks.report import Reporter
from attn_callbacks.schedule import Schedule
from attn_callbacks.streams import Streams
from attn_callbacks.writer import export_epoch

__all__ = ["AttentionMonitor"]

_STATE_VERSION = 1
_STREAM_FLAGS = ("ignore_ids", "batch_first", "validate_args")  # arguments Streams validates, kept readable here


class AttentionMonitor(Callback):
    r"""Log which vocabulary items attend to which, per attention layer and head, and how that drifts over epochs.

    During validation it hooks every selected ``torch.nn.MultiheadAttention`` of the LightningModule (stock
    ``nn.Transformer*`` layers included) and every Hugging Face eager attention module, and recomputes the weights of
    every ``scaled_dot_product_attention`` call made by a module that calls it (Hugging Face sdpa models included;
    ``docs/how-it-works.md``), maps each weight to the (query token id, key token id) pair it connects and
    accumulates, on the module's device, the sums of ``docs/reading.md``: ``S[h, a, b]``, ``C[a, b]``, ``Q[a]``,
    ``U[a, b]`` and position sums. At the end of each
    monitored epoch it logs, from ``P = S / Q[:, None]`` per head and its mean ``P̄``: scalars (asymmetry, entropy,
    lift, position statistics, sink mass, drift, skipped rows; per head too) to every logger, and heatmaps and
    tables to TensorBoard. ``docs/tags.md`` lists every tag with its formula.

    Args:
        vocab_size: vocabulary size, or a mapping stream name -> size when streams use different vocabularies.
        token_ids: where the token ids ``(B, L)`` of a batch are: a batch key (mapping key, sequence index or
            attribute), a callable ``batch -> LongTensor``, or a mapping of stream names to either, e.g.
            ``{"src": "src_ids", "tgt": "tgt_ids"}``.
        id_to_token: labels for the heatmap axes: a list, dict or callable id -> str, a Hugging Face tokenizer
            (its ``convert_ids_to_tokens``), or a mapping stream name -> one of those (streams it leaves out show
            ids). Ids are shown when None.
        modules: fnmatch patterns over ``named_modules()`` names selecting the attention modules; all when None.
        attention_streams: fnmatch pattern -> ``(query_stream, key_stream)``, first match wins. Needed only when
            there are several streams and the modules are neither stock ``nn.Transformer`` layers nor a Hugging Face
            encoder-decoder's, fed by streams named ``src`` and ``tgt``.
        ignore_ids: token ids excluded as queries and as keys (padding, say); they may lie outside the vocabulary.
        batch_first: layout of the token id tensors in the batch: ``(B, L)`` when True, ``(L, B)`` when False.
        top_k: how many of the most frequent query and key tokens the heatmaps show.
        per_head: also log per-head scalars and the per-head heatmap grid. When False only the mean of the heads is
            accumulated (``H`` times less memory, a faster update); position statistics stay per head.
        num_pairs: rows of the text tables (one-way pairs, lift pairs, moved tokens, hubs).
        min_support: the least evidence a table or drift row needs: pair count both ways for one-way pairs, pair
            count for lift pairs, query count in both epochs for a row of the drift.
        log_every_n_epochs: monitor every n-th validation epoch of ``trainer.fit``: the 1st, the (n + 1)-th, ...
            (the sanity check not counted); with Lightning's ``check_val_every_n_epoch=c`` validation runs after
            training epochs c - 1, 2c - 1, ..., and every n-th of those is monitored. Other validation epochs are not
            hooked. A ``trainer.validate()`` call is always monitored, and not counted.
        log_sanity_check: also monitor Lightning's sanity-check validation pass (it never becomes a drift epoch).
        validate_args: check token id ranges every batch (one host sync per stream and batch); turn off for speed.
        prefix: the first part of every logged tag.
        drift_reference_epoch: the (training) epoch whose monitored validation drift ``..._ref`` compares against; the
            first monitored epoch when None. When that epoch is not monitored (no validation then, or
            ``log_every_n_epochs`` skips it), the first monitored epoch after it is the reference, with a warning.
        sink_ids: key-vocabulary ids of special tokens ([CLS], [SEP], BOS ...) whose share of attention is logged as
            ``sink_mass``; a sequence for every key stream, or a mapping stream name -> sequence.
        entropy_collapse_threshold: warn once per head when its normalised entropy falls below this (0 disables).
        probe: ``"first"`` freezes the first samples of validation batch 0 at the first monitored epoch and logs
            their position × position attention every epoch (taken from the normal validation pass: the validation
            loader must not shuffle); or a batch of your own, run through ``probe_forward``; None for no probe.
        probe_forward: ``fn(pl_module, batch)`` running the model on a probe batch given in ``probe`` (its output is
            ignored; nothing is logged or accumulated from it except the probe maps).
        probe_samples: how many samples of the probe batch to draw.
        export: also save the raw sums and counts of every monitored epoch as ``"pt"`` or ``"npz"`` files (read them
            back with :func:`attn_callbacks.load_epoch`); None to save nothing.
        export_dir: the folder the files go to; ``{logger log_dir}/attention_epochs`` when None.
        monitor_test: also monitor ``trainer.test()`` epochs, logged under ``{prefix}_test...`` tags (never drift
            epochs). ``predict`` is never monitored.
        max_tracked_tokens: keep exact sums for at most this many ids of a stream (an int for every stream, or a
            mapping stream name -> int) and fold every other id into one ``<other>`` bucket on each axis, so rows
            still sum to 1 and no mass is lost (every scalar counts the bucket; heatmaps and tables show tokens
            only). State then grows with ``K²`` instead of ``V²``. The ids are the
            ``sink_ids`` plus the most frequent ids of the validation set, counted in one pass over the validation
            dataloaders (token ids only, no forward) when the first monitored epoch starts, then frozen (and
            checkpointed) so epochs stay comparable. Streams whose vocabulary is not larger are kept whole.
        tracked_ids: the ids to track instead of counting them: a sequence for every stream, or a mapping stream
            name -> sequence (``sink_ids`` are added); ``max_tracked_tokens`` is not used for a stream given here.
            Other ids fold into ``<other>``.
        memory_budget: the most bytes of sums the callback may hold per device, over all modules and dataloaders
            (a number, or a string such as ``"1GiB"`` or ``"512MB"``); it refuses to start, naming the figure and the
            knobs, rather than run out of memory. None for no limit. The figure is logged either way (again when
            it grows: SDPA calls' sums are allocated, and checked, at their first call).
        color_scale: ``"epoch"`` scales each image to its own largest value; ``"shared"`` gives each image tag one
            scale across epochs, the largest value any monitored epoch has drawn under it so far (kept in
            checkpoints), so colours compare by eye from epoch to epoch once the scale has settled; images drawn
            before it last widened keep their narrower scale (every colour bar shows its numbers).
        limit_batches: monitor only the first this many batches of each evaluation dataloader, then remove the
            hooks (restoring the fused fast path) so the rest runs at full speed: the knob for large validation sets.
            The loader must not shuffle (a warning says so), or drift compares different batches. None for all.

    With several validation dataloaders each gets its own sums, logged with a ``/dataloader_idx_{k}`` suffix, and the
    tags without suffix show all of them combined (drift, probe and export use the combined view). Every argument can
    be set from a ``LightningCLI`` config file: ``docs/options.md`` says how.

    Example:
        >>> monitor = AttentionMonitor(vocab_size=100, token_ids="input_ids", ignore_ids=[0])
        >>> trainer = Trainer(callbacks=[monitor])  # doctest: +SKIP
    """

    def __init__(
        self,
        vocab_size: int | dict[str, int],
        # jsonargparse (LightningCLI) tries union members in order, and saves a value reaching a Callable member as a
        # (broken) import path: mappings come first so SaveConfigCallback's config.yaml reads back (no None inside).
        token_ids: dict[str, TokenSource] | TokenSource = "input_ids",
        id_to_token: (
            Sequence[str]
            | Mapping[int, str]
            | dict[str, Sequence[str] | Mapping[int, str] | Callable[[int], str] | Tokenizer]
            | Callable[[int], str]
            | Tokenizer
            | None
        ) = None,
        modules: Sequence[str] | None = None,
        attention_streams: dict[str, tuple[str, str]] | None = None,
        ignore_ids: Sequence[int] = (),
        batch_first: bool = True,
        top_k: int = 30,
        per_head: bool = True,
        num_pairs: int = 10,
        min_support: int = 5,
        log_every_n_epochs: int = 1,
        log_sanity_check: bool = False,
        validate_args: bool = True,
        prefix: str = "attention",
        drift_reference_epoch: int | None = None,
        sink_ids: Sequence[int] | dict[str, Sequence[int]] = (),
        entropy_collapse_threshold: float = 0.05,
        probe: Literal["first"] | Any | None = None,
        probe_forward: Callable[[LightningModule, Any], Any] | None = None,
        probe_samples: int = 1,
        export: Literal["pt", "npz"] | None = None,
        export_dir: str | Path | None = None,
        monitor_test: bool = False,
        max_tracked_tokens: int | dict[str, int] | None = None,
        tracked_ids: Sequence[int] | dict[str, Sequence[int]] | None = None,
        memory_budget: int | float | str | None = "1GiB",
        color_scale: Literal["epoch", "shared"] = "epoch",
        limit_batches: int | None = None,
    ) -> None:
        self._streams = Streams(
            token_ids,
            vocab_size,
            id_to_token,
            ignore_ids,
            config.flag("batch_first", batch_first),
            config.flag("validate_args", validate_args),
            sink_ids,
            max_tracked_tokens,
            tracked_ids,
        )
        self.ignore_ids, self.batch_first, self.validate_args = (getattr(self._streams, k) for k in _STREAM_FLAGS)
        self.modules = config.check_patterns("modules", modules)
        self.attention_streams = config.check_attention_streams(attention_streams)
        self.top_k = config.positive_int("top_k", top_k)
        self.per_head = config.flag("per_head", per_head)
        self.num_pairs = config.positive_int("num_pairs", num_pairs, minimum=0)
        self.min_support = config.positive_int("min_support", min_support)
        self.log_every_n_epochs = config.positive_int("log_every_n_epochs", log_every_n_epochs)
        self.log_sanity_check = config.flag("log_sanity_check", log_sanity_check)
        self.prefix = config.non_empty_str("prefix", prefix)
        if drift_reference_epoch is not None:
            config.positive_int("drift_reference_epoch", drift_reference_epoch, minimum=0)
        self.drift_reference_epoch = drift_reference_epoch
        self.entropy_collapse_threshold = config.unit_interval("entropy_collapse_threshold", entropy_collapse_threshold)
        self.probe_samples = config.positive_int("probe_samples", probe_samples)
        self._probe = Probe(probe, probe_forward, self.probe_samples)
        self.probe, self.probe_forward = probe, probe_forward
        self.export = config.check_choice("export", export, ("pt", "npz", None))
        self.export_dir = config.check_path("export_dir", export_dir)
        self.monitor_test = config.flag("monitor_test", monitor_test)
        self.memory_budget = None if memory_budget is None else config.parse_bytes("memory_budget", memory_budget)
        self.color_scale = config.check_choice("color_scale", color_scale, ("epoch", "shared"))

        self._sums = EpochSums(self.per_head, self.memory_budget)
        self.limit_batches = None if limit_batches is None else config.positive_int("limit_batches", limit_batches)
        self._schedule = Schedule(self.log_every_n_epochs, self.log_sanity_check, self.limit_batches)
        self._drift = DriftMemory(drift_reference_epoch, self.log_every_n_epochs)
        self._report = Reporter(
            self._streams,
            self._drift,
            self._probe,
            per_head=self.per_head,
            top_k=self.top_k,
            num_pairs=self.num_pairs,
            min_support=self.min_support,
            entropy_collapse_threshold=self.entropy_collapse_threshold,
            color_scale=self.color_scale,
        )
        self._attention: dict[str, nn.Module] = {}
        self._heads: dict[str, int] = {}  # module -> number of heads
        self._devices: dict[str, torch.device] = {}  # SDPA call -> the device of its weights (a module may hold none)
        self._capture: AttentionCapture | None = None
        self._dataloader_idx = 0
        self._stage_prefix = self.prefix  # f"{prefix}_test" while a test epoch is monitored
        self._active = False  # this evaluation epoch is monitored (the hooks may be off for the batches past a limit)
        self._monitored_batches = 0  # batches of this epoch run with the hooks attached

    def __getstate__(self) -> dict[str, Any]:
        # ddp_spawn pickles the Trainer with its callbacks before any hook runs: name the argument that cannot go.
        config.check_picklable(
            token_ids=self._streams.getters,
            id_to_token=self._streams.labels,
            probe=self.probe,
            probe_forward=self.probe_forward,
        )
        return self.__dict__

    def __deepcopy__(self, memo: dict[int, Any]) -> AttentionMonitor:
        # Deep copies need no pickling: skip __getstate__'s check so lambdas stay fine there.
        clone = self.__class__.__new__(self.__class__)
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return clone

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(prefix=self.prefix, modules=self.modules)

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Find the attention modules and decide their token streams; misconfiguration fails here, not mid-epoch."""
        try:
            self._attention = find_attention_modules(pl_module, self.modules)
            self._capture = AttentionCapture(self._attention, self._consume, output_index=output_indices(pl_module))
            # SDPA calls tell their heads (and names past a module's first call) when they run: see _consume. Those an
            # earlier stage saw (fit, then validate) are kept, so that their sums are allocated when epochs start.
            seen = {name: heads for name, heads in self._heads.items() if self._base(name) in self._capture.watched}
            self._heads = {
                name: num_heads(module, name)
                for name, module in self._attention.items()
                if name not in self._capture.watched
            }
            self._heads.update(seen)
            self._devices = {}  # this stage's model may live elsewhere: learnt again at the first calls
            self._streams.wire(list(self._attention), pl_module, self.attention_streams)
            for name in seen:
                self._wire_call(name)
            self._streams.check_sinks()
        except ValueError as err:
            raise MisconfigurationException(f"AttentionMonitor: {err}") from err
        self._sums.check_budget(self._shapes(), loaders=1)  # fails before training; again with the real loaders

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._schedule.epoch(trainer):
            self._start(trainer, self.prefix)

    @override
    def on_test_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.monitor_test:
            self._start(trainer, f"{self.prefix}_test")

    @override
    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._streams.start_batch(batch)
        self._sums.start_batch()
        self._probe.capturing = False
        self._dataloader_idx = dataloader_idx
        if self._capture is None or not self._active:
            return
        if not self._schedule.batch(batch_idx):
            self._capture.detach()  # past the limit: the rest of this loader runs with the fast path
        else:
            self._capture.attach()  # a no-op unless a new loader starts after a limit
            self._capture.start_watching()  # SDPA calls: this batch only, left in on_validation_batch_end
            self._monitored_batches += 1
            # Read (and check) the ids before the model runs, so bad ids fail here with a clear message.
            ids = {stream: self._streams.read(stream, pl_module.device)[2] for stream in self._streams.used()}
            first = batch_idx == 0 and dataloader_idx == 0 and not (trainer.sanity_checking or trainer.testing)
            if self.probe == "first" and first:
                self._probe.capturing = self._probe.match(ids)

    @override
    def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:  # (trainer, pl_module, outputs, batch, ...)
        if self._capture is not None:
            self._capture.stop_watching()
        self._streams.end_batch()  # and with it, the probe's capture: a call outside a batch is refused

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._active:
            return
        drift_epoch = not (trainer.sanity_checking or trainer.testing)
        silent = self._warn_silent_modules()  # before the probe's own batch adds its calls
        try:
            if self._probe.own_batch and drift_epoch:
                self._capture.attach()  # detached after `limit_batches`
                with self._capture.watching():
                    self._probe.run(pl_module, self._streams)
        finally:
            self._release()
        if self._capture.watched:  # processes may have seen different SDPA calls: agree first (a collective)
            for name, (heads, _, _) in self._sums.agree(pl_module.device).items():
                self._wire_call(name)
                self._heads[name], self._devices[name] = heads, pl_module.device
        per_loader, merged = self._sums.collect()  # a collective under DDP
        if not any(int(stats.query_count.sum()) for stats in merged.values()):
            if not self._monitored_batches:
                self._report.warn_once(
                    "no_batches",
                    "AttentionMonitor: no batch ran in this monitored epoch (empty dataloaders?), so "
                    "nothing is logged for it.",
                )
            elif len(silent) < len(self._attention):  # some module ran: its every query token was ignored
                self._report.warn_once(
                    "empty",
                    "AttentionMonitor: no valid query token was seen in this epoch (every id in `ignore_ids`?), so "
                    "nothing is logged for it.",
                )
        else:
            if drift_epoch and self.export is not None:  # first: the epoch end computes P where S lies
                export_epoch(trainer, merged, self._streams, self.export, self.export_dir)
            derived = self._report.epoch(trainer, per_loader, merged, self._stage_prefix, drift_epoch)
            if drift_epoch:
                masses = {name: (s.attention_mass, s.query_count, derived.get(name, {})) for name, s in merged.items()}
                self._drift.remember(trainer.current_epoch, masses)
        self._reset_sums()

    # A monitored test epoch runs as a validation epoch does, under its own tags.
    on_test_batch_start = on_validation_batch_start
    on_test_batch_end = on_validation_batch_end
    on_test_epoch_end = on_validation_epoch_end

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._release()
        self._reset_sums()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._release()

    @override
    def state_dict(self) -> dict[str, Any]:
        """What drift, the probe and colour scales need after a resume (tensors only: ``weights_only=True`` loads it):
        previous and reference ``P`` per head, ``Q``, row entropies and epochs; probe, tracked ids; colour limits."""
        return {
            "version": _STATE_VERSION,
            **self._drift.state_dict(),
            "validation_epochs": self._schedule.validation_epochs,
            "probe_ids": self._probe.ids,
            "tracked_ids": dict(self._streams.tracked),
            "color_limits": dict(self._report.images.limits),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != _STATE_VERSION:
            raise ValueError(
                f"AttentionMonitor: checkpoint state version {state_dict.get('version')!r} is not {_STATE_VERSION}"
            )
        self._drift.load_state_dict(state_dict)
        self._schedule.validation_epochs = state_dict.get("validation_epochs")
        self._probe.ids = state_dict["probe_ids"]
        self._streams.load_tracked(state_dict.get("tracked_ids") or {})
        self._report.images.limits = dict(state_dict.get("color_limits") or {})

    def _shapes(self) -> dict[str, tuple[int, int, int]]:
        """Every module's ``(H, Vq, Vk)`` as accumulated (a stream still to be tracked counts with its limit), of the
        modules whose heads are known: all but SDPA calls not seen yet."""
        size = self._streams.planned_size
        return {name: (heads, *(size(s) for s in self._streams.of[name])) for name, heads in self._heads.items()}

    def _start(self, trainer: Trainer, stage_prefix: str) -> None:
        """Fresh sums for every (module, dataloader) on the module's device, then attach the hooks."""
        if self._capture is None:
            return
        # Known before the epoch starts, and the same on every rank, so DDP ranks hold the same metrics.
        if trainer.testing:
            loaders, limits = trainer.test_dataloaders, trainer.num_test_batches
        else:
            loaders, limits = trainer.val_dataloaders, trainer.num_val_batches
        batches = trainer.num_sanity_val_batches if trainer.sanity_checking else limits
        self._stage_prefix = stage_prefix
        with torch.inference_mode(False):
            self._streams.choose_tracked(loaders, limits, trainer.strategy)
            home = trainer.lightning_module.device  # for a module holding no tensor whose calls were not seen here
            devices = {
                name: self._devices.get(name) or module_device(self._module_of(name), home) for name in self._heads
            }
            self._sums.start(self._shapes(), devices, max(len(batches), 1))
        self._schedule.check_loaders(loaders)
        self._probe.weights.clear()
        self._capture.reset_calls()
        self._monitored_batches = 0
        self._capture.attach()
        self._active = True

    def _warn_silent_modules(self) -> list[str]:
        """Warn (once per set of names) when hooked modules never ran in the epoch's monitored batches; return them."""
        calls = self._capture.calls if self._capture is not None else {}
        silent = [name for name, count in calls.items() if count == 0]
        if silent and self._monitored_batches:
            has_stance = hasattr(torch.compiler, "set_stance")
            cause = (
                "a compiled graph that skips module hooks: this torch has no `torch.compiler.set_stance` to run it "
                "eagerly while monitored, so set `torch._dynamo.config.skip_nnmodule_hook_guards = False` before "
                "compiling"
                if not has_stance
                else "code run outside the LightningModule's modules (a copy of the model, a compiled function "
                "that does not call the modules' forward)"
            )
            self._report.warn_once(
                f"silent:{','.join(silent)}",
                f"AttentionMonitor: attention module(s) {', '.join(map(repr, silent))} were hooked for "
                f"{self._monitored_batches} monitored batch(es) but never ran, so nothing was seen of "
                f"them. Either validation_step does not call them (leave them out with `modules=`), or {cause}.",
            )
        return silent

    def _reset_sums(self) -> None:
        self._sums.reset(recycle=self._drift.state_buffer)
        self._probe.weights.clear()

    def _release(self) -> None:
        """Detach the hooks and drop the batch; stop the image writer of a failed epoch end, if one runs."""
        self._report.painter.finish(raise_errors=False)
        self._active = False
        if self._capture is not None:
            self._capture.detach()
        self._streams.end_batch()
        self._probe.capturing = self._probe.only = False

    def _consume(self, name: str, module: nn.Module, weights: Tensor, rows: slice) -> None:
        if self._streams.batch is None:
            raise RuntimeError(
                f"AttentionMonitor: attention module {name!r} ran outside a validation batch while hooked"
            )
        if weights.dim() == 3:  # unbatched call: (H, Lq, Lk)
            weights = weights.unsqueeze(0)
        if name not in self._heads:  # an SDPA call seen for the first time: its heads are the call's
            self._first_call(name, weights)
        elif weights.size(1) != self._heads[name]:
            raise RuntimeError(
                f"AttentionMonitor: attention module {name!r} returned weights with {weights.size(1)} heads, where its "
                f"earlier calls had {self._heads[name]}"
            )
        streams = self._streams.of[name]
        query, key = self._streams.read_pair(name, streams, weights, rows)
        self._probe.keep(name, weights, rows)
        if self._probe.only:
            return
        # <other> comes right after a tracked stream's tokens; an untracked stream's tokens end nowhere (None).
        query_other, key_other = (self._streams.tokens(stream).stop for stream in streams)
        other = None if query_other is None or key_other is None else (query_other, key_other)
        self._sums.add(name, self._dataloader_idx, streams, weights, query, key, rows, other)

    def _base(self, name: str) -> str:
        """The module of a name: a module's k-th SDPA call, ``f"{module}.call{k}"``, is the module's."""
        return name if name in self._attention else name.rpartition(".call")[0]

    def _module_of(self, name: str) -> nn.Module:
        return self._attention[self._base(name)]

    def _wire_call(self, name: str) -> None:
        if name not in self._streams.of:  # a module's k-th call, "{module}.call{k}"
            self._streams.wire_call(name, self._base(name), self.attention_streams)

    def _first_call(self, name: str, weights: Tensor) -> None:
        """Wire and allocate the sums of an SDPA call (a module's first, or its k-th call of a batch) seen for the first
        time; kept for later epochs, which allocate it when they start."""
        self._wire_call(name)
        pending = [stream for stream in self._streams.of[name] if self._streams.pending(stream)]
        if pending:
            raise RuntimeError(
                f"AttentionMonitor: SDPA call {name!r} reads stream(s) {pending}, whose tracked ids are chosen "
                "when the first monitored epoch starts, from the streams of the modules found in setup; map the call "
                "to those streams in `attention_streams`, or give `tracked_ids` for these streams"
            )
        self._heads[name], self._devices[name] = weights.size(1), weights.device
        size = self._streams.size
        self._sums.allocate(name, (weights.size(1), *(size(s) for s in self._streams.of[name])), weights.device)
