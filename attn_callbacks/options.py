"""The constructor of :class:`~attn_callbacks.AttentionMonitor`: every argument, its documentation and its check,
and the parts the callback's hooks hand work to (token streams, epoch sums, schedule, drift memory, report)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from attn_callbacks.base import config
from attn_callbacks.base.config import Tokenizer, TokenLookup, TokenSource
from attn_callbacks.capture.hooks import AttentionCapture
from attn_callbacks.capture.probe import Probe
from attn_callbacks.capture.sites import AttentionSites
from attn_callbacks.capture.streams import Streams
from attn_callbacks.metrics.drift_memory import DriftMemory
from attn_callbacks.output.epoch_files import check_export_dir
from attn_callbacks.output.report import Reporter
from attn_callbacks.schedule import Schedule
from attn_callbacks.sums.epoch_sums import EpochSums

__all__ = ["MonitorOptions"]

_STREAM_FLAGS = ("ignore_ids", "batch_first", "validate_args")  # arguments Streams validates, kept readable here


class MonitorOptions:
    r"""The arguments of :class:`~attn_callbacks.AttentionMonitor`, checked eagerly, and the parts built from them.

    Args:
        vocab_size: vocabulary size, or a mapping stream name -> size when streams use different vocabularies.
        token_ids: where the token ids ``(B, L)`` of a batch are: a batch key (mapping key, sequence index or
            attribute), a callable ``batch -> LongTensor``, or a mapping of stream names to either, e.g.
            ``{"src": "src_ids", "tgt": "tgt_ids"}``.
        id_to_token: labels for the heatmap axes: a list, dict or callable id -> str, a Hugging Face tokenizer
            (its ``convert_ids_to_tokens``), a ``tokenizers.Tokenizer`` (its ``id_to_token``), or a mapping stream
            name -> one of those (streams it leaves out show ids). Ids are shown when None.
        modules: fnmatch patterns over ``named_modules()`` names selecting the attention modules; all when None.
        attention_streams: fnmatch pattern -> ``(query_stream, key_stream)``, first match wins. Needed only when
            there are several streams and the modules are neither stock ``nn.Transformer`` layers nor a Hugging Face
            encoder-decoder's, fed by streams named ``src`` and ``tgt``; or with one stream for a decoder's attention
            (``nn.TransformerDecoderLayer``, an encoder-decoder's decoder), which reads target tokens: a
            decoder-only model built from such layers says ``{"*": (stream, stream)}``.
        ignore_ids: token ids excluded as queries and as keys (padding, say); they may lie outside the vocabulary.
        batch_first: layout of the token id tensors in the batch: ``(B, L)`` when True, ``(L, B)`` when False.
        top_k: how many of the most frequent query and key tokens the heatmaps show.
        per_head: also log per-head scalars and the per-head heatmap grid. When False only the mean of the heads is
            accumulated: the sums take ``16·Vq·Vk`` bytes instead of ``(4H + 12)·Vq·Vk`` (2.75× less at 8 heads,
            as the pair counts stay), and a monitored epoch's end takes about half as long on the CPU (see
            docs/performance.md); the position statistics are still summed per head for their layer values (the
            mean over heads), but no per-head tag is logged.
        num_pairs: rows of the text tables (one-way pairs, lift pairs, moved tokens, hubs); 0 for no tables.
        min_support: the least evidence a table or drift row needs: pair count both ways for one-way pairs, pair
            count for lift pairs, query count in both epochs for a row of the drift.
        log_every_n_epochs: monitor every n-th validation epoch of ``trainer.fit``: the 1st, the (n + 1)-th, ...
            (the sanity check not counted); with Lightning's ``check_val_every_n_epoch=c`` validation runs after
            training epochs c - 1, 2c - 1, ..., and every n-th of those is monitored. Other validation epochs are not
            hooked. A ``trainer.validate()`` call is always monitored, and not counted.
        log_sanity_check: also monitor Lightning's sanity-check validation pass (it never becomes a drift epoch); its
            scalars are logged at step 0, straight to the loggers (Lightning drops what the sanity pass logs).
        validate_args: check token id ranges every batch (one host sync per stream and batch); turn off for speed.
            Unchecked, an id outside an untracked stream's vocabulary stops the scatter: an exception on the CPU, a
            device-side assert on a GPU, after which that process's CUDA context is unusable.
        prefix: the first part of every logged tag.
        drift_reference_epoch: the (training) epoch whose monitored validation drift ``..._ref`` compares against; the
            first monitored epoch when None. When that epoch is not monitored (no validation then, or
            ``log_every_n_epochs`` skips it), the first monitored epoch after it is the reference, with a warning.
            A ``trainer.validate()`` is a monitored epoch too, at the trainer's current epoch: run before ``fit``, it
            is epoch 0, the untrained model's attention, and becomes the reference by default.
        sink_ids: key-vocabulary ids of special tokens ([CLS], [SEP], BOS ...) whose share of attention is logged as
            ``sink_mass``; a sequence for every key stream, or a mapping stream name -> sequence.
        entropy_collapse_threshold: warn once per head when its normalised entropy falls below this (0 disables).
        probe: ``"first"`` freezes the first samples of validation batch 0 at the first monitored epoch and logs
            their position × position attention every epoch (taken from the normal validation pass: the validation
            loader must not shuffle); or a batch of your own, run through ``probe_forward``; None for no probe.
        probe_forward: ``fn(pl_module, batch)`` running the model on a probe batch given in ``probe`` (its output is
            ignored; nothing is logged or accumulated from it except the probe maps).
        probe_samples: how many samples of the probe batch to draw.
        export: also save the raw sums and counts of every monitored validation epoch (not the sanity pass, test
            epochs or a ``fast_dev_run``) as ``"pt"`` or ``"npz"`` files (read them back with
            :func:`attn_callbacks.load_epoch`); None to save nothing.
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
            it grows: SDPA calls' sums are allocated, and checked, at their first call). The torch step (a GPU; the
            CPU without numba) sums each batch in a transient copy of one module's sums, which the figure leaves out.
        color_scale: ``"epoch"`` scales each image to its own largest value, rounded up to a round number (1, 1.2,
            1.4, 1.6, 2, 2.4, 3, 4, 5, 6 or 8 times a power of 10, so the colour bar's quarter marks read short);
            ``"shared"`` gives each image tag one scale across epochs, the largest such top any monitored epoch has
            drawn under it so far (kept in checkpoints), so colours compare by eye from epoch to epoch once the scale
            has settled; images drawn before it last widened keep their narrower scale (every colour bar shows its
            numbers).
        limit_batches: monitor only the first this many batches of each evaluation dataloader, then remove the
            hooks (restoring the fused fast path) so the rest runs at full speed: the knob for large validation sets.
            The loader must not shuffle (a warning says so), or drift compares different batches. None for all.
        explorer: write what TensorBoard's "Attention" tab shows (``docs/explorer.md``) into
            ``{logger log_dir}/plugins/attention_explorer/`` every monitored epoch (rank 0, with a TensorBoard
            logger): per module, ``P`` of the head mean and of each head, pair counts and the lift baseline over the
            most frequent tracked tokens, with their labels and query counts.
        explorer_size: the most bytes one module's explorer file may take per epoch (a number or a string such as
            ``"2MB"``); it sets how many of the most frequent tokens are kept, ``n`` with
            ``(heads + 3) * n² * 4 + 96 * n <= explorer_size`` (self-attention; ``192 * n`` for cross-attention's
            two token lists): 212 tokens for 8 heads at the default.
        compile_step: compute each batch's masks, ``U``, row statistics and position sums with ``torch.compile``
            (fused kernels; the scatters into the sums stay eager) wherever the torch step runs: on GPUs, and on CPU
            only with ``ATTN_CALLBACKS_NUMBA=0`` (numba's kernel runs there otherwise). The first batch compiles,
            a later change of length compiles once more with dynamic shapes; a compile error falls back to the eager
            step with one warning. The same sums up to float rounding. Off by default: not yet measured on a GPU.
        draw_in_background: draw the heatmaps and head grids in a process of their own (started at ``setup``, on
            global rank 0, with a TensorBoard logger; numpy and matplotlib, no torch), so that the epoch end returns
            once the statistics are logged and the pictures handed off; each picture is logged at its epoch's step
            when drawn, the same bytes as drawn in process (matplotlib's ``rcParams`` as they were at ``setup``:
            change them before the Trainer starts). The pictures fall at most one epoch behind: an epoch end first
            waits (120 s at most) for those of the epoch ends before the last. Its errors are raised, with its
            traceback, at the next validation epoch or at ``teardown``, which waits for the pictures still being
            drawn. None: on when the
            Trainer's device is not the CPU (on the CPU the process takes cores from training:
            ``docs/performance.md``).
        token_mask: where a stream's padding mask is, for padding that cannot be told by id (GPT-2 set-ups pad with
            the end-of-text token, which real text holds too): a batch key or a callable ``batch -> Tensor`` giving a
            bool or integer ``(B, L)`` tensor, nonzero at real tokens (Hugging Face's ``attention_mask``), laid out
            like the stream's ids; with several streams, a mapping stream name -> either (``{"src": "attention_mask",
            "tgt": "decoder_attention_mask"}``; streams left out have no mask). Positions where it is 0 are left out
            as queries and as keys, like ``ignore_ids`` (both apply). PyTorch's ``key_padding_mask`` is True at
            padding: give ``lambda batch: ~batch["padding_mask"]``.

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
            | dict[str, Sequence[str] | Mapping[int, str] | Callable[[int], str] | Tokenizer | TokenLookup]
            | Callable[[int], str]
            | Tokenizer
            | TokenLookup
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
        explorer: bool = True,
        explorer_size: int | float | str = "2MB",
        compile_step: bool = False,
        draw_in_background: bool | None = None,
        token_mask: dict[str, TokenSource] | TokenSource | None = None,
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
            token_mask,
        )
        self.token_mask = token_mask
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
        self.probe, self.probe_forward = probe, probe_forward
        self.export = config.check_choice("export", export, ("pt", "npz", None))
        self.export_dir = config.check_path("export_dir", export_dir)
        if self.export is not None and self.export_dir:  # a file in the way fails now (None: checked in setup)
            check_export_dir(self.export_dir)
        self.monitor_test = config.flag("monitor_test", monitor_test)
        self.memory_budget = None if memory_budget is None else config.parse_bytes("memory_budget", memory_budget)
        self.color_scale = config.check_choice("color_scale", color_scale, ("epoch", "shared"))
        self.limit_batches = None if limit_batches is None else config.positive_int("limit_batches", limit_batches)
        self.explorer = config.flag("explorer", explorer)
        self.explorer_size = config.parse_bytes("explorer_size", explorer_size)
        self.compile_step = config.flag("compile_step", compile_step)
        self.draw_in_background = (
            None if draw_in_background is None else config.flag("draw_in_background", draw_in_background)
        )

        self._probe = Probe(probe, probe_forward, self.probe_samples)
        self._sums = EpochSums(self.per_head, self.memory_budget, self.compile_step)
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
            explorer_size=self.explorer_size if self.explorer else None,
        )
        self._sites = AttentionSites()
        self._capture: AttentionCapture | None = None
        self._dataloader_idx = 0
        self._stage_prefix = self.prefix  # f"{prefix}_test" while a test epoch is monitored
        self._active = False  # this evaluation epoch is monitored (the hooks may be off for the batches past a limit)
        self._monitored_batches = 0  # batches of this epoch run with the hooks attached
        self._calls_before: dict[str, int] = {}  # each module's calls before this monitored batch
        self._census_due = False  # look for SDPA calls outside the modules found in the next monitored batch

    def _check_prefixes(self, trainer: Any) -> None:
        """Refuse two monitors of one Trainer that would write the same tags (a test epoch's are ``{prefix}_test``)."""
        mine = {self.prefix, f"{self.prefix}_test"} if self.monitor_test else {self.prefix}
        for other in trainer.callbacks:
            if other is self or not isinstance(other, MonitorOptions):
                continue
            theirs = {other.prefix, f"{other.prefix}_test"} if other.monitor_test else {other.prefix}
            if mine & theirs:
                raise MisconfigurationException(
                    f"AttentionMonitor: two monitors of this Trainer would both write the tags of prefix "
                    f"{sorted(mine & theirs)[0]!r} (prefix={self.prefix!r}, monitor_test={self.monitor_test} and "
                    f"prefix={other.prefix!r}, monitor_test={other.monitor_test}); give them other `prefix` values."
                )

    def __getstate__(self) -> dict[str, Any]:
        # ddp_spawn pickles the Trainer with its callbacks before any hook runs: name the argument that cannot go.
        config.check_picklable(
            token_ids=self._streams.getters,
            token_mask=self._streams.masks,
            id_to_token=self._streams.labels,
            probe=self.probe,
            probe_forward=self.probe_forward,
        )
        return self.__dict__

    def __deepcopy__(self, memo: dict[int, Any]) -> MonitorOptions:
        # Deep copies need no pickling: skip __getstate__'s check so lambdas stay fine there.
        clone = self.__class__.__new__(self.__class__)
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return clone
