"""Finding attention modules: what is found, the names wrappers leave, the errors that name the pattern, the device."""

import pytest
import torch
from _reference import passthrough
from torch import nn

from attn_callbacks.capture.find import clean_name, find_attention_modules, module_device


def encoder():
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2).eval()


def test_find_attention_modules_errors_name_the_pattern_and_model():
    with pytest.raises(
        ValueError,
        match="No torch.nn.MultiheadAttention, Hugging Face attention module, module calling "
        "scaled_dot_product_attention or module computing attention by hand \\(a softmax and a matrix product\\) "
        "found in the model \\(Linear\\)",
    ):
        find_attention_modules(nn.Linear(2, 2))
    model = encoder()
    with pytest.raises(ValueError, match="'layers.0.linear1'.*not attention modules"):
        find_attention_modules(model, ["layers.0.linear1"])
    with pytest.raises(ValueError, match="'nothing.*'.*matched no module"):
        find_attention_modules(model, ["nothing.*"])


class AttendsItself(nn.Module):
    """Calls scaled_dot_product_attention in its own forward (a LightningModule's validation_step, say)."""

    def __init__(self):
        super().__init__()
        self.qk = nn.Linear(8, 16)

    def forward(self, x):
        q, k = self.qk(x).chunk(2, dim=-1)
        return torch.nn.functional.scaled_dot_product_attention(q[:, None], k[:, None], k[:, None])


def test_a_model_calling_sdpa_itself_is_told_to_move_the_attention_into_a_module():
    said = r"\(AttendsItself\); AttendsItself itself calls scaled_dot_product_attention.*into an nn.Module of its own"
    with pytest.raises(ValueError, match=said):
        find_attention_modules(AttendsItself())


def scores_softmax(q, k):
    """A helper of the file, as the Annotated Transformer's ``attention()``: a module calling it computes attention."""
    return torch.matmul(q, k.transpose(-2, -1)).softmax(dim=-1)


class ByOperator(nn.Module):  # minGPT: ``@`` and F.softmax
    def forward(self, q, k):
        return torch.nn.functional.softmax(q @ k.transpose(-2, -1), dim=-1)


class ByHelper(nn.Module):
    def forward(self, q, k):
        return scores_softmax(q, k)


class BySoftmaxChild(nn.Module):  # lucidrains: einsum and an nn.Softmax
    def __init__(self):
        super().__init__()
        self.attend = nn.Softmax(dim=-1)

    def forward(self, q, k):
        return self.attend(torch.einsum("bhid,bhjd->bhij", q, k))


class Decorated(nn.Module):  # a forward decorated in another file: its wrapped code is read
    @passthrough
    def forward(self, q, k):
        return (q @ k.transpose(-2, -1)).softmax(dim=-1)


class Endless:
    """Any attribute is a new object (addict's Dict, python-box): ``__wrapped__`` never ends."""

    def __getattr__(self, name):
        return Endless()


class WithConfig(ByOperator):
    def __init__(self):
        super().__init__()
        self.config = Endless()


class Router(nn.Module):
    """A softmax without a matrix product of the module's own: a mixture-of-experts gate, not attention."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 4)

    def forward(self, x):
        return self.gate(x).softmax(dim=-1)


class Sampler(nn.Module):
    """Holds attention computed by hand and takes a softmax and a product itself (tied output, sampling)."""

    def __init__(self):
        super().__init__()
        self.attn, self.router, self.emb = ByOperator(), Router(), nn.Embedding(5, 8)

    def forward(self, ids):
        x = self.emb(ids)
        return (self.attn(x, x) @ x @ self.emb.weight.T).softmax(dim=-1)


def test_attention_computed_by_hand_is_found_by_its_softmax_and_product_never_a_holder_or_a_gate():
    found = find_attention_modules(
        nn.ModuleDict(
            {
                "sampler": Sampler(),
                "helper": ByHelper(),
                "child": BySoftmaxChild(),
                "decorated": Decorated(),
                "configured": WithConfig(),
            }
        )
    )
    assert list(found) == ["sampler.attn", "helper", "child", "decorated", "configured"]
    with pytest.raises(ValueError, match=r"\(Router\)"):
        find_attention_modules(Router())
    # Its own attention: told to move it into a module of its own.
    with pytest.raises(ValueError, match=r"if ByOperator computes attention itself \(a softmax and a matrix product\)"):
        find_attention_modules(ByOperator())


def test_wrapper_parts_never_reach_a_name_and_patterns_match_the_clean_names():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    assert clean_name("enc._orig_mod.layers.0._checkpoint_wrapped_module.self_attn") == "enc.layers.0.self_attn"
    assert clean_name("_fsdp_wrapped_module.layers.1.self_attn") == "layers.1.self_attn"
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
    plain = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    wrapped = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    wrapped.layers = nn.ModuleList(checkpoint_wrapper(m) for m in wrapped.layers)
    assert any("_checkpoint_wrapped_module" in name for name, _ in wrapped.named_modules())
    holder = nn.Module()
    holder.enc = torch.compile(wrapped, backend="eager")
    assert list(find_attention_modules(holder)) == [f"enc.{name}" for name in find_attention_modules(plain)]
    assert list(find_attention_modules(holder, ["enc.layers.1.*"])) == ["enc.layers.1.self_attn"]


def test_module_device_reads_parameters_then_buffers_then_the_default():
    assert module_device(nn.Linear(2, 2)) == torch.device("cpu")
    norm = nn.BatchNorm1d(2, affine=False)  # buffers only
    assert module_device(norm.to("meta")) == torch.device("meta")
    assert module_device(nn.Identity(), torch.device("meta")) == torch.device("meta")
    assert module_device(nn.Identity()) == torch.device("cpu")
