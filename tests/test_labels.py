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


def _word_level_tokenizer(words):
    """A real ``tokenizers.Tokenizer`` built in memory (no files, no network): one id per word."""
    import tokenizers

    vocab = {word: i for i, word in enumerate(words)}
    return tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=words[-1]))


def test_label_tokens_from_a_tokenizers_tokenizer_uses_its_id_to_token():
    tokenizer = _word_level_tokenizer(["<pad>", "the", "cat", "[UNK]"])
    assert not hasattr(tokenizer, "convert_ids_to_tokens") and not callable(tokenizer)
    # unknown (7) and negative ids (its id_to_token overflows on them) show the id
    assert label_tokens([2, 0, 7, -100, 3], tokenizer) == ["cat", "<pad>", "7", "-100", "[UNK]"]


def test_label_tokens_from_a_tokenizers_tokenizer_trims_long_labels():
    tokenizer = _word_level_tokenizer(["a-very-long-word-piece", "[UNK]"])
    assert label_tokens([0], tokenizer) == ["a-very-long-w…"]
    assert label_tokens([0], tokenizer, max_length=None) == ["a-very-long-word-piece"]


def test_label_tokens_shows_the_id_for_a_none_label():
    assert label_tokens([0, 1], ["a", None]) == ["a", "1"]
    assert label_tokens([0, 1], {0: None, 1: "b"}) == ["0", "b"]
    assert label_tokens([4, 5], lambda i: None if i == 4 else "x") == ["4", "x"]


def test_label_tokens_from_a_tokenizers_id_to_token_method_shows_the_id_where_it_has_none():
    tokenizer = _word_level_tokenizer(["<pad>", "the", "[UNK]"])
    assert label_tokens([1, 9, -1], tokenizer.id_to_token) == ["the", "9", "-1"]  # None and OverflowError: the id


class SlowTokenizer:
    """Like a sentencepiece-based slow tokenizer: ``convert_ids_to_tokens`` raises IndexError for an id it lacks."""

    def convert_ids_to_tokens(self, ids):
        return [["<s>", "▁a", "▁b"][i] if 0 <= i < 3 else self._raise(i) for i in ids]

    @staticmethod
    def _raise(i):
        raise IndexError("piece id is out of range.")


def test_label_tokens_from_a_tokenizer_that_raises_for_unknown_ids_shows_those_ids():
    assert label_tokens([2, 5, 0], SlowTokenizer()) == ["▁b", "5", "<s>"]


def test_label_tokens_names_id_to_token_and_the_id_when_its_callable_fails():
    def broken(i):
        raise TypeError("x" * 10_000)

    with pytest.raises(RuntimeError, match="`id_to_token` raised TypeError\\('xxx.*for token id 3") as error:
        label_tokens([3], broken)
    assert len(str(error.value)) < 300


def test_label_tokens_writes_undrawable_surrogates_as_escapes_only_where_shown():
    byte_labels = [bytes([b]).decode("utf-8", "surrogateescape") for b in (0x41, 0xFF)]  # "A", then a lone surrogate
    assert label_tokens([0, 1], byte_labels) == ["A", "\\xff"]
    assert label_tokens([0], ["a\ud800b"]) == ["a\\ud800b"]
    assert label_tokens([1], byte_labels, max_length=None) == [byte_labels[1]]  # whole labels stay lossless
