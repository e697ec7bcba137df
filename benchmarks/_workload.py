"""The workloads of the benchmarks: 4 × nn.TransformerEncoderLayer (d_model 256, 8 heads, feed-forward 1024), batch
32, length 128, an 8,000-token vocabulary with Zipf(1) (or uniform) token ids; the stress model stops at the encoder,
the heavier one adds a language-model head and its loss; the SDPA model has the same shapes in blocks of its own that
call ``F.scaled_dot_product_attention`` (as nanoGPT-style models do)."""

from __future__ import annotations

import logging
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn

from _presets import BATCH, D_MODEL, FEEDFORWARD, HEADS, LAYERS, LENGTH, VOCAB


class Encoder(LightningModule):
    """Embedding and 4 stock encoder layers; with ``head``, a head over the vocabulary whose loss validation logs."""

    def __init__(
        self,
        vocab: int = VOCAB,
        d_model: int = D_MODEL,
        heads: int = HEADS,
        layers: int = LAYERS,
        feedforward: int = FEEDFORWARD,
        head: bool = True,
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=feedforward, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab) if head else None

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        ids = batch["input_ids"]
        hidden = self.encoder(self.embed(ids))
        if self.head is not None:
            logits = self.head(hidden)
            self.log("val_loss", nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()))


def nudge(model: nn.Module, seed: int, scale: float = 1e-3) -> None:
    """Scale every parameter by ``1 + scale · N(0, 1)``, cell by cell: a stand-in for a training step, so that each
    monitored epoch's attention differs from the last one's as in a fit (on a model left as it is, every row's drift
    is exactly 0, which the epoch end computes without a logarithm)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator).to(parameter.device, parameter.dtype)
            parameter.mul_(1 + scale * noise)


class SdpaBlock(nn.Module):
    """A post-norm encoder block like ``nn.TransformerEncoderLayer``'s, its attention a direct SDPA call, or with
    ``by_hand`` the same attention written out (``softmax(q kᵀ / √d) v``, as minGPT does)."""

    def __init__(
        self, d_model: int = D_MODEL, heads: int = HEADS, feedforward: int = FEEDFORWARD, by_hand: bool = False
    ):
        super().__init__()
        self.heads, self.by_hand = heads, by_hand
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, feedforward), nn.ReLU(), nn.Linear(feedforward, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        if self.by_hand:
            y = torch.softmax(q @ k.transpose(-2, -1) / q.size(-1) ** 0.5, dim=-1) @ v  # (B, H, L, D / H)
        else:
            y = nn.functional.scaled_dot_product_attention(q, k, v)
        x = self.norm1(x + self.out(y.transpose(1, 2).reshape(batch, length, dim)))
        return self.norm2(x + self.ff(x))


class SdpaEncoder(LightningModule):
    """Embedding and `layers` :class:`SdpaBlock` (the stress workload's shapes by default), attention through SDPA or,
    with ``by_hand``, written out."""

    def __init__(
        self,
        vocab: int = VOCAB,
        d_model: int = D_MODEL,
        heads: int = HEADS,
        layers: int = LAYERS,
        feedforward: int = FEEDFORWARD,
        by_hand: bool = False,
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.Sequential(*(SdpaBlock(d_model, heads, feedforward, by_hand) for _ in range(layers)))

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.blocks(self.embed(batch["input_ids"]))


def token_ids(
    batches: int,
    distribution: str = "zipf",
    vocab: int = VOCAB,
    seed: int = 0,
    batch: int = BATCH,
    length: int = LENGTH,
) -> list[dict]:
    """``batches`` batches of (batch, length) ids: Zipf(1) over the vocabulary (as in real text) or uniform."""
    g = torch.Generator().manual_seed(seed)
    if distribution == "zipf":
        weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    else:
        weights = torch.ones(vocab, dtype=torch.float64)
    ids = torch.multinomial(weights, batches * batch * length, replacement=True, generator=g)
    return [{"input_ids": chunk.view(batch, length)} for chunk in ids.split(batch * length)]


def device_label() -> str:
    """The GPU's name, or the CPU and its torch threads: what the benchmarks' headers say they ran on."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"


def quiet() -> None:
    """Keep Lightning's start-up banners and our one-time info lines out of the benchmark tables."""
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("attn_callbacks").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def validate(model: LightningModule, batches: list[dict], callbacks: list) -> tuple[float, float]:
    """Wall seconds and CPU seconds (all threads of this process) of one ``trainer.validate`` epoch (no logger output
    on the terminal). CPU time leaves out what a shared virtual machine's host takes away (steal time)."""
    import tempfile

    from lightning.pytorch.loggers import TensorBoardLogger

    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(
            accelerator="auto",
            devices=1,
            logger=TensorBoardLogger(root),
            callbacks=callbacks,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        start, cpu = time.perf_counter(), time.process_time()
        trainer.validate(model, torch.utils.data.DataLoader(batches, batch_size=None), verbose=False)
        return time.perf_counter() - start, time.process_time() - cpu


def summary(values: list[float]) -> str:
    return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}"


def best_of(fn: Callable[[], object], repeats: int = 5) -> float:
    """Median wall seconds of ``fn`` over ``repeats`` runs after one warm-up (CUDA synchronised)."""
    fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
