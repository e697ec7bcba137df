"""AttentionMonitor end to end, tracked vocabulary (max_tracked_tokens, the <other> bucket) and the memory
budget."""

import logging
import math
import re

import pytest
import torch
from _callback_helpers import (
    PAD,
    VOCAB,
    Recorder,
    Seq2Seq,
    TinyEncoder,
    loaders,
    make_batches,
    run_validate,
    saved_and_loaded,
    trainer,
)
from _reference import SAME_SUMS, table_cells
from lightning.pytorch import seed_everything
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from tensorboard.backend.event_processing.event_accumulator import SCALARS, TENSORS, EventAccumulator
from torch import nn
from torch.utils.data import DataLoader

from attn_callbacks import AttentionMonitor, load_epoch
from attn_callbacks.capture.token_ids import most_frequent_ids
from attn_callbacks.sums.accumulator import AttentionAccumulator


def fold(tracked, vocab):
    """(K + 1, V) float64 0/1 matrix sending id tracked[c] to row c and every other id to row K: the independent
    reference of the <other> bucket, S_tracked = F S Fᵀ, Q_tracked = F Q."""
    matrix = torch.zeros(len(tracked) + 1, vocab, dtype=torch.float64)
    matrix[len(tracked)] = 1
    for c, token in enumerate(tracked):
        matrix[:, token] = 0
        matrix[c, token] = 1
    return matrix


def test_callback_tracked_vocabulary_equals_dense_block_and_other_is_the_folded_mass(tmp_path):
    seed_everything(0)
    model, batches = TinyEncoder(), make_batches()
    dense, tracked = Recorder(VOCAB, "input_ids", ignore_ids=[PAD]), None
    run_validate(tmp_path / "dense", dense, batches, model)
    tracked = Recorder(VOCAB, "input_ids", ignore_ids=[PAD], max_tracked_tokens=4, sink_ids=[1], export="pt")
    mean_only = Recorder(VOCAB, "input_ids", ignore_ids=[PAD], max_tracked_tokens=4, sink_ids=[1], per_head=False)
    run_validate(tmp_path / "tracked", tracked, batches, model)
    run_validate(tmp_path / "mean", mean_only, batches, model)

    # sink id 1 first, then the 3 most frequent other ids (ties: smaller id), counted by hand over the whole set
    ids = torch.cat([b["input_ids"] for b in batches]).flatten()
    counts = torch.bincount(ids[ids != PAD], minlength=VOCAB).tolist()
    frequent = sorted((i for i in range(VOCAB) if i not in (PAD, 1) and counts[i]), key=lambda i: (-counts[i], i))
    expected = [1, *frequent[:3]]
    assert tracked.state_dict()["tracked_ids"]["tokens"].tolist() == expected
    F_ = fold(expected, VOCAB)
    for name in ("encoder.layers.0.self_attn", "encoder.layers.1.self_attn"):
        d, t, m = dense.last[name], tracked.last[name], mean_only.last[name]
        assert t.attention_sum.shape == (2, 5, 5) and m.attention_sum.shape == (1, 5, 5)
        S = F_ @ d.attention_sum.double() @ F_.T
        torch.testing.assert_close(t.attention_sum.double(), S, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(m.attention_sum[0].double(), S.mean(0), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(t.uniform_sum.double(), F_ @ d.uniform_sum.double() @ F_.T, rtol=1e-5, atol=1e-6)
        assert torch.equal(t.pair_count.double(), F_ @ d.pair_count.double() @ F_.T)
        assert torch.equal(t.query_count.double(), F_ @ d.query_count.double())
        # the tracked block is the dense sums themselves; rows still sum to 1 with <other>; no mass lost
        block = torch.tensor(expected)
        torch.testing.assert_close(t.attention_sum[:, :4, :4], d.attention_sum[:, block][:, :, block], **SAME_SUMS)
        seen = t.query_count > 0
        torch.testing.assert_close(t.attention_mass[:, seen].sum(-1), torch.ones(2, int(seen.sum())))
        torch.testing.assert_close(t.position_sums, d.position_sums)  # positions do not depend on the vocabulary
    (exported,) = (tmp_path / "tracked").rglob("*.pt")
    labels = load_epoch(exported).labels["tokens"]
    assert labels == [str(i) for i in expected] + ["<other>"]


@pytest.mark.parametrize("tracked", [{"src": 3, "tgt": 4}, {"src": 3}, {"tgt": 4}])
def test_callback_hands_the_step_the_other_cell_where_both_streams_are_tracked(tmp_path, monkeypatch, tracked):
    """The step gets the flat index of (<other>, <other>), the last cell, for the modules whose query and key streams
    are both tracked (a GPU sums that cell's pairs apart), and None for the others: the sums cannot show it."""
    seen = []
    update = AttentionAccumulator.update

    def spy(self, *args, hot_cell=None, **kwargs):
        seen.append((self.query_vocab_size, self.key_vocab_size, hot_cell))
        return update(self, *args, hot_cell=hot_cell, **kwargs)

    monkeypatch.setattr(AttentionAccumulator, "update", spy)
    g = torch.Generator().manual_seed(0)
    batches = [{"src": torch.randint(0, 7, (3, 5), generator=g), "tgt": torch.randint(0, 9, (3, 4), generator=g)}]
    monitor = AttentionMonitor({"src": 7, "tgt": 9}, {"src": "src", "tgt": "tgt"}, max_tracked_tokens=tracked)
    trainer(tmp_path, [monitor]).validate(Seq2Seq(), DataLoader(batches, batch_size=None), verbose=False)
    # a tracked stream: its tracked ids and <other>; an untracked one: its whole vocabulary, 7 or 9 ids
    src, tgt = tracked.get("src", 6) + 1, tracked.get("tgt", 8) + 1
    expected = {
        (src, src, src * src - 1 if "src" in tracked else None),  # encoder self-attention
        (tgt, tgt, tgt * tgt - 1 if "tgt" in tracked else None),  # decoder self-attention
        (tgt, src, tgt * src - 1 if len(tracked) == 2 else None),  # cross-attention: queries tgt, keys src
    }
    assert set(seen) == expected


def test_callback_heatmaps_and_tables_show_tokens_not_the_other_bucket(tmp_path):
    # 3 tracked ids of 11: <other> holds most queries and keys and would lead every ranking.
    seed_everything(0)
    monitor = AttentionMonitor(
        VOCAB,
        "input_ids",
        ignore_ids=[PAD],
        max_tracked_tokens=3,
        top_k=VOCAB,
        num_pairs=50,
        min_support=1,
        draw_in_background=False,  # the spy below sees this process's drawing only
    )
    drawn = []
    heatmap = monitor._report.images.figures.heatmap

    def record(matrix, row_labels, col_labels, *args, **kwargs):
        drawn.append((list(row_labels), list(col_labels)))
        return heatmap(matrix, row_labels, col_labels, *args, **kwargs)

    monitor._report.images.figures.heatmap = record
    train, val = loaders()
    t = trainer(tmp_path, [monitor], num_sanity_val_steps=0)
    t.fit(TinyEncoder(), train, val)
    tracked = [str(i) for i in monitor.state_dict()["tracked_ids"]["tokens"].tolist()]
    assert drawn and all(rows == cols == tracked for rows, cols in drawn)  # every token shown, no <other>
    events = EventAccumulator(t.logger.log_dir, size_guidance={TENSORS: 0})
    events.Reload()
    tables = [tag for tag in events.Tags()["tensors"] if tag.endswith("/text_summary")]
    assert {tag.split("/")[0] for tag in tables} == {
        f"attention_{table}" for table in ("one_way_pairs", "lift_pairs", "hubs", "drift_tokens")
    }
    for tag in tables:
        cells = {
            cell for row in table_cells(events.Tensors(tag)[-1].tensor_proto.string_val[0].decode()) for cell in row
        }
        assert "<other>" not in cells and cells & set(tracked), (tag, cells)


def test_callback_tracked_ids_frozen_across_epochs_and_carried_by_checkpoint_state(tmp_path):
    seed_everything(0)
    batches = make_batches()
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], max_tracked_tokens=3, export="pt")
    model = TinyEncoder()
    run_validate(tmp_path / "a", monitor, batches, model)
    first = monitor.state_dict()["tracked_ids"]["tokens"].clone()
    # the same run sees other data next time: the tracked ids stay, the data is not counted again
    flipped = [{"input_ids": torch.where(b["input_ids"] == PAD, PAD, VOCAB - b["input_ids"])} for b in batches]
    ids = torch.cat([b["input_ids"] for b in flipped]).flatten()
    assert most_frequent_ids(torch.bincount(ids[ids != PAD], minlength=VOCAB), 3).tolist() != first.tolist()
    run_validate(tmp_path / "b", monitor, flipped, model)
    assert torch.equal(monitor.state_dict()["tracked_ids"]["tokens"], first)
    (exported,) = (tmp_path / "b").rglob("*.pt")
    assert all(stats.query_count.shape == (4,) for stats in load_epoch(exported).modules.values())
    # a resumed run gets them from the state dict
    resumed = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], max_tracked_tokens=3)
    state = saved_and_loaded(monitor.state_dict())
    resumed.load_state_dict(state)
    assert torch.equal(resumed.state_dict()["tracked_ids"]["tokens"], first)


def test_callback_memory_budget_refuses_before_allocating_naming_figure_and_knobs(tmp_path):
    # 10^6 ids, 2 heads: 12 TB of sums, which no allocation could survive, so the error must come first
    monitor = AttentionMonitor(10**6, "input_ids", ignore_ids=[PAD])
    with pytest.raises(MisconfigurationException, match=r"would hold 36\.4 TiB .*memory_budget`=1\.0 GiB") as info:
        run_validate(tmp_path, monitor, make_batches())
    for knob in ("max_tracked_tokens", "per_head=False", "`modules`"):
        assert knob in str(info.value)
    assert monitor._sums.metrics == {}
    # per module: (H + 1) · V² · 4 + V² · 8 + V · 8 + 8 + 6 · H · 4 bytes; 2 modules
    small = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], memory_budget="1KiB")
    per_module = 3 * 144 * 4 + 144 * 8 + 12 * 8 + 8 + 6 * 2 * 4
    model = TinyEncoder()
    with pytest.raises(MisconfigurationException, match=f"would hold {2 * per_module / 1024:.1f} KiB"):
        trainer(tmp_path, [small], max_epochs=1).fit(model, *loaders())
    assert model.global_step == 0 and small._sums.metrics == {}  # refused at setup, before training
    assert AttentionMonitor(VOCAB, "input_ids", memory_budget=None).memory_budget is None


def test_callback_bert_sized_vocabulary_runs_end_to_end_within_the_default_budget(tmp_path, caplog):
    vocab = 30_522
    seed_everything(0)
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)  # Zipf(1) ids, as in real text
    ids = torch.multinomial(weights, 64 * 128, replacement=True, generator=torch.Generator().manual_seed(0))
    batches = [{"input_ids": ids.view(64, 128)[i : i + 16]} for i in range(0, 64, 16)]  # ~2,800 distinct ids

    class Bert(TinyEncoder):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(vocab, 16), nn.Linear(16, vocab)

    dense = AttentionMonitor(vocab, "input_ids")
    with pytest.raises(MisconfigurationException, match="would hold 34\\.7 GiB .*max_tracked_tokens"):
        trainer(tmp_path / "dense", [dense], max_epochs=1).fit(Bert(), batches, batches)
    monitor = Recorder(vocab, "input_ids", max_tracked_tokens=2048, sink_ids=[101, 102], top_k=8)
    logger = TensorBoardLogger(tmp_path, name="bert")
    t = trainer(tmp_path, [monitor], logger=logger, max_epochs=2, num_sanity_val_steps=0, limit_train_batches=1)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        t.fit(Bert(), DataLoader(batches, batch_size=None), DataLoader(batches, batch_size=None))
    # the figure logged before the sums are allocated (again when it grows): the bytes they hold per device
    *_, (size, unit) = [f for r in caplog.records for f in re.findall(r"will hold ([\d.]+) (\w+) of", r.getMessage())]
    assert float(size) * 1024 ** ["B", "KiB", "MiB", "GiB", "TiB"].index(unit) < 2**30
    stats = monitor.last["encoder.layers.1.self_attn"]
    assert stats.attention_sum.shape == (2, 2049, 2049)
    assert (
        int(stats.query_count.sum()) == 64 * 128
        and float(stats.attention_mass.sum(-1)[:, stats.query_count > 0].min()) > 0.999
    )
    events = EventAccumulator(t.logger.log_dir, size_guidance={SCALARS: 0})
    events.Reload()
    js = events.Scalars("attention_drift/js_prev/encoder.layers.1.self_attn")
    assert len(js) == 1 and math.isfinite(js[0].value)


def test_callback_per_stream_sink_ids_may_leave_streams_out():
    # streams without sinks get none, also where tracking needs every stream's sinks
    two = {"vocab_size": {"a": 5, "b": 6}, "token_ids": {"a": "a", "b": "b"}, "sink_ids": {"b": [1]}}
    monitor = AttentionMonitor(**two, max_tracked_tokens={"a": 3}, tracked_ids={"a": [4]})
    assert monitor.state_dict()["tracked_ids"]["a"].tolist() == [4]
    with pytest.raises(ValueError, match="`max_tracked_tokens`=1 for stream 'b' is smaller than its 2 `sink_ids`"):
        AttentionMonitor(**{**two, "sink_ids": {"b": [1, 2]}}, max_tracked_tokens={"b": 1})


@pytest.mark.parametrize("sanity_steps", [0, 2])
def test_callback_memory_budget_counts_every_validation_loader_before_training(tmp_path, sanity_steps):
    # The sums fit the budget for one dataloader (2 modules), not for two: refused before the first training step,
    # whether or not a sanity pass runs first.
    per_module = 3 * 144 * 4 + 144 * 8 + 12 * 8 + 8 + 6 * 2 * 4  # as in the test above
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], memory_budget=3 * per_module)
    model = TinyEncoder()
    train, val = loaders()
    with pytest.raises(MisconfigurationException, match=f"would hold {4 * per_module / 1024:.1f} KiB"):
        trainer(tmp_path, [monitor], max_epochs=1, num_sanity_val_steps=sanity_steps).fit(model, train, [val, val])
    assert model.global_step == 0 and monitor._sums.metrics == {}
