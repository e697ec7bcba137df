"""The Attention tab's routes through TensorBoard's own WSGI application (werkzeug's test client), with both data
backends, on the files a real fit wrote, checked against that fit's exported sums."""

import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from _callback_helpers import VOCAB, TinyEncoder, loaders, trainer
from tensorboard import program
from tensorboard.backend import application
from werkzeug.test import Client

from attn_callbacks import AttentionMonitor, load_epoch

ROUTE = "/data/plugin/attention_explorer"
LABELS = [f"w{i}" for i in range(VOCAB)]
MODULE = "encoder.layers.0.self_attn"
VIEW = f"attention/{MODULE}"


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("explorer")
    monitor = AttentionMonitor(vocab_size=VOCAB, ignore_ids=[0], id_to_token=LABELS, export="npz", num_pairs=0)
    train, val = loaders()
    trainer(root, [monitor], max_epochs=2, num_sanity_val_steps=0).fit(TinyEncoder(), train, val)
    quiet = AttentionMonitor(vocab_size=VOCAB, ignore_ids=[0], explorer=False, num_pairs=0)
    trainer(root / "no_explorer", [quiet], max_epochs=1, num_sanity_val_steps=0).fit(TinyEncoder(), train, val)
    return root


def tensorboard_app(logdir, load_fast):
    """TensorBoard's WSGI application as `tensorboard --logdir` builds it (program.TensorBoard's own data provider
    choice: the Rust data server with load_fast=true, the Python multiplexer with false)."""
    board = program.TensorBoard()
    board.configure(argv=["", "--logdir", str(logdir), "--load_fast", load_fast, "--reload_interval", "1"])
    provider, multiplexer = board._make_data_provider()  # what TensorBoard.launch() does first
    app = application.TensorBoardWSGIApp(
        board.flags, board.plugin_loaders, provider, board.assets_zip_provider, multiplexer
    )
    client = Client(app)
    deadline = time.monotonic() + 30
    while not client.get(f"{ROUTE}/runs").json["runs"] and time.monotonic() < deadline:
        time.sleep(0.2)  # the data server loads the logdir in the background
    return client


@pytest.fixture(scope="module", params=["false", "true"], ids=["multiplexer", "data-server"])
def client(request, logdir):
    return tensorboard_app(logdir, request.param)


def exported(logdir, epoch):
    (path,) = (logdir / "tb" / "version_0" / "attention_epochs").glob(f"epoch={epoch:04d}-*.npz")
    return load_epoch(path).modules[MODULE]


def reference(stats, head):
    """P, lift and pair count in float64 from the exported sums: P = S / Q, lift = S / U (S of the head mean)."""
    sums = stats.attention_sum.double()
    s = sums.mean(0) if head is None else sums[head]
    q = stats.query_count.double()
    return (s / q[:, None]).numpy(), (s / stats.uniform_sum.double()).numpy(), stats.pair_count.numpy()


def get(client, route, **query):
    response = client.get(f"{ROUTE}/{route}", query_string=query)
    return response.status_code, response.json


def runs(client):
    return get(client, "runs")[1]["runs"]


def test_runs_lists_the_run_with_data_and_its_epochs(client):
    (run,) = runs(client)
    assert run["run"] == "tb/version_0"
    views = {view["view"]: view for view in run["views"]}
    assert sorted(views) == [VIEW, "attention/encoder.layers.1.self_attn"]
    assert views[VIEW]["heads"] == 2 and views[VIEW]["module"] == MODULE
    assert [(e["epoch"], e["step"]) for e in views[VIEW]["epochs"]] == [(0, 4), (1, 8)]


@pytest.mark.parametrize("head", [None, 1])
def test_token_lists_equal_the_exported_sums(client, logdir, head):
    run = runs(client)[0]["run"]
    stats = exported(logdir, 1)
    p, lift, count = reference(stats, head)
    token = int(stats.query_count.argmax())
    status, view = get(client, "token", run=run, view=VIEW, epoch=1, head="mean" if head is None else head, token=token)
    assert status == 200 and view["token"] == {
        "id": token,
        "label": LABELS[token],
        "count": int(stats.query_count[token]),
    }
    listed = view["attends_to"]
    assert [e["id"] for e in listed] == sorted(
        (b for b in range(VOCAB) if count[token, b] > 0), key=lambda b: -p[token, b]
    )
    for entry in listed:
        b = entry["id"]
        assert entry["p"] == pytest.approx(p[token, b], rel=1e-5) and entry["count"] == count[token, b]
        assert entry["lift"] == pytest.approx(lift[token, b], rel=1e-5) and entry["label"] == LABELS[b]
    by = {e["id"]: e for e in view["attended_by"]}
    assert set(by) == {a for a in range(VOCAB) if count[a, token] > 0}
    for a, entry in by.items():
        assert entry["p"] == pytest.approx(p[a, token], rel=1e-5)
    assert view["rest"] == pytest.approx(1 - p[token, 1:].sum() - p[token, 0], abs=1e-5)


def test_heatmap_shows_the_most_frequent_tokens(client, logdir):
    run = runs(client)[0]["run"]
    stats = exported(logdir, 0)
    p, _, count = reference(stats, None)
    status, grid = get(client, "heatmap", run=run, view=VIEW, epoch=0, step=4, head="mean", size=3)
    q = stats.query_count.numpy()
    top = [int(i) for i in np.argsort(-q, kind="stable")[:3]]
    assert status == 200 and [r["id"] for r in grid["rows"]] == top == [c["id"] for c in grid["cols"]]
    np.testing.assert_allclose(grid["p"], p[np.ix_(top, top)], rtol=1e-5)
    assert grid["count"] == count[np.ix_(top, top)].astype(int).tolist()


def test_history_gives_each_epochs_value(client, logdir):
    run = runs(client)[0]["run"]
    before, after = reference(exported(logdir, 0), None)[0], reference(exported(logdir, 1), None)[0]
    token = 3
    status, result = get(client, "history", run=run, view=VIEW, epoch=1, head="mean", token=token, keys=3)
    top = [int(b) for b in np.argsort(-after[token], kind="stable")[:3]]
    assert status == 200 and [k["id"] for k in result["keys"]] == top
    np.testing.assert_allclose(result["p"], [[before[token, b], after[token, b]] for b in top], rtol=1e-5)
    assert result["js"][0] is None and 0 <= result["js"][1] <= np.log(2)


@pytest.mark.parametrize(
    "query, status, message",
    [
        (dict(run="../../etc"), 404, "no run named '../../etc'"),
        (dict(run="no_explorer/tb/version_0"), 404, "has no explorer data for view"),
        (dict(view="attention/nothing"), 404, "has no explorer data for view 'attention/nothing'"),
        (dict(epoch=7), 404, "has no epoch 7"),
        (dict(head=2), 400, "head 2 is not stored for this epoch: it has heads 0..1 and 'mean'"),
        (dict(token="abc"), 400, "parameter 'token' must be an integer"),
        (dict(epoch=None), 400, "missing parameter 'epoch'"),
        (dict(run=None), 400, "missing parameter 'run'"),
        (dict(epoch="١"), 400, "parameter 'epoch' must be an integer, got '١'"),
        (dict(epoch="0_1"), 400, "parameter 'epoch' must be an integer"),
        (dict(limit=-1), 400, "parameter 'limit' must be at least 1, got -1"),
    ],
)
def test_bad_requests_get_a_clear_json_error(client, query, status, message):
    run = runs(client)[0]["run"]
    full = {"run": run, "view": VIEW, "epoch": 1, "head": "mean", "token": 3, **query}
    code, body = get(client, "token", **{k: v for k, v in full.items() if v is not None})
    assert code == status and message in body["error"]


def test_epoch_answers_are_cacheable_only_under_their_version(client):
    run = runs(client)[0]
    version = next(v for v in run["views"] if v["view"] == VIEW)["epochs"][0]["v"]
    query = {"run": run["run"], "view": VIEW, "epoch": 0}
    cached = client.get(f"{ROUTE}/labels", query_string={**query, "v": version})
    fresh = client.get(f"{ROUTE}/labels", query_string=query)
    assert "max-age=86400" in cached.headers["Cache-Control"] and "max-age" not in fresh.headers["Cache-Control"]
    assert cached.json["query_labels"][0] in LABELS


def test_the_tab_is_listed_and_its_script_served(client):
    listing = client.get("/data/plugins_listing").json["attention_explorer"]
    assert listing["enabled"] and listing["tab_name"] == "Attention"
    assert listing["loading_mechanism"] == {"type": "IFRAME", "module_path": f"{ROUTE}/index.js"}
    script = client.get(f"{ROUTE}/index.js")
    assert script.status_code == 200 and "javascript" in script.headers["Content-Type"]
    assert b"export function render" in script.data or b"export async function render" in script.data


def test_a_logdir_without_data_leaves_the_tab_inactive(logdir):
    client = tensorboard_app(logdir / "no_explorer", "false")
    assert client.get("/data/plugins_listing").json["attention_explorer"]["enabled"] is False
    assert client.get(f"{ROUTE}/runs").json == {"runs": []}


@pytest.mark.parametrize("load_fast", ["false", "true"])
def test_a_damaged_file_gives_a_message_not_a_traceback(logdir, tmp_path, load_fast):
    copy = tmp_path / "copy"
    shutil.copytree(logdir / "tb", copy)
    folder = copy / "version_0" / "plugins" / "attention_explorer" / VIEW.replace("/", "%2F")
    (planes,) = folder.glob("epoch=1-*.npy")
    planes.write_bytes(planes.read_bytes()[:100])
    client = tensorboard_app(copy, load_fast)
    code, body = get(client, "token", run="version_0", view=VIEW, epoch=1, token=3)
    assert code == 500 and "cannot be read" in body["error"] and planes.name in body["error"]
    assert get(client, "token", run="version_0", view=VIEW, epoch=0, token=3)[0] == 200  # the others still answer


@pytest.mark.parametrize(("route", "query"), [("heatmap", dict(size=0)), ("history", dict(keys=0, token=3))])
def test_sizes_of_zero_are_refused_not_replaced_by_the_default(client, route, query):
    code, body = get(client, route, run=runs(client)[0]["run"], view=VIEW, epoch=1, **query)
    assert code == 400 and f"parameter '{next(iter(query))}' must be" in body["error"]


def test_history_leaves_an_unreadable_epoch_out_and_still_answers(logdir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(logdir / "tb", copy)
    folder = copy / "version_0" / "plugins" / "attention_explorer" / VIEW.replace("/", "%2F")
    (planes,) = folder.glob("epoch=1-*.npy")
    planes.write_bytes(b"")
    code, body = get(tensorboard_app(copy, "false"), "history", run="version_0", view=VIEW, epoch=0, token=3)
    assert code == 200 and body["epochs"] == [0] and body["js"] == [None]


def test_the_plugin_imports_neither_torch_nor_lightning():
    # TensorBoard imports every plugin at start: a slow or failing import there takes it down.
    code = "import sys, attn_callbacks.explorer.plugin; print(sorted({'torch', 'lightning'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"
