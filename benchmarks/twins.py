"""Each numba twin against the torch / numpy code it stands beside, at the stress workload's shapes, on the CPU.

    python benchmarks/twins.py [--rounds 5] [--quick]

The project keeps a numba twin only where it is measured at least 1.5x faster on the stress workload
(benchmarks/_workload.py: 4 x nn.TransformerEncoderLayer(256, 8 heads), batch 32 x length 128, Zipf(1) ids over
8,000 tracked to 2,048 + <other>, 16 validation batches an epoch, the monitor's defaults: top_k 30, num_pairs 10,
min_support 5). The inputs are real: the stress encoder's own attention weights (a layer's ``self_attn`` called with
``need_weights=True, average_attn_weights=False`` on that layer's input), its epoch sums over three epochs (the model
nudged between them, as a training step would), the tracked ids chosen as the monitor chooses them. Timed, each with
the same inputs down both paths:

- ``step per_head=True`` / ``step per_head=False``: one batch added to the sums of all 4 modules (``S`` per head and
  ``U``, H + 1 planes; or the mean of the heads and ``U``, 2 planes), through ``EpochSums.add`` as the callback calls
  it: the torch path makes the pair index once per batch and shares it between the modules, numba reads the ids;
- ``summarize``: the epoch end's numbers of one module (the last layer) per head, with the previous and the reference
  epoch for drift, called as ``attn_callbacks/output/report.py`` calls it (``P`` computed in the sums' memory, so
  ``attention_sum=None``);
- the tables' pieces that have a twin, as ``module_tables`` calls them: ``one_way_pairs``, the ``lift_pairs``
  candidates (``module_tables``' own branch, repeated here), the hubs' column sums and ``pagerank`` (started from the
  previous epoch's ranks); and ``module_tables`` whole (its drift table and Markdown have no twin);
- ``png_bytes`` of two canvases ``Images.module_maps`` draws of that module: the mean-of-heads heatmap and the per-head
  grid (RGBA, as the writer thread gets them).

The switch is the environment variable ``ATTN_CALLBACKS_NUMBA`` (``0``: torch / numpy), read at every call, toggled
inside this one process. Every twin is warmed up on both paths first (numba's compilation or cache load left out),
both paths' results are checked equal (sums and numbers to float tolerance, tables, PNG bytes exactly), then the rounds
interleave: each round times every twin down both paths, the order of the two alternating round by round, each time
the mean of enough calls to last ~0.1 s. Printed: one row per twin, the torch and the numba milliseconds per call
(min / median over the rounds), ``torch/numba`` (the ratio of the medians) and ``keep`` where it is at least 1.5, else
``drop``; beside it, ``of mins``, the ratio of the minima (on a busy machine, of the least disturbed calls); and the
machine's load average before and after. ``--quick`` runs tiny shapes (1 layer of d_model 32, 2 heads, batch 4 x length
16, 64 ids tracked to 32, 2 batches an epoch): a smoke run whose figures mean nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from _presets import PRESETS, positive_int


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds", type=positive_int, default=5, help="timed rounds, interleaved (at least 3 for a verdict)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run whose figures mean nothing")
    return parser.parse_args()


if __name__ == "__main__":
    ARGS = arguments()  # before the imports below, so that --help needs nothing but Python

import torch

from _workload import Encoder, device_label, nudge, quiet, token_ids
from attn_callbacks.base.numba_loader import NUMBA_SWITCH, uses_numba
from attn_callbacks.capture.token_ids import compact_index, most_frequent_ids
from attn_callbacks.metrics.drift import Snapshot
from attn_callbacks.metrics.summary import lift, summarize
from attn_callbacks.metrics.tables import (
    _column_sums,
    _tables_numba,
    _top_of,
    _top_pairs_by,
    module_tables,
    one_way_pairs,
    pagerank,
    top_tokens,
)
from attn_callbacks.output.images import Images
from attn_callbacks.output.writer import png_bytes
from attn_callbacks.sums.accumulator import AttentionAccumulator
from attn_callbacks.sums.epoch_sums import EpochSums

BATCHES = {"stress": 16, "tiny": 2}  # validation batches an epoch
TOP_K, NUM_PAIRS, MIN_SUPPORT = 30, 10, 5  # the monitor's defaults
KEEP_AT = 1.5  # the project's rule: a twin stays where torch / numba >= this


@dataclass
class Twin:
    """One twin: ``run()`` does the timed call down whichever path the switch selects and returns its result;
    ``same(torch_result, numba_result)`` raises where the two differ."""

    name: str
    run: Callable[[], Any]
    same: Callable[[Any, Any], None]


def on_path(path: str) -> None:
    """Select ``"torch"`` (the switch set to 0) or ``"numba"`` (the switch unset) for the calls that follow."""
    if path == "torch":
        os.environ[NUMBA_SWITCH] = "0"
    else:
        os.environ.pop(NUMBA_SWITCH, None)
    assert uses_numba("cpu") == (path == "numba"), path


def close(rtol: float = 1e-5, atol: float = 1e-6) -> Callable[[Any, Any], None]:
    def check(a: Any, b: Any) -> None:
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True, check_dtype=False)

    return check


def equal(a: Any, b: Any) -> None:
    assert a == b, f"the paths differ:\n{a!r}\n{b!r}"


def layer_weights(model: Encoder, ids: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's per-head attention weights ``(B, H, L, L)`` for one batch: its ``self_attn`` on its own input
    (post-norm layers: the attention reads the layer's input as it is)."""
    weights = []
    with torch.no_grad():
        x = model.embed(ids)
        for layer in model.encoder.layers:
            weights.append(layer.self_attn(x, x, x, need_weights=True, average_attn_weights=False)[1])
            x = layer(x)
    return weights


def epoch_stats(model: Encoder, batches: list[torch.Tensor], vocab: int) -> Any:
    """The last layer's sums over one epoch (``AttentionStats``), per head; ``batches``: compact ids."""
    heads = model.encoder.layers[-1].self_attn.num_heads
    accumulator = AttentionAccumulator(heads, vocab, vocab)
    for ids in batches:
        valid = torch.ones_like(ids, dtype=torch.bool)
        accumulator.update(layer_weights(model, ids)[-1], ids, ids, valid, valid)
    return accumulator.compute()


def step_twin(weights: list[torch.Tensor], ids: torch.Tensor, vocab: int, per_head: bool) -> Twin:
    """One batch into the sums of every module, through ``EpochSums.add``; each path has sums of its own."""
    heads = weights[0].shape[1]
    names = [f"encoder.layers.{k}.self_attn" for k in range(len(weights))]
    valid = torch.ones_like(ids, dtype=torch.bool)
    sums: dict[str, EpochSums] = {}

    def run() -> list[dict[str, torch.Tensor]] | None:
        path = "torch" if os.environ.get(NUMBA_SWITCH) == "0" else "numba"
        fresh = path not in sums
        if fresh:
            sums[path] = EpochSums(per_head=per_head)
            shapes = {name: (heads, vocab, vocab) for name in names}
            sums[path].start(shapes, dict.fromkeys(names, torch.device("cpu")), loaders=1)
        epoch = sums[path]
        epoch.start_batch()
        for name, w in zip(names, weights, strict=True):
            epoch.add(name, 0, ("input_ids", "input_ids"), w, (ids, valid), (ids, valid))
        if not fresh:
            return None
        # The first batch of fresh sums: what the check compares (the timed calls add to the same sums).
        return [{state: getattr(epoch.metrics[(name, 0)], state).clone() for state in STATES} for name in names]

    def same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
        # rtol 1e-4: torch's index_add_ adds a cell's thousands of float32 weights one by one (the stress workload's
        # hottest cell, ~5,600 pairs of one batch: 3e-5 off a float64 sum), numba sums each row group first (1e-6)
        for module_a, module_b in zip(a, b, strict=True):
            for state in STATES:
                torch.testing.assert_close(
                    module_a[state], module_b[state], rtol=1e-4, atol=1e-4, msg=lambda m, s=state: f"{s}: {m}"
                )

    return Twin(f"step per_head={per_head} ({'H+1' if per_head else '2'} planes)", run, same)


STATES = ("sums", "pair_count", "query_count", "position_sums", "skipped_rows")


def summary_numbers(summary: Any) -> dict[str, torch.Tensor]:
    numbers = {f"layer/{key}": value for key, value in summary.layer.items()}
    numbers.update({f"heads/{key}": value for key, value in summary.heads.items()})
    numbers.update({f"drift_rows/{key}": drift.rows for key, drift in summary.drifts.items()})
    numbers["plogp_heads"], numbers["mean_mass"] = summary.plogp_heads, summary.mean_mass
    return numbers


def twins(preset: str) -> tuple[list[Twin], str]:
    """Every twin, with its real inputs; and a line saying what they are."""
    full_vocab, d_model, heads, layers, feedforward, batch, length, tracked = PRESETS[preset]
    torch.manual_seed(0)
    model = Encoder(full_vocab, d_model, heads, layers, feedforward, head=False).eval()
    raw = [b["input_ids"] for b in token_ids(BATCHES[preset], "zipf", full_vocab, batch=batch, length=length)]
    # The tracked ids, as the monitor picks them: the most frequent of the epoch's; every other id folds into <other>.
    counts = torch.bincount(torch.cat(raw).view(-1), minlength=full_vocab)
    table = compact_index(most_frequent_ids(counts, tracked), full_vocab)
    batches = [table[ids] for ids in raw]
    vocab = tracked + 1
    tokens = slice(0, vocab - 1)  # <other> left out of the tables

    # Three epochs of the last layer's sums: the reference, the previous and this one.
    epochs = []
    for seed in range(3):
        if seed:
            nudge(model, seed)
        epochs.append(epoch_stats(model, batches, vocab))
    reference, previous = (Snapshot.of(e.attention_mass, e.query_count) for e in epochs[:2])
    stats = epochs[2]
    stats.attention_mass  # noqa: B018 - P, cached, as the report computes it before the summary
    stats.attention_sum = None  # the report's P lies in the memory of S, which it then drops
    mass_heads = stats.attention_mass

    def run_summary() -> Any:
        return summarize(
            mass_heads,
            stats.uniform_sum,
            stats.query_count,
            stats.position_sums,
            stats.skipped_rows,
            square=True,
            previous=previous,
            reference=reference,
            min_support=MIN_SUPPORT,
        )

    on_path("torch")
    summary = run_summary()  # the tables' inputs: the torch path's numbers (the check holds the paths equal)
    mass, drifts = summary.mean_mass, summary.drifts
    count = stats.pair_count[tokens, tokens]
    shown, uniform, query_count = mass[tokens, tokens], stats.uniform_sum[tokens, tokens], stats.query_count

    def lift_pairs() -> list[tuple[int, int, float]]:
        """``module_tables``' lift_pairs branch, as it is there."""
        fast = _tables_numba(shown, count)
        if fast is not None:
            found = fast.lift_candidates(shown, query_count[tokens], uniform, count, MIN_SUPPORT)
            return _top_of(*found, shown.shape[-1], NUM_PAIRS)
        weights = query_count[tokens].to(mass.dtype)
        return _top_pairs_by(lambda r, c: lift(weights[r] * shown[r, c], uniform[r, c]), count, NUM_PAIRS, MIN_SUPPORT)

    def labels(ids: Any) -> list[str]:
        return [f"t{i}" for i in ids]

    rank_start = pagerank(previous.mean_mass)  # last epoch's ranks, where the report starts this epoch's

    def run_tables() -> dict[str, str]:
        tables, _ = module_tables(
            stats,
            mass,
            square=True,
            query_tokens=tokens,
            key_tokens=tokens,
            query_labels=labels,
            key_labels=labels,
            num_pairs=NUM_PAIRS,
            min_support=MIN_SUPPORT,
            reference=reference,
            drifts=drifts,
            epochs=(0, 1),
            rank_start=rank_start,
        )
        return tables

    # The canvases the report draws of this module (the writer thread encodes them).
    rows = top_tokens(query_count[tokens], TOP_K)
    canvases = Images().module_maps(
        "val_attention_{family}/layer",
        "layer",
        mass=mass,
        mass_heads=mass_heads,
        query_count=query_count,
        uniform_sum=stats.uniform_sum,
        rows=rows,
        cols=rows,
        row_labels=labels(rows.tolist()),
        col_labels=labels(rows.tolist()),
        square=True,
        reference_mass=reference.mean_mass,
        reference_epoch=0,
    )
    heatmap, grid = canvases["val_attention_mass/layer"], canvases["val_attention_mass_heads/layer"]

    def summary_same(a: Any, b: Any) -> None:
        numbers_a, numbers_b = summary_numbers(a), summary_numbers(b)
        assert numbers_a.keys() == numbers_b.keys(), (numbers_a.keys(), numbers_b.keys())
        for key in numbers_a:
            # A row's JS is a difference of float32 entropies of ~7 nats: rows that barely moved (JS ~1e-7) differ
            # by ~1e-6 between the paths; the weighted means are held to the tests' 1e-6.
            atol = 1e-5 if key.startswith("drift_rows/") else 1e-6
            torch.testing.assert_close(
                numbers_b[key], numbers_a[key], rtol=1e-5, atol=atol, equal_nan=True, msg=lambda m, k=key: f"{k}: {m}"
            )

    def pairs_same(a: list[tuple[int, int, float]], b: list[tuple[int, int, float]]) -> None:
        assert [pair[:2] for pair in a] == [pair[:2] for pair in b], (a, b)
        close()(torch.tensor([pair[2] for pair in a]), torch.tensor([pair[2] for pair in b]))

    weights = layer_weights(model, batches[0])
    found = [
        step_twin(weights, batches[0], vocab, per_head=True),
        step_twin(weights, batches[0], vocab, per_head=False),
        Twin("summarize (per head, drift prev+ref)", run_summary, summary_same),
        Twin("tables: one_way_pairs", lambda: one_way_pairs(shown, count, NUM_PAIRS, MIN_SUPPORT), pairs_same),
        Twin("tables: lift_pairs", lift_pairs, pairs_same),
        Twin("tables: hubs column sums", lambda: _column_sums(mass, query_count), close(1e-6, 0)),
        Twin("tables: pagerank", lambda: pagerank(mass, start=rank_start), close(1e-9, 1e-12)),
        Twin("tables: module_tables (all)", run_tables, equal),
        Twin(f"png_bytes heatmap {heatmap.shape[0]}x{heatmap.shape[1]}", lambda: png_bytes(heatmap), equal),
        Twin(f"png_bytes head grid {grid.shape[0]}x{grid.shape[1]}", lambda: png_bytes(grid), equal),
    ]
    what = (
        f"{layers} x nn.TransformerEncoderLayer({d_model}, {heads} heads), batch {batch} x length {length}, Zipf ids "
        f"over {full_vocab} tracked to {tracked} + <other>, {len(batches)} batches an epoch"
    )
    return found, what


def seconds_per_call(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def measure(found: list[Twin], rounds: int, target: float) -> dict[str, dict[str, list[float]]]:
    """Per twin and path, the seconds per call of every round; after a warm-up and the check of each twin."""
    calls = {}
    for twin in found:
        results, warm = {}, {}
        for path in ("torch", "numba"):
            on_path(path)
            results[path] = twin.run()  # numba: compiled or loaded from its cache here
            warm[path] = seconds_per_call(twin.run, 1)
        try:
            twin.same(results["torch"], results["numba"])
        except AssertionError as error:
            raise AssertionError(f"{twin.name}: the torch and the numba path disagree: {error}") from error
        calls[twin.name] = max(1, min(100, math.ceil(target / max(min(warm.values()), 1e-9))))
    times: dict[str, dict[str, list[float]]] = {twin.name: {"torch": [], "numba": []} for twin in found}
    for round_ in range(rounds):
        order = ("torch", "numba") if round_ % 2 == 0 else ("numba", "torch")
        for twin in found:
            for path in order:
                on_path(path)
                times[twin.name][path].append(seconds_per_call(twin.run, calls[twin.name]))
    return times


def digits(value: float) -> str:
    """At least 3 significant digits, 2 decimals at most above 1 (a tiny shape's call may take microseconds)."""
    return f"{value:.{min(6, max(2, 2 - math.floor(math.log10(value))))}f}" if value > 0 else "0"


def load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def main(args: argparse.Namespace) -> None:
    quiet()
    before = load()
    switch = os.environ.get(NUMBA_SWITCH)
    os.environ.pop(NUMBA_SWITCH, None)
    if not uses_numba("cpu"):
        print("numba twins vs torch: numba is not running (not installed): nothing to compare")
        return
    import numba

    preset = "tiny" if args.quick else "stress"
    try:
        found, what = twins(preset)
        times = measure(found, args.rounds, 0.01 if args.quick else 0.1)
    finally:
        if switch is None:
            os.environ.pop(NUMBA_SWITCH, None)
        else:
            os.environ[NUMBA_SWITCH] = switch
    print(
        f"{what}; {args.rounds} interleaved rounds; torch {torch.__version__}, numba {numba.__version__}, "
        f"{device_label()}, numba {numba.get_num_threads()} threads, {platform.processor() or platform.machine()}"
    )
    print(f"load average (1, 5, 15 min): {before} before, {load()} after")
    header = f"{'twin':40} {'torch ms min / med':>20} {'numba ms min / med':>20} {'torch/numba':>12} {'of mins':>8}"
    print(f"\n{header}  verdict")
    for name, paths in times.items():
        ms = {path: [value * 1e3 for value in values] for path, values in paths.items()}
        ratio = digits(statistics.median(ms["torch"]) / statistics.median(ms["numba"]))
        cells = {path: f"{digits(min(v))} / {digits(statistics.median(v))}" for path, v in ms.items()}
        of_mins = digits(min(ms["torch"]) / min(ms["numba"]))
        verdict = "keep" if float(ratio) >= KEEP_AT else "drop"  # of the ratio as printed
        print(f"{name:40} {cells['torch']:>20} {cells['numba']:>20} {ratio:>11}x {of_mins:>7}x  {verdict}")
    print(f"\nkeep: torch/numba >= {KEEP_AT} (medians of the rounds); numpy stands for torch in png_bytes")


if __name__ == "__main__":
    main(ARGS)
