"""AttentionMonitor's argument checks: bad constructor arguments and batches, a misconfigured model,
pickling for ddp_spawn."""

import copy
import pickle
from pathlib import PurePosixPath

import numpy as np
import pytest
import torch
from _callback_helpers import LENGTH, VOCAB, TinyEncoder, make_batches, no_hooks, run_validate, trainer
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from attn_callbacks import AttentionMonitor


@pytest.mark.parametrize(
    ("kwargs", "batches", "error", "match"),
    [
        ({}, [{"input_ids": torch.full((2, LENGTH), VOCAB)}], ValueError, f"Token id {VOCAB} of stream 'tokens'"),
        ({}, [{"input_ids": torch.full((2, LENGTH), -3)}], ValueError, "Token id -3 .*outside the vocabulary"),
        ({}, [{"input_ids": torch.ones(2, LENGTH)}], ValueError, "integer token ids for stream 'tokens'.*float32"),
        (
            {},
            [{"other": torch.ones(2, LENGTH, dtype=torch.long)}],
            KeyError,
            "Batch key 'input_ids'.*keys: \\['other'\\]",
        ),
        (
            {"token_ids": lambda b: b["input_ids"][:, :-1]},
            [{"input_ids": torch.ones(2, LENGTH, dtype=torch.long)}],
            ValueError,
            "module 'encoder.layers.0.self_attn'.*\\(2, 2, 6, 6\\).*\\(2, 5\\)",
        ),
        ({}, [{"input_ids": torch.ones(2, LENGTH, 1, dtype=torch.long)}], ValueError, "\\(B, L\\).*\\(2, 6, 1\\)"),
        ({}, [{"input_ids": torch.ones(2, LENGTH, dtype=torch.bool)}], ValueError, "integer token ids.*torch.bool"),
        ({}, [{"input_ids": [[1, 2]]}], ValueError, "to give a Tensor for stream 'tokens', but got list"),
        (
            {"token_ids": lambda b: b["missing"]},
            [{"input_ids": torch.ones(2, LENGTH, dtype=torch.long)}],
            RuntimeError,
            "The `token_ids` callable for stream 'tokens' raised KeyError\\('missing'\\)",
        ),
        (
            {"token_ids": 3},
            [(torch.ones(2, LENGTH, dtype=torch.long),)],
            KeyError,
            "Batch index 3 of argument `token_ids`.*batch of 1 items",
        ),
    ],
)
def test_callback_bad_batch_input_raises_clear_error(tmp_path, kwargs, batches, error, match):
    monitor = AttentionMonitor(VOCAB, **{"token_ids": "input_ids", **kwargs})
    model = TinyEncoder()
    with pytest.raises(error, match=match):
        run_validate(tmp_path, monitor, batches, model)
    assert no_hooks(model) and torch.backends.mha.get_fastpath_enabled()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"vocab_size": 0}, "`vocab_size` to be a positive integer, but got 0"),
        ({"vocab_size": -3}, "`vocab_size` to be a positive integer, but got -3"),
        ({"vocab_size": {"src": 5}, "token_ids": {"src": "a", "tgt": "b"}}, "`vocab_size` has no entry for .*'tgt'"),
        ({"vocab_size": 5, "token_ids": 3.5}, "`token_ids`.*but got 3.5"),
        ({"vocab_size": 5, "top_k": 0}, "`top_k` to be a positive integer, but got 0"),
        ({"vocab_size": 5, "ignore_ids": [0.5]}, "`ignore_ids`.*\\[0.5\\]"),
        ({"vocab_size": 5, "log_every_n_epochs": -1}, "`log_every_n_epochs`.*-1"),
        ({"vocab_size": {"tokens": 5, "tgt": 3}}, "`vocab_size` names stream\\(s\\) \\['tgt'\\] that argument"),
        ({"vocab_size": True}, "`vocab_size` to be a positive integer, but got True"),
        ({"vocab_size": 5, "modules": "encoder.*"}, "`modules` to be a list of fnmatch patterns, but got 'encoder"),
        ({"vocab_size": 5, "prefix": ""}, "`prefix` to be a non-empty string, but got ''"),
        ({"vocab_size": 5, "probe_samples": 0}, "`probe_samples` to be a positive integer, but got 0"),
        ({"vocab_size": 5, "per_head": "False"}, "`per_head` to be True or False, but got 'False'"),
        ({"vocab_size": 5, "batch_first": None}, "`batch_first` to be True or False, but got None"),
        ({"vocab_size": 5, "validate_args": 0}, "`validate_args` to be True or False, but got 0"),
        ({"vocab_size": 5, "id_to_token": 5}, "`id_to_token` to be a sequence of labels.*but got 5"),
        ({"vocab_size": 5, "id_to_token": "abc"}, "`id_to_token` to be a sequence of labels.*but got 'abc'"),
        (
            {"vocab_size": 5, "id_to_token": {f"w{i}": i for i in range(100)}},  # get_vocab(): token -> id
            "`id_to_token` maps ids to labels.*keys \\['w0', 'w1', 'w2', 'w3', 'w4'\\] \\(a tokenizer's get_vocab",
        ),
        (
            {
                "vocab_size": {"src": 5, "tgt": 5},
                "token_ids": {"src": "s", "tgt": "t"},
                "id_to_token": {"src": ["x"], "target": ["y"]},
            },
            "`id_to_token` names unknown stream\\(s\\) \\['target'\\]",
        ),
        (
            {"vocab_size": 5, "id_to_token": {1: "a", "b": "c"}},
            "`id_to_token` maps ids to labels, so its keys must be integer ids, but it has keys \\['b'\\]",
        ),
        (
            {"vocab_size": {"src": 5}, "token_ids": {"src": "s"}, "id_to_token": {"src": {"the": 1}}},
            "`id_to_token` for stream 'src' maps ids to labels.*keys \\['the'\\].*get_vocab",
        ),
        ({"vocab_size": 5, "export_dir": 5}, "`export_dir` to be a path \\(str or Path\\) or None, but got 5"),
        (
            {"vocab_size": 5, "attention_streams": ["x"]},
            "`attention_streams` to map module name patterns.*but got \\['x'\\]",
        ),
        (
            {"vocab_size": 5, "attention_streams": {"*": "src"}},
            "`attention_streams` to map.*but got \\{'\\*': 'src'\\}",
        ),
        ({"vocab_size": 5, "token_mask": 2.5}, "`token_mask` to be a batch key.*but got 2.5 for stream 'tokens'"),
        (
            {"vocab_size": 5, "token_ids": {"src": "s", "tgt": "t"}, "token_mask": "attention_mask"},
            "`token_mask` to be a mapping stream name -> batch key or callable, as `token_ids` defines streams",
        ),
        ({"vocab_size": 5, "memory_budget": 0.5}, "`memory_budget` to be a positive number of bytes.*but got 0.5"),
    ],
)
def test_callback_bad_arguments_raise_naming_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AttentionMonitor(**kwargs)


def test_callback_accepts_numpy_and_path_like_arguments():
    labels = np.array([f"tok{i}" for i in range(VOCAB)])
    monitor = AttentionMonitor(VOCAB, "input_ids", id_to_token=labels, per_head=np.bool_(False))
    assert monitor.per_head is False and monitor._streams.label([3], "tokens") == ["tok3"]
    monitor = AttentionMonitor(VOCAB, "input_ids", id_to_token={np.int64(3): "three"}, export_dir=PurePosixPath("x"))
    assert monitor._streams.label([3, 4], "tokens") == ["three", "4"]


class BareModel(LightningModule):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def validation_step(self, batch, batch_idx):
        pass


def test_callback_misconfigured_model_fails_in_setup_naming_module(tmp_path):
    with pytest.raises(
        MisconfigurationException,
        match="No torch.nn.MultiheadAttention, Hugging Face attention module, module calling "
        "scaled_dot_product_attention or module computing attention by hand .a softmax and a matrix product. "
        "found in the model",
    ):
        run_validate(
            tmp_path, AttentionMonitor(VOCAB), [{"input_ids": torch.ones(1, 2, dtype=torch.long)}], BareModel()
        )
    two_streams = AttentionMonitor({"a": VOCAB, "b": VOCAB}, {"a": "input_ids", "b": "input_ids"})
    with pytest.raises(MisconfigurationException, match="No token stream for attention module 'encoder.layers.0"):
        run_validate(tmp_path, two_streams, make_batches())
    unknown = AttentionMonitor(VOCAB, "input_ids", attention_streams={"*": ("tokens", "nope")})
    with pytest.raises(MisconfigurationException, match="unknown stream\\(s\\) \\['nope'\\]"):
        run_validate(tmp_path, unknown, make_batches())
    no_match = AttentionMonitor(VOCAB, "input_ids", modules=["decoder.*"])
    with pytest.raises(MisconfigurationException, match="Pattern 'decoder.\\*' in argument `modules` matched no "):
        run_validate(tmp_path, no_match, make_batches())
    not_attention = AttentionMonitor(VOCAB, "input_ids", modules=["head"])
    with pytest.raises(MisconfigurationException, match="Pattern 'head'.*only modules that are not attention modules"):
        run_validate(tmp_path, not_attention, make_batches())


def test_callback_rejects_bad_insight_arguments():
    with pytest.raises(ValueError, match="`probe` to be 'first', a batch or None, but got 'last'"):
        AttentionMonitor(VOCAB, probe="last")
    with pytest.raises(ValueError, match="needs argument `probe_forward`"):
        AttentionMonitor(VOCAB, probe={"input_ids": torch.ones(1, 2, dtype=torch.long)})
    with pytest.raises(ValueError, match="`export` to be 'pt', 'npz' or None, but got 'csv'"):
        AttentionMonitor(VOCAB, export="csv")
    with pytest.raises(ValueError, match="`entropy_collapse_threshold` to be in \\[0, 1\\], but got 2"):
        AttentionMonitor(VOCAB, entropy_collapse_threshold=2)
    with pytest.raises(ValueError, match="`sink_ids` names unknown stream\\(s\\) \\['nope'\\]"):
        AttentionMonitor(VOCAB, sink_ids={"nope": [0]})
    with pytest.raises(ValueError, match="`drift_reference_epoch` to be an integer >= 0, but got -1"):
        AttentionMonitor(VOCAB, drift_reference_epoch=-1)
    with pytest.raises(MisconfigurationException, match="`sink_ids` has id\\(s\\) \\[99\\] outside the vocabulary"):
        AttentionMonitor(VOCAB, sink_ids=[99]).setup(None, TinyEncoder(), "fit")


def test_callback_options_that_ddp_spawn_cannot_pickle_raise_naming_the_argument():
    monitor = AttentionMonitor(VOCAB, token_ids=lambda batch: batch["input_ids"])
    with pytest.raises(TypeError, match="argument `token_ids` cannot be pickled.*ddp_spawn"):
        pickle.dumps(monitor)
    assert (
        copy.deepcopy(monitor)._streams.getters.keys() == monitor._streams.getters.keys()
    )  # deep copies need no pickling
    assert pickle.loads(pickle.dumps(AttentionMonitor(VOCAB, "input_ids")))._streams.vocab == {"tokens": VOCAB}
    with pytest.raises(TypeError, match="argument `token_mask` cannot be pickled.*ddp_spawn"):
        pickle.dumps(AttentionMonitor(VOCAB, token_mask=lambda batch: batch["input_ids"] > 0))


@pytest.mark.parametrize(
    "first, second, clash",
    [
        ({"monitor_test": True}, {"prefix": "attention_test"}, "attention_test"),
        ({}, {"modules": ["encoder.layers.0.*"]}, "attention"),
    ],
)
def test_two_monitors_writing_the_same_tags_are_refused_at_setup(tmp_path, first, second, clash):
    monitors = [AttentionMonitor(VOCAB, "input_ids", **first), AttentionMonitor(VOCAB, "input_ids", **second)]
    with pytest.raises(MisconfigurationException, match=f"would both write the tags of prefix '{clash}'"):
        trainer(tmp_path, monitors).validate(TinyEncoder(), make_batches(), verbose=False)
