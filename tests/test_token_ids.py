"""Token ids as a batch holds them: read from dicts, tuples, attributes and callables, checked against the vocabulary
in every integer dtype, and an iterator of the monitor's own over the validation loaders."""

import re
from collections import namedtuple

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from attn_callbacks.capture.token_ids import check_ids_in_range, own_iterator, read_mask, read_stream


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


def test_read_stream_key_of_a_tuple_batch_suggests_the_index_of_its_integer_tensors():
    """TensorDataset batches are lists: the default key "input_ids" cannot be read there, and the error says where
    the 2-D integer tensors are (not bool ones: a mask), or that an index is needed where there is none; a mask's
    argument gets no guess (a mask cannot be told from ids by its type)."""
    ids, labels = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long)
    mask = torch.ones(2, 3, dtype=torch.bool)
    hint = "pass the index of the ids instead of a key (the batch's 2-D integer tensors are at [2, 3]), or a callable"
    with pytest.raises(KeyError, match=re.escape(hint)):
        read_stream([torch.randn(2, 3), mask, ids, labels, torch.ones(2)], "s", "input_ids")
    with pytest.raises(KeyError, match=re.escape("type tuple; pass an index into the batch, or a callable")):
        read_stream((torch.randn(2, 3), mask), "s", "input_ids")
    with pytest.raises(KeyError, match=re.escape("type Tensor; pass a callable")):
        read_stream(ids, "s", "input_ids")
    with pytest.raises(KeyError, match=re.escape("`token_mask` (stream 's') from a batch of type list; pass an index "
                                                 "into the batch, or a callable")):  # fmt: skip
        read_mask([ids, mask], "s", "attention_mask", ids.shape)


def test_read_mask_is_true_at_nonzero_entries_of_bool_and_integer_masks_in_either_layout():
    mask = torch.tensor([[1, 1, 0], [2, 0, 0]])  # nonzero: a real token
    expected = [[True, True, False], [True, False, False]]
    assert read_mask({"m": mask}, "s", "m", torch.Size([2, 3])).tolist() == expected
    assert read_mask({"m": mask.bool()}, "s", "m", torch.Size([2, 3])).tolist() == expected
    seq_first = read_mask({"m": mask.T.to(torch.uint8)}, "s", "m", torch.Size([2, 3]), batch_first=False)
    assert seq_first.tolist() == expected
    assert read_mask({"p": mask == 0}, "s", lambda b: ~b["p"], torch.Size([2, 3])).tolist() == expected


def test_read_mask_errors_name_the_argument_the_stream_and_the_value():
    mask = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="`token_mask` to give a bool or integer tensor for stream 's'.*torch.float32"):
        read_mask({"m": mask.float()}, "s", "m", torch.Size([2, 3]))
    with pytest.raises(ValueError, match=r"mask of stream 's' \(argument `token_mask`\).*\(2, 3\), but got \(2, 4\)"):
        read_mask({"m": torch.ones(2, 4, dtype=torch.bool)}, "s", "m", torch.Size([2, 3]))
    with pytest.raises(ValueError, match=r"token mask of stream 's' to have shape \(B, L\), but got shape \(6,\)"):
        read_mask({"m": mask.flatten()}, "s", "m", torch.Size([2, 3]))
    with pytest.raises(KeyError, match=r"'attention_mask' of argument `token_mask` \(stream 's'\).*keys: \['m'\]"):
        read_mask({"m": mask}, "s", "attention_mask", torch.Size([2, 3]))
    with pytest.raises(RuntimeError, match="The `token_mask` callable for stream 's' raised"):
        read_mask({"m": mask}, "s", lambda b: b["nope"], torch.Size([2, 3]))


def test_check_ids_in_range_ignores_invalid_positions():
    ids = torch.tensor([[1, -100, 4]])
    check_ids_in_range(ids, ids != -100, 5, "s")
    with pytest.raises(ValueError, match="Token id 5 of stream 's' is outside the vocabulary \\[0, 5\\)"):
        check_ids_in_range(ids + 1, ids != -100, 5, "s")


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


def test_read_stream_missing_key_error_cuts_a_long_list_of_keys():
    batch = {f"key_{i}": None for i in range(5000)}
    with pytest.raises(KeyError, match="'y'.*stream 's'.*keys: \\['key_0', 'key_1'") as error:
        read_stream(batch, "s", "y")
    assert len(str(error.value)) < 400


def test_read_stream_error_of_a_raising_callable_cuts_its_message():
    def raises(batch):
        raise KeyError("x" * 10_000)

    with pytest.raises(RuntimeError, match="callable for stream 's' raised KeyError\\('xxx") as error:
        read_stream({}, "s", raises)
    assert len(str(error.value)) < 300


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
