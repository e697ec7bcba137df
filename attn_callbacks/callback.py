"""AttentionMonitor: the Lightning callback, wiring hooks, token streams, epoch sums, drift memory and writers."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from typing_extensions import override

from attn_callbacks.capture.find import find_attention_modules, output_indices
from attn_callbacks.capture.hooks import AttentionCapture
from attn_callbacks.options import MonitorOptions
from attn_callbacks.output.epoch_files import discard, export_directory, export_epoch

__all__ = ["AttentionMonitor"]

_STATE_VERSION = 1


class AttentionMonitor(MonitorOptions, Callback):
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

    Its arguments are those of :class:`~attn_callbacks.options.MonitorOptions` (every one is listed, with its type and
    default, in ``docs/options.md``).

    Example:
        >>> monitor = AttentionMonitor(vocab_size=100, token_ids="input_ids", ignore_ids=[0])
        >>> trainer = Trainer(callbacks=[monitor])  # doctest: +SKIP
    """

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(prefix=self.prefix, modules=self.modules)

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Find the attention modules and decide their token streams; misconfiguration fails here, not mid-epoch."""
        try:
            modules = find_attention_modules(pl_module, self.modules)
            self._capture = AttentionCapture(
                modules,
                self._consume,
                output_index=output_indices(pl_module),
                expect=self._expected,
                skip_generate=True,  # decoding attends over cached tokens the batch does not hold
            )
            kept_calls = self._sites.setup(modules, self._capture.watched)
            self._streams.wire(list(modules), pl_module, self.attention_streams)
            for name in kept_calls:
                self._streams.wire_call(name, self._sites.base(name), self.attention_streams)
            self._streams.check_sinks()
            if self.export is not None:
                export_directory(trainer, self.export_dir)  # a file in the way fails now, not after an epoch
        except ValueError as err:
            raise MisconfigurationException(f"AttentionMonitor: {err}") from err
        self._check_prefixes(trainer)
        self._sums.check_budget(self._shapes(), loaders=1)  # fails before training; again with the real loaders
        self._report.drawing.start(trainer, self.draw_in_background)  # its start-up overlaps the sanity pass
        self._census_due = True

    @override
    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._check_budget(trainer)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._check_budget(trainer)
        last = trainer.max_epochs
        if self.drift_reference_epoch is not None and last is not None and 0 <= last <= self.drift_reference_epoch:
            self._report.warnings.once(
                "reference_epoch",
                f"AttentionMonitor: argument `drift_reference_epoch`={self.drift_reference_epoch} is not an epoch of "
                f"this fit (max_epochs={last}), so no epoch becomes the reference and no `drift/..._ref` is logged.",
            )

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._report.drawing.check()  # the last epoch's pictures, drawn in the background
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
            return
        self._capture.attach()  # a no-op unless a new loader starts after a limit
        self._capture.start_watching()  # SDPA calls: this batch only, left in on_validation_batch_end
        self._monitored_batches += 1
        self._calls_before = dict(self._capture.calls)
        if self._census_due:  # once per setup: attention that no module found makes, called in this batch
            self._capture.start_census(pl_module)
        # Read (and check) the ids before the model runs, so bad ids fail here with a clear message.
        read = {stream: self._streams.read(stream, pl_module.device) for stream in self._streams.used()}
        first = batch_idx == 0 and dataloader_idx == 0 and not (trainer.sanity_checking or trainer.testing)
        if self.probe == "first" and first:
            self._probe.capturing = self._probe.match(read)

    @override
    def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:  # (trainer, pl_module, outputs, batch, ...)
        if self._capture is not None:
            self._capture.finish_batch()
            self._capture.stop_watching()
            # A hooked module's calls add into its one set of sums; an SDPA call after the first is summed apart.
            for name, count in self._capture.calls.items():
                if name in self._calls_before and name not in self._capture.watched:
                    self._report.warnings.repeated(name, count - self._calls_before[name], self._streams.of[name])
            self._calls_before = {}
            if self._census_due and self._active:
                self._census_due = False
                self._report.warnings.unseen_sdpa(self._capture.stop_census())
        self._streams.end_batch()  # and with it, the probe's capture: a call outside a batch is refused

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._active:
            return
        drift_epoch = not (trainer.sanity_checking or trainer.testing)
        # Before the probe's own batch. A module found by a softmax and a product in its code that read nothing is
        # not attention (an output head, a router; one run in training only), or took softmaxes over the keys it
        # could not read (named apart); unless nothing at all was read.
        unread, hand = self._capture.by_hand.unread, self._capture.by_hand.hand_only
        ran, generated = self._capture.ran(), self._capture.generated
        silent = [name for name, count in self._capture.calls.items() if count == 0 and name not in unread]
        if len(silent) < len(self._capture.calls):
            silent = [name for name in silent if name not in hand]
        only_generated = [name for name in silent if name in generated and name not in ran]  # said apart
        quiet = [name for name in silent if name not in only_generated]
        self._report.warnings.silent(quiet, self._monitored_batches, ran, hand)
        self._report.warnings.unread(self._capture.by_hand.unread)
        read = any(self._capture.calls.values())  # before the probe's own batch adds its reads
        outside = bool(ran) or read  # some module ran outside generate()
        self._report.warnings.generated(generated, sorted(self._capture.generators), only_generated, outside)
        try:
            if self._probe.own_batch and drift_epoch:
                self._capture.attach()  # detached after `limit_batches`
                with self._capture.watching():
                    self._probe.run(pl_module, self._streams, self._capture.finish_batch)
                self._report.warnings.unread(self._capture.by_hand.unread)  # a loop that does not fit the probe
        finally:
            self._release()
        if self._capture.watched:  # processes may have seen different SDPA calls: agree first (a collective)
            for name, (heads, _, _) in self._sums.agree(pl_module.device).items():
                self._streams.wire_call(name, self._sites.base(name), self.attention_streams)
                self._sites.heads[name], self._sites.devices[name] = heads, pl_module.device
        per_loader, merged = self._sums.collect()  # a collective under DDP
        # A module whose every row was dropped (NaN weights) still reports its skipped rows, and warns.
        if not any(int(stats.query_count.sum()) or int(stats.skipped_rows) for stats in merged.values()):
            self._report.warnings.nothing_seen(self._monitored_batches, read)
        else:
            exported = None
            try:
                # First: the epoch end computes P where S lies. Not under fast_dev_run, which keeps no file either.
                if drift_epoch and self.export is not None and not trainer.fast_dev_run:
                    exported = export_epoch(
                        trainer, merged, self._streams, self.export, self.export_dir, self._stage_prefix
                    )
                derived = self._report.epoch(trainer, per_loader, merged, self._stage_prefix, drift_epoch)
                if drift_epoch:
                    masses = {n: (s.attention_mass, s.query_count, derived.get(n, {})) for n, s in merged.items()}
                    self._drift.remember(trainer.current_epoch, masses)
            except BaseException:
                discard(exported)  # a failed epoch leaves no export
                raise
        self._reset_sums()

    # A monitored test epoch runs as a validation epoch does, under its own tags.
    on_test_batch_start = on_validation_batch_start
    on_test_batch_end = on_validation_batch_end
    on_test_epoch_end = on_validation_epoch_end

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._release()
        self._reset_sums()
        self._report.drawing.stop(abort=True)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._release()
        self._report.drawing.stop()  # after the pictures still being drawn; raises its error

    @override
    def state_dict(self) -> dict[str, Any]:
        """What drift, the probe and colour scales need after a resume (tensors only: ``weights_only=True`` loads it):
        previous and reference ``P`` per head, ``Q``, row entropies and epochs; probe, tracked ids; colour limits.
        Like ``nn.Module.state_dict``, the tensors are the monitor's own: copy them to keep them past an epoch end."""
        return {
            "version": _STATE_VERSION,
            **self._drift.state_dict(),
            "validation_epochs": self._schedule.validation_epochs,
            "probe_ids": self._probe.ids,
            "probe_valid": self._probe.valid,
            "tracked_ids": dict(self._streams.tracked),
            "track_limits": dict(self._streams.track_limit),
            **self._report.state_dict(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != _STATE_VERSION:
            raise ValueError(
                f"AttentionMonitor: checkpoint state version {state_dict.get('version')!r} is not {_STATE_VERSION}"
            )
        self._drift.load_state_dict(state_dict)
        self._schedule.validation_epochs = state_dict.get("validation_epochs")
        self._probe.ids, self._probe.valid = state_dict["probe_ids"], state_dict.get("probe_valid")
        self._load_tracked(state_dict.get("tracked_ids") or {}, state_dict.get("track_limits"))
        self._report.load_state_dict(state_dict)

    def _load_tracked(self, tracked: dict[str, Tensor], limits: dict[str, int] | None) -> None:
        """The checkpoint's tracked ids win (epochs stay comparable), but never silently over other arguments
        (``limits``: the checkpointed monitor's ``max_tracked_tokens``, None from a checkpoint without them)."""
        streams = self._streams
        for stream, ids in tracked.items():
            vocab, limit = streams.vocab.get(stream), streams.track_limit.get(stream)
            given = streams.tracked.get(stream)
            if vocab is None or (len(ids) and int(ids.max()) >= vocab):
                held = f"stream {stream!r} with ids up to {int(ids.max()) if len(ids) else '-'}"
                what = f"has no such stream ({streams.names})" if vocab is None else f"has `vocab_size`={vocab}"
                raise ValueError(
                    f"AttentionMonitor: the checkpoint tracks {held}, but this monitor {what}: resume with the "
                    "streams and vocabulary the checkpoint was written with."
                )
            missing = sorted(set(streams.sinks.get(stream, [])) - set(ids.tolist()))
            if missing:  # sinks are always tracked: their share would be looked up in a row that is not there
                raise ValueError(
                    f"AttentionMonitor: argument `sink_ids` names ids {missing} of stream {stream!r}, but the "
                    f"checkpoint tracks {len(ids)} ids of that stream without them: resume with the `sink_ids` the "
                    "checkpoint was written with (its tracked ids stay fixed, so that epochs stay comparable)."
                )
            if given is not None and not torch.equal(given, ids):
                changed = f"`tracked_ids` ({len(given)} ids)"
            elif given is None and (
                limit is None or len(ids) > limit or (limits is not None and limits.get(stream) != limit)
            ):
                changed = "no tracking" if limit is None else f"`max_tracked_tokens`={limit}"
            else:
                continue
            self._report.warnings.once(
                f"tracked:{stream}",
                f"AttentionMonitor: the checkpoint tracks {len(ids)} ids of stream {stream!r}; they are kept, so that "
                f"epochs stay comparable, and this monitor's {changed} is not used.",
            )
        streams.load_tracked(tracked)

    def _check_budget(self, trainer: Trainer) -> None:
        """Each validation dataloader holds sums of its own: with several, check the budget as soon as they are known
        (before the sanity pass and before training), not at the first monitored epoch, after a training epoch."""
        loaders = len(trainer.num_val_batches or [])
        if self._capture is not None and loaders > 1:
            self._sums.check_budget(self._shapes(), loaders=loaders)

    def _shapes(self) -> dict[str, tuple[int, int, int]]:
        """Every site's ``(H, Vq, Vk)`` as accumulated (a stream still to be tracked counts with its limit)."""
        return self._sites.shapes(self._streams.planned_size, self._streams.of)

    def _start(self, trainer: Trainer, stage_prefix: str) -> None:
        """Fresh sums for every (site, dataloader) on the site's device, then attach the hooks."""
        if self._capture is None:
            return
        loaders, limits, num_loaders = self._schedule.loaders(trainer)
        self._stage_prefix = stage_prefix
        with torch.inference_mode(False):
            self._streams.choose_tracked(loaders, limits, trainer.strategy)
            home = trainer.lightning_module.device  # for a module holding no tensor whose calls were not seen here
            devices = {name: self._sites.device(name, home) for name in self._sites.heads}
            self._sums.start(self._shapes(), devices, num_loaders)
        self._schedule.check_loaders(loaders)
        self._probe.weights.clear()
        self._capture.reset_calls()
        self._monitored_batches = 0
        self._capture.attach()
        self._active = True

    def _reset_sums(self) -> None:
        self._sums.reset(recycle=self._drift.state_buffer)
        self._probe.weights.clear()

    def _release(self) -> None:
        """Detach the hooks and drop the batch; stop the image writer of a failed epoch end, if one runs."""
        self._report.close()
        self._active = False
        if self._capture is not None:
            self._capture.detach()
        self._streams.end_batch()
        self._probe.capturing = self._probe.only = False

    def _expected(self, site: str, device: torch.device) -> tuple[int, int, int] | None:
        """``(B, Lq, Lk)`` of a site's token streams in the current batch (a softmax computed by hand must fit)."""
        return self._streams.expected(site, self._sites.base(site), self.attention_streams, device)

    def _consume(
        self, name: str, module: nn.Module, weights: Tensor, rows: slice, batch: int, allowed: Tensor | None = None
    ) -> None:
        """The hooks' hand-off: one call's weights (and the keys its mask allows) to the probe and to the sums of its
        site."""
        if self._streams.batch is None:
            raise RuntimeError(
                f"AttentionMonitor: attention module {name!r} ran outside a validation batch while hooked"
            )
        weights, first_call = self._sites.check(name, weights)
        if first_call:  # an SDPA call seen for the first time: wired, checked and allocated now, kept for later epochs
            base = self._sites.base(name)
            if self._streams.wire_call(name, base, self.attention_streams):
                # A second pass of one encoder over other inputs (a bi-encoder's pair) lands here too, on the wrong ids.
                # Once per module: a layer shared by 12 (ALBERT) makes 11 such calls.
                self._report.warnings.once(
                    f"call:{base}",
                    f"AttentionMonitor: module {base!r} computed attention again in the same batch (a second "
                    "scaled_dot_product_attention call, or a second softmax over its scores); "
                    f"such calls are summed apart ({name!r}, ...), read against the module's own streams "
                    f"{self._streams.of[name]}. If they attend over other tokens (the same encoder run on a second "
                    f"input, say), name their streams in `attention_streams` (a pattern matching {name!r})",
                )
            self._streams.check_call(name)
            self._sums.allocate(name, self._shapes()[name], weights.device)
        streams = self._streams.of[name]
        query, key = self._streams.read_pair(name, streams, weights, rows, batch)
        self._report.warnings.row_mass(name, weights, query[1])
        # Watched modules' weights come before dropout (SDPA's recomputed, a softmax's output): hooked ones' after it.
        if module.training and self._sites.base(name) not in self._capture.watched:
            self._report.warnings.training_mode(name, module)
        self._probe.keep(name, weights, rows)
        if not self._probe.only:
            other = self._streams.other_cell(streams)
            self._sums.add(name, self._dataloader_idx, streams, weights, query, key, rows, other, allowed)
