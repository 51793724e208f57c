"""The CPU experts' grouped torch path (one grouped_mm per projection and layer) against the
per-expert loop it replaces (HF's loop): the same bits, for every expert format and dtype.

The loop stays the reference off the CPU and for widths grouped_mm cannot take, so it is the
oracle here; tests/test_parity.py checks both against transformers end to end.
"""

import pytest
import torch

from triton_kernels.fused_moe import (SILU, SWIGLU_OAI, _moe_grouped_torch, _moe_loop_torch,
                                      fused_moe_reference)


def _inputs(g, t, e, k, s, d, i, dtype, slot_map, bias):
    x = torch.randn(t, d, generator=g).to(dtype)
    w13 = torch.randn(s, 2 * i, d, generator=g).to(dtype)
    w2 = torch.randn(s, d, i, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    weights = torch.rand(t, k, generator=g)
    sm = torch.randperm(s, generator=g)[:e].to(torch.int32) if slot_map else None
    b13 = torch.randn(s, 2 * i, generator=g).to(dtype) if bias else None
    b2 = torch.randn(s, d, generator=g).to(dtype) if bias else None
    return x, w13, w2, weights, ids, sm, b13, b2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grouped_equals_the_expert_loop(dtype):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for trial in range(12):
        e = int(torch.randint(2, 12, (1,), generator=g))
        k = int(torch.randint(1, e + 1, (1,), generator=g))
        t = int(torch.randint(1, 20, (1,), generator=g))
        s = e + int(torch.randint(0, 4, (1,), generator=g))      # a slot pool larger than E
        d, i = 8 * int(torch.randint(1, 6, (1,), generator=g)), 8 * int(torch.randint(1, 5, (1,), generator=g))
        args = _inputs(g, t, e, k, s if trial % 2 else e, d, i, dtype, slot_map=trial % 2 == 1,
                       bias=trial % 3 == 1)
        act = SWIGLU_OAI if trial % 4 == 2 else SILU
        want = _moe_loop_torch(*args, act)
        # float32 gpt-oss activations: the dispatch keeps the loop (the float32 sigmoid's
        # last bits depend on the layout), so the dispatched form is checked there.
        if act is SWIGLU_OAI and dtype == torch.float32:
            x, w13, w2, weights, ids, sm, b13, b2 = args
            got = fused_moe_reference(x, w13, w2, weights, ids, sm, b13=b13, b2=b2,
                                      activation=act)
        else:
            got = _moe_grouped_torch(*args, act)
        diff = (got.float() - want.float()).abs()
        assert torch.equal(got, want), (f"trial {trial} (T={t} E={e} k={k} D={d} I={i}): "
                                        f"{int((diff > 0).sum())} elements differ, max {diff.max()}")


def test_reference_on_unaligned_widths_and_sparse_routing():
    # D = 20 floats: 80-byte rows grouped_mm takes; I = 6 float16: 12-byte rows it refuses.
    g = torch.Generator().manual_seed(3)
    x, w13, w2, weights, ids, sm, _, _ = _inputs(g, 5, 6, 2, 6, 20, 6, torch.float16, True, False)
    got = fused_moe_reference(x, w13, w2, weights, ids, sm)
    assert torch.equal(got, _moe_loop_torch(x, w13, w2, weights, ids, sm, None, None, SILU))
    # One token on 2 of 32 experts (batch-1 decode's shape of routing) and 16 tokens on most
    # of them: both forms the dispatch picks give the loop's bits.
    for t in (1, 16):
        args = _inputs(g, t, 32, 2, 32, 16, 8, torch.bfloat16, False, False)
        got = fused_moe_reference(*args[:5])
        assert torch.equal(got, _moe_loop_torch(*args, SILU))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_token_equals_the_expert_loop(dtype):
    # Batch-1 decode's path: the same bits as the loop, with slot maps, biases, both
    # activations and k from 1 to E.
    from triton_kernels.fused_moe import _moe_one_token_torch
    g = torch.Generator().manual_seed(11)
    for trial in range(12):
        e = int(torch.randint(2, 12, (1,), generator=g))
        k = int(torch.randint(1, e + 1, (1,), generator=g))
        args = _inputs(g, 1, e, k, e + 2, 16, 8, dtype, slot_map=trial % 2 == 1,
                       bias=trial % 3 == 1)
        act = SWIGLU_OAI if trial % 4 == 2 else SILU
        want = _moe_loop_torch(*args, act)
        assert torch.equal(_moe_one_token_torch(*args, act), want), f"trial {trial} k={k}"
        assert torch.equal(fused_moe_reference(*args[:6], b13=args[6], b2=args[7],
                                               activation=act), want)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("t", [1, 3])
def test_cpu_moe_on_a_share_of_the_experts(t, packed):
    # Hybrid's CPU share: only the pairs routed to `experts`, the rest left to the GPU. One
    # token takes the full path's one call on its chosen pairs, more tokens one row a pair;
    # either equals the float32 reference with the other pairs' weights zeroed.
    from freetoken.moe.cpu import cpu_moe
    from freetoken.moe.layout import ExpertLayout
    g = torch.Generator().manual_seed(t)
    e, k, d, i = 8, 4, 64, 32
    layout = ExpertLayout(d, i, torch.bfloat16)
    bank = {"w13": (torch.randn(e, 2 * i, d, generator=g) / 8).bfloat16(),
            "w2": (torch.randn(e, d, i, generator=g) / 6).bfloat16()}
    form = (layout.pack_cpu(bank) or bank) if packed else bank
    x = torch.randn(t, d, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g).softmax(-1)
    share = [int(ids[0, 1]), int(ids[0, 3]), int(ids[-1, 0])]
    got = cpu_moe(layout, x, form, weights, ids, share)
    kept = weights * torch.isin(ids, torch.tensor(share))
    want = fused_moe_reference(x.float(), bank["w13"].float(), bank["w2"].float(), kept, ids)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2
    none = [j for j in range(e) if j not in ids.flatten().tolist()]
    assert torch.equal(cpu_moe(layout, x, form, weights, ids, none), torch.zeros_like(x))
