"""16-bit CPU projections (triton_kernels/cpu_matmul.py): widened to float32 for many rows
(the same product as F.linear up to the order of the float32 sums, chosen from WIDE_ROWS
rows) and the MoE reference's prefill form against its 16-bit loop; fp16-packed weights (a CPU
engine's projections and experts), against the float64 / float32 products and the float32
model."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import triton_kernels as tk
from triton_kernels.cpu_matmul import WIDE_ROWS, widens
from triton_kernels.fused_moe import SILU, SWIGLU_OAI, _moe_loop_torch, fused_moe_reference
from tiny_fixtures import biased_experts, tiny_model_dir  # noqa: F401 - a fixture


def _ulps(got, want):
    """Largest difference in units of want's dtype's epsilon times its magnitude."""
    eps = torch.finfo(want.dtype).eps
    return ((got.float() - want.float()).abs() / (want.float().abs() * eps + 1e-30)).max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_widens_from_wide_rows_and_rounds_once(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g).to(dtype)
    b = torch.randn(48, generator=g).to(dtype)
    for rows in (1, WIDE_ROWS - 1, WIDE_ROWS, 40):
        x = torch.randn(rows, 64, generator=g).to(dtype)
        got = tk.linear(x, w, b)
        exact = (x.double() @ w.double().T + b.double())
        assert got.dtype == dtype and widens(x) == (rows >= WIDE_ROWS)
        # Both forms round a float32 sum once: within a unit of the dtype of the exact sum.
        assert _ulps(got, exact.to(dtype)) <= 1.0
        if rows >= WIDE_ROWS:
            assert torch.equal(got, F.linear(x.float(), w.float(), b.float()).to(dtype))
    x3 = torch.randn(2, 7, 64, generator=g).to(dtype)             # [.., K]: rows counted flat
    assert torch.equal(tk.linear(x3, w), F.linear(x3.float(), w.float()).to(dtype))
    x32 = torch.randn(40, 64, generator=g)
    assert torch.equal(tk.linear(x32, w.float()), F.linear(x32, w.float()))   # float32: as is


@pytest.mark.parametrize("act", [SILU, SWIGLU_OAI], ids=lambda a: a.kind)
def test_moe_prefill_widens_each_expert(act):
    # 64 tokens on 4 of 8 experts, k=2: 32 rows an expert, the widened loop; its result is
    # the 16-bit loop's within bf16 rounding, and each expert's product is the float32 one.
    g = torch.Generator().manual_seed(1)
    t, d, i, e, k = 64, 32, 16, 8, 2
    x = torch.randn(t, d, generator=g).bfloat16()
    w13 = torch.randn(e, 2 * i, d, generator=g).bfloat16()
    w2 = torch.randn(e, d, i, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(4, generator=g)[:k] for _ in range(t)]).int()
    weights = torch.rand(t, k, generator=g)
    got = fused_moe_reference(x, w13, w2, weights, ids, activation=act)
    want = _moe_loop_torch(x, w13, w2, weights, ids, None, None, None, act, wide=True)
    assert torch.equal(got, want)
    assert widens(x, rows=ids.numel() / ids.unique().numel())
    narrow = _moe_loop_torch(x, w13, w2, weights, ids, None, None, None, act)
    torch.testing.assert_close(got.float(), narrow.float(), atol=0.1, rtol=0.02)


# -- fp16-packed weights (a CPU engine's projections) ------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_weight_is_the_float32_product_rounded_once(dtype):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 72, generator=g).to(dtype)
    w[0, :8] = torch.tensor([2.0 ** -15, 3 * 2.0 ** -20, -2.0 ** -24, 2.0 ** -30, 1e-7, 0, 6000, -1])
    b = torch.randn(40, generator=g).to(dtype)
    packed = tk.Fp16Weight(w, b)
    for shape in ((1, 72), (5, 72), (2, 20, 72)):
        x = torch.randn(*shape, generator=g).to(dtype)
        got = packed(x)
        want = F.linear(x.double(), w.double(), b.double())
        assert got.dtype == dtype and got.shape == (*shape[:-1], 40)
        # float16 holds every bfloat16 weight from 2^-14 up exactly; below, within 2^-25.
        slack = (x.double().abs().sum(-1, keepdim=True) * 2.0 ** -25)
        err = (got.double() - want).abs() - slack
        ulp = torch.finfo(dtype).eps * want.abs()
        assert (err <= ulp + 1e-30).all()
    assert tk.Fp16Weight(w).bias.abs().max() == 0


def test_large_packed_weight_runs_threaded_with_the_same_bits():
    # From THREADED_ELEMENTS a weight takes the threaded entry point to FBGEMM's fp16 GEMM:
    # the same kernel as the one-thread call a small weight takes, so the same bits.
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(1024, 1024, generator=g) * 0.02).to(torch.bfloat16)
    b = torch.randn(1024, generator=g)
    big, small = tk.Fp16Weight(w, b), tk.Fp16Weight(w[:64], b[:64])
    assert big.threaded and not small.threaded
    assert w.numel() >= tk.cpu_matmul.THREADED_ELEMENTS > small.out_features * 1024
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one_thread = torch.fbgemm_pack_gemm_matrix_fp16(w.float())
        for rows in (1, 7, 64):
            x = torch.randn(rows, 1024, generator=g).bfloat16()
            want = torch.fbgemm_linear_fp16_weight(x.float(), one_thread, b)
            assert torch.equal(big.f32(x.float()), want)
            assert torch.equal(big(x), want.bfloat16())
            assert torch.equal(small.f32(x.float()), want[:, :64])


def test_what_packs():
    w = torch.randn(8, 16)
    assert not tk.packable(w)                                     # float32 stays as it is
    assert tk.packable(w.bfloat16()) and tk.packable(w.half())
    w[3, 3] = 70000.0
    assert not tk.packable(w.bfloat16())                          # beyond float16's range
    assert not tk.packable(torch.empty(8, 16, dtype=torch.bfloat16, device="meta"))


@pytest.mark.parametrize("t", [1, 9])        # batch 1, and a batch over several experts
@pytest.mark.parametrize("act", [SILU, SWIGLU_OAI], ids=lambda a: a.kind)
def test_packed_experts_equal_the_float32_experts(act, t):
    # Experts packed for the fp16-weight GEMM (Fp16Bank) through fused_moe, slots mapped and
    # biased: the float32 reference on the same weights within bf16 rounding, as near to it
    # as the bf16 forms are.
    c = biased_experts(3, t)
    x, w13, w2, weights, ids, slot_map = (c[n] for n in ("x", "w13", "w2", "weights", "ids", "slot_map"))
    kw = dict(b13=c["b13"], b2=c["b2"], activation=act)
    got = tk.fused_moe(x, tk.Fp16Bank(w13), tk.Fp16Bank(w2), weights, ids, slot_map, **kw)
    want = fused_moe_reference(x.float(), w13.float(), w2.float(), weights, ids, slot_map,
                               **{n: v.float() if n != "activation" else v for n, v in kw.items()})
    bf16 = fused_moe_reference(x, w13, w2, weights, ids, slot_map, **kw)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    err = (got.float() - want).abs().max().item()
    ref = (bf16.float() - want).abs().max().item()
    # The packed experts run in float32 from x to the weighted sum (the weights in float16,
    # exact for these), rounded once: about the output's own bf16 rounding, well inside the
    # bf16 forms' error (they round gate_up, the activation and each expert's output).
    assert err <= min(ref / 1.5, 2.0 ** -8 * want.abs().max().item())
    empty = tk.fused_moe(x, tk.Fp16Bank(w13), tk.Fp16Bank(w2), weights[:, :0], ids[:, :0], **kw)
    assert torch.equal(empty, torch.zeros_like(x))


def test_packed_experts_refuse_mismatched_banks():
    w13, w2 = torch.randn(4, 16, 8).bfloat16(), torch.randn(4, 8, 8).bfloat16()
    x, weights, ids = torch.randn(2, 8).bfloat16(), torch.rand(2, 1), torch.zeros(2, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="packed banks"):
        tk.fused_moe(x, tk.Fp16Bank(w13), w2, weights, ids)                 # one packed
    with pytest.raises(ValueError, match="packed banks"):
        tk.fused_moe(torch.randn(2, 4).bfloat16(), tk.Fp16Bank(w13), tk.Fp16Bank(w2), weights, ids)


def test_cpu_engine_packs_its_projections(tiny_model_dir):  # noqa: F811
    """A bf16 model on the CPU: every Linear carries a packed copy beside its weight (q, k
    and v one between them), used at every row count, the routers too; the experts are
    repacked in place (Fp16Bank); the logits of a prompt follow the float32 model's within
    bf16 rounding, and a float32 model packs nothing."""
    from freetoken import LLM
    from freetoken.models.layers.attention import Attention
    from freetoken.models.layers.linear import Linear
    llm = LLM(str(tiny_model_dir("qwen3_moe")), skip_tokenizer_init=True, dtype="bfloat16")
    model = llm.runner.model
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    fused = {id(getattr(a, n)) for a in attns for n in a.cpu_fused}
    linears = [m for m in model.modules() if isinstance(m, Linear) and id(m) not in fused]
    assert linears and all(m.packed is not None and m.weight.dtype == torch.bfloat16
                           for m in linears)
    # q, k and v: one packed product a layer, its column slices the three projections'.
    assert attns and all(a.qkv_packed is not None and a.q_proj.packed is None for a in attns)
    a = attns[0]
    x = torch.randn(3, a.q_proj.in_features, generator=torch.Generator().manual_seed(0))
    x = x.bfloat16()
    kernel = tk.native_kernels()
    for part, proj in zip(a.qkv_packed(x).split(a.qkv_widths, dim=-1),
                          (a.q_proj, a.k_proj, a.v_proj)):
        # 3 rows: the native GEMV where it builds (one row's dot product each, as alone),
        # else FBGEMM's
        bias = None if proj.bias is None else proj.bias.float()
        alone = (kernel.linear(x, proj.weight.contiguous(), bias) if kernel is not None
                 else tk.Fp16Weight(proj.weight, proj.bias)(x))
        assert torch.equal(part, alone)
    banks = [b.experts for b in model.moe_blocks().values()]
    cpu_bank = tk.NativeBank if tk.native_kernels() else tk.Fp16Bank
    assert banks and all(isinstance(b.bank()["w13"], cpu_bank) and not hasattr(b, "w13")
                         for b in banks)
    gates = [b.gate for b in model.moe_blocks().values()]     # the routers, packed too
    assert all(g.packed is not None for g in gates)
    x = torch.randn(2, gates[0].weight.shape[1]).bfloat16()
    logits = gates[0].logits(x)
    assert logits.dtype == torch.bfloat16 and torch.equal(logits, gates[0].packed(x))
    torch.testing.assert_close(logits.float(), F.linear(x, gates[0].weight).float(),
                               atol=0.02, rtol=0.02)
    q = linears[0]
    one, rows = torch.randn(1, q.in_features).bfloat16(), torch.randn(3, q.in_features).bfloat16()
    assert torch.equal(q(one), q.packed(one)) and torch.equal(q(rows), q.packed(rows))
    torch.testing.assert_close(q(one).float(), F.linear(one, q.weight, q.bias).float(),
                               atol=0.02, rtol=0.02)
    ids = [5, 17, 99, 3, 200, 7, 8, 45, 11]
    f32 = LLM(str(tiny_model_dir("qwen3_moe")), skip_tokenizer_init=True, dtype="float32")
    assert all(m.packed is None for m in f32.runner.model.modules() if isinstance(m, Linear))
    assert all(b.experts.packed is None and b.gate.packed is None and b.gate.native is None
               for b in f32.runner.model.moe_blocks().values())
    want = f32.logits(ids)
    got = llm.logits(ids)
    assert ((got - want).abs().max() / want.abs().max()).item() < 0.05
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75


@pytest.fixture(scope="module")
def bf16_moe_model(tmp_path_factory):
    from freetoken.demo.tiny_model import make_tiny_model
    out = tmp_path_factory.mktemp("bf16moe") / "m"
    make_tiny_model(out, family="qwen3_moe", seed=4, dtype="bfloat16", hidden_size=64,
                    num_layers=3, num_heads=4, num_kv_heads=2, num_experts=8, top_k=2,
                    moe_intermediate_size=32, intermediate_size=96, vocab_size=2048,
                    max_position_embeddings=512, mlp_only_layers=(1,))
    return str(out)


@pytest.mark.usefixtures("one_thread", "no_saved_profiles")
@pytest.mark.parametrize("native", [True, False])
def test_experts_only_the_cpu_computes_are_packed(bf16_moe_model, monkeypatch, native):
    # Every bank only the CPU computes is repacked in place (the store's, one copy): for the
    # native kernel (the tensors as they are) or, without one, the fp16-weight GEMM; hybrid
    # layers, also fetched, keep their bf16 bank and, room allowing, a CPU form beside it
    # (the native one reads the fetched bank in place: no bytes); every path's logits
    # follow the float32 engine's.
    import freetoken.engine.model_runner as mr
    from freetoken import LLM
    if native and tk.native_kernels() is None:
        pytest.skip("no C compiler: the native kernel is not built")
    if not native:
        monkeypatch.setattr(tk, "native_kernels", lambda: None)
    cpu_bank = tk.NativeBank if native else tk.Fp16Bank
    prompt = [5, 17, 99, 3, 200, 7, 8, 45, 11, 250, 31, 64, 2]
    want = LLM(bf16_moe_model, skip_tokenizer_init=True, dtype="float32").logits(prompt)
    monkeypatch.setattr(mr, "host_available_bytes", lambda: 64 << 30)     # room for copies
    runs = {"resident": {}, "cpu": dict(moe_backend="cpu"),
            "cpu-layers": dict(moe_backend="offload", moe_cache_size=8, moe_cpu_layers="2"),
            "hybrid": dict(moe_backend="hybrid", moe_hybrid_k=1, moe_cache_size=8)}
    for name, kw in runs.items():
        llm = LLM(bf16_moe_model, skip_tokenizer_init=True, dtype="bfloat16", **kw)
        blocks, store = llm.runner.model.moe_blocks(), llm.runner.expert_store
        cpu_layers = llm.runner.moe_plan.cpu_layers if store else tuple(blocks)
        assert (name == "hybrid") != bool(cpu_layers), name
        for i, b in blocks.items():
            bank = b.experts.bank()
            assert isinstance(bank["w13"], cpu_bank) == (i in cpu_layers), f"{name} {i}"
            if i in cpu_layers and not native:  # the CPU engine's second core for prefill
                assert bank["w13"].split is llm.runner.cpu_split is not None
            if store is not None:
                assert (store.bank(i) is bank) == (i in cpu_layers)
        if name == "hybrid":
            layers = llm.runner.moe_plan.cache_layers
            assert layers and set(store.cpu_banks) == set(layers)
            assert all(isinstance(store.cpu_bank(i)["w2"], cpu_bank)
                       and isinstance(store.bank(i)["w2"], torch.Tensor) for i in layers)
            copy = llm.runner.moe_report()["host"]["cpu_copy_bytes"]
            assert copy == store.cpu_copy_bytes and (copy == 0) == native
            if native:
                assert all(store.cpu_bank(i)["w2"].weight.data_ptr()
                           == store.bank(i)["w2"].data_ptr() for i in layers)
        got = llm.logits(prompt)
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < 0.05, f"{name}: relative logit error {err:.2e} against float32"
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75, name
        if store is not None:
            assert llm.runner.moe_report()["counters"]["cpu_experts"] > 0, name
