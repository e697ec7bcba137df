"""scaled_dot_product_attention calls: recomputed weights against float64 loops, outputs untouched, names, and the
monitor's position statistics on a nanoGPT-style model against an eager float64 reference."""

import functools
import math
import subprocess
import sys
import warnings
from pathlib import Path

import numba
import pytest
import torch
import torch.nn.functional as F
from _reference import ACCELERATOR, naive_accumulate, naive_position_sums, naive_uniform
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from tensorboard.backend.event_processing.event_accumulator import IMAGES, SCALARS, EventAccumulator
from torch import nn
from torch.nn.functional import scaled_dot_product_attention as sdpa_alias
from torch.utils.data import DataLoader

from attn_callbacks import AttentionMonitor, capture_attention, find_attention_modules, load_epoch
from attn_callbacks.capture import hooks
from attn_callbacks.capture.hooks import AttentionCapture
from attn_callbacks.capture.sdpa import SdpaWatch, calls_sdpa, sdpa_weights


def naive_weights(q, k, mask=None, causal=False, scale=None, gqa=False):
    """float64 loop over (sample, head, query) of softmax(q·k * scale + bias), as the SDPA docs define it."""
    q, k = q.double(), k.double()
    b_, hq, lq, e = q.shape
    hk, lk = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(e) if scale is None else scale
    out = torch.zeros(b_, hq, lq, lk, dtype=torch.float64)
    for n in range(b_):
        for h in range(hq):
            kh = h // (hq // hk) if gqa else h
            for i in range(lq):
                scores = []
                for j in range(lk):
                    s = sum(float(q[n, h, i, x]) * float(k[n, kh, j, x]) for x in range(e)) * scale
                    if causal and j > i:
                        s = -math.inf
                    if mask is not None:
                        m = mask.expand(b_, hq, lq, lk)[n, h, i, j]
                        s = (s if bool(m) else -math.inf) if mask.dtype == torch.bool else s + float(m)
                    scores.append(s)
                top = max(scores)
                if top == -math.inf:
                    out[n, h, i] = math.nan
                    continue
                exps = [math.exp(s - top) for s in scores]
                out[n, h, i] = torch.tensor([x / sum(exps) for x in exps], dtype=torch.float64)
    return out


CASES = {
    "plain": dict(),
    "scale": dict(scale=0.3),
    "causal_short_queries": dict(causal=True, lq=3),
    "causal_long_queries": dict(causal=True, lq=7, lk=5),
    "bool_padding_mask": dict(mask="bool"),
    "float_mask": dict(mask="float"),
    "gqa": dict(gqa=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sdpa_weights_equal_a_float64_loop_and_reproduce_the_calls_output(case):
    spec = CASES[case]
    g = torch.Generator().manual_seed(0)
    b_, hq, lq, lk, e = 2, 4, spec.get("lq", 5), spec.get("lk", 5), 8
    hk = 2 if spec.get("gqa") else hq
    q, k, v = (torch.randn(b_, h, n, e, generator=g) for h, n in ((hq, lq), (hk, lk), (hk, lk)))
    mask = None
    if spec.get("mask") == "bool":
        mask = torch.ones(b_, 1, lq, lk, dtype=torch.bool)
        mask[1, :, :, -2:] = False  # the second sample's last two keys are padding
    elif spec.get("mask") == "float":
        mask = torch.randn(1, hq, lq, lk, generator=g)
    kwargs = dict(attn_mask=mask, is_causal=spec.get("causal", False), scale=spec.get("scale"))
    got = sdpa_weights(q, k, enable_gqa=spec.get("gqa", False), **kwargs)
    want = naive_weights(q, k, mask, spec.get("causal", False), spec.get("scale"), spec.get("gqa", False))
    finite = want.isfinite()
    assert torch.equal(got.isfinite(), finite)  # rows that see no key are NaN in both
    torch.testing.assert_close(got.double()[finite], want[finite], atol=1e-6, rtol=1e-6)
    if finite.all():  # the weights are the ones SDPA applied to the values
        v_rep = v.repeat_interleave(hq // hk, dim=1) if spec.get("gqa") else v
        out = F.scaled_dot_product_attention(
            q.double(),
            k.double(),
            v.double(),
            enable_gqa=spec.get("gqa", False),
            **{**kwargs, "attn_mask": None if mask is None else mask if mask.dtype == torch.bool else mask.double()},
        )
        torch.testing.assert_close(want @ v_rep.double(), out, atol=1e-10, rtol=1e-10)


class Attention(nn.Module):
    """nanoGPT's causal self-attention, with no head-count attribute of the usual names."""

    def __init__(self, dim=16, heads=4, eager=False):
        super().__init__()
        self.qkv, self.proj, self.h, self.eager = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), heads, eager

    def forward(self, x):
        b_, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b_, t, self.h, c // self.h).transpose(1, 2) for z in (q, k, v))  # (B, H, T, C/H)
        if self.eager:  # the float64 reference: the same weights, computed by hand
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
            scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
            self.weights = torch.softmax(scores, dim=-1)
            y = self.weights @ v
        else:
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b_, t, c))


class Block(nn.Module):
    def __init__(self, dim=16, heads=4, eager=False):
        super().__init__()
        self.ln, self.attn, self.mlp = nn.LayerNorm(dim), Attention(dim, heads, eager), nn.Linear(dim, dim)

    def forward(self, x):
        x = x + self.attn(self.ln(x))
        return x + self.mlp(x)


class TinyGPT(nn.Module):
    def __init__(self, vocab=12, dim=16, heads=4, layers=2, eager=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, eager) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    @torch.no_grad()
    def generate(self, ids, new_tokens):
        """nanoGPT's: the model run again on the whole prefix for each new token, greedily."""
        for _ in range(new_tokens):
            ids = torch.cat([ids, self(ids)[:, -1:].argmax(-1)], dim=1)
        return ids


class Lit(LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.outputs = []

    def validation_step(self, batch, batch_idx):
        self.outputs.append(self.model(batch["ids"]))


def gpt_batches(vocab=12, n=6, length=9, batch_size=3):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (n, length), generator=g)
    return [{"ids": ids[i : i + batch_size]} for i in range(0, n, batch_size)]


def run(tmp_path, model, monitor, batches):
    lit = Lit(model)
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator=ACCELERATOR,
        logger=TensorBoardLogger(tmp_path, name="tb") if monitor else False,
        callbacks=[monitor] if monitor else [],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.validate(lit, DataLoader(batches, batch_size=None), verbose=False)
    return lit.outputs, trainer


def scalars(trainer):
    events = EventAccumulator(trainer.logger.log_dir, size_guidance={SCALARS: 0})
    events.Reload()
    return {tag: events.Scalars(tag)[-1].value for tag in events.Tags()["scalars"]}


def test_monitor_reads_nanogpt_style_model_as_float64_eager_twin_outputs_untouched(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT().eval()
    batches = gpt_batches()
    plain, _ = run(tmp_path / "plain", model, None, batches)
    monitored, trainer = run(tmp_path / "mon", model, AttentionMonitor(vocab_size=12, token_ids="ids"), batches)
    assert all(torch.equal(a, b) for a, b in zip(plain, monitored, strict=True))  # bit-identical outputs

    twin = TinyGPT(eager=True).double().eval()
    twin.load_state_dict(model.state_dict())
    sums = {name: torch.zeros(6, 4, dtype=torch.float64) for name in ("0", "1")}
    rows = 0
    with torch.no_grad():
        for batch in batches:
            twin(batch["ids"])
            valid = torch.ones_like(batch["ids"], dtype=torch.bool)
            rows += valid.sum()
            for layer, block in enumerate(twin.blocks):
                sums[str(layer)] += naive_position_sums(block.attn.weights, valid, valid)
    logged = scalars(trainer)
    for layer, position in sums.items():
        name = f"model.blocks.{layer}.attn"
        for stat, row in (("entropy", 0), ("previous", 3)):
            heads = position[row] / rows
            assert logged[f"attention_position/{stat}/{name}"] == pytest.approx(float(heads.mean()), abs=1e-4)
            for h in range(4):
                got = logged[f"attention_position_heads/{stat}/{name}/head_{h}"]
                assert got == pytest.approx(float(heads[h]), abs=1e-4)


class Sharp(LightningModule):
    """A causal nanoGPT-style model whose query weights are scaled up: logits hundreds apart, so that float32's
    softmax rounds most keys' weights to exactly 0 in every head."""

    def __init__(self, eager=False):
        super().__init__()
        torch.manual_seed(3)
        self.model = TinyGPT(heads=2, layers=1, eager=eager)
        with torch.no_grad():
            self.model.blocks[0].attn.qkv.weight[:16] *= 400

    def validation_step(self, batch, batch_idx):
        self.model(batch["ids"])


def test_sharp_sdpa_attention_counts_every_key_its_mask_allows_in_the_baseline_and_max_entropy(tmp_path):
    """U and Σ log n (the maximum entropy) count the keys the causal mask allows, also where float32 rounded their
    weight to 0 in both heads (weights alone would call them masked: lift and normalised entropy would read as if the
    rows saw fewer keys). Against the float64 twin, which rounds none of them."""
    batches = gpt_batches()
    monitor = AttentionMonitor(vocab_size=12, token_ids="ids", export="pt")
    Trainer(
        default_root_dir=tmp_path, accelerator=ACCELERATOR, logger=TensorBoardLogger(tmp_path, name="tb"),
        callbacks=[monitor], enable_progress_bar=False, enable_model_summary=False,
    ).validate(Sharp(), DataLoader(batches, batch_size=None), verbose=False)  # fmt: skip
    stats = load_epoch(next((tmp_path / "tb").rglob("*.pt"))).modules["model.blocks.0.attn"]
    twin = Sharp(eager=True).double()
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    U = torch.zeros(12, 12, dtype=torch.float64)
    position = torch.zeros(6, 2, dtype=torch.float64)
    underflowed = 0
    with torch.no_grad():
        for batch in batches:
            ids, valid = batch["ids"], torch.ones_like(batch["ids"], dtype=torch.bool)
            twin.model(ids)
            weights = twin.model.blocks[0].attn.weights  # float64: no allowed key rounds to 0
            assert ((weights.amax(dim=1) > 0) == causal).all()
            underflowed += int((causal & (weights.float().amax(dim=1) == 0)).sum())
            U += naive_uniform(weights, ids, ids, valid, valid, 12, 12)
            position += naive_position_sums(weights, valid, valid)
    assert underflowed > 50  # in float32, as the monitor recomputes them
    torch.testing.assert_close(stats.uniform_sum.double(), U, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats.position_sums[1].double(), position[1], rtol=1e-5, atol=1e-5)  # Σ log n


def test_sdpa_modules_are_found_by_their_code_named_by_the_innermost_watched_module():
    model = TinyGPT()
    assert calls_sdpa(model.blocks[0].attn) and not calls_sdpa(model.blocks[0])
    assert list(find_attention_modules(model)) == ["blocks.0.attn", "blocks.1.attn"]
    assert list(find_attention_modules(model, ["blocks.1.*"])) == ["blocks.1.attn"]
    seen = []
    capture = AttentionCapture(find_attention_modules(model), lambda *call: seen.append((call[0], call[3])))
    with capture, capture.watching(), torch.no_grad():
        model(torch.zeros(2, 5, dtype=torch.long))
        model(torch.zeros(1, 5, dtype=torch.long))
    # the k-th call of a module is named apart; rows: the samples of the call
    assert seen == [
        ("blocks.0.attn", slice(0, 2)),
        ("blocks.1.attn", slice(0, 2)),
        ("blocks.0.attn.call1", slice(0, 1)),
        ("blocks.1.attn.call1", slice(0, 1)),
    ]
    assert capture.calls == {"blocks.0.attn": 2, "blocks.1.attn": 2}


def causal_attention(q, k, v):
    """A helper of the model's file, as many codebases have one."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class OneHead(nn.Module):
    """Causal self-attention of one head; subclasses make the SDPA call in other ways (the base names none)."""

    def __init__(self, dim=8):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        q, k, v = self.qkv(x)[:, None].chunk(3, dim=-1)  # (B, 1, L, E) each
        return self.attend(q, k, v)[:, 0]


class ByAlias(OneHead):
    def attend(self, q, k, v):
        return sdpa_alias(q, k, v, is_causal=True)


class ByHelper(OneHead):
    def attend(self, q, k, v):
        return causal_attention(q, k, v)


def by_closure():
    call = F.scaled_dot_product_attention

    class ByClosure(OneHead):
        def attend(self, q, k, v):
            return call(q, k, v, is_causal=True)

    return ByClosure()


class ByHand(OneHead):
    def attend(self, q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v * scale_of(1.0)


@numba.njit
def scale_of(x):  # a numba helper of the model's file: a __code__, but no closure, and nothing to read in it
    return x


class Opaque:
    """A global whose attributes raise: detection must look past it."""

    def __getattr__(self, name):
        raise RuntimeError(f"no {name} here")

    def __call__(self, x):
        return x


opaque = Opaque()


class ByHandOpaque(ByHand):
    def attend(self, q, k, v):
        return opaque(super().attend(q, k, v))


def test_sdpa_called_under_another_name_or_through_a_helper_is_found_and_read():
    torch.manual_seed(0)
    model = nn.ModuleDict({"alias": ByAlias(), "helper": ByHelper(), "closure": by_closure(), "hand": ByHand()})
    assert [calls_sdpa(module) for module in model.values()] == [True, True, True, False]
    assert not calls_sdpa(ByHandOpaque())
    assert list(find_attention_modules(model)) == ["alias", "helper", "closure", "hand"]  # the last by its softmax
    x = torch.randn(2, 4, 8)
    with torch.no_grad(), capture_attention(model) as weights:
        for module in model.values():
            module(x)
    for name in ("alias", "helper", "closure", "hand"):
        q, k, _ = model[name].qkv(x)[:, None].chunk(3, dim=-1)
        (got,) = weights[name]
        want = naive_weights(q.detach(), k.detach(), causal=name != "hand", scale=1.0 if name == "hand" else None)
        torch.testing.assert_close(got.double(), want)


class Hidden(OneHead):
    """Calls the function by a name its code does not hold: no static look can find it."""

    def attend(self, q, k, v):
        return getattr(F, "_".join(["scaled", "dot", "product", "attention"]))(q, k, v)


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.gpt, self.hidden = TinyGPT(), Hidden(16)

    def forward(self, ids):
        return self.hidden(self.gpt.emb(ids))


def test_sdpa_called_where_no_module_was_found_is_warned_about_naming_the_module(tmp_path):
    """One batch after setup is looked at: the hidden call is named; the found modules' calls, selected or not, are
    theirs; the look leaves torch's mode stack as it found it."""
    model = Mixed()

    def validate(*monitors):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lit = Lit(model)
            lit.validation_step = lambda batch, batch_idx: (model.gpt(batch["ids"]), model(batch["ids"]))
            fit = Trainer(default_root_dir=tmp_path, accelerator=ACCELERATOR, callbacks=list(monitors), logger=False)
            fit.validate(lit, DataLoader(gpt_batches(), batch_size=None), verbose=False)
        assert torch._C._len_torch_function_stack() == 0
        return [str(w.message) for w in caught if "setup found no attention module there" in str(w.message)]

    said = validate(AttentionMonitor(12, "ids", modules=["model.gpt.blocks.0.attn"]))  # blocks.1: found, not kept
    assert len(said) == 1 and said[0].startswith(
        "AttentionMonitor: 'model.hidden' (Hidden) called scaled_dot_product_attention in a monitored batch"
    )
    assert len(validate(AttentionMonitor(12, "ids", prefix="a"), AttentionMonitor(12, "ids", prefix="b"))) == 1
    model.hidden = ByHelper(16)  # found: nothing to say
    assert validate(AttentionMonitor(12, "ids")) == []


def test_watch_hands_large_calls_on_a_few_samples_at_a_time():
    model = TinyGPT()
    chunks = []
    watch = SdpaWatch({"attn": model.blocks[0].attn}, lambda *call: chunks.append((call[3].shape, call[4])))
    watch.chunk_bytes = 3 * 4 * 5 * 5 * 4 * 2  # two samples' weights and temporaries
    ids = torch.randint(0, 12, (5, 5))
    with watch, torch.no_grad():
        model(ids)
    assert chunks == [((2, 4, 5, 5), slice(0, 2)), ((2, 4, 5, 5), slice(2, 4)), ((1, 4, 5, 5), slice(4, 5))]
    with capture_attention(model) as whole, torch.no_grad():  # capture_attention joins the chunks of a call
        model(ids)
    assert whole["blocks.0.attn"][0].shape == (5, 4, 5, 5)


def test_monitor_maps_each_chunk_of_a_large_sdpa_call_to_its_own_samples(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = TinyGPT().eval()
    whole = scalars(run(tmp_path / "whole", model, AttentionMonitor(vocab_size=12, token_ids="ids"), gpt_batches())[1])
    one_sample = 3 * 4 * 9 * 9 * 4  # the watch's bytes for one sample: chunks of one
    monkeypatch.setattr(hooks, "SdpaWatch", functools.partial(SdpaWatch, chunk_bytes=one_sample))
    chunked = scalars(
        run(tmp_path / "chunk", model, AttentionMonitor(vocab_size=12, token_ids="ids"), gpt_batches())[1]
    )
    assert chunked.keys() == whole.keys() and len(whole) > 50
    for tag, value in whole.items():
        assert chunked[tag] == pytest.approx(value, rel=1e-5, abs=1e-6), tag


class PerSample(nn.Module):
    """Runs each sample through the blocks on its own: every SDPA call sees one sample of the batch."""

    def __init__(self):
        super().__init__()
        self.gpt = TinyGPT()

    def forward(self, ids):
        return torch.cat([self.gpt(row) for row in ids.split(1)])


def test_sdpa_called_on_one_sample_of_the_batch_at_a_time_is_refused(tmp_path):
    expected = r"'model.gpt.blocks.0.attn' ran on a batch of 1 samples.*\(3, 9\).*hold 3 and 3.*`modules`"
    with pytest.raises(ValueError, match=expected):
        run(tmp_path, PerSample().eval(), AttentionMonitor(vocab_size=12, token_ids="ids"), gpt_batches())


class BiEncoder(nn.Module):
    """Encodes a query and a passage with one encoder, as a bi-encoder does."""

    def __init__(self):
        super().__init__()
        self.gpt = TinyGPT(layers=1)

    def forward(self, ids):
        return self.gpt(ids) + self.gpt(ids.flip(-1)) + self.gpt(ids.roll(1, -1))  # a query and two passages


def test_a_second_sdpa_pass_of_a_module_is_named_apart_and_warned_unless_attention_streams_maps_it(tmp_path):
    with pytest.warns(
        UserWarning, match=r"'model.gpt.blocks.0.attn.call1'.*\('tokens', 'tokens'\).*`attention_streams`"
    ) as caught:
        run(tmp_path / "a", BiEncoder().eval(), AttentionMonitor(vocab_size=12, token_ids="ids"), gpt_batches())
    assert sum("again in the same batch" in str(w.message) for w in caught) == 1  # once per module, not per call
    mapped = AttentionMonitor(vocab_size=12, token_ids="ids", attention_streams={"*.call?": ("tokens", "tokens")})
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*computed attention again")
        run(tmp_path / "b", BiEncoder().eval(), mapped, gpt_batches())


class Dropping(nn.Module):
    """Calls SDPA with dropout whatever its mode, as code that forgets `if self.training` does."""

    def forward(self, x):
        q = x.unflatten(-1, (2, 4)).transpose(1, 2)  # (B, H, L, E)
        return F.scaled_dot_product_attention(q, q, q, dropout_p=0.25)


def test_sdpa_call_with_dropout_warns_once_per_module_naming_it_and_the_rate():
    model = nn.ModuleDict({"a": Dropping(), "b": Dropping()})
    capture = AttentionCapture(find_attention_modules(model), lambda *call: None)
    with pytest.warns(UserWarning) as caught, capture, torch.no_grad():
        for _ in range(3):  # a watch per batch; the warning still once per module
            with capture.watching():
                model["a"](torch.randn(2, 3, 8))
                model["b"](torch.randn(2, 3, 8))
    dropout = [str(w.message) for w in caught if "dropout_p" in str(w.message)]
    assert len(dropout) == 2 and "'a'" in dropout[0] and "'b'" in dropout[1] and "dropout_p=0.25" in dropout[0]
    gpt = TinyGPT()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with capture_attention(gpt) as weights, torch.no_grad():  # dropout_p=0.0: no warning
            gpt(torch.zeros(1, 3, dtype=torch.long))
    assert sorted(weights) == ["blocks.0.attn", "blocks.1.attn"]


def test_watch_is_left_on_every_exit_path():
    model = TinyGPT()
    capture = AttentionCapture(find_attention_modules(model), lambda *call: (_ for _ in ()).throw(ValueError("boom")))
    with pytest.raises(ValueError, match="boom"), capture, capture.watching():
        model(torch.zeros(1, 3, dtype=torch.long))
    assert not torch.overrides._get_current_function_mode_stack()
    capture.attach()
    capture.start_watching()
    capture.detach()  # detaching leaves the watch too
    assert not torch.overrides._get_current_function_mode_stack()
    # Ctrl+C inside a watched forward: its always_call hook catches Exception only, so detaching leaves the watch
    capture = AttentionCapture(find_attention_modules(model), lambda *call: None)
    handle = model.blocks[0].attn.proj.register_forward_pre_hook(lambda *args: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt), capture, capture.watching():
        model(torch.zeros(1, 3, dtype=torch.long))
    handle.remove()
    assert not torch.overrides._get_current_function_mode_stack()
    with torch.no_grad(), capture_attention(model) as weights:  # and the next capture sees every call again
        model(torch.zeros(1, 3, dtype=torch.long))
    assert {name: len(calls) for name, calls in weights.items()} == {"blocks.0.attn": 1, "blocks.1.attn": 1}


def test_flex_attention_is_refused_naming_the_module():
    from torch.nn.attention.flex_attention import flex_attention

    class Flex(nn.Module):
        def forward(self, q):
            return flex_attention(q, q, q)

    with pytest.raises(ValueError, match="'attn' \\(Flex\\) calls flex_attention, which returns no attention weights"):
        find_attention_modules(nn.ModuleDict({"attn": Flex()}))


def test_monitor_refuses_a_model_without_attention_in_setup(tmp_path):
    with pytest.raises(
        MisconfigurationException, match="module computing attention by hand .a softmax and a matrix product. found"
    ):
        run(tmp_path, nn.Linear(3, 3), AttentionMonitor(vocab_size=12, token_ids="ids"), gpt_batches())


class Trained(Lit):
    """Lit with next-token training, so that fit compiles the model in training before any monitored batch."""

    def training_step(self, batch, batch_idx):
        logits = self.model(batch["ids"][:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), batch["ids"][:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fitted(tmp_path, name, model):
    torch.manual_seed(0)
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator=ACCELERATOR,
        max_epochs=2,
        logger=TensorBoardLogger(tmp_path, name=name),
        callbacks=[AttentionMonitor(vocab_size=12, token_ids="ids", min_support=1)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    batches = gpt_batches()
    trainer.fit(Trained(model), DataLoader(batches, batch_size=None), DataLoader(batches, batch_size=None))
    return {tag: value for tag, value in scalars(trainer).items() if tag.startswith("attention_")}


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compiled_sdpa_model_in_fit_with_sanity_check_logs_plain_models_tags_values(tmp_path, backend):
    torch._dynamo.reset()
    torch.manual_seed(0)
    expected = fitted(tmp_path, "plain", TinyGPT())
    torch.manual_seed(0)
    got = fitted(tmp_path, "compiled", torch.compile(TinyGPT(), backend=backend))
    assert got.keys() == expected.keys() and len(got) > 50  # the same names: no "_orig_mod", nothing missed
    for tag, value in expected.items():
        assert math.isclose(got[tag], value, rel_tol=1e-5, abs_tol=1e-6), (tag, got[tag], value)


def test_nanogpt_example_runs_offline_and_shows_previous_byte_heads_forming(tmp_path):
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run(
        [sys.executable, str(root / "examples" / "nanogpt_style.py"), "--logdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    events = EventAccumulator(str(tmp_path / "nanogpt_style" / "version_0"), size_guidance={SCALARS: 0})
    events.Reload()
    previous = {
        tag: [e.value for e in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
        if tag.startswith("attention_position_heads/previous/")
    }
    assert len(previous) == 8 and all(len(values) == 4 for values in previous.values())  # 2 blocks x 4 heads, 4 epochs
    best = max(previous, key=lambda tag: previous[tag][-1])
    assert previous[best][0] < 0.15 and previous[best][-1] > 0.4, previous[best]  # a previous-byte head formed
    entropy = [e.value for e in events.Scalars(best.replace("/previous/", "/entropy/"))]
    assert entropy[-1] < entropy[0] - 0.5, entropy  # and it sharpened


def test_toy_translation_rnn_example_reads_its_decoder_steps_as_target_by_source_attention(tmp_path):
    """The example's GRU decoder attends once per target word: its steps are read as one target x source call per
    batch (every emitted word counted once, rows summing to 1 over the source words), which learns the dictionary."""
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run(
        [sys.executable, str(root / "examples" / "toy_translation.py"), "--model", "rnn", "--logdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    sys.path.insert(0, str(root / "examples"))
    try:
        import toy_translation as toy
    finally:
        sys.path.remove(str(root / "examples"))
    val = toy.collate(toy.make_pairs(toy.VAL_SIZE, _after_train(toy)))
    exports = sorted((tmp_path / "toy_translation" / "version_0" / "attention_epochs").glob("*.pt"))
    assert len(exports) == 5
    first, last = (load_epoch(path).modules["attention"] for path in (exports[0], exports[-1]))
    words = val["tgt_out"][val["tgt_out"] != toy.PAD]
    assert torch.equal(last.query_count.long(), torch.bincount(words, minlength=len(toy.TGT_VOCAB)))
    rows = last.attention_sum[0].sum(dim=-1)  # (Vq,): one per query token seen
    torch.testing.assert_close(rows, last.query_count.float(), rtol=1e-5, atol=1e-4)
    dictionary = [(int(t), int(s)) for t, s in enumerate(toy.TGT_TO_SRC) if s > 0]

    def share(stats):  # of the emitted words' attention, on the source word they translate
        mass = sum(float(stats.attention_sum[0, t, s]) for t, s in dictionary)
        return mass / float(sum(stats.query_count[t] for t, _ in dictionary))

    assert share(first) < 0.5 < share(last), (share(first), share(last))
    assert "cross-attention on the dictionary word" in result.stdout


def _after_train(toy):
    """The example's generator after it drew the training pairs: the validation pairs come next."""
    generator = torch.Generator().manual_seed(0)
    toy.make_pairs(toy.TRAIN_SIZE, generator)
    return generator


class TwoCalls(nn.Module):
    """Attends twice per forward: causal, then bidirectional."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.qkv, self.h = nn.Linear(dim, 3 * dim), heads

    def forward(self, x):
        b_, t, c = x.shape
        q, k, v = (z.view(b_, t, self.h, c // self.h).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = F.scaled_dot_product_attention(y, k, v)
        return y.transpose(1, 2).reshape(b_, t, c)


class TwoCallModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.attn = nn.Embedding(12, 16), TwoCalls()

    def forward(self, ids):
        return self.attn(self.emb(ids))


def test_module_calling_sdpa_twice_logs_each_call_keeps_its_sums_for_the_next_stage(tmp_path):
    model = TwoCallModel().eval()
    monitor = AttentionMonitor(vocab_size=12, token_ids="ids")
    _, first = run(tmp_path / "a", model, monitor, gpt_batches())
    sums = dict(monitor._sums.metrics)
    _, second = run(tmp_path / "b", model, monitor, gpt_batches())  # a new Trainer: setup runs again
    assert monitor._sums.metrics == sums  # allocated when the epoch started, not again at the first call
    for trainer in (first, second):
        logged = scalars(trainer)
        previous = {tag: v for tag, v in logged.items() if tag.startswith("attention_position/previous/")}
        assert sorted(previous) == [
            "attention_position/previous/model.attn",
            "attention_position/previous/model.attn.call1",
        ]
        nxt = {tag: v for tag, v in logged.items() if tag.startswith("attention_position/next/")}
        assert nxt["attention_position/next/model.attn"] == 0.0  # the causal call sees no next position
        assert nxt["attention_position/next/model.attn.call1"] > 0.05  # the second call does


def test_sdpa_sums_are_checked_against_the_budget_at_first_call_and_feed_the_probe(tmp_path):
    model = TinyGPT().eval()
    with pytest.raises(MisconfigurationException, match="over argument `memory_budget`=1000 B"):
        run(
            tmp_path / "small",
            model,
            AttentionMonitor(vocab_size=12, token_ids="ids", memory_budget=1000),
            gpt_batches(),
        )
    assert not torch.overrides._get_current_function_mode_stack()  # the watch was left on the way out
    monitor = AttentionMonitor(vocab_size=12, token_ids="ids", probe="first", probe_samples=2, modules=["*.1.attn"])
    _, trainer = run(tmp_path / "probe", model, monitor, gpt_batches())
    events = EventAccumulator(trainer.logger.log_dir, size_guidance={"images": 0})
    events.Reload()
    probes = sorted(tag for tag in events.Tags()["images"] if tag.startswith("attention_probe/"))
    assert probes == [f"attention_probe/model.blocks.1.attn/sample_{n}" for n in range(2)]  # the selected module


def test_causal_bias_masks_are_read_as_the_booleans_they_stand_for():
    from torch.nn.attention.bias import causal_lower_right

    class LowerRight(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.size(-2), k.size(-2)))

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 2, 3, 4, generator=g), torch.randn(2, 2, 5, 4, generator=g), torch.randn(2, 2, 5, 4)
    model = nn.ModuleDict({"attn": LowerRight()})
    with capture_attention(model) as weights, torch.no_grad():
        out = model["attn"](q, k, v)
    (w,) = weights["attn"]
    assert torch.equal(w[..., 0, 3:] == 0, torch.ones(2, 2, 2, dtype=torch.bool))  # query 0 sees keys 0..2 only
    torch.testing.assert_close(w @ v, out, atol=1e-6, rtol=1e-6)


class PassThrough(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_the_watch_is_on_the_mode_stack_only_inside_watched_forwards_stays_out_of_compiled_tracing():
    model, seen, stacks = TinyGPT(), [], []
    model.blocks[0].register_forward_hook(lambda *_: stacks.append(torch.overrides._get_current_function_mode_stack()))
    capture = AttentionCapture(find_attention_modules(model), lambda *call: seen.append(call[0])).attach()
    other = PassThrough()
    try:
        capture.start_watching()
        other.__enter__()  # a mode of the user's, entered after the watch started and left after it stopped
        with torch.no_grad():
            model(torch.zeros(1, 3, dtype=torch.long))
        capture.stop_watching()
        assert torch.overrides._get_current_function_mode_stack() == [other]
        other.__exit__(None, None, None)
    finally:
        capture.detach()
    assert seen == ["blocks.0.attn", "blocks.1.attn"]
    assert stacks == [[other]]  # between the attention modules' forwards, only the user's mode
    assert not torch.overrides._get_current_function_mode_stack()
    # Traced by dynamo while watching (no eager stance held): no frames to walk, nothing read, no error.
    compiled = torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q), backend="eager", fullgraph=True)
    q = torch.randn(1, 2, 3, 4)
    try:
        with SdpaWatch({"attn": model.blocks[0].attn}, lambda *call: None):
            torch.testing.assert_close(compiled(q), F.scaled_dot_product_attention(q, q, q))
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sdpa_weights_are_recomputed_in_float32_under_autocast(dtype):
    """precision="bf16-mixed" runs the model, and so the recompute inside its forward, under autocast: the weights
    are still float32 products and softmax of the call's q and k (bf16 ones would be ~1e-2 off, fp16 ones round
    keys ~17 logits down to 0)."""
    g = torch.Generator().manual_seed(1)
    q, k = (3 * torch.randn(2, 4, 6, 8, generator=g) for _ in range(2))  # logits ~9 apart
    with torch.autocast("cpu", dtype=dtype):
        got = sdpa_weights(q, k, is_causal=True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), naive_weights(q, k, causal=True), atol=1e-6, rtol=1e-6)


class Bypassed(Attention):
    """Found by the SDPA call and the softmax in its code, which this path never reaches."""

    def forward(self, x):
        return self.proj(x)


def test_a_module_that_ran_without_its_sdpa_call_is_named_apart_from_modules_that_never_ran(tmp_path):
    """A module found by the SDPA call in its code that computes attention another way on this run (a Hugging Face
    model without attention records, under eager attention) is said to have run without the call, not not to have
    run; nothing of it is logged."""
    monitor = AttentionMonitor(vocab_size=12, token_ids="ids")
    model = TinyGPT()
    for block in model.blocks:
        block.attn = Bypassed()
    with pytest.warns(UserWarning) as caught:
        run(tmp_path, model, monitor, gpt_batches())
    said = [str(w.message) for w in caught if "AttentionMonitor: attention module(s)" in str(w.message)]
    assert len(said) == 1, said
    assert "'model.blocks.0.attn', 'model.blocks.1.attn' ran in 2 monitored batch(es) but never called" in said[0]
    assert "attn_implementation='eager'" in said[0]


def by_hand_attention(q, k, mask):
    """The Annotated Transformer's ``attention()``: a helper of the file, masked with -1e9."""
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    return scores.masked_fill(mask == 0, -1e9).softmax(dim=-1)


class Tutorial(nn.Module):
    """Causal self-attention written by hand, in the style of a tutorial: minGPT (``@``, ``F.softmax``, ``-inf``),
    the Annotated Transformer (a helper, ``Tensor.softmax``, ``-1e9``), lucidrains (``einsum``, an ``nn.Softmax``,
    the dtype's minimum), Karpathy's one-head ``Head`` (``(B, T, T)``, ``torch.softmax``) or d2l (``bmm`` over
    ``(B · H, T, T)``, ``-1e6``: the batch's size tells the heads). Keeps its weights ``(B, H, T, T)`` for the float64
    reference."""

    def __init__(self, style, dim=16, heads=2):
        super().__init__()
        self.qkv, self.proj, self.style = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), style
        self.h = 1 if style == "karpathy" else heads
        if style == "einsum":
            self.attend = nn.Softmax(dim=-1)

    def forward(self, x):
        b_, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b_, t, self.h, c // self.h).transpose(1, 2) for z in (q, k, v))  # (B, H, T, C/H)
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        scale = 1 / math.sqrt(c // self.h)
        if self.style == "mingpt":
            att = F.softmax(((q @ k.transpose(-2, -1)) * scale).masked_fill(future, -math.inf), dim=-1)
        elif self.style == "annotated":
            att = by_hand_attention(q, k, ~future)
        elif self.style == "einsum":
            sim = torch.einsum("bhid,bhjd->bhij", q, k) * scale
            att = self.attend(sim.masked_fill(future, torch.finfo(sim.dtype).min))
        elif self.style == "bqhk":  # queries before heads, as some JAX ports lay scores out
            sim = torch.einsum("bqhd,bkhd->bqhk", q.transpose(1, 2), k.transpose(1, 2)) * scale  # (B, T, H, T)
            att = sim.masked_fill(future[:, None], -math.inf).softmax(dim=-1).transpose(1, 2)
        elif self.style == "karpathy":
            q, k = q[:, 0], k[:, 0]  # (B, T, C)
            att = torch.softmax((q @ k.transpose(-2, -1) * scale).masked_fill(future, -math.inf), -1)[:, None]
        else:  # d2l
            q, k = q.reshape(b_ * self.h, t, -1), k.reshape(b_ * self.h, t, -1)  # (B · H, T, C/H)
            att = torch.softmax(torch.bmm(q, k.transpose(1, 2)).mul(scale).masked_fill(future, -1e6), dim=-1)
            att = att.view(b_, self.h, t, t)
        self.weights = att
        return self.proj((att @ v).transpose(1, 2).reshape(b_, t, c))


class HandGPT(LightningModule):
    def __init__(self, style):
        super().__init__()
        torch.manual_seed(3)
        self.model = TinyGPT(heads=2, layers=1)
        self.model.blocks[0].attn = Tutorial(style)
        with torch.no_grad():  # logits hundreds apart: float32 rounds many allowed keys' weights to 0
            self.model.blocks[0].attn.qkv.weight[:16] *= 400
        self.outputs = []

    def validation_step(self, batch, batch_idx):
        self.outputs.append(self.model(batch["ids"]))


@pytest.mark.parametrize("style", ["mingpt", "annotated", "einsum", "bqhk", "karpathy", "d2l"])
def test_attention_computed_by_hand_is_read_from_its_softmax_as_a_float64_loop_outputs_untouched(tmp_path, style):
    """The softmax's output is the weights, its input's masked scores the keys allowed: S, C, Q, U and the position
    sums equal a float64 loop over the float64 twin's weights with the causal mask, U counting the allowed keys whose
    weight float32 rounded to 0; the model's outputs are the same bits as unmonitored."""
    batches = gpt_batches()
    plain = HandGPT(style)
    Trainer(accelerator=ACCELERATOR, logger=False, enable_progress_bar=False, enable_model_summary=False).validate(
        plain, DataLoader(batches, batch_size=None), verbose=False
    )
    lit = HandGPT(style)
    Trainer(
        default_root_dir=tmp_path, accelerator=ACCELERATOR, logger=TensorBoardLogger(tmp_path, name="tb"),
        callbacks=[AttentionMonitor(vocab_size=12, token_ids="ids", export="pt")], enable_progress_bar=False,
        enable_model_summary=False,
    ).validate(lit, DataLoader(batches, batch_size=None), verbose=False)  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(plain.outputs, lit.outputs, strict=True))
    stats = load_epoch(next((tmp_path / "tb").rglob("*.pt"))).modules["model.blocks.0.attn"]

    twin = HandGPT(style).double()
    causal = torch.ones(9, 9, dtype=torch.bool).tril().expand(3, 9, 9)
    cases, underflowed = [], 0
    with torch.no_grad():
        for batch in batches:
            twin.model(batch["ids"])
            weights = twin.model.blocks[0].attn.weights  # (B, H, T, T) float64
            underflowed += int((causal & (weights.float().amax(dim=1) == 0)).sum())
            cases.append((weights, batch["ids"], batch["ids"], causal))
    assert underflowed > 20
    assert_sums_of_float64_loop(stats, cases, 12, 12)


def assert_sums_of_float64_loop(stats, cases, vq, vk, pad=None):
    """The exported ``stats`` of a module equal float64 loops over ``cases``: per batch, its float64 weights
    ``(B, H, Lq, Lk)``, query and key ids (``pad``: the id ignored) and the keys its mask allows ``(B, Lq, Lk)``."""
    heads = cases[0][0].size(1)
    S, C, Q = torch.zeros(heads, vq, vk), torch.zeros(vq, vk), torch.zeros(vq)
    U, position = torch.zeros(vq, vk), torch.zeros(6, heads)
    S, C, Q, U, position = (t.double() for t in (S, C, Q, U, position))
    for weights, query, key, allowed in cases:
        query_valid, key_valid = (
            torch.ones_like(ids, dtype=torch.bool) if pad is None else ids != pad for ids in (query, key)
        )
        s, c, q, skipped = naive_accumulate(weights, query, key, query_valid, key_valid, vq, vk, allowed)
        assert skipped == 0
        S, C, Q = S + s, C + c, Q + q
        U += naive_uniform(weights, query, key, query_valid, key_valid, vq, vk, allowed)
        position += naive_position_sums(weights, query_valid, key_valid, allowed)
    assert int(stats.skipped_rows) == 0
    torch.testing.assert_close(stats.attention_sum.double(), S, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats.pair_count.double(), C)
    torch.testing.assert_close(stats.query_count.double(), Q)
    torch.testing.assert_close(stats.uniform_sum.double(), U, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats.position_sums.double(), position, rtol=1e-5, atol=1e-4)


def test_nanogpt_manual_fallback_logs_what_its_sdpa_path_logs(tmp_path):
    """nanoGPT computes attention by hand where flash attention is off: both paths of one module log the same."""
    torch.manual_seed(0)
    model = TinyGPT()
    monitor = functools.partial(AttentionMonitor, vocab_size=12, token_ids="ids")
    _, with_sdpa = run(tmp_path / "sdpa", model, monitor(), gpt_batches())
    for block in model.blocks:
        block.attn.eager = True
    _, by_hand = run(tmp_path / "hand", model, monitor(), gpt_batches())
    want, got = scalars(with_sdpa), scalars(by_hand)
    assert sorted(got) == sorted(want) and len(want) > 20
    for tag, value in want.items():
        assert got[tag] == pytest.approx(value, rel=1e-5, abs=1e-6), tag


def test_softmaxes_that_are_not_over_attention_keys_are_not_read():
    """A module computing attention by hand also takes other softmaxes: over another dimension, of a vector."""

    class Pooled(nn.Module):
        def forward(self, x):  # (B, T, C)
            att = F.softmax(x @ x.transpose(-2, -1), dim=-1)  # (B, T, T): read, one head
            pooled = torch.softmax(x.sum(-1), dim=-1)  # (B, T): not attention
            across = F.softmax(att, dim=1)  # over the queries: not read
            return att @ x + pooled[..., None] + across @ x

    x = torch.randn(2, 5, 4)
    model = nn.Sequential(Pooled())
    with torch.no_grad(), capture_attention(model) as weights:
        model(x)
    assert list(weights) == ["0"] and len(weights["0"]) == 1
    torch.testing.assert_close(weights["0"][0], F.softmax(x @ x.transpose(-2, -1), dim=-1)[:, None])


class Router(nn.Module):
    """A mixture-of-experts gate as many as the tokens: ``x @ W`` and a softmax over the last dimension, (B, T, E)."""

    def __init__(self, dim=16, experts=9):
        super().__init__()
        self.w_gate = nn.Parameter(torch.randn(dim, experts))

    def forward(self, x):
        return F.softmax(x @ self.w_gate, dim=-1)


class Pooling(nn.Module):
    """Attention pooling: a softmax over the positions, (B, T), and a batched product with it."""

    def __init__(self, dim=16):
        super().__init__()
        self.w = nn.Linear(dim, 1)

    def forward(self, x):
        return torch.bmm(self.w(x).squeeze(-1).softmax(dim=-1)[:, None], x)


class TiedHead(nn.Module):
    def __init__(self, emb):
        super().__init__()
        self.emb = emb

    def forward(self, x):
        return torch.softmax(x @ self.emb.weight.T, dim=-1)


class Experts(nn.Module):
    """A mixture of experts routed by an ``nn.Linear`` gate as wide as the sequence."""

    def __init__(self, dim=16, experts=9):
        super().__init__()
        self.gate, self.experts = nn.Linear(dim, experts), nn.Parameter(torch.randn(experts, dim))

    def forward(self, x):
        return self.gate(x).softmax(dim=-1) @ self.experts


class AttendThenRoute(Router):
    """Attention, then a router over its output whose softmax has the attention's shape."""

    def forward(self, x):
        x = F.softmax(x @ x.transpose(1, 2), dim=-1) @ x
        return F.softmax(x @ self.w_gate, dim=-1)


class GatedRouter(Router):
    """A one-output gate on the hidden states, then a router as wide as the sequence: neither is attention."""

    def __init__(self, dim=16, experts=9):
        super().__init__(dim, experts)
        self.gate = nn.Linear(dim, 1)

    def forward(self, x):
        return F.softmax((torch.sigmoid(self.gate(x)) * x) @ self.w_gate, dim=-1)


class LayerScaled(Router):
    """LayerScale written as an einsum with a vector it does not sum over, then a router as wide as the sequence."""

    def __init__(self, dim=16, experts=9):
        super().__init__(dim, experts)
        self.gamma = nn.Parameter(torch.full((dim,), 0.1))

    def forward(self, x):
        return F.softmax(torch.einsum("btd,d->btd", x, self.gamma) @ self.w_gate, dim=-1)


class WithHeads(LightningModule):
    """Attention by hand beside modules that take a softmax and a product but make no attention scores."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyGPT(heads=2, layers=1)
        self.model.blocks[0].attn = Tutorial("mingpt")
        self.router, self.pool, self.tied = Router(), Pooling(), TiedHead(nn.Embedding(9, 16))
        self.moe, self.route, self.unused = Experts(), AttendThenRoute(), TiedHead(nn.Embedding(9, 16))
        self.gated, self.scaled = GatedRouter(), LayerScaled()

    def validation_step(self, batch, batch_idx):
        x = self.model.emb(batch["ids"])
        self.model(batch["ids"])
        self.router(x), self.pool(x), self.tied(x), self.moe(x), self.gated(x), self.scaled(x)
        self.outputs = self.route(x), x


def test_modules_taking_a_softmax_and_a_product_but_no_attention_scores_are_neither_read_nor_warned_about(tmp_path):
    """Routers whose experts are as many as the tokens (``x @ W`` or an ``nn.Linear`` gate: their softmax has the
    shape of attention; one after attention in the same module), a pooling, a tied output head and one never called
    in validation: found by their code, never read (no product of two batched tensors made their softmax's input),
    never named in a warning; the attention beside them is read."""
    batches = gpt_batches()
    monitor = AttentionMonitor(vocab_size=12, token_ids="ids", export="pt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(
            default_root_dir=tmp_path, accelerator=ACCELERATOR, logger=TensorBoardLogger(tmp_path, name="tb"),
            callbacks=[monitor], enable_progress_bar=False, enable_model_summary=False,
        ).validate(WithHeads(), DataLoader(batches, batch_size=None), verbose=False)  # fmt: skip
    found = {"model.blocks.0.attn", "router", "pool", "tied", "moe", "route", "unused", "gated", "scaled"}
    assert set(find_attention_modules(WithHeads())) == found
    assert list(load_epoch(next((tmp_path / "tb").rglob("*.pt"))).modules) == ["model.blocks.0.attn", "route"]
    assert [str(w.message) for w in caught if any(f"'{name}" in str(w.message) for name in found)] == []


class StepDecoder(nn.Module):
    """Dot-product (Luong) attention, one query position per call, as a decoder loop takes it; causal, ``-inf``
    masked. Keeps its weights ``(B, 1, T, T)`` for the float64 reference. ``steps``: the loop's steps where not
    ``T`` (step ``t`` at position ``t % T``); ``halve``: halve the weights in place after the softmax; ``flat``: a
    softmax over ``(B, T)`` scores, ``bmm(keys, query)`` squeezed, unsqueezed after it."""

    def __init__(self, dim=16, steps=None, halve=False, flat=False):
        super().__init__()
        self.q, self.steps, self.halve, self.flat = nn.Linear(dim, dim), steps, halve, flat

    def forward(self, x):
        out, weights = [], []
        for step in range(self.steps or x.size(1)):
            t = step % x.size(1)
            if self.flat:
                scores = torch.bmm(x, self.q(x[:, t]).unsqueeze(2)).squeeze(2)  # (B, T)
                scores[:, t + 1 :] = -math.inf
                w = F.softmax(scores, dim=1).unsqueeze(1)
            else:
                scores = torch.bmm(self.q(x[:, t : t + 1]), x.transpose(1, 2))  # (B, 1, T)
                scores[:, :, t + 1 :] = -math.inf
                w = F.softmax(scores, dim=-1)
            weights.append(w.clone() if self.halve else w)
            if self.halve:
                w.mul_(0.5)
            out.append(torch.bmm(w, x))
        self.weights = torch.cat(weights, dim=1)[:, None]
        return torch.cat(out, dim=1)


class Additive(nn.Module):
    """d2l's additive attention over the whole sequence, ``vᵀ tanh(W q + U k)`` (B, T, T), its causal mask written
    in place as d2l's ``masked_softmax`` does (-1e6)."""

    def __init__(self, dim=16, einsum=False):
        super().__init__()
        self.w_q, self.w_k, self.w_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, 1, bias=False)
        self.einsum = einsum

    def forward(self, x):
        t = x.size(1)
        features = torch.tanh(self.w_q(x)[:, :, None] + self.w_k(x)[:, None])  # (B, T, T, D)
        if self.einsum:
            scores = torch.einsum("bqkd,d->bqk", features, self.w_v.weight[0])
        else:
            scores = self.w_v(features).squeeze(-1)  # (B, T, T)
        flat = scores.reshape(-1, t)  # (B · T, T)
        flat[torch.ones(t, t, dtype=torch.bool).triu(1).repeat(x.size(0), 1)] = -1e6
        self.weights = F.softmax(flat.reshape(scores.shape), dim=-1)[:, None]
        return torch.bmm(self.weights[:, 0], x)


class Stepping(LightningModule):
    def __init__(self, step=None):
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyGPT(heads=2, layers=1)
        self.step = step or StepDecoder()

    def validation_step(self, batch, batch_idx):
        self.step(self.model.emb(batch["ids"]))
        self.model(batch["ids"])


def validated_sums(tmp_path, lit):
    """``lit`` validated over ``gpt_batches()`` with the sums exported: ``lit`` and its modules' exported sums."""
    Trainer(
        default_root_dir=tmp_path, accelerator=ACCELERATOR, logger=TensorBoardLogger(tmp_path, name="tb"),
        callbacks=[AttentionMonitor(vocab_size=12, token_ids="ids", export="pt")], enable_progress_bar=False,
        enable_model_summary=False,
    ).validate(lit, DataLoader(gpt_batches(), batch_size=None), verbose=False)  # fmt: skip
    modules = load_epoch(next((tmp_path / "tb").rglob("*.pt"))).modules
    return lit, modules


@pytest.mark.parametrize(
    "step",
    [
        StepDecoder,
        functools.partial(StepDecoder, halve=True),
        functools.partial(StepDecoder, flat=True),
        Additive,
        functools.partial(Additive, einsum=True),
    ],
    ids=["loop", "loop-changed-in-place", "loop-2d", "additive", "additive-einsum"],
)
def test_decoder_loop_and_additive_attention_are_read_as_a_float64_loop(tmp_path, step):
    """A decoder loop's steps, one query position per call, make one call over the query stream (as the softmax
    gave them, whatever the model does with them in place later); additive scores (a one-output Linear, an einsum
    with a vector) are scores: S, C, Q, U and the position sums equal a float64 loop over the float64 twin's
    weights."""
    lit, modules = validated_sums(tmp_path, Stepping(step()))
    assert sorted(modules) == ["model.blocks.0.attn", "step"]

    twin = lit.double()
    causal = torch.ones(9, 9, dtype=torch.bool).tril().expand(3, 9, 9)
    cases = []
    with torch.no_grad():
        for batch in gpt_batches():
            twin.step(twin.model.emb(batch["ids"]))
            cases.append((twin.step.weights, batch["ids"], batch["ids"], causal))
    assert cases[0][0].shape == (3, 1, 9, 9)
    assert_sums_of_float64_loop(modules["step"], cases, 12, 12)


def test_decoder_loop_run_on_a_probe_batch_of_ones_own_is_drawn(tmp_path):
    """A probe batch of one's own runs at the epoch end: its loop's steps are read before that batch ends."""
    batch = gpt_batches()[0]
    monitor = AttentionMonitor(
        vocab_size=12, token_ids="ids", probe={"ids": batch["ids"][:1]},
        probe_forward=lambda lit, probe: lit.step(lit.model.emb(probe["ids"])),
    )  # fmt: skip
    trainer = Trainer(
        default_root_dir=tmp_path, accelerator=ACCELERATOR, logger=TensorBoardLogger(tmp_path, name="tb"),
        callbacks=[monitor], enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.validate(Stepping(), DataLoader(gpt_batches(), batch_size=None), verbose=False)
    events = EventAccumulator(trainer.logger.log_dir, size_guidance={IMAGES: 0})
    events.Reload()
    assert "attention_probe/step/sample_0" in events.Tags()["images"]


def test_decoder_loop_that_does_not_fit_a_probe_batch_of_ones_own_is_named_with_its_shape(tmp_path):
    """A loop of nine steps reads the validation batches (nine tokens) but not a five-token probe: the probe says
    nothing of its attention was read, and the loop is named with the shape its steps made there."""
    batch = gpt_batches()[0]
    monitor = AttentionMonitor(
        vocab_size=12, token_ids="ids", probe={"ids": batch["ids"][:1, :5]},
        probe_forward=lambda lit, probe: lit.step(lit.model.emb(probe["ids"])),
    )  # fmt: skip
    with pytest.warns(UserWarning) as caught:
        Trainer(
            default_root_dir=tmp_path, accelerator=ACCELERATOR, logger=TensorBoardLogger(tmp_path, name="tb"),
            callbacks=[monitor], enable_progress_bar=False, enable_model_summary=False,
        ).validate(Stepping(StepDecoder(steps=9)), DataLoader(gpt_batches(), batch_size=None))  # fmt: skip
    said = [str(w.message) for w in caught]
    assert sum("no attention of a monitored module was read in it" in message for message in said) == 1, said
    unread = [message for message in said if "that were not read" in message]
    assert len(unread) == 1 and "'step': (1, 1, 9, 5) for tokens (B, Lq, Lk) = (1, 5, 5)" in unread[0], said


class OnlyStepping(LightningModule):
    """A decoder loop and nothing else: the model's only attention."""

    def __init__(self, step):
        super().__init__()
        self.emb, self.step = nn.Embedding(12, 16), step

    def validation_step(self, batch, batch_idx):
        self.step(self.emb(batch["ids"]))


def test_an_epoch_where_no_attention_was_read_is_explained_by_the_modules_not_the_tokens(tmp_path):
    """Nothing read because the only module's loop does not make the query stream: the warning names the loop, and
    none blames the tokens (``ignore_ids``, ``token_mask``) for the empty epoch."""
    with pytest.warns(UserWarning) as caught:
        Trainer(
            default_root_dir=tmp_path, accelerator=ACCELERATOR, logger=TensorBoardLogger(tmp_path, name="tb"),
            callbacks=[AttentionMonitor(vocab_size=12, token_ids="ids")], enable_progress_bar=False,
            enable_model_summary=False,
        ).validate(OnlyStepping(StepDecoder(steps=8)), DataLoader(gpt_batches(), batch_size=None))  # fmt: skip
    said = [str(w.message) for w in caught]
    assert sum("'step': (3, 1, 8, 9) for tokens (B, Lq, Lk) = (3, 9, 9)" in message for message in said) == 1, said
    assert not [message for message in said if "no valid query token" in message], said


class Beams(StepDecoder):
    """A beam search of width 2 after its first step: the rows change from B to 2 · B."""

    def forward(self, x):
        for t in range(x.size(1)):
            rows = x if t == 0 else x.repeat_interleave(2, dim=0)
            F.softmax(torch.bmm(self.q(rows[:, t : t + 1]), rows.transpose(1, 2)), dim=-1)


@pytest.mark.parametrize(
    ("step", "shape"),
    [(StepDecoder(steps=8), (3, 1, 8, 9)), (StepDecoder(steps=18), (3, 1, 18, 9)), (Beams(), (6, 1, 9))],
    ids=["short", "twice-the-stream", "beam-rows"],
)
def test_decoder_loop_that_does_not_make_the_query_stream_is_not_read_and_named_with_its_shape(tmp_path, step, shape):
    """A loop of another length than the query stream's (a step short; a MAX_LENGTH loop twice as long, or a module
    called twice per step), or whose rows change (a beam search), cannot be matched to its tokens: skipped, named
    once with the shape its steps made and the tokens', while the model's other attention is read."""
    monitor = AttentionMonitor(vocab_size=12, token_ids="ids", export="pt")
    with pytest.warns(UserWarning) as caught:
        Trainer(
            default_root_dir=tmp_path, accelerator=ACCELERATOR, logger=TensorBoardLogger(tmp_path, name="tb"),
            callbacks=[monitor], enable_progress_bar=False, enable_model_summary=False,
        ).validate(Stepping(step), DataLoader(gpt_batches(), batch_size=None))  # fmt: skip
    said = [str(w.message) for w in caught if "that were not read" in str(w.message)]
    assert len(said) == 1 and f"'step': {shape} for tokens (B, Lq, Lk) = (3, 9, 9)" in said[0], said
    assert "a decoder loop" in said[0]
    assert not [w for w in caught if "never called" in str(w.message) or "never ran" in str(w.message)]
    assert list(load_epoch(next((tmp_path / "tb").rglob("*.pt"))).modules) == ["model.blocks.0.attn"]


class BahdanauAttention(nn.Module):
    """The PyTorch seq2seq tutorial's: ``Va(tanh(Wa(query) + Ua(keys)))``, one decoder step per call."""

    def __init__(self, hidden):
        super().__init__()
        self.Wa, self.Ua, self.Va = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, 1)

    def forward(self, query, keys):  # (B, 1, H), (B, S, H)
        scores = self.Va(torch.tanh(self.Wa(query) + self.Ua(keys)))  # (B, S, 1)
        weights = F.softmax(scores.squeeze(2).unsqueeze(1), dim=-1)  # (B, 1, S)
        return torch.bmm(weights, keys), weights


class Translator(LightningModule):
    """The tutorial's GRU encoder and attention decoder, teacher-forced: step t reads target token t - 1 (BOS
    first) and attends over the source to produce target token t."""

    def __init__(self, vocab=12, hidden=16):
        super().__init__()
        torch.manual_seed(0)
        self.src_emb, self.tgt_emb = nn.Embedding(vocab, hidden), nn.Embedding(vocab, hidden)
        self.encoder, self.decoder = (
            nn.GRU(hidden, hidden, batch_first=True),
            nn.GRU(2 * hidden, hidden, batch_first=True),
        )
        self.attention, self.out = BahdanauAttention(hidden), nn.Linear(hidden, vocab)

    def forward(self, src, tgt):
        keys, hidden = self.encoder(self.src_emb(src))
        read = torch.cat([torch.ones_like(tgt[:, :1]), tgt[:, :-1]], dim=1)  # BOS = 1
        logits, weights = [], []
        for t in range(tgt.size(1)):
            context, w = self.attention(hidden.permute(1, 0, 2), keys)
            out, hidden = self.decoder(torch.cat([self.tgt_emb(read[:, t : t + 1]), context], dim=2), hidden)
            logits.append(self.out(out))
            weights.append(w)
        return torch.cat(logits, dim=1), torch.cat(weights, dim=1)[:, None]  # (B, T, V), (B, 1, T, S)

    def validation_step(self, batch, batch_idx):
        logits, _ = self(batch["src"], batch["tgt"])
        self.log("loss", F.cross_entropy(logits.transpose(1, 2), batch["tgt"], ignore_index=0))


def test_rnn_decoder_with_bahdanau_attention_reads_target_tokens_against_source_tokens(tmp_path):
    """Seed 004's translation attention: the tutorial's decoder loop attends one target position per step over the
    padded source. Its steps make one call (target → source), equal to a float64 loop over the twin's weights."""
    g = torch.Generator().manual_seed(2)
    batches = [
        {"src": torch.randint(2, 12, (3, 7), generator=g), "tgt": torch.randint(2, 12, (3, 5), generator=g)}
        for _ in range(2)
    ]
    batches[0]["src"][0, -2:], batches[1]["tgt"][2, -1:] = 0, 0  # padding, left out by ignore_ids
    lit = Translator()
    monitor = AttentionMonitor(
        vocab_size=12, token_ids={"src": "src", "tgt": "tgt"}, attention_streams={"attention": ("tgt", "src")},
        ignore_ids=[0], export="pt",
    )  # fmt: skip
    Trainer(
        default_root_dir=tmp_path, accelerator=ACCELERATOR, logger=TensorBoardLogger(tmp_path, name="tb"),
        callbacks=[monitor], enable_progress_bar=False, enable_model_summary=False,
    ).validate(lit, DataLoader(batches, batch_size=None), verbose=False)  # fmt: skip
    modules = load_epoch(next((tmp_path / "tb").rglob("*.pt"))).modules
    assert list(modules) == ["attention"]

    twin = lit.double()
    with torch.no_grad():
        cases = [
            (twin(b["src"], b["tgt"])[1], b["tgt"], b["src"], torch.ones(3, 5, 7, dtype=torch.bool)) for b in batches
        ]
    assert_sums_of_float64_loop(modules["attention"], cases, 12, 12, pad=0)


def test_scores_laid_out_queries_before_heads_are_read_with_their_queries_where_heads_equal_queries():
    """``einsum("bqhd,bkhd->bqhk")`` scores, as many heads as queries: the equation says which axis holds the
    queries, so the weights are not read with heads and queries swapped; through scaling and masking too."""

    class QueriesFirst(nn.Module):
        def forward(self, q, k):  # (B, T, H, E)
            sim = torch.einsum("...qhd,...khd->...qhk", q, k) / 2  # (B, T, H, T)
            return (sim - 1e9 * torch.ones(3, 3).triu(1)[:, None]).softmax(dim=-1)

    q, k = torch.randn(2, 3, 3, 4), torch.randn(2, 3, 3, 4)
    model = nn.Sequential(QueriesFirst())
    with torch.no_grad(), capture_attention(model) as weights:
        model[0](q, k)
    [read] = weights["0"]
    scores = (q.double().transpose(1, 2) @ k.double().permute(0, 2, 3, 1)) / 2  # (B, H, T, T)
    want = scores.masked_fill(torch.ones(3, 3, dtype=torch.bool).triu(1), -math.inf).softmax(dim=-1)
    torch.testing.assert_close(read.double(), want)


def test_scores_moved_back_to_heads_first_or_broadcast_over_heads_are_read_as_laid_out():
    """After ``einsum("bqhd,bkhd->bqhk")`` a permute back to ``(B, H, Lq, Lk)`` (heads as many as queries) is read as
    it is, not moved again; one head's scores plus a per-head bias broadcast to every head are read per head."""

    class MovedBack(nn.Module):
        def forward(self, q, k):  # (B, T, H, E)
            return torch.einsum("bqhd,bkhd->bqhk", q, k).permute(0, 2, 1, 3).softmax(dim=-1)

    class SharedPlusBias(nn.Module):
        def forward(self, q, k, bias):  # (B, T, E), (B, T, E), (B, H, T, T)
            return ((q @ k.transpose(1, 2))[:, None] + bias).softmax(dim=-1)

    q, k, bias = torch.randn(2, 3, 3, 4), torch.randn(2, 3, 3, 4), torch.randn(2, 3, 3, 3)
    moved, shared = nn.Sequential(MovedBack()), nn.Sequential(SharedPlusBias())
    with torch.no_grad(), capture_attention(moved) as first, capture_attention(shared) as second:
        moved[0](q, k)
        shared[0](q[:, :, 0], k[:, :, 0], bias)
    torch.testing.assert_close(first["0"][0], (q.transpose(1, 2) @ k.permute(0, 2, 3, 1)).softmax(dim=-1))
    torch.testing.assert_close(second["0"][0], ((q[:, :, 0] @ k[:, :, 0].transpose(1, 2))[:, None] + bias).softmax(-1))


class LoopThenWhole(StepDecoder):
    """A loop, one query per call, then a softmax over the whole sequence in the same forward: two calls, numbered
    in the order they ran."""

    def forward(self, x):
        super().forward(x)
        self.whole = F.softmax(torch.bmm(x, x.transpose(1, 2)), dim=-1)[:, None]


def test_a_loop_and_a_whole_call_of_one_module_are_summed_apart_in_the_order_they_ran(tmp_path):
    lit, modules = validated_sums(tmp_path, Stepping(LoopThenWhole()))
    twin = lit.double()
    loop, whole = [], []
    causal = torch.ones(9, 9, dtype=torch.bool).tril().expand(3, 9, 9)
    with torch.no_grad():
        for batch in gpt_batches():
            twin.step(twin.model.emb(batch["ids"]))
            loop.append((twin.step.weights, batch["ids"], batch["ids"], causal))
            whole.append((twin.step.whole, batch["ids"], batch["ids"], torch.ones(3, 9, 9, dtype=torch.bool)))
    assert_sums_of_float64_loop(modules["step"], loop, 12, 12)
    assert_sums_of_float64_loop(modules["step.call1"], whole, 12, 12)


def test_capture_attention_splits_batch_major_scores_by_the_heads_the_module_or_its_caller_declares():
    """Outside Lightning the batch's size is not known: (B · H, T, T) scores are split by a ``num_heads`` of the
    module taking the softmax or of the module calling it (d2l keeps it on the multi-head module)."""

    class DotProduct(nn.Module):
        def forward(self, q, k):  # (B · H, T, E)
            return torch.softmax(torch.bmm(q, k.transpose(1, 2)), dim=-1)

    class MultiHead(nn.Module):
        def __init__(self, heads):
            super().__init__()
            self.num_heads, self.attention = heads, DotProduct()

        def forward(self, x):  # (B, T, E)
            b_, t, e = x.shape
            per_head = x.reshape(b_, t, self.num_heads, e // self.num_heads).transpose(1, 2)  # (B, H, T, E/H)
            flat = per_head.reshape(b_ * self.num_heads, t, -1)
            return self.attention(flat, flat)

    model = nn.Sequential(MultiHead(2))
    x = torch.randn(3, 5, 8)
    with torch.no_grad(), capture_attention(model) as weights:
        model(x)
    per_head = x.reshape(3, 5, 2, 4).transpose(1, 2)
    torch.testing.assert_close(weights["0.attention"][0], torch.softmax(per_head @ per_head.transpose(-2, -1), dim=-1))


class OnlyRouter(LightningModule):
    def __init__(self):
        super().__init__()
        self.emb, self.router = nn.Embedding(12, 16), Router(experts=4)

    def validation_step(self, batch, batch_idx):
        self.router(self.emb(batch["ids"]))


def test_a_model_whose_only_softmax_and_product_module_reads_nothing_is_told_so(tmp_path):
    """Found by its code, the router is all the model has: with nothing read at all, it is named."""
    with pytest.warns(UserWarning, match=r"'router', found by the softmax and matrix product .* took no softmax"):
        Trainer(
            default_root_dir=tmp_path, accelerator=ACCELERATOR, logger=False,
            callbacks=[AttentionMonitor(vocab_size=12, token_ids="ids")], enable_progress_bar=False,
            enable_model_summary=False,
        ).validate(OnlyRouter(), DataLoader(gpt_batches(), batch_size=None), verbose=False)  # fmt: skip


class Variant(nn.Module):
    """Scores made less plainly: grouped-query heads in a 5-D einsum, a relative-position term (a product with a
    parameter: logits) that the scores are added into in place, heads mixed by a matrix (talking heads)."""

    def __init__(self, kind, dim=8, heads=4):
        super().__init__()
        self.kind, self.h = kind, heads
        self.qk = nn.Linear(dim, 2 * dim)
        self.rel, self.mix = nn.Parameter(torch.randn(5, dim // heads)), nn.Parameter(torch.randn(heads, heads))

    def scores(self, x):
        b_, t, c = x.shape
        q, k = (z.view(b_, t, self.h, c // self.h).transpose(1, 2) for z in self.qk(x).chunk(2, dim=-1))
        if self.kind == "grouped":  # 2 key heads, each shared by 2 query heads: (B, Hk, G, T, T)
            return torch.einsum("bhgqd,bhkd->bhgqk", q.view(b_, 2, 2, t, -1), k[:, ::2])
        if self.kind == "relative":
            pos = torch.einsum("bhid,jd->bhij", q, self.rel)
            pos += q @ k.transpose(-2, -1)
            return pos
        return torch.einsum("bhij,hg->bgij", q @ k.transpose(-2, -1), self.mix)  # talking heads

    def forward(self, x):
        return F.softmax(self.scores(x), dim=-1)


@pytest.mark.parametrize("kind", ["grouped", "relative", "talking"])
def test_scores_are_followed_through_grouped_heads_in_place_terms_and_mixed_heads(kind):
    model = nn.Sequential(Variant(kind))
    x = torch.randn(3, 5, 8)
    with torch.no_grad(), capture_attention(model) as weights:
        model(x)
        want = F.softmax(model[0].scores(x), dim=-1).reshape(3, 4, 5, 5)  # (B, H, T, T)
    torch.testing.assert_close(weights["0"][0], want)


class Sampling(Lit):
    """A validation_step that also generates from the batch's first tokens (nanoGPT's ``generate``), as users do to
    look at samples; or only generates."""

    def __init__(self, model, forward=True):
        super().__init__(model)
        self.forward_too = forward

    def validation_step(self, batch, batch_idx):
        if self.forward_too:
            self.outputs.append(self.model(batch["ids"]))
        self.outputs.append(self.model.generate(batch["ids"][:, :4], 3))


@pytest.mark.parametrize("by_hand", [False, True])
def test_generate_in_validation_step_is_left_out_and_the_batchs_forward_logs_as_alone(tmp_path, by_hand):
    """What the model computes in ``generate`` (prefixes the batch does not hold) is not read: the logged values equal
    a run without it, a warning counts the calls left out; with no forward on the batch, it says nothing was seen."""
    torch.manual_seed(0)
    model = TinyGPT(eager=by_hand).eval()
    monitor = functools.partial(AttentionMonitor, vocab_size=12, token_ids="ids")
    _, alone = run(tmp_path / "alone", model, monitor(), gpt_batches())
    lit = Sampling(model)
    trainer = Trainer(
        default_root_dir=tmp_path, accelerator=ACCELERATOR, logger=TensorBoardLogger(tmp_path, name="tb"),
        callbacks=[monitor()], enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.validate(lit, DataLoader(gpt_batches(), batch_size=None), verbose=False)
    want, got = scalars(alone), scalars(trainer)
    assert sorted(got) == sorted(want) and len(want) > 20
    for tag, value in want.items():
        assert got[tag] == pytest.approx(value, rel=1e-6, abs=1e-7), tag
    said = [str(w.message) for w in caught if "generate` in monitored batches" in str(w.message)]
    # 2 batches, 3 new tokens each, 2 layers
    assert said == [
        "AttentionMonitor: 12 call(s) of attention module(s) 'model.blocks.0.attn', 'model.blocks.1.attn' made inside "
        "`TinyGPT.generate` in monitored batches were not read: generation attends over cached and generated tokens "
        "that the batch does not hold. The monitor reads the forward passes validation_step runs on the batch itself."
    ]
    assert not [w for w in caught if "never ran" in str(w.message) or "took no softmax" in str(w.message)]

    only = Trainer(
        default_root_dir=tmp_path / "only", accelerator=ACCELERATOR, logger=TensorBoardLogger(tmp_path / "only"),
        callbacks=[monitor()], enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        only.validate(Sampling(model, forward=False), DataLoader(gpt_batches(), batch_size=None), verbose=False)
    said = [str(w.message) for w in caught if "AttentionMonitor" in str(w.message)]
    assert len(said) == 1 and "it ran none outside `TinyGPT.generate`, so nothing was seen" in said[0], said
    assert scalars(only) == {}


class DecodeOnlySdpa(nn.Module):
    """SDPA in decoding steps only; on the whole sequence a linear attention (no softmax) the monitor cannot read."""

    def __init__(self, dim=16):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        q, k, v = self.qkv(x).split(x.size(-1), dim=2)
        if x.size(1) < 9:  # the prefixes generate() runs on
            return F.scaled_dot_product_attention(q, k, v)
        return F.elu(q) + 1 + v.cumsum(1) / (F.elu(k) + 1).cumsum(1)


def test_module_that_read_nothing_outside_generate_keeps_its_own_warning(tmp_path):
    """The calls generate() makes do not hide that the batch's own forward read nothing of a module."""
    torch.manual_seed(0)
    model = TinyGPT(layers=1)
    model.blocks[0].attn = DecodeOnlySdpa()
    with pytest.warns(UserWarning) as caught:
        run_sampling = Sampling(model)
        Trainer(
            default_root_dir=tmp_path, accelerator=ACCELERATOR, logger=False, enable_progress_bar=False,
            callbacks=[AttentionMonitor(vocab_size=12, token_ids="ids")], enable_model_summary=False,
        ).validate(run_sampling, DataLoader(gpt_batches(), batch_size=None), verbose=False)  # fmt: skip
    said = [str(w.message) for w in caught if str(w.message).startswith("AttentionMonitor")]
    assert any("'model.blocks.0.attn' ran in 2 monitored batch(es) but never called" in m for m in said), said
    assert any(m.startswith("AttentionMonitor: 6 call(s)") and m.endswith("batch itself.") for m in said), said
