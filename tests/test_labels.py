import numpy as np
import pytest

from attn_callbacks.base.labels import MAX_LABEL, OTHER_LABEL, label_tokens


class Tokenizer:
    """A tokenizer-like object: callable (text -> ids) like a real one, labels via ``convert_ids_to_tokens``, which
    gives None for an id it does not know (ids >= 100 here) and fails on a negative id, as a fast tokenizer does."""

    def __init__(self):
        self.calls = []

    def __call__(self, text):
        raise AssertionError("labels must come from convert_ids_to_tokens, not from calling the tokenizer")

    def convert_ids_to_tokens(self, ids):
        self.calls.append(list(ids))
        assert all(i >= 0 for i in ids), ids
        return [f"▁w{i}" if i < 100 else None for i in ids]


def test_label_tokens_without_labels_shows_the_ids():
    assert label_tokens([5, 0, -100]) == ["5", "0", "-100"]


def test_label_tokens_from_a_list_falls_back_to_the_id_out_of_range():
    assert label_tokens([1, 0, 2, -1], ["<pad>", "the"]) == ["the", "<pad>", "2", "-1"]  # -1 is no index from the end


def test_label_tokens_from_a_numpy_array_of_labels():
    assert label_tokens([2, 0, 3], np.array(["a", "b", "c"])) == ["c", "a", "3"]


def test_label_tokens_from_a_dict_falls_back_to_the_id():
    assert label_tokens([3, 4], {3: "cat", 9: "dog"}) == ["cat", "4"]


def test_label_tokens_from_a_callable_converts_its_result_to_text():
    assert label_tokens([2, 7], lambda i: i * 10) == ["20", "70"]


def test_label_tokens_from_a_tokenizer_calls_it_once_with_the_known_ids():
    tokenizer = Tokenizer()
    assert label_tokens([3, -100, 150, 0], tokenizer) == ["▁w3", "-100", "150", "▁w0"]
    assert tokenizer.calls == [[3, 150, 0]]  # negative ids never reach it; None (unknown) shows the id


def test_label_tokens_from_a_tokenizer_with_only_negative_ids():
    tokenizer = Tokenizer()
    assert label_tokens([-1, -2], tokenizer) == ["-1", "-2"]
    assert tokenizer.calls == [[]]


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("x" * MAX_LABEL, "x" * MAX_LABEL),  # exactly the limit: whole
        ("x" * (MAX_LABEL + 1), "x" * (MAX_LABEL - 1) + "…"),
        ("a-very-long-word-piece", "a-very-long-w…"),
    ],
)
def test_label_tokens_trims_to_max_label_with_an_ellipsis(text, want):
    (got,) = label_tokens([0], [text])
    assert got == want and len(got) <= MAX_LABEL


def test_label_tokens_trims_to_a_given_max_length_or_keeps_whole_labels():
    assert label_tokens([0], ["abcdef"], max_length=4) == ["abc…"]
    assert label_tokens([0], ["abcdef"], max_length=1) == ["…"]
    assert label_tokens([0], ["x" * 40], max_length=None) == ["x" * 40]


def test_label_tokens_escapes_newlines_before_trimming():
    assert label_tokens([0, 1], ["\n", "a\nb"]) == ["\\n", "a\\nb"]
    assert label_tokens([0], ["abc\n"], max_length=4) == ["abc…"]  # "abc\\n" is 5 characters


def test_label_tokens_shows_an_empty_label_as_its_repr():
    assert label_tokens([0, 1], ["", " "]) == ["''", " "]
    assert label_tokens([0], {0: ""}) == ["''"]


def test_other_label_is_a_short_label_of_its_own():
    assert label_tokens([0], [OTHER_LABEL]) == [OTHER_LABEL] and len(OTHER_LABEL) <= MAX_LABEL
