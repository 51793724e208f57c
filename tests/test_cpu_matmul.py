"""16-bit CPU projections (triton_kernels/cpu_matmul.py): widened to float32 for many rows
(the same product as F.linear up to the order of the float32 sums, chosen from WIDE_ROWS
rows) and the MoE reference's prefill form against its 16-bit loop; fp16-packed weights (a CPU
engine's projections), against the float64 product and the unpacked model."""

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


def test_what_packs():
    w = torch.randn(8, 16)
    assert not tk.packable(w)                                     # float32 stays as it is
    assert tk.packable(w.bfloat16()) and tk.packable(w.half())
    w[3, 3] = 70000.0
    assert not tk.packable(w.bfloat16())                          # beyond float16's range
    assert not tk.packable(torch.empty(8, 16, dtype=torch.bfloat16, device="meta"))


def test_cpu_engine_packs_its_projections(tiny_model_dir):  # noqa: F811
    """A bf16 model on the CPU: every Linear carries a packed copy beside its weight, used
    from 2 rows (one row stays the bf16 product); the experts stay stacked tensors; the
    logits of a prompt (its rows through the packed copies) follow the unpacked model's
    within bf16 rounding."""
    from freetoken import LLM
    from freetoken.models.layers.linear import Linear
    llm = LLM(str(tiny_model_dir("qwen3_moe")), skip_tokenizer_init=True, dtype="bfloat16")
    model = llm.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None and m.weight.dtype == torch.bfloat16
                           for m in linears)
    assert all(isinstance(b.experts.w13, torch.nn.Parameter) for b in model.moe_blocks().values())
    q = linears[0]
    one, rows = torch.randn(1, q.in_features).bfloat16(), torch.randn(3, q.in_features).bfloat16()
    assert torch.equal(q(one), F.linear(one, q.weight, q.bias))
    assert torch.equal(q(rows), q.packed(rows))
    ids = [5, 17, 99, 3, 200, 7, 8, 45, 11]
    packed_logits = llm.logits(ids)
    for m in linears:
        m.packed = None
    torch.testing.assert_close(packed_logits, llm.logits(ids), atol=0.06, rtol=0.03)
    f32 = LLM(str(tiny_model_dir("qwen3_moe")), skip_tokenizer_init=True, dtype="float32")
    assert all(m.packed is None for m in f32.runner.model.modules() if isinstance(m, Linear))
