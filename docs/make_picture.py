"""Draw the docs' pictures: real images logged by ``AttentionMonitor`` while the toy translation model trains.

    python docs/make_picture.py            # about 4 minutes on 2 CPU cores; writes docs/images/*.png

It runs ``examples/toy_translation.py`` unchanged (CPU, a temporary log directory), reads the TensorBoard event file
back and saves each image logged under ``--tag`` at the last step, byte for byte as TensorBoard shows it: by default
the README's heatmap and the head grid shown in ``docs/tags.md``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "docs" / "images"
# The decoder's cross-attention (target word x source word): it sharpens into the toy dictionary, one bright cell
# per row. Then every module's and head's normalised position entropy: which heads attend sharply.
DEFAULT_TAGS = {
    "attention_mass/transformer.decoder.layers.1.multihead_attn": IMAGES / "heatmap.png",
    "attention_heads/position_entropy_normalized": IMAGES / "head_grid.png",
}


def main() -> None:
    """Train the toy example, then copy the logged images to their files."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5, help="training epochs of the toy example")
    parser.add_argument(
        "--tag", nargs=2, action="append", metavar=("TAG", "FILE"), help="an image tag and the PNG file to save it to"
    )
    args = parser.parse_args()
    wanted = {tag: Path(out) for tag, out in args.tag} if args.tag else DEFAULT_TAGS

    with tempfile.TemporaryDirectory() as logdir:
        example = ROOT / "examples" / "toy_translation.py"
        subprocess.run(
            [sys.executable, str(example), "--logdir", logdir, "--epochs", str(args.epochs)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        (run,) = Path(logdir, "toy_translation").iterdir()  # version_0
        events = EventAccumulator(str(run), size_guidance={"images": 0})
        events.Reload()
        for tag, out in wanted.items():
            if tag not in events.Tags()["images"]:
                sys.exit(f"no image tag {tag!r}; logged: {sorted(events.Tags()['images'])}")
            last = max(events.Images(tag), key=lambda event: event.step)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(last.encoded_image_string)
            print(f"{out}: {tag} at step {last.step}, {last.width} x {last.height} px, {out.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
