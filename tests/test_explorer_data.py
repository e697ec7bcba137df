"""The explorer's files: written atomically, read back exactly, listed from the folder, and refused with the file's
name when half-written, malformed or of another version."""

import json
import os
import stat

import numpy as np
import pytest

from attn_callbacks.explorer.data import (
    PLUGIN_NAME,
    ExplorerDataError,
    list_views,
    planes_bytes,
    read_epoch,
    write_epoch,
)


def write(run, view="attention/enc.0", epoch=0, step=10, heads=2, n=3, seed=0):
    planes = np.random.default_rng(seed).random((heads + 3, n, n), dtype=np.float32)
    ids = list(range(100, 100 + n))
    path = write_epoch(
        run,
        view=view,
        module="enc.0",
        streams=("tokens", "tokens"),
        epoch=epoch,
        step=step,
        planes=planes,
        query_ids=ids,
        key_ids=ids,
        query_labels=[f"w{i}" for i in ids],
        key_labels=[f"w{i}" for i in ids],
        query_count=[30, 20, 10][:n],
    )
    return path, planes


def test_written_planes_read_back_exactly(tmp_path):
    _, planes = write(tmp_path)
    epoch = read_epoch(tmp_path, "attention/enc.0", 0, 10)
    np.testing.assert_array_equal(epoch.planes, planes)
    np.testing.assert_array_equal(epoch.mass(None), planes[0])
    np.testing.assert_array_equal(epoch.mass(1), planes[2])
    np.testing.assert_array_equal(epoch.pair_count, planes[3])
    np.testing.assert_array_equal(epoch.uniform_sum, planes[4])
    assert epoch.heads == 2 and epoch.query_count.tolist() == [30, 20, 10]
    assert epoch.meta["query_labels"] == ["w100", "w101", "w102"]
    assert isinstance(epoch.planes, np.memmap)  # a query reads a slice, not the file


def test_files_get_the_mode_the_umask_allows_so_another_user_can_serve_them(tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    path, _ = write(tmp_path)
    for file in path.parent.iterdir():  # the JSON and the planes
        assert stat.S_IMODE(file.stat().st_mode) == 0o666 & ~umask, file.name


def test_views_are_listed_from_the_folder_sorted_by_step(tmp_path):
    write(tmp_path, epoch=1, step=20)
    write(tmp_path, epoch=0, step=10)
    write(tmp_path, view="attention_test/dec.1/dataloader_idx_1", epoch=0, step=5)
    views = list_views(tmp_path)
    assert sorted(views) == ["attention/enc.0", "attention_test/dec.1/dataloader_idx_1"]
    assert [(e, s) for e, s, _ in views["attention/enc.0"]] == [(0, 10), (1, 20)]
    assert (tmp_path / "plugins" / PLUGIN_NAME / "attention_test%2Fdec.1%2Fdataloader_idx_1").is_dir()
    assert list_views(tmp_path / "missing") == {}


def test_folders_the_monitor_did_not_write_are_not_views(tmp_path):
    path, _ = write(tmp_path)
    root = path.parent.parent
    for name in (os.fsencode("attention%2Fenc.0") + b"\xff", b"attention/enc.1".replace(b"/", b"%2f"), b"a b"):
        (root / os.fsdecode(name)).mkdir()  # not UTF-8; lower-case quoting; an unquoted space
        (root / os.fsdecode(name) / path.name).write_bytes(path.read_bytes())
    assert list(list_views(tmp_path)) == ["attention/enc.0"]


def test_rewriting_an_epoch_replaces_its_planes_and_removes_the_old(tmp_path):
    path, _ = write(tmp_path, seed=0)
    version = list_views(tmp_path)["attention/enc.0"][0][2]
    _, planes = write(tmp_path, seed=1)
    np.testing.assert_array_equal(read_epoch(tmp_path, "attention/enc.0", 0, 10).planes, planes)
    assert len(list(path.parent.glob("*.npy"))) == 1
    assert not list(path.parent.glob(".*"))  # no temporary file left
    assert list_views(tmp_path)["attention/enc.0"][0][2] >= version


def test_size_is_the_planes_and_a_header(tmp_path):
    path, _ = write(tmp_path, heads=4, n=3)
    (npy,) = path.parent.glob("*.npy")
    assert npy.stat().st_size == planes_bytes(4, 3, 3) + 128 == (4 + 3) * 9 * 4 + 128


@pytest.mark.parametrize("keep", [-7, 0], ids=["truncated", "empty"])
def test_a_truncated_planes_file_is_refused_naming_it(tmp_path, keep):
    path, _ = write(tmp_path)
    (npy,) = path.parent.glob("*.npy")
    npy.write_bytes(npy.read_bytes()[:keep])  # empty: a crash before the data reached the disk
    with pytest.raises(ExplorerDataError, match=str(npy.name).replace(".", r"\.")):
        read_epoch(tmp_path, "attention/enc.0", 0, 10)


def test_a_missing_planes_file_is_refused(tmp_path):
    path, _ = write(tmp_path)
    (npy,) = path.parent.glob("*.npy")
    npy.unlink()
    with pytest.raises(ExplorerDataError, match="does not exist"):
        read_epoch(tmp_path, "attention/enc.0", 0, 10)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda meta: meta.update(version=99), "version 1"),
        (lambda meta: meta.update(query_labels=["a"]), "disagree with its shape"),
        (lambda meta: meta.pop("heads"), "lacks or garbles"),
        (lambda meta: meta.pop("module"), "lacks or garbles"),
        (lambda meta: meta.update(streams=["a"]), "lacks or garbles"),
        (lambda meta: meta.update(step="ten"), "lacks or garbles"),
        (lambda meta: meta.update(planes="../../x.npy"), "names no planes file"),
    ],
)
def test_a_malformed_json_file_is_refused(tmp_path, change, message):
    path, _ = write(tmp_path)
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))
    with pytest.raises(ExplorerDataError, match=message):
        read_epoch(tmp_path, "attention/enc.0", 0, 10)


def test_an_epoch_rewritten_between_reading_its_json_and_its_planes_is_read_again(tmp_path, monkeypatch):
    path, _ = write(tmp_path, seed=0)
    stale = path.read_bytes()
    _, planes = write(tmp_path, seed=1)  # the rewrite: new planes, the old ones removed
    fresh = path.read_bytes()
    path.write_bytes(stale)  # a reader holds the old JSON...
    load = np.load

    def rewritten_meanwhile(*args, **kwargs):
        path.write_bytes(fresh)  # ...while the writer's new JSON lands
        monkeypatch.setattr(np, "load", load)
        return load(*args, **kwargs)

    monkeypatch.setattr(np, "load", rewritten_meanwhile)
    epoch = read_epoch(tmp_path, "attention/enc.0", 0, 10)
    assert np.array_equal(epoch.planes, planes)


def test_half_written_json_is_refused(tmp_path):
    path, _ = write(tmp_path)
    path.write_text(path.read_text()[:40])
    with pytest.raises(ExplorerDataError, match="not readable JSON"):
        read_epoch(tmp_path, "attention/enc.0", 0, 10)


def test_write_refuses_lists_that_disagree_with_the_planes(tmp_path):
    with pytest.raises(ValueError, match="`query_count` to have 2 entries"):
        write_epoch(
            tmp_path,
            view="v",
            module="m",
            streams=("a", "a"),
            epoch=0,
            step=0,
            planes=np.zeros((3, 2, 2), np.float32),
            query_ids=[1, 2],
            key_ids=[1, 2],
            query_labels=["a", "b"],
            key_labels=["a", "b"],
            query_count=[1],
        )


def test_labels_that_are_not_utf8_survive(tmp_path):
    label = bytes([0xFF]).decode("utf-8", "surrogateescape")  # a byte-level model's label
    write_epoch(
        tmp_path,
        view="v",
        module="m",
        streams=("a", "a"),
        epoch=0,
        step=0,
        planes=np.zeros((3, 1, 1), np.float32),
        query_ids=[255],
        key_ids=[255],
        query_labels=[label],
        key_labels=[label],
        query_count=[1],
    )
    assert read_epoch(tmp_path, "v", 0, 0).meta["query_labels"] == [label]
