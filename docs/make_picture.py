"""Draw the README's picture: a real heatmap logged by ``AttentionMonitor`` while the toy translation model trains.

    python docs/make_picture.py            # about 4 minutes on 2 CPU cores; writes docs/images/heatmap.png

It runs ``examples/toy_translation.py`` unchanged (CPU, a temporary log directory), reads the TensorBoard event file
back and saves the image logged under ``--tag`` at the last step, byte for byte as TensorBoard shows it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parent.parent
# The decoder's cross-attention (target word x source word): it sharpens into the toy dictionary, one bright cell
# per row.
DEFAULT_TAG = "attention_mass/transformer.decoder.layers.1.multihead_attn"


def main() -> None:
    """Train the toy example, then copy one logged image to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5, help="training epochs of the toy example")
    parser.add_argument("--tag", default=DEFAULT_TAG, help="TensorBoard image tag to save")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "heatmap.png")
    args = parser.parse_args()

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
        if args.tag not in events.Tags()["images"]:
            sys.exit(f"no image tag {args.tag!r}; logged: {sorted(events.Tags()['images'])}")
        last = max(events.Images(args.tag), key=lambda event: event.step)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_bytes(last.encoded_image_string)
    size = args.out.stat().st_size
    print(f"{args.out}: {args.tag} at step {last.step}, {last.width} x {last.height} px, {size:,} bytes")


if __name__ == "__main__":
    main()
