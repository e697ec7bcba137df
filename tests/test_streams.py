import pickle
from collections import namedtuple

import pytest
import torch
from torch import nn

from attn_callbacks.base.config import resolve_vocab_sizes, stream_getters
from attn_callbacks.capture.streams import check_ids_in_range, read_stream
from attn_callbacks.capture.wiring import resolve_streams


def test_stream_getters_single_and_mapping():
    assert stream_getters("input_ids") == {"tokens": "input_ids"}
    assert stream_getters({"src": "a", "tgt": 1}) == {"src": "a", "tgt": 1}
    with pytest.raises(ValueError, match="empty mapping"):
        stream_getters({})


def test_read_stream_from_dict_tuple_attribute_callable_and_seq_first():
    ids = torch.arange(6).reshape(2, 3)
    Batch = namedtuple("Batch", ["input_ids", "labels"])
    assert torch.equal(read_stream({"x": ids}, "s", "x"), ids)
    assert torch.equal(read_stream((ids, None), "s", 0), ids)
    assert torch.equal(read_stream(Batch(ids, None), "s", "input_ids"), ids)
    assert torch.equal(read_stream({"x": ids}, "s", lambda b: b["x"] + 1), ids + 1)
    assert torch.equal(read_stream({"x": ids.T}, "s", "x", batch_first=False), ids)


def test_read_stream_errors_name_stream_and_value():
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(KeyError, match="'y'.*stream 's'.*keys: \\['x'\\]"):
        read_stream({"x": ids}, "s", "y")
    with pytest.raises(ValueError, match="shape \\(B, L\\), but got shape \\(6,\\)"):
        read_stream({"x": ids.flatten()}, "s", "x")
    with pytest.raises(ValueError, match="integer token ids for stream 's', but got dtype torch.float32"):
        read_stream({"x": ids.float()}, "s", "x")
    with pytest.raises(RuntimeError, match="callable for stream 's' raised"):
        read_stream({"x": ids}, "s", lambda b: b["nope"])


def test_check_ids_in_range_ignores_invalid_positions():
    ids = torch.tensor([[1, -100, 4]])
    check_ids_in_range(ids, ids != -100, 5, "s")
    with pytest.raises(ValueError, match="Token id 5 of stream 's' is outside the vocabulary \\[0, 5\\)"):
        check_ids_in_range(ids + 1, ids != -100, 5, "s")


def test_resolve_vocab_sizes():
    assert resolve_vocab_sizes(7, ["a", "b"]) == {"a": 7, "b": 7}
    assert resolve_vocab_sizes({"a": 3, "b": 4}, ["a", "b"]) == {"a": 3, "b": 4}
    with pytest.raises(ValueError, match="for stream 'b', but got 0"):
        resolve_vocab_sizes({"a": 3, "b": 0}, ["a", "b"])


def test_resolve_streams_stock_transformer_rules_and_patterns():
    model = nn.Transformer(8, 2, 1, 1, 16)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)]
    assert resolve_streams(names, model, ["src", "tgt"]) == {
        "encoder.layers.0.self_attn": ("src", "src"),
        "decoder.layers.0.self_attn": ("tgt", "tgt"),
        "decoder.layers.0.multihead_attn": ("tgt", "src"),
    }
    custom = resolve_streams(
        names, model, ["src", "out"], {"*multihead_attn": ("out", "src"), "decoder.*": ("out",) * 2}
    )
    assert custom["decoder.layers.0.multihead_attn"] == ("out", "src")
    assert custom["decoder.layers.0.self_attn"] == ("out", "out")
    assert custom["encoder.layers.0.self_attn"] == ("src", "src")
    assert set(resolve_streams(names, model, ["only"]).values()) == {("only", "only")}
    with pytest.raises(ValueError, match="No token stream for attention module 'decoder.layers.0.self_attn'"):
        resolve_streams(names, model, ["src", "x"])


def test_labels_of_tracked_ids_survive_pickling_and_follow_loaded_ids():
    from attn_callbacks import AttentionMonitor

    two = {"vocab_size": {"a": 9, "b": 6}, "token_ids": {"a": "a", "b": "b"}}
    streams = AttentionMonitor(**two, max_tracked_tokens={"a": 3}, tracked_ids={"a": [7, 2]})._streams
    assert streams.label([0, 1, 2], "a") == ["2", "7", "<other>"]  # tracked ids kept in id order
    copy = pickle.loads(pickle.dumps(streams))
    assert copy.label([1, 0], "a") == ["7", "2"]
    copy.load_tracked({"a": torch.tensor([3, 8])})  # new tracked ids: new labels
    assert copy.label([0, 1, 2], "a") == ["3", "8", "<other>"]
