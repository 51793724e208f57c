"""INT4 weights packed for torch's CPU int4 GEMM (triton_kernels/int4_cpu.py).

The kernel computes W' = (q - 8) * bf16(s) + bf16((8 - z) * s): checked against that product
in float64 (the packing and the (scale, zero) pairs are right), and W' against the
checkpoint's W = (q - z) * s within the documented bound (one bf16 rounding of s and of the
zero). The packed experts equal fused_moe_quant_reference to bf16 precision; a bf16 CPU
engine packs its INT4 projections and experts (resident, and the host store's CPU layers) and
stays as close to the float32 engine as it should.
"""

import pytest
import torch

import triton_kernels as tk
from freetoken import LLM, SamplingParams
from freetoken.demo.tiny_model import make_tiny_model
from freetoken.models.layers.attention import Attention
from freetoken.models.layers.linear import QuantLinear
from freetoken.models.layers.mlp import DenseMLP
from freetoken.models.quant.encode import quantize_checkpoint
from test_dequant_cpu import routed_batch
from test_kernels_dequant import random_weight
from triton_kernels.dequant import QuantFormat, dequantize_reference, fused_moe_quant_reference
from triton_kernels.fused_moe import SILU, SWIGLU_OAI

pytestmark = pytest.mark.skipif(not hasattr(torch, "_weight_int4pack_mm_for_cpu"),
                                reason="this torch has no CPU int4 GEMM")
BF16_ULP = 2.0 ** -8          # bf16's unit roundoff: a rounding's relative error at most


def effective_weight(fmt, w):
    """W' as the kernel forms it, in float64, from the bf16 (scale, zero) pairs."""
    nib = torch.stack([w["q"] & 15, w["q"] >> 4], -1).flatten(-2).double()
    s = w["s"].float()
    zero = (8 - w["z"].float()) * s if "z" in w else torch.zeros_like(s)
    scale = s.to(torch.bfloat16).double().repeat_interleave(fmt.group, -1)
    zero = zero.to(torch.bfloat16).double().repeat_interleave(fmt.group, -1)
    return (nib - 8) * scale + zero


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_packed_linear_is_the_kernels_weight(symmetric, scale_dtype, group):
    torch.manual_seed(group)
    fmt = QuantFormat("int4", group=group, symmetric=symmetric)
    n, k = 48, 256
    w = random_weight(fmt, (), n, k)
    w["s"] = w["s"].to(scale_dtype)
    assert tk.packable_int4(fmt, w, torch.bfloat16)
    packed = tk.Int4Packed(fmt, w)
    assert packed.q.shape == w["q"].shape and packed.q.dtype == torch.uint8
    assert packed.sz.shape == (k // group, n, 2) and packed.sz.dtype == torch.bfloat16

    exact = dequantize_reference(fmt, w, torch.float64)
    eff = effective_weight(fmt, w)
    # |W' - W| <= u (|q - 8| + |8 - z|) |s|, u = 2^-8 (bf16's unit roundoff): s/16 at most
    nib = torch.stack([w["q"] & 15, w["q"] >> 4], -1).flatten(-2).double()
    z = w["z"].double().repeat_interleave(group, -1) if "z" in w else torch.full_like(nib, 8)
    s = w["s"].double().repeat_interleave(group, -1).abs()
    bound = BF16_ULP * ((nib - 8).abs() + (8 - z).abs()) * s + 1e-12
    assert ((eff - exact).abs() <= bound).all()
    assert ((eff - exact).abs() <= s / 16 + 1e-12).all()
    if symmetric and scale_dtype == torch.bfloat16:
        assert torch.equal(eff, exact)                 # bf16 scales, zero 0: exact weights

    for rows in (1, 3, 17):
        x = torch.randn(rows, k).bfloat16()
        got = packed.linear(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        want = x.double() @ eff.T
        # float32 sums, one bf16 rounding of each output
        err = (got.double() - want).abs()
        assert (err <= BF16_ULP * want.abs() + 1e-5 * want.abs().max()).all()


def test_packable_refuses_what_the_kernel_cannot_run():
    fmt = QuantFormat("int4", group=32)
    w = random_weight(fmt, (), 48, 64)
    assert tk.packable_int4(fmt, w, torch.bfloat16)
    assert not tk.packable_int4(fmt, w, torch.float16)     # only bf16 is vectorized
    assert not tk.packable_int4(fmt, w, torch.float32)
    assert not tk.packable_int4(fmt, random_weight(fmt, (), 40, 64), torch.bfloat16)  # N % 16
    fp8 = QuantFormat("fp8_channel")
    assert not tk.packable_int4(fp8, random_weight(fp8, (), 48, 64), torch.bfloat16)
    with pytest.raises(ValueError, match="leading dims"):
        tk.Int4Packed(fmt, random_weight(fmt, (2, 3), 48, 64))


@pytest.mark.parametrize("tokens", [1, 7])
def test_packed_experts_equal_the_reference(tokens):
    torch.manual_seed(5 + tokens)
    fmt = QuantFormat("int4", group=32)
    d, inter, e, k, pool = 64, 32, 6, 2, 9
    w13, w2 = random_weight(fmt, (pool,), 2 * inter, d), random_weight(fmt, (pool,), d, inter)
    for w in (w13, w2):
        w["s"] = w["s"].to(torch.bfloat16)
    p13, p2 = tk.Int4Packed(fmt, w13), tk.Int4Packed(fmt, w2)
    assert p13.experts == pool and p13.q.shape == w13["q"].shape
    for act in (SILU, SWIGLU_OAI):
        x, weights, ids, slot_map, kw = routed_batch(tokens, d, inter, e, k, pool, act)
        # The public CPU op takes the packed banks as they sit in a packed store's bank.
        got = tk.fused_moe_quant_cpu(x, fmt, p13, p2, weights, ids, slot_map, **kw)
        want = fused_moe_quant_reference(x.float(), fmt, w13, w2, weights, ids, slot_map,
                                         **{n: v.float() if n != "activation" else v
                                            for n, v in kw.items()})
        assert got.dtype == torch.bfloat16
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        assert err < 2e-2, f"{act.kind}: relative error {err:.2e}"
    with pytest.raises(ValueError, match="bf16"):
        tk.fused_moe_int4_cpu(x.float(), p13, p2, weights, ids, slot_map)
    empty = tk.fused_moe_int4_cpu(x[:0], p13, p2, weights[:0], ids[:0], slot_map)
    assert empty.shape == (0, d)


@pytest.mark.skipif(tk.native_kernels() is None, reason="no native kernels: no int4 decode")
@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_linear_prefill_rows_take_the_decoded_weight_on_amx(amx, symmetric):
    # A prefill chunk's rows (PREFILL_ROWS and more) on an AMX CPU: the checkpoint's nibbles
    # decoded to bf16 (the reference's weight, one rounding) and AMX's bf16 product, exactly
    # F.linear on that weight; fewer rows, or no AMX: the int4 GEMM's product. The rows'
    # scales: float32 pairs made for them (zero points), or a symmetric weight's own bf16
    # scales, which add no bytes.
    from triton_kernels.cpu_linear import QuantRows
    from triton_kernels.int4_cpu import PREFILL_ROWS
    torch.manual_seed(5)
    fmt = QuantFormat("int4", group=32, symmetric=symmetric)
    n, k = 48, 256
    w = random_weight(fmt, (), n, k)
    if symmetric:
        w["s"] = w["s"].bfloat16()              # compressed-tensors' symmetric form
    bias = torch.randn(n).bfloat16()
    rows = QuantRows(w["q"], tk.int4_scales(w["s"], w.get("z")), (1, 32))
    assert (rows.s.dtype == torch.bfloat16) == symmetric
    lin = tk.Int4Linear(fmt, w, bias, rows=rows, amx=amx, gemv=False)
    assert lin.prefill == amx and lin.gemv is None
    own = 0 if rows.s.dtype == torch.bfloat16 else rows.s.numel() * 4
    assert lin.nbytes == lin.packed.nbytes + (own if amx else 0)
    decoded = dequantize_reference(fmt, w, torch.float32).bfloat16()
    for t in (1, 8, PREFILL_ROWS - 1, PREFILL_ROWS, 40):
        x = torch.randn(t, k).bfloat16()
        got = lin(x)
        if amx and t >= PREFILL_ROWS:
            assert torch.equal(lin.decoded(), decoded)
            assert torch.equal(got, torch.nn.functional.linear(x, decoded) + bias)
        else:
            assert torch.equal(got, lin.packed.linear(x) + bias)
    with pytest.raises(ValueError, match="rows"):
        tk.Int4Linear(fmt, w, rows=QuantRows(w["q"][:8], rows.s[:8], (1, 32)), amx=True)


@pytest.mark.skipif(tk.native_kernels() is None, reason="no native kernels: no int4 GEMV")
@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_linear_on_the_native_gemv_keeps_no_repacked_copy(symmetric):
    # gemv (AVX2's default): every row count on the native GEMV from the checkpoint's nibbles,
    # the bias added in float32 before the one rounding, no int4 GEMM copy (its bytes: only
    # the pairs made for it); within bf16's rounding of float64 on the reference's decode,
    # plus the int16 rounding of x where this build takes it
    from triton_kernels.cpu_linear import QuantRows
    from tiny_fixtures import int16_x_bound
    torch.manual_seed(6)
    fmt = QuantFormat("int4", group=32, symmetric=symmetric)
    n, k = 40, 256                              # (N not the int4 GEMM's multiple of 16)
    w = random_weight(fmt, (), n, k)
    if symmetric:
        w["s"] = w["s"].bfloat16()
    bias = torch.randn(n).bfloat16()
    rows = QuantRows(w["q"], tk.int4_scales(w["s"], w.get("z")), (1, 32))
    lin = tk.Int4Linear(fmt, w, bias, rows=rows, amx=False, gemv=True)
    assert lin.packed is None and lin.gemv is not None and not lin.prefill
    assert lin.nbytes == (0 if symmetric else rows.s.nbytes)
    deq = dequantize_reference(fmt, w, torch.float32).double()
    kernel = tk.native_kernels()
    for t in (1, 8, 40):
        x = torch.randn(t, k).bfloat16()
        got = lin(x.view(t, 1, k))
        assert got.shape == (t, 1, n) and got.dtype == torch.bfloat16
        want = x.double() @ deq.T + bias.double()
        bound = (want.abs() * 2.0 ** -8 + (x.double().abs() @ deq.abs().T) * 2.0 ** -20
                 + int16_x_bound(kernel, x, deq.abs(), 32))
        assert ((got[:, 0].double() - want).abs() <= bound).all(), t


@pytest.mark.skipif(tk.native_kernels() is None, reason="no native kernels: no int4 rows")
def test_fused_projections_take_int4_rows_in_both_scale_forms():
    # Projections of one input whose int4 rows come in both scale forms (a symmetric one's
    # own bf16 scales, one with zero points' pairs: two compressed-tensors config groups),
    # fused into one product (N 40: not the int4 GEMM's multiple of 16, so the 16-bit
    # copy's with the rows beside it): the rows become pairs for both, and a decode row
    # reads the decoded weights' product.
    from freetoken.models.layers.linear import _fused_rows, pack_fused
    from freetoken.models.quant.quantize import quantize_weight
    torch.manual_seed(0)
    projs, weights = [], []
    for sym in (True, False):
        fmt = QuantFormat("int4", group=32, symmetric=sym)
        p = QuantLinear(128, 40, fmt, False, torch.bfloat16, scale_dtype=torch.bfloat16)
        w = quantize_weight(fmt, torch.randn(40, 128), scale_dtype=torch.bfloat16)
        for name in p.names:
            getattr(p, name).data = w[name]
        projs.append(p)
        weights.append(dequantize_reference(fmt, w, torch.float32))
    assert [p.cpu_rows().s.dim() for p in projs] == [2, 3]
    rows = _fused_rows(projs)
    assert rows.s.shape == (80, 4, 2) and rows.s.dtype == torch.float32
    fused = pack_fused(projs)
    x = torch.randn(1, 128).bfloat16()
    w = torch.cat(weights).double()
    want = x.double() @ w.T
    bound = want.abs() * 2.0 ** -8 + (x.double().abs() @ w.abs().T) * 2.0 ** -20
    assert ((fused(x).double() - want).abs() <= bound).all()


@pytest.fixture(scope="module")
def int4_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("int4") / "m"
    make_tiny_model(out, family="qwen3_moe", seed=2, hidden_size=64, num_layers=3, num_heads=4,
                    num_kv_heads=2, num_experts=8, top_k=2, moe_intermediate_size=32,
                    intermediate_size=96, vocab_size=2048, max_position_embeddings=512,
                    mlp_only_layers=(1,))
    quantize_checkpoint(out, "int4-awq", seed=2)
    return str(out)


PROMPT = [5, 17, 99, 3, 200, 7, 8, 45, 11, 250, 31, 64, 2]
# What a bf16 CPU engine computes int4 experts with: the native kernel on the checkpoint's
# nibbles where it is built, else torch's int4 GEMM on a packed copy.
EXPERT_BANK = tk.NativeInt4Bank if tk.native_kernels() is not None else tk.Int4Packed


@pytest.mark.usefixtures("one_thread", "no_saved_profiles")
def test_bf16_cpu_engine_runs_int4_packed(int4_model, monkeypatch):
    want = LLM(int4_model, skip_tokenizer_init=True, dtype="float32").logits(PROMPT)
    # float32 packs nothing: the reference's decode
    runs = {"resident": {}, "cpu": dict(moe_backend="cpu"),
            "cpu-layers": dict(moe_backend="offload", moe_cache_size=8, moe_cpu_layers=1)}
    for name, kw in runs.items():
        llm = LLM(int4_model, skip_tokenizer_init=True, dtype="bfloat16", **kw)
        model = llm.runner.model
        qlin = [m for m in model.modules() if isinstance(m, QuantLinear)]
        # every projection through the int4 GEMM; an attention layer's q, k and v as one
        # (so its decode step runs natively after it), a dense MLP's gate and up as one
        attns = [m for m in model.modules() if isinstance(m, Attention)]
        mlps = [m for m in model.modules() if isinstance(m, DenseMLP)]
        fused = {id(getattr(m, n)) for m in attns + mlps for n in m.cpu_fused}
        alone = [m for m in qlin if id(m) not in fused]
        assert alone and all(isinstance(m.packed, tk.Int4Linear) for m in alone), name
        assert attns and all(isinstance(a.qkv_packed, tk.Int4Linear) for a in attns), name
        assert mlps and all(isinstance(m.gate_up, tk.Int4Linear) for m in mlps), name
        # on an AMX CPU (with the native kernels) their prefill rows decode the nibbles;
        # where the native int4 GEMV takes bf16 x as int16 (AVX2), it takes decode rows
        kernel = tk.native_kernels()
        amx_rows = tk.has_amx_bf16() and kernel is not None
        gemv_rows = kernel is not None and kernel.int4_activations == "int16"
        packs = [m.packed for m in alone] + [a.qkv_packed for a in attns]
        assert all(p.prefill == amx_rows and (p.gemv is not None) == gemv_rows
                   for p in packs), name
        assert all(a.cpu_decode is not None for a in attns) == (tk.native_kernels() is not None)
        if name == "resident" and tk.native_kernels() is not None:   # and its decode steps take it
            calls = []
            real = tk.cpu_native.AttnCall.__call__
            monkeypatch.setattr(tk.cpu_native.AttnCall, "__call__",
                                lambda *a, **k: calls.append(1) or real(*a, **k))
            graph = llm.runner.cpu_graph        # (the decode program records the same step)
            before = graph.runs if graph is not None else 0
            llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
            monkeypatch.setattr(tk.cpu_native.AttnCall, "__call__", real)
            steps = len(calls) // len(attns) + (graph.runs - before if graph is not None else 0)
            assert steps >= 3
        blocks = model.moe_blocks()
        # the experts: the native kernel on the checkpoint's nibbles where it is built
        store = llm.runner.expert_store
        cpu_layers = llm.runner.moe_plan.cpu_layers if store else tuple(blocks)
        assert cpu_layers, name
        for i, b in blocks.items():
            bank = b.experts.bank()
            packed = isinstance(bank.get("w13"), EXPERT_BANK)
            assert packed == (i in cpu_layers), f"{name} layer {i}"
            if store is not None:
                assert (store.bank(i) is bank) == packed          # one copy, the store's
                assert not (packed and store.pinned[i])
        got = llm.logits(PROMPT)
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < 0.1, f"{name}: relative logit error {err:.2e} against float32"
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75, name
        if store is not None:
            assert llm.runner.moe_report()["counters"]["cpu_experts"] > 0


@pytest.fixture
def int4_gemm_calls(monkeypatch):
    """Counts the CPU experts run through packed banks (dequant_cpu's dispatch to the int4
    GEMM's, fused_moe's to the native kernel's)."""
    import sys

    import triton_kernels.dequant_cpu as dc
    fm = sys.modules["triton_kernels.fused_moe"]      # (the package's fused_moe is the function)
    calls = []
    for module, name in ((dc, "fused_moe_int4_cpu"), (fm, "moe_native")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    return calls


HYBRID = dict(skip_tokenizer_init=True, dtype="bfloat16", moe_cache_size=8)


def _close_to(llm, want, what):
    # bf16 against float32, the INT4 projections packed (bf16 (scale, zero) pairs: within
    # s/16 a weight for AWQ's fp16 scales): 3-12% on this tiny model, by path.
    got = llm.logits(PROMPT)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 0.15, f"{what}: relative logit error {err:.2e} against float32"
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75, what


@pytest.mark.usefixtures("one_thread", "no_saved_profiles")
def test_hybrid_layers_keep_a_packed_copy_for_the_cpu(int4_model, monkeypatch, int4_gemm_calls):
    # Hybrid layers are fetched in the checkpoint's layout and computed on the CPU too: the
    # store keeps a packed copy for the CPU beside the fetched bank (room allowing), the CPU
    # side runs the int4 GEMM on it, and /v1/instrumentation counts the copy's bytes.
    import freetoken.engine.model_runner as mr
    want = LLM(int4_model, skip_tokenizer_init=True, dtype="float32").logits(PROMPT)
    monkeypatch.setattr(mr, "host_available_bytes", lambda: 64 << 30)     # room
    llm = LLM(int4_model, moe_backend="hybrid", moe_hybrid_k=1, **HYBRID)
    store = llm.runner.expert_store
    layers = llm.runner.moe_plan.cache_layers
    assert layers and set(store.cpu_banks) == set(layers)
    for i in layers:
        assert isinstance(store.cpu_bank(i)["w13"], EXPERT_BANK)
        assert not isinstance(store.bank(i).get("w13"), EXPERT_BANK)   # fetched as stored
    int4_gemm_calls.clear()
    _close_to(llm, want, "hybrid, packed copies")
    report = llm.runner.moe_report()
    assert int4_gemm_calls and report["counters"]["cpu_experts"] > 0
    assert report["counters"]["experts_fetched"] > 0
    assert report["host"]["cpu_copy_layers"] == sorted(layers)
    assert report["host"]["cpu_copy_bytes"] == store.cpu_copy_bytes > 0
    # No room in host RAM (free RAM read as the reserve itself): no copy (the native kernel's
    # bank would read the fetched nibbles in place, but its float32 group scales are bytes
    # of its own), the tile decode.
    monkeypatch.setattr(mr, "host_available_bytes", lambda: mr.HYBRID_COPY_RESERVE)
    tight = LLM(int4_model, moe_backend="hybrid", moe_hybrid_k=1, **HYBRID)
    assert not tight.runner.expert_store.cpu_banks
    int4_gemm_calls.clear()
    _close_to(tight, want, "hybrid, no room")
    assert not int4_gemm_calls


@pytest.mark.usefixtures("one_thread", "no_saved_profiles")
def test_auto_turned_hybrid_packs_its_cache_layers(int4_model, monkeypatch):
    # auto weighs fetching against the CPU in the runtime and may turn to hybrid there: the
    # copies are packed then, for the cache layers only (a CPU layer is repacked in place).
    import freetoken.engine.model_runner as mr
    import freetoken.moe.runtime as rt
    monkeypatch.setattr(mr, "host_available_bytes", lambda: 64 << 30)
    monkeypatch.setattr(rt, "hybrid_k", lambda *a, **k: 1)               # the CPU shares
    for kw in ({}, dict(moe_cpu_layers=1)):
        llm = LLM(int4_model, moe_backend="auto", **HYBRID, **kw)
        plan, store = llm.runner.moe_plan, llm.runner.expert_store
        assert plan.backend == "hybrid" and plan.cache_layers, kw
        assert set(store.cpu_banks) == set(plan.cache_layers), kw
        assert not set(store.cpu_banks) & set(plan.cpu_layers)
