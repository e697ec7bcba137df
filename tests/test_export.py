import errno
import json
import math
import os
import re
import stat
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import _callback_helpers as helpers
import networkx as nx
import numpy as np
import pytest
import torch
from _callback_helpers import PAD, VOCAB, TinyEncoder, run_validate, trainer
from _reference import naive_js
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader

from attn_callbacks import AttentionMonitor, EpochRecord, export_graph, load_epoch, save_epoch
from attn_callbacks import functional as F
from attn_callbacks.__main__ import main
from attn_callbacks.output.epoch_files import check_export_dir, export_epoch, export_name
from attn_callbacks.output.export import FORMAT_VERSION
from attn_callbacks.sums.accumulator import SUM_FIELDS, AttentionAccumulator, AttentionStats

HEADS, BATCH, LENGTH = 2, 3, 5
LABELS = ["<s>", "the", "cat", "sat", "on\nthe mat", "."]
SELF, CROSS = "encoder.layers.0.self_attn", "decoder.layers.0.multihead_attn"
STREAMS = {SELF: ("src", "src"), CROSS: ("tgt", "src")}


def make_batches(seed, vocab_q=6, vocab_k=6, n=4):
    """Random softmax weights over random token ids, some padding; self-attention when the vocabularies are equal."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        weights = torch.randn(BATCH, HEADS, LENGTH, LENGTH, generator=g).softmax(-1)
        query_ids = torch.randint(0, vocab_q, (BATCH, LENGTH), generator=g)
        key_ids = query_ids if vocab_q == vocab_k else torch.randint(0, vocab_k, (BATCH, LENGTH), generator=g)
        query_valid = torch.ones(BATCH, LENGTH, dtype=torch.bool)
        query_valid[0, -1] = False
        key_valid = query_valid if vocab_q == vocab_k else torch.ones(BATCH, LENGTH, dtype=torch.bool)
        yield weights, query_ids, key_ids, query_valid, key_valid


def accumulate(seed, vocab_q=6, vocab_k=6, n=4, mean_of_heads=False):
    metric = AttentionAccumulator(HEADS, vocab_q, vocab_k, mean_of_heads=mean_of_heads)
    for batch in make_batches(seed, vocab_q, vocab_k, n):
        metric.update(*batch)
    return metric.compute()


def loop_mass(seed, vocab_q=6, vocab_k=6, head=None):
    """P̄[a, b] = mean_h S[h, a, b] / Q[a] (or one head's), by explicit loops in float64."""
    S = np.zeros((HEADS, vocab_q, vocab_k))
    Q = np.zeros(vocab_q)
    for weights, query_ids, key_ids, query_valid, key_valid in make_batches(seed, vocab_q, vocab_k):
        for n in range(BATCH):
            for i in range(LENGTH):
                if not query_valid[n, i]:
                    continue
                Q[query_ids[n, i]] += 1
                for j in range(LENGTH):
                    if key_valid[n, j]:
                        S[:, query_ids[n, i], key_ids[n, j]] += weights[n, :, i, j].double().numpy()
    summed = S.mean(axis=0) if head is None else S[head]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(Q[:, None] > 0, summed / np.maximum(Q[:, None], 1), 0.0), Q, summed


def save_two_modules(path, seed, epoch=3, global_step=120):
    stats = {SELF: accumulate(seed), CROSS: accumulate(seed + 100, vocab_q=4, vocab_k=6)}
    save_epoch(path, stats, streams=STREAMS, labels={"src": LABELS, "tgt": None}, epoch=epoch, global_step=global_step)
    return stats


def assert_stats_equal(got: AttentionStats, expected: AttentionStats):
    for field in (*SUM_FIELDS, "attention_mass", "mean_weight"):
        a, b = getattr(got, field), getattr(expected, field)
        assert a.dtype == b.dtype and a.device.type == "cpu", field
        assert torch.equal(a, b), field


# ---------------------------------------------------------------------------------------------------- save / load
@pytest.mark.parametrize("suffix", [".pt", ".npz"])
def test_save_epoch_round_trips_every_field(tmp_path, suffix):
    path = tmp_path / "nested" / "dir" / f"epoch=0003-step=120{suffix}"
    stats = save_two_modules(path, seed=0)
    record = load_epoch(path)
    assert isinstance(record, EpochRecord)
    assert (record.epoch, record.global_step) == (3, 120)
    assert record.streams == STREAMS
    assert record.labels == {"src": LABELS, "tgt": None}
    assert list(record.modules) == [SELF, CROSS]
    for name in stats:
        assert_stats_equal(record.modules[name], stats[name])
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind


@pytest.mark.parametrize("suffix", [".pt", ".npz"])
def test_save_epoch_round_trips_the_vocabulary_ids_of_tracked_streams(tmp_path, suffix):
    path = tmp_path / f"e{suffix}"
    stats = {SELF: accumulate(0), CROSS: accumulate(100, vocab_q=4, vocab_k=6)}
    ids = {"src": [40, 7, 1000, 3, 12]}  # tracked: 5 ids and <other>
    save_epoch(path, stats, streams=STREAMS, labels={}, epoch=0, global_step=1, vocab_ids=ids)
    record = load_epoch(path)
    assert record.vocab_ids == {"src": [40, 7, 1000, 3, 12], "tgt": None}
    assert [record.vocab_id("src", i) for i in range(6)] == [40, 7, 1000, 3, 12, None]
    assert [record.vocab_id("tgt", i) for i in range(4)] == [0, 1, 2, 3]
    save_epoch(path, stats, streams=STREAMS, labels={}, epoch=0, global_step=1)
    assert load_epoch(path).vocab_ids == {"src": None, "tgt": None}


def test_save_epoch_refuses_vocabulary_ids_that_do_not_fit(tmp_path):
    stats = {SELF: accumulate(0)}
    for ids, message in (
        ([1, 2, 3, 4, 5, 6], r"`vocab_ids` to give 5 integer ids for stream 'src' \(its 6 indices but the last"),
        ([1, 2, 3.0, 4, 5], "`vocab_ids` to give 5 integer ids"),
        ([1, 2, -3, 4, 5], "`vocab_ids` to hold ids >= 0 for stream 'src', but got -3"),
    ):
        with pytest.raises(ValueError, match=message):
            save_epoch(
                tmp_path / "e.pt", stats, streams=STREAMS, labels={}, epoch=0, global_step=1, vocab_ids={"src": ids}
            )
    assert not (tmp_path / "e.pt").exists()


@pytest.mark.parametrize("suffix", [".pt", ".npz"])
def test_save_epoch_round_trips_head_mean_sums_with_per_head_position_statistics(tmp_path, suffix):
    # per_head=False: one head-mean channel of S, position statistics still per head
    metric = AttentionAccumulator(HEADS, 6, 6, mean_of_heads=True)
    for batch in make_batches(seed=4):
        metric.update(*batch)
    stats = metric.compute()
    assert stats.attention_sum.shape == (1, 6, 6) and stats.position_sums.shape == (len(F.POSITION_STATS), HEADS)
    path = tmp_path / f"mean{suffix}"
    save_epoch(path, {SELF: stats}, streams={SELF: STREAMS[SELF]}, labels={"src": None}, epoch=0, global_step=0)
    assert_stats_equal(load_epoch(path).modules[SELF], stats)
    torch.testing.assert_close(
        load_epoch(path).modules[SELF].attention_mass[0].double(), torch.from_numpy(loop_mass(4)[0])
    )


def test_save_epoch_pt_loads_with_weights_only(tmp_path):
    save_two_modules(tmp_path / "e.pt", seed=0)
    content = torch.load(tmp_path / "e.pt", weights_only=True)
    assert content["format"] == "attn_callbacks.epoch" and content["version"] == FORMAT_VERSION
    assert set(content["modules"][SELF]) == {
        "attention_sum",
        "pair_count",
        "query_count",
        "skipped_rows",
        "uniform_sum",
        "position_sums",
    }


def test_save_epoch_npz_loads_without_pickle(tmp_path):
    stats = save_two_modules(tmp_path / "e.npz", seed=0)
    with np.load(tmp_path / "e.npz", allow_pickle=False) as data:
        meta = json.loads(str(data["__meta__"]))
        assert meta["modules"] == [SELF, CROSS] and meta["version"] == FORMAT_VERSION
        np.testing.assert_array_equal(data["1.attention_sum"], stats[CROSS].attention_sum.numpy())
        assert data["0.pair_count"].dtype == np.int64


def test_save_epoch_keeps_dtypes_numpy_lacks(tmp_path):
    stats = accumulate(0)
    raw = (getattr(stats, field) for field in SUM_FIELDS)
    low = AttentionStats(*(t.to(torch.bfloat16) if t.is_floating_point() else t for t in raw))
    save_epoch(tmp_path / "e.npz", {"m": low}, streams={"m": ("x", "x")}, labels={}, epoch=0, global_step=0)
    record = load_epoch(tmp_path / "e.npz")
    assert record.labels == {"x": None}
    assert_stats_equal(record.modules["m"], low)


def test_save_epoch_rejects_bad_suffix(tmp_path):
    with pytest.raises(ValueError, match=r"`path` to end in '.pt' or '.npz', but got '.*e\.json'"):
        save_epoch(tmp_path / "e.json", {}, streams={}, labels={}, epoch=0, global_step=0)
    with pytest.raises(ValueError, match="`path`"):
        load_epoch(tmp_path / "e.json")


def test_save_epoch_rejects_inconsistent_arguments(tmp_path):
    stats = {SELF: accumulate(0)}
    with pytest.raises(ValueError, match="`streams` to have an entry for module 'encoder"):
        save_epoch(tmp_path / "e.pt", stats, streams={}, labels={}, epoch=0, global_step=0)
    with pytest.raises(ValueError, match="`labels` to give 6 tokens for stream 'src'.*but got 2"):
        save_epoch(tmp_path / "e.pt", stats, streams=STREAMS, labels={"src": ["a", "b"]}, epoch=0, global_step=0)
    with pytest.raises(ValueError, match="`epoch` to be a non-negative integer, but got -1"):
        save_epoch(tmp_path / "e.pt", stats, streams=STREAMS, labels={}, epoch=-1, global_step=0)
    assert not (tmp_path / "e.pt").exists()


def test_load_epoch_reports_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="No attention epoch export at '.*missing.pt'"):
        load_epoch(tmp_path / "missing.pt")


@pytest.mark.parametrize("suffix", [".pt", ".npz"])
def test_load_epoch_rejects_unknown_format_version(tmp_path, suffix):
    path = tmp_path / f"e{suffix}"
    save_two_modules(path, seed=0)
    if suffix == ".pt":
        content = torch.load(path, weights_only=True)
        torch.save({**content, "version": FORMAT_VERSION + 1}, path)
    else:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
        meta = json.loads(str(arrays["__meta__"]))
        arrays["__meta__"] = np.array(json.dumps({**meta, "version": FORMAT_VERSION + 1}))
        np.savez_compressed(path, **arrays)
    with pytest.raises(ValueError, match=f"format version {FORMAT_VERSION + 1}, but this attn_callbacks reads"):
        load_epoch(path)


def test_load_epoch_rejects_files_that_are_not_exports(tmp_path):
    torch.save({"state_dict": {"w": torch.zeros(2)}}, tmp_path / "checkpoint.pt")
    (tmp_path / "garbage.pt").write_bytes(b"not a torch file")
    (tmp_path / "garbage.npz").write_bytes(b"not a zip file")
    np.savez(tmp_path / "plain.npz", x=np.zeros(3))
    for name in ("checkpoint.pt", "garbage.pt", "garbage.npz", "plain.npz"):
        with pytest.raises(ValueError, match="is not an attention epoch export"):
            load_epoch(tmp_path / name)
    assert zipfile.is_zipfile(tmp_path / "plain.npz")


# ---------------------------------------------------------------------------------------------------------- graph
def read_graph(path):
    graph = nx.read_graphml(path)
    edges = {(a, b): data["weight"] for a, b, data in graph.edges(data=True)}
    return graph, edges


@pytest.mark.parametrize("head", [None, 1])
def test_export_graph_self_attention_matches_loop_reference(tmp_path, head):
    stats = accumulate(0)
    expected_mass, Q, summed = loop_mass(0, head=head)
    min_weight = 0.06
    assert np.abs(expected_mass - min_weight).min() > 1e-4  # no edge decided by float32 rounding
    path = export_graph(tmp_path / "g.graphml", stats, query_labels=LABELS, head=head, min_weight=min_weight)
    graph, edges = read_graph(path)

    expected = {(str(a), str(b)): expected_mass[a, b] for a in range(6) for b in range(6) if expected_mass[a, b] > 0.06}
    assert set(edges) == set(expected) and len(expected) > 3
    for edge, weight in expected.items():
        assert edges[edge] == pytest.approx(weight, abs=1e-6)
    seen = [a for a in range(6) if Q[a] > 0 or stats.attention_sum[:, :, a].sum() > 0]
    assert sorted(graph.nodes, key=int) == [str(a) for a in seen]
    rank = F.pagerank(stats.attention_mass.mean(0) if head is None else stats.attention_mass[head])
    for a in seen:
        node = graph.nodes[str(a)]
        assert node["label"] == LABELS[a] and node["token_id"] == a and node["query_count"] == Q[a]
        assert node["in_degree"] == pytest.approx(summed[:, a].sum() / Q.sum(), abs=1e-6)
        assert node["pagerank"] == pytest.approx(float(rank[a]), abs=1e-12)
    assert graph.graph["head"] == ("mean" if head is None else str(head))


def test_export_graph_cross_attention_has_query_and_key_nodes(tmp_path):
    stats = accumulate(7, vocab_q=4, vocab_k=6)
    expected_mass, Q, summed = loop_mass(7, vocab_q=4, vocab_k=6)
    keys = ["k0", "k1", "k2", "k3", "k4", "k5"]
    path = export_graph(tmp_path / "cross.graphml", stats, query_labels=list("abcd"), key_labels=keys)
    graph, edges = read_graph(path)
    assert {f"q:{a}" for a in range(4) if Q[a] > 0} == {n for n in graph if graph.nodes[n]["role"] == "query"}
    key_nodes = {n for n in graph if graph.nodes[n]["role"] == "key"}
    assert key_nodes == {f"k:{b}" for b in range(6) if summed[:, b].sum() > 0}
    assert graph.nodes["k:5"]["label"] == "k5" and graph.nodes["q:2"]["label"] == "c"
    assert all("pagerank" not in data for _, data in graph.nodes(data=True))
    expected = {
        (f"q:{a}", f"k:{b}"): expected_mass[a, b] for a in range(4) for b in range(6) if expected_mass[a, b] > 0
    }
    assert set(edges) == set(expected)
    for edge, weight in expected.items():
        assert edges[edge] == pytest.approx(weight, abs=1e-6)


def test_export_graph_square_cross_attention_when_told(tmp_path):
    graph, _ = read_graph(export_graph(tmp_path / "g.graphml", accumulate(0), self_attention=False))
    assert {graph.nodes[n]["role"] for n in graph} == {"query", "key"}


def test_export_graph_rejects_bad_arguments(tmp_path):
    stats = accumulate(0)
    with pytest.raises(ValueError, match=r"`head` to be None or an integer in \[0, 2\), but got 2"):
        export_graph(tmp_path / "g.graphml", stats, head=2)
    with pytest.raises(ValueError, match="`min_weight` to be a non-negative number, but got -0.1"):
        export_graph(tmp_path / "g.graphml", stats, min_weight=-0.1)
    with pytest.raises(ValueError, match="`query_labels` to hold 6 tokens"):
        export_graph(tmp_path / "g.graphml", stats, query_labels=["a"])
    with pytest.raises(ValueError, match="`self_attention` to be False for a 4 x 6"):
        export_graph(tmp_path / "g.graphml", accumulate(0, vocab_q=4), self_attention=True)


def test_export_graph_without_networkx_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "networkx", None)  # makes `import networkx` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'attn_callbacks\[graph\]'"):
        export_graph(tmp_path / "g.graphml", accumulate(0))


def test_export_graph_escapes_labels_xml_cannot_hold(tmp_path):
    labels = ["\x00", "a\x1fb", "ok", "é", "<&>", ""]
    graph, _ = read_graph(export_graph(tmp_path / "g.graphml", accumulate(0), query_labels=labels))
    assert {graph.nodes[n]["label"] for n in graph} <= {"\\x00", "a\\x1fb", "ok", "é", "<&>", ""}


@pytest.mark.parametrize("labels", [None, LABELS])
def test_export_graph_names_a_tracked_streams_nodes_by_vocabulary_id(tmp_path, labels):
    stats = accumulate(0)  # index 5 is <other>, the bucket of untracked ids
    expected_mass, Q, summed = loop_mass(0)
    ids = [40, 7, 1000, 3, 12]
    graph, edges = read_graph(export_graph(tmp_path / "g.graphml", stats, query_labels=labels, query_ids=ids))
    names = [*map(str, ids), "<other>"]
    assert set(graph.nodes) == {names[a] for a in range(6) if Q[a] > 0 or summed[:, a].sum() > 0} and len(graph) == 6
    for a, name in enumerate(names):
        node = graph.nodes[name]
        assert node.get("token_id") == (ids[a] if a < 5 else None)
        assert node["label"] == (LABELS[a] if labels else name) and node["query_count"] == Q[a]
    assert edges == pytest.approx(
        {(names[a], names[b]): expected_mass[a, b] for a in range(6) for b in range(6) if expected_mass[a, b] > 0},
        abs=1e-6,
    )
    cross, _ = read_graph(
        export_graph(tmp_path / "c.graphml", accumulate(7, vocab_q=4, vocab_k=6), query_ids=[9, 8, 5], key_ids=ids)
    )
    assert {n for n in cross if n.startswith("q:")} <= {"q:9", "q:8", "q:5", "q:<other>"}
    assert {n for n in cross if n.startswith("k:")} <= {f"k:{name}" for name in names}
    assert cross.nodes["q:9"]["token_id"] == 9 and cross.nodes["q:9"]["label"] == "9"
    with pytest.raises(ValueError, match=r"`query_ids` to hold 5 ids \(the sums' 6 indices but the last, <other>\)"):
        export_graph(tmp_path / "g.graphml", stats, query_ids=ids[:3])


def test_epoch_record_export_graph_uses_streams_and_labels(tmp_path):
    save_two_modules(tmp_path / "e.pt", seed=0)
    record = load_epoch(tmp_path / "e.pt")
    graph, _ = read_graph(record.export_graph(CROSS, tmp_path / "cross.graphml"))
    assert graph.nodes["k:4"]["label"] == "on\nthe mat" and graph.nodes["q:1"]["label"] == "1"
    with pytest.raises(ValueError, match="`module` to be one of"):
        record.export_graph("nope", tmp_path / "x.graphml")


# ------------------------------------------------------------------------------------------------------------ CLI
def parse_table(lines, first_column):
    """Rows of a printed table after its header line starting with ``first_column``, up to the first blank line."""
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(first_column)) + 2
    rows = []
    for line in lines[start:]:
        if not line.strip():
            break
        rows.append(line)
    return rows


def test_main_compare_prints_drift_and_moved_tokens(tmp_path, capsys):
    old = save_two_modules(tmp_path / "old.pt", seed=0, epoch=0, global_step=10)
    new = save_two_modules(tmp_path / "new.npz", seed=1, epoch=1, global_step=20)
    argv = ["compare", str(tmp_path / "old.pt"), str(tmp_path / "new.npz"), "--top", "3", "--min-support", "2"]
    assert main([*argv, "--per-head"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "(epoch 0, step 10)" in lines[0] and "(epoch 1, step 20)" in lines[1]

    rows = parse_table(lines, "module")
    assert len(rows) == 2 * (1 + HEADS)
    for name, row, head_rows in ((SELF, rows[0], rows[1:3]), (CROSS, rows[3], rows[4:6])):
        after, before = new[name], old[name]
        counts = (after.query_count, before.query_count, 2)
        js, frob = F.attention_drift(after.attention_mass.mean(0), before.attention_mass.mean(0), *counts)
        assert row.split() == [name, "mean", f"{float(js):#.6g}", f"{float(frob):#.6g}"]
        js_heads, frob_heads = F.attention_drift(after.attention_mass, before.attention_mass, *counts)
        for h, head_row in enumerate(head_rows):
            assert head_row.split() == ["head", str(h), f"{float(js_heads[h]):#.6g}", f"{float(frob_heads[h]):#.6g}"]
        assert 0 < float(js) < math.log(2)

    text = "\n".join(lines)
    section = lines[lines.index(f"{SELF}: query tokens whose attention moved most (JS in nats, NEW vs OLD)") :]
    moved_rows = parse_table(section, "query token")
    mass_new, mass_old = new[SELF].attention_mass.mean(0), old[SELF].attention_mass.mean(0)
    moved = F.moved_tokens(mass_new, mass_old, new[SELF].query_count, old[SELF].query_count, 3, 2)
    assert len(moved_rows) == len(moved) == 3
    for row, (token, js) in zip(moved_rows, moved, strict=True):
        label = LABELS[token].replace("\n", "\\n")
        assert row.strip().startswith(label)
        assert row[len(label) + 2 :].split()[:3] == [
            f"{js:#.6g}",
            str(int(old[SELF].query_count[token])),
            str(int(new[SELF].query_count[token])),
        ]
    assert f"{CROSS}: query tokens whose attention moved most" in text


def test_main_compare_into_a_closed_pipe_stops_quietly(tmp_path):
    # `compare ... | head`: 3,000 moved tokens (~150 KB, more than a pipe holds), the reader gone after one line.
    g = torch.Generator().manual_seed(0)
    for name, epoch in (("old.pt", 0), ("new.pt", 1)):
        sums = torch.rand(1, 3000, 2, generator=g)
        count = torch.full((3000,), 10)
        stats = AttentionStats(
            sums, count[:, None].expand(3000, 2).clone(), count, torch.tensor(0), sums[0].clone(), torch.zeros(6, 1)
        )
        save_epoch(
            tmp_path / name, {CROSS: stats}, streams={CROSS: ("tgt", "src")}, labels={}, epoch=epoch, global_step=epoch
        )
    argv = [sys.executable, "-m", "attn_callbacks", "compare", str(tmp_path / "old.pt"), str(tmp_path / "new.pt")]
    process = subprocess.Popen([*argv, "--top", "3000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout.readline().startswith(b"OLD: ")
    process.stdout.close()
    _, errors = process.communicate(timeout=120)
    assert process.returncode == 1 and errors == b""


def test_main_compare_takes_modules_before_the_files_when_ended_with_a_double_dash(tmp_path, capsys):
    save_two_modules(tmp_path / "a.pt", seed=0)
    files = [str(tmp_path / "a.pt"), str(tmp_path / "a.pt")]
    assert main(["compare", *files, "--modules", "encoder.*"]) == 0
    after = capsys.readouterr().out
    assert main(["compare", "--modules", "encoder.*", "--", *files]) == 0
    assert capsys.readouterr().out == after and SELF in after and CROSS not in after


def test_main_compare_identical_epochs_print_zero_drift(tmp_path, capsys):
    save_two_modules(tmp_path / "a.pt", seed=0)
    save_two_modules(tmp_path / "b.npz", seed=0)
    assert main(["compare", str(tmp_path / "a.pt"), str(tmp_path / "b.npz"), "--modules", "encoder.*"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = parse_table(lines, "module")
    assert [row.split() for row in rows] == [[SELF, "mean", "0.00000", "0.00000"]]
    moved_rows = parse_table(
        lines[lines.index(f"{SELF}: query tokens whose attention moved most (JS in nats, NEW vs OLD)") :], "query token"
    )
    assert moved_rows and all(" 0.00000 " in row for row in moved_rows)
    assert CROSS not in "\n".join(lines)


def test_main_compare_prints_n_a_where_the_callback_would_log_no_drift(tmp_path, capsys):
    old = save_two_modules(tmp_path / "old.pt", seed=0)
    new = save_two_modules(tmp_path / "new.pt", seed=1)
    argv = ["compare", str(tmp_path / "old.pt"), str(tmp_path / "new.pt"), "--modules", "encoder.*", "--top", "0"]
    assert main([*argv, "--min-support", "1000000", "--per-head"]) == 0  # no row that often in both: no JS
    lines = capsys.readouterr().out.splitlines()
    rows = [row.split() for row in parse_table(lines, "module")]
    note = "  n/a: JS with no query token seen >= 1000000 times in both, Frobenius where a file saw no query token"
    assert note in lines
    _, frob = F.attention_drift(
        new[SELF].attention_mass.mean(0),
        old[SELF].attention_mass.mean(0),
        *(new[SELF].query_count, old[SELF].query_count, 1000000),
    )
    assert rows[0] == [SELF, "mean", "n/a", f"{float(frob):#.6g}"] and float(frob) > 0
    assert all(row[2] == "n/a" for row in rows[1:]) and len(rows) == 1 + HEADS
    empty = AttentionStats(*(torch.zeros_like(getattr(old[SELF], f)) for f in SUM_FIELDS))  # OLD saw nothing
    save_epoch(
        tmp_path / "empty.pt",
        {SELF: empty},
        streams={SELF: STREAMS[SELF]},
        labels={"src": LABELS},
        epoch=0,
        global_step=0,
    )
    for files in (["empty.pt", "new.pt"], ["new.pt", "empty.pt"]):  # NEW empty: ||0 - P̄_old|| / ||P̄_old|| = 1
        argv[1:3] = [str(tmp_path / name) for name in files]
        assert main(argv) == 0
        assert [row.split() for row in parse_table(capsys.readouterr().out.splitlines(), "module")] == [
            [SELF, "mean", "n/a", "n/a"]
        ]


def test_main_compare_a_per_head_file_with_a_mean_only_one_compares_the_head_means(tmp_path, capsys):
    old = {SELF: accumulate(0)}
    new = {SELF: accumulate(1, mean_of_heads=True)}  # per_head=False: S of the head mean only
    for path, stats in (("old.pt", old), ("new.pt", new)):
        save_epoch(
            tmp_path / path, stats, streams={SELF: STREAMS[SELF]}, labels={"src": LABELS}, epoch=0, global_step=0
        )
    argv = ["compare", str(tmp_path / "old.pt"), str(tmp_path / "new.pt"), "--min-support", "2", "--per-head"]
    assert main(argv) == 0
    rows = parse_table(capsys.readouterr().out.splitlines(), "module")
    counts = (new[SELF].query_count, old[SELF].query_count, 2)
    js, frob = F.attention_drift(new[SELF].attention_mass[0], old[SELF].attention_mass.mean(0), *counts)
    assert rows[0].split() == [SELF, "mean", f"{float(js):#.6g}", f"{float(frob):#.6g}"]
    assert "no per-head sums" in rows[1]
    with pytest.raises(ValueError, match=r"`head` to be None for sums of the head mean only.*2 heads\), but got 0"):
        export_graph(tmp_path / "g.graphml", new[SELF], head=0)


def test_main_graph_writes_graphml(tmp_path, capsys):
    save_two_modules(tmp_path / "e.npz", seed=0)
    out = tmp_path / "graphs" / "self.graphml"
    assert main(["graph", str(tmp_path / "e.npz"), SELF, str(out), "--head", "0", "--min-weight", "0.1"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    graph, edges = read_graph(out)
    assert edges and min(edges.values()) > 0.1 and graph.graph["head"] == "0"


def test_main_errors_exit_2_with_a_message(tmp_path, capsys):
    save_two_modules(tmp_path / "e.pt", seed=0)
    other = {SELF: accumulate(0, vocab_q=5, vocab_k=5)}
    save_epoch(tmp_path / "small.pt", other, streams=STREAMS, labels={}, epoch=0, global_step=0)
    e, small = str(tmp_path / "e.pt"), str(tmp_path / "small.pt")
    cases = [
        (["compare", str(tmp_path / "missing.pt"), e], "No attention epoch export at"),
        (["compare", e, str(tmp_path / "e.csv")], "`path` to end in '.pt' or '.npz'"),
        (["compare", e, small], "has (heads, query vocab, key vocab) (2, 6, 6) in OLD but (2, 5, 5) in NEW"),
        (["compare", e, e, "--modules", "nothing*"], "match no module found in both files"),
        (["compare", e, e, "--top", "-1"], "expected an integer >= 0"),
        (["compare", e], "NEW is required"),
        (["compare", "--modules", "enc*", e, e], f"--modules took ['enc*', {e!r}, {e!r}]; give OLD NEW before it"),
        (["graph", e, "nope", str(tmp_path / "g.graphml")], "module 'nope' is not in"),
        (["graph", e, SELF, str(tmp_path / "g.graphml"), "--head", "5"], "`head` to be None or an integer in [0, 2)"),
        ([], "required"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert not (tmp_path / "g.graphml").exists()


# ---------------------------------------------------------------------------------------- the callback's exports
LAYERS = ("encoder.layers.0.self_attn", "encoder.layers.1.self_attn")


def query_counts(batches):
    """Q[a]: how often token a is a query, padding left out (ignore_ids=[PAD]), counted by hand."""
    counts = torch.zeros(VOCAB, dtype=torch.int64)
    for batch in batches:
        for token in batch["input_ids"].flatten().tolist():
            if token != PAD:
                counts[token] += 1
    return counts


def exporting_monitor(**kwargs):
    return AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], per_head=False, export="pt", **kwargs)


def exported_files(folder):
    return sorted(path.name for path in Path(folder).iterdir())


def test_export_two_validate_calls_at_one_step_keep_both_epochs(tmp_path):
    first, second = helpers.make_batches(n=8, seed=1), helpers.make_batches(n=12, seed=2)
    monitor = exporting_monitor(export_dir=tmp_path / "exports")
    runner, model = trainer(tmp_path, [monitor]), TinyEncoder()
    runner.validate(model, DataLoader(first, batch_size=None), verbose=False)
    runner.validate(model, DataLoader(second, batch_size=None), verbose=False)  # epoch 0, step 0 again

    assert exported_files(tmp_path / "exports") == ["epoch=0000-step=0-v1.pt", "epoch=0000-step=0.pt"]
    for name, batches in (("epoch=0000-step=0.pt", first), ("epoch=0000-step=0-v1.pt", second)):
        record = load_epoch(tmp_path / "exports" / name)
        assert (record.epoch, record.global_step) == (0, 0)
        for layer in LAYERS:
            assert torch.equal(record.modules[layer].query_count, query_counts(batches)), (name, layer)
    assert not torch.equal(query_counts(first), query_counts(second))


def test_export_of_a_tracked_run_names_graph_nodes_by_vocabulary_id(tmp_path, capsys):
    batches = helpers.make_batches(n=8)
    monitor = exporting_monitor(export_dir=tmp_path / "exports", tracked_ids=[9, 4, 2])
    run_validate(tmp_path, monitor, batches)
    (path,) = (tmp_path / "exports").iterdir()
    record = load_epoch(path)
    tracked = record.vocab_ids["tokens"]
    assert sorted(tracked) == [2, 4, 9] and record.labels["tokens"] == [*map(str, tracked), "<other>"]
    counts = query_counts(batches)  # by vocabulary id; <other> holds every other id's queries
    expected = [*counts[tracked].tolist(), int(counts.sum() - counts[tracked].sum())]
    assert record.modules[LAYERS[0]].query_count.tolist() == expected

    out = tmp_path / "g.graphml"
    assert main(["graph", str(path), LAYERS[0], str(out)]) == 0 and capsys.readouterr().err == ""
    graph, _ = read_graph(out)
    nodes = [*map(str, tracked), "<other>"]
    assert {node: graph.nodes[node].get("token_id") for node in graph} == dict(
        zip(nodes, [*tracked, None], strict=True)
    )
    assert {node: graph.nodes[node]["query_count"] for node in graph} == dict(zip(nodes, expected, strict=True))


def test_export_two_monitors_on_one_trainer_write_their_own_files(tmp_path):
    batches = helpers.make_batches(n=8)
    first = exporting_monitor(modules=[f"{LAYERS[0]}*"])
    second = exporting_monitor(modules=[f"{LAYERS[1]}*"], prefix="deep")
    trainer(tmp_path, [first, second]).validate(TinyEncoder(), DataLoader(batches, batch_size=None), verbose=False)

    folder = tmp_path / "tb" / "version_0" / "attention_epochs"
    assert exported_files(folder) == ["deep-epoch=0000-step=0.pt", "epoch=0000-step=0.pt"]
    for name, layer in (("epoch=0000-step=0.pt", LAYERS[0]), ("deep-epoch=0000-step=0.pt", LAYERS[1])):
        record = load_epoch(folder / name)
        assert list(record.modules) == [layer]
        assert torch.equal(record.modules[layer].query_count, query_counts(batches))


def fake_trainer(log_dir, epoch=2, step=30):
    return SimpleNamespace(
        log_dir=str(log_dir), default_root_dir=str(log_dir), is_global_zero=True, current_epoch=epoch, global_step=step
    )


class FakeStreams:
    """What export_epoch reads of the monitor's streams: one self-attention module on stream "src"."""

    def __init__(self):
        self.names, self.of = ("src",), {SELF: ("src", "src")}

    def full_labels(self, stream):
        return LABELS

    def vocab_ids(self, stream):
        return None


@pytest.mark.parametrize("hard_links", [True, False])
def test_export_epoch_never_replaces_a_file(tmp_path, monkeypatch, hard_links):
    if not hard_links:  # a file system without hard links (FAT, some network file systems)
        monkeypatch.setattr(os, "link", lambda *args: (_ for _ in ()).throw(OSError(errno.EPERM, "no hard links")))
    folder = tmp_path / "exports"
    folder.mkdir()
    (folder / "run-epoch=0002-step=30.npz").write_bytes(b"another run's export")
    stats = {SELF: accumulate(0)}
    written = [export_epoch(fake_trainer(tmp_path), stats, FakeStreams(), "npz", folder, prefix="run") for _ in "ab"]

    assert [path.name for path in written] == ["run-epoch=0002-step=30-v1.npz", "run-epoch=0002-step=30-v2.npz"]
    assert (folder / "run-epoch=0002-step=30.npz").read_bytes() == b"another run's export"
    assert exported_files(folder) == sorted(["run-epoch=0002-step=30.npz", *(path.name for path in written)])
    umask = os.umask(0o022)
    os.umask(umask)
    for path in written:
        record = load_epoch(path)
        assert (record.epoch, record.global_step, record.labels) == (2, 30, {"src": LABELS})
        assert_stats_equal(record.modules[SELF], stats[SELF])
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask  # as open() makes it, not mkstemp's 0600


def test_export_name_keeps_0_1_0_names_for_the_default_prefix():
    assert export_name("attention", 3, 120, ".pt") == "epoch=0003-step=120.pt"  # as 0.1.0 named it
    assert export_name("attention_test", 3, 120, ".npz") == "attention_test-epoch=0003-step=120.npz"
    assert export_name("a/b c", 0, 7, ".pt", version=3) == "a_b_c-epoch=0000-step=7-v3.pt"
    assert export_name("..", 0, 7, ".pt") == "_-epoch=0000-step=7.pt"  # never a hidden file


def test_failed_epoch_end_leaves_no_export(tmp_path):
    folder = tmp_path / "exports"

    def id_to_token(token):  # a tokenizer that breaks once the export is on disk (while the tables are labelled)
        if folder.exists() and any(folder.iterdir()):
            raise RuntimeError("tokenizer went away")
        return f"t{token}"

    monitor = exporting_monitor(export_dir=folder, id_to_token=id_to_token)
    with pytest.raises(RuntimeError, match="tokenizer went away"):
        run_validate(tmp_path, monitor, helpers.make_batches(n=8))
    assert folder.is_dir() and exported_files(folder) == []  # no export, and no temporary file either


def test_export_dir_that_is_a_file_fails_in_the_constructor(tmp_path):
    file = tmp_path / "notes.txt"
    file.write_text("not a folder")
    with pytest.raises(ValueError, match=rf"`export_dir` to be a folder .*but got '{re.escape(str(file))}', which is"):
        exporting_monitor(export_dir=file)
    below = file / "epochs"
    with pytest.raises(ValueError, match=rf"`export_dir`.*'{re.escape(str(below))}', below '{re.escape(str(file))}'"):
        exporting_monitor(export_dir=str(below))
    monitor = AttentionMonitor(VOCAB, "input_ids", export_dir=below)  # nothing is exported: nothing to check
    assert monitor.export_dir == below


def test_default_export_dir_below_a_file_fails_in_setup(tmp_path):
    log_dir = tmp_path / "tb" / "version_0"
    log_dir.mkdir(parents=True)
    (log_dir / "attention_epochs").write_text("a file where the exports would go")
    model = TinyEncoder()
    expected = (
        rf"`export_dir` \(None: .*attention_epochs\) to be a folder.*'{re.escape(str(log_dir))}/attention_epochs'"
    )
    runner = trainer(tmp_path, [exporting_monitor()], logger=TensorBoardLogger(tmp_path, name="tb", version=0))
    with pytest.raises(MisconfigurationException, match=expected):
        runner.validate(model, DataLoader(helpers.make_batches(n=8), batch_size=None), verbose=False)
    assert model.val_outputs == []  # refused before the first batch
    assert (log_dir / "attention_epochs").read_text() == "a file where the exports would go"


def test_check_export_dir_accepts_folders_to_be(tmp_path):
    assert check_export_dir(tmp_path) == tmp_path
    assert check_export_dir(str(tmp_path / "new" / "deeper")) == tmp_path / "new" / "deeper"
    assert not (tmp_path / "new").exists()  # checked, not made


# ------------------------------------------------------------------------------------------- CLI: refused inputs
def test_main_compare_refuses_files_that_label_tokens_differently(tmp_path, capsys):
    stats = {SELF: accumulate(0)}
    relabelled = [*LABELS[:2], "dog", *LABELS[3:]]  # same shape, token 2 is another word
    save_epoch(tmp_path / "old.pt", stats, streams=STREAMS, labels={"src": LABELS}, epoch=0, global_step=1)
    save_epoch(tmp_path / "new.npz", stats, streams=STREAMS, labels={"src": relabelled}, epoch=1, global_step=2)
    old, new = str(tmp_path / "old.pt"), str(tmp_path / "new.npz")
    assert main(["compare", old, new]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == (
        f"python -m attn_callbacks compare: error: module {SELF!r}: query token 2 is 'cat' in OLD ({old}) but 'dog' "
        f"in NEW ({new}): the files count different tokens, not comparable (leave it out with --modules)"
    )
    assert main(["compare", old, old]) == 0 and capsys.readouterr().err == ""  # same labels: compared, no warning


def test_main_compare_refuses_files_that_track_different_ids(tmp_path, capsys):
    stats = {SELF: accumulate(0)}
    for name, ids in (("old.pt", [40, 7, 1000, 3, 12]), ("new.pt", [40, 7, 1000, 3, 13]), ("same.pt", None)):
        tracked = {"src": ids}
        save_epoch(tmp_path / name, stats, streams=STREAMS, labels={}, epoch=0, global_step=1, vocab_ids=tracked)
    old, new = str(tmp_path / "old.pt"), str(tmp_path / "new.pt")
    assert main(["compare", old, new]) == 2
    assert capsys.readouterr().err.strip() == (
        f"python -m attn_callbacks compare: error: module {SELF!r}: query index 4 is token id 12 in OLD ({old}) but 13 "
        f"in NEW ({new}) (None: <other>): the files track different tokens, not comparable (leave it out with "
        "--modules)"
    )
    assert main(["compare", str(tmp_path / "same.pt"), new]) == 2  # untracked against tracked: index 0 is id 0 vs 40
    assert main(["compare", old, old, "--top", "0"]) == 0


def test_main_compare_lists_tokens_only_never_the_other_bucket_of_a_tracked_stream(tmp_path, capsys):
    """Index 5 is <other>: the most frequent query, the one that moves most, and every row's largest column. The
    moved-tokens table ranks the five tokens by their JS (a float64 loop) and names their top key among tokens."""
    vocab, heads = 6, 1
    gen = torch.Generator().manual_seed(0)
    labels = {"src": ["t40", "t7", "t1000", "t3", "t12", "<other>"]}
    masses, counts = [], torch.tensor([3, 4, 5, 6, 7, 50])
    for name in ("old.pt", "new.pt"):
        mass = torch.rand(vocab, vocab, generator=gen, dtype=torch.float64)
        mass[:, 5] += 10
        mass[5] = torch.eye(vocab, dtype=torch.float64)[0 if name == "old.pt" else 5]  # <other> moves all the way
        mass /= mass.sum(dim=1, keepdim=True)
        masses.append(mass)
        sums = (mass * counts[:, None])[None].float()
        stats = AttentionStats(
            sums, torch.ones(vocab, vocab), counts, torch.tensor(0), torch.ones(vocab, vocab), torch.zeros(6, heads)
        )
        save_epoch(
            tmp_path / name,
            {SELF: stats},
            streams={SELF: ("src", "src")},
            labels=labels,
            epoch=0,
            global_step=1,
            vocab_ids={"src": [40, 7, 1000, 3, 12]},
        )
    assert (
        main(["compare", str(tmp_path / "old.pt"), str(tmp_path / "new.pt"), "--top", "9", "--min-support", "1"]) == 0
    )
    table = capsys.readouterr().out.split("moved most (JS in nats, NEW vs OLD)\n")[1].splitlines()[1:]
    rows = [line.split() for line in table if line.strip() and not line.lstrip().startswith("-")]
    js = {a: naive_js(masses[1][a].tolist(), masses[0][a].tolist()) for a in range(5)}
    ranked = sorted(range(5), key=lambda a: -js[a])
    assert [row[0] for row in rows] == [labels["src"][a] for a in ranked]
    assert [float(row[1]) for row in rows] == pytest.approx([js[a] for a in ranked], rel=1e-4)
    for row, a in zip(rows, ranked, strict=True):  # the top key among tokens, never the bucket
        assert row[4:] == [labels["src"][int(masses[i][a, :5].argmax())] for i in (0, 1)]


def test_main_compare_warns_when_one_file_has_no_labels(tmp_path, capsys):
    save_two_modules(tmp_path / "old.pt", seed=0)
    stats = {SELF: accumulate(0), CROSS: accumulate(100, vocab_q=4, vocab_k=6)}
    save_epoch(tmp_path / "new.pt", stats, streams=STREAMS, labels={}, epoch=4, global_step=130)
    assert main(["compare", str(tmp_path / "old.pt"), str(tmp_path / "new.pt"), "--top", "0"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"python -m attn_callbacks compare: warning: module {name!r}: NEW has no {axis} token labels, so {axis} tokens "
        "are compared by id, unchecked"
        for name, axis in ((SELF, "query"), (SELF, "key"), (CROSS, "key"))  # CROSS's queries ("tgt") had none
    ]
    rows = parse_table(captured.out.splitlines(), "module")
    assert [row.split() for row in rows] == [[name, "mean", "0.00000", "0.00000"] for name in (SELF, CROSS)]


def test_main_graph_into_a_folder_is_a_one_line_error(tmp_path, capsys):
    save_two_modules(tmp_path / "e.pt", seed=0)
    folder = tmp_path / "graphs"
    folder.mkdir()
    assert main(["graph", str(tmp_path / "e.pt"), SELF, str(folder)]) == 2
    message = f"OUT.graphml {str(folder)!r} is a folder: give the file to write"
    assert capsys.readouterr().err == f"python -m attn_callbacks graph: error: {message}\n"
    assert list(folder.iterdir()) == []


def test_main_graph_refuses_outputs_it_cannot_or_must_not_write(tmp_path, capsys):
    export = tmp_path / "e.pt"
    save_two_modules(export, seed=0)
    before = export.read_bytes()
    below = tmp_path / "e.pt" / "g.graphml"
    cases = [
        (below, f"OUT.graphml {str(below)!r} cannot be written: {str(export)!r} is a file, not a folder"),
        (export, f"OUT.graphml {str(export)!r} is EPOCH_FILE: writing the graph would replace the export"),
    ]
    for out, message in cases:
        assert main(["graph", str(export), SELF, str(out)]) == 2
        assert capsys.readouterr().err == f"python -m attn_callbacks graph: error: {message}\n"
    assert export.read_bytes() == before  # the export is still the export


def test_main_reports_an_unwritable_output_in_one_line(tmp_path, capsys, monkeypatch):
    save_two_modules(tmp_path / "e.pt", seed=0)

    def refused(path, write):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr("attn_callbacks.output.graph.write_atomically", refused)
    out = tmp_path / "g.graphml"
    assert main(["graph", str(tmp_path / "e.pt"), SELF, str(out)]) == 2
    assert capsys.readouterr().err == f"python -m attn_callbacks graph: error: [Errno 13] Permission denied: '{out}'\n"


def test_export_graph_refuses_a_folder_as_path(tmp_path):
    folder = re.escape(str(tmp_path))
    with pytest.raises(ValueError, match=rf"`path` to be a file to write, but got '{folder}', a folder"):
        export_graph(tmp_path, accumulate(0))
    (tmp_path / "file").write_text("")
    below = tmp_path / "file" / "g.graphml"
    with pytest.raises(ValueError, match=rf"got '{re.escape(str(below))}', below '{re.escape(str(tmp_path))}/file'"):
        export_graph(below, accumulate(0))
