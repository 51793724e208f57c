"""Gated DeltaNet's ops (Qwen3-Next's linear attention): gated_delta_rule and causal_conv1d.

The references against transformers' torch code (the oracle: torch_chunk_gated_delta_rule,
torch_recurrent_gated_delta_rule, causal_conv1d_fn/_update, one sequence at a time); then the
Triton kernels (interpreter on CPU, float32 and float16; compiled on a GPU) against the
references on flat varlen batches: lengths off the 64-token chunk, mixed prefill and decode,
Hv = 2 Hk, state slots out of order, has_initial_state mixed, and a sequence fed in pieces.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from test_kernels import DTYPES, _kernel_device, _seed, assert_close  # noqa: F401
from triton_kernels.causal_conv1d import causal_conv1d_reference, causal_conv1d_triton
from triton_kernels.gated_delta import gated_delta_rule_reference, gated_delta_rule_triton

pytestmark = pytest.mark.usefixtures("kernel_device")

# The chunked kernel solves each chunk's triangular system in float32 and the recurrence
# stays float32: against the float32 reference, float32 inputs agree to rounding; float16
# inputs round the output once (both sides read the same float16 q, k, v).
TOL_DELTA = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=3e-3),
             torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
TOL_CONV = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
            torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def _delta_batch(lens, hk, hv, dk, dv, dtype, num_slots=None):
    """Random inputs for sequences of these lengths; the decay mixes strong and weak heads
    (log decays down to about -4 per token) so both the state and the new tokens matter."""
    t, n = sum(lens), len(lens)
    q = torch.randn(t, hk, dk, dtype=dtype)
    k = torch.randn(t, hk, dk, dtype=dtype)
    v = torch.randn(t, hv, dv, dtype=dtype)
    a_log = torch.rand(hv) * 2 - 1.5                                    # per head, as A_log
    g = -a_log.exp() * F.softplus(torch.randn(t, hv) * 2)               # float32, <= 0
    beta = torch.rand(t, hv).to(dtype)
    num_slots = num_slots or n + 3
    pool = torch.randn(num_slots, hv, dk, dv)
    slots = torch.randperm(num_slots)[:n].to(torch.int32)               # out of order
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    return q, k, v, g, beta, pool, slots, cu


def _hf_delta(q, k, v, g, beta, state, chunked: bool, use_l2norm=True):
    """transformers' gated delta rule on one sequence [L, H, D] -> (o [L, Hv, Dv], state)."""
    fn = hf.torch_chunk_gated_delta_rule if chunked else hf.torch_recurrent_gated_delta_rule
    o, s = fn(q[None], k[None], v[None], g[None], beta[None], initial_state=state[None],
              output_final_state=True, use_qk_l2norm_in_kernel=use_l2norm)
    return o[0], s[0]


# ---- gated_delta_rule: reference vs transformers --------------------------------------------

@pytest.mark.parametrize("chunked", [False, True])
def test_reference_matches_transformers(chunked):
    lens = [1, 70, 5, 64]
    hk, hv, dk, dv = 2, 4, 32, 16
    q, k, v, g, beta, pool, slots, cu = _delta_batch(lens, hk, hv, dk, dv, torch.float32)
    has = torch.tensor([True, False, True, True])
    before = pool.clone()
    out = gated_delta_rule_reference(q, k, v, g, beta, pool, slots, cu, has, dk ** -0.5)
    for i, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        start = before[slots[i]] if has[i] else torch.zeros(hv, dk, dv)
        o, s = _hf_delta(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], start, chunked)
        assert_close(out[lo:hi], o, atol=2e-5, rtol=2e-5, what=f"seq {i} output")
        assert_close(pool[slots[i]], s, atol=2e-5, rtol=2e-5, what=f"seq {i} state")
    # the initial state mattered, and the rows nobody owns are untouched
    assert (before[slots[0]] - pool[slots[0]]).abs().max() > 1e-2
    others = sorted(set(range(pool.shape[0])) - set(slots.tolist()))
    assert torch.equal(pool[others], before[others])


def test_reference_without_l2norm_and_scale_applies_after_norm():
    lens = [9]
    q, k, v, g, beta, pool, slots, cu = _delta_batch(lens, 1, 1, 16, 16, torch.float32)
    k = k / k.norm(dim=-1, keepdim=True)            # unnormalised updates would blow up
    has = torch.tensor([True])
    start = pool[slots[0]].clone()
    out = gated_delta_rule_reference(q, k, v, g, beta, pool, slots, cu, has, 16 ** -0.5,
                                     use_qk_l2norm=False)
    o, s = _hf_delta(q, k, v, g, beta, start, chunked=False, use_l2norm=False)
    assert_close(out, o, atol=2e-5, rtol=2e-5)
    assert_close(pool[slots[0]], s, atol=2e-5, rtol=2e-5, what="state")
    # a different scale scales the output linearly (q enters o once, after the l2norm)
    pool[slots[0]] = start
    out2 = gated_delta_rule_reference(q, k, v, g, beta, pool, slots, cu, has, 2 * 16 ** -0.5,
                                      use_qk_l2norm=False)
    assert_close(out2, 2 * out, atol=2e-5, rtol=2e-5, what="scale")


# ---- gated_delta_rule: pieces == one piece --------------------------------------------------

def _run_in_pieces(op, cuts, q, k, v, g, beta, pool, slot, scale):
    outs, lo = [], 0
    for i, hi in enumerate(cuts + [q.shape[0]]):
        cu = torch.tensor([0, hi - lo], dtype=torch.int32)
        outs.append(op(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], pool, slot, cu,
                       torch.tensor([i > 0]), scale))
        lo = hi
    return torch.cat(outs)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_pieces_carry_the_state(impl):
    # one 150-token sequence, whole and split at 7 / 16 / 64 / 65 (the chunk boundary and
    # one past it, a one-token piece in the middle)
    q, k, v, g, beta, pool, slots, cu = _delta_batch([150], 1, 2, 16, 16, torch.float32)
    op = gated_delta_rule_reference if impl == "reference" else gated_delta_rule_triton
    slot = slots[:1]
    whole_pool = pool.clone()
    whole = op(q, k, v, g, beta, whole_pool, slot, cu, torch.tensor([False]), 0.25)
    pieces = _run_in_pieces(op, [7, 16, 64, 65], q, k, v, g, beta, pool, slot, 0.25)
    assert_close(pieces, whole, atol=1e-4, rtol=1e-4, what="output")
    assert_close(pool, whole_pool, atol=1e-4, rtol=1e-4, what="state")


# ---- gated_delta_rule: Triton vs reference --------------------------------------------------

def _check_delta(lens, has, hk, hv, dk, dv, dtype, chunked=None):
    q, k, v, g, beta, pool, slots, cu = _delta_batch(lens, hk, hv, dk, dv, dtype)
    has = torch.tensor(has)
    pool[slots[~has].long()] = float("nan")       # rows without an initial state are ignored
    want_pool = pool.clone()
    want = gated_delta_rule_reference(q, k, v, g, beta, want_pool, slots, cu, has, dk ** -0.5)
    got = gated_delta_rule_triton(q, k, v, g, beta, pool, slots, cu, has, dk ** -0.5,
                                  chunked=chunked)
    assert_close(got, want, **TOL_DELTA[dtype], what="output")
    assert_close(pool, want_pool, **TOL_DELTA[dtype], what="state pool")


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_mixed_prefill_and_decode(dtype):
    # prompts off the chunk (70: a boundary inside, 5: one short chunk, 64: one full), decodes
    # and an empty segment among them, Hv = 2 Hk, Dk not a power of two, slots out of order
    _check_delta([1, 70, 5, 1, 64, 0], [True, False, True, True, False, True], 2, 4, 24, 16,
                 dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_decode_batch_takes_recurrent_kernel(dtype):
    _check_delta([1] * 5, [True, False, True, True, False], 2, 4, 32, 16, dtype)


@pytest.mark.parametrize("chunked", [False, True])
def test_triton_both_kernels_on_any_lengths(chunked):
    # each kernel forced on the batch the other would take
    lens = [1, 1, 1] if chunked else [3, 65, 1]
    _check_delta(lens, [True, True, False], 1, 2, 16, 16, torch.float32, chunked=chunked)


def test_bad_inputs_raise():
    q, k, v, g, beta, pool, slots, cu = _delta_batch([3], 2, 3, 16, 16, torch.float32)
    has = torch.tensor([True])
    with pytest.raises(ValueError, match="multiple"):
        gated_delta_rule_reference(q, k, v, g, beta, pool, slots, cu, has, 0.25)
    q, k, v, g, beta, pool, slots, cu = _delta_batch([3], 2, 4, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="float32"):
        gated_delta_rule_triton(q, k, v, g.half(), beta, pool, slots, cu, has, 0.25)
    with pytest.raises(ValueError, match="state_pool"):
        gated_delta_rule_triton(q, k, v, g, beta, pool.half(), slots, cu, has, 0.25)
    with pytest.raises(ValueError, match="has_initial_state"):
        gated_delta_rule_triton(q, k, v, g, beta, pool, slots, cu, has.int(), 0.25)


# ---- causal_conv1d --------------------------------------------------------------------------

def _conv_batch(lens, c, w, dtype, with_bias=True):
    t, n = sum(lens), len(lens)
    x = torch.randn(t, c, dtype=dtype)
    weight = torch.randn(c, w, dtype=dtype) / w ** 0.5
    bias = torch.randn(c, dtype=dtype) if with_bias else None
    pool = torch.randn(n + 2, c, w - 1, dtype=dtype)
    slots = torch.randperm(n + 2)[:n].to(torch.int32)
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    return x, weight, bias, pool, slots, cu


@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_reference_matches_transformers(activation):
    lens = [1, 2, 9, 1]
    c, w = 40, 4
    x, weight, bias, pool, slots, cu = _conv_batch(lens, c, w, torch.float32)
    has = torch.tensor([True, True, False, False])
    before = pool.clone()
    y = causal_conv1d_reference(x, weight, bias, pool, slots, cu, has, activation)
    for i, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        xs = x[lo:hi].t()[None]                                           # [1, C, L]
        if has[i]:            # decode-style: transformers' update shifts its state in place
            state = before[slots[i]][None].clone()
            want = hf.causal_conv1d_update(xs, state, weight, bias, activation)
        else:                 # a fresh prompt: left padding W-1
            want = hf.causal_conv1d_fn(xs, weight, bias, activation=activation)
            state = F.pad(xs, (w - 1, 0))[..., -(w - 1):]
        assert_close(y[lo:hi], want[0].t(), atol=1e-5, rtol=1e-5, what=f"seq {i} output")
        assert_close(pool[slots[i]], state[0], atol=0, rtol=0, what=f"seq {i} state")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias,activation", [(True, "silu"), (False, None)])
def test_conv_triton_matches_reference(dtype, with_bias, activation):
    # segments shorter than W-1 (1, 2) keep part of the old state, a 0-token one keeps all
    # of it; C = 72 is not a multiple of the channel tile; 40 tokens span several token tiles
    lens = [1, 2, 40, 0, 1, 3, 7]
    has = torch.tensor([True, True, False, True, False, True, True])
    x, weight, bias, pool, slots, cu = _conv_batch(lens, 72, 4, dtype, with_bias)
    pool[slots[~has].long()] = float("nan")       # rows without an initial state are ignored
    want_pool = pool.clone()
    want = causal_conv1d_reference(x, weight, bias, want_pool, slots, cu, has, activation)
    got = causal_conv1d_triton(x, weight, bias, pool, slots, cu, has, activation)
    assert_close(got, want, **TOL_CONV[dtype], what="output")
    assert_close(pool, want_pool, atol=0, rtol=0, what="state pool")


def test_conv_pieces_carry_the_state():
    x, weight, bias, pool, slots, cu = _conv_batch([20], 40, 4, torch.float32)
    slot = slots[:1]
    whole_pool = pool.clone()
    whole = causal_conv1d_triton(x, weight, bias, whole_pool, slot, cu, torch.tensor([False]))
    outs, lo = [], 0
    for i, hi in enumerate([1, 2, 9, 10, 20]):
        outs.append(causal_conv1d_triton(x[lo:hi], weight, bias, pool, slot,
                                         torch.tensor([0, hi - lo], dtype=torch.int32),
                                         torch.tensor([i > 0])))
        lo = hi
    assert_close(torch.cat(outs), whole, atol=1e-5, rtol=1e-5)
    assert_close(pool, whole_pool, atol=0, rtol=0, what="state pool")


def test_conv_bad_inputs_raise():
    x, weight, bias, pool, slots, cu = _conv_batch([3], 8, 4, torch.float32)
    has = torch.tensor([True])
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_reference(x, weight, bias, pool, slots, cu, has, "gelu")
    with pytest.raises(ValueError, match="conv_state_pool"):
        causal_conv1d_triton(x, weight, bias, pool.half(), slots, cu, has)
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d_triton(x, weight[:4], bias, pool, slots, cu, has)
