"""AttentionMonitor end to end, images: the probe maps, the shared colour scale, the events add_image writes and
the background writer."""

import copy
import io
import pickle

import numpy as np
import pytest
import torch
from _callback_helpers import (
    PAD,
    VOCAB,
    Recorder,
    Seq2Seq,
    TinyEncoder,
    collate,
    loaders,
    make_batches,
    no_hooks,
    run_validate,
    saved_and_loaded,
    trainer,
)
from _reference import SAME_SUMS, spying
from lightning.pytorch import seed_everything
from lightning.pytorch.loggers import TensorBoardLogger
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import IMAGES, TENSORS, EventAccumulator
from torch.utils.data import DataLoader

from attn_callbacks import AttentionMonitor, capture_attention, load_epoch


class ProbeRecorder(AttentionMonitor):
    """Keeps the probe weights each epoch renders."""

    def on_validation_epoch_end(self, trainer, pl_module):
        self.probes = getattr(self, "probes", [])

        def keep(name, *args):
            self.probes.append((name, self._probe.weights.get(name)))

        with spying(self._report, "_probe_maps", keep):
            super().on_validation_epoch_end(trainer, pl_module)


def test_callback_probe_first_batch_is_frozen_and_equals_the_models_attention(tmp_path):
    seed_everything(0)
    monitor = ProbeRecorder(VOCAB, "input_ids", ignore_ids=[PAD], probe="first", probe_samples=2)
    model = TinyEncoder()
    train, val = loaders()
    t = trainer(tmp_path, [monitor], num_sanity_val_steps=0)
    t.fit(model, train, val)
    events = EventAccumulator(t.logger.log_dir, size_guidance={IMAGES: 0})
    events.Reload()
    for sample in range(2):
        assert len(events.Images(f"attention_probe/encoder.layers.1.self_attn/sample_{sample}")) == 2
    frozen = make_batches(seed=1)[0]["input_ids"][:2]
    assert torch.equal(monitor.state_dict()["probe_ids"]["tokens"], frozen)
    with torch.no_grad(), capture_attention(model.eval(), ["encoder.layers.1.self_attn"]) as weights:
        model(frozen)
    name, last = monitor.probes[-1]
    assert name == "encoder.layers.1.self_attn"
    torch.testing.assert_close(last, weights[name][0], rtol=1e-5, atol=1e-6)


def test_callback_probe_first_warns_when_the_validation_loader_shuffles(tmp_path):
    seed_everything(0)
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], probe="first")
    train, _ = loaders()
    val = DataLoader(make_batches(seed=1), batch_size=1, collate_fn=collate, shuffle=True)
    with pytest.warns(UserWarning, match="no longer starts with the frozen probe samples"):
        trainer(tmp_path, [monitor], num_sanity_val_steps=0, max_epochs=4).fit(TinyEncoder(), train, val)


def test_callback_probe_batch_with_probe_forward_does_not_touch_the_sums(tmp_path):
    g = torch.Generator().manual_seed(0)
    batches = [{"src": torch.randint(0, 7, (3, 5), generator=g), "tgt": torch.randint(0, 9, (3, 4), generator=g)}]
    probe = {"src": torch.tensor([[1, 2, 3]]), "tgt": torch.tensor([[4, 5]])}
    results = []
    for kwargs in ({}, {"probe": probe, "probe_forward": lambda module, batch: module.validation_step(batch, 0)}):
        seed_everything(0)
        monitor = Recorder({"src": 7, "tgt": 9}, {"src": "src", "tgt": "tgt"}, **kwargs)
        t = trainer(tmp_path, [monitor])
        t.validate(Seq2Seq(), DataLoader(batches, batch_size=None), verbose=False)
        results.append((monitor.last, t))
    (plain, _), (probed, t) = results
    for name, stats in plain.items():
        torch.testing.assert_close(stats.attention_sum, probed[name].attention_sum, **SAME_SUMS, msg=name)
    events = EventAccumulator(t.logger.log_dir, size_guidance={IMAGES: 0})
    events.Reload()
    image = events.Images("attention_probe/transformer.decoder.layers.0.multihead_attn/sample_0")[0]
    assert Image.open(io.BytesIO(image.encoded_image_string)).width > 200


def test_callback_shared_colour_scale_is_largest_value_drawn_so_far_and_checkpointed(tmp_path):
    seed_everything(0)
    monitor = AttentionMonitor(
        VOCAB, "input_ids", ignore_ids=[PAD], top_k=VOCAB, color_scale="shared", export="pt", per_head=True
    )
    train, val = loaders()
    trainer(tmp_path, [monitor], max_epochs=3).fit(TinyEncoder(), train, val)
    limits = monitor.state_dict()["color_limits"]
    layer = "encoder.layers.1.self_attn"
    tops, head_tops, asymmetry_tops = [], [], []
    for path in sorted(tmp_path.rglob("*.pt")):  # the exported epochs: an independent record of what was drawn
        stats = load_epoch(path).modules[layer]
        seen = stats.query_count > 0  # heatmaps show the tokens seen as queries (top_k covers all)
        heads = stats.attention_mass[:, seen][:, :, seen].double()
        tops.append(float(heads.mean(0).max()))
        head_tops.append(float(heads.max()))
        asymmetry_tops.append(float((heads.mean(0) - heads.mean(0).T).abs().max()))
    assert len(tops) == 3
    # Each top: the largest value drawn, rounded up to the next of 1, 1.2, 1.4, 1.6, 2, 2.4, 3, 4, 5, 6, 8 x 10^k.
    tops_allowed = sorted(m * 10.0**k for k in range(-4, 2) for m in (1, 1.2, 1.4, 1.6, 2, 2.4, 3, 4, 5, 6, 8))
    for family, top in (("mass", tops), ("mass_heads", head_tops), ("asymmetry_map", asymmetry_tops)):
        want = next(t for t in tops_allowed if t >= max(top) * (1 - 1e-5))
        assert limits[f"attention_{family}/{layer}"] == pytest.approx(want, rel=1e-9), family
    restored = AttentionMonitor(VOCAB, "input_ids", color_scale="shared")
    restored.load_state_dict(saved_and_loaded(monitor.state_dict()))
    assert restored.state_dict()["color_limits"] == limits
    per_epoch = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD])
    trainer(tmp_path / "b", [per_epoch], max_epochs=1).fit(TinyEncoder(), train, val)
    assert per_epoch.state_dict()["color_limits"] == {}
    with pytest.raises(ValueError, match="`color_scale` to be 'epoch' or 'shared', but got 'fixed'"):
        AttentionMonitor(VOCAB, "input_ids", color_scale="fixed")


def test_callback_images_are_the_events_add_image_writes_other_writers_get_add_image(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    from attn_callbacks.output.writer import add_image as _add_image

    image = np.random.default_rng(0).integers(0, 256, (37, 53, 3), dtype=np.uint8)
    rgba = np.concatenate([image, np.full((37, 53, 1), 255, dtype=np.uint8)], axis=-1)  # what the canvas holds
    for name, write in (
        ("ours", lambda w: _add_image(w, "img", image, 3)),
        ("ours_rgba", lambda w: _add_image(w, "img", rgba, 3)),
        ("stock", lambda w: w.add_image("img", image, 3, dataformats="HWC")),
    ):
        with SummaryWriter(tmp_path / name) as writer:
            write(writer)
    read = {}
    for name in ("ours", "ours_rgba", "stock"):
        events = EventAccumulator(str(tmp_path / name), size_guidance={IMAGES: 0})
        events.Reload()
        (event,) = events.Images("img")
        read[name] = (
            event.step,
            event.width,
            event.height,
            np.asarray(Image.open(io.BytesIO(event.encoded_image_string))),
        )
    assert read["ours"][:3] == read["ours_rgba"][:3] == read["stock"][:3] == (3, 53, 37)
    for name in ("ours", "ours_rgba", "stock"):
        assert np.array_equal(read[name][3], image), name

    class OtherWriter:  # tensorboardX's SummaryWriter, say: its own protobuf classes
        def __init__(self):
            self.calls = []

        def add_image(self, *args, **kwargs):
            self.calls.append((args, kwargs))

    other = OtherWriter()
    _add_image(other, "img", rgba, 3)
    ((tag, written, step), kwargs), *more = other.calls
    assert (tag, step, kwargs, more) == ("img", 3, {"dataformats": "HWC"}, [])
    assert np.array_equal(written, image)  # RGB: the alpha channel left out


def test_callback_images_encoded_by_a_worker_thread_whose_errors_reach_the_caller(tmp_path, monkeypatch):
    import threading

    import attn_callbacks.output.writer as callback_module

    written_by = []
    original = callback_module.png_bytes

    def spy(*args):
        written_by.append(threading.current_thread().name)
        return original(*args)

    def workers():
        return [t for t in threading.enumerate() if t.name.startswith("attn_callbacks-images")]

    monkeypatch.setattr(callback_module, "png_bytes", spy)
    model = TinyEncoder()
    logger = TensorBoardLogger(tmp_path, name="tb")
    # Drawn in this process (the GPU default draws in a background process, whose writes the spy cannot see).
    monitor = AttentionMonitor(VOCAB, "input_ids", draw_in_background=False)
    trainer(tmp_path, [monitor], logger=logger).validate(model, loaders()[1])
    events = EventAccumulator(logger.log_dir, size_guidance={IMAGES: 0})
    events.Reload()
    # Every picture was encoded, each by the worker (and written once the epoch end succeeded); the worker is gone.
    assert len(written_by) == len(events.Tags()["images"]) > 0
    assert all(name.startswith("attn_callbacks-images") for name in written_by)
    assert workers() == []

    def broken(*args):
        raise RuntimeError("encoding failed")

    monkeypatch.setattr(callback_module, "png_bytes", broken)
    with pytest.raises(RuntimeError, match="encoding failed"):
        trainer(tmp_path, [AttentionMonitor(VOCAB, "input_ids", draw_in_background=False)]).validate(
            model, loaders()[1]
        )
    assert no_hooks(model) and workers() == []


def test_callback_interrupted_wait_for_writer_thread_stops_it_and_drops_the_rest(tmp_path, monkeypatch):
    import threading
    import time

    import attn_callbacks.output.writer as callback_module

    monitor = AttentionMonitor(VOCAB, "input_ids")
    started, done = threading.Event(), []

    def slow(name, seconds=1.0):
        started.set()
        time.sleep(seconds)
        done.append(name)

    # Drawing may outrun encoding: at most MAX_PENDING pictures wait, the oldest are waited for.
    for k in range(3 * callback_module.MAX_PENDING):
        monitor._report.background.submit(lambda k=k: slow(k, 0.01))
        assert sum(not job.done() for job in monitor._report.background._jobs) <= callback_module.MAX_PENDING
    monitor._report.background.finish()
    assert done == list(range(3 * callback_module.MAX_PENDING))
    started.clear()
    done.clear()

    monitor._report.background.submit(lambda: slow("first"))
    for name in ("second", "third"):
        monitor._report.background.submit(lambda name=name: slow(name))
    assert started.wait(5)
    real_shutdown = callback_module.ThreadPoolExecutor.shutdown
    calls = []

    def interrupted_once(self, wait=True, *, cancel_futures=False):
        calls.append(cancel_futures)
        if len(calls) == 1:
            raise KeyboardInterrupt  # Ctrl+C while the hook waits for the writer
        return real_shutdown(self, wait=wait, cancel_futures=cancel_futures)

    monkeypatch.setattr(callback_module.ThreadPoolExecutor, "shutdown", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        monitor._report.background.finish()
    # The job in progress finished, the queued ones were dropped, and no worker is left.
    assert calls == [False, True] and done == ["first"]
    assert not [t for t in threading.enumerate() if t.name.startswith("attn_callbacks-images")]
    assert monitor._report.background._pool is None and monitor._report.background._jobs == []
    pickle.dumps(monitor)  # nothing of the thread is carried
    copy.deepcopy(monitor)


def test_callback_draws_labels_decoded_from_bytes_with_surrogateescape(tmp_path):
    # a byte-level model's lossless labels: bytes 0x80.. alone are no UTF-8, so they decode to lone surrogates
    labels = [bytes([0x80 + i]).decode("utf-8", "surrogateescape") for i in range(VOCAB)]
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], id_to_token=labels, top_k=4)
    run_validate(tmp_path, monitor, make_batches())
    events = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={IMAGES: 0, TENSORS: 0})
    events.Reload()
    assert "attention_mass/encoder.layers.0.self_attn" in events.Tags()["images"]
    table = events.Tensors("attention_hubs/encoder.layers.0.self_attn/text_summary")[0].tensor_proto.string_val[0]
    assert b"\\x8" in table  # the escapes, not the bytes
