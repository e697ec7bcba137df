import pickle

import pytest
import torch
from torch import nn

from attn_callbacks.base.config import mask_getters, resolve_vocab_sizes, stream_getters
from attn_callbacks.capture.streams import Streams
from attn_callbacks.capture.wiring import resolve_streams


def test_stream_getters_single_and_mapping():
    assert stream_getters("input_ids") == {"tokens": "input_ids"}
    assert stream_getters({"src": "a", "tgt": 1}) == {"src": "a", "tgt": 1}
    with pytest.raises(ValueError, match="empty mapping"):
        stream_getters({})


def test_mask_getters_one_stream_mapping_and_errors():
    assert mask_getters(None, ["tokens"]) == {}
    assert mask_getters("attention_mask", ["tokens"]) == {"tokens": "attention_mask"}
    assert mask_getters({"src": "attention_mask"}, ["src", "tgt"]) == {"src": "attention_mask"}  # tgt: no mask
    with pytest.raises(ValueError, match=r"`token_mask` to be a mapping.*\['src', 'tgt'\], but got 'attention_mask'"):
        mask_getters("attention_mask", ["src", "tgt"])
    with pytest.raises(ValueError, match=r"`token_mask` names unknown stream\(s\) \['source'\]"):
        mask_getters({"source": "attention_mask"}, ["src", "tgt"])
    with pytest.raises(ValueError, match="`token_mask` to be a batch key.*but got 1.5 for stream 'tokens'"):
        mask_getters(1.5, ["tokens"])


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
    # One stream: a decoder's attention reads target tokens, which one stream rarely holds; said, it is used.
    with pytest.raises(
        ValueError, match=r"'decoder.layers.0.self_attn' is a decoder's self-attention: its queries are"
    ):
        resolve_streams(names, model, ["only"])
    with pytest.raises(
        ValueError, match=r"decoder's cross-attention \(target → source\).*leave the module out"
    ) as said:
        resolve_streams(["decoder.layers.0.multihead_attn"], model, ["only"])
    assert "attention_streams" not in str(said.value)  # one stream for both axes cannot fit cross-attention
    assert set(resolve_streams(names, model, ["only"], {"*": ("only",) * 2}).values()) == {("only", "only")}
    assert resolve_streams(names[:1], model, ["only"]) == {"encoder.layers.0.self_attn": ("only", "only")}
    # one stream named as the decoder's: its self-attention reads it; its cross-attention reads src, not given
    assert resolve_streams(names[1:2], model, ["tgt"]) == {"decoder.layers.0.self_attn": ("tgt", "tgt")}
    with pytest.raises(ValueError, match="'decoder.layers.0.multihead_attn' is a decoder's cross-attention") as said:
        resolve_streams(names[2:], model, ["tgt"])
    assert "audio frames or image patches, cannot be mapped to a vocabulary" in str(said.value)
    with pytest.raises(ValueError, match="a decoder's self-attention") as said:
        resolve_streams(names[1:2], model, ["only"])
    assert "audio frames" not in str(said.value)
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


# ---------------------------------------------------------------------------------------------- id dtypes and range


class _OneProcess:
    """The two things ``choose_tracked`` asks of a Lightning strategy, for one process on the CPU."""

    root_device = torch.device("cpu")

    def reduce(self, tensor, reduce_op):
        return tensor


def _read(streams, ids, stream="tokens"):
    streams.start_batch({"x": ids})
    return streams.read(stream, torch.device("cpu"))


def test_streams_read_uint8_ids_of_a_256_byte_vocabulary_without_wrapping():
    ids = torch.tensor([[0, 154, 255, 156]], dtype=torch.uint8)
    compact, valid, as_read = _read(Streams("x", 256, ignore_ids=[-100]), ids)
    # 154 < 256 (compared in uint8, 256 wraps to 0), and -100 (which wraps to byte 156) ignores nothing
    assert compact.tolist() == [[0, 154, 255, 156]] and as_read.tolist() == [[0, 154, 255, 156]]
    assert valid.tolist() == [[True, True, True, True]]


def test_streams_ignore_ids_outside_the_ids_dtype_never_match():
    ids = torch.tensor([[-100, 7, 40000 - 2**16]], dtype=torch.int16)  # 40000 as int16 would be -25536
    streams = Streams("x", 10, ignore_ids=[-100, 40000, 2**70], validate_args=False)
    assert _read(streams, ids)[1].tolist() == [[False, True, True]]
    with pytest.raises(ValueError, match="Token id -25536 of stream 'tokens' is outside the vocabulary \\[0, 10\\)"):
        _read(Streams("x", 10, ignore_ids=[-100, 40000]), ids)


def test_streams_tracked_ids_without_validation_fold_ids_outside_the_vocabulary_into_other():
    streams = Streams("x", 10, tracked_ids=[3, 9], validate_args=False)
    compact, valid, _ = _read(streams, torch.tensor([[3, 9, 10, 57, -4, 0]]))
    assert compact.tolist() == [[0, 1, 2, 2, 2, 2]]  # 10 and 57 are no token 9: <other> (index 2), as 0 and -4
    assert valid.all()


def test_streams_tracked_ids_of_uint8_ids_with_a_wrapping_ignore_id():
    streams = Streams("x", 256, tracked_ids=[156, 3], ignore_ids=[-100])
    compact, valid, _ = _read(streams, torch.tensor([[156, 3, 200]], dtype=torch.uint8))
    assert compact.tolist() == [[1, 0, 2]] and valid.all()  # tracked [3, 156] in id order; 200 is <other>


def test_choose_tracked_counts_uint8_ids_without_wrapping_the_ignore_ids():
    streams = Streams("x", 256, ignore_ids=[-100], max_tracked_tokens=2)
    streams.of = {"attn": ("tokens", "tokens")}
    batches = [{"x": torch.tensor([[156, 156, 3, 200], [156, 7, 7, 3]], dtype=torch.uint8)}]
    streams.choose_tracked([batches], [1], _OneProcess())
    assert streams.tracked["tokens"].tolist() == [156, 3]  # 156: 3 times, 3 and 7: twice (the smaller id wins)


def test_streams_token_mask_leaves_out_masked_positions_as_ignore_ids_do_and_in_the_tracked_count():
    """GPT-2's set-up: the pad id is the end-of-text id (9), which real text holds too; the mask tells them apart."""
    ids = torch.tensor([[5, 9, 3, 9, 9], [9, 5, 5, 9, 9]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    streams = Streams("x", 10, ignore_ids=[3], token_mask="m", max_tracked_tokens=2)
    streams.start_batch({"x": ids, "m": mask})
    _, valid, _ = streams.read("tokens", torch.device("cpu"))
    assert valid.tolist() == [[True, True, False, False, False], [True, True, True, True, False]]  # both apply
    streams.of = {"attn": ("tokens", "tokens")}
    streams.choose_tracked([[{"x": ids, "m": mask}]], [1], _OneProcess())
    assert streams.tracked["tokens"].tolist() == [5, 9]  # 5: 3 times, 9: 3 real times (not 6)
    streams = Streams("x", 10, token_mask="m", max_tracked_tokens=1)
    streams.of = {"attn": ("tokens", "tokens")}
    streams.choose_tracked([[{"x": ids, "m": mask}]], [1], _OneProcess())
    assert streams.tracked["tokens"].tolist() == [5]  # counted with its padding, 9 (6 times) would lead


@pytest.mark.parametrize("bad", [12, -3])
def test_choose_tracked_without_validation_names_the_stream_the_id_and_the_vocabulary(bad):
    streams = Streams({"src": "x"}, 10, max_tracked_tokens=2, validate_args=False)
    streams.of = {"attn": ("src", "src")}
    batches = [{"x": torch.tensor([[1, 2, bad]])}]
    with pytest.raises(ValueError, match=f"Token id {bad} of stream 'src' is outside the vocabulary \\[0, 10\\)"):
        streams.choose_tracked([batches], [1], _OneProcess())


# ------------------------------------------------------------------------------------------ short reprs in errors


def test_streams_tracked_ids_error_cuts_a_long_list_of_bad_ids():
    with pytest.raises(ValueError, match="`tracked_ids` to hold ids in \\[0, 10\\).*but got \\[10, 11, 12") as error:
        Streams("x", 10, tracked_ids=list(range(10, 10_000)))
    assert len(str(error.value)) < 300


def test_streams_sink_ids_error_cuts_a_long_list_of_bad_ids():
    streams = Streams("x", 10, sink_ids=list(range(10, 10_000)))
    with pytest.raises(ValueError, match="`sink_ids` has id\\(s\\) \\[10, 11, 12") as error:
        streams.check_sinks()
    assert len(str(error.value)) < 300


def test_streams_uint64_ids_past_int64_match_no_ignore_id_and_are_refused_as_they_are():
    ids = torch.tensor([[2**64 - 100, 5]], dtype=torch.uint64)  # -100 once wrapped to int64
    assert _read(Streams("x", 10, ignore_ids=[-100], validate_args=False), ids)[1].tolist() == [[True, True]]
    with pytest.raises(ValueError, match=f"Token id {2**64 - 100} of stream 'tokens' is outside"):
        _read(Streams("x", 10, ignore_ids=[-100]), ids)


def test_streams_say_when_a_label_list_and_the_vocabulary_differ_in_length(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        Streams("x", 12, id_to_token=["a", "b"])
        Streams("x", 2, id_to_token=["a", "b", "c"])
        Streams("x", 2, id_to_token=["a", "b"])  # as many: nothing to say
    said = [record.getMessage() for record in caplog.records if "id_to_token" in record.getMessage()]
    assert said == [
        "AttentionMonitor: argument `id_to_token` has 2 labels for the 12 ids of stream 'tokens' (`vocab_size`): "
        "ids from 2 on are shown as numbers",
        "AttentionMonitor: argument `id_to_token` has 3 labels for the 2 ids of stream 'tokens' (`vocab_size`): "
        "labels from 2 on are never shown",
    ]
