import pickle
from collections import namedtuple

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from attn_callbacks.base.config import resolve_vocab_sizes, stream_getters
from attn_callbacks.capture.streams import Streams, check_ids_in_range, own_iterator, read_stream
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


@pytest.mark.parametrize(
    ("dtype", "values", "vocab_size", "bad"),
    [
        (torch.uint8, [0, 255], 256, None),
        (torch.uint8, [3, 250], 200, 250),
        (torch.int8, [127, -5], 128, -5),
        (torch.int16, [300, -2], 301, -2),
        (torch.int32, [2**31 - 1, 4], 2**31 - 1, 2**31 - 1),
        (torch.uint16, [65535, 1], 65536, None),
        (torch.uint32, [2**32 - 1, 1], 2**32, None),
        (torch.uint64, [2**64 - 1, 1], 10, 2**64 - 1),  # not -1: the id as the batch holds it
    ],
)
def test_check_ids_in_range_compares_every_integer_dtype_without_wrapping(dtype, values, vocab_size, bad):
    ids = torch.tensor([values], dtype=dtype)
    valid = torch.ones(ids.shape, dtype=torch.bool)
    if bad is None:
        check_ids_in_range(ids, valid, vocab_size, "s")
    else:
        with pytest.raises(
            ValueError, match=f"Token id {bad} of stream 's' is outside the vocabulary \\[0, {vocab_size}\\)"
        ):
            check_ids_in_range(ids, valid, vocab_size, "s")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.complex64, torch.bool])
def test_read_stream_refuses_float_complex_and_bool_ids_naming_the_stream(dtype):
    with pytest.raises(ValueError, match=f"integer token ids for stream 'src', but got dtype {dtype}"):
        read_stream({"x": torch.zeros(2, 3, dtype=dtype)}, "src", "x")


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


@pytest.mark.parametrize("bad", [12, -3])
def test_choose_tracked_without_validation_names_the_stream_the_id_and_the_vocabulary(bad):
    streams = Streams({"src": "x"}, 10, max_tracked_tokens=2, validate_args=False)
    streams.of = {"attn": ("src", "src")}
    batches = [{"x": torch.tensor([[1, 2, bad]])}]
    with pytest.raises(ValueError, match=f"Token id {bad} of stream 'src' is outside the vocabulary \\[0, 10\\)"):
        streams.choose_tracked([batches], [1], _OneProcess())


# ------------------------------------------------------------------------------------------ short reprs in errors
def test_read_stream_missing_key_error_cuts_a_long_list_of_keys():
    batch = {f"key_{i}": None for i in range(5000)}
    with pytest.raises(KeyError, match="'y'.*stream 's'.*keys: \\['key_0', 'key_1'") as error:
        read_stream(batch, "s", "y")
    assert len(str(error.value)) < 400


def test_streams_tracked_ids_error_cuts_a_long_list_of_bad_ids():
    with pytest.raises(ValueError, match="`tracked_ids` to hold ids in \\[0, 10\\).*but got \\[10, 11, 12") as error:
        Streams("x", 10, tracked_ids=list(range(10, 10_000)))
    assert len(str(error.value)) < 300


def test_streams_sink_ids_error_cuts_a_long_list_of_bad_ids():
    streams = Streams("x", 10, sink_ids=list(range(10, 10_000)))
    with pytest.raises(ValueError, match="`sink_ids` has id\\(s\\) \\[10, 11, 12") as error:
        streams.check_sinks()
    assert len(str(error.value)) < 300


def test_read_stream_error_of_a_raising_callable_cuts_its_message():
    def raises(batch):
        raise KeyError("x" * 10_000)

    with pytest.raises(RuntimeError, match="callable for stream 's' raised KeyError\\('xxx") as error:
        read_stream({}, "s", raises)
    assert len(str(error.value)) < 300


def test_streams_uint64_ids_past_int64_match_no_ignore_id_and_are_refused_as_they_are():
    ids = torch.tensor([[2**64 - 100, 5]], dtype=torch.uint64)  # -100 once wrapped to int64
    assert _read(Streams("x", 10, ignore_ids=[-100], validate_args=False), ids)[1].tolist() == [[True, True]]
    with pytest.raises(ValueError, match=f"Token id {2**64 - 100} of stream 'tokens' is outside"):
        _read(Streams("x", 10, ignore_ids=[-100]), ids)


class Counting(IterableDataset):
    def __iter__(self):
        return iter(range(5))


def test_own_iterator_leaves_a_persistent_workers_iterator_undisturbed():
    loader = DataLoader(TensorDataset(torch.arange(6)), batch_size=2, num_workers=1, persistent_workers=True)
    running = iter(loader)
    first = next(running)
    assert [batch[0].tolist() for batch in own_iterator(loader)] == [[0, 1], [2, 3], [4, 5]]
    assert first[0].tolist() == [0, 1] and next(running)[0].tolist() == [2, 3]  # went on where it was
    assert [b[0].tolist() for b in own_iterator(loader)] == [[0, 1], [2, 3], [4, 5]]  # a new pass each time


def test_own_iterator_keeps_iterable_and_unbatched_loaders_batches():
    iterable = DataLoader(Counting(), batch_size=2, drop_last=True, num_workers=1, persistent_workers=True)
    assert [batch.tolist() for batch in own_iterator(iterable)] == [[0, 1], [2, 3]]
    unbatched = DataLoader(TensorDataset(torch.arange(3)), batch_size=None, num_workers=1, persistent_workers=True)
    assert [int(sample[0]) for sample in own_iterator(unbatched)] == [0, 1, 2]
    plain = [[0, 1], [2]]  # anything iterable, as a batch limit or a plain list of batches
    assert list(own_iterator(plain)) == plain
