"""Reporter: its checkpointed state and its background writer, called directly."""

from attn_callbacks.capture.probe import Probe
from attn_callbacks.capture.streams import Streams
from attn_callbacks.metrics.drift_memory import DriftMemory
from attn_callbacks.output.report import Reporter


def reporter(**kwargs):
    streams = Streams("input_ids", 10, None, [0], True, True, (), None, None)
    options = dict(per_head=True, top_k=5, num_pairs=3, min_support=1, entropy_collapse_threshold=0.1)
    options.update(color_scale="shared", **kwargs)
    return Reporter(streams, DriftMemory(), Probe(), **options)


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
