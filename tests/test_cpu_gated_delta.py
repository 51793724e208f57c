"""Gated DeltaNet's sequence ops on the CPU's native kernels (triton_kernels/cpu_gated_delta.py,
.c) against their references (gated_delta_rule_reference, causal_conv1d_reference, themselves
held to transformers in test_kernels_gated_delta.py): mixed prefill chunks and decodes, with
and without a starting state, Hv = 2 Hk, strided views as the layer passes them, sequences
shorter than the conv's history and empty ones, in float32, bf16 and fp16; the same bits on
1 to 3 threads; what they decline and refuse; the layer handing its steps to them."""

import pytest
import torch

import triton_kernels as tk
from test_kernels_gated_delta import TOL_CONV, TOL_DELTA, _conv_batch, _delta_batch
from tiny_fixtures import tiny_model_dir  # noqa: F401
from test_kernels import assert_close
from triton_kernels.causal_conv1d import causal_conv1d_reference
from triton_kernels.gated_delta import gated_delta_rule_reference

kernel = tk.native_kernels()
pytestmark = pytest.mark.skipif(kernel is None, reason="no native kernels (no C compiler)")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def strided(*parts):
    """The tensors as column slices of one [T, sum] tensor (the layer's split views)."""
    flat = torch.cat([p.flatten(1) for p in parts], dim=1)
    out, at = [], 0
    for p in parts:
        n = p[0].numel()
        out.append(flat[:, at:at + n].view(p.shape))
        at += n
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_delta_rule_matches_the_reference(dtype, threads):
    threads(2)
    lens, has = [1, 70, 5, 1, 64, 0], torch.tensor([True, False, True, True, False, True])
    q, k, v, g, beta, pool, slots, cu = _delta_batch(lens, 2, 4, 24, 16, dtype)
    q, k, v = strided(q, k, v)
    pool[slots[~has].long()] = float("nan")       # rows without a starting state are unread
    want_pool = pool.clone()
    want = gated_delta_rule_reference(q, k, v, g, beta, want_pool, slots, cu, has, 24 ** -0.5)
    op = tk.CpuGatedDelta(kernel, torch.randn(8, 4))
    got = op.rule(q, k, v, g, beta, pool, slots, cu, has, 24 ** -0.5)
    assert got is not None and got.dtype == dtype
    assert_close(got, want, **TOL_DELTA[dtype], what="output")
    assert_close(pool, want_pool, **TOL_DELTA[dtype], what="state pool")


@pytest.mark.parametrize("n", [1, 2, 3])
def test_native_delta_rule_same_bits_on_any_thread_count(n, threads):
    torch.manual_seed(0)
    lens, has = [1, 33, 1, 9], torch.tensor([True, False, True, True])
    q, k, v, g, beta, pool, slots, cu = _delta_batch(lens, 1, 2, 32, 32, torch.bfloat16)
    op = tk.CpuGatedDelta(kernel, torch.randn(8, 4))
    threads(1)
    pool_1 = pool.clone()
    want = op.rule(q, k, v, g, beta, pool_1, slots, cu, has, 0.2)
    threads(n)
    got = op.rule(q, k, v, g, beta, pool, slots, cu, has, 0.2)
    assert torch.equal(got, want) and torch.equal(pool, pool_1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("silu,width", [(True, 4), (False, 4), (True, 2), (True, 16)])
def test_native_conv_matches_the_reference(dtype, silu, width, threads):
    threads(2)
    # segments shorter than W-1 (1, 2) keep part of the old state, a 0-token one all of it;
    # 300 channels: a block of 256 and a ragged one
    lens = [1, 2, 40, 0, 1, 3, 7]
    has = torch.tensor([True, True, False, True, False, True, True])
    x, weight, _, pool, slots, cu = _conv_batch(lens, 300, width, dtype, with_bias=False)
    slots, cu = slots.long(), cu.long()                                     # int64 as well
    x = strided(x, torch.zeros(x.shape[0], 5, dtype=dtype))[0]    # rows 305 apart
    pool[slots[~has].long()] = float("nan")
    want_pool = pool.clone()
    want = causal_conv1d_reference(x, weight, None, want_pool, slots, cu, has,
                                   "silu" if silu else None)
    got = tk.CpuGatedDelta(kernel, weight).conv1d(x, pool, slots, cu, has, silu=silu)
    assert got is not None and got.dtype == dtype
    assert_close(got, want, **TOL_CONV[dtype], what="output")
    assert torch.equal(pool[slots.long()], want_pool[slots.long()])     # the inputs, exactly


def test_native_ops_decline_and_refuse():
    q, k, v, g, beta, pool, slots, cu = _delta_batch([3, 1], 2, 4, 16, 16, torch.float32)
    has = torch.tensor([True, False])
    op = tk.CpuGatedDelta(kernel, torch.randn(8, 4))
    assert op.rule(q, k, v, g.half(), beta, pool, slots, cu, has, 0.25) is None   # g not f32
    assert op.rule(q, k, v, g, beta, pool.half(), slots, cu, has, 0.25) is None
    assert op.rule(q, k, v, g, beta, pool, slots, cu[:2], has, 0.25) is None     # [N+1]
    bad = slots.clone()
    bad[1] = pool.shape[0]
    with pytest.raises(ValueError, match="outside the pool"):
        op.rule(q, k, v, g, beta, pool, bad, cu, has, 0.25)
    with pytest.raises(ValueError, match="one state slot"):
        op.rule(q, k, v, g, beta, pool, slots[[0, 0]], cu, has, 0.25)
    x, weight, _, cpool, cslots, ccu = _conv_batch([3, 1], 8, 4, torch.float32, False)
    conv = tk.CpuGatedDelta(kernel, weight)
    assert conv.conv1d(x, cpool.half(), cslots, ccu, has) is None               # pool dtype
    assert conv.conv1d(x[:, :4], cpool, cslots, ccu, has) is None               # channels
    assert conv.conv1d(x, cpool, cslots, ccu, has[:1]) is None                  # flags [N]
    with pytest.raises(ValueError, match="offsets"):
        conv.conv1d(x, cpool, cslots, torch.tensor([0, 3, 9], dtype=torch.int32), has)
    wide = tk.CpuGatedDelta(kernel, torch.randn(8, 17))
    assert wide.conv1d(x, torch.zeros(4, 8, 16), cslots, ccu, has) is None      # W > 16


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_cpu_engine_linear_attention_runs_native(tiny_model_dir, family, monkeypatch):
    # Every step of every Gated DeltaNet layer runs natively: the prefill through both
    # sequence ops, each decode through the whole-layer decode call (GdnDecodeCall). Its
    # output and the pools it leaves are the torch path's on the same input and state (each
    # path from a copy of the state): the difference's norm within a bf16 step of the output's.
    from freetoken import LLM, SamplingParams
    from freetoken.models.layers.linear_attention import GatedDeltaNet
    llm = LLM(str(tiny_model_dir(family, seed=2)), skip_tokenizer_init=True,
              dtype="bfloat16", enforce_eager=True)
    layers = [m for m in llm.runner.model.modules() if isinstance(m, GatedDeltaNet)]
    assert layers and all(m.cpu_native is not None and m.proj_packed is not None
                          and m.cpu_decode is not None for m in layers)
    calls = []
    for cls, name in ((tk.CpuGatedDelta, "conv1d"), (tk.CpuGatedDelta, "rule"),
                      (tk.GdnDecodeCall, "__call__")):
        fn = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda self, *a, fn=fn, name=name, **kw:
                            calls.append(name) or fn(self, *a, **kw))
    checked = []
    for m in layers:
        native, decode, forward = m.cpu_native, m.cpu_decode, m.forward

        def both(x, batch, m=m, native=native, decode=decode, forward=forward):
            pools = batch.kv.layer(m.layer_idx)
            start = [p.clone() for p in pools]
            m.cpu_native = m.cpu_decode = None
            want = forward(x, batch)
            after = [p.clone() for p in pools]
            for p, s in zip(pools, start):
                p.copy_(s)
            m.cpu_native, m.cpu_decode = native, decode
            got = forward(x, batch)
            checked.append(max(float((got.float() - want.float()).norm()
                                     / want.float().norm()),
                               *(float((p.float() - a.float()).norm() / a.float().norm())
                                 for p, a in zip(pools, after))))
            return got
        m.forward = both
    llm.generate([[5, 17, 99, 3, 200, 7, 8, 9, 10, 11]],
                 SamplingParams(max_tokens=4, temperature=0))
    # every layer: the prefill through both ops, 3 decodes through the decode call
    assert calls.count("conv1d") == calls.count("rule") == len(layers)
    assert calls.count("__call__") == 3 * len(layers) and len(checked) == 4 * len(layers)
    # A one-token prompt's prefill is a step of one token a sequence too: the decode call
    # takes it, from zeros (no state yet), whatever the slot held before.
    for m in layers:
        for p in llm.runner.kv.layer(m.layer_idx):
            p.normal_()
    llm.generate([[42]], SamplingParams(max_tokens=2, temperature=0))
    assert calls.count("conv1d") == len(layers) and calls.count("__call__") == 5 * len(layers)
    assert max(checked) <= 2 ** -8, checked
