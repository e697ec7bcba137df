"""Reporter: its warnings, its checkpointed state and its background writer, called directly."""

import warnings

from attn_callbacks.capture.probe import Probe
from attn_callbacks.capture.streams import Streams
from attn_callbacks.metrics.drift_memory import DriftMemory
from attn_callbacks.output.report import Reporter


def reporter(**kwargs):
    streams = Streams("input_ids", 10, None, [0], True, True, (), None, None)
    options = dict(per_head=True, top_k=5, num_pairs=3, min_support=1, entropy_collapse_threshold=0.1)
    options.update(color_scale="shared", **kwargs)
    return Reporter(streams, DriftMemory(), Probe(), **options)


def caught(action):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        action()
    return [str(w.message) for w in seen]


def test_report_warns_of_silent_modules_once_per_set_of_names():
    report = reporter()
    messages = caught(lambda: [report.warn_silent(["a", "b"], 3) for _ in range(2)])
    assert len(messages) == 1 and "'a', 'b' were hooked for 3 monitored batch(es) but never ran" in messages[0]
    assert caught(lambda: report.warn_silent(["a"], 0)) == []  # no batch ran: nothing could have run
    assert caught(lambda: report.warn_silent([], 3)) == []
    assert len(caught(lambda: report.warn_silent(["a"], 1))) == 1  # another set of names


def test_report_says_why_an_epoch_has_nothing_to_log():
    report = reporter()
    assert "no batch ran" in caught(lambda: report.warn_nothing_seen(0, some_module_ran=False))[0]
    assert "every id in `ignore_ids`?" in caught(lambda: report.warn_nothing_seen(2, some_module_ran=True))[0]
    assert caught(lambda: report.warn_nothing_seen(2, some_module_ran=True)) == []  # once
    assert caught(lambda: reporter().warn_nothing_seen(2, some_module_ran=False)) == []  # silent modules said so


def test_report_state_round_trips_the_shared_colour_limits():
    report = reporter()
    report.images.limits = {"attention_mass/enc": 0.75}
    state = report.state_dict()
    report.images.limits["attention_mass/enc"] = 1.0  # the state is a copy
    other = reporter()
    other.load_state_dict(state)
    assert other.images.limits == {"attention_mass/enc": 0.75}
    other.load_state_dict({})  # a checkpoint without limits
    assert other.images.limits == {}


def test_report_close_drops_the_pending_images_of_a_failed_epoch_end():
    report, done = reporter(), []
    report.background.submit(lambda: done.append(1))
    report.close()
    report.close()  # nothing runs: a no-op
    assert done in ([], [1])  # the job in progress may finish; the worker is gone either way
    report.background.submit(lambda: done.append(2))
    report.background.finish()
    assert done[-1] == 2
