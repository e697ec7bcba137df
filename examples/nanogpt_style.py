"""A byte-level nanoGPT-style language model, whose blocks call ``F.scaled_dot_product_attention``, watched by
``AttentionMonitor`` with no change to the model.

Trained a few epochs on the Python documentation shipped with Python (``pydoc_data.topics``), a causal model learns to
look at the byte just before the one it predicts from: the previous-token share of some heads
(``attention_position_heads/previous/...``) climbs while their entropy falls. Runs offline on CPU in about a minute:

    python examples/nanogpt_style.py              # then: tensorboard --logdir runs
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path
from pydoc_data.topics import topics

import lightning
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing import event_accumulator
from torch import Tensor, nn
from torch.utils.data import DataLoader

from attn_callbacks import AttentionMonitor

VOCAB = 256  # bytes


# ---------------------------------------------------------------------------------------------------------- the model
class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: one projection to q, k, v, then ``scaled_dot_product_attention`` with a causal mask."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=2)
        q, k, v = (t.view(batch, length, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))  # (B,H,T,D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, dim))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(dim), CausalSelfAttention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ByteGPT(LightningModule):
    def __init__(self, length: int = 64, dim: int = 64, heads: int = 4, layers: int = 2, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.tok, self.pos = nn.Embedding(VOCAB, dim), nn.Embedding(length, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.size(1), device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, VOCAB)

    def _loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self(batch["input_ids"])
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch["targets"].reshape(-1))

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


# ----------------------------------------------------------------------------------------------------------- the data
def byte_windows(length: int, count: int, offset: int) -> list[dict[str, Tensor]]:
    """``count`` windows of ``length + 1`` bytes of the Python docs from window ``offset`` on: inputs, next bytes."""
    text = "\n".join(topics[key] for key in sorted(topics)).encode("utf-8")
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    windows = data[: (len(data) // (length + 1)) * (length + 1)].view(-1, length + 1)[offset : offset + count]
    return [{"input_ids": w[:-1], "targets": w[1:]} for w in windows]


def collate(items: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


def main() -> None:
    """Train, then print the wall time, the validation loss and every head's previous-byte share per epoch."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", default="runs", help="TensorBoard root directory")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--train-windows", type=int, default=3072)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    torch.set_num_threads(2)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", r".*isinstance\(treespec, LeafSpec\).*")  # lightning vs newer torch
    lightning.seed_everything(args.seed, verbose=False)

    length = 64
    train = DataLoader(byte_windows(length, args.train_windows, 0), batch_size=32, shuffle=True, collate_fn=collate)
    val = DataLoader(byte_windows(length, 256, args.train_windows), batch_size=64, collate_fn=collate)
    monitor = AttentionMonitor(
        vocab_size=VOCAB,
        token_ids="input_ids",
        id_to_token=lambda i: repr(chr(i))[1:-1] if 32 <= i < 127 or i == 10 else f"\\x{i:02x}",
        max_tracked_tokens=96,  # the 96 most frequent bytes of the validation text; the rest in <other>
    )
    logger = TensorBoardLogger(args.logdir, name="nanogpt_style")
    trainer = Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=1,
        logger=logger,
        callbacks=[monitor],
        log_every_n_steps=20,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    model = ByteGPT(length)
    trainer.fit(model, train, val)

    events = event_accumulator.EventAccumulator(logger.log_dir, size_guidance={event_accumulator.SCALARS: 0})
    events.Reload()
    print(f"wall time: {time.perf_counter() - start:.1f} s")
    print(f"final val loss: {float(trainer.callback_metrics['val_loss']):.3f} nats per byte (uniform: 5.545)")
    print(f"log directory: {Path(logger.log_dir)}  (tensorboard --logdir {args.logdir})")
    print("\nprevious-byte share per head and epoch (attention_position_heads/previous/...):")
    tags = sorted(t for t in events.Tags()["scalars"] if t.startswith("attention_position_heads/previous/"))
    for tag in tags:
        values = "  ".join(f"{event.value:.2f}" for event in events.Scalars(tag))
        print(f"  {tag.removeprefix('attention_position_heads/previous/'):<24} {values}")


if __name__ == "__main__":
    main()
