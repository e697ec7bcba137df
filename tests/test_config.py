import os
import pathlib
import re

import numpy as np
import pytest

from attn_callbacks.base import config


def _message(name, value):
    """The part every argument error shares: the argument's name and the bad value's repr."""
    return re.escape(f"`{name}`") + ".*" + re.escape(f"but got {value!r}")


@pytest.mark.parametrize("value", [1, 7, 10**12])
def test_positive_int_returns_the_value(value):
    assert config.positive_int("top_k", value) == value


@pytest.mark.parametrize("value", [0, -3, 2.0, "3", True, None])
def test_positive_int_names_the_argument_and_the_bad_value(value):
    with pytest.raises(ValueError, match=_message("top_k", value)) as error:
        config.positive_int("top_k", value)
    assert "a positive integer" in str(error.value)


def test_positive_int_with_a_minimum_says_which():
    assert config.positive_int("num_pairs", 0, minimum=0) == 0
    with pytest.raises(ValueError, match=re.escape("`num_pairs` to be an integer >= 0, but got -1")):
        config.positive_int("num_pairs", -1, minimum=0)


def test_int_list_sorts_and_drops_repeats():
    assert config.int_list("ignore_ids", (5, 0, 5, -100)) == [-100, 0, 5]
    assert config.int_list("ignore_ids", []) == []


@pytest.mark.parametrize("value", [3, "12", [1, 2.0], [True]])
def test_int_list_names_the_argument_and_the_bad_value(value):
    with pytest.raises(ValueError, match=_message("ignore_ids", value)):
        config.int_list("ignore_ids", value)


@pytest.mark.parametrize("value", [None, 2.5])
def test_int_list_names_the_argument_for_a_non_iterable_value(value):
    with pytest.raises(ValueError, match=_message("ignore_ids", value)):
        config.int_list("ignore_ids", value)


def test_flag_accepts_python_and_numpy_bools_only():
    assert config.flag("log_heads", True) is True and config.flag("log_heads", np.bool_(False)) is False
    for value in ("False", "no", 0, 1, None):
        with pytest.raises(ValueError, match=_message("log_heads", value) + "$") as error:
            config.flag("log_heads", value)
        assert "True or False" in str(error.value)


def test_non_empty_str_rejects_empty_and_non_strings():
    assert config.non_empty_str("prefix", "attention") == "attention"
    for value in ("", None, 3):
        with pytest.raises(ValueError, match=_message("prefix", value)):
            config.non_empty_str("prefix", value)


@pytest.mark.parametrize(("value", "want"), [(0, 0.0), (1, 1.0), (0.25, 0.25), (np.float64(0.5), 0.5)])
def test_unit_interval_returns_a_float(value, want):
    got = config.unit_interval("entropy_collapse_threshold", value)
    assert type(got) is float and got == want


@pytest.mark.parametrize("value", [-0.01, 1.5, True, float("nan"), "0.5", None])
def test_unit_interval_names_the_argument_and_the_bad_value(value):
    with pytest.raises(ValueError, match=_message("entropy_collapse_threshold", value)) as error:
        config.unit_interval("entropy_collapse_threshold", value)
    assert "[0, 1]" in str(error.value)


def test_check_choice_lists_the_choices_and_the_bad_value():
    assert config.check_choice("export", None, ("pt", "npz", None)) is None
    with pytest.raises(ValueError) as error:
        config.check_choice("export", "csv", ("pt", "npz", None))
    assert str(error.value) == "Expected argument `export` to be 'pt', 'npz' or None, but got 'csv'"


def test_check_path_accepts_str_pathlike_and_none():
    path = pathlib.Path("runs")
    assert config.check_path("export_dir", path) is path and config.check_path("export_dir", "r") == "r"
    assert config.check_path("export_dir", None) is None
    with pytest.raises(ValueError, match=_message("export_dir", 5)):
        config.check_path("export_dir", 5)


def test_check_patterns_copies_a_sequence_to_a_list():
    assert config.check_patterns("modules", ("enc.*", "dec.0")) == ["enc.*", "dec.0"]
    assert config.check_patterns("modules", None) is None


@pytest.mark.parametrize("value", ["enc.*", ["enc.*", 3]])
def test_check_patterns_names_the_argument_and_the_bad_value(value):
    with pytest.raises(ValueError, match=_message("modules", value)):
        config.check_patterns("modules", value)


def test_check_patterns_names_the_argument_for_a_non_iterable_value():
    with pytest.raises(ValueError, match=_message("modules", 5)):
        config.check_patterns("modules", 5)


def test_check_attention_streams_gives_tuples_and_none_for_empty():
    got = config.check_attention_streams({"dec.*.multihead_attn": ["tgt", "src"]})
    assert got == {"dec.*.multihead_attn": ("tgt", "src")}
    assert config.check_attention_streams(None) is None and config.check_attention_streams({}) is None


@pytest.mark.parametrize(
    "value", [[("a", "b")], {"x": "ab"}, {"x": ("a",)}, {"x": ("a", "b", "c")}, {"x": ("a", 1)}, {1: ("a", "b")}]
)
def test_check_attention_streams_names_the_argument_and_the_bad_value(value):
    with pytest.raises(ValueError, match=_message("attention_streams", value)):
        config.check_attention_streams(value)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("1GiB", 2**30),
        ("1.5 GiB", 3 * 2**29),
        ("512MB", 512 * 10**6),
        ("512 mb", 512 * 10**6),
        ("2e9", 2 * 10**9),
        ("10 B", 10),
        ("3kib", 3 * 1024),
        ("7kB", 7000),
        ("2TiB", 2 * 2**40),
        ("1tb", 10**12),
        (4096, 4096),
        (1.5e3, 1500),
    ],
)
def test_parse_bytes_reads_numbers_and_units(text, want):
    got = config.parse_bytes("memory_budget", text)
    assert type(got) is int and got == want


@pytest.mark.parametrize("value", ["", "GiB", "1k", "lots", "-1GiB", "0.5", 0, -5, True, None, float("inf"), "nan"])
def test_parse_bytes_names_the_argument_and_the_bad_value(value):
    with pytest.raises(ValueError, match=_message("memory_budget", value)) as error:
        config.parse_bytes("memory_budget", value)
    assert "positive number of bytes" in str(error.value)


def test_parse_bytes_rounds_a_whole_number_of_bytes_exactly():
    assert config.parse_bytes("memory_budget", "4.1GB") == 4_100_000_000


@pytest.mark.parametrize(
    ("size", "want"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (3 * 2**30, "3.0 GiB"), (2**50, "1024.0 TiB")],
)
def test_format_bytes_uses_binary_units_with_one_decimal(size, want):
    assert config.format_bytes(size) == want


def test_format_bytes_inverts_parse_bytes_on_binary_units():
    for text in ("1.5 KiB", "12.0 MiB", "2.5 GiB"):
        assert config.format_bytes(config.parse_bytes("memory_budget", text)) == text


def test_check_picklable_names_the_argument_that_cannot_be_pickled():
    config.check_picklable(token_ids="input_ids", id_to_token=["a", "b"])
    with pytest.raises(TypeError, match=re.escape("argument `token_ids` cannot be pickled")) as error:
        config.check_picklable(id_to_token=["a"], token_ids=lambda batch: batch)
    assert "ddp_spawn" in str(error.value) and error.value.__cause__ is not None


def _first(batch):
    return batch[0]


def test_stream_getters_normalises_to_a_mapping():
    assert config.stream_getters("input_ids") == {config.DEFAULT_STREAM: "input_ids"}
    assert config.stream_getters({"src": 0, "tgt": _first}) == {"src": 0, "tgt": _first}


@pytest.mark.parametrize(
    ("value", "part"),
    [({}, "empty mapping"), ({1: "ids"}, "but got 1"), (True, "but got True"), ({"src": 2.5}, "got 2.5 for stream")],
)
def test_stream_getters_names_the_argument_and_the_bad_value(value, part):
    with pytest.raises(ValueError, match=re.escape("`token_ids`") + ".*" + re.escape(part)):
        config.stream_getters(value)


def test_per_stream_spreads_a_value_or_checks_each_mapping_entry():
    streams = ["src", "tgt"]
    assert config.per_stream("top_k", 3, streams, config.positive_int) == {"src": 3, "tgt": 3}
    assert config.per_stream("top_k", {"tgt": 4}, streams, config.positive_int) == {"tgt": 4}
    assert config.per_stream("top_k", {"tgt": 4}, streams, config.positive_int, default=2) == {"src": 2, "tgt": 4}
    with pytest.raises(ValueError, match=re.escape("`top_k` to be a positive integer, but got 0")):
        config.per_stream("top_k", {"src": 0}, streams, config.positive_int)
    with pytest.raises(ValueError, match=re.escape("Argument `top_k` names unknown stream(s) ['memory']")):
        config.per_stream("top_k", {"memory": 1}, streams, config.positive_int)


def test_resolve_vocab_sizes_per_stream_in_stream_order():
    assert config.resolve_vocab_sizes(9, ["a", "b"]) == {"a": 9, "b": 9}
    assert list(config.resolve_vocab_sizes({"b": 2, "a": 5}, ["a", "b"]).items()) == [("a", 5), ("b", 2)]


@pytest.mark.parametrize(
    ("value", "part"),
    [
        (-3, "positive integer, but got -3"),
        ({"a": 5}, "no entry for stream(s) ['b']"),
        ({"a": 5, "b": 2, "c": 1}, "names stream(s) ['c']"),
        ({"a": 5, "b": 0}, "positive integer for stream 'b', but got 0"),
    ],
)
def test_resolve_vocab_sizes_names_the_argument_and_the_bad_value(value, part):
    with pytest.raises(ValueError, match=re.escape("`vocab_size`") + ".*" + re.escape(part)):
        config.resolve_vocab_sizes(value, ["a", "b"])


class _Tokenizer:
    def convert_ids_to_tokens(self, ids):
        return [f"w{i}" for i in ids]


def test_labels_per_stream_shares_or_splits_the_labels():
    tokenizer, labels = _Tokenizer(), {0: "<pad>", 1: "the"}
    assert config.labels_per_stream(labels, ["src", "tgt"]) == {"src": labels, "tgt": labels}
    assert config.labels_per_stream({"tgt": tokenizer}, ["src", "tgt"]) == {"src": None, "tgt": tokenizer}
    assert config.labels_per_stream(None, ["src"]) == {"src": None}


@pytest.mark.parametrize(
    ("value", "part"),
    [
        ({"src": None, 7: "x"}, "unknown stream(s) [7]"),
        ({"the": 1}, "keys ['the']"),
        ("abc", "but got 'abc'"),
        ({"src": 5}, "for stream 'src' to be a sequence of labels"),
    ],
)
def test_labels_per_stream_names_the_argument_and_the_bad_value(value, part):
    with pytest.raises(ValueError, match=re.escape("`id_to_token`") + ".*" + re.escape(part)):
        config.labels_per_stream(value, ["src", "tgt"])


def test_check_path_accepts_an_os_pathlike():
    class Where(os.PathLike):
        def __fspath__(self):
            return "x"

    where = Where()
    assert config.check_path("export_dir", where) is where


# ------------------------------------------------------------------------------------------------------ short_repr
def test_short_repr_keeps_a_short_repr_whole():
    assert config.short_repr([1, 2]) == "[1, 2]" and config.short_repr("abc") == "'abc'"
    assert config.short_repr("x" * 78) == repr("x" * 78)  # 80 characters: the limit


def test_short_repr_cuts_a_long_repr_and_says_how_long_the_value_is():
    text = config.short_repr(list(range(10_000)))
    assert text.startswith("[0, 1, 2, 3,") and "…" in text and text.endswith("(list of length 10000)")
    assert len(text.split("…")[0]) == 79  # the repr's first 79 characters, then the ellipsis
    assert config.short_repr("x" * 200, limit=10) == "'xxxxxxxx… (str of length 200)"


def test_short_repr_of_an_object_whose_repr_fails_names_its_type():
    class Broken:
        def __repr__(self):
            raise RuntimeError("no repr")

    assert config.short_repr(Broken()) == "<Broken object>"


class _HugeRepr:
    """Like a tokenizers.Tokenizer: a repr listing its whole vocabulary."""

    def __repr__(self):
        return "Huge(vocab={" + ", ".join(f'"w{i}": {i}' for i in range(30_000)) + "})"


_HUGE, _LONG_TEXT, _LONG_LIST = _HugeRepr(), "x" * 10_000, [0.5] * 10_000


@pytest.mark.parametrize(
    "check",
    [
        lambda: config.positive_int("top_k", _LONG_TEXT),
        lambda: config.int_list("ignore_ids", _LONG_LIST),
        lambda: config.flag("log_heads", _HUGE),
        lambda: config.non_empty_str("prefix", _HUGE),
        lambda: config.unit_interval("threshold", _LONG_TEXT),
        lambda: config.check_choice("mode", _LONG_TEXT, ["a", "b"]),
        lambda: config.check_patterns("modules", [_HUGE]),
        lambda: config.check_attention_streams({"x": _LONG_LIST}),
        lambda: config.check_path("export_dir", _HUGE),
        lambda: config.parse_bytes("memory_budget", _LONG_TEXT),
        lambda: config.stream_getters({"src": _HUGE}),
        lambda: config.stream_getters({tuple(range(5000)): 0}),
        lambda: config.resolve_vocab_sizes({"a": _HUGE}, ["a"]),
        lambda: config.resolve_vocab_sizes({f"s{i}": 1 for i in range(5000)}, ["a"]),
        lambda: config.per_stream("sink_ids", {f"s{i}": [] for i in range(5000)}, ["a"], config.int_list),
        lambda: config.labels_per_stream(_HUGE, ["src"]),
        lambda: config.labels_per_stream({_LONG_TEXT: 1}, ["src"]),
    ],
    ids=[
        "positive_int",
        "int_list",
        "flag",
        "non_empty_str",
        "unit_interval",
        "check_choice",
        "check_patterns",
        "check_attention_streams",
        "check_path",
        "parse_bytes",
        "stream_getters-source",
        "stream_getters-name",
        "resolve_vocab_sizes-size",
        "resolve_vocab_sizes-streams",
        "per_stream-streams",
        "labels_per_stream-object",
        "labels_per_stream-keys",
    ],
)
def test_config_errors_show_a_short_repr_of_the_bad_value(check):
    with pytest.raises(ValueError) as error:
        check()
    assert len(str(error.value)) < 400, str(error.value)[:500]


def test_labels_per_stream_refusal_names_the_type_not_the_whole_repr():
    with pytest.raises(ValueError, match="`id_to_token` to be .* but got Huge\\(vocab=.*… \\(_HugeRepr") as error:
        config.labels_per_stream(_HUGE, ["src"])
    assert len(str(error.value)) < 400


def test_labels_per_stream_accepts_a_tokenizers_tokenizer():
    import tokenizers

    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<pad>": 0, "the": 1}, unk_token="<pad>"))
    assert config.labels_per_stream(tokenizer, ["src"]) == {"src": tokenizer}
    assert config.labels_per_stream({"tgt": tokenizer}, ["src", "tgt"]) == {"src": None, "tgt": tokenizer}


# ------------------------------------------------------------------------------------------ numpy numbers as values
def test_int_list_takes_numpy_integers_as_python_ints():
    got = config.int_list("ignore_ids", np.array([5, -100, 5]))
    assert got == [-100, 5] and all(type(i) is int for i in got)
    assert config.int_list("sink_ids", [np.int32(3), 1]) == [1, 3]


def test_int_list_still_refuses_numpy_floats_and_bools():
    for value in ([np.float64(1.0)], [np.bool_(True)]):
        with pytest.raises(ValueError, match=re.escape("`ignore_ids` to be a sequence of integers")):
            config.int_list("ignore_ids", value)


def test_positive_int_and_vocab_sizes_take_numpy_integers_as_python_ints():
    got = config.positive_int("top_k", np.int64(7))
    assert got == 7 and type(got) is int
    sizes = config.resolve_vocab_sizes({"a": np.int64(30522), "b": 4}, ["a", "b"])
    assert sizes == {"a": 30522, "b": 4} and type(sizes["a"]) is int
    with pytest.raises(ValueError, match="positive integer for stream 'a', but got np.int64\\(0\\)"):
        config.resolve_vocab_sizes({"a": np.int64(0), "b": 4}, ["a", "b"])


def test_unit_interval_and_parse_bytes_take_numpy_numbers():
    assert config.unit_interval("threshold", np.float32(0.25)) == 0.25
    assert config.parse_bytes("memory_budget", np.int64(2048)) == 2048
    with pytest.raises(ValueError, match=re.escape("`threshold` to be in [0, 1], but got np.float64(nan)")):
        config.unit_interval("threshold", np.float64("nan"))
    with pytest.raises(ValueError, match=re.escape("`memory_budget` to be a positive number of bytes")):
        config.parse_bytes("memory_budget", 10**400)  # past float's range: no OverflowError
