"""The tab's queries against naive float64 loops over the planes."""

import math

import numpy as np
import pytest

from attn_callbacks.explorer.data import read_epoch, write_epoch
from attn_callbacks.explorer.queries import heatmap, history, js_divergence, token_view

IDS = [7, 3, 9, 1]


def epoch_of(tmp_path, epoch=0, seed=0, ids=IDS):
    rng = np.random.default_rng(seed)
    n, heads = len(ids), 2
    mass = rng.random((heads, n, n)).astype(np.float32) / n
    counts = rng.integers(0, 5, (n, n)).astype(np.float32)
    counts[0, 1] = 0  # a pair never seen
    uniform = rng.random((n, n)).astype(np.float32)
    uniform[0, 2] = 0  # never visible
    planes = np.concatenate([mass.mean(0, keepdims=True), mass, counts[None], uniform[None]])
    write_epoch(
        tmp_path,
        view="v",
        module="m",
        streams=("t", "t"),
        epoch=epoch,
        step=epoch * 10,
        planes=planes,
        query_ids=ids,
        key_ids=ids,
        query_labels=[f"w{i}" for i in ids],
        key_labels=[f"w{i}" for i in ids],
        query_count=[40, 30, 20, 10],
    )
    return read_epoch(tmp_path, "v", epoch, epoch * 10), planes


@pytest.mark.parametrize("head", [None, 1])
def test_token_lists_match_a_naive_loop(tmp_path, head):
    epoch, planes = epoch_of(tmp_path)
    p = planes[0 if head is None else head + 1].astype(np.float64)
    counts, uniform, q = planes[-2], planes[-1].astype(np.float64), [40, 30, 20, 10]
    view = token_view(epoch, head, token=7)  # the first row and column
    expected_row = []
    for b in range(4):
        if uniform[0, b] > 0:  # ever visible (a pair counted in C may have been masked)
            lift = None if uniform[0, b] == 0 else p[0, b] * 40 / uniform[0, b]
            expected_row.append((IDS[b], p[0, b], lift, int(counts[0, b])))
    expected_row.sort(key=lambda entry: -entry[1])
    got = [(e["id"], e["p"], e["lift"], e["count"]) for e in view["attends_to"]]
    assert [g[0] for g in got] == [e[0] for e in expected_row]
    for g, e in zip(got, expected_row, strict=True):
        assert g[1] == pytest.approx(e[1], rel=1e-6) and g[3] == e[3]
        assert (g[2] is None) == (e[2] is None) and (e[2] is None or g[2] == pytest.approx(e[2], rel=1e-6))
    column = sorted(
        [(IDS[a], p[a, 0] * q[a] / uniform[a, 0]) for a in range(4) if uniform[a, 0] > 0],
        key=lambda e: -p[IDS.index(e[0]), 0],
    )
    assert [(e["id"], pytest.approx(e["lift"], rel=1e-6)) for e in view["attended_by"]] == column
    assert view["rest"] == pytest.approx(1 - p[0].sum(), abs=1e-6)
    assert view["token"] == {"id": 7, "label": "w7", "count": 40}


def test_a_token_not_stored_has_no_lists(tmp_path):
    epoch, _ = epoch_of(tmp_path)
    view = token_view(epoch, None, token=12345)
    assert view["attends_to"] is None and view["attended_by"] is None and view["token"]["label"] is None


def test_heatmap_of_the_top_tokens_and_of_a_neighbourhood(tmp_path):
    epoch, planes = epoch_of(tmp_path)
    top = heatmap(epoch, None, size=2)
    assert [r["id"] for r in top["rows"]] == [7, 3] and [c["id"] for c in top["cols"]] == [7, 3]
    assert top["p"] == planes[0, :2, :2].astype(np.float64).tolist()  # exactly as written
    assert top["count"] == planes[-2, :2, :2].astype(int).tolist()
    around = heatmap(epoch, 0, size=3, around=9)  # index 2
    p = planes[1].astype(np.float64)
    want_cols = [9, *[IDS[j] for j in np.argsort(-p[2], kind="stable") if j != 2][:2]]
    want_rows = [9, *[IDS[i] for i in np.argsort(-p[:, 2], kind="stable") if i != 2][:2]]
    assert [c["id"] for c in around["cols"]] == want_cols and [r["id"] for r in around["rows"]] == want_rows
    assert around["outline"] == {"row": 0, "col": 0}
    assert around["lift"][0][0] == pytest.approx(p[2, 2] * 20 / planes[-1, 2, 2], rel=1e-6)


def test_js_divergence_matches_the_formula_over_the_ids_both_give():
    p, q = {1: 0.5, 2: 0.2, 4: 0.1}, {1: 0.25, 3: 0.5, 4: 0.05}  # common ids 1 and 4; rests 0.4 and 0.7
    a, b = [0.5, 0.1, 0.4], [0.25, 0.05, 0.7]
    m = [(x + y) / 2 for x, y in zip(a, b, strict=True)]
    kl = lambda x: sum(xi * math.log(xi / mi) for xi, mi in zip(x, m, strict=True) if xi > 0)  # noqa: E731
    assert js_divergence(p, q) == pytest.approx((kl(a) + kl(b)) / 2, rel=1e-12)
    assert js_divergence(p, p) == 0
    # One row {1: .5, 2: .25, 3: .25} stored over other columns at two epochs did not move
    assert js_divergence({1: 0.5, 2: 0.25}, {1: 0.5, 3: 0.25}) == pytest.approx(0, abs=1e-15)


def test_history_follows_the_top_keys_across_epochs(tmp_path):
    first, planes0 = epoch_of(tmp_path, epoch=0, seed=0)
    second, planes1 = epoch_of(tmp_path, epoch=1, seed=1)
    third, _ = epoch_of(tmp_path, epoch=2, seed=2, ids=[100, 101, 102, 103])  # the token fell out of the top
    result = history([first, second, third], None, token=3, chosen=1, keys=2)
    row1 = planes1[0, 1].astype(np.float64)
    top = [IDS[j] for j in np.argsort(-row1, kind="stable")[:2]]
    assert [k["id"] for k in result["keys"]] == top
    for key, values in zip(top, result["p"], strict=True):
        j = IDS.index(key)
        assert values[:2] == pytest.approx([planes0[0, 1, j], planes1[0, 1, j]]) and values[2] is None
    expected = js_divergence(
        dict(zip(IDS, row1.tolist(), strict=True)), dict(zip(IDS, planes0[0, 1].tolist(), strict=True))
    )
    assert result["js"][0] is None and result["js"][1] == pytest.approx(expected) and result["js"][2] is None
    assert result["epochs"] == [0, 1, 2] and result["steps"] == [0, 10, 20]


def test_a_cross_attention_token_is_looked_up_on_its_side_only(tmp_path):
    # ids 3 on the query axis and 3 on the key axis are two different tokens (two vocabularies)
    rng = np.random.default_rng(3)
    planes = rng.random((3, 2, 2)).astype(np.float32)
    write_epoch(
        tmp_path,
        view="x",
        module="m",
        streams=("tgt", "src"),
        epoch=0,
        step=0,
        planes=planes,
        query_ids=[3, 5],
        key_ids=[8, 3],
        query_labels=["a", "b"],
        key_labels=["chat", "le"],
        query_count=[4, 2],
    )
    epoch = read_epoch(tmp_path, "x", 0, 0)
    as_query = token_view(epoch, None, 3, side="query")
    as_key = token_view(epoch, None, 3, side="key")
    assert as_query["token"]["label"] == "a" and as_query["attended_by"] is None
    assert [e["id"] for e in as_query["attends_to"]] == [8, 3][:: 1 if planes[0, 0, 0] >= planes[0, 0, 1] else -1]
    assert as_key["token"] == {"id": 3, "label": "le", "count": None} and as_key["attends_to"] is None
    assert [e["p"] for e in as_key["attended_by"]] == sorted(planes[0, :, 1].astype(float).tolist(), reverse=True)
    around = heatmap(epoch, None, 2, around=3, side="key")  # its column first, rows by attention to it
    assert around["outline"] == {"row": None, "col": 0}
    assert [c["id"] for c in around["cols"]] == [3, 8]
    assert [r["id"] for r in around["rows"]] == [[3, 5][i] for i in np.argsort(-planes[0, :, 1], kind="stable")]
    # the rarest query token, in a heatmap of one row: its own row, its keys by its attention
    around = heatmap(epoch, None, 1, around=5, side="query")
    assert around["outline"] == {"row": 0, "col": None} and [r["id"] for r in around["rows"]] == [5]
    assert [c["id"] for c in around["cols"]] == [[8, 3][int(np.argmax(planes[0, 1]))]]
