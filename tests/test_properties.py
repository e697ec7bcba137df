"""Hypothesis property tests of :mod:`attn_callbacks.functional` against float64 Python-loop definitions.

Every case is a random batch: shapes B 1-3, H 1-4, Lq and Lk 1-7, vocabularies of 1-6 tokens (ids repeat a lot),
self- or cross-attention, padding on the query and the key side (whole sequences included), padded keys masked to
exactly 0 or left with weight, an optional causal mask (Lq == Lk) and random ``attn_mask`` holes (-inf before the
softmax), temperatures from uniform to underflowing one-hot, and non-finite rows (NaN or inf, in one head or all).
The accumulators are float32, as in :class:`attn_callbacks.metrics.AttentionAccumulator`. The epoch metrics are
computed by the package from those accumulators (in float64, so that the check is of the formula and not of float32
rounding) and compared with their loop definitions from the docstrings.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from unittest import mock

import numpy as np
import pytest
import torch
from _reference import accumulate_attention_reference, naive_js
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from attn_callbacks import functional as F
from attn_callbacks.base.numba_loader import NUMBA_SWITCH
from attn_callbacks.sums import step_torch

LOG2 = math.log(2)
NUM_STATS = len(F.POSITION_STATS)


def _settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# ---------------------------------------------------------------------------------------------------------------------
# Random cases
# ---------------------------------------------------------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Spec:
    """Plain description of a batch (what Hypothesis prints for a failing example); :func:`build` makes tensors."""

    heads: int
    len_q: int
    len_k: int
    vocab_q: int
    vocab_k: int
    self_attention: bool
    causal: bool
    query_valid: tuple[tuple[bool, ...], ...]  # (B, Lq)
    key_valid: tuple[tuple[bool, ...], ...]  # (B, Lk); the query mask for self-attention
    mask_ignored_keys: bool  # -inf on ignored keys before the softmax (else they keep weight)
    hole_density: float  # share of random -inf attn_mask entries
    temperature: float  # score scale: 0 = uniform, 60 = one-hot with underflowing zeros
    # (n, i, head or -1 for all heads, nan / inf / 0.0; 0.0 always zeroes the whole row, in every head)
    nonfinite_rows: tuple[tuple[int, int, int, float], ...]
    pad_id: int | None  # id written at ignored positions; None: leave the random id
    dtype: str
    seed: int

    @property
    def batch(self) -> int:
        return len(self.query_valid)


def _masks(draw, batch, length, all_valid):
    if all_valid:
        return tuple((True,) * length for _ in range(batch))
    rows = []
    for _ in range(batch):
        if draw(st.sampled_from([False, False, False, True])):  # a sequence that is all padding
            rows.append((False,) * length)
        else:  # shrinks towards no padding
            rows.append(tuple(draw(st.lists(st.sampled_from([True, True, False]), min_size=length, max_size=length))))
    return tuple(rows)


@st.composite
def specs(
    draw,
    *,
    min_batch=1,
    heads=None,
    vocab=None,
    self_attention=None,
    keys_all_valid=False,
    mask_ignored_keys=None,
    dtypes=("float32", "float64", "bfloat16"),
    temperatures=(1.0, 0.0, 4.0, 60.0),
):
    batch = draw(st.integers(min_batch, 3))
    heads = heads if heads is not None else draw(st.integers(1, 4))
    self_attention = draw(st.booleans()) if self_attention is None else self_attention
    len_q = draw(st.integers(1, 7))
    len_k = len_q if self_attention else draw(st.integers(1, 7))
    vocab_q, vocab_k = vocab if vocab is not None else (draw(st.integers(1, 6)), None)
    if vocab_k is None:
        vocab_k = vocab_q if self_attention else draw(st.integers(1, 6))
    causal = len_q == len_k and draw(st.booleans())
    query_valid = _masks(draw, batch, len_q, all_valid=keys_all_valid and self_attention)
    key_valid = query_valid if self_attention else _masks(draw, batch, len_k, all_valid=keys_all_valid)
    nonfinite_rows = st.tuples(
        st.integers(0, batch - 1),
        st.integers(0, len_q - 1),
        st.integers(-1, heads - 1),
        st.sampled_from([math.nan, math.inf, 0.0]),  # 0.0: a row some attention code gives a padded query
    )
    return Spec(
        heads=heads,
        len_q=len_q,
        len_k=len_k,
        vocab_q=vocab_q,
        vocab_k=vocab_k,
        self_attention=self_attention,
        causal=causal,
        query_valid=query_valid,
        key_valid=key_valid,
        mask_ignored_keys=draw(st.booleans()) if mask_ignored_keys is None else mask_ignored_keys,
        hole_density=draw(st.sampled_from([0.0, 0.3])),
        temperature=draw(st.sampled_from(temperatures)),
        nonfinite_rows=tuple(draw(st.lists(nonfinite_rows, max_size=3))),
        pad_id=draw(st.sampled_from([-100, None, 0])),
        dtype=draw(st.sampled_from(dtypes)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@dataclass
class Batch:
    weights: torch.Tensor
    query_ids: torch.Tensor
    key_ids: torch.Tensor
    query_valid: torch.Tensor
    key_valid: torch.Tensor

    def args(self):
        return self.weights, self.query_ids, self.key_ids, self.query_valid, self.key_valid

    def rows(self, start, stop):
        return Batch(*(t[start:stop] for t in self.args()))


def build(spec: Spec) -> Batch:
    g = torch.Generator().manual_seed(spec.seed)
    batch, heads, len_q, len_k = spec.batch, spec.heads, spec.len_q, spec.len_k
    query_valid = torch.tensor(spec.query_valid, dtype=torch.bool).reshape(batch, len_q)
    key_valid = torch.tensor(spec.key_valid, dtype=torch.bool).reshape(batch, len_k)
    query_ids = torch.randint(0, spec.vocab_q, (batch, len_q), generator=g)
    key_ids = query_ids.clone() if spec.self_attention else torch.randint(0, spec.vocab_k, (batch, len_k), generator=g)
    if spec.pad_id is not None:
        query_ids = torch.where(query_valid, query_ids, spec.pad_id)
        key_ids = torch.where(key_valid, key_ids, spec.pad_id)

    scores = torch.randn(batch, heads, len_q, len_k, generator=g) * spec.temperature
    allowed = torch.ones(batch, heads, len_q, len_k, dtype=torch.bool)
    if spec.causal:
        allowed &= torch.ones(len_q, len_k, dtype=torch.bool).tril()
    if spec.mask_ignored_keys:
        allowed &= key_valid[:, None, None, :]
    if spec.hole_density:
        allowed &= torch.rand(batch, heads, len_q, len_k, generator=g) >= spec.hole_density
    dtype = _DTYPES[spec.dtype]
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    weights = scores.to(compute).masked_fill(~allowed, float("-inf")).softmax(-1).to(dtype)  # all -inf: NaN row
    for n, i, head, value in spec.nonfinite_rows:
        if head < 0 or value == 0:  # zeros only as a whole row: one zeroed weight would just unnormalise the row
            weights[n, :, i] = value
        else:
            weights[n, head, i, int(torch.randint(0, len_k, (), generator=g))] = value
    return Batch(weights, query_ids, key_ids, query_valid, key_valid)


def new_state(heads, vocab_q, vocab_k, dtype=torch.float32):
    return {
        "S": torch.zeros(heads, vocab_q, vocab_k, dtype=dtype),
        "C": torch.zeros(vocab_q, vocab_k, dtype=torch.long),
        "Q": torch.zeros(vocab_q, dtype=torch.long),
        "U": torch.zeros(vocab_q, vocab_k, dtype=dtype),
        "P": torch.zeros(NUM_STATS, heads, dtype=dtype),
        "skipped": 0,
    }


def accumulate(state, batch: Batch, path: str = "reference"):
    if path == "fast":
        return accumulate_fast(state, batch)
    skipped = accumulate_attention_reference(
        state["S"], state["C"], state["Q"], *batch.args(), uniform_sum=state["U"], position_sums=state["P"]
    )
    assert skipped.dtype == torch.int64 and skipped.dim() == 0
    state["skipped"] += int(skipped)
    return state


def accumulate_fast(state, batch: Batch):
    """The fast path on its packed layout, unpacked and added into the same state as the reference path's."""
    heads, vocab_q, vocab_k = state["S"].shape
    plane = vocab_q * vocab_k
    sums = torch.zeros(heads + 1, plane, dtype=state["S"].dtype)
    C, Q = torch.zeros(plane, dtype=torch.long), torch.zeros(vocab_q, dtype=torch.long)
    P = torch.zeros_like(state["P"])
    pairs = F.pair_index(batch.query_ids, batch.key_ids, batch.query_valid, batch.key_valid, vocab_q, vocab_k)
    skipped = F.accumulate_attention(
        sums, C, Q, P, batch.weights, pairs, batch.query_ids, batch.query_valid, batch.key_valid
    )
    assert skipped.dtype == torch.int64 and skipped.dim() == 0
    state["S"] += sums[:heads].view(heads, vocab_q, vocab_k)
    state["U"] += sums[heads].view(vocab_q, vocab_k)
    state["C"] += C.view(vocab_q, vocab_k)
    state["Q"] += Q
    state["P"] += P
    state["skipped"] += int(skipped)
    return state


def run(spec: Spec, batch: Batch | None = None, path: str = "reference"):
    return accumulate(new_state(spec.heads, spec.vocab_q, spec.vocab_k), batch or build(spec), path)


# ---------------------------------------------------------------------------------------------------------------------
# float64 loop references: the accumulators
# ---------------------------------------------------------------------------------------------------------------------


def reference(batch: Batch, vocab_q, vocab_k, accumulator_dtype=torch.float32):
    """S, C, Q, skipped, U, position sums and, per query token, the kept rows with a visible key; all float64 loops.

    A key is visible when it is valid and some head gives it a non-zero weight, as the accumulator stores it.
    """
    w = batch.weights.double().numpy()
    stored = batch.weights.to(accumulator_dtype).double().numpy()  # what "non-zero" means in the accumulator
    qi, ki = batch.query_ids.tolist(), batch.key_ids.tolist()
    qv, kv = batch.query_valid.tolist(), batch.key_valid.tolist()
    n_batch, heads, len_q, len_k = w.shape
    S = np.zeros((heads, vocab_q, vocab_k))
    C = np.zeros((vocab_q, vocab_k))
    Q = np.zeros(vocab_q)
    U = np.zeros((vocab_q, vocab_k))
    P = np.zeros((NUM_STATS, heads))
    rows_with_visible = np.zeros(vocab_q)
    skipped = 0
    for n in range(n_batch):
        for i in range(len_q):
            if not qv[n][i]:
                continue
            if not all(math.isfinite(x) for h in range(heads) for x in w[n, h, i]) or not (stored[n, :, i] > 0).any():
                skipped += 1  # non-finite in some head, or no weight anywhere: no occurrence of the token's attention
                continue
            a = qi[n][i]
            Q[a] += 1
            keys = [j for j in range(len_k) if kv[n][j]]
            visible = [j for j in keys if any(stored[n, h, i, j] != 0 for h in range(heads))]
            for j in keys:
                C[a, ki[n][j]] += 1
                for h in range(heads):
                    S[h, a, ki[n][j]] += w[n, h, i, j]
            for j in visible:
                U[a, ki[n][j]] += 1 / len(visible)
            rows_with_visible[a] += bool(visible)
            for h in range(heads):
                row = {j: w[n, h, i, j] for j in keys}
                # The entropy of the row as stored in the accumulator's dtype: renormalising a row whose valid-key
                # mass lies in values that dtype flushes to 0 is beyond any float32 computation.
                kept = {j: stored[n, h, i, j] for j in keys}
                total = sum(kept.values())
                P[0, h] += -sum(x / total * math.log(x / total) for x in kept.values() if x > 0)
                P[1, h] += math.log(len(visible)) if visible else 0.0
                P[2, h] += row.get(i, 0.0)
                P[3, h] += row.get(i - 1, 0.0)
                P[4, h] += row.get(i + 1, 0.0)
                P[5, h] += sum(x * abs(i - j) for j, x in row.items())
    as_tensor = torch.from_numpy
    return {
        "S": as_tensor(S),
        "C": as_tensor(C),
        "Q": as_tensor(Q),
        "U": as_tensor(U),
        "P": as_tensor(P),
        "skipped": skipped,
        "rows_with_visible": as_tensor(rows_with_visible),
    }


def close(actual, expected, rtol=1e-5, atol=1e-6, msg=None):
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol, msg=msg)


# ---------------------------------------------------------------------------------------------------------------------
# float64 loop references: the epoch metrics (from the docstrings)
# ---------------------------------------------------------------------------------------------------------------------


def as64(values):
    return torch.tensor(values, dtype=torch.float64)


def loop_divide(x, y):
    return x / y if y else 0.0


# The metric references take tensors, read them as nested Python lists of floats and loop.


def loop_mass(S, Q):
    """``(Vq, Vk)`` attention mass ``S[a, b] / Q[a]`` of one head."""
    q = Q.tolist()
    return as64([[loop_divide(x, q[a]) for x in row] for a, row in enumerate(S.tolist())])


def loop_mean_weight(S, C):
    c = C.tolist()
    return as64([[loop_divide(x, c[a][b]) for b, x in enumerate(row)] for a, row in enumerate(S.tolist())])


def loop_asymmetry(P):
    p = P.tolist()
    v = len(p)
    cross = sum(p[a][b] * p[b][a] for a in range(v) for b in range(v))
    norm = sum(p[a][b] ** 2 for a in range(v) for b in range(v))
    return math.sqrt(max(0.0, 1 - cross / norm)) if norm else 0.0


def loop_pairwise(P):
    p = P.tolist()
    v = len(p)
    return as64([[loop_divide(p[a][b] - p[b][a], p[a][b] + p[b][a]) for b in range(v)] for a in range(v)])


def loop_entropy(row):
    total = sum(row)
    return -sum(x / total * math.log(x / total) for x in row if x > 0) if total else 0.0


def loop_row_entropy(P, Q):
    q = Q.tolist()
    return loop_divide(sum(q[a] * loop_entropy(row) for a, row in enumerate(P.tolist())), sum(q))


def loop_lift(S, U):
    u = U.tolist()
    return as64([[loop_divide(x, u[a][b]) for b, x in enumerate(row)] for a, row in enumerate(S.tolist())])


def loop_mean_lift(S, U):
    u = U.tolist()
    num = den = 0.0
    for a, row in enumerate(S.tolist()):
        for b, x in enumerate(row):
            if x > 0:
                num += x * math.log(x / u[a][b])
                den += x
    return math.exp(loop_divide(num, den))


def loop_drift(current, reference_, current_count, reference_count, min_support):
    """``(js, frobenius)`` of one ``(Vq, Vk)`` pair of attention masses."""
    cur, ref, q_t, q_s = current.tolist(), reference_.tolist(), current_count.tolist(), reference_count.tolist()
    num = den = 0.0
    for a in range(len(cur)):
        if q_t[a] >= min_support and q_s[a] >= min_support:
            num += q_t[a] * naive_js(cur[a], ref[a])
            den += q_t[a]
    diff = sum((x - y) ** 2 for row_t, row_s in zip(cur, ref, strict=True) for x, y in zip(row_t, row_s, strict=True))
    norm = sum(y**2 for row in ref for y in row)
    return loop_divide(num, den), loop_divide(math.sqrt(diff), math.sqrt(norm))


def loop_sink_mass(S, Q, sinks):
    return loop_divide(sum(row[b] for row in S.tolist() for b in sinks), sum(Q.tolist()))


def loop_in_degree(S, Q):
    s, total = S.tolist(), sum(Q.tolist())
    return as64([loop_divide(sum(row[b] for row in s), total) for b in range(len(s[0]))])


def usable_rows(batch: Batch, dtype=torch.float32):
    """(B, Lq): rows finite in every head with some positive weight (as stored in the accumulator's dtype)."""
    finite = torch.isfinite(batch.weights).all(dim=-1).all(dim=1)
    return finite & (batch.weights.to(dtype) > 0).any(dim=-1).any(dim=1)


def kept_rows(batch: Batch):
    return int((batch.query_valid & usable_rows(batch)).sum())


# ---------------------------------------------------------------------------------------------------------------------
# accumulate_attention
# ---------------------------------------------------------------------------------------------------------------------

# One query row, keys [0, ignored]: the ignored key is not masked and takes all but 4.7e-35 of the weight. Over the one
# valid key the row is [1], entropy 0; a valid-key mass s below the 1e-30 clamp in accumulate_attention's
# -Σ w log w / s + log s gives log(1e-30) = -69 instead.
TINY_VALID_MASS = Spec(
    heads=1,
    len_q=1,
    len_k=2,
    vocab_q=1,
    vocab_k=1,
    self_attention=False,
    causal=False,
    query_valid=((True,),),
    key_valid=((True, False),),
    mask_ignored_keys=False,
    hole_density=0.0,
    temperature=60.0,
    nonfinite_rows=(),
    pad_id=-100,
    dtype="float32",
    seed=5,
)


@pytest.mark.parametrize("path", ["reference", "fast"])
@_settings(400)
@given(spec=specs())
def test_accumulate_attention_matches_float64_loop(path, spec):
    batch = build(spec)
    state = run(spec, batch, path)
    ref = reference(batch, spec.vocab_q, spec.vocab_k)
    close(state["S"], ref["S"], msg="S")
    assert torch.equal(state["C"].double(), ref["C"]), "C"
    assert torch.equal(state["Q"].double(), ref["Q"]), "Q"
    assert state["skipped"] == ref["skipped"], "skipped"
    close(state["U"], ref["U"], msg="U")
    for name in ("S", "U", "P"):
        assert torch.isfinite(state[name]).all(), name
    rows = kept_rows(batch)
    close(state["P"][1:], ref["P"][1:], atol=1e-6 * max(rows, 1), msg="position sums but the entropy")
    # float32 entropy of a row whose valid keys hold little mass cancels (-Σ w log w / s + log s): atol per row
    close(state["P"][0], ref["P"][0], atol=1e-5 * max(rows, 1), msg="entropy sum")


@_settings(150)
@given(spec=specs(temperatures=(60.0,), mask_ignored_keys=False))
@example(spec=TINY_VALID_MASS)
@pytest.mark.parametrize("path", ["reference", "fast"])
def test_accumulate_attention_position_entropy_is_between_zero_and_log_visible_keys(path, spec):
    # each row: 0 <= H_i <= log n_i (its support lies within the visible keys), so the sums obey the same bounds
    batch = build(spec)
    state = run(spec, batch, path)
    ref = reference(batch, spec.vocab_q, spec.vocab_k)
    tol = 1e-5 * max(kept_rows(batch), 1)
    entropy, max_entropy = state["P"][0], state["P"][1]
    assert (entropy >= -tol).all(), (entropy.tolist(), ref["P"][0].tolist())
    assert (entropy <= max_entropy + tol).all(), (entropy.tolist(), max_entropy.tolist())


@_settings(120)
@given(spec=specs(dtypes=("float32",)))
@pytest.mark.parametrize("path", ["reference", "fast"])
def test_accumulate_attention_float64_accumulators_match_float64_loop(path, spec):
    batch = build(spec)
    state = accumulate(new_state(spec.heads, spec.vocab_q, spec.vocab_k, dtype=torch.float64), batch, path)
    ref = reference(batch, spec.vocab_q, spec.vocab_k, accumulator_dtype=torch.float64)
    assert torch.equal(state["C"].double(), ref["C"]) and torch.equal(state["Q"].double(), ref["Q"])
    assert state["skipped"] == ref["skipped"]
    close(state["S"], ref["S"], rtol=1e-10, atol=1e-12, msg="S")
    close(state["P"][1:], ref["P"][1:], rtol=1e-10, atol=1e-12, msg="position sums but the entropy")
    close(state["P"][0], ref["P"][0], rtol=1e-10, atol=1e-9, msg="entropy sum")
    close(state["U"], ref["U"], rtol=1e-10, atol=1e-12, msg="U")


@_settings(150)
@given(spec=specs(min_batch=2), data=st.data())
def test_accumulate_attention_split_along_batch_equals_one_call(spec, data):
    batch = build(spec)
    whole = run(spec, batch)
    cut = data.draw(st.integers(1, spec.batch - 1), label="cut")
    halves = new_state(spec.heads, spec.vocab_q, spec.vocab_k)
    accumulate(halves, batch.rows(0, cut))
    accumulate(halves, batch.rows(cut, spec.batch))
    assert torch.equal(halves["C"], whole["C"]) and torch.equal(halves["Q"], whole["Q"])
    assert halves["skipped"] == whole["skipped"]
    for name in ("S", "U", "P"):
        close(halves[name], whole[name], msg=name)


@_settings(120)
@given(spec=specs(), other_id=st.sampled_from([-1, 10**6, 0]))
def test_accumulate_attention_ignores_ids_at_ignored_positions_drops_nonfinite_rows(spec, other_id):
    batch = build(spec)
    state = run(spec, batch)
    # any id (out of range too) at an ignored position changes nothing
    query_ids = torch.where(batch.query_valid, batch.query_ids, other_id)
    key_ids = torch.where(batch.key_valid, batch.key_ids, other_id)
    moved = run(spec, Batch(batch.weights, query_ids, key_ids, batch.query_valid, batch.key_valid))
    for name in ("S", "C", "Q", "U", "P"):
        assert torch.equal(moved[name], state[name]), name
    # a valid query row with a non-finite weight, or none positive, is dropped as if it were padding, and counted
    usable = usable_rows(batch)
    as_padding = Batch(batch.weights, batch.query_ids, batch.key_ids, batch.query_valid & usable, batch.key_valid)
    padded = run(spec, as_padding)
    assert padded["skipped"] == 0 and state["skipped"] == int((batch.query_valid & ~usable).sum())
    for name in ("S", "C", "Q", "U", "P"):
        assert torch.equal(padded[name], state[name]), name


@_settings(150)
@given(spec=specs())
def test_accumulate_attention_uniform_rows_sum_to_rows_with_a_visible_key(spec):
    batch = build(spec)
    state = run(spec, batch)
    ref = reference(batch, spec.vocab_q, spec.vocab_k)
    close(state["U"].sum(dim=1), ref["rows_with_visible"], msg="U row sums")
    assert (ref["rows_with_visible"] <= ref["Q"]).all()
    # attention lands only where the baseline could: S > 0 => U > 0 and C > 0
    assert ((state["U"] > 0) | (state["S"] == 0).all(dim=0)).all()
    assert ((state["C"] > 0) | (state["S"] == 0).all(dim=0)).all()


@_settings(150)
@given(spec=specs(mask_ignored_keys=True))
def test_accumulate_attention_uniform_rows_sum_to_query_count_ignored_keys_masked(spec):
    # every kept row's softmax mass (1) lies on valid keys, so it has a visible key and spreads exactly 1
    state = run(spec)
    close(state["U"].sum(dim=1), state["Q"], msg="U rows sum to Q")
    assert (state["U"][state["Q"] == 0] == 0).all()


# ---------------------------------------------------------------------------------------------------------------------
# Epoch metrics against their loop definitions
# ---------------------------------------------------------------------------------------------------------------------


@_settings(150)
@given(spec=specs())
def test_attention_mass_and_mean_weight_match_loop_definitions(spec):
    state = run(spec)
    S, C, Q = state["S"].double(), state["C"], state["Q"]
    close(F.attention_mass(S, Q), torch.stack([loop_mass(m, Q) for m in S]), rtol=1e-12, atol=0)
    close(F.mean_weight(S, C), torch.stack([loop_mean_weight(m, C) for m in S]), rtol=1e-12, atol=0)
    close(F.attention_mass(S.mean(0), Q), loop_mass(S.mean(0), Q), rtol=1e-12, atol=0)
    # in float32, as the callback computes it (denormal sums round on a 1.4e-45 grid)
    close(F.attention_mass(state["S"], Q), torch.stack([loop_mass(m, Q) for m in S]), rtol=1e-6, atol=1e-44)
    close(F.mean_weight(state["S"], C), torch.stack([loop_mean_weight(m, C) for m in S]), rtol=1e-6, atol=1e-44)


@_settings(150)
@given(spec=specs(keys_all_valid=True, dtypes=("float32", "float64")))
def test_attention_mass_rows_sum_to_one_for_seen_query_tokens_when_no_key_is_ignored(spec):
    state = run(spec)
    mass = F.attention_mass(state["S"], state["Q"])
    seen = state["Q"] > 0
    close(mass.sum(dim=-1)[:, seen], torch.ones(spec.heads, int(seen.sum())), rtol=0, atol=1e-5)
    assert (mass[:, ~seen] == 0).all()
    close(F.in_degree(state["S"], state["Q"]).sum(-1), torch.full((spec.heads,), float(seen.any())), atol=1e-5)


@_settings(150)
@given(spec=specs(self_attention=True))
def test_asymmetry_index_and_pairwise_asymmetry_match_loop_definitions_and_bounds(spec):
    state = run(spec)
    mass = F.attention_mass(state["S"].double(), state["Q"])
    for matrix in (*mass, mass.mean(0)):
        got = float(F.asymmetry_index(matrix))
        assert math.isclose(got, loop_asymmetry(matrix), rel_tol=1e-7, abs_tol=1e-7)
        assert 0.0 <= got <= 1.0
        pairwise = F.pairwise_asymmetry(matrix)
        close(pairwise, loop_pairwise(matrix), rtol=1e-12, atol=1e-15)
        assert (pairwise.abs() <= 1).all() and torch.equal(pairwise, -pairwise.T)
    batched = F.asymmetry_index(mass)
    assert batched.shape == (spec.heads,)
    close(batched, as64([loop_asymmetry(m) for m in mass]), rtol=1e-7, atol=1e-7)
    # float32 input, as the callback calls it: still within [0, 1]
    asym32 = F.asymmetry_index(F.attention_mass(state["S"], state["Q"]))
    assert ((asym32 >= 0) & (asym32 <= 1)).all()


@_settings(150)
@given(spec=specs())
def test_row_entropy_matches_loop_definition(spec):
    state = run(spec)
    Q = state["Q"]
    mass = F.attention_mass(state["S"].double(), Q)
    got = F.row_entropy(mass, Q)
    assert got.shape == (spec.heads,)
    close(got, as64([loop_row_entropy(m, Q) for m in mass]), rtol=1e-9, atol=1e-12)
    layer = float(F.row_entropy(mass.mean(0), Q))
    assert math.isclose(layer, loop_row_entropy(mass.mean(0), Q), rel_tol=1e-9, abs_tol=1e-12)
    assert 0.0 <= layer <= math.log(spec.vocab_k) + 1e-12
    assert ((got >= 0) & (got <= math.log(spec.vocab_k) + 1e-12)).all()


@_settings(150)
@given(spec=specs())
def test_lift_and_mean_lift_match_loop_definitions(spec):
    state = run(spec)
    S, U = state["S"].double(), state["U"].double()
    for matrix in (*S, S.mean(0)):
        close(F.lift(matrix, U), loop_lift(matrix, U), rtol=1e-12, atol=0)
        assert math.isclose(float(F.mean_lift(matrix, U)), loop_mean_lift(matrix, U), rel_tol=1e-9)
    close(F.lift(S, U), torch.stack([loop_lift(m, U) for m in S]), rtol=1e-12, atol=0)
    close(F.mean_lift(S, U), as64([loop_mean_lift(m, U) for m in S]), rtol=1e-9, atol=0)
    # From the rows' Σ p log p (of P, as the callback passes it), no logarithm of S taken again.
    plogp = F.row_plogp(F.attention_mass(S, state["Q"]))
    close(F.mean_lift(S, U, plogp), as64([loop_mean_lift(m, U) for m in S]), rtol=1e-9, atol=0)


@_settings(120)
@given(
    spec=specs(vocab=(4, 5), heads=2, self_attention=False),
    other=specs(vocab=(4, 5), heads=2, self_attention=False),
    min_support=st.integers(1, 4),
    k=st.integers(1, 5),
)
def test_js_divergence_attention_drift_moved_tokens_of_two_epochs_match_loops(spec, other, min_support, k):
    current, reference_ = run(spec), run(other)
    mass_t = F.attention_mass(current["S"].double(), current["Q"])
    mass_s = F.attention_mass(reference_["S"].double(), reference_["Q"])
    q_t, q_s = current["Q"], reference_["Q"]

    js_rows = F.js_divergence(mass_t, mass_s)
    assert js_rows.shape == (2, 4)
    expected_rows = as64(
        [
            [naive_js(p, q) for p, q in zip(a, b, strict=True)]
            for a, b in zip(mass_t.tolist(), mass_s.tolist(), strict=True)
        ]
    )
    close(js_rows, expected_rows, rtol=1e-9, atol=1e-12)
    assert ((js_rows >= 0) & (js_rows <= LOG2 + 1e-12)).all()

    js, frob = F.attention_drift(mass_t, mass_s, q_t, q_s, min_support=min_support)
    expected = [loop_drift(mass_t[h], mass_s[h], q_t, q_s, min_support) for h in range(2)]
    close(js, as64([e[0] for e in expected]), rtol=1e-9, atol=1e-12)
    close(frob, as64([e[1] for e in expected]), rtol=1e-9, atol=1e-12)
    assert ((js >= 0) & (js <= LOG2 + 1e-12)).all() and (frob >= 0).all()
    layer_t, layer_s = mass_t.mean(0), mass_s.mean(0)
    layer_js, layer_frob = F.attention_drift(layer_t, layer_s, q_t, q_s, min_support=min_support)
    ref_js, ref_frob = loop_drift(layer_t, layer_s, q_t, q_s, min_support)
    assert math.isclose(float(layer_js), ref_js, rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(float(layer_frob), ref_frob, rel_tol=1e-9, abs_tol=1e-12)

    moved = F.moved_tokens(layer_t, layer_s, q_t, q_s, k=k, min_support=min_support)
    supported = [a for a in range(4) if q_t[a] >= min_support and q_s[a] >= min_support]
    scores = {a: naive_js(layer_t[a].tolist(), layer_s[a].tolist()) for a in supported}
    assert len(moved) == min(k, len(supported))
    assert len({a for a, _ in moved}) == len(moved) and all(a in scores for a, _ in moved)
    got_scores = [s for _, s in moved]
    assert got_scores == sorted(got_scores, reverse=True)
    for a, s in moved:
        assert math.isclose(s, scores[a], rel_tol=1e-9, abs_tol=1e-12)
    top = sorted(scores.values(), reverse=True)[: len(moved)]  # the k largest, whatever the order of near-ties
    assert all(math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12) for x, y in zip(got_scores, top, strict=True))


@_settings(120)
@given(spec=specs(), min_support=st.integers(1, 3))
def test_attention_drift_of_an_epoch_against_itself_is_zero(spec, min_support):
    state = run(spec)  # float32, as the callback keeps it
    mass = F.attention_mass(state["S"], state["Q"])
    js, frob = F.attention_drift(mass, mass.clone(), state["Q"], state["Q"], min_support=min_support)
    assert (js == 0).all() and (frob == 0).all()
    assert (F.js_divergence(mass, mass.clone()) == 0).all()
    moved = F.moved_tokens(mass.mean(0), mass.mean(0), state["Q"], state["Q"], k=10, min_support=min_support)
    assert [a for a, _ in moved] == [a for a in range(spec.vocab_q) if state["Q"][a] >= min_support]
    assert all(s == 0 for _, s in moved)


@_settings(150)
@given(spec=specs())
def test_position_statistics_match_loop_definitions(spec):
    batch = build(spec)
    state = run(spec, batch)
    P = reference(batch, spec.vocab_q, spec.vocab_k)["P"].tolist()
    rows = kept_rows(batch)
    assert int(state["Q"].sum()) == rows
    stats = F.position_statistics(state["P"].double(), state["Q"])
    heads = range(spec.heads)
    defined = any(P[1][h] > 0 for h in heads)  # some row saw more than one key: the normalised entropy is no 0 / 0
    names = {"entropy", "self", "previous", "next", "distance"} | ({"entropy_normalized"} if defined else set())
    assert set(stats) == names
    expected = {
        "entropy": [loop_divide(P[0][h], rows) for h in heads],
        "entropy_normalized": [loop_divide(P[0][h], P[1][h]) for h in heads],
        "self": [loop_divide(P[2][h], rows) for h in heads],
        "previous": [loop_divide(P[3][h], rows) for h in heads],
        "next": [loop_divide(P[4][h], rows) for h in heads],
        "distance": [loop_divide(P[5][h], rows) for h in heads],
    }
    for name, value in expected.items():
        if name not in names:
            continue
        assert stats[name].shape == (spec.heads,)
        close(stats[name], as64(value), atol=1e-5, msg=name)
    if defined:
        assert ((stats["entropy_normalized"] >= 0) & (stats["entropy_normalized"] <= 1 + 1e-5)).all()
    for name in ("self", "previous", "next"):
        assert ((stats[name] >= 0) & (stats[name] <= 1 + 1e-5)).all(), name
    if spec.causal and spec.mask_ignored_keys:  # the softmax gives exactly 0 to the future
        assert (state["P"][4] == 0).all()


@_settings(150)
@given(spec=specs(), data=st.data())
def test_sink_mass_and_in_degree_match_loop_definitions(spec, data):
    state = run(spec)
    S, Q = state["S"].double(), state["Q"]
    sinks = sorted(data.draw(st.sets(st.integers(0, spec.vocab_k - 1), min_size=1), label="sinks"))
    sink_ids = torch.tensor(sinks)
    got = F.sink_mass(S, Q, sink_ids)
    close(got, as64([loop_sink_mass(m, Q, sinks) for m in S]), rtol=1e-12, atol=1e-15)
    assert math.isclose(float(F.sink_mass(S.mean(0), Q, sink_ids)), loop_sink_mass(S.mean(0), Q, sinks), rel_tol=1e-12)
    degree = F.in_degree(S, Q)
    assert degree.shape == (spec.heads, spec.vocab_k)
    close(degree, torch.stack([loop_in_degree(m, Q) for m in S]), rtol=1e-12, atol=1e-15)
    close(F.in_degree(S.mean(0), Q), loop_in_degree(S.mean(0), Q), rtol=1e-12, atol=1e-15)
    # the sink mass is the in-degree summed over the sinks, and all the in-degree is at most 1
    close(got, degree[:, sinks].sum(-1), rtol=1e-12, atol=1e-15)
    if spec.dtype == "bfloat16":  # rows of a bfloat16 softmax do not sum to 1
        return
    assert (degree.sum(-1) <= 1 + 1e-5).all()
    if spec.mask_ignored_keys and Q.sum() > 0:  # no mass lost on ignored keys: a distribution over key tokens
        close(degree.sum(-1), torch.ones(spec.heads), atol=1e-5)


@_settings(300)
@given(spec=specs())
def test_accumulate_attention_fast_path_equals_reference_path(spec):
    batch = build(spec)
    ref = run(spec, batch, "reference")
    rows = max(kept_rows(batch), 1)
    # The numba kernel (where it runs), then the torch kernel with the whole (small) batch in one chunk and with one
    # sample per chunk, as for a large batch on CPU.
    for switch, chunk_bytes in (("1", step_torch._CPU_CHUNK_BYTES), ("0", step_torch._CPU_CHUNK_BYTES), ("0", 1)):
        with (
            mock.patch.dict(os.environ, {NUMBA_SWITCH: switch}),
            mock.patch.object(step_torch, "_CPU_CHUNK_BYTES", chunk_bytes),
        ):
            fast = run(spec, batch, "fast")
        assert torch.equal(fast["C"], ref["C"]) and torch.equal(fast["Q"], ref["Q"]), "counts are exact"
        assert fast["skipped"] == ref["skipped"]
        for name in ("S", "U"):
            close(fast[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
        close(fast["P"][1:], ref["P"][1:], rtol=1e-5, atol=1e-6 * rows, msg="position sums but the entropy")
        close(fast["P"][0], ref["P"][0], rtol=1e-5, atol=1e-5 * rows, msg="entropy sum")
