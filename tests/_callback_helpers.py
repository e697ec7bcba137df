"""The tiny models, data, Trainer and readers shared by the end-to-end tests of AttentionMonitor
(tests/test_callback_*.py)."""

import io

import torch
from _reference import ACCELERATOR, copied, returned
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator
from torch import nn
from torch.utils.data import DataLoader

from attn_callbacks import AttentionMonitor

VOCAB, PAD, LENGTH = 12, 0, 6


def make_batches(n=16, batch_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
    ids[::3, -2:] = PAD  # some padding
    return [{"input_ids": ids[i : i + batch_size]} for i in range(0, n, batch_size)]


class TinyEncoder(LightningModule):
    def __init__(self, fail_in_validation=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(16, VOCAB)
        self.fail_in_validation = fail_in_validation
        self.val_outputs = []

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids), src_key_padding_mask=ids == PAD))

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        return nn.functional.cross_entropy(self(ids).flatten(0, 1), ids.flatten(), ignore_index=PAD)

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        if self.fail_in_validation:
            raise RuntimeError("validation failed")
        logits = self(batch["input_ids"])
        self.val_outputs.append(logits)
        self.log("val_loss", nn.functional.cross_entropy(logits.flatten(0, 1), batch["input_ids"].flatten()))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def collate(items):
    return items[0]


def loaders():
    return DataLoader(make_batches(), batch_size=1, collate_fn=collate), DataLoader(
        make_batches(seed=1), batch_size=1, collate_fn=collate
    )


def trainer(tmp_path, callbacks, logger=None, **kwargs):
    kwargs.setdefault("max_epochs", 2)
    return Trainer(
        default_root_dir=tmp_path,
        accelerator=ACCELERATOR,
        logger=logger if logger is not None else TensorBoardLogger(tmp_path, name="tb"),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **kwargs,
    )


def no_hooks(model):
    return not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


class Recorder(AttentionMonitor):
    """Keeps the computed stats of the last epoch to compare against an independent reference."""

    def on_validation_epoch_end(self, trainer, pl_module):
        self.last = getattr(self, "last", {})

        def keep(result):
            self.last.update({name: copied(stats) for name, stats in result[1].items()})

        with returned(self._sums, "collect", keep):
            super().on_validation_epoch_end(trainer, pl_module)


class Seq2Seq(LightningModule):
    def __init__(self, src_vocab=7, tgt_vocab=9, batch_first=True):
        super().__init__()
        self.src_embed, self.tgt_embed = nn.Embedding(src_vocab, 16), nn.Embedding(tgt_vocab, 16)
        self.transformer = nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=batch_first)
        self.batch_first = batch_first

    def validation_step(self, batch, batch_idx):
        src, tgt = batch["src"], batch["tgt"]  # (B, L) when batch_first else (L, B)
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1 if self.batch_first else 0], tgt.device)
        self.transformer(self.src_embed(src), self.tgt_embed(tgt), tgt_mask=mask, tgt_is_causal=True)


def run_validate(tmp_path, monitor, batches, model=None):
    model = model or TinyEncoder()
    trainer(tmp_path, [monitor]).validate(model, DataLoader(batches, batch_size=None), verbose=False)
    return model


def last_scalars(log_dir, part=""):
    """The last value of every scalar tag containing ``part`` in the event files under ``log_dir``."""
    events = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0})
    events.Reload()
    return {tag: events.Scalars(tag)[-1].value for tag in events.Tags()["scalars"] if part in tag}


def saved_and_loaded(state):
    """``state`` through ``torch.save`` and back with ``weights_only=True``, as a checkpoint carries it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
