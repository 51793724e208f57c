"""A CPU engine's dense products (triton_kernels/cpu_linear.py, cpu_linear.c) and the AMX
form of native expert banks. The native GEMV's oracle is float64 on the same 16-bit weights
(only the order of the float32 sums and the one rounding differ); each row count's form is
checked against the product it hands the rows to, bit for bit."""

import pytest
import torch
import torch.nn.functional as F

import triton_kernels as tk
from tiny_fixtures import biased_experts
from triton_kernels.cpu_linear import GEMM_ROWS, NATIVE_ROWS
from triton_kernels.fused_moe import _moe_loop_torch, fused_moe_reference

kernel = tk.native_kernels()
pytestmark = pytest.mark.skipif(kernel is None,
                                reason="no C compiler: the native kernels are not built")


@pytest.fixture
def threads():
    old = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(old)


def case(seed, t, n, k, wdtype, xdtype, bias=True):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(wdtype)
    x = torch.randn(t, k, generator=g).to(xdtype)
    b = torch.randn(n, generator=g) if bias else None
    return x, w, b


# k: whole paired blocks of 32 and one with a tail; n: not a multiple of the 4-row tile.
@pytest.mark.parametrize("k", [64, 72])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16, torch.float32])
def test_native_linear_matches_float64(k, wdtype, xdtype, threads):
    threads(2)
    for t in (1, 3, 4, 9):                     # one row, a partial token block, whole ones
        for bias in (True, False):
            x, w, b = case(t, t, 37, k, wdtype, xdtype, bias)
            got = kernel.linear(x, w, b)
            want = F.linear(x.double(), w.double(), None if b is None else b.double())
            assert got.dtype == xdtype and got.shape == (t, 37)
            # the one rounding to x's dtype, and float32 sums
            ulp = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -22}
            bound = want.abs() * ulp[xdtype] + (x.double().abs() @ w.double().abs().T) * 2.0 ** -20
            assert ((got.double() - want).abs() <= bound).all(), (t, bias)


def test_native_linear_gives_the_same_bits_on_any_thread_count(threads):
    x, w, b = case(0, 6, 300, 96, torch.bfloat16, torch.bfloat16)
    outs = []
    for n in (1, 2, 3):
        threads(n)
        outs.append(kernel.linear(x, w, b))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_native_linear_rounds_to_nearest_even_and_keeps_nan():
    # 1 + 2^-8 lies halfway between two bf16 values: nearest even is 1; just above rounds up.
    w = torch.ones(3, 1, dtype=torch.bfloat16)
    b = torch.tensor([2.0 ** -8, 2.0 ** -8 + 2.0 ** -12, float("nan")])
    got = kernel.linear(torch.ones(1, 1, dtype=torch.bfloat16), w, b)
    assert got[0, 0] == 1 and got[0, 1] == 1 + 2.0 ** -7 and got[0, 2].isnan()


def test_native_linear_refuses_bad_input():
    x, w, b = case(0, 2, 8, 32, torch.bfloat16, torch.bfloat16)
    with pytest.raises(ValueError, match="16-bit weight"):
        kernel.linear(x, w.float(), b)
    with pytest.raises(ValueError, match="16-bit weight"):
        kernel.linear(x[:, :16], w, b)
    with pytest.raises(ValueError, match="16-bit weight"):
        kernel.linear(x, w.t(), b)                          # not contiguous
    with pytest.raises(ValueError, match="16-bit weight"):
        kernel.linear(x, w, b[:4])
    with pytest.raises(ValueError, match="16-bit weight"):
        kernel.linear(x, w, b.bfloat16())


@pytest.mark.parametrize("amx", [True, False])
def test_cpu_linear_takes_each_row_count_to_its_product(amx):
    # Below NATIVE_ROWS: the native GEMV. From there: oneDNN's bf16 product where AMX runs it
    # (any machine computes it, AMX or not), else FBGEMM's fp16 GEMM; bit for bit.
    x, w, b = case(1, 2 * GEMM_ROWS, 40, 64, torch.bfloat16, torch.bfloat16)
    lin = tk.CpuLinear(w, b, kernel=kernel, amx=amx)
    assert (lin.fbgemm is None) == amx and lin.weight is not None
    assert lin.nbytes == (0 if amx else 40 * 64 * 2)         # the module's weight: not counted
    fbgemm = tk.Fp16Weight(w, b)
    for rows in (1, NATIVE_ROWS - 1, GEMM_ROWS, 2 * GEMM_ROWS):
        got = lin(x[:rows].view(1, rows, 64))
        assert got.shape == (1, rows, 40) and got.dtype == torch.bfloat16
        if rows < NATIVE_ROWS:
            want = kernel.linear(x[:rows], w, b)
        elif amx:
            want = F.linear(x[:rows], w, b.bfloat16())
        else:
            want = fbgemm(x[:rows])
        assert torch.equal(got[0], want), rows
    # A fused or decoded copy counts its bytes; fp16 weights never go to oneDNN.
    own = tk.CpuLinear(w.half(), b, kernel=kernel, amx=amx, own_weight=True)
    assert not own.gemm and own.fbgemm is not None and own.nbytes == 2 * 40 * 64 * 2


def test_cpu_linear_without_the_native_kernel_is_fbgemm_alone():
    x, w, b = case(2, 9, 24, 64, torch.bfloat16, torch.bfloat16)
    lin = tk.CpuLinear(w.half(), b, kernel=None, amx=False, own_weight=True)
    assert lin.weight is None and lin.nbytes == 24 * 64 * 2     # the fp16 copy is not held
    for rows in (1, 9):
        assert torch.equal(lin(x[:rows]), tk.Fp16Weight(w.half(), b)(x[:rows]))
    with pytest.raises(ValueError, match="16-bit weight"):
        tk.CpuLinear(w.float(), b, kernel=kernel, amx=True)


def test_cpu_linear_decoded_weights_take_one_two_byte_copy():
    # A float32 weight (decoded from fp8 or fp4) becomes bf16 where this machine runs the
    # native GEMV and AMX's GEMM, else fp16 for FBGEMM (refused beyond its range).
    w = torch.randn(16, 32)
    lin = tk.cpu_linear(w, None)
    both = tk.has_amx_bf16()
    assert lin.nbytes == 16 * 32 * 2
    if both:
        assert torch.equal(lin.weight, w.bfloat16()) and lin.fbgemm is None
    else:
        assert lin.fbgemm is not None
    big = w.clone()
    big[0, 0] = 1e6
    assert (tk.cpu_linear(big) is not None) == both
    assert tk.cpu_linear(torch.randn(4, 8).to(torch.float64)) is None


def test_native_bank_hands_prefill_rows_to_amx_products():
    # An AMX bank: a call of GEMM_ROWS (token, expert) pairs an expert and more runs torch's
    # bf16 products an expert at a time (HF's loop and its bits; the float32 biases in x's
    # dtype); fewer, the native kernel. Without AMX, always the native kernel.
    c = biased_experts(seed=4, t=40, d=64, i=32, e=3, k=2, pool=5)     # ~27 pairs an expert
    b13, b2 = c["b13"].float(), c["b2"].float()
    amx = (tk.NativeBank(c["w13"], kernel, amx=True), tk.NativeBank(c["w2"], kernel, amx=True))
    plain = (tk.NativeBank(c["w13"], kernel, amx=False), tk.NativeBank(c["w2"], kernel, amx=False))
    assert amx[0].gemm and not plain[0].gemm
    assert not tk.NativeBank(c["w13"].half(), kernel, amx=True).gemm
    args = (c["weights"], c["ids"], c["slot_map"])
    got = fused_moe_reference(c["x"], *amx, *args, b13=b13, b2=b2)
    want = _moe_loop_torch(c["x"], c["w13"], c["w2"], *args, c["b13"], c["b2"],
                           tk.SILU)
    assert torch.equal(got, want)
    native = fused_moe_reference(c["x"], *plain, *args, b13=b13, b2=b2)
    assert not torch.equal(native, want)
    assert ((native.float() - want.float()).norm() / want.float().norm()) < 1e-2
    one = [t[:1] for t in args[:2]] + [args[2]]               # one token: the native kernel
    assert torch.equal(fused_moe_reference(c["x"][:1], *amx, *one, b13=b13, b2=b2),
                       fused_moe_reference(c["x"][:1], *plain, *one, b13=b13, b2=b2))
