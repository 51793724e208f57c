"""A prefill chunk's experts on AMX tiles (triton_kernels/cpu_amx.py, cpu_amx.c), against HF's
loop in bf16 (fused_moe._moe_loop_torch: the same roundings; only the products' float32
sums may differ in order, where oneDNN splits K) and float64; the same bits on 1 to 3
threads; the routing's edges (one token an expert, ragged token blocks, unused experts, a
slot map, ids out of range); fused_moe's banks handing their prefill chunks to it."""

import pytest
import torch

import triton_kernels as tk
from tiny_fixtures import amx_kernel_runs, biased_experts
from triton_kernels.cpu_amx import moe_amx
from triton_kernels.fused_moe import (SILU, SWIGLU_OAI, MoeActivation, _moe_loop_torch,
                                      fused_moe_reference)

kernel = tk.native_kernels()
pytestmark = pytest.mark.skipif(not amx_kernel_runs(kernel),
                                reason="the AMX kernel does not run here")


def close_to_loop(got, want):
    """got against HF's loop: the same bits but for a few outputs (the products' sums in
    another order: a product's output a bf16 step off, carried on), none off by more than a
    few of the largest output's bf16 steps."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    assert (diff > 0).float().mean() < 0.02
    assert diff.max() <= 2 ** -6 * want.float().abs().max()
    assert diff.norm() <= 1e-3 * want.float().norm()


def float64_reference(c, activation, bias=True):
    """The layer in float64 from the same bf16 weights, nothing rounded between."""
    x, w13, w2 = c["x"].double(), c["w13"].double(), c["w2"].double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(c["ids"].shape[1]):
            s = int(c["slot_map"][c["ids"][t, j]])
            h = w13[s] @ x[t] + (c["b13"][s].double() if bias else 0)
            g, u = h.chunk(2)
            if activation.kind == "silu":
                a = torch.nn.functional.silu(g) * u
            else:
                g, u = g.clamp(max=activation.limit), u.clamp(-activation.limit, activation.limit)
                a = (u + 1) * g * torch.sigmoid(activation.alpha * g)
            down = w2[s] @ a + (c["b2"][s].double() if bias else 0)
            out[t] += c["weights"][t, j].double() * down
    return out


def run(c, activation=SILU, bias=True):
    return moe_amx(kernel, c["x"], c["w13"], c["w2"], c["weights"], c["ids"], c["slot_map"],
                   c["b13"] if bias else None, c["b2"] if bias else None, activation)


def loop(c, activation=SILU, bias=True):
    return _moe_loop_torch(c["x"], c["w13"], c["w2"], c["weights"], c["ids"], c["slot_map"],
                           c["b13"] if bias else None, c["b2"] if bias else None, activation)


# t tokens over e experts, top-k: one token (a 1-row block), ragged blocks (17, 33 rows an
# expert), many blocks an expert, K past one chunk of 256 columns (d 512, i 320).
@pytest.mark.parametrize("t,d,i,e,k", [(1, 64, 32, 4, 2), (40, 64, 32, 3, 2),
                                       (50, 128, 96, 6, 4), (200, 512, 320, 8, 3)])
# gpt-oss's activation also with limits that clamp most values, one not a bf16 value (a bf16
# tensor's clamp meets it rounded).
@pytest.mark.parametrize("activation", [SILU, SWIGLU_OAI, MoeActivation("swiglu_oai", 1.702, 0.5),
                                        MoeActivation("swiglu_oai", 1.702, 0.3)])
def test_amx_moe_rounds_as_hfs_loop(t, d, i, e, k, activation, threads):
    c = biased_experts(seed=t + d, t=t, d=d, i=i, e=e, k=k, pool=e + 3)
    for bias in (True, False):
        got = run(c, activation, bias)
        close_to_loop(got, loop(c, activation, bias))
        want = float64_reference(c, activation, bias)
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 1e-2, err                     # bf16's roundings, nothing more


def test_amx_moe_bits_do_not_depend_on_the_thread_count(threads):
    c = biased_experts(seed=7, t=97, d=256, i=64, e=12, k=4, pool=12)
    outs = []
    for n in (1, 2, 3):
        threads(n)
        outs.append(run(c))
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_amx_moe_routing_edges(threads):
    threads(2)
    c = biased_experts(seed=3, t=64, d=64, i=32, e=8, k=3, pool=10)
    # every token to experts 5, 3 and 2 (64 rows an expert, 4 whole blocks; the others
    # unused), the ids in descending order: the loop adds in id order, whatever the routing's
    c["ids"] = torch.tensor([[5, 3, 2]] * 64)
    close_to_loop(run(c), loop(c))
    # no slot map: ids are slots
    c["slot_map"], c["ids"] = None, c["ids"] + 1
    close_to_loop(run(c), loop(c))
    bad = dict(c, ids=torch.tensor([[10, 1, 0]] * 64))                # past the 10 slots
    with pytest.raises(ValueError, match="outside"):
        run(bad)
    mapped = dict(c, ids=torch.tensor([[3, 1, 0]] * 64), slot_map=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="outside"):                   # past the slot map
        run(mapped)
    # two routed ids in one slot: declined (the caller's torch path adds them by id)
    shared = dict(c, ids=torch.tensor([[3, 1, 0]] * 64), slot_map=torch.tensor([0, 1, 2, 1]))
    assert run(shared) is None
    with pytest.raises(ValueError, match="weights"):                   # weights not [T, k]
        run(dict(c, weights=c["weights"][:, :1]))
    with pytest.raises(ValueError, match="biases"):
        run(dict(c, b2=c["b2"][:, :32]))


def test_amx_moe_declines_what_it_does_not_take():
    c = biased_experts(seed=1, t=20, d=48, i=32, e=3, k=2, pool=4)     # d not a multiple of 32
    assert run(c) is None
    c = biased_experts(seed=1, t=20, d=64, i=32, e=3, k=2, pool=4)
    assert moe_amx(kernel, c["x"].half(), c["w13"].half(), c["w2"].half(), c["weights"],
                   c["ids"], c["slot_map"], None, None, SILU) is None
    assert run(c) is not None


def test_native_banks_hand_prefill_chunks_to_the_amx_kernel(threads):
    # A bf16 bank's chunk of GEMM_ROWS pairs an expert and more: the kernel's own bits; an
    # int4 bank's: the kernel on its decoded experts, each id mapped to its decoded place.
    threads(2)
    c = biased_experts(seed=11, t=48, d=128, i=64, e=4, k=2, pool=6)
    banks = (tk.NativeBank(c["w13"], kernel, amx=True), tk.NativeBank(c["w2"], kernel, amx=True))
    args = (c["weights"], c["ids"], c["slot_map"])
    got = fused_moe_reference(c["x"], *banks, *args, b13=c["b13"].float(), b2=c["b2"].float())
    assert torch.equal(got, run(c))
    from test_cpu_native import int4_bank
    q13, deq13 = int4_bank(c["w13"], 32, True, torch.bfloat16)
    q2, deq2 = int4_bank(c["w2"], 32, True, torch.bfloat16)
    int4 = (tk.NativeInt4Bank(q13["q"], q13["s"], None, 32, kernel, amx=True),
            tk.NativeInt4Bank(q2["q"], q2["s"], None, 32, kernel, amx=True))
    got = fused_moe_reference(c["x"], *int4, *args, b13=c["b13"], b2=c["b2"])
    decoded = dict(c, w13=deq13.bfloat16(), w2=deq2.bfloat16())      # exact: bf16 scales
    assert torch.equal(got, run(decoded))


@pytest.mark.parametrize("form", ["fp8 128x128", "fp8 16x32", "fp8 7x32", "fp8 48x64",
                                  "int4 g32 zero points", "int4 g64 bf16 scales"])
def test_amx_moe_reads_quantized_banks_as_their_decoded_copy(form, threads):
    # From the bytes, each chunk of rows decoded as the reference decodes it: the bits of the
    # kernel on the decoded bf16 bank. fp8 blocks ragged at the edges (D 160 over 128-column
    # blocks, I 96 under one; 2I 192 rows over 128-row blocks).
    from test_cpu_native import int4_bank
    from tiny_fixtures import fp8_bank
    threads(2)
    c = biased_experts(seed=21, t=60, d=160 if form.startswith("fp8") else 128,
                       i=96 if form.startswith("fp8") else 64, e=5, k=2, pool=7)
    if form.startswith("fp8"):
        block = tuple(int(n) for n in form.split()[1].split("x"))   # row blocks of 7, 48:
        # not whole 16-row tiles
        (q13, s13, deq13), (q2, s2, deq2) = (fp8_bank(c[w], *block) for w in ("w13", "w2"))
        banks = (tk.NativeFp8Bank(q13, s13, block, kernel), tk.NativeFp8Bank(q2, s2, block, kernel))
    else:
        group, symmetric = (32, False) if "g32" in form else (64, True)
        (p13, deq13), (p2, deq2) = (int4_bank(c[w], group, symmetric, torch.bfloat16)
                                    for w in ("w13", "w2"))
        banks = tuple(tk.NativeInt4Bank(p["q"], p["s"], p.get("z"), group, kernel)
                      for p in (p13, p2))
    args = (c["x"], *banks, c["weights"], c["ids"], c["slot_map"], c["b13"], c["b2"], SILU)
    got = moe_amx(kernel, *args)
    decoded = dict(c, w13=deq13.bfloat16(), w2=deq2.bfloat16())
    assert got is not None and torch.equal(got, run(decoded))


def test_amx_moe_runs_a_long_step_in_slices_of_its_scratch(threads, monkeypatch):
    # A step whose scratch would pass SCRATCH_BYTES runs in slices of tokens: the same bits
    # (a token's output is its own routing's alone).
    import triton_kernels.cpu_amx as cpu_amx
    threads(2)
    c = biased_experts(seed=5, t=300, d=64, i=32, e=4, k=2, pool=6)
    whole = run(c)
    monkeypatch.setattr(cpu_amx, "SCRATCH_BYTES", kernel.moe_amx_scratch(100, 2, 6, 64, 32))
    calls = []
    fn = kernel.moe_amx_fn
    monkeypatch.setattr(kernel, "moe_amx_fn", lambda *a: calls.append(a[5]) or fn(*a))
    assert torch.equal(run(c), whole)
    assert calls == [100, 100, 100]                      # tokens a call
