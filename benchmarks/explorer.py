"""How fast the Attention tab answers, and what writing its data costs, at BERT-base scale.

    python benchmarks/explorer.py [--modules 12] [--epochs 10] [--queries 50] [--quick]

A run as a monitor writes it for BERT-base (12 modules of 12 heads, a 30,522-id vocabulary tracked to 1,024, the
default ``explorer_size`` of 2 MB: the 181 most frequent tracked tokens per module), ``--epochs`` epochs of it, with
random attention; then TensorBoard's own WSGI application (the Python data backend) answers the tab's requests.
Printed: the seconds to write one module's epoch (the writer thread's share of the epoch end: the cut from the sums is
measured with the epoch end by ``overhead.py --configs per-head,no-explorer``), and min / median / max milliseconds
per request of each route, over ``--queries`` random tokens. Target (issue "Attention explorer"): a token query
answers in <= 100 ms.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from _presets import positive_int


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", type=positive_int, default=12, help="attention modules (views) in the run")
    parser.add_argument("--epochs", type=positive_int, default=10, help="epochs written per module")
    parser.add_argument("--queries", type=positive_int, default=50, help="requests timed per route")
    parser.add_argument("--quick", action="store_true", help="2 modules, 2 epochs, 3 queries: a smoke run")
    return parser.parse_args()


if __name__ == "__main__":
    ARGS = arguments()  # before the imports below, so that --help needs nothing but Python

import numpy as np
from tensorboard import default, program
from tensorboard.backend import application
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from werkzeug.test import Client

from attn_callbacks.explorer.data import write_epoch
from attn_callbacks.explorer.plugin import ExplorerPlugin
from attn_callbacks.output.explore import explorer_tokens

ROUTE = "/data/plugin/attention_explorer"
VOCAB, TRACKED, HEADS, SIZE = 30_522, 1_024, 12, 2_000_000


def make_run(run: Path, modules: int, epochs: int, rng: np.random.Generator) -> tuple[list[int], list[float]]:
    """Write the run's explorer files; return the stored token ids and the seconds each write took."""
    EventFileWriter(str(run)).close()  # TensorBoard lists a folder as a run once it holds an event file
    n = explorer_tokens(HEADS, SIZE, square=True)
    tracked = rng.choice(VOCAB, TRACKED, replace=False)
    ids = [int(i) for i in tracked[:n]]  # the most frequent first
    labels = [f"piece{i}" for i in ids]
    counts = sorted(rng.integers(1, 50_000, n).tolist(), reverse=True)
    seconds = []
    for epoch in range(epochs):
        for module in range(modules):
            mass = rng.random((HEADS, n, n), dtype=np.float32)
            mass /= mass.sum(-1, keepdims=True) * 1.25  # rows keep a fifth for keys outside the stored columns
            planes = np.concatenate([mass.mean(0, keepdims=True), mass, rng.random((2, n, n), dtype=np.float32)])
            start = time.perf_counter()
            write_epoch(
                run,
                view=f"attention/encoder.layer.{module}.attention.self",
                module=f"encoder.layer.{module}.attention.self",
                streams=("tokens", "tokens"),
                epoch=epoch,
                step=100 * (epoch + 1),
                planes=planes,
                query_ids=ids,
                key_ids=ids,
                query_labels=labels,
                key_labels=labels,
                query_count=counts,
            )
            seconds.append(time.perf_counter() - start)
    return ids, seconds


def tensorboard_client(logdir: Path) -> Client:
    # TensorBoard's plugins with this one, whether or not an installed attn_callbacks registers it (PYTHONPATH runs)
    plugins = [p for p in default.get_plugins() if p is not ExplorerPlugin] + [ExplorerPlugin]
    board = program.TensorBoard(plugins=plugins)
    board.configure(argv=["", "--logdir", str(logdir), "--load_fast", "false"])
    provider, multiplexer = board._make_data_provider()  # what TensorBoard.launch() does first
    app = application.TensorBoardWSGIApp(
        board.flags, board.plugin_loaders, provider, board.assets_zip_provider, multiplexer
    )
    return Client(app)


def summary(values: list[float]) -> str:
    return f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f}"


def main(args: argparse.Namespace) -> None:
    if args.quick:
        args.modules, args.epochs, args.queries = 2, 2, 3
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as root:
        ids, writes = make_run(Path(root) / "run", args.modules, args.epochs, rng)
        print(
            f"{args.modules} modules x {args.epochs} epochs, {HEADS} heads, {len(ids)} of {TRACKED} tracked ids of "
            f"{VOCAB} stored per module (explorer_size {SIZE / 1e6:g} MB)"
        )
        print(f"write one module's epoch: {summary([1000 * s for s in writes])} ms (min / median / max)")
        client = tensorboard_client(Path(root))
        listing = client.get(f"{ROUTE}/runs").json["runs"][0]
        view = listing["views"][-1]["view"]
        last = args.epochs - 1
        routes = {
            "runs": lambda token: {},
            "labels": lambda token: {"epoch": last},
            "token": lambda token: {"epoch": last, "head": "mean", "token": token},
            "token head": lambda token: {"epoch": last, "head": int(rng.integers(HEADS)), "token": token},
            "heatmap 24": lambda token: {"epoch": last, "head": "mean", "size": 24},
            "heatmap around 64": lambda token: {"epoch": last, "head": "mean", "size": 64, "around": token},
            "history": lambda token: {"epoch": last, "head": "mean", "token": token},
        }
        print(f"\n{'route':20} {'ms per request: min / median / max':>36}")
        for name, query in routes.items():
            times = []
            for token in rng.choice(ids, args.queries):
                start = time.perf_counter()
                response = client.get(
                    f"{ROUTE}/{name.split()[0]}",
                    query_string={"run": listing["run"], "view": view, **query(int(token))},
                )
                times.append(1000 * (time.perf_counter() - start))
                assert response.status_code == 200, response.json
            print(f"{name:20} {summary(times):>36}")


if __name__ == "__main__":
    main(ARGS)
