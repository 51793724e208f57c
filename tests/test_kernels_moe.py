"""Fused MoE's expert biases and gpt-oss's clamped SwiGLU: both Triton forms (GEMV, grouped
GEMM) against the torch reference, and the reference against a per-token float64 loop written
out here from Hugging Face's gpt-oss expert. Interpreter on CPU (float32, float16), compiled
kernels on a GPU, as in test_kernels.py."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import triton_kernels as tk
from test_kernels import DTYPES, TOL_ACCUM, _kernel_device, _seed, assert_close  # noqa: F401
from triton_kernels.fused_moe import (SILU, SWIGLU_OAI, MoeActivation, fused_moe_reference,
                                      fused_moe_triton)


def naive_moe(x, w13, w2, weights, ids, slot_map, b13, b2, activation):
    """Token by token, expert by expert, in float64: x @ W13^T + b13, the activation,
    @ W2^T + b2, times the routing weight, summed over the k experts."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            s = e if slot_map is None else int(slot_map[e])
            gate_up = w13[s].double() @ x[t].double()
            if b13 is not None:
                gate_up += b13[s].double()
            gate, up = gate_up[:inter], gate_up[inter:]
            if activation.kind == "silu":
                act = F.silu(gate) * up
            else:
                gate = gate.clamp(max=activation.limit)
                up = up.clamp(-activation.limit, activation.limit)
                act = (up + 1) * gate * torch.sigmoid(gate * activation.alpha)
            y = w2[s].double() @ act
            if b2 is not None:
                y += b2[s].double()
            out[t] += float(weights[t, j]) * y
    return out.to(x.dtype)


def _inputs(t, d, inter, e, k, pool, dtype, bias, act_scale):
    slots = pool or e
    x = act_scale * torch.randn(t, d)
    w13 = torch.randn(slots, 2 * inter, d) / d ** 0.5
    w2 = torch.randn(slots, d, inter) / inter ** 0.5 / act_scale
    # In float32, biases big enough that swiglu_oai's clamps at +-7 bite on some gate and up
    # values; smaller in 16-bit dtypes, where large activations would round by whole units.
    b13_scale = 3.0 if dtype == torch.float32 else 1.0
    b13 = b13_scale * torch.randn(slots, 2 * inter) if bias in ("both", "b13") else None
    b2 = 0.5 * torch.randn(slots, d) if bias in ("both", "b2") else None
    weights, ids = torch.topk(torch.randn(t, e).softmax(-1), k, dim=-1)
    slot_map = torch.randperm(slots)[:e] if pool else None
    cast = [None if a is None else a.to(dtype) for a in (x, w13, w2, b13, b2)]
    return cast[0], cast[1], cast[2], weights, ids, slot_map, cast[3], cast[4]


SHAPES = [
    (1, 64, 48, 8, 2, None),          # batch 1, I not a tile multiple
    (7, 80, 40, 6, 1, 11),            # top-1 into an 11-slot pool; D not a tile multiple
    (5, 96, 24, 6, 6, None),          # every token on every expert
    (70, 64, 56, 8, 3, 20),           # several tokens per expert, BLOCK_M 64 when grouped
]
EPILOGUES = [("both", SILU), ("b2", SILU), ("none", SWIGLU_OAI), ("b13", SWIGLU_OAI),
             ("both", SWIGLU_OAI)]


# The GEMV form serves up to _GEMV_MAX_TOKENS (8) tokens: the 70-token shape is the grouped
# form's alone (through the interpreter it cost ~10 s a case in the GEMV form).
SHAPE_PATHS = [(*shape, path) for shape in SHAPES for path in ("gemv", "grouped")
               if path == "grouped" or shape[0] <= 8]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias,activation", EPILOGUES, ids=[f"{b}-{a.kind}" for b, a in EPILOGUES])
@pytest.mark.parametrize("t,d,inter,e,k,pool,path", SHAPE_PATHS)
def test_fused_moe_bias_and_activation(t, d, inter, e, k, pool, bias, activation, path, dtype):
    x, w13, w2, weights, ids, slot_map, b13, b2 = _inputs(t, d, inter, e, k, pool, dtype, bias,
                                                          act_scale=1.0)
    kw = dict(b13=b13, b2=b2, activation=activation)
    want = fused_moe_reference(x, w13, w2, weights, ids, slot_map, **kw)
    assert_close(want, naive_moe(x, w13, w2, weights, ids, slot_map, b13, b2, activation),
                 **TOL_ACCUM[dtype], what="reference vs per-token loop")
    got = fused_moe_triton(x, w13, w2, weights, ids, slot_map, **kw, path=path)
    assert_close(got, want, **TOL_ACCUM[dtype], what=f"{path} vs reference")


@pytest.mark.parametrize("path", ["gemv", "grouped"])
def test_swiglu_oai_clamps_bite(path):
    # Large activations: about a third of the gate and up values beyond +-7, clamped.
    x, w13, w2, weights, ids, slot_map, b13, b2 = _inputs(6, 64, 32, 8, 2, None, torch.float32,
                                                          "both", act_scale=6.0)
    gate_up = torch.einsum("td,sid->tsi", x, w13) + b13
    assert (gate_up.abs() > 7).float().mean() > 0.25
    for act in (SWIGLU_OAI, MoeActivation("swiglu_oai", alpha=1.0, limit=3.5)):
        want = fused_moe_reference(x, w13, w2, weights, ids, slot_map, b13=b13, b2=b2,
                                   activation=act)
        assert_close(want, naive_moe(x, w13, w2, weights, ids, slot_map, b13, b2, act),
                     **TOL_ACCUM[torch.float32], what="reference vs per-token loop")
        got = fused_moe_triton(x, w13, w2, weights, ids, slot_map, b13=b13, b2=b2,
                               activation=act, path=path)
        assert_close(got, want, **TOL_ACCUM[torch.float32], what=f"{path} vs reference")
    plain = fused_moe_reference(x, w13, w2, weights, ids, slot_map, b13=b13, b2=b2)
    assert not torch.allclose(plain, want), "silu and swiglu_oai must differ"


def test_moe_activation_is_a_validated_frozen_dataclass():
    assert SILU == MoeActivation() and SILU.kind == "silu"
    assert (SWIGLU_OAI.kind, SWIGLU_OAI.alpha, SWIGLU_OAI.limit) == ("swiglu_oai", 1.702, 7.0)
    assert tk.MoeActivation is MoeActivation and tk.SWIGLU_OAI is SWIGLU_OAI
    with pytest.raises(ValueError, match="kind"):
        MoeActivation("gelu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        SILU.kind = "swiglu_oai"


def test_bad_biases_are_rejected():
    x, w13, w2, weights, ids, slot_map, b13, b2 = _inputs(3, 64, 32, 8, 2, None, torch.float32,
                                                          "both", 1.0)
    with pytest.raises(ValueError, match="b13"):
        fused_moe_triton(x, w13, w2, weights, ids, b13=b13[:, :32])
    with pytest.raises(ValueError, match="b2"):
        fused_moe_triton(x, w13, w2, weights, ids, b2=b2.half())
    with pytest.raises(ValueError, match="activation"):
        fused_moe_triton(x, w13, w2, weights, ids, activation="silu")


def test_public_op_passes_the_new_kwargs():
    x, w13, w2, weights, ids, slot_map, b13, b2 = _inputs(3, 64, 32, 8, 2, 12, torch.float32,
                                                          "both", 1.0)
    kw = dict(b13=b13, b2=b2, activation=SWIGLU_OAI)
    want = fused_moe_reference(x, w13, w2, weights, ids, slot_map, **kw)
    for backend in ("triton", "reference"):
        with tk.kernel_backend(backend):
            assert_close(tk.fused_moe(x, w13, w2, weights, ids, slot_map, **kw), want,
                         **TOL_ACCUM[torch.float32], what=backend)
