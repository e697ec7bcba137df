"""Write the compatibility data that tests/test_compat.py reads: what attn_callbacks 0.1.0 saved and logged.

Run it with the 0.1.0 code first on the path (a worktree of the commit), from anywhere:

    PYTHONPATH=/path/to/0.1.0/worktree python tests/data/make_data.py

(or set ``ATTN_CALLBACKS_SOURCE=/path/to/0.1.0/worktree``, which this script puts first on ``sys.path``). It refuses
to run with another version. CPU only, deterministic, a few seconds. It writes, next to itself:

- ``v0_1_0.ckpt``: ``Trainer.save_checkpoint`` after 2 epochs of the run in ``compat_model.py`` (model, optimizer,
  loops and the AttentionMonitor state: previous and reference drift snapshots, tracked ids, probe ids, colour
  limits, the validation epoch count);
- ``epoch=0000-step=4.pt``: the callback's own export (``export="pt"``) of epoch 0;
- ``epoch=0001-step=8.npz``: epoch 1, exported by the callback and written again as ``.npz`` by ``save_epoch``;
- ``v0_1_0.json``: what the 0.1.0 code made of them: the checkpoint state, everything the run resumed from the
  checkpoint for one more epoch logged (scalars, with full float precision, image and text tags, the export file),
  what ``load_epoch`` reads from both exports and what ``python -m attn_callbacks compare`` prints for them.
"""

import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
if os.environ.get("ATTN_CALLBACKS_SOURCE"):
    sys.path.insert(0, os.environ["ATTN_CALLBACKS_SOURCE"])
sys.path.insert(0, str(HERE))

import lightning  # noqa: E402
import torch  # noqa: E402
from compat_model import (  # noqa: E402
    MONITOR_ARGS,
    STREAM,
    VOCAB,
    CompatEncoder,
    make_monitor,
    make_trainer,
    resume_val_loader,
    train_loader,
    val_loader,
)
from lightning.pytorch import seed_everything  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    IMAGES,
    SCALARS,
    TENSORS,
    EventAccumulator,
)

import attn_callbacks  # noqa: E402
from attn_callbacks import load_epoch, save_epoch  # noqa: E402
from attn_callbacks.__main__ import main  # noqa: E402

VERSION = "0.1.0"
CHECKPOINT, OLD_EXPORT, NEW_EXPORT, VALUES = (
    "v0_1_0.ckpt",
    "epoch=0000-step=4.pt",
    "epoch=0001-step=8.npz",
    "v0_1_0.json",
)
CLI_ARGS = ["--min-support", "2", "--per-head"]


def state_summary(state):
    """The AttentionMonitor state as JSON: epochs, ids and colour limits as they are, the drift snapshots' keys and
    shapes (their values are checked through the drift the resumed run logs)."""
    return {
        "version": state["version"],
        "previous_epoch": state["previous_epoch"],
        "reference_epoch": state["reference_epoch"],
        "validation_epochs": state["validation_epochs"],
        "previous": {m: {k: list(t.shape) for k, t in s.items()} for m, s in state["previous"].items()},
        "reference": {m: {k: list(t.shape) for k, t in s.items()} for m, s in state["reference"].items()},
        "probe_ids": {s: t.tolist() for s, t in state["probe_ids"].items()},
        "tracked_ids": {s: t.tolist() for s, t in state["tracked_ids"].items()},
        "color_limits": dict(state["color_limits"]),
    }


def export_summary(path):
    record = load_epoch(path)
    return {
        "epoch": record.epoch,
        "global_step": record.global_step,
        "streams": {m: list(pair) for m, pair in record.streams.items()},
        "labels": record.labels,
        "modules": {
            name: {
                "attention_sum_shape": list(stats.attention_sum.shape),
                "attention_sum": stats.attention_sum.tolist(),
                "pair_count": stats.pair_count.tolist(),
                "query_count": stats.query_count.tolist(),
                "skipped_rows": int(stats.skipped_rows),
                "uniform_sum_total": float(stats.uniform_sum.double().sum()),
                "position_sums": stats.position_sums.tolist(),
            }
            for name, stats in record.modules.items()
        },
    }


def recounted_tracked_ids(loader, k, sinks):
    """The ids that counting ``loader`` would track (sinks first, then by count, ties to the smaller id)."""
    counts = torch.zeros(VOCAB, dtype=torch.long)
    for batch in loader:
        ids = batch["input_ids"].flatten()
        counts += torch.bincount(ids[~torch.isin(ids, torch.tensor(MONITOR_ARGS["ignore_ids"]))], minlength=VOCAB)
    counts[sinks] = -1
    order = torch.sort(counts, descending=True, stable=True).indices
    return [*sinks, *order[counts[order] > 0][: k - len(sinks)].tolist()]


def main_() -> None:
    source = Path(attn_callbacks.__file__).resolve().parent
    print(f"attn_callbacks {attn_callbacks.__version__} from {source}")
    if attn_callbacks.__version__ != VERSION:
        sys.exit(f"expected attn_callbacks {VERSION}: put its worktree first on PYTHONPATH")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # 1. Two epochs; the checkpoint and the callback's exports.
        seed_everything(0)
        monitor = make_monitor()
        first = make_trainer(tmp, monitor, TensorBoardLogger(tmp, name="first"), max_epochs=2)
        first.fit(CompatEncoder(), train_loader(), val_loader())
        first.save_checkpoint(HERE / CHECKPOINT)
        exports = Path(first.logger.log_dir) / "attention_epochs"
        assert sorted(p.name for p in exports.iterdir()) == [OLD_EXPORT, "epoch=0001-step=8.pt"]
        shutil.copyfile(exports / OLD_EXPORT, HERE / OLD_EXPORT)
        epoch1 = load_epoch(exports / "epoch=0001-step=8.pt")
        save_epoch(
            HERE / NEW_EXPORT,
            epoch1.modules,
            streams=epoch1.streams,
            labels=epoch1.labels,
            epoch=epoch1.epoch,
            global_step=epoch1.global_step,
        )
        os.chmod(HERE / NEW_EXPORT, 0o644)  # save_epoch's temporary file is private
        checkpoint = torch.load(HERE / CHECKPOINT, weights_only=True)
        saved = checkpoint["callbacks"][monitor.state_key]
        assert saved["previous_epoch"] == 1 and saved["reference_epoch"] == 0 and saved["probe_ids"]
        assert saved["color_limits"] and saved["validation_epochs"] == 2

        # 2. Resumed from the checkpoint for epoch 2, on a validation set whose counts would track other ids.
        seed_everything(0)
        resumed_monitor = make_monitor()
        resumed = make_trainer(tmp, resumed_monitor, TensorBoardLogger(tmp, name="resumed"), max_epochs=3)
        resumed.fit(CompatEncoder(), train_loader(), resume_val_loader(), ckpt_path=HERE / CHECKPOINT)
        recounted = recounted_tracked_ids(resume_val_loader(), MONITOR_ARGS["max_tracked_tokens"], [1])
        assert recounted != saved["tracked_ids"][STREAM].tolist(), "the resumed data must not pick the same ids"
        assert resumed_monitor.state_dict()["tracked_ids"][STREAM].tolist() == saved["tracked_ids"][STREAM].tolist()
        metrics = {tag: float(value) for tag, value in resumed.callback_metrics.items() if tag.startswith("attention")}
        events = EventAccumulator(resumed.logger.log_dir, size_guidance={IMAGES: 0, SCALARS: 0, TENSORS: 0})
        events.Reload()
        tags = events.Tags()
        scalars = {}
        for tag in tags["scalars"]:
            if tag.startswith("attention"):
                [event] = events.Scalars(tag)  # one monitored epoch
                scalars[tag] = {"step": event.step, "value": event.value}
        js_prev = metrics["attention_drift/js_prev/encoder.layers.0.self_attn"]
        js_ref = metrics["attention_drift/js_ref/encoder.layers.0.self_attn"]
        assert 0 < js_prev != js_ref > 0, (js_prev, js_ref)
        resumed_exports = sorted(p.name for p in (Path(resumed.logger.log_dir) / "attention_epochs").iterdir())

        # 3. The command line on the two exports.
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            status = main(["compare", str(HERE / OLD_EXPORT), str(HERE / NEW_EXPORT), *CLI_ARGS])
        assert status == 0
        stdout = out.getvalue().replace(str(HERE / OLD_EXPORT), "{old}").replace(str(HERE / NEW_EXPORT), "{new}")

    values = {
        "generated_with": {"attn_callbacks": VERSION, "torch": torch.__version__, "lightning": lightning.__version__},
        "checkpoint": {
            "file": CHECKPOINT,
            "state_key": monitor.state_key,
            "epoch": checkpoint["epoch"],
            "global_step": checkpoint["global_step"],
            "state": state_summary(saved),
        },
        "resumed": {
            "max_epochs": 3,
            "state": state_summary(resumed_monitor.state_dict()),
            "tracked_ids_if_recounted": recounted,
            "callback_metrics": metrics,
            "scalars": scalars,
            "images": sorted(tags["images"]),
            "texts": sorted(tag for tag in tags["tensors"] if tag.startswith("attention")),
            "exports": resumed_exports,
        },
        "exports": {name: export_summary(HERE / name) for name in (OLD_EXPORT, NEW_EXPORT)},
        "cli_compare": {"old": OLD_EXPORT, "new": NEW_EXPORT, "args": CLI_ARGS, "stdout": stdout},
    }
    (HERE / VALUES).write_text(json.dumps(values, indent=1, sort_keys=True) + "\n")
    for name in (CHECKPOINT, OLD_EXPORT, NEW_EXPORT, VALUES):
        print(f"wrote {HERE / name} ({(HERE / name).stat().st_size:,} bytes)")


if __name__ == "__main__":
    main_()
