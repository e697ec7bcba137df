"""The keys a call's masks allow: nn.MultiheadAttention's and scaled_dot_product_attention's, per call form."""

import math

import torch
from torch import nn

from attn_callbacks.capture.masks import mha_allowed, sdpa_allowed


def test_mha_allowed_reads_boolean_and_float_attention_and_padding_masks_per_call_form():
    """nn.MultiheadAttention's masks say True where a query may NOT attend (boolean) or add to the logits (float: a
    bias allows, -inf and values 1e3 below the row's largest mask); the allowed keys are True where no mask masks
    them, for some head."""
    weights = torch.zeros(2, 2, 3, 3)  # (B, H, Lq, Lk)
    query = torch.zeros(2, 3, 8)
    causal = nn.Transformer.generate_square_subsequent_mask(3)  # 0 on and below the diagonal, -inf above
    lower = torch.ones(3, 3, dtype=torch.bool).tril()
    assert torch.equal(mha_allowed({"query": query, "attn_mask": causal}, weights), lower[None])
    assert torch.equal(mha_allowed({"query": query, "attn_mask": ~lower}, weights), lower[None])
    padding = torch.tensor([[False, False, True], [False, False, False]])  # sample 0's last key is padding
    got = mha_allowed({"query": query, "key_padding_mask": padding, "attn_mask": causal}, weights)
    assert got.tolist() == [[[1, 0, 0], [1, 1, 0], [1, 1, 0]], lower.int().tolist()]
    for masked in (-torch.inf, -1e3, -1e9):  # -1e3 zeroes a weight too: a mask, not a bias
        float_padding = torch.zeros(2, 3).masked_fill(padding, masked)
        got = mha_allowed({"query": query, "key_padding_mask": float_padding}, weights)
        assert torch.equal(got, (~padding)[:, None].expand(2, 3, 3))
    alibi = -torch.tensor([[0.0, 1.0, 2.0], [1.0, 0.0, 1.0], [2.0, 1.0, 0.0]])  # a bias: every key allowed
    assert mha_allowed({"query": query, "attn_mask": alibi}, weights).all()
    per_head = torch.zeros(4, 3, 3, dtype=torch.bool)  # (B * H, Lq, Lk): sample 1's first head masks key 0
    per_head[2, :, 0] = True
    assert mha_allowed({"query": query, "attn_mask": per_head}, weights).all()  # its second head may attend
    per_head[3, :, 0] = True
    assert mha_allowed({"query": query, "attn_mask": per_head}, weights)[1, :, 0].tolist() == [False] * 3
    unbatched = mha_allowed({"query": query[0], "key_padding_mask": padding[0]}, weights[0])
    assert unbatched.tolist() == [[[True, True, False]] * 3]
    nested = torch.nested.nested_tensor([torch.zeros(3, 8), torch.zeros(2, 8)])
    assert mha_allowed({"query": nested}, weights) is None  # its padding mask was dropped: the weights tell


def test_mha_allowed_lets_the_keys_add_bias_kv_and_add_zero_attn_append_be_seen():
    attention = nn.MultiheadAttention(8, 2, add_bias_kv=True, add_zero_attn=True, batch_first=True).eval()
    x = torch.randn(2, 4, 8)
    padding = torch.tensor([[False, False, False, True], [False] * 4])
    with torch.no_grad():
        _, weights = attention(x, x, x, key_padding_mask=padding, average_attn_weights=False)  # (2, 2, 4, 6)
    allowed = mha_allowed({"query": x, "key_padding_mask": padding, "attn_mask": torch.zeros(4, 4)}, weights)
    assert allowed.shape == (2, 4, 6)
    assert allowed[0, 0].tolist() == [True, True, True, False, True, True] and allowed[1].all()
    assert torch.equal(allowed, weights.amax(dim=1) > 0)  # the masked key alone gets no weight


def test_sdpa_allowed_reads_boolean_float_causal_and_per_head_masks():
    cpu = torch.device("cpu")
    assert sdpa_allowed(None, False, 2, 3, cpu).tolist() == [[[True] * 3] * 2]
    assert sdpa_allowed(None, True, 2, 3, cpu).tolist() == [[[True, False, False], [True, True, False]]]
    per_head = torch.tensor([[[[True, False]], [[False, False]]]])  # (B=1, H=2, 1, Lk=2): allowed for some head
    assert sdpa_allowed(per_head, False, 2, 2, cpu).tolist() == [[[True, False], [True, False]]]
    # float: a bias allows (T5's position bias folded into the mask, ALiBi: within 1e3 of the row's largest value);
    # -inf, a dtype's minimum, -1e9, and -1e4 plus a bias mask; a row whose largest value is -1e4 or less is masked
    mask = torch.tensor([[0.0, -math.inf, -1e9, -0.25, 7.5, -9999.0, -1e4, torch.finfo(torch.float32).min]])
    causal_rows = [[True, False, False, False, False, False, False, False], [True] + [False] * 7]
    assert sdpa_allowed(mask.view(1, 1, 1, 8), True, 2, 8, cpu).tolist() == [causal_rows]
    assert sdpa_allowed(mask.view(1, 1, 1, 8), False, 1, 8, cpu).tolist() == [
        [[True, False, False, True, True, False, False, False]]
    ]
    masked_whole = torch.tensor([[-1e4, -2e4]]).view(1, 1, 1, 2)  # its largest value -1e4: no key allowed
    assert sdpa_allowed(masked_whole, False, 1, 2, cpu).tolist() == [[[False, False]]]
