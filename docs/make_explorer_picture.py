"""Draw the docs' picture of TensorBoard's "Attention" tab: the explorer on the toy translation model, a token searched.

    python docs/make_explorer_picture.py      # about 3 minutes on 2 CPU cores; writes docs/images/explorer.png

It runs ``examples/toy_translation.py`` unchanged (CPU, a temporary log directory; the monitor writes the explorer's
data by default), serves that directory with ``python -m tensorboard.main`` on a free port of 127.0.0.1, opens the
Attention tab in headless Chromium (Debian's ``/usr/bin/chromium`` driven by Playwright, no downloaded browser; light
mode, 1200 x 800), picks ``--module``, searches ``--token``, points at one heatmap cell so that its tooltip shows, and
saves the screenshot.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "images" / "explorer.png"
# The decoder's second self-attention: "cat" leans on itself more each epoch and on <bos> less, two lines that move.
MODULE = "attention/transformer.decoder.layers.1.self_attn"
TOKEN = "cat"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve(logdir: str, log) -> tuple[subprocess.Popen, str]:
    """A tensorboard server over ``logdir``, once it lists a run with explorer data."""
    port = free_port()
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", logdir, "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(
        [*command, "--load_fast=false", "--reload_task=blocking", "--reload_interval=0"],  # load once, then answer
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/data/plugin/attention_explorer/runs", timeout=5) as response:
                if json.load(response)["runs"]:
                    return server, url
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
            pass
        time.sleep(0.5)
    server.terminate()
    server.wait(timeout=30)
    log.flush()
    sys.exit(f"tensorboard did not serve the explorer's data:\n{Path(log.name).read_text(errors='replace')[-3000:]}")


def screenshot(url: str, module: str, token: str, chromium: str, out: Path) -> None:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 800}, color_scheme="light")
            page.set_default_timeout(30_000)
            page.goto(f"{url}/")
            page.get_by_role("tab", name="Attention").click()
            tab = page.frame_locator('iframe[src*="name=attention_explorer"]')
            tab.get_by_label("module", exact=True).select_option(module)
            search = tab.get_by_label("token", exact=True)
            search.fill(token)
            search.press("Enter")
            tab.locator("strong[data-token]").wait_for()
            tab.get_by_role("img", name="P across epochs").wait_for()
            tab.get_by_role("img", name="heatmap").locator('rect[data-row="0"][data-col="1"]').hover()
            tab.get_by_role("tooltip").wait_for()
            out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out))
        finally:
            browser.close()


def main() -> None:
    """Train the toy example, serve it, and screenshot the tab."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3, help="training epochs of the toy example")
    parser.add_argument("--module", default=MODULE, help="the module (explorer view) to show")
    parser.add_argument("--token", default=TOKEN, help="the token to search")
    parser.add_argument("--chromium", default="/usr/bin/chromium", help="the Chromium executable")
    parser.add_argument("--out", type=Path, default=OUT, help="the PNG file to write")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as logdir:
        example = ROOT / "examples" / "toy_translation.py"
        subprocess.run(
            [sys.executable, str(example), "--logdir", logdir, "--epochs", str(args.epochs)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        with open(Path(logdir, "tensorboard.log"), "wb") as log:
            server, url = serve(logdir, log)
            try:
                screenshot(url, args.module, args.token, args.chromium, args.out)
            finally:
                server.terminate()
                server.wait(timeout=30)
    print(f"{args.out}: {args.module}, token {args.token!r}, {args.out.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
