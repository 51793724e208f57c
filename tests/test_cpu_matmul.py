"""16-bit CPU projections widened to float32 for many rows (triton_kernels/cpu_matmul.py):
the same product as F.linear up to the order of the float32 sums, chosen from WIDE_ROWS rows,
and the MoE reference's prefill form (each expert widened) against its 16-bit loop."""

import pytest
import torch
import torch.nn.functional as F

import triton_kernels as tk
from triton_kernels.cpu_matmul import WIDE_ROWS, widens
from triton_kernels.fused_moe import SILU, SWIGLU_OAI, _moe_loop_torch, fused_moe_reference


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
