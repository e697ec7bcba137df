"""Command line: compare two saved epochs, or export one module's attention graph.

Usage::

    python -m attn_callbacks compare OLD NEW [--modules PATTERN ...] [--top N] [--min-support M] [--per-head]
    python -m attn_callbacks graph EPOCH_FILE MODULE OUT.graphml [--head H] [--min-weight W]

``OLD``, ``NEW`` and ``EPOCH_FILE`` are ``.pt`` or ``.npz`` files written by :func:`attn_callbacks.save_epoch` (the
callback's ``export=`` option). ``compare`` compares modules token by token: both files must give their tokens the same
labels (a file without labels is compared by token id, with a warning). Exit status: 0 on success, 2 on bad input (a
missing or unreadable file, a module that is not in the file, modules whose shapes or labels differ, an ``OUT`` that
cannot be written), 1 when networkx is missing for ``graph`` or when the reader of the output went away
(``... | head``), quietly.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import itertools
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from attn_callbacks.base.config import short_repr
from attn_callbacks.base.labels import label_tokens
from attn_callbacks.metrics.drift import Snapshot, moved_tokens, supported_rows
from attn_callbacks.metrics.summary import drift_between
from attn_callbacks.output.epoch_files import not_a_folder
from attn_callbacks.output.export import EpochRecord, load_epoch

__all__ = ["main"]


_PROG = "python -m attn_callbacks"


class _InputError(Exception):
    """Bad input from the user: reported on stderr with exit status 2."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (``sys.argv[1:]`` when None) and return its exit status.

    Args:
        argv: the arguments after ``python -m attn_callbacks``.

    Returns:
        0 on success, 2 on bad input, 1 when an optional dependency is missing or the output's reader went away.
        Never raises ``SystemExit``.

    Example:
        >>> main(["compare", "missing-old.pt", "missing-new.pt"])  # doctest: +SKIP
        2
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits on --help (0) and on usage errors (2): callers get the status
        return int(exit_.code or 0)
    try:
        return args.run(args, sys.stdout)
    except BrokenPipeError:  # the reader went away (`... | head`): stop quietly, as command-line tools do
        _drop_stdout()
        return 1
    except (_InputError, OSError, ValueError) as error:  # OSError: a file that cannot be read or written
        print(f"{parser.prog} {args.command}: error: {error}", file=sys.stderr)
        return 2
    except ImportError as error:
        print(f"{parser.prog} {args.command}: error: {error}", file=sys.stderr)
        return 1


def _drop_stdout() -> None:
    """Point standard output at the null device, so that Python's own flush at exit does not hit the closed pipe."""
    with contextlib.suppress(OSError, ValueError, AttributeError):  # no file descriptor behind it (a StringIO, say)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="Inspect attention epochs saved by attn_callbacks (AttentionMonitor(export='pt' or 'npz')).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    compare = commands.add_parser(
        "compare",
        help="attention drift between two saved epochs",
        description="Drift of the head-averaged attention mass P̄ = mean_h S[h] / Q from OLD to NEW, per module: "
        "Jensen–Shannon divergence of the rows (nats, weighted by NEW's query counts, rows seen at least "
        "--min-support times in both epochs) and relative Frobenius change ||P̄_new - P̄_old|| / ||P̄_old||; then "
        "the query tokens whose attention moved most.",
    )
    # OLD and NEW are checked in _compare, so that files taken by --modules (it takes every word after it) are named.
    compare.usage = f"{_PROG} compare OLD NEW [--modules PATTERN ...] [--top N] [--min-support M] [--per-head]"
    compare.add_argument("old", nargs="?", metavar="OLD", help="the earlier epoch (.pt or .npz), the reference")
    compare.add_argument("new", nargs="?", metavar="NEW", help="the later epoch (.pt or .npz)")
    compare.add_argument(
        "--modules",
        nargs="+",
        metavar="PATTERN",
        help="fnmatch patterns over module names (default: all in both); give it after OLD NEW, or end it with --",
    )
    compare.add_argument(
        "--top", type=_int_at_least(0), default=10, metavar="N", help="moved query tokens per module (default 10)"
    )
    compare.add_argument(
        "--min-support",
        type=_int_at_least(1),
        default=5,
        metavar="M",
        help="least query count, in both epochs, for a token to count (default 5, as AttentionMonitor)",
    )
    compare.add_argument("--per-head", action="store_true", help="also one drift row per head")
    compare.set_defaults(run=_compare)

    graph = commands.add_parser(
        "graph",
        help="export one module's attention graph as GraphML (needs networkx)",
        description="Write the directed graph query token -> key token weighted by the attention mass P̄[a, b] "
        "(head average, or one head) as GraphML, for Gephi, Cytoscape or networkx.",
    )
    graph.add_argument("epoch_file", metavar="EPOCH_FILE", help="a saved epoch (.pt or .npz)")
    graph.add_argument("module", metavar="MODULE", help="the attention module's name, as in the file")
    graph.add_argument("out", metavar="OUT.graphml", help="the GraphML file to write")
    graph.add_argument("--head", type=_int_at_least(0), default=None, metavar="H", help="one head (default: mean)")
    graph.add_argument(
        "--min-weight", type=float, default=0.0, metavar="W", help="leave out edges with weight <= W (default 0)"
    )
    graph.set_defaults(run=_graph)
    return parser


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


# -------------------------------------------------------------------------------------------------------- compare
def _compare(args: argparse.Namespace, out: TextIO) -> int:
    if args.new is None:
        missing = "OLD and NEW are" if args.old is None else "NEW is"
        taken = f": --modules took {args.modules}; give OLD NEW before it, or end its patterns with --"
        raise _InputError(f"{missing} required{taken if args.modules else ''}")
    old, new = load_epoch(args.old), load_epoch(args.new)
    common = [name for name in new.modules if name in old.modules]
    if args.modules:
        unmatched = [p for p in args.modules if not any(fnmatch.fnmatchcase(name, p) for name in common)]
        if unmatched:
            raise _InputError(f"--modules {unmatched} match no module found in both files (those are: {common})")
        common = [name for name in common if any(fnmatch.fnmatchcase(name, p) for p in args.modules)]
    if not common:
        raise _InputError(f"no module is in both files (OLD has {list(old.modules)}, NEW has {list(new.modules)})")
    for name in common:
        old_shape = tuple(old.modules[name].attention_sum.shape)
        new_shape = tuple(new.modules[name].attention_sum.shape)
        # A file of per_head=False holds the head mean only: compared with the other's head mean, P̄ against P̄.
        mean_only = 1 in (old_shape[0], new_shape[0])
        if old_shape[1:] != new_shape[1:] or (old_shape[0] != new_shape[0] and not mean_only):
            raise _InputError(
                f"module {name!r} has (heads, query vocab, key vocab) {old_shape} in OLD but {new_shape} in NEW: "
                "not comparable (leave it out with --modules)"
            )
        _check_labels(name, old, new, args)

    print(f"OLD: {args.old}  (epoch {old.epoch}, step {old.global_step})", file=out)
    print(f"NEW: {args.new}  (epoch {new.epoch}, step {new.global_step})", file=out)
    for which, record, other in (("OLD", old, new), ("NEW", new, old)):
        alone = [name for name in record.modules if name not in other.modules]
        if alone:
            print(f"only in {which} (not compared): {', '.join(_display(name) for name in alone)}", file=out)
    print(file=out)
    print(
        "Attention drift OLD -> NEW of P̄ = mean_h S[h] / Q, "
        f"rows of query tokens seen >= {args.min_support} times in both",
        file=out,
    )
    print("  JS: Jensen–Shannon divergence of the rows, in nats (0 .. ln 2), averaged with weights Q_new", file=out)
    print("  rel. Frobenius: ||P̄_new - P̄_old|| / ||P̄_old||", file=out)
    rows = []
    drifts = {}  # the callback's own drift computation, NEW against a snapshot of OLD
    for name in common:
        before, after = old.modules[name], new.modules[name]
        mass_old, mass_new = before.attention_mass, after.attention_mass
        heads_differ = mass_old.shape[0] != mass_new.shape[0]
        if heads_differ:  # one file holds the head mean only
            mass_old, mass_new = mass_old.mean(dim=0, keepdim=True), mass_new.mean(dim=0, keepdim=True)
        then = Snapshot.of(mass_old, before.query_count)
        drift = drifts[name] = drift_between(mass_new, after.query_count, then, args.min_support)
        # A 0 there would read "nothing moved", as in the callback, which logs neither.
        shown = (
            bool(supported_rows(after.query_count, before.query_count, args.min_support).any()),
            bool(before.query_count.any() and after.query_count.any()),  # ||0 - P̄_old|| / ||P̄_old|| = 1
        )
        rows.append((_display(name), "mean", *_drift_cells(float(drift.js), float(drift.frobenius), shown)))
        if args.per_head and heads_differ:
            rows.append(("", "(one file has no per-head sums)", "", ""))
        elif args.per_head:
            js_heads, frobenius_heads = drift.js_heads, drift.frobenius_heads
            for h, (js_h, frobenius_h) in enumerate(zip(js_heads.tolist(), frobenius_heads.tolist(), strict=True)):
                rows.append(("", f"head {h}", *_drift_cells(js_h, frobenius_h, shown)))
    _print_table(("module", "heads", "JS (nats)", "rel. Frobenius"), rows, out, numeric=(2, 3))
    if any("n/a" in row for row in rows):
        support = f"no query token seen >= {args.min_support} times in both"
        print(f"\n  n/a: JS with {support}, Frobenius where a file saw no query token", file=out)

    if args.top == 0:
        return 0
    for name in common:
        before, after = old.modules[name], new.modules[name]
        mass_old, mass_new = before.attention_mass.mean(dim=0), after.attention_mass.mean(dim=0)
        # Tokens only, as in the callback's tables: a tracked stream's last index is <other>, the bucket.
        tq, tk = (_tokens(new, stream, size) for stream, size in zip(new.streams[name], mass_new.shape, strict=True))
        counts = (after.query_count[tq], before.query_count[tq], args.top, args.min_support)
        moved = moved_tokens(mass_new[tq], None, *counts, row_divergence=drifts[name].rows[tq])
        print(file=out)
        print(f"{_display(name)}: query tokens whose attention moved most (JS in nats, NEW vs OLD)", file=out)
        if not moved:
            print(f"  no query token seen at least {args.min_support} times in both epochs", file=out)
            continue
        query_labels, key_labels = _labels(new, name)
        rows = [
            (
                _label(a, query_labels),
                f"{js:#.6g}",
                str(int(before.query_count[a])),
                str(int(after.query_count[a])),
                _label(int(mass_old[a, tk].argmax()), key_labels),
                _label(int(mass_new[a, tk].argmax()), key_labels),
            )
            for a, js in moved
        ]
        header = ("query token", "JS (nats)", "Q old", "Q new", "top key old", "top key new")
        _print_table(header, rows, out, numeric=(1, 2, 3), indent="  ")
    return 0


def _tokens(record: EpochRecord, stream: str, size: int) -> slice:
    """The indices of a stream's sums that are tokens: all but the last (``<other>``) where the stream is tracked."""
    return slice(0, size - 1 if record.vocab_ids.get(stream) is not None else size)


def _drift_cells(js: float, frobenius: float, shown: tuple[bool, bool]) -> tuple[str, str]:
    """The JS and Frobenius cells of a row, "n/a" where ``shown`` says the number means nothing."""
    return f"{js:#.6g}" if shown[0] else "n/a", f"{frobenius:#.6g}" if shown[1] else "n/a"


def _check_labels(name: str, old: EpochRecord, new: EpochRecord, args: argparse.Namespace) -> None:
    """Row a and column b mean the same tokens in both files, or the comparison is refused: the same shape is not the
    same vocabulary (another tokenizer, other tracked ids)."""
    for side, axis in enumerate(("query", "key")):
        old_stream, new_stream = old.streams[name][side], new.streams[name][side]
        if old_stream not in old.vocab_ids or new_stream not in new.vocab_ids:  # a file written by 0.1.0
            continue
        size = new.modules[name].attention_sum.shape[1 + side]
        ids = [(old.vocab_id(old_stream, i), new.vocab_id(new_stream, i)) for i in range(size)]
        differing = next(((i, x, y) for i, (x, y) in enumerate(ids) if x != y), None)
        if differing is not None:
            index, old_id, new_id = differing
            raise _InputError(
                f"module {name!r}: {axis} index {index} is token id {old_id} in OLD ({args.old}) but {new_id} in NEW "
                f"({args.new}) (None: <other>): the files track different tokens, not comparable (leave it out with "
                "--modules)"
            )
    (old_query, old_key), (new_query, new_key) = _labels(old, name), _labels(new, name)
    for axis, old_labels, new_labels in (("query", old_query, new_query), ("key", old_key, new_key)):
        if old_labels is None or new_labels is None:
            if old_labels is not new_labels:
                which = "OLD" if old_labels is None else "NEW"
                print(
                    f"{_PROG} compare: warning: module {name!r}: {which} has no {axis} token labels, so {axis} tokens "
                    "are compared by id, unchecked",
                    file=sys.stderr,
                )
            continue
        pairs = enumerate(itertools.zip_longest(old_labels, new_labels))  # equal lengths, unless a file is damaged
        differing = next(((a, x, y) for a, (x, y) in pairs if x != y), None)
        if differing is not None:
            token, old_label, new_label = differing
            raise _InputError(
                f"module {name!r}: {axis} token {token} is {_cut(old_label)} in OLD ({args.old}) but "
                f"{_cut(new_label)} in NEW ({args.new}): the files count different tokens, not comparable "
                "(leave it out with --modules)"
            )


def _cut(label: str | None) -> str:
    return "missing" if label is None else short_repr(label, limit=40)


def _labels(record: EpochRecord, module: str) -> tuple[list[str] | None, list[str] | None]:
    query_stream, key_stream = record.streams[module]
    return record.labels.get(query_stream), record.labels.get(key_stream)


def _label(token: int, labels: list[str] | None) -> str:
    # Whole labels (no trimming), with newlines escaped so a row stays one line.
    return label_tokens([token], labels, max_length=None)[0]


def _display(module: str) -> str:
    return module or "<root>"  # a bare nn.MultiheadAttention as the model is named ""


def _print_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], out: TextIO, numeric: Sequence[int] = (), indent: str = ""
) -> None:
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        padded = (
            c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )
        return indent + "  ".join(padded).rstrip()

    print(line(header), file=out)
    print(indent + "  ".join("-" * w for w in widths), file=out)
    for row in rows:
        print(line(row), file=out)


# ---------------------------------------------------------------------------------------------------------- graph
def _graph(args: argparse.Namespace, out: TextIO) -> int:
    target = Path(args.out)
    if target.is_dir():
        raise _InputError(f"OUT.graphml {args.out!r} is a folder: give the file to write")
    blocking = not_a_folder(target.parent)
    if blocking is not None:
        raise _InputError(f"OUT.graphml {args.out!r} cannot be written: {str(blocking)!r} is a file, not a folder")
    if target.exists() and Path(args.epoch_file).exists() and target.samefile(args.epoch_file):
        raise _InputError(f"OUT.graphml {args.out!r} is EPOCH_FILE: writing the graph would replace the export")
    record = load_epoch(args.epoch_file)
    if args.module not in record.modules:
        raise _InputError(
            f"module {args.module!r} is not in {args.epoch_file} (it has: {', '.join(map(repr, record.modules))})"
        )
    path = record.export_graph(args.module, args.out, head=args.head, min_weight=args.min_weight)
    query_stream, key_stream = record.streams[args.module]
    kind = "self-attention" if query_stream == key_stream else f"cross-attention {query_stream} -> {key_stream}"
    head = "head average" if args.head is None else f"head {args.head}"
    print(f"wrote {path} ({_display(args.module)}, {kind}, {head}, edges with weight > {args.min_weight})", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
