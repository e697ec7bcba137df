"""End to end through the real ``tensorboard`` server: what a user sees after ``tensorboard --logdir``.

Trains ``examples/toy_translation.py`` for 2 epochs in a subprocess, starts ``python -m tensorboard.main`` on a free
port of 127.0.0.1 over that log directory, and reads its HTTP data API (the routes the dashboard itself calls) with
``urllib``. It checks that the server lists the run; that every expected ``attention_*`` scalar and image tag of the
six attention modules of the toy ``nn.Transformer`` is there (and that asymmetry and sink tags are left out where
they do not apply); that every callback tag has exactly one point per monitored validation epoch (2; drift tags only
from the second epoch, so 1), at the same steps as the model's own ``val_acc`` for scalars and at
``trainer.global_step`` for images; that an image (a heatmap, a head grid) served by
``/data/plugin/images/individualImage`` is a PNG; that no Scalars-tab section mixes per-head and layer charts; and
that every chart of the custom-scalars layout (``/data/plugin/custom_scalars/layout``) finds tags through the
plugin's own ``/scalars`` route, each per-head chart one module's heads, together covering every per-head tag.
The server is always terminated, and its log is in the failure message when it does not come up.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.tensorboard_server

ROOT = Path(__file__).parents[1]
EXAMPLE = ROOT / "examples" / "toy_translation.py"
RUN = "toy_translation/version_0"  # TensorBoardLogger(logdir, name="toy_translation"), first version
EPOCHS = 2
STEPS_PER_EPOCH = 32  # the example's 2048 training pairs in batches of 64: global_step at the end of epoch e is 32(e+1)
SERVER_TIMEOUT_S = 60.0
POLL_S = 0.25

# The example's nn.Transformer has 2 encoder and 2 decoder layers with 4 heads; every attention module is monitored.
HEADS = 4
ENCODER_SELF = [f"transformer.encoder.layers.{i}.self_attn" for i in range(2)]
DECODER_SELF = [f"transformer.decoder.layers.{i}.self_attn" for i in range(2)]
CROSS = [f"transformer.decoder.layers.{i}.multihead_attn" for i in range(2)]  # (tgt_out x src): rectangular
SQUARE = ENCODER_SELF + DECODER_SELF
MODULES = SQUARE + CROSS

MODEL_SCALARS = {"train_loss", "train_acc", "val_loss", "val_acc", "epoch"}  # the example's self.log + Lightning's


def _with_heads(tag: str) -> list[str]:
    """A layer tag and its per-head series, which live in the family's ``_heads`` section."""
    family, rest = tag.split("/", 1)
    return [tag, *(f"{family}_heads/{rest}/head_{h}" for h in range(HEADS))]


def expected_scalars() -> tuple[set[str], set[str]]:
    """(tags logged every monitored epoch, drift tags logged from the second one on)."""
    every: set[str] = set()
    for module in MODULES:
        every.add(f"attention_skipped_rows/{module}")
        for metric in ("entropy", "lift", *(f"position/{p}" for p in ("entropy", "entropy_normalized", "self"))):
            every.update(_with_heads(f"attention_{metric}/{module}"))
        for metric in ("previous", "next", "distance"):
            every.update(_with_heads(f"attention_position/{metric}/{module}"))
    for module in SQUARE:  # asymmetry needs query stream == key stream
        every.update(_with_heads(f"attention_asymmetry/{module}"))
    for module in DECODER_SELF:  # sink_ids={"tgt_in": [BOS]}: only modules whose keys are tgt_in tokens
        every.update(_with_heads(f"attention_position/sink_mass/{module}"))
    drift = {
        tag
        for module in MODULES
        for kind in ("js_prev", "js_ref", "frobenius_prev", "frobenius_ref")
        for tag in _with_heads(f"attention_drift/{kind}/{module}")
    }
    return every, drift


def expected_images() -> tuple[set[str], set[str]]:
    """(tags logged every monitored epoch, drift maps logged from the second one on)."""
    every = {f"attention_{kind}/{m}" for m in MODULES for kind in ("mass", "mass_heads", "lift_map")}
    every |= {f"attention_probe/{m}/sample_0" for m in MODULES}  # probe="first", probe_samples=1
    every |= {f"attention_asymmetry_map/{m}" for m in SQUARE}
    drift = {f"attention_drift_map/{m}" for m in MODULES}
    # One head grid per per-head metric (sink_mass: the decoder's self-attention has sink ids).
    position = ("entropy", "entropy_normalized", "self", "previous", "next", "distance", "sink_mass")
    every |= {f"attention_heads/{m}" for m in ("entropy", "asymmetry", "lift", *(f"position_{p}" for p in position))}
    drift |= {f"attention_heads/drift_{kind}_{which}" for kind in ("js", "frobenius") for which in ("prev", "ref")}
    return every, drift


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A ``tensorboard`` subprocess and GETs against its HTTP API."""

    def __init__(self, logdir: Path, log: Path) -> None:
        self.logdir, self.log = logdir, log
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self, run: str, deadline: float) -> None:
        """Start the server and poll ``/data/runs`` until it lists ``run``; if another process took the free port in the
        meantime, again on another one (3 tries). Fails with the server's output if it dies or times out."""
        for attempt in range(3):
            self.port = _free_port()
            with self.log.open("ab") as log:
                self.process = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "tensorboard.main",
                        f"--logdir={self.logdir}",
                        "--host=127.0.0.1",
                        f"--port={self.port}",
                        "--load_fast=false",  # the Python loader: no Rust data server child process
                        # Load the finished run once, before serving: once the server answers, all data is there.
                        "--reload_task=blocking",
                        "--reload_interval=0",
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                )
            if self._wait_for_run(run, deadline) or attempt == 2 or "could not bind" not in self.output():
                break
        if self.process.returncode is not None:
            pytest.fail(f"tensorboard exited with code {self.process.returncode}:\n{self.output()}")

    def _wait_for_run(self, run: str, deadline: float) -> bool:
        """True once ``/data/runs`` lists ``run``, False if the server exited."""
        last_error: object = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                runs = self.get_json("/data/runs")
                if run in runs:
                    return True
                last_error = f"runs listed: {runs}"
            except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError) as error:
                last_error = error
            time.sleep(POLL_S)
        pytest.fail(f"tensorboard did not serve {run!r} within {SERVER_TIMEOUT_S} s ({last_error}):\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def get(self, route: str, **query: str) -> bytes:
        url = f"http://127.0.0.1:{self.port}{route}"
        if query:
            url += "?" + urllib.parse.urlencode(query)
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read()

    def get_json(self, route: str, **query: str) -> object:
        return json.loads(self.get(route, **query))

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()  # tensorboard exits on SIGTERM
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


def _check_tags(kind: str, found: set[str], every: set[str], drift: set[str], absent: set[str]) -> None:
    missing = sorted((every | drift) - found)
    unexpected = sorted(absent & found)
    callback_tags = "\n  ".join(sorted(t for t in found if t.startswith("attention_")))
    assert not missing and not unexpected, (
        f"{kind} tags: missing {missing}, unexpected {unexpected}; the server lists:\n  {callback_tags}"
    )


def test_tensorboard_server_serves_the_toy_translation_run(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)  # this checkout
    logdir = tmp_path / "runs"
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--logdir", str(logdir), "--epochs", str(EPOCHS)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"{EXAMPLE.name} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"

    server = Server(logdir, tmp_path / "tensorboard.log")
    try:
        server.start(RUN, time.monotonic() + SERVER_TIMEOUT_S)
        assert server.get_json("/data/runs") == [RUN]

        scalar_tags = set(server.get_json("/data/plugin/scalars/tags")[RUN])
        image_tags = set(server.get_json("/data/plugin/images/tags")[RUN])

        every_scalar, drift_scalar = expected_scalars()
        assert not MODEL_SCALARS - scalar_tags, f"model scalars missing: {sorted(MODEL_SCALARS - scalar_tags)}"
        not_applicable = {
            *(tag for m in CROSS for tag in _with_heads(f"attention_asymmetry/{m}")),
            *(tag for m in ENCODER_SELF + CROSS for tag in _with_heads(f"attention_position/sink_mass/{m}")),
        }
        _check_tags("scalar", scalar_tags, every_scalar, drift_scalar, not_applicable)
        every_image, drift_image = expected_images()
        _check_tags("image", image_tags, every_image, drift_image, {f"attention_asymmetry_map/{m}" for m in CROSS})

        # Scalars: [wall_time, step, value] per point. The callback's go through LightningModule.log at validation
        # epoch end, so they share the steps of the model's own val_acc: one point per epoch (no sanity-check epoch:
        # log_sanity_check defaults to False).
        def scalar_steps(tag: str) -> list[int]:
            return [step for _, step, _ in server.get_json("/data/plugin/scalars/scalars", run=RUN, tag=tag)]

        val_steps = scalar_steps("val_acc")
        assert len(val_steps) == EPOCHS, f"val_acc steps {val_steps}"
        wrong = {}
        for tag in sorted(t for t in scalar_tags if t.startswith("attention_")):
            want = val_steps[1:] if tag in drift_scalar else val_steps  # drift needs a previous epoch
            if (steps := scalar_steps(tag)) != want:
                wrong[tag] = (steps, want)
        assert not wrong, f"scalar steps (found, expected): {wrong}"

        # Images: the callback writes them itself at trainer.global_step, the end of each training epoch. Lightning
        # logs epoch-end validation scalars at its count of batches stepped, which does not include the epoch's last
        # batch yet when validation runs: one less than global_step.
        global_steps = [STEPS_PER_EPOCH * (epoch + 1) for epoch in range(EPOCHS)]
        assert val_steps == [step - 1 for step in global_steps], f"val_acc steps {val_steps}"
        series = {
            tag: server.get_json("/data/plugin/images/images", run=RUN, tag=tag)
            for tag in sorted(t for t in image_tags if t.startswith("attention_"))
        }
        wrong = {}
        for tag, points in series.items():
            want = global_steps[1:] if tag in drift_image else global_steps
            if (steps := [point["step"] for point in points]) != want:
                wrong[tag] = (steps, want)
        assert not wrong, f"image steps (found, expected): {wrong}"

        # The Scalars tab groups charts by the text before the first "/": no section mixes per-head and other charts.
        sections: dict[str, set[bool]] = {}
        for tag in scalar_tags:
            sections.setdefault(tag.split("/")[0], set()).add("/head_" in tag)
        assert not [name for name, kinds in sections.items() if len(kinds) > 1], sections

        # The custom-scalars layout: every chart's regexes, as the plugin applies them, find tags; together they
        # cover every per-head tag, and each per-head chart shows one module's heads of one metric.
        layout = server.get_json("/data/plugin/custom_scalars/layout")
        charts = [chart for category in layout["category"] for chart in category["chart"]]
        covered: set[str] = set()
        for chart in charts:
            for regex in chart["multiline"]["tag"]:
                found = server.get_json("/data/plugin/custom_scalars/scalars", run=RUN, tag=regex)
                assert found["regex_valid"] and found["tag_to_events"], (chart["title"], regex)
                covered |= found["tag_to_events"].keys()
                if "/head_" in regex:
                    modules = {tag.rsplit("/", 2)[-2] for tag in found["tag_to_events"]}
                    assert len(found["tag_to_events"]) == HEADS and len(modules) == 1, (regex, found.keys())
        heads = {tag for tag in scalar_tags if "/head_" in tag}
        assert heads and not heads - covered, sorted(heads - covered)
        titles = [category["title"] for category in layout["category"]]
        assert "attention overview" in titles and "attention heads: position/entropy" in titles

        for tag in (f"attention_mass/{CROSS[-1]}", f"attention_drift_map/{ENCODER_SELF[0]}", "attention_heads/lift"):
            query = series[tag][-1]["query"]  # an opaque query string for individualImage, e.g. "blob_key=..."
            png = server.get(f"/data/plugin/images/individualImage?{query}")
            assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000, f"{tag}: not a PNG: {png[:32]!r}"
    finally:
        server.stop()
    assert server.process.returncode is not None
