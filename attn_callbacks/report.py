"""One monitored epoch's results for one module: its numbers (from :mod:`attn_callbacks.summary`), warnings, images
and tables, handed to the writers."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from attn_callbacks.accumulate import AttentionStats
from attn_callbacks.dashboard import grid_tag, head_tag, layer_tag, scalars_layout
from attn_callbacks.drift import DriftMemory
from attn_callbacks.images import Images
from attn_callbacks.probe import Probe
from attn_callbacks.streams import Streams
from attn_callbacks.summary import ModuleSummary, attention_mass, summarize
from attn_callbacks.tables import module_tables, top_tokens
from attn_callbacks.writer import Painter, add_layout, log_heads, log_layer, quick_checksums, tensorboard_writer

__all__ = ["Reporter"]


# TensorBoard run -> tag prefix -> the custom-scalars layout part written there, for every Reporter of the process.
_LAYOUTS: dict[str, dict[str, Any]] = {}


class _Output(NamedTuple):
    """What one module's tables and images are made of, and where they go."""

    writer: Any
    name: str
    layer: str
    streams: tuple[str, str]
    stats: AttentionStats
    mass: Tensor  # mean_h P, (Vq, Vk)
    reference: Any  # the reference epoch's Snapshot, or None
    drifts: dict[str, Any]
    step: int
    prefix: str
    suffix: str


class Reporter:
    """Turns a module's epoch sums into logged scalars, warnings, heatmaps and tables.

    Args are :class:`~attn_callbacks.AttentionMonitor`'s of the same names; ``streams``, ``drift`` and ``probe`` are
    the monitor's.
    """

    def __init__(
        self,
        streams: Streams,
        drift: DriftMemory,
        probe: Probe,
        *,
        per_head: bool,
        top_k: int,
        num_pairs: int,
        min_support: int,
        entropy_collapse_threshold: float,
        color_scale: str,
    ) -> None:
        self.streams, self.drift, self.probe = streams, drift, probe
        self.per_head = per_head
        self.top_k = top_k
        self.num_pairs = num_pairs
        self.min_support = min_support
        self.entropy_collapse_threshold = entropy_collapse_threshold
        self.images = Images(color_scale)
        self.painter = Painter()
        self._ranks: dict[tuple[str, str, str], Tensor] = {}  # the last PageRank per (module, prefix, suffix)
        self._logged: dict[tuple[str, str], dict[str, list[str]]] = {}  # (run, prefix) -> metric -> modules
        self._warned: set[str] = set()

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message)

    def tensorboard(self, trainer: Trainer) -> Any:
        """The TensorBoard writer of rank 0, or None (with a warning, once, when rank 0 has none)."""
        writer = tensorboard_writer(trainer)
        if writer is None and trainer.is_global_zero:
            why = (
                "fast_dev_run replaces the Trainer's loggers with a dummy one"
                if trainer.fast_dev_run
                else "no TensorBoardLogger in the Trainer"
            )
            self.warn_once(
                "no_tb",
                f"AttentionMonitor: {why}, so heatmaps and tables are skipped; scalars are still logged to the "
                "Trainer's loggers.",
            )
        return writer if trainer.is_global_zero else None

    def epoch(
        self,
        trainer: Trainer,
        per_loader: dict[tuple[str, int], AttentionStats],
        merged: dict[str, AttentionStats],
        prefix: str,
        drift: bool,
    ) -> dict[str, dict[str, Tensor]]:
        """Log every module's epoch: combined over dataloaders, and per dataloader (``/dataloader_idx_{k}``) when
        there are several. On a drift epoch, returns what drift memory keeps of the derived numbers, per module."""
        writer = self.tensorboard(trainer)
        _masses_in_place(merged)
        loaders = 1 + max(idx for _, idx in per_loader)
        derived: dict[str, dict[str, Tensor]] = {}
        heads: dict[tuple[str, str], Tensor] = {}  # every module's per-head scalars, logged in one call
        grids: dict[str, dict[str, dict[str, Tensor]]] = {}  # suffix -> metric -> module -> (H,) values
        logged: dict[str, list[str]] = {}  # metric -> the modules (tag names) logging it
        # Every module's numbers first, then its tables, then its pictures: the numba passes take both cores, and
        # the image writer thread then encodes while the drawing (one core) goes on, instead of competing with those
        # passes (measured: a table's pass 3x slower beside the writer). Neither kind of job reads what the other
        # makes, nor changes its inputs in place.
        tables: list[Callable[[], None]] = []
        draws: list[Callable[[], None]] = []
        pl_module, step = trainer.lightning_module, trainer.global_step
        with quick_checksums(writer):  # TensorBoard's own checksums would hold the GIL for ~0.15 s
            finished = False
            try:
                for name, stats in merged.items():
                    # The combined view (a drift epoch's, kept by drift memory), then each dataloader's when several.
                    views = [(stats, drift, "", derived if drift else None)]
                    if loaders > 1:
                        views += [(per_loader[(name, k)], False, f"/dataloader_idx_{k}", None) for k in range(loaders)]
                    for view, is_drift, suffix, keep in views:
                        where = dict(prefix=prefix, step=step, drift=is_drift, suffix=suffix, derived=keep)
                        summary = self.module(
                            pl_module, writer, name, self.streams.of[name], view, tables=tables, draws=draws, **where
                        )
                        if summary is None:
                            continue
                        layer = name or "attention"
                        for key in summary.layer:
                            if layer not in logged.setdefault(key, []):
                                logged[key].append(layer)
                        if self.per_head:
                            for key, values in summary.heads.items():
                                heads[(head_tag(prefix, key, layer), suffix)] = values
                                grids.setdefault(suffix, {}).setdefault(key, {})[name] = values
                for job in tables + draws:
                    job()
                log_heads(trainer, heads)
                if writer is not None:
                    self._dashboard(writer, grids, logged, prefix, step)
                finished = True
            finally:
                self.painter.finish(raise_errors=finished)
        return derived

    def _dashboard(
        self,
        writer: Any,
        grids: dict[str, dict[str, dict[str, Tensor]]],
        logged: dict[str, list[str]],
        prefix: str,
        step: int,
    ) -> None:
        """The head grid images of every per-head metric, and the custom-scalars layout when it has grown."""
        square = {name: queries == keys for name, (queries, keys) in self.streams.of.items()}  # self-attention
        for suffix, metrics in grids.items():
            for key, values in metrics.items():
                image = self.images.metric_grid(grid_tag(prefix, key), key, values, square, suffix)
                self.painter.image(writer, grid_tag(prefix, key) + suffix, image, step)
        run = _run_of(writer)
        seen = self._logged.setdefault((run, prefix), {})  # every epoch's modules: a layout never loses a chart
        for key, layers in logged.items():
            known = seen.setdefault(key, [])
            known += [layer for layer in layers if layer not in known]
        # prefix -> its part, shared by every monitor of this process: the plugin shows a run's last layout only, so
        # each write holds the parts of every prefix written to the run (test epochs, a second monitor).
        layouts = _LAYOUTS.setdefault(run, {})
        layout = scalars_layout(prefix, seen, self.per_head)
        if layouts.get(prefix) != layout:
            layouts[prefix] = layout
            merged = {category: charts for part in layouts.values() for category, charts in part.items()}
            self.painter.submit(lambda: add_layout(writer, merged, step))

    def module(
        self,
        pl_module: LightningModule,
        writer: Any,
        name: str,
        streams: tuple[str, str],
        stats: AttentionStats,
        *,
        tables: list[Callable[[], None]],
        draws: list[Callable[[], None]],
        prefix: str,
        step: int,
        drift: bool,
        suffix: str = "",
        derived: dict[str, dict[str, Tensor]] | None = None,
    ) -> ModuleSummary | None:
        """Log one module's scalars, images and tables; return its numbers (None when it saw no query token), whose
        per-head ones the caller logs. With ``derived``, what drift memory keeps of this epoch's numbers
        (``row_plogp``, ``mean_mass``, on ``P``'s device) goes there. The tables and images are not made here: a call
        that makes them is appended to ``tables`` and to ``draws``, for the caller to run."""
        if int(stats.query_count.sum()) == 0:
            return None  # nothing seen by this module (or this dataloader): no numbers to log
        layer = name or "attention"
        square = streams[0] == streams[1]
        mass_heads = stats.attention_mass  # (H, Vq, Vk)
        previous, reference = self.drift.snapshots(name, mass_heads.shape) if drift else (None, None)
        summary = summarize(
            mass_heads,
            stats.attention_sum,
            stats.uniform_sum,
            stats.query_count,
            stats.position_sums,
            stats.skipped_rows,
            square=square,
            sink_ids=self.streams.sink_indices(streams[1]),
            previous=previous,
            reference=reference,
            min_support=self.min_support,
        )
        mass = summary.mean_mass
        if derived is not None:
            derived[name] = {"row_plogp": summary.plogp_heads, "mean_mass": mass}  # drift memory moves them to the CPU
        log_layer(pl_module, {layer_tag(prefix, key, layer) + suffix: value for key, value in summary.layer.items()})
        self._warn(name, summary.heads.get("position/entropy_normalized"), stats)
        if writer is not None:
            out = _Output(writer, name, layer, streams, stats, mass, reference, summary.drifts, step, prefix, suffix)
            if self.num_pairs:
                tables.append(partial(self._tables, out))
            draws.append(partial(self._draw, out))
        return summary

    def _warn(self, name: str, entropy_normalized: Tensor | None, stats: AttentionStats) -> None:
        if self.entropy_collapse_threshold > 0 and entropy_normalized is not None:
            for h, value in enumerate(entropy_normalized.tolist()):
                if value < self.entropy_collapse_threshold:
                    self.warn_once(
                        f"collapse:{name}:{h}",
                        f"AttentionMonitor: head {h} of attention module {name!r} has normalised entropy {value:.3f} "
                        f"< entropy_collapse_threshold={self.entropy_collapse_threshold}: nearly every query looks at "
                        "a single key (attention collapse, or a sink).",
                    )
        if int(stats.skipped_rows) > 0:
            self.warn_once(
                f"skipped:{name}",
                f"AttentionMonitor: {int(stats.skipped_rows)} query rows of attention module {name!r} had non-finite "
                "or all-zero weights (fully masked rows? padded positions whose id is not in `ignore_ids`?) and were "
                "left out of the sums",
            )

    def _draw(self, out: _Output) -> None:
        writer, name, layer, streams, stats, mass, reference, _, step, prefix, suffix = out
        query_stream, key_stream = streams
        square = query_stream == key_stream
        label = self.streams.label
        images = {} if suffix else self._probe_maps(name, layer, streams, prefix)
        rows = top_tokens(stats.query_count[self.streams.tokens(query_stream)], self.top_k)
        # Cross-attention's keys by how often they were visible: a pass over C, not paid for self-attention.
        cols = (
            rows if square else top_tokens(stats.pair_count[:, self.streams.tokens(key_stream)].sum(dim=0), self.top_k)
        )
        if len(rows) and len(cols):
            images.update(
                self.images.module_maps(
                    f"{prefix}_{{family}}/{layer}",
                    layer,
                    mass=mass,
                    mass_heads=stats.attention_mass if self.per_head else None,
                    query_count=stats.query_count,
                    uniform_sum=stats.uniform_sum,
                    pair_count=stats.pair_count,
                    rows=rows,
                    cols=cols,
                    row_labels=label(rows.tolist(), query_stream),
                    col_labels=label(cols.tolist(), key_stream),
                    square=square,
                    reference_mass=None if reference is None else reference.mean_mass,
                    reference_epoch=self.drift.reference_epoch,
                    suffix=suffix,
                )
            )
        for tag, image in images.items():  # encoded by the writer thread while the next are drawn
            self.painter.image(writer, tag + suffix, image, step)

    def _tables(self, out: _Output) -> None:
        writer, name, layer, streams, stats, mass, reference, drifts, step, prefix, suffix = out
        query_stream, key_stream = streams
        square = query_stream == key_stream
        label = self.streams.label
        key = (name, prefix, suffix)
        tables, self._ranks[key] = module_tables(
            stats,
            mass,
            square=square,
            query_tokens=self.streams.tokens(query_stream),
            key_tokens=self.streams.tokens(key_stream),
            query_labels=lambda ids: label(ids, query_stream),
            key_labels=lambda ids: label(ids, key_stream),
            num_pairs=self.num_pairs,
            min_support=self.min_support,
            reference=reference,
            drifts=drifts,
            epochs=(self.drift.reference_epoch, self.drift.previous_epoch),
            rank_start=self._ranks.get(key),
        )
        for kind, table in tables.items():
            self.painter.text(writer, f"{prefix}_{kind}/{layer}{suffix}", table, step)

    def _probe_maps(self, name: str, layer: str, streams: tuple[str, str], prefix: str) -> dict[str, Any]:
        weights, ids = self.probe.weights.get(name), self.probe.ids
        if weights is None or ids is None:
            return {}
        query_ids, key_ids = ids[streams[0]], ids[streams[1]]
        samples = []
        for sample in range(min(weights.shape[0], query_ids.shape[0])):
            q_ids, k_ids = query_ids[sample], key_ids[sample]
            q_pos, k_pos = self.streams.valid(q_ids).nonzero()[:, 0], self.streams.valid(k_ids).nonzero()[:, 0]
            q_labels = self.streams.batch_label(q_ids[q_pos].tolist(), streams[0])
            samples.append((q_pos, k_pos, q_labels, self.streams.batch_label(k_ids[k_pos].tolist(), streams[1])))
        return self.images.probe_maps(f"{prefix}_probe/{layer}", layer, weights, samples)


def _masses_in_place(merged: dict[str, AttentionStats]) -> None:
    """Each module's ``P = S / Q`` computed where ``S`` lies, which leaves ``attention_sum`` None: nothing after this
    needs ``S`` (``Q * P`` gives it back), and no second matrix of the state's size is written (on the CPU, drift
    memory then keeps that memory as the snapshot, and the state takes a retired one's: see
    :meth:`attn_callbacks.drift.DriftMemory.state_buffer`)."""
    for stats in merged.values():
        sums = stats.attention_sum
        if sums is not None:
            stats.attention_mass = attention_mass(sums, stats.query_count, out=sums)  # the cached property
            stats.attention_sum = None


def _run_of(writer: Any) -> str:
    """The TensorBoard run a writer writes: its folder."""
    log_dir = getattr(writer, "log_dir", None) or getattr(writer, "logdir", None)
    return str(log_dir) if log_dir is not None else str(id(writer))
