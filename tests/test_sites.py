"""AttentionSites: the modules found in setup, the SDPA calls seen since, and their heads and devices."""

import pytest
import torch
from torch import nn

from attn_callbacks.capture.sites import AttentionSites


def test_sites_take_heads_from_modules_and_from_a_first_call():
    sites = AttentionSites()
    mha, sdpa_block = nn.MultiheadAttention(8, 2), nn.Linear(8, 8)
    kept = sites.setup({"enc.attn": mha, "dec.block": sdpa_block}, watched={"dec.block"})
    assert kept == [] and sites.heads == {"enc.attn": 2}  # a watched module's heads come with its first call
    weights, first = sites.check("dec.block", torch.rand(3, 4, 5, 5))
    assert first and sites.heads["dec.block"] == 4 and weights.shape == (3, 4, 5, 5)
    weights, first = sites.check("dec.block.call1", torch.rand(4, 5, 5))  # unbatched: a batch of one
    assert first and weights.shape == (1, 4, 5, 5) and sites.base("dec.block.call1") == "dec.block"
    assert sites.check("dec.block", torch.rand(1, 4, 2, 2))[1] is False
    with pytest.raises(RuntimeError, match="'enc.attn' returned weights with 3 heads, where its earlier calls had 2"):
        sites.check("enc.attn", torch.rand(1, 3, 2, 2))


def test_sites_keep_calls_of_watched_modules_across_stages():
    sites = AttentionSites()
    block = nn.Linear(4, 4)
    sites.setup({"block": block}, watched={"block"})
    sites.check("block", torch.rand(1, 2, 3, 3))
    sites.check("block.call1", torch.rand(1, 2, 3, 3))
    # validate() after fit(): the same module, still watched; the calls seen keep their heads, devices are learnt again.
    kept = sites.setup({"block": block}, watched={"block"})
    assert kept == ["block.call1"] and sites.heads == {"block": 2, "block.call1": 2} and sites.devices == {}
    # A model without that module: nothing kept.
    assert sites.setup({"other": nn.MultiheadAttention(4, 1)}, watched=set()) == []
    assert sites.heads == {"other": 1}


def test_sites_shapes_and_devices():
    sites = AttentionSites()
    sites.setup({"attn": nn.MultiheadAttention(4, 2)}, watched=set())
    sizes = {"src": 10, "tgt": 7}
    assert sites.shapes(sizes.__getitem__, {"attn": ("tgt", "src")}) == {"attn": (2, 7, 10)}
    assert sites.device("attn", torch.device("meta")) == torch.device("cpu")  # the module's own parameters
    sites.setup({"empty": nn.Identity()}, watched={"empty"})
    assert sites.device("empty", torch.device("meta")) == torch.device("meta")  # no tensor: the home device
