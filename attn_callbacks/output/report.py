"""One monitored epoch's results for one module: its numbers (from :mod:`attn_callbacks.metrics.summary`), warnings,
images and tables, handed to the writers."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from torch import Tensor

from attn_callbacks.capture.probe import Probe
from attn_callbacks.capture.streams import Streams
from attn_callbacks.explorer.data import view_fits, write_epoch
from attn_callbacks.metrics.drift_memory import DriftMemory
from attn_callbacks.metrics.summary import ModuleSummary, attention_mass, summarize
from attn_callbacks.metrics.tables import module_tables, top_tokens
from attn_callbacks.output.dashboard import grid_tag, head_tag, layer_tag, scalars_layout
from attn_callbacks.output.drawing import Drawing
from attn_callbacks.output.explore import explorer_view
from attn_callbacks.output.images import Images
from attn_callbacks.output.warn import Warnings
from attn_callbacks.output.writer import (
    BackgroundWriter,
    add_layout,
    fast_record_checksums,
    log_heads,
    log_layer,
    tensorboard_writer,
)
from attn_callbacks.sums.accumulator import AttentionStats

__all__ = ["Reporter"]


# TensorBoard run -> tag prefix -> the custom-scalars layout part written there, for every Reporter of the process.
_LAYOUTS: dict[str, dict[str, Any]] = {}


@dataclass(frozen=True)
class ModuleView:
    """One view of one module's epoch (combined over dataloaders, or one dataloader's): what its tables and images are
    made of, and where they go."""

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
        explorer_size: int | None = None,
    ) -> None:
        self.streams, self.drift, self.probe = streams, drift, probe
        self.per_head = per_head
        self.top_k = top_k
        self.num_pairs = num_pairs
        self.min_support = min_support
        self.warnings = Warnings(entropy_collapse_threshold)
        self.explorer_size = explorer_size  # None: no explorer data
        self.images = Images(color_scale)
        self.background = BackgroundWriter()
        self.drawing = Drawing(self.images, self.background)  # pictures: drawn here, or in a drawing process
        self._ranks: dict[tuple[str, str, str], Tensor] = {}  # the last PageRank per (module, prefix, suffix)
        self._logged: dict[tuple[str, str], dict[str, list[str]]] = {}  # (run, prefix) -> metric -> modules

    def state_dict(self) -> dict[str, Any]:
        return {"color_limits": dict(self.images.limits)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.images.limits = dict(state.get("color_limits") or {})

    def close(self) -> None:
        """Stop the image writer of a failed epoch end, if one runs (its pending images are dropped), and drop what
        the drawing process returns of it."""
        self.background.finish(raise_errors=False)
        self.drawing.drop_epoch()

    def tensorboard(self, trainer: Trainer) -> Any:
        """The TensorBoard writer of rank 0, or None (with a warning, once, when rank 0 has none)."""
        writer = tensorboard_writer(trainer)
        if writer is None and trainer.is_global_zero:
            self.warnings.no_tensorboard(trainer)
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
        self.drawing.check()  # the last epoch's pictures, drawn since
        self.drawing.begin_epoch()
        writer = self.tensorboard(trainer)
        _masses_in_place(merged)
        derived: dict[str, dict[str, Tensor]] = {}
        finished = False
        # Every module's numbers first, then its tables, then its pictures: the numba passes take both cores, and
        # the image writer thread then encodes while the drawing (one core) goes on, instead of competing with those
        # passes (measured: a table's pass 3x slower beside the writer). Neither kind of job reads what the other
        # makes, nor changes its inputs in place.
        with fast_record_checksums(writer):
            try:
                made_of, heads, grids, logged = self._numbers(
                    trainer, writer, per_loader, merged, prefix, drift, derived
                )
                if self.num_pairs:
                    for out in made_of:
                        self._tables(out)
                if self.explorer_size is not None and not trainer.sanity_checking:
                    for out in made_of:
                        self._explore(out, trainer.current_epoch)
                for out in made_of:
                    self._draw(out)
                self.background.later(lambda: log_heads(trainer, heads))  # as the layer scalars: if all succeeds
                if writer is not None:
                    self._dashboard(writer, grids, logged, prefix, trainer.global_step)
                finished = True
            finally:
                self.background.finish(raise_errors=finished)
        return derived

    def _numbers(self, trainer, writer, per_loader, merged, prefix, drift, derived) -> tuple[list, dict, dict, dict]:
        """Every module's (and dataloader's) scalars, logged; returns the views its tables and pictures are made of,
        the per-head scalars ``(tag, suffix) -> (H,)``, the head grids ``suffix -> metric -> module -> (H,)`` and
        ``metric -> the modules (tag names) logging it``."""
        loaders = 1 + max(idx for _, idx in per_loader)
        made_of: list[ModuleView] = []
        heads: dict[tuple[str, str], Tensor] = {}
        grids: dict[str, dict[str, dict[str, Tensor]]] = {}
        logged: dict[str, list[str]] = {}
        pl_module, step = trainer.lightning_module, trainer.global_step
        for name, stats in merged.items():
            # The combined view (a drift epoch's, kept by drift memory), then each dataloader's when several.
            parts = [(stats, drift, "", derived if drift else None)]
            if loaders > 1:
                parts += [(per_loader[(name, k)], False, f"/dataloader_idx_{k}", None) for k in range(loaders)]
            for part, is_drift, suffix, keep in parts:
                where = dict(prefix=prefix, step=step, drift=is_drift, suffix=suffix, derived=keep)
                summary = self.module(pl_module, writer, name, self.streams.of[name], part, views=made_of, **where)
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
        return made_of, heads, grids, logged

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
                self.drawing.image(writer, grid_tag(prefix, key) + suffix, image, step)
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

            def write() -> None:  # the process's record of the run's layout changes with the write, if it is made
                layouts[prefix] = layout
                add_layout(
                    writer, {category: charts for part in layouts.values() for category, charts in part.items()}, step
                )

            self.background.later(write)

    def module(
        self,
        pl_module: LightningModule,
        writer: Any,
        name: str,
        streams: tuple[str, str],
        stats: AttentionStats,
        *,
        views: list[ModuleView],
        prefix: str,
        step: int,
        drift: bool,
        suffix: str = "",
        derived: dict[str, dict[str, Tensor]] | None = None,
    ) -> ModuleSummary | None:
        """Log one module's scalars, images and tables; return its numbers (None when it saw no query token), whose
        per-head ones the caller logs. With ``derived``, what drift memory keeps of this epoch's numbers
        (``row_plogp``, ``mean_mass``, on ``P``'s device) goes there. The tables and images are not made here: with a
        TensorBoard writer, the view they are made of is appended to ``views``, for the caller to make them from."""
        layer = name or "attention"
        if int(stats.query_count.sum()) == 0:  # nothing summed by this module (or this dataloader)
            skipped = int(stats.skipped_rows)
            if skipped:  # every row it saw was dropped: say so, rather than vanish
                skipped_tag = layer_tag(prefix, "skipped_rows", layer) + suffix
                log_layer(pl_module, {skipped_tag: stats.skipped_rows.float()}, self.background.later)
                self.warnings.all_skipped(name, skipped)
            return None
        square = streams[0] == streams[1]
        mass_heads = stats.attention_mass  # (H, Vq, Vk)
        previous, reference, lost = self.drift.snapshots(name, mass_heads.shape) if drift else (None, None, [])
        if lost:
            self.warnings.incomparable(name, tuple(mass_heads.shape), lost)
        summary = summarize(
            mass_heads,
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
        scalars = {layer_tag(prefix, key, layer) + suffix: value for key, value in summary.layer.items()}
        log_layer(pl_module, scalars, self.background.later)
        self.warnings.health(name, summary.heads.get("position/entropy_normalized"), int(stats.skipped_rows))
        label = functools.partial(self.streams.label, stream=streams[1])
        self.warnings.hidden_keys(name, streams[1], stats.pair_count, stats.uniform_sum, label)
        if writer is not None:
            views.append(
                ModuleView(writer, name, layer, streams, stats, mass, reference, summary.drifts, step, prefix, suffix)
            )
        return summary

    def _draw(self, out: ModuleView) -> None:
        name, layer, streams, stats, suffix = out.name, out.layer, out.streams, out.stats, out.suffix
        query_stream, key_stream = streams
        square = query_stream == key_stream
        label = self.streams.label
        images = {} if suffix else self._probe_maps(name, layer, streams, out.prefix)
        rows = top_tokens(stats.query_count[self.streams.tokens(query_stream)], self.top_k)
        # Cross-attention's keys by how often they were visible: a pass over C, not paid for self-attention.
        cols = (
            rows if square else top_tokens(stats.pair_count[:, self.streams.tokens(key_stream)].sum(dim=0), self.top_k)
        )
        if len(rows) and len(cols):
            images.update(
                self.images.module_maps(
                    f"{out.prefix}_{{family}}/{layer}",
                    layer,
                    mass=out.mass,
                    mass_heads=stats.attention_mass if self.per_head else None,
                    query_count=stats.query_count,
                    uniform_sum=stats.uniform_sum,
                    rows=rows,
                    cols=cols,
                    row_labels=label(rows.tolist(), query_stream),
                    col_labels=label(cols.tolist(), key_stream),
                    square=square,
                    reference_mass=None if out.reference is None else out.reference.mean_mass,
                    reference_epoch=self.drift.reference_epoch,
                    suffix=suffix,
                )
            )
        for tag, image in images.items():  # encoded by the writer thread while the next are drawn (or jobs)
            self.drawing.image(out.writer, tag + suffix, image, out.step)

    def _tables(self, out: ModuleView) -> None:
        query_stream, key_stream = out.streams
        square = query_stream == key_stream
        label = functools.partial(self.streams.label, max_length=None)  # whole: a cut label could read as another
        key = (out.name, out.prefix, out.suffix)
        tables, self._ranks[key] = module_tables(
            out.stats,
            out.mass,
            square=square,
            query_tokens=self.streams.tokens(query_stream),
            key_tokens=self.streams.tokens(key_stream),
            query_labels=lambda ids: label(ids, query_stream),
            key_labels=lambda ids: label(ids, key_stream),
            num_pairs=self.num_pairs,
            min_support=self.min_support,
            reference=out.reference,
            drifts=out.drifts,
            epochs=(self.drift.reference_epoch, self.drift.previous_epoch),
            rank_start=self._ranks.get(key),
        )
        for kind, table in tables.items():
            self.background.text(out.writer, f"{out.prefix}_{kind}/{out.layer}{out.suffix}", table, out.step)

    def _explore(self, out: ModuleView, epoch: int) -> None:
        """Hand the explorer's cut of this view (a copy, made here) to the writer, written if the epoch end succeeds."""
        run_dir, view = _run_dir(out.writer), f"{out.prefix}/{out.layer}{out.suffix}"
        if not view_fits(view):
            self.warnings.explorer_name(view)
            return
        where = dict(view=view, module=out.name, streams=out.streams, epoch=epoch, step=out.step)
        data = explorer_view(
            **where,
            stats=out.stats,
            mass=out.mass,
            per_head=self.per_head,
            size=self.explorer_size,
            tokens=self.streams,
        )
        if run_dir is not None and data is not None:
            self.background.later(lambda: write_epoch(run_dir, **data))

    def _probe_maps(self, name: str, layer: str, streams: tuple[str, str], prefix: str) -> dict[str, Any]:
        weights, ids = self.probe.weights.get(name), self.probe.ids
        if weights is None or ids is None:
            return {}
        # A checkpoint older than `token_mask` kept no valid positions: they were the ids not ignored.
        valid = self.probe.valid or {stream: self.streams.valid(stream_ids) for stream, stream_ids in ids.items()}
        query_ids, key_ids = ids[streams[0]], ids[streams[1]]
        samples = []
        for sample in range(min(weights.shape[0], query_ids.shape[0])):
            q_ids, k_ids = query_ids[sample], key_ids[sample]
            q_pos, k_pos = valid[streams[0]][sample].nonzero()[:, 0], valid[streams[1]][sample].nonzero()[:, 0]
            q_labels = self.streams.batch_label(q_ids[q_pos].tolist(), streams[0])
            samples.append((q_pos, k_pos, q_labels, self.streams.batch_label(k_ids[k_pos].tolist(), streams[1])))
        return self.images.probe_maps(f"{prefix}_probe/{layer}", layer, weights, samples)


def _masses_in_place(merged: dict[str, AttentionStats]) -> None:
    """Each module's ``P = S / Q`` computed where ``S`` lies, which leaves ``attention_sum`` None: nothing after this
    needs ``S`` (``Q * P`` gives it back), and no second matrix of the state's size is written (on the CPU, drift
    memory then keeps that memory as the snapshot, and the state takes a retired one's: see
    :meth:`attn_callbacks.metrics.drift_memory.DriftMemory.state_buffer`)."""
    for stats in merged.values():
        sums = stats.attention_sum
        if sums is not None:
            stats.attention_mass = attention_mass(sums, stats.query_count, out=sums)  # the cached property
            stats.attention_sum = None


def _run_dir(writer: Any) -> str | None:
    """The folder a TensorBoard writer writes to, None when it says none."""
    log_dir = getattr(writer, "log_dir", None) or getattr(writer, "logdir", None)
    return None if log_dir is None else str(log_dir)


def _run_of(writer: Any) -> str:
    """The TensorBoard run a writer writes: its folder (the writer's identity when it names none)."""
    return _run_dir(writer) or str(id(writer))
