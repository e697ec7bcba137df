"""AttentionMonitor end to end, the epoch sums against independent references: weights captured by hand,
cross-attention streams, NaN rows, sinks and position statistics, several validation dataloaders."""

import math
import warnings

import pytest
import torch
from _callback_helpers import (
    LENGTH,
    PAD,
    VOCAB,
    Recorder,
    Seq2Seq,
    TinyEncoder,
    last_scalars,
    loaders,
    make_batches,
    no_hooks,
    trainer,
)
from _reference import (
    accumulate_attention_reference,
    add_loop_sums,
    copied,
    naive_position_sums,
    naive_uniform,
    returned,
)
from lightning.pytorch import LightningModule, seed_everything
from torch import nn
from torch.utils.data import DataLoader

from attn_callbacks import AttentionMonitor
from attn_callbacks.functional import attention_mass


def test_callback_sums_equal_reference_from_manually_captured_weights(tmp_path):
    seed_everything(0)
    monitor = Recorder(VOCAB, "input_ids", ignore_ids=[PAD])
    model = TinyEncoder()
    _, val = loaders()
    t = trainer(tmp_path, [monitor])
    t.validate(model, val)
    stats = monitor.last["encoder.layers.1.self_attn"]
    # reference: per-head weights recomputed directly from the layer with need_weights=True, loop-accumulated
    S = torch.zeros(2, VOCAB, VOCAB, dtype=torch.float64)
    Q = torch.zeros(VOCAB, dtype=torch.float64)
    with torch.no_grad():
        for batch in make_batches(seed=1):
            ids = batch["input_ids"]
            x = model.encoder.layers[0](model.embed(ids), src_key_padding_mask=ids == PAD)
            attn = model.encoder.layers[1].self_attn
            _, w = attn(x, x, x, key_padding_mask=ids == PAD, need_weights=True, average_attn_weights=False)
            add_loop_sums(S, Q, ids, w, PAD)
    torch.testing.assert_close(stats.attention_sum.double(), S, rtol=1e-4, atol=1e-5)
    assert torch.equal(stats.query_count.double(), Q)
    P = stats.attention_mass
    seen = Q > 0
    torch.testing.assert_close(P.sum(-1)[:, seen], torch.ones(2, int(seen.sum())), rtol=1e-5, atol=1e-5)
    assert no_hooks(model)


class SharpCausal(LightningModule):
    """One nn.MultiheadAttention called with a causal mask and a padding mask, its query projection scaled up:
    logits hundreds apart, so that float32's softmax rounds most keys' weights to exactly 0 in both heads."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.attn = nn.Embedding(VOCAB, 16), nn.MultiheadAttention(16, 2, batch_first=True)
        with torch.no_grad():
            self.attn.in_proj_weight[:16] *= 400

    def forward(self, ids, need_weights=False):
        x = self.embed(ids)
        future = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).triu(1)  # True: may not attend
        padding = ids == PAD
        return self.attn(x, x, x, padding, need_weights, future, average_attn_weights=False)

    def validation_step(self, batch, batch_idx):
        self(batch["input_ids"])


def test_callback_sharp_mha_counts_every_key_its_masks_allow_in_the_baseline_and_max_entropy(tmp_path):
    """U and Σ log n count the keys that nn.MultiheadAttention's causal and padding masks allow, also where float32
    rounded their weight to 0 in both heads; against the float64 twin, which rounds none of them."""
    monitor = Recorder(VOCAB, "input_ids", ignore_ids=[PAD])
    model = SharpCausal()
    trainer(tmp_path, [monitor]).validate(model, loaders()[1])
    stats = monitor.last["attn"]
    twin = SharpCausal().double()
    U = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    position = torch.zeros(6, 2, dtype=torch.float64)
    underflowed = 0
    with torch.no_grad():
        for batch in make_batches(seed=1):
            ids = batch["input_ids"]
            valid = ids != PAD
            _, weights = twin(ids, need_weights=True)  # float64: no allowed key rounds to 0
            allowed = torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril() & valid[:, None, :]
            assert ((weights.amax(dim=1) > 0) == allowed).all()
            _, single = model(ids, need_weights=True)
            underflowed += int((allowed & (single.amax(dim=1) == 0)).sum())
            U += naive_uniform(weights, ids, ids, valid, valid, VOCAB, VOCAB)
            position += naive_position_sums(weights, valid, valid)
    assert underflowed > 20
    torch.testing.assert_close(stats.uniform_sum.double(), U, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats.position_sums[1].double(), position[1], rtol=1e-5, atol=1e-5)  # Σ log n


class RunsTwice(TinyEncoder):
    """validation_step runs the model twice on the batch (once for the loss, once for the predictions, say)."""

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self(batch["input_ids"])
        return super().validation_step(batch, batch_idx, dataloader_idx)


def test_callback_a_module_run_twice_in_a_batch_adds_both_calls_and_is_warned_about(tmp_path):
    """Both calls add into the module's one set of sums, each query token counted once per call, and the warning
    names the module (an encoder run on a second input would be mapped to the wrong ids). One call: no warning."""
    sums = {}
    for model_class in (TinyEncoder, RunsTwice):
        seed_everything(0)
        monitor = Recorder(VOCAB, "input_ids", ignore_ids=[PAD])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer(tmp_path / model_class.__name__, [monitor]).validate(model_class(), loaders()[1])
        said = [str(w.message) for w in caught if "times in one validation batch" in str(w.message)]
        sums[model_class] = monitor.last, said
    (once, silent), (twice, said) = sums[TinyEncoder], sums[RunsTwice]
    assert not silent and len(said) == 2  # once per module
    assert "'encoder.layers.0.self_attn' ran 2 times in one validation batch; every call adds into its" in said[0]
    for name, stats in twice.items():
        assert torch.equal(stats.query_count, 2 * once[name].query_count)
        torch.testing.assert_close(stats.attention_sum, 2 * once[name].attention_sum)


class MasksInPlace(TinyEncoder):
    """validation_step masks every third token of the batch in place (MLM style), then runs the model."""

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        batch["input_ids"][:, ::3] = 1
        return super().validation_step(batch, batch_idx, dataloader_idx)


@pytest.mark.parametrize("tracked", [False, True])
def test_callback_counts_the_ids_of_the_batch_start_when_validation_step_edits_them_in_place(tmp_path, tracked):
    """Every stream, tracked or not, of any dtype, is read as it was when the batch started."""
    expected = torch.zeros(VOCAB, dtype=torch.int64)
    for batch in make_batches(seed=1):  # the validation batches, counted before validation_step edits them
        ids = batch["input_ids"]
        expected += torch.bincount(ids[ids != PAD], minlength=VOCAB)
    kwargs = {"tracked_ids": list(range(VOCAB))} if tracked else {}
    monitor = Recorder(VOCAB, "input_ids", ignore_ids=[PAD], **kwargs)
    trainer(tmp_path, [monitor]).validate(MasksInPlace(), loaders()[1])
    for stats in monitor.last.values():
        assert torch.equal(stats.query_count[:VOCAB], expected)


@pytest.mark.parametrize("batch_first", [True, False])
def test_callback_cross_attention_streams_for_nn_transformer(tmp_path, batch_first):
    seed_everything(0)
    g = torch.Generator().manual_seed(0)
    batches = [{"src": torch.randint(0, 7, (3, 5), generator=g), "tgt": torch.randint(0, 9, (3, 4), generator=g)}]
    if not batch_first:
        batches = [{k: v.T for k, v in b.items()} for b in batches]
    monitor = Recorder({"src": 7, "tgt": 9}, {"src": "src", "tgt": "tgt"}, batch_first=batch_first)
    model = Seq2Seq(batch_first=batch_first)
    trainer(tmp_path, [monitor]).validate(model, DataLoader(batches, batch_size=None))
    cross = monitor.last["transformer.decoder.layers.0.multihead_attn"]
    assert cross.attention_sum.shape == (2, 9, 7)
    b = batches[0] if batch_first else {k: v.T for k, v in batches[0].items()}
    assert torch.equal(cross.query_count, torch.bincount(b["tgt"].flatten(), minlength=9))
    # cross-attention rows sum to 1 over the source vocabulary for every target token seen
    seen = cross.query_count > 0
    torch.testing.assert_close(cross.attention_mass[:, seen].sum(-1), torch.ones(2, int(seen.sum())))
    # decoder self-attention is causal: the first target token attends only to itself
    dec = monitor.last["transformer.decoder.layers.0.self_attn"]
    assert dec.attention_sum.shape == (2, 9, 9)
    # reference from the captured weights through the functional core
    with torch.no_grad():
        src, tgt = b["src"], b["tgt"]
        memory = model.transformer.encoder(model.src_embed(src if batch_first else src.T))
        x = model.transformer.decoder.layers[0]
        tgt_x = model.tgt_embed(tgt if batch_first else tgt.T)
        mask = nn.Transformer.generate_square_subsequent_mask(4)
        h = x.norm1(tgt_x + x._sa_block(tgt_x, mask, None, is_causal=True))
        _, w = x.multihead_attn(h, memory, memory, need_weights=True, average_attn_weights=False)
    S, C, Q = torch.zeros(2, 9, 7), torch.zeros(9, 7, dtype=torch.long), torch.zeros(9, dtype=torch.long)
    ones = torch.ones_like
    accumulate_attention_reference(S, C, Q, w, tgt, src, ones(tgt, dtype=torch.bool), ones(src, dtype=torch.bool))
    torch.testing.assert_close(cross.attention_mass, attention_mass(S, Q), rtol=1e-5, atol=1e-6)


class MaskedRowModel(LightningModule):
    """Query position 1 may see no key at all: its attention row is NaN on PyTorch's normal path."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def validation_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        mask = torch.zeros(ids.shape[1], ids.shape[1], dtype=torch.bool, device=ids.device)
        mask[1] = True  # True = not allowed to attend
        x = self.embed(ids)
        self.attn(x, x, x, attn_mask=mask, need_weights=False)


def test_callback_nan_rows_are_counted_skipped_and_warned_once(tmp_path):
    ids = torch.randint(1, VOCAB, (3, LENGTH), generator=torch.Generator().manual_seed(0))
    monitor = Recorder(VOCAB, "input_ids")
    t = trainer(tmp_path, [monitor])
    with pytest.warns(
        UserWarning, match="6 query rows of attention module 'attn' had non-finite or all-zero weights"
    ) as record:
        t.validate(MaskedRowModel(), DataLoader([{"input_ids": ids}] * 2, batch_size=None), verbose=False)
    assert sum("non-finite" in str(w.message) for w in record) == 1
    stats = monitor.last["attn"]
    assert int(stats.skipped_rows) == 6 and float(t.callback_metrics["attention_skipped_rows/attn"]) == 6.0
    assert int(stats.query_count.sum()) == 2 * 3 * (LENGTH - 1)  # the NaN rows are not counted as queries
    assert torch.isfinite(stats.attention_sum).all()
    seen = stats.query_count > 0
    torch.testing.assert_close(stats.attention_mass.sum(-1)[:, seen], torch.ones(2, int(seen.sum())))


class SinkModel(LightningModule):
    """Every query may only see key position 0, which always holds token 0 (BOS): all attention is on the sink."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def validation_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        mask = torch.full((ids.shape[1], ids.shape[1]), float("-inf"), device=ids.device)
        mask[:, 0] = 0.0
        x = self.embed(ids)
        self.attn(x, x, x, attn_mask=mask, need_weights=False)


def test_callback_sink_mass_and_position_statistics_of_a_model_forced_onto_token_0(tmp_path):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (8, LENGTH), generator=g)
    ids[:, 0] = 0
    batches = [{"input_ids": ids[:4]}, {"input_ids": ids[4:]}]
    monitor = Recorder(VOCAB, "input_ids", sink_ids=[0], entropy_collapse_threshold=0.1)
    t = trainer(tmp_path, [monitor])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.validate(SinkModel(), DataLoader(batches, batch_size=None), verbose=False)
    # Each row sees one key: its entropy is 0 of a maximum log 1 = 0, no collapse, and the ratio 0 / 0 is left out.
    assert not [w for w in caught if "normalised entropy" in str(w.message)]
    logged = last_scalars(t.logger.log_dir)
    assert not [tag for tag in logged if "entropy_normalized" in tag]
    expected = {
        "sink_mass": 1.0,  # every row puts all its weight on token 0
        "entropy": 0.0,
        "self": 1 / LENGTH,  # only row i = 0 looks at itself
        "previous": 1 / LENGTH,  # only row i = 1 looks at i - 1 = 0
        "next": 0.0,
        "distance": sum(range(LENGTH)) / LENGTH,  # row i looks |i - 0| = i away
    }
    for stat, value in expected.items():
        for tag in ("attention_position/{}/attn", "attention_position_heads/{}/attn/head_0", "{}/attn/head_1"):
            tag = tag if tag.startswith("attention") else f"attention_position_heads/{tag}"
            assert math.isclose(logged[tag.format(stat)], value, abs_tol=1e-6), stat
    # The mask leaves one visible key per row, so uniform attention would do the same: lift exactly 1.
    assert math.isclose(logged["attention_lift/attn"], 1.0, rel_tol=1e-6)
    stats = monitor.last["attn"]
    assert torch.equal(stats.uniform_sum[:, 0], stats.query_count.float())


class LoaderRecorder(AttentionMonitor):
    def on_validation_epoch_end(self, trainer, pl_module):
        self.views = getattr(self, "views", {})

        def keep(result):
            per_loader, merged = result
            self.views.update({(name, ""): copied(stats) for name, stats in merged.items()})
            if len(per_loader) > len(merged):
                self.views.update({(name, f"/dataloader_idx_{k}"): copied(s) for (name, k), s in per_loader.items()})

        with returned(self._sums, "collect", keep):
            super().on_validation_epoch_end(trainer, pl_module)


def test_callback_multiple_validation_dataloaders_kept_apart_and_combined(tmp_path):
    seed_everything(0)
    model = TinyEncoder()
    first, second = make_batches(seed=1), make_batches(n=8, seed=2)
    monitor = LoaderRecorder(VOCAB, "input_ids", ignore_ids=[PAD], per_head=False)
    loader = lambda batches: DataLoader(batches, batch_size=None)  # noqa: E731
    t = trainer(tmp_path, [monitor])
    t.validate(model, [loader(first), loader(second)], verbose=False)
    alone = []
    for batches in (first, second):
        single = LoaderRecorder(VOCAB, "input_ids", ignore_ids=[PAD], per_head=False)
        trainer(tmp_path, [single]).validate(model, loader(batches), verbose=False)
        alone.append(single.views[("encoder.layers.0.self_attn", "")])
    views = {suffix: stats for (name, suffix), stats in monitor.views.items() if name == "encoder.layers.0.self_attn"}
    assert sorted(views) == ["", "/dataloader_idx_0", "/dataloader_idx_1"]
    for idx in range(2):
        torch.testing.assert_close(views[f"/dataloader_idx_{idx}"].attention_sum, alone[idx].attention_sum)
    combined = views[""]
    torch.testing.assert_close(combined.attention_sum, alone[0].attention_sum + alone[1].attention_sum)
    assert torch.equal(combined.query_count, alone[0].query_count + alone[1].query_count)
    torch.testing.assert_close(
        combined.attention_mass, attention_mass(combined.attention_sum, combined.query_count), rtol=0, atol=0
    )
    tags = [k for k in t.callback_metrics if k.startswith("attention_entropy/encoder.layers.0.self_attn")]
    assert sorted(tags) == [
        "attention_entropy/encoder.layers.0.self_attn",
        "attention_entropy/encoder.layers.0.self_attn/dataloader_idx_0",
        "attention_entropy/encoder.layers.0.self_attn/dataloader_idx_1",
    ]
