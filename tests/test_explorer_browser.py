"""The Attention tab in a real browser, inside TensorBoard's own UI, its numbers checked against the export.

Fits a tiny encoder for 2 epochs with ``AttentionMonitor`` (explorer data on by default, ``export="npz"``) and a
``TensorBoardLogger``, starts ``python -m tensorboard.main`` over the log directory, and drives Debian's headless
Chromium through Playwright (never a downloaded browser). It opens the Attention tab from TensorBoard's tab bar,
searches a token, and compares its "attends to" and "attended by" lists (P, lift, pair count), query count and rest
share with values computed in float64 from the exported sums; checks the heatmap around it (outline, a cell's values,
its tooltip) and the drift view; scrubs to the other epoch and picks one head (the lists follow); opens the address
bar's URL in a fresh page (the same token, epoch and head come back); follows TensorBoard's dark mode; and checks the
empty and error states: a token that is not stored, a run without explorer data, a run whose epoch file is gone (the
server's message is shown). Skipped when ``/usr/bin/chromium`` or playwright is missing, except under CI
(``CI=true``), where it fails.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter

from attn_callbacks import AttentionMonitor, load_epoch

pytestmark = pytest.mark.tensorboard_server

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SERVER_TIMEOUT_S = 60.0
UI_TIMEOUT_MS = 20_000

# A vocabulary small enough to be tracked whole (no max_tracked_tokens): explorer ids are vocabulary ids and indices
# into the exported sums. Labels with markup and URL characters check that the tab prints them as text; "#2" (the
# search for id 2) and a carriage return (which the search box drops) that their own tokens can still be searched.
VOCAB, PAD, LENGTH = 12, 0, 8
LABELS = ["<pad>", "the", "cat", "sat", "on", "\r", "mat", "<b>", "&=#?", "dog", "#2", "é"]
MODULE = "encoder.layers.0.self_attn"
VIEW = f"attention/{MODULE}"
RUN = "tiny/version_0"
TOKEN = LABELS.index("cat")
TOLERANCE = {"rel": 1e-6, "abs": 1e-6}  # the planes are float32; the reference is float64


class TinyEncoder(LightningModule):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids), src_key_padding_mask=ids == PAD))

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        return nn.functional.cross_entropy(self(ids).flatten(0, 1), ids.flatten(), ignore_index=PAD)

    def validation_step(self, batch, batch_idx):
        self(batch["input_ids"])

    def configure_optimizers(self):
        # a large step, so that the two epochs' attention differ visibly
        return torch.optim.SGD(self.parameters(), lr=0.5)


def fit(logdir: Path) -> Path:
    """Train for 2 epochs, monitoring both validation epochs; returns the run's folder."""
    torch.manual_seed(0)
    ids = torch.randint(1, VOCAB, (64, LENGTH), generator=torch.Generator().manual_seed(0))
    ids[::3, -2:] = PAD
    loader = DataLoader([{"input_ids": ids[i : i + 8]} for i in range(0, 64, 8)], batch_size=None)
    monitor = AttentionMonitor(vocab_size=VOCAB, ignore_ids=[PAD], id_to_token=LABELS, export="npz")
    logger = TensorBoardLogger(logdir, name="tiny")
    trainer = Trainer(
        max_epochs=2,
        accelerator="cpu",  # the tab reads files: no device matters here
        logger=logger,
        callbacks=[monitor],
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(TinyEncoder(), loader, loader)
    return Path(logger.log_dir)


def expected(record, head: int | None, token: int) -> dict:
    """The token's lists, query count and rest share from the exported sums, in float64: ``P = S / Q`` (S the head
    mean, or one head), lift ``P * Q / U``; an entry for every pair seen at least once."""
    stats = record.modules[MODULE]
    sums = stats.attention_sum.double().numpy()
    sums = sums.mean(axis=0) if head is None else sums[head]
    queries = stats.query_count.double().numpy()
    pairs = stats.pair_count.numpy()
    uniform = stats.uniform_sum.double().numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        mass = sums / queries[:, None]
        lift = mass * queries[:, None] / uniform

    def entries(cells):
        return {int(j): (mass[cell], lift[cell], int(pairs[cell])) for j, cell in cells if pairs[cell] > 0}

    return {
        "attends to": entries((b, (token, b)) for b in range(VOCAB)),
        "attended by": entries((a, (a, token)) for a in range(VOCAB)),
        "count": int(queries[token]),
        "rest": max(0.0, 1.0 - mass[token].sum()),
    }


def shown_lists(frame) -> dict[str, list[dict]]:
    """Each list's entries in the order shown: the exact values of their data attributes."""
    read = "items => items.map(item => ({...item.dataset, text: item.innerText}))"
    return {
        name: frame.get_by_role("list", name=name, exact=True).locator("li").evaluate_all(read)
        for name in ("attends to", "attended by")
    }


def check_lists(shown: dict[str, list[dict]], reference: dict) -> None:
    for name in ("attends to", "attended by"):
        entries, wanted = shown[name], reference[name]
        assert sorted(int(entry["id"]) for entry in entries) == sorted(wanted), name
        probabilities = [float(entry["p"]) for entry in entries]
        assert probabilities == sorted(probabilities, reverse=True), f"{name} is not ranked by P"
        for entry in entries:
            p, lift, count = wanted[int(entry["id"])]
            where = f"{name}: {entry}"
            assert entry["label"] == LABELS[int(entry["id"])], where
            assert entry["text"].split("\n")[0] == printed(LABELS[int(entry["id"])]), where  # text, never markup
            assert float(entry["p"]) == pytest.approx(p, **TOLERANCE), where
            assert float(entry["lift"]) == pytest.approx(lift, **TOLERANCE), where
            assert int(entry["count"]) == count, where
            # the readable figures: lift with 2 decimals, the count as an integer
            assert f"{float(entry['lift']):.2f}" in entry["text"] and f"{count:,}" in entry["text"], where


def printed(label: str) -> str:
    """How the tab prints a label: a carriage return drawn as ␍."""
    return label.replace("\r", "␍")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_tensorboard(logdir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """A ``tensorboard`` server over ``logdir`` that has loaded every run (it loads once, before it answers)."""
    port = free_port()
    with log.open("ab") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tensorboard.main",
                "--logdir",
                str(logdir),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--load_fast=false",  # the Python loader: no Rust data server child process
                "--reload_task=blocking",
                "--reload_interval=0",
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_TIMEOUT_S
    last: object = None
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/data/plugin/attention_explorer/runs", timeout=5) as response:
                runs = [run["run"] for run in json.load(response)["runs"]]
            if RUN in runs:
                return process, url
            last = f"runs with explorer data: {runs}"
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError) as error:
            last = error
        time.sleep(0.25)
    stop(process)
    pytest.fail(f"tensorboard did not serve {RUN!r} ({last}):\n{log.read_text(errors='replace')}")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def open_tab(context, url: str):
    """A fresh page on ``url`` and the Attention tab's frame in it (TensorBoard draws the tab's iframe itself)."""
    page = context.new_page()
    page.set_default_timeout(UI_TIMEOUT_MS)
    page.goto(url)
    return page, page.frame_locator('iframe[src*="name=attention_explorer"]')


def showing(tab, epoch: int, head: str):
    """The token summary once it shows ``TOKEN`` at ``epoch`` and ``head`` (lists and summary are drawn together)."""
    summary = tab.locator(f'strong[data-token="{TOKEN}"][data-epoch="{epoch}"][data-head="{head}"]')
    summary.wait_for()
    return summary


def test_explorer_tab_shows_the_exported_sums(tmp_path):
    # Outside CI a machine without the browser skips this test; CI installs it (.ci/chromium.sh) and must run it.
    missing = pytest.fail if os.environ.get("CI") == "true" else pytest.skip
    if not CHROMIUM.exists():
        missing(f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium, or bash .ci/chromium.sh)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("playwright is not installed (pip install playwright; the browser is Debian's chromium)")

    logdir = tmp_path / "logs"
    run_dir = fit(logdir)
    records = {record.epoch: record for record in map(load_epoch, (run_dir / "attention_epochs").glob("*.npz"))}
    assert sorted(records) == [0, 1]
    # A run TensorBoard lists without explorer data, and a copy of the run whose first epoch lost its planes.
    with SummaryWriter(str(logdir / "plain")) as writer:
        writer.add_scalar("loss", 1.0, 0)
    shutil.copytree(run_dir, logdir / "tiny_unreadable", ignore=shutil.ignore_patterns("attention_epochs"))
    (planes,) = (logdir / "tiny_unreadable" / "plugins" / "attention_explorer").glob("*/epoch=0-*.npy")
    planes.unlink()

    process, url = start_tensorboard(logdir, tmp_path / "tensorboard.log")
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            try:
                check_tab(browser.new_context(viewport={"width": 1400, "height": 1000}), url, records)
            finally:
                browser.close()
    finally:
        stop(process)


def check_tab(context, url: str, records: dict) -> None:
    page, tab = open_tab(context, f"{url}/")
    page.get_by_role("tab", name="Attention").click()  # from TensorBoard's own tab bar
    tab.get_by_role("img", name="heatmap", exact=True).wait_for()  # drawn: the controls are set
    assert tab.get_by_label("run", exact=True).input_value() == RUN  # the first run with explorer data
    assert tab.get_by_label("module", exact=True).input_value() == VIEW
    assert tab.get_by_label("head", exact=True).input_value() == "mean"
    assert tab.get_by_label("epoch", exact=True).get_attribute("aria-valuetext").startswith("epoch 1 ")  # the last

    # Search the token: its lists at the last epoch, head mean.
    search = tab.get_by_label("token", exact=True)
    search.fill(LABELS[TOKEN])
    search.press("Enter")
    summary = showing(tab, epoch=1, head="mean")
    reference = expected(records[1], None, TOKEN)
    last_epoch = shown_lists(tab)
    check_lists(last_epoch, reference)
    assert int(tab.locator("[data-query-count]").get_attribute("data-query-count")) == reference["count"]
    assert float(tab.locator("[data-rest]").get_attribute("data-rest")) == pytest.approx(reference["rest"], abs=1e-6)
    assert summary.inner_text() == LABELS[TOKEN]

    # The heatmap around it: its row and column first and outlined; a cell's values and tooltip.
    heatmap = tab.get_by_role("img", name="heatmap", exact=True)
    assert heatmap.locator('[data-outline="row"]').count() == heatmap.locator('[data-outline="col"]').count() == 1
    cell = heatmap.locator('rect[data-row="0"][data-col="1"]')
    key = int(cell.get_attribute("data-key"))
    assert int(cell.get_attribute("data-query")) == TOKEN
    assert float(cell.get_attribute("data-p")) == pytest.approx(reference["attends to"][key][0], **TOLERANCE)
    cell.hover()
    tooltip = tab.get_by_role("tooltip")
    tooltip.wait_for()
    assert f"query {LABELS[TOKEN]} (#{TOKEN}) → key {printed(LABELS[key])} (#{key})" in tooltip.inner_text()
    assert f"lift {float(cell.get_attribute('data-lift')):.2f}" in tooltip.inner_text()
    # The drift view: its top keys' P at both epochs, and the row's drift into epoch 1.
    lines = tab.get_by_role("img", name="P across epochs").locator("path[data-key]")
    assert lines.count() == min(5, len(reference["attends to"]))
    top_key = int(lines.first.get_attribute("data-key"))
    values = json.loads(lines.first.get_attribute("data-values"))
    for epoch, value in enumerate(values):
        assert value == pytest.approx(expected(records[epoch], None, TOKEN)["attends to"][top_key][0], **TOLERANCE)
    assert tab.get_by_role("img", name="drift", exact=True).locator("rect[data-js]").count() == 1

    # Scrub to the first epoch, then pick head 1: the lists follow. The map is redrawn under the still pointer: the
    # tooltip is the new map's cell (0, 1), not the old one's.
    hovered = tooltip.inner_text()
    tab.get_by_label("epoch", exact=True).fill("0")
    showing(tab, epoch=0, head="mean")
    redrawn = heatmap.locator('rect[data-row="0"][data-col="1"]')
    p = float(redrawn.get_attribute("data-p"))
    assert tooltip.is_visible() and tooltip.inner_text() != hovered
    assert f"key {printed(LABELS[int(redrawn.get_attribute('data-key'))])}" in tooltip.inner_text()
    assert f"P {p * 100:#.3g}%" in tooltip.inner_text()  # as JavaScript's toPrecision(3)
    first_epoch = shown_lists(tab)
    check_lists(first_epoch, expected(records[0], None, TOKEN))
    assert first_epoch != last_epoch
    tab.get_by_label("head", exact=True).select_option("1")
    showing(tab, epoch=0, head="1")
    one_head = shown_lists(tab)
    check_lists(one_head, expected(records[0], 1, TOKEN))

    # The address bar holds the state: a fresh page on it shows the same token, epoch and head.
    link = page.url
    assert "#attention_explorer&" in link and f"p.attention_explorer.token={TOKEN}" in link
    linked_page, linked = open_tab(context, link)
    showing(linked, epoch=0, head="1")
    assert linked.get_by_label("token", exact=True).input_value() == LABELS[TOKEN]
    assert linked.get_by_label("epoch", exact=True).get_attribute("aria-valuetext").startswith("epoch 0 ")
    assert linked.get_by_label("head", exact=True).input_value() == "1"
    assert shown_lists(linked) == one_head
    linked_page.close()

    # TensorBoard's dark mode reaches the tab.
    page.evaluate("document.body.classList.add('dark-mode')")
    tab.locator("html.dark").wait_for(state="attached")
    page.evaluate("document.body.classList.remove('dark-mode')")
    tab.locator("html:not(.dark)").wait_for(state="attached")

    # "#2" searches id 2, not the token labelled "#2"; that one and "\r" are searched by their suggestions.
    suggestions = tab.locator("datalist option").evaluate_all("options => options.map(option => option.value)")
    shadow, blank = LABELS.index("#2"), LABELS.index("\r")
    assert {f"#2 #{shadow}", f"␍ #{blank}"} <= set(suggestions) and "#2" not in suggestions
    for text, token in (("#2", TOKEN), (f"#2 #{shadow}", shadow), (f"␍ #{blank}", blank)):
        search.fill(text)
        search.press("Enter")
        tab.locator(f'strong[data-token="{token}"][data-epoch="0"][data-head="1"]').wait_for()

    # A token that is not stored; a run whose epoch is unreadable (the run switch keeps epoch 0); a run without data.
    search.fill("#99")
    search.press("Enter")
    assert "is not stored at epoch 0" in tab.locator('[data-missing="99"]').inner_text()
    tab.get_by_label("run", exact=True).select_option("tiny_unreadable")
    alert = tab.get_by_role("alert").filter(has_text="cannot be read")
    assert "does not exist" in alert.inner_text()  # the server's own message
    tab.get_by_label("run", exact=True).select_option("plain")
    empty = tab.get_by_role("status").filter(has_text="this run")
    assert "has no explorer data: an AttentionMonitor with a TensorBoardLogger" in empty.inner_text()
