"""The tiny model, data, trainer and AttentionMonitor arguments behind the compatibility data in this folder.

``make_data.py`` (next to this file) trains with them under attn_callbacks 0.1.0 and commits what that code wrote;
``tests/test_compat.py`` rebuilds the same run with today's code and checks that it still reads it. Change nothing here
without regenerating the data from the 0.1.0 code (see ``make_data.py``): the recorded values depend on every number.
"""

from lightning.pytorch import LightningModule, Trainer
from torch import Generator, nn, optim, randint
from torch.utils.data import DataLoader

from attn_callbacks import AttentionMonitor

VOCAB, PAD, SINK, LENGTH = 12, 0, 1, 6
LAYERS = ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
STREAM = "tokens"  # the stream name a single `token_ids` key gets

# The arguments of the run that wrote the data, and of every run that resumes it.
MONITOR_ARGS = {
    "vocab_size": VOCAB,
    "token_ids": "input_ids",
    "ignore_ids": [PAD],
    "max_tracked_tokens": 8,  # 12 ids: 7 most frequent + the sink tracked, the rest in <other>
    "sink_ids": [SINK],
    "probe": "first",
    "color_scale": "shared",
    "export": "pt",
    "min_support": 2,
    "top_k": 8,
}


def make_batches(n, seed, low=1, batch_size=4):
    """``n`` sequences of ids in ``low .. VOCAB - 1``, every third one ending in two pads, in batches of 4."""
    g = Generator().manual_seed(seed)
    ids = randint(low, VOCAB, (n, LENGTH), generator=g)
    ids[::3, -2:] = PAD
    return [{"input_ids": ids[i : i + batch_size]} for i in range(0, n, batch_size)]


def _loader(batches):
    return DataLoader(batches, batch_size=None)  # each item is already a batch; never shuffled (probe="first")


def train_loader():
    return _loader(make_batches(16, seed=0))


def val_loader():
    """Three batches: what the checkpointed run validated on (epochs 0 and 1)."""
    return _loader(make_batches(12, seed=1))


def resume_val_loader():
    """The resumed run's validation set: the same batch 0 (the probe), then two batches of ids 5 .. 11 only, so that
    counting its ids would track other ids than the checkpoint holds: the resumed run must keep the checkpoint's."""
    return _loader([make_batches(12, seed=1)[0], *make_batches(8, seed=2, low=5)])


class CompatEncoder(LightningModule):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids), src_key_padding_mask=ids == PAD))

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        return nn.functional.cross_entropy(self(ids).flatten(0, 1), ids.flatten(), ignore_index=PAD)

    def validation_step(self, batch, batch_idx):
        self(batch["input_ids"])

    def configure_optimizers(self):
        return optim.SGD(self.parameters(), lr=1.0)


def make_monitor():
    return AttentionMonitor(**MONITOR_ARGS)


def make_trainer(root, monitor, logger, max_epochs):
    return Trainer(
        default_root_dir=root,
        max_epochs=max_epochs,
        accelerator="cpu",
        devices=1,
        logger=logger,
        callbacks=[monitor],
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
