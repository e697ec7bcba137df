import pytest
import torch
from torch import nn

from attn_callbacks.capture.collect import capture_attention
from attn_callbacks.capture.find import find_attention_modules
from attn_callbacks.capture.hooks import AttentionCapture


def encoder(batch_first=True, layers=2, nested=True):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=batch_first)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=nested).eval()


def count_calls(model):
    calls: dict[str, list] = {}

    def consumer(name, module, weights, rows, batch, allowed):
        calls.setdefault(name, []).append(weights.clone())

    return calls, AttentionCapture(find_attention_modules(model), consumer)


@pytest.mark.parametrize("with_padding", [False, True])
def test_capture_fires_once_per_layer_on_stock_encoder_with_nested_tensors(with_padding):
    model = encoder(nested=True)
    x = torch.randn(3, 6, 16)
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[0, 4:] = True
    mask = pad if with_padding else None
    fastpath = torch.backends.mha.get_fastpath_enabled()
    with torch.inference_mode():
        reference = model(x, src_key_padding_mask=mask)
        calls, capture = count_calls(model)
        with capture:
            out = model(x, src_key_padding_mask=mask)
    assert sorted(calls) == ["layers.0.self_attn", "layers.1.self_attn"]
    for weights in calls.values():
        assert len(weights) == 1 and weights[0].shape == (3, 4, 6, 6)
        torch.testing.assert_close(weights[0].sum(-1), torch.ones(3, 4, 6))
        if with_padding:
            assert float(weights[0][0, :, :, 4:].abs().max()) == 0.0  # padded keys get no weight
    # Outputs at real positions are unchanged (padded positions are zeros on the nested path, dense while hooked).
    valid = ~pad if with_padding else torch.ones_like(pad)
    assert float((out - reference)[valid].abs().max()) <= 1e-6
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert torch.backends.mha.get_fastpath_enabled() == fastpath


def test_capture_weights_equal_manual_need_weights_call_batch_first_false():
    model = encoder(batch_first=False, layers=1, nested=False)
    attn = model.layers[0].self_attn
    x = torch.randn(5, 2, 16)  # (L, B, E)
    with torch.no_grad():
        _, expected = attn(x, x, x, need_weights=True, average_attn_weights=False)
        calls, capture = count_calls(model)
        with capture:
            model(x)
    weights = calls["layers.0.self_attn"][0]
    assert weights.shape == (2, 4, 5, 5)  # batch-major whatever batch_first says
    torch.testing.assert_close(weights, expected)


def test_capture_nn_transformer_all_modules_and_outputs_identical():
    torch.manual_seed(0)
    model = nn.Transformer(16, 4, 2, 2, 32, dropout=0.0, batch_first=True).eval()
    src, tgt = torch.randn(2, 7, 16), torch.randn(2, 5, 16)
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    with torch.inference_mode():
        reference = model(src, tgt, tgt_mask=causal, tgt_is_causal=True)
        calls, capture = count_calls(model)
        with capture:
            out = model(src, tgt, tgt_mask=causal, tgt_is_causal=True)
    assert float((out - reference).abs().max()) <= 1e-6
    assert len(calls) == 6 and all(len(v) == 1 for v in calls.values())
    self_attn = calls["decoder.layers.0.self_attn"][0]
    assert self_attn.shape == (2, 4, 5, 5)
    assert float(self_attn.triu(1).abs().max()) == 0.0  # causal: nothing above the diagonal
    assert calls["decoder.layers.1.multihead_attn"][0].shape == (2, 4, 5, 7)


def test_capture_gives_caller_what_it_asked_for_positional_need_weights():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        _, averaged = mha(x, x, x)
        calls, capture = count_calls(mha)
        with capture:
            out_none = mha(x, x, x, None, False)  # need_weights passed positionally
            out_avg = mha(x, x, x)
            out_heads = mha(x, x, x, average_attn_weights=False)
    assert out_none[1] is None
    torch.testing.assert_close(out_avg[1], averaged)
    assert out_heads[1].shape == (2, 2, 3, 3)
    assert len(calls[""]) == 3 and all(w.shape == (2, 2, 3, 3) for w in calls[""])


@pytest.mark.parametrize("inner_first", [True, False])
def test_two_captures_both_read_every_call_and_the_last_detach_restores_fastpath(inner_first):
    # Two monitors on one Trainer: both attached at once, detached in the order they attached (or the other).
    model = encoder(nested=False)
    mha = model.layers[0].self_attn
    seen_by_user_hook = []
    mha.register_forward_hook(lambda module, args, output: seen_by_user_hook.append(output[1]))  # before ours
    x = torch.randn(2, 5, 16)
    fastpath = torch.backends.mha.get_fastpath_enabled()
    with torch.no_grad():
        reference = model(x)
        _, averaged = mha(x, x, x)
        outer_calls, outer = count_calls(model)
        inner_calls, inner = count_calls(model)
        outer.attach()
        inner.attach()
        out = model(x)
        out_none, out_avg = mha(x, x, x, need_weights=False), mha(x, x, x)
        for capture in (inner, outer) if inner_first else (outer, inner):
            assert not torch.backends.mha.get_fastpath_enabled()
            capture.detach()
    assert torch.backends.mha.get_fastpath_enabled() == fastpath
    torch.testing.assert_close(out, reference)
    assert out_none[1] is None
    torch.testing.assert_close(out_avg[1], averaged)
    for calls in (outer_calls, inner_calls):
        assert sorted(calls) == ["layers.0.self_attn", "layers.1.self_attn"]
        assert len(calls["layers.0.self_attn"]) == 3 and len(calls["layers.1.self_attn"]) == 1
        assert all(w.shape[1] == 4 for w in calls["layers.0.self_attn"])  # per head, whatever the caller asked
    torch.testing.assert_close(inner_calls["layers.0.self_attn"][0], outer_calls["layers.0.self_attn"][0])
    # A hook of the user's, registered before, sees what the caller asked for: no weights from the layer's call.
    unhooked_layer_call, unhooked_averaged, layer_call, none, averaged_call = seen_by_user_hook
    assert unhooked_layer_call is None and layer_call is None and none is None
    assert unhooked_averaged.shape == averaged_call.shape == (2, 5, 5)


def test_copy_of_an_attached_capture_is_detached_and_fastpath_count_never_goes_wrong():
    import copy

    model = encoder(nested=False)
    fastpath = torch.backends.mha.get_fastpath_enabled()
    _, capture = count_calls(model)
    capture.attach()
    clone = copy.deepcopy(capture)  # as when a monitor is deep-copied mid-epoch
    assert not clone.attached
    clone.detach()
    clone.detach()  # releasing what it never held changes nothing
    assert not torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(True)  # the user switches it back on while a capture is attached
    _, another = count_calls(model)
    with another:
        assert not torch.backends.mha.get_fastpath_enabled()  # a new capture switches it off again
    capture.detach()
    assert torch.backends.mha.get_fastpath_enabled() == fastpath
    assert no_hooks_left(model)
    with count_calls(model)[1]:  # and later captures still work
        assert not torch.backends.mha.get_fastpath_enabled()
    assert torch.backends.mha.get_fastpath_enabled() == fastpath


def test_a_copy_of_a_capture_watching_sdpa_modules_reads_their_calls_once_attached():
    import copy

    class Attend(nn.Module):
        def forward(self, x):
            return nn.functional.scaled_dot_product_attention(x, x, x)

    model = nn.Sequential(Attend())
    calls, capture = count_calls(model)
    clone = copy.deepcopy(capture)  # its modules are copies too: its hooks must not look up the originals
    x = torch.randn(2, 1, 3, 4)
    with clone, clone.watching():
        clone.modules["0"](x)
    assert [tuple(w.shape) for w in calls["0"]] == [(2, 1, 3, 3)]


def test_a_copy_of_a_model_made_while_hooked_runs_as_the_model_did_and_pickles():
    """A keep-best callback deep-copying the model mid-epoch, or torch.save of it: the copy changes nothing in its
    outputs and never calls into the capture; the original is read as before, and left without hooks."""
    import copy
    import io

    model = encoder(nested=False)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        plain = model(x)
    calls, capture = count_calls(model)
    with capture, torch.no_grad():
        duplicate = copy.deepcopy(model)
        saved = io.BytesIO()
        torch.save(model, saved)
        for other in (duplicate, torch.load(io.BytesIO(saved.getvalue()), weights_only=False)):
            torch.testing.assert_close(other(x), plain)  # the fast path (off while hooked) rounds otherwise
        assert calls == {}  # neither copy called the consumer
        model(x)
    assert sorted(calls) == ["layers.0.self_attn", "layers.1.self_attn"] and no_hooks_left(model)


def no_hooks_left(model):
    return not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_capture_detaches_and_restores_fastpath_after_exception():
    model = encoder()

    def consumer(name, module, weights, rows, batch, allowed):
        raise RuntimeError("boom")

    capture = AttentionCapture(find_attention_modules(model), consumer)
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad(), capture:
        assert not torch.backends.mha.get_fastpath_enabled()
        model(torch.randn(1, 3, 16))
    assert torch.backends.mha.get_fastpath_enabled()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    capture.detach()  # idempotent


def test_capture_attention_context_manager_collects_every_call():
    model = encoder(nested=False)
    with torch.no_grad(), capture_attention(model, modules=["layers.1.*"]) as weights:
        model(torch.randn(2, 4, 16))
        model(torch.randn(1, 3, 16))
    assert list(weights) == ["layers.1.self_attn"]
    assert [w.shape for w in weights["layers.1.self_attn"]] == [(2, 4, 4, 4), (1, 4, 3, 3)]


def _compiled_frames():
    from torch._dynamo.utils import counters

    return sum(counters["frames"].values())


def test_module_compiled_before_the_hooks_existed_is_seen_and_keeps_its_graph_after():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    plain = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    compiled = torch.compile(plain, backend="eager")
    x = torch.randn(3, 5, 8)
    with torch.no_grad():
        compiled(x)  # compiled now, without hooks: dynamo does not guard on hooks, so this graph would skip them
        frames = _compiled_frames()
        with capture_attention(compiled) as weights:
            out = compiled(x)
        assert list(weights) == ["layers.0.self_attn", "layers.1.self_attn"]  # no "_orig_mod" in the names
        with capture_attention(plain) as expected:
            plain(x)
        for name in weights:
            torch.testing.assert_close(weights[name][0], expected[name][0], rtol=0, atol=0)
        torch.testing.assert_close(out, plain(x), rtol=1e-6, atol=1e-6)
        assert torch._dynamo.eval_frame._stance.stance == "default"  # restored on detach
        compiled(x)  # the graph compiled before runs again: nothing recompiled for good
        assert _compiled_frames() == frames


def test_eager_stance_is_restored_by_the_last_capture_to_detach_and_after_exceptions():
    model = nn.MultiheadAttention(8, 2, batch_first=True)
    first, second = AttentionCapture({"a": model}, lambda *a: None), AttentionCapture({"a": model}, lambda *a: None)
    first.attach()
    second.attach()
    assert torch._dynamo.eval_frame._stance.stance == "force_eager"
    first.detach()
    assert torch._dynamo.eval_frame._stance.stance == "force_eager"  # the second still reads
    second.detach()
    assert torch._dynamo.eval_frame._stance.stance == "default"
    with pytest.raises(ZeroDivisionError), capture_attention(model):
        raise ZeroDivisionError
    assert torch._dynamo.eval_frame._stance.stance == "default"


def test_capture_inside_a_compiled_function_reads_the_calls_leaves_the_stance_alone():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2)

        def forward(self, x):
            return self.attn(x, x, x)[0]

    holder = Holder()

    @torch.compile(backend="eager")
    def run(x):
        with capture_attention(holder) as weights:
            out = holder(x)
        return out, len(weights["attn"])

    assert run(torch.randn(3, 1, 8))[1] == 1
    assert torch._dynamo.eval_frame._stance.stance == "default"


@pytest.mark.parametrize("via_layer", [False, True])
def test_a_causal_hint_without_a_mask_is_read_as_the_unmasked_attention_it_computes_and_warned_about(via_layer):
    """is_causal=True without attn_mask is a hint PyTorch's fast path ignores (the attention is not causal) and that
    raises once weights are asked for: the monitored call gives the caller the same output, the weights read are the
    unmasked ones, and one warning names the module."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    if via_layer:
        model = nn.ModuleDict({"dec": nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True)}).eval()
        mha, name = model["dec"].self_attn, "dec.self_attn"

        def run():
            return model["dec"](x, x, tgt_is_causal=True)
    else:
        model = nn.ModuleDict({"mha": nn.MultiheadAttention(8, 2, batch_first=True)}).eval()
        mha, name = model["mha"], "mha"

        def run():
            return model["mha"](x, x, x, is_causal=True, need_weights=False)[0]

    with torch.no_grad():
        plain = run()
        said = f"'{name}' was called with is_causal=True and no attn_mask"
        with pytest.warns(UserWarning, match=said) as caught, capture_attention(model) as weights:
            monitored = run()
            run()
        _, unmasked = mha(x, x, x, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(monitored, plain, atol=1e-6, rtol=1e-6)  # the fast path's kernel, rounded apart
    assert len([w for w in caught if "is_causal=True" in str(w.message)]) == 1  # once per module
    torch.testing.assert_close(weights[name][0], unmasked)
    assert float(weights[name][0].triu(1).amax()) > 0.1  # keys after the query weighed: not causal


class Decoding(nn.Module):
    """An encoder layer and a greedy ``generate`` that runs it again on a growing prefix, as decoding loops do."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True).eval()

    def forward(self, x):
        return self.layer(x)

    def generate(self, x, steps):
        for _ in range(steps):
            x = torch.cat([x, self(x)[:, -1:]], dim=1)
        return x


@pytest.mark.parametrize("skip", [False, True])
def test_calls_inside_a_generate_method_are_counted_not_read_when_skipped(skip):
    """The monitor leaves out what ``generate`` computes (cached decoding attends over tokens the batch does not
    hold); ``capture_attention`` keeps every call. Outputs are as unhooked (the fast path's, to float32 rounding)."""
    model = Decoding()
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        plain = model.generate(x, 2)
        calls, capture = count_calls(model)
        capture.skip_generate = skip
        with capture:
            model(x)
            got = model.generate(x, 2)
    torch.testing.assert_close(got, plain)
    shapes = [tuple(w.shape) for w in calls["layer.self_attn"]]
    assert shapes == ([(2, 4, 3, 3)] if skip else [(2, 4, 3, 3), (2, 4, 3, 3), (2, 4, 4, 4)])
    assert capture.generated == ({"layer.self_attn": 2} if skip else {})
    assert capture.calls["layer.self_attn"] == len(shapes)
