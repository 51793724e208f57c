"""16-bit CPU projections (triton_kernels/cpu_matmul.py): widened to float32 for many rows
(the same product as F.linear up to the order of the float32 sums, chosen from WIDE_ROWS
rows) and the MoE reference's prefill form against its 16-bit loop; fp16-packed weights and
experts (a CPU engine's), against the float64 product and the stacked tensors."""

import pytest
import torch
import torch.nn.functional as F

import triton_kernels as tk
from triton_kernels.cpu_matmul import WIDE_ROWS, widens
from triton_kernels.fused_moe import SILU, SWIGLU_OAI, _moe_loop_torch, fused_moe_reference
from tiny_fixtures import tiny_model_dir  # noqa: F401 - a fixture


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


# -- fp16-packed weights (a CPU engine's projections and resident experts) ----------------------
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


def test_what_packs():
    w = torch.randn(8, 16)
    assert not tk.packable(w)                                     # float32 stays as it is
    assert tk.packable(w.bfloat16()) and tk.packable(w.half())
    w[3, 3] = 70000.0
    assert not tk.packable(w.bfloat16())                          # beyond float16's range
    assert not tk.packable(torch.empty(8, 16, dtype=torch.bfloat16, device="meta"))


@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_packed_experts_equal_the_stacked_ones(tokens):
    """fused_moe_reference over PackedExperts (one token; the grouped order at any row count)
    against the stacked bf16 tensors' loop: the same sums within bf16 rounding, with a slot map
    and biases."""
    g = torch.Generator().manual_seed(3)
    d, i, e, k = 64, 24, 6, 2
    x = torch.randn(tokens, d, generator=g).bfloat16()
    w13 = (torch.randn(e, 2 * i, d, generator=g) / 8).bfloat16()
    w2 = (torch.randn(e, d, i, generator=g) / 5).bfloat16()
    b13, b2 = torch.randn(e, 2 * i, generator=g).bfloat16(), torch.randn(e, d, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(5, generator=g)[:k] for _ in range(tokens)]).int()
    weights = torch.rand(tokens, k, generator=g)
    slot_map = torch.tensor([4, 0, 5, 1, 3, 2], dtype=torch.int32)
    p13, p2 = tk.PackedExperts(w13), tk.PackedExperts(w2)
    assert len(p13) == e and p13.shape == tuple(w13.shape) and p13.nbytes == w13.numel() * 2
    got = fused_moe_reference(x, p13, p2, weights, ids, slot_map, b13=b13, b2=b2)
    want = _moe_loop_torch(x, w13, w2, weights, ids, slot_map, b13, b2, SILU)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.02)
    exact = _moe_loop_torch(x.double(), w13.double(), w2.double(), weights.double(), ids,
                            slot_map, b13.double(), b2.double(), SILU)
    assert (got.double() - exact).abs().max() <= 2 * (want.double() - exact).abs().max() + 0.05


def test_cpu_engine_packs_its_projections_and_experts(tiny_model_dir):  # noqa: F811
    """A bf16 model on the CPU: every Linear carries its packed copy, the resident experts are
    repacked in place (the stacked tensors gone), and greedy decoding follows the unpacked
    model's logits within bf16 rounding."""
    from freetoken import LLM, SamplingParams
    from freetoken.models.layers.linear import Linear
    path = tiny_model_dir("qwen3_moe")
    llm = LLM(str(path), skip_tokenizer_init=True, dtype="bfloat16")
    model = llm.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None for m in linears)
    banks = [b.experts for b in model.moe_blocks().values()]
    assert banks and all(isinstance(b.w13, tk.PackedExperts) and "w13" not in dict(b.named_parameters())
                         for b in banks)
    ids = [5, 17, 99, 3, 200, 7, 8, 45, 11]
    packed_logits = llm.logits(ids)
    for m in linears:                                               # the same model, unpacked
        m.packed = None
    for b in banks:
        for name in ("w13", "w2"):
            setattr(b, name, torch.stack([_unpack(p) for p in getattr(b, name).experts]))
    plain_logits = llm.logits(ids)
    torch.testing.assert_close(packed_logits, plain_logits, atol=0.06, rtol=0.03)
    out = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 6


def _unpack(p: tk.Fp16Weight) -> torch.Tensor:
    """The packed weight back as [N, K] in its dtype: the product with the identity."""
    eye = torch.eye(p.in_features)
    return (torch.fbgemm_linear_fp16_weight(eye, p.packed, torch.zeros(p.out_features)).T
            .to(p.dtype))


def test_cpu_expert_layers_are_packed_in_the_store(tiny_model_dir):  # noqa: F811
    """Experts in host RAM that only the CPU computes (moe_backend=cpu, moe_cpu_layers) are
    packed in the store in place, and the model's banks point at the packed objects: the
    CPU backend then gives the resident (packed) model's logits. Fetched layers stay stacked
    tensors (the fetcher copies them)."""
    from freetoken import LLM
    path = str(tiny_model_dir("qwen3_moe"))
    ids = [5, 17, 99, 3, 200, 7, 8, 45, 11]
    want = LLM(path, skip_tokenizer_init=True, dtype="bfloat16").logits(ids)
    llm = LLM(path, skip_tokenizer_init=True, dtype="bfloat16", moe_backend="cpu")
    store, blocks = llm.runner.expert_store, llm.runner.model.moe_blocks()
    assert store.layers and all(isinstance(store.bank(i)["w13"], tk.PackedExperts)
                                and blocks[i].experts.w13 is store.bank(i)["w13"]
                                for i in store.layers)
    torch.testing.assert_close(llm.logits(ids), want, atol=0, rtol=0)
    mixed = LLM(path, skip_tokenizer_init=True, dtype="bfloat16", moe_backend="offload",
                moe_cpu_layers="1")
    banks, (cpu,) = mixed.runner.expert_store.banks, mixed.runner.moe_report()["cpu_layers"]
    assert all(isinstance(b["w2"], tk.PackedExperts) == (i == cpu) for i, b in banks.items())
    torch.testing.assert_close(mixed.logits(ids), want, atol=0.06, rtol=0.03)
