"""AttentionMonitor: the thin Lightning Callback wiring capture, token streams, accumulators and rendering together."""

from __future__ import annotations

import copy
import functools
import math
import numbers
import os
import pickle
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from tensorboard.compat.proto.summary_pb2 import Summary
from torch import Tensor, nn
from torch.utils.tensorboard import SummaryWriter

from attn_callbacks import functional as F
from attn_callbacks import hf, render
from attn_callbacks.capture import AttentionCapture, find_attention_modules, num_heads
from attn_callbacks.export import save_epoch
from attn_callbacks.metrics import AttentionAccumulator, AttentionStats, merge_stats
from attn_callbacks.render import Tokenizer, TokenLabels
from attn_callbacks.tokens import (
    OTHER_LABEL,
    TokenSource,
    check_ids_in_range,
    compact_index,
    most_frequent_ids,
    parse_bytes,
    read_stream,
    resolve_streams,
    resolve_vocab_sizes,
    stream_getters,
)

__all__ = ["AttentionMonitor"]

_STATE_VERSION = 1
# Images waiting for the writer thread, at most: drawing may outrun PNG encoding, and each is megabytes.
_MAX_PENDING = 4
# What a pickled or deep-copied monitor starts afresh: the figures and the spare buffers are caches, rebuilt where
# needed, and the writer thread lives only during an epoch end.
_TRANSIENT: dict[str, Callable[[], Any]] = {
    "_figures": render.FigureCache,
    "_painter": lambda: None,
    "_painted": list,
    "_spare": dict,
}


def _positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"Expected argument `{name}` to be {what}, but got {value!r}")
    return value


def _int_list(name: str, value: Any) -> list[int]:
    if isinstance(value, (int, str)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ValueError(f"Expected argument `{name}` to be a sequence of integers, but got {value!r}")
    return sorted(set(value))


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):  # "False" or "no" would read as True
        raise ValueError(f"Expected argument `{name}` to be True or False, but got {value!r}")
    return bool(value)


def _labels_source(value: Any, where: str = "") -> TokenLabels:
    """One stream's ``id_to_token``, checked: None, a tokenizer, a callable, a sequence of labels, or ids -> labels."""
    if value is None or isinstance(value, Tokenizer):
        return value
    if isinstance(value, Mapping):
        keys = [key for key in value if not isinstance(key, numbers.Integral) or isinstance(key, bool)]
        if keys:
            raise ValueError(
                f"Argument `id_to_token`{where} maps ids to labels, so its keys must be integer ids, but it has keys "
                f"{keys[:5]!r} (a tokenizer's get_vocab() maps tokens to ids: invert it, or pass the tokenizer)"
            )
        return value
    indexable = hasattr(value, "__getitem__") and hasattr(value, "__len__")  # a list, or a numpy array of labels
    if callable(value) or (indexable and not isinstance(value, (str, bytes))):
        return value
    raise ValueError(
        f"Expected argument `id_to_token`{where} to be a sequence of labels, a mapping id -> label, a callable, a "
        f"tokenizer or None, but got {value!r}"
    )


def _token_labels(id_to_token: Any, streams: list[str]) -> dict[str, TokenLabels]:
    """Every stream's labels: ``id_to_token`` for all, or a mapping stream name -> labels (every key a stream)."""
    if isinstance(id_to_token, Mapping) and any(key in streams for key in id_to_token):
        unknown = [key for key in id_to_token if key not in streams][:5]
        if unknown:
            raise ValueError(
                f"Argument `id_to_token` names unknown stream(s) {unknown}; streams: {streams} (an id -> label "
                "mapping takes integer ids as keys)"
            )
        return {s: _labels_source(id_to_token.get(s), f" for stream {s!r}") for s in streams}
    return dict.fromkeys(streams, _labels_source(id_to_token))


class AttentionMonitor(Callback):
    r"""Log which vocabulary items attend to which, per attention layer and head, and how that drifts over epochs.

    During validation it hooks every selected ``torch.nn.MultiheadAttention`` of the LightningModule (stock
    ``nn.Transformer*`` layers included) and every attention module of a Hugging Face BERT-family model run with
    ``attn_implementation="eager"``, maps each attention weight to the (query token id, key token id) pair it
    connects and accumulates, on the module's device, per module (see the glossary in the README): the attention sum
    ``S[h, a, b]``, pair count ``C[a, b]``, query count ``Q[a]``, the uniform baseline ``U[a, b]`` (the mass uniform
    attention over the same visible keys would give) and position-level sums.

    At the end of each monitored validation epoch it computes the attention mass ``P = S / Q[:, None]`` per head and
    head-averaged ``P̄ = mean_h P[h]``, and logs (``{layer}`` is the module name, ``/head_{h}`` variants with
    ``per_head``; the README has the full table):

    - scalars through ``LightningModule.log`` (every logger): ``{prefix}_asymmetry`` ``sqrt(1 - <P̄, P̄ᵀ> / <P̄, P̄>)``
      (self-attention), ``{prefix}_entropy`` (row entropy of ``P̄`` over the key vocabulary), ``{prefix}_lift``
      (attention-weighted geometric mean of ``S / U``), ``{prefix}_position/{stat}`` (entropy, normalised entropy,
      self / previous / next mass, distance, sink mass), ``{prefix}_drift/{js,frobenius}_{prev,ref}`` (weighted row
      Jensen–Shannon divergence and relative Frobenius change of ``P`` against the previous and the reference
      monitored epoch) and ``{prefix}_skipped_rows``; their ``/head_{h}`` variants go straight to the Trainer's
      loggers at the same step (not into ``callback_metrics``: thousands of them in a large model would cost ~1 ms
      each there);
    - images and text (TensorBoard only): heatmaps of ``P̄`` (``mass``), per head (``mass_heads``), ``P̄ - P̄ᵀ``
      (``asymmetry_map``), ``log2 lift`` (``lift_map``), ``P̄_t - P̄_ref`` (``drift_map``), probe position × position
      maps (``probe``); tables of one-way pairs, top-lift pairs, most-moved tokens and attention hubs (PageRank).

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
            there are several streams and the modules are not stock ``nn.Transformer`` layers fed by streams named
            ``src`` and ``tgt``.
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
            knobs, rather than run out of memory. None for no limit. The figure is logged once either way.
        color_scale: ``"epoch"`` scales each image to its own largest value; ``"shared"`` gives each image tag one
            scale across epochs, the largest value any monitored epoch has drawn under it so far (kept in
            checkpoints), so colours compare by eye from epoch to epoch once the scale has settled; images drawn
            before it last widened keep their narrower scale (every colour bar shows its numbers).

    With several validation dataloaders each gets its own sums, logged with a ``/dataloader_idx_{k}`` suffix, and the
    tags without suffix show all of them combined (drift, probe and export use the combined view).

    Every argument can be set from a ``LightningCLI`` config file (``trainer.callbacks`` entry with ``class_path:
    attn_callbacks.AttentionMonitor`` and ``init_args``; see ``examples/attention_monitor.yaml``). There a string
    ``token_ids`` is always a batch key (a callable is given as ``class_path`` and ``init_args`` of a class whose
    instances are callable), functions for ``id_to_token`` and ``probe_forward`` are given by import path
    (``my_package.labels``), and ``probe`` is ``first`` or null (a probe batch of your own must hold tensors).

    Example:
        >>> monitor = AttentionMonitor(vocab_size=100, token_ids="input_ids", ignore_ids=[0])
        >>> trainer = Trainer(callbacks=[monitor])  # doctest: +SKIP
    """

    def __init__(
        self,
        vocab_size: int | dict[str, int],
        # jsonargparse (LightningCLI) tries union members in the order written, and when it saves a config it writes any
        # value that reaches a Callable member as a (broken) import path: the mappings come before the callables so that
        # the config.yaml of SaveConfigCallback reads back (and for that, no None inside the id_to_token mapping).
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
    ) -> None:
        self._getters = stream_getters(token_ids)
        self._vocab = resolve_vocab_sizes(vocab_size, list(self._getters))
        streams = list(self._getters)
        self._labels = _token_labels(id_to_token, streams)
        if modules is not None and (isinstance(modules, str) or not all(isinstance(p, str) for p in modules)):
            raise ValueError(f"Expected argument `modules` to be a list of fnmatch patterns, but got {modules!r}")
        self.modules = None if modules is None else list(modules)
        if attention_streams is not None and not (
            isinstance(attention_streams, Mapping)
            and all(
                isinstance(pattern, str)
                and isinstance(pair, Sequence)
                and not isinstance(pair, str)
                and len(pair) == 2
                and all(isinstance(stream, str) for stream in pair)
                for pattern, pair in attention_streams.items()
            )
        ):
            raise ValueError(
                "Expected argument `attention_streams` to map module name patterns to (query stream, key stream) "
                f"pairs, such as {{'decoder.*.multihead_attn': ('tgt', 'src')}}, but got {attention_streams!r}"
            )
        self.attention_streams = {k: tuple(v) for k, v in attention_streams.items()} if attention_streams else None
        self.ignore_ids = _int_list("ignore_ids", ignore_ids)
        self.batch_first = _flag("batch_first", batch_first)
        self.top_k = _positive_int("top_k", top_k)
        self.per_head = _flag("per_head", per_head)
        self.num_pairs = _positive_int("num_pairs", num_pairs, minimum=0)
        self.min_support = _positive_int("min_support", min_support)
        self.log_every_n_epochs = _positive_int("log_every_n_epochs", log_every_n_epochs)
        self.log_sanity_check = _flag("log_sanity_check", log_sanity_check)
        self.validate_args = _flag("validate_args", validate_args)
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"Expected argument `prefix` to be a non-empty string, but got {prefix!r}")
        self.prefix = prefix
        if drift_reference_epoch is not None:
            _positive_int("drift_reference_epoch", drift_reference_epoch, minimum=0)
        self.drift_reference_epoch = drift_reference_epoch
        self._sinks = self._resolve_sinks(sink_ids, streams)
        if isinstance(entropy_collapse_threshold, bool) or not (
            isinstance(entropy_collapse_threshold, (int, float)) and 0 <= entropy_collapse_threshold <= 1
        ):
            raise ValueError(
                "Expected argument `entropy_collapse_threshold` to be in [0, 1], but got "
                f"{entropy_collapse_threshold!r}"
            )
        self.entropy_collapse_threshold = float(entropy_collapse_threshold)
        if isinstance(probe, str) and probe != "first":
            raise ValueError(f"Expected argument `probe` to be 'first', a batch or None, but got {probe!r}")
        if probe == "first" and probe_forward is not None:
            raise ValueError(
                "Argument `probe_forward` runs a probe batch you give in `probe`; with probe='first' the probe is read "
                "from the normal validation pass, so leave `probe_forward` as None"
            )
        if probe is not None and probe != "first" and not callable(probe_forward):
            raise ValueError(
                "A probe batch given in argument `probe` needs argument `probe_forward`, a callable "
                f"(pl_module, batch) that runs the model on it; got probe_forward={probe_forward!r}"
            )
        self.probe = probe
        self.probe_forward = probe_forward
        self.probe_samples = _positive_int("probe_samples", probe_samples)
        if export not in (None, "pt", "npz"):
            raise ValueError(f"Expected argument `export` to be 'pt', 'npz' or None, but got {export!r}")
        self.export = export
        if export_dir is not None and not isinstance(export_dir, (str, os.PathLike)):
            raise ValueError(
                f"Expected argument `export_dir` to be a path (str or Path) or None, but got {export_dir!r}"
            )
        self.export_dir = export_dir
        self.monitor_test = _flag("monitor_test", monitor_test)
        self._track_limit = self._resolve_track_limit(max_tracked_tokens, streams)
        # stream -> the tracked ids, compact index c holding id tracked[c] (CPU int64); frozen once set.
        self._tracked: dict[str, Tensor] = self._resolve_tracked_ids(tracked_ids, streams)
        for stream, limit in self._track_limit.items():
            if len(self._sinks[stream]) > limit:
                raise ValueError(
                    f"Argument `max_tracked_tokens`={limit} for stream {stream!r} is smaller than its "
                    f"{len(self._sinks[stream])} `sink_ids`, which are always tracked"
                )
        self.memory_budget = None if memory_budget is None else parse_bytes("memory_budget", memory_budget)
        if color_scale not in ("epoch", "shared"):
            raise ValueError(f"Expected argument `color_scale` to be 'epoch' or 'shared', but got {color_scale!r}")
        self.color_scale = color_scale
        self._color_limits: dict[str, float] = {}  # image tag -> top of its colour scale so far (color_scale="shared")
        self._compact_tables: dict[str, Tensor] = {}  # stream -> id -> compact index, on the device
        self._pairs: dict[tuple[str, str], Tensor] = {}  # this batch's pair index per (query, key) stream
        self._calls: set[str] = set()  # modules that ran in this batch
        self._budget_logged = False

        self._attention: dict[str, nn.Module] = {}
        self._heads: dict[str, int] = {}  # module -> number of heads
        self._streams_of: dict[str, tuple[str, str]] = {}
        self._metrics: dict[tuple[str, int], AttentionAccumulator] = {}  # (module, dataloader_idx) -> sums
        self._capture: AttentionCapture | None = None
        self._dataloader_idx = 0
        self._stage_prefix = self.prefix  # f"{prefix}_test" while a test epoch is monitored
        self._batch: Any = None
        self._batch_ids: dict[str, tuple[Tensor, Tensor]] = {}
        self._warned: set[str] = set()
        # Drift memory, carried by state_dict: module -> {"attention_mass": (H, Vq, Vk), "query_count": (Vq,)} on CPU.
        self._previous: dict[str, dict[str, Tensor]] = {}
        self._reference: dict[str, dict[str, Tensor]] = {}
        self._previous_epoch: int | None = None
        self._reference_epoch: int | None = None
        # Validation epochs of trainer.fit seen, monitored or not: log_every_n_epochs counts them. None for a run
        # resumed from a checkpoint saved before the count, which keeps the epoch rule it was saved under.
        self._validation_epochs: int | None = 0
        # Probe: frozen ids per stream (probe_samples, L) on CPU; this epoch's weights per module (n, H, Lq, Lk).
        self._probe_ids: dict[str, Tensor] | None = None
        self._probe_weights: dict[str, Tensor] = {}
        self._probe_capturing = False  # the current batch is the probe: copy its weights
        self._probe_only = False  # running probe_forward: copy weights, do not accumulate
        self._figures = render.FigureCache()  # each image tag's figure, redrawn with new data every epoch
        # During an epoch end only: one worker thread that PNG-encodes and writes the images (and writes the texts,
        # so that one thread uses the writer) while this one computes the next statistics and draws the next images.
        # Drawing stays here: matplotlib holds the GIL, which would stall this thread's many small tensor ops.
        self._painter: ThreadPoolExecutor | None = None
        self._painted: list[Future] = []
        # The last PageRank per (module, stage prefix, dataloader suffix): where the next one starts.
        self._ranks: dict[tuple[str, str, str], Tensor] = {}
        # This epoch's row_plogp(P) and mean_h P per module (on CPU), for its drift snapshot.
        self._derived: dict[str, dict[str, Tensor]] = {}
        # Per module, the P of a drift snapshot that no longer serves and that nothing else holds: where the next
        # epoch's P goes. A fresh tensor of hundreds of MB costs its page faults on every epoch (measured 10x the
        # division itself); the peak memory is the same, as the current, previous and reference P coexist anyway.
        self._spare: dict[str, Tensor] = {}

    def __getstate__(self) -> dict[str, Any]:
        # ddp_spawn pickles the Trainer with its callbacks before any hook runs: name the argument that cannot go.
        for argument, value in (
            ("token_ids", self._getters),
            ("id_to_token", self._labels),
            ("probe", self.probe),
            ("probe_forward", self.probe_forward),
        ):
            try:
                pickle.dumps(value)
            except Exception as err:
                raise TypeError(
                    f"AttentionMonitor argument `{argument}` cannot be pickled ({err}), which strategy='ddp_spawn' "
                    "needs to start its processes: use a module-level function or a batch key instead of a lambda "
                    "or local function, or strategy='ddp'"
                ) from err
        return {key: _TRANSIENT[key]() if key in _TRANSIENT else value for key, value in self.__dict__.items()}

    def __deepcopy__(self, memo: dict[int, Any]) -> AttentionMonitor:
        # Deep copies need no pickling: skip __getstate__'s check so lambdas stay fine there.
        clone = self.__class__.__new__(self.__class__)
        memo[id(self)] = clone
        for key, value in self.__dict__.items():
            setattr(clone, key, _TRANSIENT[key]() if key in _TRANSIENT else copy.deepcopy(value, memo))
        return clone

    @property
    def state_key(self) -> str:
        return self._generate_state_key(prefix=self.prefix, modules=self.modules)

    @staticmethod
    def _resolve_sinks(sink_ids: Any, streams: list[str]) -> dict[str, list[int]]:
        if isinstance(sink_ids, Mapping):
            unknown = [s for s in sink_ids if s not in streams]
            if unknown:
                raise ValueError(f"Argument `sink_ids` names unknown stream(s) {unknown}; streams: {streams}")
            return {s: _int_list("sink_ids", sink_ids.get(s, ())) for s in streams}  # streams left out: none
        return dict.fromkeys(streams, _int_list("sink_ids", sink_ids))

    @staticmethod
    def _resolve_track_limit(limit: Any, streams: list[str]) -> dict[str, int]:
        if limit is None:
            return {}
        if isinstance(limit, Mapping):
            unknown = [s for s in limit if s not in streams]
            if unknown:
                raise ValueError(f"Argument `max_tracked_tokens` names unknown stream(s) {unknown}; streams: {streams}")
            return {s: _positive_int("max_tracked_tokens", k) for s, k in limit.items()}
        return dict.fromkeys(streams, _positive_int("max_tracked_tokens", limit))

    def _resolve_tracked_ids(self, tracked_ids: Any, streams: list[str]) -> dict[str, Tensor]:
        if tracked_ids is None:
            return {}
        if isinstance(tracked_ids, Mapping):
            unknown = [s for s in tracked_ids if s not in streams]
            if unknown:
                raise ValueError(f"Argument `tracked_ids` names unknown stream(s) {unknown}; streams: {streams}")
            given = {s: _int_list("tracked_ids", ids) for s, ids in tracked_ids.items()}
        else:
            given = dict.fromkeys(streams, _int_list("tracked_ids", tracked_ids))
        tracked = {}
        for stream, ids in given.items():
            bad = [i for i in ids if not 0 <= i < self._vocab[stream]]
            if bad or not ids:
                raise ValueError(
                    f"Expected argument `tracked_ids` to hold ids in [0, {self._vocab[stream]}) for stream {stream!r}, "
                    f"but got {bad or ids}"
                )
            always = [i for i in self._sinks[stream] if i not in ids]
            tracked[stream] = torch.tensor(always + ids, dtype=torch.long)
        return tracked

    # ----------------------------------------------------------------------------------------------- Lightning hooks
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Find the attention modules and decide their token streams; misconfiguration fails here, not mid-epoch."""
        try:
            self._attention = find_attention_modules(pl_module, self.modules)
            self._heads = {name: num_heads(module, name) for name, module in self._attention.items()}
            self._streams_of = resolve_streams(
                list(self._attention), pl_module, list(self._getters), self.attention_streams
            )
        except ValueError as err:
            raise MisconfigurationException(f"AttentionMonitor: {err}") from err
        for stream, ids in self._sinks.items():
            bad = [i for i in ids if not 0 <= i < self._vocab[stream]]
            if bad:
                raise MisconfigurationException(
                    f"AttentionMonitor: argument `sink_ids` has id(s) {bad} outside the vocabulary "
                    f"[0, {self._vocab[stream]}) of stream {stream!r}"
                )
        self._capture = AttentionCapture(self._attention, self._consume, output_index=hf.attention_outputs(pl_module))
        self._check_budget(loaders=1)  # fail before training starts; checked again with the real dataloader count

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._monitored(trainer):
            self._start(trainer, self.prefix)

    def on_test_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.monitor_test:
            self._start(trainer, f"{self.prefix}_test")

    def on_test_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self.on_validation_batch_start(trainer, pl_module, batch, batch_idx, dataloader_idx)

    def on_test_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self.on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)

    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.on_validation_epoch_end(trainer, pl_module)

    def _start(self, trainer: Trainer, stage_prefix: str) -> None:
        """Fresh sums for every (module, dataloader) on the module's device, then attach the hooks."""
        if self._capture is None:
            return
        # Known before the epoch starts, and the same on every rank, so DDP ranks hold the same metrics.
        if trainer.testing:
            batches = trainer.num_test_batches
        else:
            batches = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
        loaders = max(len(batches), 1)
        self._stage_prefix = stage_prefix
        with torch.inference_mode(False):  # state tensors must be normal tensors, not inference tensors
            self._choose_tracked(trainer)
            self._check_budget(loaders)  # before any allocation
            for name, module in self._attention.items():
                device = _module_device(module)
                for idx in range(loaders):
                    metric = self._metrics.get((name, idx))
                    if metric is None:
                        query_stream, key_stream = self._streams_of[name]
                        sizes = (self._heads[name], self._size(query_stream), self._size(key_stream))
                        metric = AttentionAccumulator(*sizes, mean_of_heads=not self.per_head)
                        self._metrics[(name, idx)] = metric
                    metric.to(device)
                    if metric.update_count or metric.summed_in_place:  # an interrupted epoch's; else zero
                        metric.reset()
        for key in [key for key in self._metrics if key[1] >= loaders]:  # fewer loaders than last time
            del self._metrics[key]
        self._probe_weights.clear()
        self._capture.attach()

    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._batch = batch
        self._batch_ids.clear()
        self._pairs.clear()
        self._calls.clear()
        self._probe_capturing = False
        self._dataloader_idx = dataloader_idx
        if self._capture is not None and self._capture.attached:
            # Read (and check) the ids before the model runs, so bad ids fail here with a clear message.
            ids = {stream: self._stream_ids(stream, pl_module.device)[2] for stream in self._used_streams()}
            first = batch_idx == 0 and dataloader_idx == 0 and not (trainer.sanity_checking or trainer.testing)
            if self.probe == "first" and first:
                self._probe_capturing = self._match_probe(ids)

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._batch = None
        self._batch_ids.clear()
        self._pairs.clear()
        self._probe_capturing = False

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._capture is None or not self._capture.attached:
            return
        drift_epoch = not (trainer.sanity_checking or trainer.testing)
        try:
            if self.probe is not None and self.probe != "first" and drift_epoch:
                self._run_probe(pl_module)
        finally:
            self._release()
        writer = _tensorboard_writer(trainer)
        if writer is None and trainer.is_global_zero:
            why = (
                "fast_dev_run replaces the Trainer's loggers with a dummy one"
                if trainer.fast_dev_run
                else "no TensorBoardLogger in the Trainer"
            )
            self._warn_once(
                "no_tb",
                f"AttentionMonitor: {why}, so heatmaps and tables are skipped; scalars are still logged to the "
                "Trainer's loggers.",
            )
        writer = writer if trainer.is_global_zero else None
        # A collective under DDP. Views of the state, summed in place, with no copy: it is reset right after use.
        per_loader = {key: metric.stats(in_place=True) for key, metric in self._metrics.items()}
        loaders = 1 + max(idx for _, idx in per_loader)
        all_stats = {
            name: merge_stats([per_loader[(name, idx)] for idx in range(loaders)]) if loaders > 1 else stats
            for (name, idx), stats in per_loader.items()
            if idx == 0
        }
        if not any(int(stats.query_count.sum()) for stats in all_stats.values()):
            self._warn_once(
                "empty",
                "AttentionMonitor: no valid query token was seen in this epoch (empty dataloaders, or every id in "
                "`ignore_ids`), so nothing is logged for it.",
            )
            self._reset_sums()
            return
        step = trainer.global_step
        self._derived.clear()  # nothing left from an epoch that failed before _remember
        for name, stats in all_stats.items():
            sums = stats.attention_sum
            # Only an epoch that _remember keeps uses the spare. The spare lives on the CPU: for P computed on
            # another device, _remember copies P into it instead, so it is not taken (nor dropped) here.
            on_cpu = sums.device.type == "cpu"
            spare = self._take_spare(name, sums.shape, sums.dtype, sums.device) if drift_epoch and on_cpu else None
            if spare is not None:
                stats.attention_mass = F.attention_mass(sums, stats.query_count, out=spare)  # the cached property
        finished = False
        heads: dict[tuple[str, str], Tensor] = {}  # every module's per-head scalars, logged in one call
        try:
            for name, stats in all_stats.items():
                heads.update(self._log_module(pl_module, name, stats, writer, step, drift_epoch))
                if loaders > 1:
                    for idx in range(loaders):
                        suffix = f"/dataloader_idx_{idx}"
                        part = per_loader[(name, idx)]
                        heads.update(self._log_module(pl_module, name, part, writer, step, False, suffix))
            _log_heads(trainer, heads)
            finished = True
        finally:
            self._finish_painting(raise_errors=finished)
        if drift_epoch:
            if self.export is not None:
                # trainer.log_dir is a broadcast under DDP: every rank must ask, only rank 0 writes.
                log_dir = None if self.export_dir else trainer.log_dir
                if trainer.is_global_zero:
                    root = Path(log_dir or trainer.default_root_dir) / "attention_epochs"
                    self._export(trainer, all_stats, Path(self.export_dir) if self.export_dir else root)
            self._remember(all_stats, trainer.current_epoch)
        self._reset_sums()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._finish_painting(raise_errors=False)
        self._release()
        self._reset_sums()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._finish_painting(raise_errors=False)
        self._release()

    def state_dict(self) -> dict[str, Any]:
        """What drift and the probe need to carry on after a resume: previous and reference ``P`` (per head) with
        their query counts and row entropies, their epochs, the frozen probe ids and tracked ids. Tensors only, so
        checkpoints load with ``weights_only=True``; size ``Σ_modules 2 · (4 H Vq Vk + 4 H Vq + 8 Vq)`` bytes,
        plus the probe ids."""
        return {
            "version": _STATE_VERSION,
            "previous_epoch": self._previous_epoch,
            "reference_epoch": self._reference_epoch,
            "validation_epochs": self._validation_epochs,
            "previous": _checkpointed(self._previous),
            "reference": _checkpointed(self._reference),
            "probe_ids": self._probe_ids,
            "tracked_ids": dict(self._tracked),
            "color_limits": dict(self._color_limits),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != _STATE_VERSION:
            raise ValueError(
                f"AttentionMonitor: checkpoint state version {state_dict.get('version')!r} is not {_STATE_VERSION}"
            )
        self._previous_epoch = state_dict["previous_epoch"]
        self._reference_epoch = state_dict["reference_epoch"]
        self._validation_epochs = state_dict.get("validation_epochs")
        self._previous = state_dict["previous"]
        self._reference = state_dict["reference"]
        self._probe_ids = state_dict["probe_ids"]
        # The tracked ids were frozen when the checkpointed run chose them: keep them, so epochs stay comparable.
        self._tracked.update(state_dict.get("tracked_ids") or {})
        self._color_limits = dict(state_dict.get("color_limits") or {})
        self._compact_tables.clear()
        self._spare.clear()

    # ----------------------------------------------------------------------------------------------------- internals
    def _monitored(self, trainer: Trainer) -> bool:
        if trainer.sanity_checking:
            return self.log_sanity_check
        if trainer.state.fn != TrainerFn.FITTING:
            return True  # trainer.validate(): asked for explicitly, and not counted
        if self._validation_epochs is None:
            return trainer.current_epoch % self.log_every_n_epochs == 0
        # Validation epochs, not training ones: with check_val_every_n_epoch = 2, say, validation runs after training
        # epochs 1, 3, 5 ... only, and current_epoch % n could never be 0.
        seen, self._validation_epochs = self._validation_epochs, self._validation_epochs + 1
        return seen % self.log_every_n_epochs == 0

    def _reset_sums(self) -> None:
        for metric in self._metrics.values():
            metric.reset()
        self._probe_weights.clear()

    def _used_streams(self) -> list[str]:
        return list(dict.fromkeys(s for pair in self._streams_of.values() for s in pair))

    def _release(self) -> None:
        if self._capture is not None:
            self._capture.detach()
        self._batch = None
        self._batch_ids.clear()
        self._pairs.clear()
        self._probe_capturing = self._probe_only = False

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message)

    def _stream_ids(self, stream: str, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """(ids as accumulated, valid, ids as in the batch) of one stream of the current batch, read once per batch.
        Accumulated ids are compact indices (``<other>`` last) for a tracked stream, the batch's ids otherwise."""
        if stream not in self._batch_ids:
            ids = read_stream(self._batch, stream, self._getters[stream], self.batch_first).to(device)
            valid = self._valid(ids)
            if self.validate_args:
                check_ids_in_range(ids, valid, self._vocab[stream], stream)
            compact = ids
            if stream in self._tracked:
                table = self._compact_tables.get(stream)
                if table is None or table.device != ids.device:
                    table = compact_index(self._tracked[stream], self._vocab[stream]).to(ids.device)
                    self._compact_tables[stream] = table
                # Ignored positions may hold anything (pad = -100): clamp so the lookup stays in range.
                compact = table[ids.long().clamp(0, self._vocab[stream] - 1)]
            self._batch_ids[stream] = (compact, valid, ids)
        return self._batch_ids[stream]

    def _size(self, stream: str) -> int:
        """Vocabulary size of a stream as accumulated: tracked ids + ``<other>``, or the whole vocabulary."""
        tracked = self._tracked.get(stream)
        return self._vocab[stream] if tracked is None else len(tracked) + 1

    def _pending(self, stream: str) -> bool:
        """Whether the stream will be tracked but its ids are not chosen yet."""
        limit = self._track_limit.get(stream)
        return stream not in self._tracked and limit is not None and self._vocab[stream] > limit

    def _choose_tracked(self, trainer: Trainer) -> None:
        """Count the ids of every pending stream over the evaluation dataloaders (ids only, no forward; summed over
        processes) and freeze the most frequent ones."""
        pending = [stream for stream in self._used_streams() if self._pending(stream)]
        if not pending:
            return
        device = trainer.strategy.root_device
        counts = {s: torch.zeros(self._vocab[s] + 1, dtype=torch.long, device=device) for s in pending}
        if trainer.testing:
            loaders, limits = trainer.test_dataloaders, trainer.num_test_batches
        else:
            loaders, limits = trainer.val_dataloaders, trainer.num_val_batches
        for loader, limit in zip(_as_list(loaders), limits, strict=False):
            for index, batch in enumerate(_fresh_iter(loader)):
                if index >= limit:
                    break
                for stream in pending:
                    ids = read_stream(batch, stream, self._getters[stream], self.batch_first).to(device)
                    valid = self._valid(ids)
                    if self.validate_args:
                        check_ids_in_range(ids, valid, self._vocab[stream], stream)
                    where = torch.where(valid, ids.long(), self._vocab[stream]).reshape(-1)  # ignored -> last cell
                    counts[stream].index_add_(0, where, valid.reshape(-1).long())
        for stream in pending:
            total = trainer.strategy.reduce(counts[stream], reduce_op="sum")[:-1]  # same counts on every rank
            self._tracked[stream] = most_frequent_ids(total, self._track_limit[stream], self._sinks[stream])
            rank_zero_info(
                f"AttentionMonitor: tracking {len(self._tracked[stream])} of {self._vocab[stream]} ids of stream "
                f"{stream!r} ({float(total[self._tracked[stream]].sum()) / max(float(total.sum()), 1):.1%} of its "
                "validation tokens); the rest fold into <other>"
            )

    def _state_bytes(self, loaders: int) -> dict[str, int]:
        """Bytes of sums each module will hold per device (all its dataloaders); a tracked stream whose ids are not
        chosen yet counts with its limit."""

        def size(stream: str) -> int:
            return self._track_limit[stream] + 1 if self._pending(stream) else self._size(stream)

        return {
            name: loaders
            * AttentionAccumulator.state_bytes(
                self._heads[name], size(self._streams_of[name][0]), size(self._streams_of[name][1]), not self.per_head
            )
            for name, module in self._attention.items()
        }

    def _check_budget(self, loaders: int) -> None:
        per_module = self._state_bytes(loaders)
        total = sum(per_module.values())
        budget = self.memory_budget
        if not self._budget_logged and loaders > 0 and per_module:
            self._budget_logged = True
            rank_zero_info(
                f"AttentionMonitor: {len(per_module)} attention module(s) × {loaders} dataloader(s) will hold "
                f"{_format_bytes(total)} of attention sums per device (memory_budget: "
                f"{'none' if budget is None else _format_bytes(budget)})"
            )
        if budget is None or total <= budget:
            return
        largest = max(per_module, key=per_module.__getitem__)
        query_stream, key_stream = self._streams_of[largest]
        raise MisconfigurationException(
            f"AttentionMonitor would hold {_format_bytes(total)} of attention sums per device "
            f"({len(per_module)} module(s) × {loaders} dataloader(s); the largest, {largest!r}, "
            f"{_format_bytes(per_module[largest])} for a {self._size(query_stream)} × {self._size(key_stream)} "
            f"vocabulary), over argument `memory_budget`={_format_bytes(budget)}. Sums grow with the square of the "
            "vocabulary: set `max_tracked_tokens` (e.g. 2048 keeps exact sums for the 2048 most frequent ids and "
            "folds the rest into <other>), or `per_head=False` (the mean of the heads only), or select fewer modules "
            "with `modules`, or raise `memory_budget` (None disables the check)."
        )

    def _valid(self, ids: Tensor) -> Tensor:
        if not self.ignore_ids:
            return torch.ones_like(ids, dtype=torch.bool)
        return ~torch.isin(ids, torch.tensor(self.ignore_ids, device=ids.device, dtype=ids.dtype))

    def _match_probe(self, ids: dict[str, Tensor]) -> bool:
        """Freeze the probe at its first sight; afterwards, whether batch 0 still starts with the same samples."""
        head = {stream: t[: self.probe_samples].detach().cpu() for stream, t in ids.items()}
        if self._probe_ids is None:
            self._probe_ids = {stream: t.clone() for stream, t in head.items()}
            return True
        same = head.keys() == self._probe_ids.keys() and all(torch.equal(head[s], self._probe_ids[s]) for s in head)
        if not same:
            self._warn_once(
                "probe_moved",
                "AttentionMonitor: validation batch 0 no longer starts with the frozen probe samples (a shuffled "
                "validation loader?), so probe maps are skipped for such epochs; give a batch in `probe` with "
                "`probe_forward` instead.",
            )
        return same

    def _run_probe(self, pl_module: LightningModule) -> None:
        """Run ``probe_forward`` on the user's probe batch with the hooks attached, keeping only the probe weights."""
        self._batch = move_data_to_device(self.probe, pl_module.device)
        self._batch_ids.clear()
        ids = {stream: self._stream_ids(stream, pl_module.device)[2] for stream in self._used_streams()}
        self._probe_ids = {stream: t[: self.probe_samples].detach().cpu() for stream, t in ids.items()}
        self._probe_only = True
        try:
            with torch.no_grad():
                self.probe_forward(pl_module, self._batch)
        finally:
            self._probe_only = False
            self._batch = None
            self._batch_ids.clear()

    def _consume(self, name: str, module: nn.Module, weights: Tensor) -> None:
        if self._batch is None:
            raise RuntimeError(
                f"AttentionMonitor: attention module {name!r} ran outside a validation batch while hooked"
            )
        if weights.dim() == 3:  # unbatched call: (H, Lq, Lk)
            weights = weights.unsqueeze(0)
        query_stream, key_stream = self._streams_of[name]
        # .to() is a no-op unless the module lives on another device than the LightningModule's (model parallel).
        query_ids, query_valid, _ = (t.to(weights.device) for t in self._stream_ids(query_stream, weights.device))
        key_ids, key_valid, _ = (t.to(weights.device) for t in self._stream_ids(key_stream, weights.device))
        batch, _, len_q, len_k = weights.shape
        if query_ids.shape != (batch, len_q) or key_ids.shape != (batch, len_k):
            raise ValueError(
                f"AttentionMonitor: attention module {name!r} returned weights of shape (B, H, Lq, Lk) = "
                f"{tuple(weights.shape)}, which does not match the token ids of its query stream {query_stream!r} "
                f"{tuple(query_ids.shape)} and key stream {key_stream!r} {tuple(key_ids.shape)} (expected (B, Lq) and "
                "(B, Lk); see arguments `attention_streams` and `batch_first`)"
            )
        if self._probe_capturing or self._probe_only:
            self._probe_weights[name] = weights[: self.probe_samples].detach().float().cpu()
        if not self._probe_only:
            if name in self._calls:
                self._warn_once(
                    f"calls:{name}",
                    f"AttentionMonitor: attention module {name!r} ran more than once in one batch (one module shared "
                    "by several layers, as in ALBERT, or called in a loop): its sums add up every call, so its maps "
                    "and numbers mix those calls; the probe shows the last one.",
                )
            self._calls.add(name)
            # The pair index depends on the ids only: one per batch for all modules reading the same streams.
            pairs = self._pairs.get((query_stream, key_stream))
            if pairs is None or pairs.device != weights.device:
                sizes = (self._size(query_stream), self._size(key_stream))
                pairs = F.pair_index(query_ids, key_ids, query_valid, key_valid, *sizes)
                self._pairs[(query_stream, key_stream)] = pairs
            metric = self._metrics[(name, self._dataloader_idx)]
            metric.update(weights, query_ids, key_ids, query_valid, key_valid, pairs=pairs)

    def _remember(self, all_stats: dict[str, AttentionStats], epoch: int) -> None:
        """Keep this epoch's ``P`` as the previous one, and as the reference when it is the reference epoch."""
        snapshot = {}
        for name, stats in all_stats.items():
            # P = S / Q is a tensor of its own (no copy needed on CPU); Q is a view of the state, which is zeroed in
            # place for the next epoch: a copy. row_plogp(P) and mean_h P as _log_module computed them, if it did.
            mass = stats.attention_mass.detach()
            if mass.device.type != "cpu":
                spare = self._take_spare(name, mass.shape, mass.dtype, torch.device("cpu"))
                mass = mass if spare is None else spare.copy_(mass)
            snapshot[name] = {
                "attention_mass": mass.cpu(),
                "query_count": stats.query_count.to("cpu", copy=True),
                **self._derived.get(name, {}),
            }
            if "row_plogp" not in snapshot[name]:
                snapshot[name]["row_plogp"] = F.row_plogp(stats.attention_mass).cpu()
        self._derived.clear()
        retired, kept = self._previous, self._reference
        self._previous, self._previous_epoch = snapshot, epoch
        wanted = self.drift_reference_epoch
        if self._reference_epoch is None and (wanted is None or epoch >= wanted):
            self._reference, self._reference_epoch = snapshot, epoch
            if wanted is not None and epoch > wanted:
                self._warn_once(
                    "reference_epoch",
                    f"AttentionMonitor: argument `drift_reference_epoch`={wanted} names an epoch that was not "
                    f"monitored (no validation then, `log_every_n_epochs`={self.log_every_n_epochs} skipped it, or it "
                    f"saw no token); epoch {epoch}, the first monitored one after it, is the drift reference instead",
                )
        # A retired P is ours to reuse only if no snapshot still in use shares its memory, and nothing outside (a
        # state dict being written by a checkpoint thread, say) refers to it: no more references than a stand-in
        # held the same way (a dict entry and a local) has, whatever this Python counts.
        stand_in = object()
        held = {"attention_mass": stand_in}  # as a snapshot holds its P
        ours = sys.getrefcount(stand_in)
        del held
        live = {
            m[name]["attention_mass"].untyped_storage().data_ptr()
            for m in (kept, self._reference, snapshot)
            for name in m
        }
        for name, memory in retired.items():
            mass = memory["attention_mass"]
            if mass.untyped_storage().data_ptr() not in live and sys.getrefcount(mass) <= ours:
                self._spare[name] = mass

    def _take_spare(self, name: str, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor | None:
        """The module's spare buffer, if it can receive a ``P`` of this shape, dtype and device here (an inference
        tensor can only be written inside inference mode, a normal one only outside); a spare that no longer fits
        the model is dropped."""
        spare = self._spare.get(name)
        if spare is None:
            return None
        if (spare.shape, spare.dtype, spare.device) != (shape, dtype, device):
            del self._spare[name]
            return None
        if spare.is_inference() != torch.is_inference_mode_enabled():
            return None
        return self._spare.pop(name)

    def _export(self, trainer: Trainer, all_stats: dict[str, AttentionStats], directory: Path) -> None:
        path = directory / f"epoch={trainer.current_epoch:04d}-step={trainer.global_step}"
        labels = {
            stream: None if self._labels[stream] is None and stream not in self._tracked else self._full_labels(stream)
            for stream in self._vocab
        }
        save_epoch(
            path.with_suffix(f".{self.export}"),
            all_stats,
            streams=self._streams_of,
            labels=labels,
            epoch=trainer.current_epoch,
            global_step=trainer.global_step,
        )

    def _tokens(self, stream: str) -> slice:
        """The accumulated indices that are tokens: all but the last, ``<other>``, of a tracked stream (slicing it off
        the end keeps every index as it is). The bucket counts in every scalar, but it is no token to show in a
        heatmap or a table (it would lead them all)."""
        return slice(0, len(self._tracked[stream])) if stream in self._tracked else slice(None)

    def _full_labels(self, stream: str) -> list[str]:
        return self._label(range(self._size(stream)), stream, max_length=None)

    def _label(self, ids: Sequence[int], stream: str, max_length: int | None = render.MAX_LABEL) -> list[str]:
        """Labels of accumulated ids (compact indices of a tracked stream: ``<other>`` for the bucket)."""
        tracked = self._tracked.get(stream)
        if tracked is None:
            return render.label_tokens(list(ids), self._labels[stream], max_length=max_length)
        ids, originals = list(ids), tracked.tolist()
        known = [originals[c] for c in ids if c < len(originals)]  # one lookup for all (a tokenizer call, say)
        labels = iter(render.label_tokens(known, self._labels[stream], max_length=max_length))
        return [next(labels) if c < len(originals) else OTHER_LABEL for c in ids]

    def _token_label(self, ids: Sequence[int], stream: str) -> list[str]:
        """Labels of ids as they are in the batch."""
        return render.label_tokens(list(ids), self._labels[stream])

    # ------------------------------------------------------------------------------------------------------- logging
    def _log_module(
        self,
        pl_module: LightningModule,
        name: str,
        stats: AttentionStats,
        writer: Any,
        step: int,
        drift: bool,
        suffix: str = "",
    ) -> dict[tuple[str, str], Tensor]:
        """Log one module's scalars, images and tables; return its per-head scalars, ``(tag, suffix) -> (H,)``, for
        :func:`_log_heads`."""
        heads: dict[tuple[str, str], Tensor] = {}
        if int(stats.query_count.sum()) == 0:
            return heads  # nothing seen by this module (or this dataloader): no numbers to log
        layer = name or "attention"
        query_stream, key_stream = self._streams_of[name]
        square = query_stream == key_stream
        query_count = stats.query_count
        mass_heads = stats.attention_mass  # (H, Vq, Vk)
        mass = _head_mean(mass_heads)  # P̄ = mean_h S[h] / Q = mean_h P[h]
        sum_mean = _head_mean(stats.attention_sum)  # (Vq, Vk)
        previous = self._previous.get(name) if drift else None
        reference = self._reference.get(name) if drift else None
        if previous is not None and tuple(previous["attention_mass"].shape) != tuple(mass_heads.shape):
            previous = reference = None  # a different model under the same name: nothing comparable

        prefix = self._stage_prefix
        scalars: dict[str, Tensor] = {
            f"{prefix}_skipped_rows/{layer}{suffix}": stats.skipped_rows.float(),
        }

        def add(tag: str, layer_value: Tensor, head_values: Tensor | None = None) -> None:
            scalars[f"{prefix}_{tag}/{layer}{suffix}"] = layer_value
            if self.per_head and head_values is not None:
                heads[(f"{prefix}_{tag}/{layer}", suffix)] = head_values

        # Σ p log p of every row, (H, Vq) and (Vq,): shared by the entropy, the lift and every drift comparison.
        plogp_heads, plogp = F.row_plogp(mass_heads), F.row_plogp(mass)
        add("entropy", F.row_entropy(mass, query_count, plogp), F.row_entropy(mass_heads, query_count, plogp_heads))
        if square:
            add("asymmetry", F.asymmetry_index(mass), F.asymmetry_index(mass_heads))
        add(
            "lift",
            F.mean_lift(sum_mean, stats.uniform_sum, plogp),
            F.mean_lift(stats.attention_sum, stats.uniform_sum, plogp_heads),
        )
        positions = F.position_statistics(stats.position_sums, query_count)
        for stat, values in positions.items():
            add(f"position/{stat}", values.mean(), values)
        sinks = self._sinks.get(key_stream)
        if sinks:
            if key_stream in self._tracked:  # sinks are always tracked: their compact indices
                sinks = [self._tracked[key_stream].tolist().index(i) for i in sinks]
            sink_heads = F.sink_mass(stats.attention_sum, query_count, torch.tensor(sinks, device=mass.device))
            add("position/sink_mass", sink_heads.mean(), sink_heads)
        if drift and not suffix:  # the combined view of a drift epoch is the one _remember keeps
            self._derived[name] = {"row_plogp": plogp_heads.cpu(), "mean_mass": mass.cpu()}
        drifts: dict[int, tuple[Tensor, ...]] = {}
        moved: dict[str, Tensor] = {}  # "prev" / "ref" -> each row's JS of the mean of the heads, for the table
        for which, memory in (("prev", previous), ("ref", reference)):
            if memory is None:
                continue
            if id(memory) not in drifts:  # the previous epoch is often the reference too: compare once
                old_heads = memory["attention_mass"].to(mass.device)
                old_count = memory["query_count"].to(mass.device)
                if "row_plogp" not in memory:  # a snapshot from an older checkpoint: computed once, then kept
                    memory["row_plogp"] = F.row_plogp(memory["attention_mass"])
                old_plogp = memory["row_plogp"].to(mass.device)
                args = (query_count, old_count, self.min_support)
                drifts[id(memory)] = (
                    *F.attention_drift(mass, _snapshot_mean(memory).to(mass.device), *args, row_divergence=True),
                    *F.attention_drift(mass_heads, old_heads, *args, plogp_heads, old_plogp),
                )
            js, frobenius, moved[which], js_heads, frobenius_heads = drifts[id(memory)]
            add(f"drift/js_{which}", js, js_heads)
            add(f"drift/frobenius_{which}", frobenius, frobenius_heads)
        for tag, value in scalars.items():
            # Already summed over ranks by compute(): sync_dist would only average equal numbers. Our own
            # dataloader suffixes replace Lightning's, which would otherwise append one for the current dataloader.
            pl_module.log(tag, value.float(), on_step=False, on_epoch=True, sync_dist=False, add_dataloader_idx=False)
        self._check_collapse(name, positions["entropy_normalized"], query_count)
        if int(stats.skipped_rows) > 0:
            self._warn_once(
                f"skipped:{name}",
                f"AttentionMonitor: {int(stats.skipped_rows)} query rows of attention module {name!r} had non-finite "
                "or all-zero weights (fully masked rows? padded positions whose id is not in `ignore_ids`?) and were "
                "left out of the sums",
            )
        if writer is not None:
            self._write_images_and_text(
                writer, name, layer, stats, mass, mass_heads, sum_mean, reference, moved, step, prefix, suffix
            )
        return heads

    def _check_collapse(self, name: str, entropy_normalized: Tensor, query_count: Tensor) -> None:
        if self.entropy_collapse_threshold <= 0 or int(query_count.sum()) == 0:
            return
        for h, value in enumerate(entropy_normalized.tolist()):
            if value < self.entropy_collapse_threshold:
                self._warn_once(
                    f"collapse:{name}:{h}",
                    f"AttentionMonitor: head {h} of attention module {name!r} has normalised entropy {value:.3f} < "
                    f"entropy_collapse_threshold={self.entropy_collapse_threshold}: nearly every query looks at a "
                    "single key (attention collapse, or a sink).",
                )

    def _write_images_and_text(
        self,
        writer: Any,
        name: str,
        layer: str,
        stats: AttentionStats,
        mass: Tensor,
        mass_heads: Tensor,
        sum_mean: Tensor,
        reference: dict[str, Tensor] | None,
        moved: dict[str, Tensor],
        step: int,
        prefix: str,
        suffix: str,
    ) -> None:
        query_stream, key_stream = self._streams_of[name]
        square = query_stream == key_stream
        images: dict[str, Any] = {}
        texts: dict[str, str] = {}
        if not suffix:
            self._probe_images(images, name, layer)
        rows = F.top_tokens(stats.query_count[self._tokens(query_stream)], self.top_k)
        # Cross-attention's keys by how often they were visible: a pass over C, not paid for self-attention.
        cols = rows if square else F.top_tokens(stats.pair_count[:, self._tokens(key_stream)].sum(dim=0), self.top_k)
        if len(rows) and len(cols):
            row_labels = self._label(rows.tolist(), query_stream)
            col_labels = self._label(cols.tolist(), key_stream)

            def draw(tag: str, shown: Tensor, title: str, colour: str, diverging: bool = False) -> None:
                matrix = shown.float().cpu().numpy()
                images[tag] = self._figures.heatmap(
                    tag + suffix,
                    matrix,
                    row_labels,
                    col_labels,
                    f"{layer}: {title}",
                    colour,
                    diverging,
                    self._color_limit(tag + suffix, matrix),
                    alpha=True,  # the writer thread drops it: a plain copy here
                )

            # Maps are drawn from the shown block only: differences of whole V × V matrices would be wasted work.
            shown = mass[rows][:, cols]  # (top rows, top cols)
            draw(f"{prefix}_mass/{layer}", shown, "attention mass P (mean of heads)", "P[query, key]")
            if self.per_head:
                tag = f"{prefix}_mass_heads/{layer}"
                matrices = mass_heads[:, rows][:, :, cols].float().cpu().numpy()
                images[tag] = self._figures.head_grid(
                    tag + suffix,
                    matrices,
                    row_labels,
                    col_labels,
                    f"{layer}: attention mass P per head",
                    "P[query, key]",
                    vmax=self._color_limit(tag + suffix, matrices),
                    alpha=True,
                )
            if square:  # rows == cols, so the block of Pᵀ is the transposed block
                draw(
                    f"{prefix}_asymmetry_map/{layer}",
                    shown - shown.T,
                    "P - Pᵀ (red: query attends to key more than back)",
                    "P[a, b] - P[b, a]",
                    True,
                )
            lift = F.lift(sum_mean[rows][:, cols], stats.uniform_sum[rows][:, cols])
            # log2 lift, blank where the pair was never visible (no evidence either way).
            log_lift = torch.where(stats.pair_count[rows][:, cols] > 0, torch.log2(lift.clamp(min=1e-6)), float("nan"))
            draw(
                f"{prefix}_lift_map/{layer}",
                log_lift,
                "log2 lift over uniform attention (red: more than chance)",
                "log2(S / U)",
                True,
            )
            if reference is not None:
                ref_mass = _snapshot_mean(reference)[rows.cpu()][:, cols.cpu()].to(mass.device)
                draw(
                    f"{prefix}_drift_map/{layer}",
                    shown - ref_mass,
                    f"P now - P at epoch {self._reference_epoch} (red: attends more now)",
                    "P_t - P_ref",
                    True,
                )
        if self.num_pairs:
            texts.update(self._tables(name, layer, stats, mass, sum_mean, reference, moved, prefix, suffix))
        for tag, image in images.items():
            self._paint(functools.partial(_add_image, writer, tag + suffix, image, step))
        for tag, text in texts.items():
            self._paint(functools.partial(writer.add_text, tag + suffix, text, step))

    def _paint(self, job: Callable[[], Any]) -> None:
        """Run ``job`` (encode and write one image, or write a text) on the worker thread, after those before it.
        At most ``_MAX_PENDING`` jobs wait: pictures are megabytes each, and drawing can outrun encoding."""
        if self._painter is None:
            self._painter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attn_callbacks-images")
        pending = [future for future in self._painted if not future.done()]
        if len(pending) >= _MAX_PENDING:
            wait(pending[: len(pending) - _MAX_PENDING + 1])
        self._painted.append(self._painter.submit(job))

    def _finish_painting(self, raise_errors: bool = True) -> None:
        """Wait for every job of this epoch end and stop the worker; re-raise the first job's error. When
        ``raise_errors`` is False (the epoch end already failed), or when the wait itself is interrupted (Ctrl+C),
        jobs not yet started are dropped and their errors too; the worker is stopped either way."""
        painter, jobs = self._painter, self._painted
        if painter is None:
            return
        try:
            painter.shutdown(wait=True, cancel_futures=not raise_errors)
        except BaseException:
            painter.shutdown(wait=True, cancel_futures=True)  # waits for the job in progress only
            raise
        finally:
            self._painter, self._painted = None, []
        if raise_errors:
            for job in jobs:
                job.result()

    def _color_limit(self, tag: str, values: Any) -> float | None:
        """Top of an image's colour scale: its own largest value (``color_scale="epoch"``), or the largest any epoch
        drew under this tag so far (``"shared"``: the scale only widens, so maps of later epochs compare by eye)."""
        if self.color_scale == "epoch":
            return None
        limit = max(self._color_limits.get(tag, 0.0), render.abs_max(values))
        self._color_limits[tag] = limit
        return limit

    def _probe_images(self, images: dict[str, Any], name: str, layer: str) -> None:
        prefix = self._stage_prefix
        weights = self._probe_weights.get(name)
        if weights is None or self._probe_ids is None:
            return
        query_stream, key_stream = self._streams_of[name]
        query_ids, key_ids = self._probe_ids[query_stream], self._probe_ids[key_stream]
        for sample in range(min(weights.shape[0], query_ids.shape[0])):
            q_ids, k_ids = query_ids[sample], key_ids[sample]
            q_pos, k_pos = self._valid(q_ids).nonzero()[:, 0], self._valid(k_ids).nonzero()[:, 0]
            per_head = weights[sample][:, q_pos][:, :, k_pos]  # (H, valid Lq, valid Lk)
            panels = torch.cat([per_head.mean(dim=0, keepdim=True), per_head]).numpy()
            tag = f"{prefix}_probe/{layer}/sample_{sample}"
            images[tag] = self._figures.head_grid(
                tag,
                panels,
                self._token_label(q_ids[q_pos].tolist(), query_stream),
                self._token_label(k_ids[k_pos].tolist(), key_stream),
                f"{layer}: probe sample {sample}, attention weight (query position × key position)",
                "weight",
                titles=["mean of heads"] + [f"head {h}" for h in range(per_head.shape[0])],
                vmax=self._color_limit(tag, panels),
                alpha=True,
            )

    def _tables(
        self,
        name: str,
        layer: str,
        stats: AttentionStats,
        mass: Tensor,
        sum_mean: Tensor,
        reference: dict[str, Tensor] | None,
        moved_rows: dict[str, Tensor],
        prefix: str,
        suffix: str,
    ) -> dict[str, str]:
        query_stream, key_stream = self._streams_of[name]
        square = query_stream == key_stream
        tq, tk = self._tokens(query_stream), self._tokens(key_stream)  # tokens only, no <other>
        count = stats.pair_count[tq, tk]
        tables: dict[str, str] = {}

        def table(header: Sequence[str], rows: list[Sequence[object]], empty: str) -> str:
            return render.markdown_table(header, rows) if rows else empty

        def q_label(a: int) -> str:
            return self._label([a], query_stream)[0]

        def k_label(b: int) -> str:
            return self._label([b], key_stream)[0]

        needs = f"No pair seen at least min_support={self.min_support} times"
        if square:
            rows = [
                (q_label(a), k_label(b), score, float(mass[a, b]), float(mass[b, a]), int(count[a, b]))
                for a, b, score in F.one_way_pairs(mass[tq, tk], count, self.num_pairs, self.min_support)
            ]
            header = ("query a", "key b", "(P[a,b]-P[b,a])/(P[a,b]+P[b,a])", "P[a,b]", "P[b,a]", "pairs C[a,b]")
            tables[f"{prefix}_one_way_pairs/{layer}"] = table(header, rows, f"{needs} in both directions.")
        lift = F.lift(sum_mean[tq, tk], stats.uniform_sum[tq, tk])
        rows = [
            (q_label(a), k_label(b), score, float(mass[a, b]), float(stats.uniform_sum[a, b] / stats.query_count[a]))
            for a, b, score in F.top_pairs(lift, count, self.num_pairs, self.min_support)
        ]
        header = ("query a", "key b", "lift S/U", "P[a,b]", "uniform U[a,b]/Q[a]")
        tables[f"{prefix}_lift_pairs/{layer}"] = table(header, rows, f"{needs}.")
        if reference is not None and "ref" in moved_rows:
            ref_mass = _snapshot_mean(reference)  # where the snapshot lives: only the moved rows are read
            ref_count = reference["query_count"].to(mass.device)
            moved = F.moved_tokens(
                mass[tq],
                None,
                stats.query_count[tq],
                ref_count[tq],
                self.num_pairs,
                self.min_support,
                moved_rows["ref"][tq],
            )
            prev_js: list[Any] = [""] * len(moved)
            if "prev" in moved_rows and moved:  # NaN (not shown) where the token was too rare in the previous epoch
                prev_js = [
                    "" if math.isnan(js) else js
                    for js in moved_rows["prev"][torch.tensor([a for a, _ in moved], device=mass.device)].tolist()
                ]
            rows = [
                (
                    q_label(a),
                    js,
                    prev,
                    k_label(int(mass[a, tk].argmax())),
                    k_label(int(ref_mass[a, tk].argmax())),
                    int(stats.query_count[a]),
                )
                for (a, js), prev in zip(moved, prev_js, strict=True)
            ]
            header = (
                "query token",
                f"JS vs epoch {self._reference_epoch}",
                f"JS vs epoch {self._previous_epoch}",
                "top key now",
                "top key then",
                "Q now",
            )
            tables[f"{prefix}_drift_tokens/{layer}"] = table(header, rows, "No query token seen often enough.")
        degree = F.in_degree(sum_mean, stats.query_count)
        if square:
            # The sums give P's ranks (rows are normalised); last epoch's ranks are a close first guess.
            start = self._ranks.get((name, prefix, suffix))
            start = start if start is not None and start.shape == degree.shape else None  # a new model: no guess
            rank = F.pagerank(sum_mean, start=start)
            self._ranks[(name, prefix, suffix)] = rank
            order = F.top_tokens((rank * (degree > 0))[tk], self.num_pairs).tolist()
            rows = [(k_label(b), float(rank[b]), float(degree[b]), int(stats.query_count[b])) for b in order]
            header = ("token", "PageRank", "in-degree (share of attention received)", "Q")
        else:
            order = F.top_tokens(degree[tk], self.num_pairs).tolist()
            rows = [(k_label(b), float(degree[b])) for b in order]
            header = ("key token", "in-degree (share of attention received)")
        tables[f"{prefix}_hubs/{layer}"] = table(header, rows, "No attention recorded.")
        return tables


def _module_device(module: nn.Module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    return torch.device("cpu")


def _log_heads(trainer: Trainer, heads: dict[tuple[str, str], Tensor]) -> None:
    """Per-head scalars (``heads``: ``(tag, suffix)`` -> ``(H,)`` values, logged as ``{tag}/head_{h}{suffix}``)
    straight to every logger of the Trainer in one call, from global rank 0, with ``epoch`` and at the step, as
    Lightning logs the layer scalars that went through ``LightningModule.log`` in the same hook (a CSV gets one row of
    them per epoch end).

    ``LightningModule.log`` keeps a result object per tag and walks it on every call (about 1 ms each: a model of
    12 layers × 12 heads has thousands of per-head scalars), and would also fill ``callback_metrics``,
    ``logged_metrics`` and what ``trainer.validate`` returns and prints with them. Like Lightning's own epoch-end
    logging, nothing is written during the sanity check.
    """
    if not heads or trainer.sanity_checking or not trainer.is_global_zero or not trainer.loggers:
        return
    # Lightning's own step for epoch-end metrics (its LoggerConnector reads the same counter, unless the model logs
    # a metric named "step"); global_step is one more at the end of a training epoch.
    step = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)
    device = next(iter(heads.values())).device
    values = iter(torch.cat([v.detach().reshape(-1).double().to(device) for v in heads.values()]).tolist())
    metrics: dict[str, float] = {
        f"{tag}/head_{h}{suffix}": next(values) for (tag, suffix), v in heads.items() for h in range(v.numel())
    }
    metrics["epoch"] = trainer.current_epoch
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


def _tensorboard_writer(trainer: Trainer) -> Any:
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            return logger.experiment
    return None


def _snapshot_mean(memory: dict[str, Tensor]) -> Tensor:
    """``mean_h P`` of a drift snapshot, ``(Vq, Vk)``: as that epoch computed it, or computed once (a snapshot from a
    checkpoint, which leaves it out as derivable) and kept."""
    if "mean_mass" not in memory:
        memory["mean_mass"] = _head_mean(memory["attention_mass"])
    return memory["mean_mass"]


def _head_mean(heads: Tensor) -> Tensor:
    """``mean_h`` of ``(H, ...)``: a view of the one head when ``H = 1`` (``per_head=False``), not a second copy."""
    return heads[0] if heads.shape[0] == 1 else heads.mean(dim=0)


def _checkpointed(snapshots: dict[str, dict[str, Tensor]]) -> dict[str, dict[str, Tensor]]:
    """Drift snapshots without what :func:`_snapshot_mean` derives again: checkpoints stay ``1 / H`` smaller."""
    return {name: {k: v for k, v in memory.items() if k != "mean_mass"} for name, memory in snapshots.items()}


def _add_image(writer: Any, tag: str, image: Any, step: int) -> None:
    """``writer.add_image(tag, image[..., :3], step, dataformats="HWC")`` for an ``(H, W, 3)`` RGB or ``(H, W, 4)``
    RGBA uint8 array (the alpha is dropped), without its float round trip and with faster PNG compression
    (:func:`render.png_bytes`); the same event a reader sees."""
    if not isinstance(writer, SummaryWriter):  # tensorboardX's, say: other protobuf classes, so its own add_image
        writer.add_image(tag, image[..., :3], step, dataformats="HWC")
        return
    height, width = image.shape[:2]
    picture = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=render.png_bytes(image))
    writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=picture)]), step)


def _as_list(loaders: Any) -> list[Any]:
    if loaders is None:
        return []
    if isinstance(loaders, Mapping):
        return list(loaders.values())
    return list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]


def _fresh_iter(loader: Any) -> Any:
    """An iterator of its own over a dataloader: a persistent-workers DataLoader hands every ``iter()`` the same
    iterator, which the running evaluation loop is using, so iterate a shallow copy without it."""
    if isinstance(loader, torch.utils.data.DataLoader):
        loader = copy.copy(loader)
        loader._iterator = None
    return iter(loader)


def _format_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
