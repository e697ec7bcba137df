"""Warnings: each said once per key, with what was seen and why."""

import functools
import warnings

import torch
from torch import nn

from attn_callbacks.output.warn import Warnings


def caught(action):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        action()
    return [str(w.message) for w in seen]


def test_warnings_warns_of_silent_modules_once_per_set_of_names():
    said = Warnings(0.1)
    messages = caught(lambda: [said.silent(["a", "b"], 3) for _ in range(2)])
    assert len(messages) == 1 and "'a', 'b' were hooked for 3 monitored batch(es) but never ran" in messages[0]
    assert caught(lambda: said.silent(["a"], 0)) == []  # no batch ran: nothing could have run
    assert caught(lambda: said.silent([], 3)) == []
    assert len(caught(lambda: said.silent(["a"], 1))) == 1  # another set of names


def test_warnings_says_why_an_epoch_has_nothing_to_log():
    said = Warnings(0.1)
    assert "no batch ran" in caught(lambda: said.nothing_seen(0, some_module_read=False))[0]
    (why,) = caught(lambda: said.nothing_seen(2, some_module_read=True))
    assert "every id in `ignore_ids`, or masked by `token_mask`?" in why
    assert caught(lambda: said.nothing_seen(2, some_module_read=True)) == []  # once
    assert caught(lambda: Warnings(0.1).nothing_seen(2, some_module_read=False)) == []  # silent modules said so


def test_warnings_on_generate_count_the_calls_and_say_what_was_not_seen():
    """Calls left out inside ``generate`` methods: counted and named with the methods; the modules that ran nowhere
    else are named; a step that ran nothing outside them is told that nothing was seen."""
    calls = {"enc.0": 4, "enc.1": 4, "dec.0": 6}
    methods = ["OwnStep.generate", "T5ForConditionalGeneration.generate"]
    (read,) = caught(lambda: Warnings(0.1).generated(calls, methods, [], outside=True))
    assert read.startswith(
        "AttentionMonitor: 14 call(s) of attention module(s) 'enc.0', 'enc.1' and 1 more made inside "
        "`OwnStep.generate` or `T5ForConditionalGeneration.generate` in monitored batches were not read"
    )
    assert read.endswith("runs on the batch itself.")
    (partly,) = caught(lambda: Warnings(0.1).generated(calls, methods[1:], ["dec.0"], outside=True))
    assert partly.endswith("; nothing was seen of 'dec.0', which ran inside it only.")
    said = Warnings(0.1)
    (none,) = caught(lambda: said.generated(calls, methods[:1], list(calls), outside=False))
    assert "it ran none outside `OwnStep.generate`, so nothing was seen" in none
    assert caught(lambda: said.generated(calls, methods[:1], [], outside=True)) == []  # once
    assert caught(lambda: Warnings(0.1).generated({}, [], [], outside=True)) == []


def test_warnings_name_each_collapsed_head_once_and_the_skipped_rows():
    said = Warnings(0.2)
    messages = caught(lambda: said.health("enc.0", torch.tensor([0.5, 0.1, 0.05]), skipped_rows=0))
    assert [m.split(" of attention")[0] for m in messages] == ["AttentionMonitor: head 1", "AttentionMonitor: head 2"]
    assert "normalised entropy 0.100 < entropy_collapse_threshold=0.2" in messages[0]
    assert caught(lambda: said.health("enc.0", torch.tensor([0.5, 0.1, 0.05]), skipped_rows=0)) == []  # once
    (skipped,) = caught(lambda: said.health("enc.0", None, skipped_rows=7))
    assert "7 query rows of attention module 'enc.0'" in skipped
    assert caught(lambda: Warnings(0.0).health("enc.0", torch.tensor([0.0]), skipped_rows=0)) == []  # 0: off


def test_warnings_say_which_kept_epochs_drift_cannot_compare_against():
    (message,) = caught(lambda: Warnings(0).incomparable("enc", (2, 5, 5), [(3, (2, 4, 4)), (0, (2, 4, 4))]))
    assert "'enc' now gives P of shape (2, 5, 5)" in message
    assert "another (epoch 3: (2, 4, 4), epoch 0: (2, 4, 4))" in message


def test_warnings_name_the_first_module_whose_rows_do_not_sum_to_1_once():
    """Rows of valid queries only (a padded query's row and an all-zero or NaN row do not count), checked once per
    module, said once for the model: learned sinks leave each row short of 1."""
    softmax = torch.softmax(torch.randn(2, 3, 4, 5, dtype=torch.float64), dim=-1)
    valid = torch.tensor([[True, True, True, False], [True, True, False, False]])
    sinks = softmax * torch.linspace(0.6, 0.9, 4, dtype=torch.float64)[:, None]  # row i keeps 0.6 ... 0.9
    sinks[0, :, 3] = softmax[0, :, 3]  # a padded query: its row does not count
    sinks[1, 0, 0] = 0.0  # an all-zero row (dropped from the sums): does not count
    sinks[1, 1, 0] = float("nan")
    said = Warnings(0.1)
    padded = softmax.clone()
    padded[0, :, 3] = 0.25  # a padded query's row, summing to 1.25: not a valid query, not looked at
    assert caught(lambda: said.row_mass("ok", padded, valid)) == []
    (first,) = caught(lambda: said.row_mass("sinks", sinks, valid))
    assert "module 'sinks' sum to 0.6–0.8 over the keys of a row, not 1" in first and "gpt-oss" in first
    assert caught(lambda: said.row_mass("more", sinks * 0.5, valid)) == []  # said once for the model
    assert caught(lambda: Warnings(0.1).row_mass("ok", sinks, torch.zeros(2, 4, dtype=torch.bool))) == []
    (over,) = caught(lambda: Warnings(0.1).row_mass("over", softmax * 1.02, valid))
    assert "sum to 1.02–1.02" in over
    assert caught(lambda: Warnings(0.1).row_mass("fine", softmax.float(), valid)) == []  # float32 rounding


def test_training_mode_names_a_module_with_dropout_once_and_its_rate():
    class Llamaish(nn.Module):  # a float rate, as Hugging Face's Llama keeps it
        attention_dropout = 0.3

    class Bertish(nn.Module):  # an nn.Dropout child, beside a float that is smaller
        def __init__(self):
            super().__init__()
            self.dropout, self.rate = nn.Dropout(0.25), 0.1

    class GPT2ish(nn.Module):  # no dropout on the weights, some on the output: nothing to say
        def __init__(self):
            super().__init__()
            self.attn_dropout, self.resid_dropout = nn.Dropout(0.0), nn.Dropout(0.1)

    said = Warnings(0.1)
    modules = {
        "mha": nn.MultiheadAttention(8, 2, dropout=0.2),
        "llama": Llamaish(),
        "bert": Bertish(),
        "none": nn.MultiheadAttention(8, 2),
        "gpt2": GPT2ish(),
    }
    for name, module in modules.items():
        messages = caught(functools.partial(said.training_mode, name, module))
        rate = {"mha": 0.2, "llama": 0.3, "bert": 0.25}.get(name)
        if rate is None:
            assert messages == [], name
        else:
            assert len(messages) == 1 and f"module {name!r} ran in training mode" in messages[0], name
            assert f"(p = {rate:g})" in messages[0], messages[0]
        assert caught(functools.partial(said.training_mode, name, module)) == []  # once per module
