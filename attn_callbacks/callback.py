"""AttentionMonitor: the thin Lightning Callback wiring capture, token streams, accumulators and rendering together."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from attn_callbacks import functional as F
from attn_callbacks import render
from attn_callbacks.capture import AttentionCapture, find_attention_modules
from attn_callbacks.metrics import AttentionAccumulator, AttentionStats
from attn_callbacks.render import TokenLabels
from attn_callbacks.tokens import (
    TokenSource,
    check_ids_in_range,
    read_stream,
    resolve_streams,
    resolve_vocab_sizes,
    stream_getters,
)

__all__ = ["AttentionMonitor"]


def _positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"Expected argument `{name}` to be {what}, but got {value!r}")
    return value


class AttentionMonitor(Callback):
    r"""Log which vocabulary items attend to which, per attention layer and head, every validation epoch.

    During validation it hooks every selected ``torch.nn.MultiheadAttention`` of the LightningModule (stock
    ``nn.Transformer*`` layers included), maps each attention weight to the (query token id, key token id) pair it
    connects and accumulates, on the module's device, per module (see the glossary in the README):

    - ``S[h, a, b]``: attention sum; ``C[a, b]``: pair count; ``Q[a]``: query count.

    At the end of each logged validation epoch it computes, per module, the attention mass ``P = S / Q[:, None]``
    (per head, and head-averaged ``P̄ = mean_h P[h]``), and logs

    - scalars (through ``LightningModule.log``, so every logger gets them):
      ``{prefix}_asymmetry/{layer}`` = ``sqrt(1 - <P̄, P̄ᵀ> / <P̄, P̄>)`` (self-attention only; ``/head_{h}`` per head),
      ``{prefix}_entropy/{layer}`` = ``Σ_a Q[a] H(P̄[a, :]) / Σ_a Q[a]`` in nats (``/head_{h}`` per head),
      ``{prefix}_skipped_rows/{layer}`` = query rows dropped for non-finite weights;
    - images (TensorBoard only): ``{prefix}_mass/{layer}``, the heatmap of ``P̄`` over the ``top_k`` most frequent
      query and key tokens; ``{prefix}_mass_heads/{layer}``, one heatmap per head; ``{prefix}_asymmetry_map/{layer}``,
      ``P̄ - P̄ᵀ`` (self-attention only);
    - text (TensorBoard only): ``{prefix}_one_way_pairs/{layer}``, the pairs with the largest
      ``(P̄[a, b] - P̄[b, a]) / (P̄[a, b] + P̄[b, a])`` seen at least ``min_support`` times both ways.

    Args:
        vocab_size: vocabulary size, or a mapping stream name -> size when streams use different vocabularies.
        token_ids: where the token ids ``(B, L)`` of a batch are: a batch key (mapping key, sequence index or
            attribute), a callable ``batch -> LongTensor``, or a mapping of stream names to either, e.g.
            ``{"src": "src_ids", "tgt": "tgt_ids"}``.
        id_to_token: labels for the heatmap axes: a list, dict or callable id -> str, or a mapping stream name -> one
            of those. Ids are shown when None.
        modules: fnmatch patterns over ``named_modules()`` names selecting the attention modules; all when None.
        attention_streams: fnmatch pattern -> ``(query_stream, key_stream)``, first match wins. Needed only when
            there are several streams and the modules are not stock ``nn.Transformer`` layers fed by streams named
            ``src`` and ``tgt``.
        ignore_ids: token ids excluded as queries and as keys (padding, say); they may lie outside the vocabulary.
        batch_first: layout of the token id tensors in the batch: ``(B, L)`` when True, ``(L, B)`` when False.
        top_k: how many of the most frequent query and key tokens the heatmaps show.
        per_head: also log per-head scalars and the per-head heatmap grid.
        num_pairs: rows of the one-way pairs table.
        min_support: minimum pair count, both ways, for a pair to enter the one-way table.
        log_every_n_epochs: monitor validation epochs 0, n, 2n, ... (other epochs are not hooked at all).
        log_sanity_check: also monitor Lightning's sanity-check validation pass.
        validate_args: check token id ranges every batch (one host sync per stream and batch); turn off for speed.
        prefix: the first part of every logged tag.

    Example:
        >>> monitor = AttentionMonitor(vocab_size=100, token_ids="input_ids", ignore_ids=[0])
        >>> trainer = Trainer(callbacks=[monitor])  # doctest: +SKIP
    """

    def __init__(
        self,
        vocab_size: int | dict[str, int],
        token_ids: TokenSource | dict[str, TokenSource] = "input_ids",
        id_to_token: TokenLabels | dict[str, TokenLabels] = None,
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
    ) -> None:
        self._getters = stream_getters(token_ids)
        self._vocab = resolve_vocab_sizes(vocab_size, list(self._getters))
        streams = list(self._getters)
        if isinstance(id_to_token, Mapping) and id_to_token and all(key in streams for key in id_to_token):
            self._labels: dict[str, TokenLabels] = {s: id_to_token.get(s) for s in streams}
        else:
            self._labels = dict.fromkeys(streams, id_to_token)
        if modules is not None and (isinstance(modules, str) or not all(isinstance(p, str) for p in modules)):
            raise ValueError(f"Expected argument `modules` to be a list of fnmatch patterns, but got {modules!r}")
        self.modules = None if modules is None else list(modules)
        self.attention_streams = dict(attention_streams) if attention_streams else None
        if isinstance(ignore_ids, (int, str)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ignore_ids
        ):
            raise ValueError(f"Expected argument `ignore_ids` to be a sequence of integers, but got {ignore_ids!r}")
        self.ignore_ids = sorted(set(ignore_ids))
        self.batch_first = bool(batch_first)
        self.top_k = _positive_int("top_k", top_k)
        self.per_head = bool(per_head)
        self.num_pairs = _positive_int("num_pairs", num_pairs, minimum=0)
        self.min_support = _positive_int("min_support", min_support)
        self.log_every_n_epochs = _positive_int("log_every_n_epochs", log_every_n_epochs)
        self.log_sanity_check = bool(log_sanity_check)
        self.validate_args = bool(validate_args)
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"Expected argument `prefix` to be a non-empty string, but got {prefix!r}")
        self.prefix = prefix

        self._attention: dict[str, nn.MultiheadAttention] = {}
        self._streams_of: dict[str, tuple[str, str]] = {}
        self._metrics: dict[str, AttentionAccumulator] = {}
        self._capture: AttentionCapture | None = None
        self._batch: Any = None
        self._batch_ids: dict[str, tuple[Tensor, Tensor]] = {}
        self._warned: set[str] = set()

    # ----------------------------------------------------------------------------------------------- Lightning hooks
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Find the attention modules and decide their token streams; misconfiguration fails here, not mid-epoch."""
        try:
            self._attention = find_attention_modules(pl_module, self.modules)
            self._streams_of = resolve_streams(
                list(self._attention), pl_module, list(self._getters), self.attention_streams
            )
        except ValueError as err:
            raise MisconfigurationException(f"AttentionMonitor: {err}") from err
        self._capture = AttentionCapture(self._attention, self._consume)

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._capture is None or not self._monitored(trainer):
            return
        with torch.inference_mode(False):  # state tensors must be normal tensors, not inference tensors
            for name, module in self._attention.items():
                device = _module_device(module)
                metric = self._metrics.get(name)
                if metric is None:
                    query_stream, key_stream = self._streams_of[name]
                    metric = AttentionAccumulator(module.num_heads, self._vocab[query_stream], self._vocab[key_stream])
                    self._metrics[name] = metric
                metric.to(device)
                metric.reset()
        self._capture.attach()

    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._batch = batch
        self._batch_ids.clear()
        if self._capture is not None and self._capture.attached:
            # Read (and check) the ids before the model runs, so bad ids fail here with a clear message.
            for stream in dict.fromkeys(s for pair in self._streams_of.values() for s in pair):
                self._stream_ids(stream, pl_module.device)

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

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._capture is None or not self._capture.attached:
            return
        self._release()
        writer = _tensorboard_writer(trainer)
        if writer is None and trainer.is_global_zero:
            self._warn_once(
                "no_tb",
                "AttentionMonitor: no TensorBoardLogger in the Trainer, so heatmaps and tables are "
                "skipped; scalars are still logged to the Trainer's loggers.",
            )
        for name, metric in self._metrics.items():
            stats = metric.compute()  # a collective under DDP: every rank calls it
            self._log_module(pl_module, name, stats, writer if trainer.is_global_zero else None, trainer.global_step)
            metric.reset()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._release()
        for metric in self._metrics.values():
            metric.reset()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._release()

    # ----------------------------------------------------------------------------------------------------- internals
    def _monitored(self, trainer: Trainer) -> bool:
        if trainer.sanity_checking:
            return self.log_sanity_check
        return trainer.current_epoch % self.log_every_n_epochs == 0

    def _release(self) -> None:
        if self._capture is not None:
            self._capture.detach()
        self._batch = None
        self._batch_ids.clear()

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message)

    def _stream_ids(self, stream: str, device: torch.device) -> tuple[Tensor, Tensor]:
        """(ids, valid) of one stream of the current batch, read once per batch."""
        if stream not in self._batch_ids:
            ids = read_stream(self._batch, stream, self._getters[stream], self.batch_first).to(device)
            valid = (
                ~torch.isin(ids, torch.tensor(self.ignore_ids, device=device, dtype=ids.dtype))
                if self.ignore_ids
                else torch.ones_like(ids, dtype=torch.bool)
            )
            if self.validate_args:
                check_ids_in_range(ids, valid, self._vocab[stream], stream)
            self._batch_ids[stream] = (ids, valid)
        return self._batch_ids[stream]

    def _consume(self, name: str, module: nn.MultiheadAttention, weights: Tensor) -> None:
        if self._batch is None:
            raise RuntimeError(
                f"AttentionMonitor: attention module {name!r} ran outside a validation batch while hooked"
            )
        if weights.dim() == 3:  # unbatched call: (H, Lq, Lk)
            weights = weights.unsqueeze(0)
        query_stream, key_stream = self._streams_of[name]
        # .to() is a no-op unless the module lives on another device than the LightningModule's (model parallel).
        query_ids, query_valid = (t.to(weights.device) for t in self._stream_ids(query_stream, weights.device))
        key_ids, key_valid = (t.to(weights.device) for t in self._stream_ids(key_stream, weights.device))
        batch, _, len_q, len_k = weights.shape
        if query_ids.shape != (batch, len_q) or key_ids.shape != (batch, len_k):
            raise ValueError(
                f"AttentionMonitor: attention module {name!r} returned weights of shape (B, H, Lq, Lk) = "
                f"{tuple(weights.shape)}, which does not match the token ids of its query stream {query_stream!r} "
                f"{tuple(query_ids.shape)} and key stream {key_stream!r} {tuple(key_ids.shape)} (expected (B, Lq) and "
                "(B, Lk); see arguments `attention_streams` and `batch_first`)"
            )
        self._metrics[name].update(weights, query_ids, key_ids, query_valid, key_valid)

    def _log_module(self, pl_module: LightningModule, name: str, stats: AttentionStats, writer: Any, step: int) -> None:
        layer = name or "attention"
        query_stream, key_stream = self._streams_of[name]
        square = query_stream == key_stream
        mass_heads = stats.attention_mass  # (H, Vq, Vk)
        mass = F.attention_mass(stats.attention_sum.mean(dim=0), stats.query_count)  # (Vq, Vk)

        scalars = {
            f"{self.prefix}_entropy/{layer}": F.row_entropy(mass, stats.query_count),
            f"{self.prefix}_skipped_rows/{layer}": stats.skipped_rows.float(),
        }
        if square:
            scalars[f"{self.prefix}_asymmetry/{layer}"] = F.asymmetry_index(mass)
        if self.per_head:
            entropy_heads = F.row_entropy(mass_heads, stats.query_count)
            asymmetry_heads = F.asymmetry_index(mass_heads) if square else None
            for h in range(mass_heads.shape[0]):
                scalars[f"{self.prefix}_entropy/{layer}/head_{h}"] = entropy_heads[h]
                if asymmetry_heads is not None:
                    scalars[f"{self.prefix}_asymmetry/{layer}/head_{h}"] = asymmetry_heads[h]
        for tag, value in scalars.items():
            pl_module.log(tag, value.float(), on_step=False, on_epoch=True, sync_dist=False)
        if int(stats.skipped_rows) > 0:
            self._warn_once(
                f"skipped:{name}",
                f"AttentionMonitor: {int(stats.skipped_rows)} query rows of attention module {name!r} had non-finite "
                "weights (fully masked rows?) and were left out of the sums",
            )
        if writer is None:
            return

        rows = F.top_tokens(stats.query_count, self.top_k)
        key_frequency = stats.pair_count.sum(dim=0)
        cols = rows if square else F.top_tokens(key_frequency, self.top_k)
        if len(rows) == 0 or len(cols) == 0:
            return
        row_labels = render.label_tokens(rows.tolist(), self._labels[query_stream])
        col_labels = render.label_tokens(cols.tolist(), self._labels[key_stream])

        def block(matrix: Tensor) -> Any:  # (..., Vq, Vk) -> (..., top rows, top cols) as numpy
            return matrix[..., rows, :][..., cols].float().cpu().numpy()

        images = {
            f"{self.prefix}_mass/{layer}": render.heatmap(
                block(mass), row_labels, col_labels, f"{layer}: attention mass P (mean of heads)", "P[query, key]"
            )
        }
        if self.per_head:
            images[f"{self.prefix}_mass_heads/{layer}"] = render.head_grid(
                block(mass_heads), row_labels, col_labels, f"{layer}: attention mass P per head", "P[query, key]"
            )
        if square:
            images[f"{self.prefix}_asymmetry_map/{layer}"] = render.heatmap(
                block(mass - mass.T),
                row_labels,
                col_labels,
                f"{layer}: P - Pᵀ (red: query attends to key more than back)",
                "P[a, b] - P[b, a]",
                diverging=True,
            )
        for tag, figure in images.items():
            writer.add_image(tag, render.figure_to_array(figure), step, dataformats="HWC")
        if square and self.num_pairs:
            pairs = F.one_way_pairs(mass, stats.pair_count, self.num_pairs, self.min_support)
            labels = self._labels[query_stream]
            table = [
                (
                    render.label_tokens([a], labels)[0],
                    render.label_tokens([b], labels)[0],
                    score,
                    float(mass[a, b]),
                    float(mass[b, a]),
                    int(stats.pair_count[a, b]),
                )
                for a, b, score in pairs
            ]
            header = ("query a", "key b", "(P[a,b]-P[b,a])/(P[a,b]+P[b,a])", "P[a,b]", "P[b,a]", "pairs C[a,b]")
            text = (
                render.markdown_table(header, table)
                if table
                else (f"No pair seen at least min_support={self.min_support} times in both directions.")
            )
            writer.add_text(f"{self.prefix}_one_way_pairs/{layer}", text, step)


def _module_device(module: nn.Module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    return torch.device("cpu")


def _tensorboard_writer(trainer: Trainer) -> Any:
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            return logger.experiment
    return None
