"""Toy word-by-word French -> English translation with ``nn.Transformer``, watched by ``AttentionMonitor``.

The right answer is known: every French word has exactly one English translation at the same position, so the decoder
cross-attention (target word x source word) should sharpen into the dictionary, a permutation-like matrix. Runs
offline on 2 CPU cores in about 15 s (the first run also compiles the monitor's CPU kernels, about 40 s more):

    python examples/toy_translation.py            # then: tensorboard --logdir runs
    python examples/toy_translation.py --model rnn  # a GRU decoder with Bahdanau attention, one step per word
"""

from __future__ import annotations

import argparse
import math
import time
import warnings
from pathlib import Path

import lightning
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing import event_accumulator
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader

from attn_callbacks import AttentionMonitor, capture_attention

# ----------------------------------------------------------------------------------------------------------- the data
DICTIONARY: dict[str, str] = {
    "le": "the",
    "un": "a",
    "chat": "cat",
    "chien": "dog",
    "oiseau": "bird",
    "poisson": "fish",
    "noir": "black",
    "blanc": "white",
    "rouge": "red",
    "petit": "small",
    "grand": "big",
    "mange": "eats",
    "dort": "sleeps",
    "voit": "sees",
    "aime": "likes",
    "et": "and",
    "avec": "with",
    "sous": "under",
    "ici": "here",
    "souvent": "often",
}
PAD, BOS, EOS = 0, 1, 2  # PAD is 0 in both vocabularies; BOS and EOS exist only in the target vocabulary
SRC_VOCAB: list[str] = ["<pad>", *DICTIONARY]
# Target words in alphabetical order, so the dictionary is a real permutation of ids, not the identity.
TGT_VOCAB: list[str] = ["<pad>", "<bos>", "<eos>", *sorted(DICTIONARY.values())]
SRC_TO_TGT = torch.tensor([PAD] + [TGT_VOCAB.index(DICTIONARY[word]) for word in SRC_VOCAB[1:]])
TGT_TO_SRC = torch.full((len(TGT_VOCAB),), -1, dtype=torch.long)  # -1: no source word (pad, bos, eos)
TGT_TO_SRC[SRC_TO_TGT[1:]] = torch.arange(1, len(SRC_VOCAB))
MIN_LEN, MAX_LEN = 4, 9
TRAIN_SIZE, VAL_SIZE = 2048, 512


def make_pairs(count: int, generator: torch.Generator) -> list[tuple[Tensor, Tensor]]:
    """``count`` random (French ids, English ids) sentence pairs of 4-9 words, translated word by word."""
    lengths = torch.randint(MIN_LEN, MAX_LEN + 1, (count,), generator=generator)
    pairs = []
    for length in lengths.tolist():
        src = torch.randint(1, len(SRC_VOCAB), (length,), generator=generator)
        pairs.append((src, SRC_TO_TGT[src]))
    return pairs


def collate(pairs: list[tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
    """Pad a list of pairs into ``{"src": (B, S), "tgt_in": (B, T), "tgt_out": (B, T)}`` (T = S + 1)."""
    src = [s for s, _ in pairs]
    tgt_in = [torch.cat([torch.tensor([BOS]), t]) for _, t in pairs]
    tgt_out = [torch.cat([t, torch.tensor([EOS])]) for _, t in pairs]
    return {
        "src": pad_sequence(src, batch_first=True, padding_value=PAD),
        "tgt_in": pad_sequence(tgt_in, batch_first=True, padding_value=PAD),
        "tgt_out": pad_sequence(tgt_out, batch_first=True, padding_value=PAD),
    }


# ---------------------------------------------------------------------------------------------------------- the model
class ToyTranslator(LightningModule):
    """A small ``nn.Transformer`` with token and learned positional embeddings, trained with teacher forcing."""

    def __init__(self, src_vocab: int, tgt_vocab: int, d_model: int = 64, max_len: int = 16, lr: float = 1e-3) -> None:
        super().__init__()
        self.lr = lr
        self.src_embed = nn.Embedding(src_vocab, d_model, padding_idx=PAD)
        self.tgt_embed = nn.Embedding(tgt_vocab, d_model, padding_idx=PAD)
        self.src_pos = nn.Embedding(max_len, d_model)
        self.tgt_pos = nn.Embedding(max_len, d_model)
        # Attention module names: transformer.encoder.layers.{i}.self_attn, transformer.decoder.layers.{i}.self_attn
        # and transformer.decoder.layers.{i}.multihead_attn (the cross-attention).
        self.transformer = nn.Transformer(
            d_model=d_model,
            nhead=4,
            num_encoder_layers=2,
            num_decoder_layers=2,
            dim_feedforward=128,
            dropout=0.0,
            batch_first=True,
        )
        # Same computation in every validation pass: no nested-tensor fast path when the monitor is not hooked.
        self.transformer.encoder.use_nested_tensor = False
        self.out = nn.Linear(d_model, tgt_vocab)
        self.loss = nn.CrossEntropyLoss(ignore_index=PAD)

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Logits ``(B, T, tgt_vocab)`` for the next target token at every decoder position."""
        src_pad, tgt_pad = src == PAD, tgt_in == PAD
        causal = nn.Transformer.generate_square_subsequent_mask(tgt_in.shape[1], device=src.device).isinf()
        positions_src = torch.arange(src.shape[1], device=src.device)
        positions_tgt = torch.arange(tgt_in.shape[1], device=src.device)
        hidden = self.transformer(
            self.src_embed(src) + self.src_pos(positions_src),
            self.tgt_embed(tgt_in) + self.tgt_pos(positions_tgt),
            tgt_mask=causal,  # boolean, like the key padding masks (mixing float and bool masks is deprecated)
            src_key_padding_mask=src_pad,
            tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad,
            tgt_is_causal=True,
        )
        return self.out(hidden)

    def _step(self, batch: dict[str, Tensor], stage: str) -> Tensor:
        logits = self(batch["src"], batch["tgt_in"])
        target = batch["tgt_out"]
        loss = self.loss(logits.flatten(0, 1), target.flatten())
        valid = target != PAD
        accuracy = (logits.argmax(-1) == target)[valid].float().mean()
        self.log(f"{stage}_loss", loss, prog_bar=True, batch_size=target.shape[0])
        self.log(f"{stage}_acc", accuracy, prog_bar=True, batch_size=target.shape[0])
        return loss

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._step(batch, "val")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class BahdanauAttention(nn.Module):
    """Additive attention (Bahdanau et al., 2015): ``score(q, k) = v · tanh(W q + U k)``, one decoder step per call."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.query, self.key, self.score = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, 1)

    def forward(self, query: Tensor, keys: Tensor, pad: Tensor) -> tuple[Tensor, Tensor]:
        """The context ``(B, 1, H)`` and weights ``(B, 1, S)`` of a query ``(B, 1, H)`` over keys ``(B, S, H)``."""
        scores = self.score(torch.tanh(self.query(query) + self.key(keys))).squeeze(2).unsqueeze(1)  # (B, 1, S)
        weights = F.softmax(scores.masked_fill(pad[:, None], -math.inf), dim=-1)
        return torch.bmm(weights, keys), weights


class RnnTranslator(ToyTranslator):
    """The classic attention model: a bidirectional GRU encoder, and a GRU decoder that attends over the source
    once per target word (the monitor gathers a batch's steps into one target x source call)."""

    def __init__(self, src_vocab: int, tgt_vocab: int, d_model: int = 64, lr: float = 3e-3) -> None:
        LightningModule.__init__(self)
        self.lr = lr
        self.src_embed = nn.Embedding(src_vocab, d_model, padding_idx=PAD)
        self.tgt_embed = nn.Embedding(tgt_vocab, d_model, padding_idx=PAD)
        self.encoder = nn.GRU(d_model, d_model // 2, batch_first=True, bidirectional=True)
        self.decoder = nn.GRU(2 * d_model, d_model, batch_first=True)
        self.attention = BahdanauAttention(d_model)  # named "attention" in the tags
        self.out = nn.Linear(2 * d_model, tgt_vocab)
        self.loss = nn.CrossEntropyLoss(ignore_index=PAD)

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        keys, _ = self.encoder(self.src_embed(src))  # (B, S, H)
        hidden = keys.new_zeros(1, src.shape[0], keys.shape[-1])
        logits = []
        for t in range(tgt_in.shape[1]):  # teacher forcing: step t reads tgt_in[t] and emits tgt_out[t]
            out, hidden = self.decoder(torch.cat([self.tgt_embed(tgt_in[:, t : t + 1]), hidden.transpose(0, 1)], -1))
            context, _ = self.attention(out, keys, src == PAD)
            logits.append(self.out(torch.cat([out, context], dim=-1)))
        return torch.cat(logits, dim=1)


# --------------------------------------------------------------------------------------------------------- the check
@torch.no_grad()
def dictionary_alignment(model: ToyTranslator, batch: dict[str, Tensor]) -> dict[str, tuple[float, float]]:
    """Per cross-attention module: (head-averaged weight on the source word that translates to the emitted target
    word, the same for uniform attention over the source words), averaged over the target words of ``batch``."""
    model.eval()
    rnn = isinstance(model, RnnTranslator)
    with capture_attention(model, ["attention" if rnn else "*multihead_attn"]) as weights:
        model(batch["src"], batch["tgt_in"])
    if rnn:  # one call per target position: attention, attention.call1, ... -> (B, 1, T, S)
        weights = {"attention": [torch.cat([calls[0] for calls in weights.values()], dim=-2)]}
    src, tgt_out = batch["src"], batch["tgt_out"]
    wanted = TGT_TO_SRC[tgt_out]  # (B, T): the source word id each position must look up; -1 for eos and pad
    correct = (src[:, None, :] == wanted[:, :, None]) & (wanted[:, :, None] > 0)  # (B, T, S)
    words = wanted > 0
    uniform = (correct.sum(-1) / (src != PAD).sum(-1, keepdim=True))[words].mean().item()
    return {
        name: ((calls[0].mean(dim=1) * correct).sum(-1)[words].mean().item(), uniform)
        for name, calls in weights.items()
    }


def main() -> None:
    """Train, then print the wall time, the accuracy, the TensorBoard tags and how well cross-attention aligns."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", default="runs", help="TensorBoard root directory")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=None, help="default: 1e-3 (transformer), 3e-3 (rnn)")
    parser.add_argument("--model", choices=["transformer", "rnn"], default="transformer")
    args = parser.parse_args()
    start = time.perf_counter()
    torch.set_num_threads(2)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")  # toy data: worker processes cost more
    warnings.filterwarnings("ignore", r".*isinstance\(treespec, LeafSpec\).*")  # lightning vs newer torch
    lightning.seed_everything(args.seed, verbose=False)

    generator = torch.Generator().manual_seed(args.seed)
    train = DataLoader(make_pairs(TRAIN_SIZE, generator), batch_size=64, shuffle=True, collate_fn=collate)
    val_pairs = make_pairs(VAL_SIZE, generator)
    val = DataLoader(val_pairs, batch_size=128, collate_fn=collate)
    model_class = RnnTranslator if args.model == "rnn" else ToyTranslator
    lr = {} if args.lr is None else {"lr": args.lr}
    model = model_class(len(SRC_VOCAB), len(TGT_VOCAB), **lr)
    streams = {
        "transformer.encoder.*": ("src", "src"),
        "*decoder*self_attn": ("tgt_in", "tgt_in"),
        # Cross-attention queries are labelled by the token each decoder position *emits* (tgt_out), not the one it
        # reads (tgt_in): the position holding tgt_in[i] has to look up the source word that translates to
        # tgt_out[i]. Labelled that way, the (target word x source word) map should sharpen into the dictionary, one
        # bright cell per row; labelled by tgt_in it would show each word attending to its neighbour's source.
        "*multihead_attn": ("tgt_out", "src"),
    }
    if args.model == "rnn":
        streams = {"attention": ("tgt_out", "src")}  # step t of the decoder loop is target position t

    monitor = AttentionMonitor(
        vocab_size={"src": len(SRC_VOCAB), "tgt_in": len(TGT_VOCAB), "tgt_out": len(TGT_VOCAB)},
        token_ids={"src": "src", "tgt_in": "tgt_in", "tgt_out": "tgt_out"},
        id_to_token={"src": SRC_VOCAB, "tgt_in": TGT_VOCAB, "tgt_out": TGT_VOCAB},
        ignore_ids=[PAD],
        attention_streams=streams,
        sink_ids={"tgt_in": [BOS]},  # how much decoder self-attention parks on <bos>
        probe="first",  # one fixed validation sentence, drawn every epoch (the loader below does not shuffle)
        export="pt",  # raw sums per epoch, for `python -m attn_callbacks compare`
    )
    logger = TensorBoardLogger(args.logdir, name="toy_translation")
    trainer = Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=1,
        logger=logger,
        callbacks=[monitor],
        log_every_n_steps=10,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        deterministic=True,
    )
    trainer.fit(model, train, val)

    accuracy = float(trainer.callback_metrics["val_acc"])
    alignment = dictionary_alignment(model, collate(val_pairs))
    events = event_accumulator.EventAccumulator(
        logger.log_dir,
        size_guidance={event_accumulator.IMAGES: 0, event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0},
    )
    events.Reload()

    print(f"wall time: {time.perf_counter() - start:.1f} s")
    print(f"final val accuracy: {accuracy:.3f}")
    print(f"log directory: {Path(logger.log_dir)}  (tensorboard --logdir {args.logdir})")
    for kind, tags in events.Tags().items():
        if isinstance(tags, list) and tags:  # hundreds of tags: their families, each a section in TensorBoard
            families = sorted({tag.split("/")[0] for tag in tags})
            print(f"{kind}: {len(tags)} tags in {len(families)} families: {', '.join(families)}")
    last = list(alignment)[-1]
    share, chance = alignment[last]
    print(f"cross-attention on the dictionary word: {share:.2f} ({last}; uniform attention would give {chance:.2f})")
    print(f"\n{last}, per epoch (lift: x more than chance; drift: JS divergence of rows, nats)")
    print("epoch  lift   drift vs prev  drift vs epoch 0")
    lift = events.Scalars(f"attention_lift/{last}")
    drift = {e.step: e.value for e in events.Scalars(f"attention_drift/js_prev/{last}")}
    drift_ref = {e.step: e.value for e in events.Scalars(f"attention_drift/js_ref/{last}")}
    for epoch, event in enumerate(lift):
        prev, ref = drift.get(event.step), drift_ref.get(event.step)
        shown = [f"{value:.4f}" if value is not None else "-" for value in (prev, ref)]  # none at the first epoch
        print(f"{epoch:>5}  {event.value:5.2f}  {shown[0]:>13}  {shown[1]:>16}")
    exports = sorted((Path(logger.log_dir) / "attention_epochs").glob("*.pt"))
    if len(exports) > 1:
        print(f"\ncompare two epochs: python -m attn_callbacks compare {exports[0]} {exports[-1]}")


if __name__ == "__main__":
    main()
