"""What the monitor writes for the Attention tab (attn_callbacks/output/explore.py), read back and checked against
the exported sums of the same epoch."""

import numpy as np
import pytest
import torch
from _callback_helpers import PAD, VOCAB, Seq2Seq, TinyEncoder, make_batches, run_validate, trainer
from torch.utils.data import DataLoader

from attn_callbacks import AttentionMonitor, load_epoch
from attn_callbacks.explorer.data import list_views, planes_bytes, read_epoch
from attn_callbacks.output.explore import explorer_tokens


def run_dir(tmp_path):
    return tmp_path / "tb" / "version_0"


def only_epoch(tmp_path, view):
    (epoch, step, _), *_ = list_views(run_dir(tmp_path))[view]
    return read_epoch(run_dir(tmp_path), view, epoch, step)


def exported(tmp_path, module):
    (path,) = (run_dir(tmp_path) / "attention_epochs").glob("*.npz")
    return load_epoch(path).modules[module]


@pytest.mark.parametrize(
    "heads, size, square", [(8, 2_000_000, True), (0, 5_000, True), (12, 10**6, False), (2, 1, True)]
)
def test_explorer_tokens_is_the_largest_count_that_fits(heads, size, square):
    json_bytes = 48 * (1 if square else 2) * 2

    def fits(n):
        return planes_bytes(heads, n, n) + json_bytes * n <= size

    n = explorer_tokens(heads, size, square)
    assert n == 1 or (fits(n) and not fits(n + 1))
    if size == 2_000_000:
        assert n == 212  # 44 * 212² + 96 * 212 = 1,997,888 <= 2e6 < 44 * 213² + 96 * 213: docs/explorer.md


def test_planes_equal_the_exported_sums_of_the_epoch(tmp_path):
    labels = [f"w{i}" for i in range(VOCAB)]
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], id_to_token=labels, export="npz", num_pairs=0)
    run_validate(tmp_path, monitor, make_batches())
    name = "encoder.layers.1.self_attn"
    epoch, stats = only_epoch(tmp_path, f"attention/{name}"), exported(tmp_path, name)
    q = stats.query_count
    order = sorted((i for i in range(VOCAB) if q[i] > 0), key=lambda i: (-int(q[i]), i))  # most frequent first
    assert epoch.meta["query_ids"] == order == epoch.meta["key_ids"]
    assert epoch.meta["query_labels"] == [labels[i] for i in order] and epoch.query_count.tolist() == q[order].tolist()
    grid = np.ix_(order, order)
    sums = stats.attention_sum.double().numpy()  # (H, V, V)
    with np.errstate(invalid="ignore"):  # rows of ids never seen: 0 / 0, not compared
        p_heads = sums / q.double().numpy()[None, :, None]
    np.testing.assert_allclose(epoch.mass(None), p_heads.mean(0)[grid], rtol=1e-5, atol=1e-7)
    for h in range(2):
        np.testing.assert_allclose(epoch.mass(h), p_heads[h][grid], rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(epoch.pair_count, stats.pair_count.numpy()[grid])
    np.testing.assert_array_equal(epoch.uniform_sum, stats.uniform_sum.numpy()[grid])
    assert epoch.meta["epoch"] == 0 and epoch.meta["module"] == name and epoch.heads == 2


def test_explorer_size_bounds_the_file(tmp_path):
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], explorer_size="1KB", num_pairs=0)
    run_validate(tmp_path, monitor, make_batches())
    folder = run_dir(tmp_path) / "plugins" / "attention_explorer" / "attention%2Fencoder.layers.0.self_attn"
    (npy,), (meta,) = folder.glob("*.npy"), folder.glob("*.json")
    n = explorer_tokens(2, 1000, True)
    assert only_epoch(tmp_path, "attention/encoder.layers.0.self_attn").planes.shape == (5, n, n)
    assert npy.stat().st_size - 128 + meta.stat().st_size <= 1000 + 300  # the JSON's fixed fields beside the bound


def test_explorer_off_or_without_tensorboard_writes_nothing(tmp_path):
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], explorer=False, num_pairs=0)
    run_validate(tmp_path, monitor, make_batches())
    assert not (run_dir(tmp_path) / "plugins").exists()
    with pytest.raises(ValueError, match="`explorer` to be True or False, but got 'yes'"):
        AttentionMonitor(VOCAB, explorer="yes")
    with pytest.raises(ValueError, match="`explorer_size` to be a positive number of bytes"):
        AttentionMonitor(VOCAB, explorer_size="0MB")


def test_a_view_whose_folder_name_would_be_too_long_is_left_out_with_a_warning(tmp_path):
    prefix = "é" * 40  # %-quoted: 240 bytes, and the module's name after it
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], prefix=prefix, num_pairs=0)
    with pytest.warns(UserWarning, match=r"view '.*encoder.layers.0.self_attn' would be a name longer than 255 bytes"):
        run_validate(tmp_path, monitor, make_batches())
    assert list_views(run_dir(tmp_path)) == {}
    assert (run_dir(tmp_path) / "plugins" / "attention_explorer").exists() is False
    short = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], prefix="é" * 10, num_pairs=0)
    run_validate(tmp_path / "short", short, make_batches())
    assert len(list_views(tmp_path / "short" / "tb" / "version_0")) == 2  # both layers


def test_mean_only_monitor_writes_the_head_mean_only(tmp_path):
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], per_head=False, num_pairs=0)
    run_validate(tmp_path, monitor, make_batches())
    epoch = only_epoch(tmp_path, "attention/encoder.layers.0.self_attn")
    assert epoch.heads == 0 and epoch.planes.shape[0] == 3


def test_tracked_ids_are_written_as_vocabulary_ids(tmp_path):
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], tracked_ids=[9, 4, 7], num_pairs=0)
    run_validate(tmp_path, monitor, make_batches())
    epoch = only_epoch(tmp_path, "attention/encoder.layers.0.self_attn")
    assert sorted(epoch.meta["query_ids"]) == [4, 7, 9]  # never the compact indices, never <other>
    assert epoch.meta["query_labels"] == [str(i) for i in epoch.meta["query_ids"]]


def test_cross_attention_columns_are_the_keys_most_often_visible(tmp_path):
    g = torch.Generator().manual_seed(0)
    batches = [{"src": torch.randint(0, 7, (3, 5), generator=g), "tgt": torch.randint(0, 9, (3, 4), generator=g)}]
    monitor = AttentionMonitor(
        {"src": 7, "tgt": 9}, {"src": "src", "tgt": "tgt"}, id_to_token={"src": [f"s{i}" for i in range(7)]}
    )
    trainer(tmp_path, [monitor], max_epochs=1).validate(Seq2Seq(), DataLoader(batches, batch_size=None), verbose=False)
    view = next(v for v in list_views(run_dir(tmp_path)) if "multihead_attn" in v)
    epoch = only_epoch(tmp_path, view)
    visible = torch.cat(list(batches[0]["src"])).bincount(minlength=7) * 4  # each src id is visible to 4 tgt queries
    expected = sorted((i for i in range(7) if visible[i] > 0), key=lambda i: (-int(visible[i]), i))
    assert epoch.meta["key_ids"] == expected and epoch.meta["key_labels"] == [f"s{i}" for i in expected]
    assert epoch.meta["streams"] == ["tgt", "src"] and epoch.meta["query_labels"][0].isdigit()


class WithTestStep(TinyEncoder):  # not "Test...": pytest would try to collect it
    def test_step(self, batch, batch_idx):
        self(batch["input_ids"])


def test_sanity_pass_is_not_written_and_test_epochs_get_their_prefix(tmp_path):
    monitor = AttentionMonitor(
        VOCAB, "input_ids", ignore_ids=[PAD], log_sanity_check=True, monitor_test=True, num_pairs=0
    )
    t = trainer(tmp_path, [monitor], max_epochs=1, num_sanity_val_steps=1, limit_train_batches=1)
    batches = DataLoader(make_batches(), batch_size=None)
    t.fit(WithTestStep(), batches, batches)
    t.test(WithTestStep(), batches, verbose=False)
    views = list_views(run_dir(tmp_path))
    assert [(e, s) for e, s, _ in views["attention/encoder.layers.0.self_attn"]] == [(0, 1)]  # not the sanity pass
    assert "attention_test/encoder.layers.0.self_attn" in views
