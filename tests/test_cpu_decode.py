"""A 16-bit CPU engine's native decode-step kernels beside the MoE one: the dense products
(triton_kernels/cpu_linear.py, cpu_linear.c) and the AMX form of native expert banks, the
attention step (cpu_attention.py, cpu_attention.c) and RMSNorm (cpu_norm.c). The native
GEMV's oracle is float64 on the same 16-bit weights (only the order of the float32 sums and
the one rounding differ); each row count's form is checked against the product it hands the
rows to, bit for bit; the attention step and the norm against the torch ops they replace."""

import pytest
import torch
import torch.nn.functional as F

import triton_kernels as tk
from tiny_fixtures import (amx_kernel_runs, biased_experts, float16_x_bound,  # noqa: F401
                           fp8_bank, fp8_rel, int16_x_bound, tiny_model_dir)
from triton_kernels.cpu_linear import GEMM_ROWS, NATIVE_ROWS
from triton_kernels.fused_moe import _moe_loop_torch, fused_moe_reference

kernel = tk.native_kernels()
pytestmark = pytest.mark.skipif(kernel is None,
                                reason="no C compiler: the native kernels are not built")


def case(seed, t, n, k, wdtype, xdtype, bias=True):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(wdtype)
    x = torch.randn(t, k, generator=g).to(xdtype)
    b = torch.randn(n, generator=g) if bias else None
    return x, w, b


# k: whole paired blocks of 32 (two an iteration where the tile has few chains), one block
# past them, a tail; n: not a multiple of the 4-row tile.
@pytest.mark.parametrize("k", [64, 72, 100])
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


@pytest.mark.parametrize("n,k,bn,bk", [(37, 100, 16, 32), (300, 256, 128, 128), (40, 72, 32, 16),
                                        (300, 96, 10, 48), (37, 100, 1, 0), (300, 256, 1, 0)])
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32])
def test_native_fp8_linear_matches_the_decoded_weight_in_float64(n, k, bn, bk, xdtype, threads):
    # fp8 e4m3 bytes with their block scales (ragged blocks, subnormal codes: fp8_bank), or
    # row scales (block (1, 0): a channel's, applied to each row's sums), against float64 on
    # the exactly decoded weight; and the same bits on 1-3 threads (whose work items start
    # at other rows: 300 rows are items of 64, 32 and 16 rows, and row blocks of 10 are not
    # whole 4-row tiles). Tokens: one row, 3 a row at a time, whole 4-row tiles, their 2-
    # and 1-token tails.
    for t in (1, 3, 4, 6, 9):
        x, w, b = case(t, t, n, k, torch.float32, xdtype)
        q, s, deq = fp8_bank(w[None], bn, bk or k)
        s = s if bk else s[..., 0].contiguous()             # [1, N]: a row's own
        outs = []
        for nthreads in (1, 2, 3):
            threads(nthreads)
            outs.append(kernel.linear(x, q[0], b, scales=s[0], block=(bn, bk)))
        assert all(torch.equal(outs[0], o) for o in outs[1:])
        got = outs[0]
        want = F.linear(x.double(), deq[0].double(), b.double())
        assert got.dtype == xdtype and got.shape == (t, n)
        ulp = {torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -22}[xdtype]
        bound = (want.abs() * ulp + (x.double().abs() @ deq[0].double().abs().T) * 2.0 ** -20
                 + float16_x_bound(kernel, x, deq[0].abs(), s.max()))
        assert ((got.double() - want).abs() <= bound).all(), t
        if xdtype == torch.float32:     # (bf16's own rounding of the outputs is 2^-9)
            assert (got.double() - want).norm() / want.norm() < fp8_rel(kernel), t
    with pytest.raises(ValueError, match="block scales"):
        kernel.linear(x, q[0], b, scales=s[0], block=(bn * 2, bk))
    with pytest.raises(ValueError, match="block scales"):           # no such block
        kernel.linear(x, q[0], b, scales=s[0], block=(bn, -1))
    with pytest.raises(ValueError, match="block scales"):
        kernel.linear(x, q[0], b)


@pytest.mark.parametrize("n,k,bn,bk", [(37, 1100, 16, 64), (40, 72, 32, 16), (9, 40, 1, 0)])
def test_native_fp8_linear_is_exact_where_float16_sums_are(n, k, bn, bk, threads):
    # Weights of e4m3 codes 0 and of exponents 7 and 8 (1 to 3.75 and their negatives: 1/8
    # steps), block scales 1 and 1/2 (or row scales), x integers in [-2, 2], biases in 1/8s:
    # every product and every sum of 16 of them is a float16 (x at most 4 of its smallest
    # step, weights 30 of theirs, 16 deep: under 2^11 steps), so this build's float16 sums
    # (kernel.e4m3_decode "float16 products", cpu_dot.h's FT_F8H) are exact, as float32's
    # are: an element missed, met twice or met with another's x shows. K 1100: spans of 512
    # and a tail of 12 past its blocks of 32; rows: 4-row tiles and 1-row tails; tokens 1-9:
    # the rows one at a time, then 4-row tiles. (That form only where the CPU has the flag.)
    from triton_kernels.cpu_native import cpu_flags
    assert kernel.e4m3_decode != "float16 products" or " avx512_fp16" in cpu_flags()
    g = torch.Generator().manual_seed(k)
    sign, exponent, mantissa = (torch.randint(lo, hi, (n, k), generator=g)
                                for lo, hi in ((0, 2), (7, 9), (0, 8)))
    codes = sign << 7 | exponent << 3 | mantissa
    codes[torch.rand(n, k, generator=g) < 0.1] = 0
    q = codes.to(torch.uint8).view(torch.float8_e4m3fn)
    if bk:
        s = 0.5 ** torch.randint(0, 2, (-(-n // bn), -(-k // bk)), generator=g).float()
        deq = q.double() * s.double().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    else:
        s = 0.5 ** torch.randint(0, 2, (n,), generator=g).float()
        deq = q.double() * s.double()[:, None]
    b = torch.randint(-8, 9, (n,), generator=g) / 8
    for t in (1, 3, 4, 6, 9):
        x = torch.randint(-2, 3, (t, k), generator=g).float()
        threads(2)
        got = kernel.linear(x, q, b, scales=s, block=(bn, bk))
        assert torch.equal(got.double(), F.linear(x.double(), deq, b.double())), t
    # The largest sums: e4m3's largest weight, 448, everywhere and x just under a power of
    # two (x sigma just under 2^11): a lane's 16 products in float16 reach 57300 (float16's
    # largest: 65504), and the sums stay finite.
    q = torch.full((4, k), 0x7E, dtype=torch.uint8).view(torch.float8_e4m3fn)
    got = kernel.linear(torch.full((1, k), 1.999), q, None, scales=torch.ones(4), block=(1, 0))
    assert ((got - 448 * 1.999 * k).abs() <= 448 * 1.999 * k * 2e-3).all(), got


@pytest.mark.parametrize("n,k", [(37, 100), (300, 256)])
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32])
def test_native_int8_linear_matches_the_decoded_weight_in_float64(n, k, xdtype, threads):
    # int8 rows (every code, -128 too) with a float32 scale a row on their sums, against
    # float64; the same bits on 1-3 threads; tokens as the fp8 test's; scales of another
    # shape or block refused.
    for t in (1, 3, 4, 6, 9):
        x, w, b = case(t, t, n, k, torch.float32, xdtype)
        g = torch.Generator().manual_seed(t)
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        q[0, :256 if k >= 256 else k] = torch.arange(-128, 128, dtype=torch.int8)[:min(k, 256)]
        s = torch.rand(n, generator=g) * 0.01 + 1e-4
        outs = []
        for nthreads in (1, 2, 3):
            threads(nthreads)
            outs.append(kernel.linear(x, q, b, scales=s, block=(1, 0)))
        assert all(torch.equal(outs[0], o) for o in outs[1:])
        deq = q.double() * s.double()[:, None]
        want = F.linear(x.double(), deq, b.double())
        ulp = {torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -22}[xdtype]
        bound = want.abs() * ulp + (x.double().abs() @ deq.abs().T) * 2.0 ** -20
        assert ((outs[0].double() - want).abs() <= bound).all(), t
    with pytest.raises(ValueError, match="row scales"):
        kernel.linear(x, q, b, scales=s[:-1], block=(1, 0))
    with pytest.raises(ValueError, match="row scales"):
        kernel.linear(x, q, b, scales=s[:, None], block=(1, k))


def every_e4m3_code(kern):
    # Each of the 254 e4m3 codes that are numbers (0x7f and 0xff are nan) at each position of
    # a 32-byte block, in rows mixing zeros and subnormals with normal codes and rows of
    # normal codes only, plus a tail; power-of-two block scales, then power-of-two row scales
    # (block (1, 0), on the sums). x is the identity, so each output is one exact product:
    # the decoded weight, bit for bit, and each token meets its own column (the order x is
    # laid out in).
    codes = torch.tensor([c for c in range(256) if c & 0x7f != 0x7f], dtype=torch.uint8)
    normal = codes[(codes & 0x78) != 0]
    k = 8 * 32 + 8
    rows = [torch.cat([codes.roll(r)] * 2)[:k] for r in range(32)]     # each code in each lane
    rows += [torch.cat([normal.roll(5 * r)] * 2)[:k] for r in range(8)]
    q = torch.stack(rows).view(torch.float8_e4m3fn)
    s = 2.0 ** torch.randint(-3, 4, (1, 9), generator=torch.Generator().manual_seed(0))
    want = (q.float() * s.repeat_interleave(32, 1)[:, :k]).T
    for t in (1, 3, 4, k):
        got = kern.linear(torch.eye(k)[:t], q, None, scales=s, block=(q.shape[0], 32))
        assert torch.equal(got, want[:t]), t
    rs = 2.0 ** torch.randint(-3, 4, (q.shape[0],), generator=torch.Generator().manual_seed(1))
    want = (q.float() * rs[:, None]).T
    for t in (1, 3, 4, k):
        got = kern.linear(torch.eye(k)[:t], q, None, scales=rs, block=(1, 0))
        assert torch.equal(got, want[:t]), t


def fp8_experts_match(kern):
    # fp8 experts (128-blocks, and row scales) at 1 to 40 tokens (more than 4: rows decoded
    # once to words, f8l_decodes) against the float32 reference on the decoded weights.
    for bn, bk in ((128, 128), (1, 0)):
        for t in (1, 3, 9, 40):
            c = biased_experts(seed=t, t=t, d=256, i=128, e=6, k=2, pool=9)
            q13, s13, deq13 = fp8_bank(c["w13"], bn, bk or 256)
            q2, s2, deq2 = fp8_bank(c["w2"], bn, bk or 128)
            if not bk:
                s13, s2 = s13[..., 0].contiguous(), s2[..., 0].contiguous()
            got = kern.moe(c["x"], q13, q2, c["weights"], c["ids"], c["slot_map"], c["b13"],
                           c["b2"], scales=(s13, s2), block=(bn, bk))
            want = fused_moe_reference(c["x"].float(), deq13, deq2, c["weights"], c["ids"],
                                       c["slot_map"], b13=c["b13"].float(), b2=c["b2"].float())
            assert (got.float() - want).norm() / want.norm() < fp8_rel(kern), (bn, t)


def test_native_fp8_linear_decodes_every_e4m3_code_in_every_lane(threads):
    # This build's decode (kernel.e4m3_decode: on AVX2, "shifts" moves a byte's bits into a
    # bfloat16's places at 2^-120 of its value, zeros and subnormals as float32 denormals,
    # and x and the sums carry the 2^120; "tables" looks both bytes up, blending zeros and
    # subnormals in from two more tables where a block holds one).
    threads(2)
    every_e4m3_code(kernel)


def test_avx2s_other_e4m3_decode_builds_and_decodes_every_code(threads, monkeypatch, tmp_path):
    # A build that takes the shifts (AMD's AVX2 cores) compiled with -DFT_F8L_TABLES takes the
    # tables, Intel's AVX2 decode: both are checked on this machine, each code and the experts.
    if kernel.e4m3_decode != "shifts":
        pytest.skip(f"this build decodes e4m3 by {kernel.e4m3_decode}: the other is not built here")
    import ctypes
    from triton_kernels import cpu_native
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_native, "_FLAGS", (*cpu_native._FLAGS, "-DFT_F8L_TABLES"))
    path = cpu_native._build()
    tables = cpu_native.NativeKernels(ctypes.CDLL(str(path)), path)
    assert tables.e4m3_decode == "tables"
    threads(2)
    every_e4m3_code(tables)
    fp8_experts_match(tables)
    fp8_experts_match(kernel)


@pytest.mark.parametrize("group,symmetric", [(32, False), (64, True), (32, True)])
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32])
def test_native_int4_linear_matches_the_decoded_weight_in_float64(group, symmetric, xdtype,
                                                                  threads):
    # int4 nibbles with (scale, -zero * scale) pairs per group, against float64 on the
    # reference's decode (and 16-bit x's rounding to int16 where this build takes it); the
    # same bits on 1-3 threads; bad groups refused. K 320: 10 groups of 32, or 5 of 64.
    from freetoken.models.quant.quantize import quantize_weight
    from triton_kernels.dequant import QuantFormat
    fmt = QuantFormat("int4", group=group, symmetric=symmetric)
    for t in (1, 3, 4, 9):
        x, w, b = case(t, t, 37, 320, torch.float32, xdtype)
        qw = quantize_weight(fmt, w, scale_dtype=torch.bfloat16)
        deq = tk.dequantize_reference(fmt, qw, torch.float32)
        pairs = tk.int4_group_pairs(qw["s"], qw.get("z"))
        outs = []
        for nthreads in (1, 2, 3):
            threads(nthreads)
            outs.append(kernel.linear(x, qw["q"], b, scales=pairs, block=(1, group)))
        assert all(torch.equal(outs[0], o) for o in outs[1:])
        # a symmetric weight's own bf16 scales (cpu_dot.h's FT_INT4S): float32 x's bits (bf16
        # x's pair products take the offset back as -136 s X, not -128 s X - 8 s X: in bound)
        scales = tk.int4_scales(qw["s"], qw.get("z"))
        assert (scales.dtype == torch.bfloat16) == symmetric
        outs.append(kernel.linear(x, qw["q"], b, scales=scales, block=(1, group)))
        assert xdtype == torch.bfloat16 or torch.equal(outs[-1], outs[0])
        want = F.linear(x.double(), deq.double(), b.double())
        ulp = {torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -22}[xdtype]
        bound = (want.abs() * ulp + (x.double().abs() @ deq.double().abs().T) * 2.0 ** -20
                 + (int16_x_bound(kernel, x, deq.abs(), group) if xdtype != torch.float32 else 0))
        assert all(((o.double() - want).abs() <= bound).all() for o in outs), t
    with pytest.raises(ValueError, match="group scales"):
        kernel.linear(x, qw["q"], b, scales=pairs, block=(1, 16))
    with pytest.raises(ValueError, match="group scales"):
        kernel.linear(x, qw["q"], b, scales=pairs[:, :1], block=(1, group))


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
    # A float32 weight (decoded from fp8 or fp4) of a bf16 model becomes bf16 where this
    # machine runs the native GEMV and AMX's GEMM, else fp16 for FBGEMM (refused beyond its
    # range); an fp16 model's is always fp16 (its 11 bits).
    w = torch.randn(16, 32)
    lin = tk.cpu_linear(w, None, dtype=torch.bfloat16)
    both = tk.has_amx_bf16()
    assert lin.nbytes == 16 * 32 * 2
    if both:
        assert torch.equal(lin.weight, w.bfloat16()) and lin.fbgemm is None
    else:
        assert lin.fbgemm is not None
    fp16 = tk.cpu_linear(w, None, dtype=torch.float16)
    assert fp16.fbgemm is not None and fp16.nbytes == 16 * 32 * 2 and not fp16.gemm
    big = w.clone()
    big[0, 0] = 1e6
    assert (tk.cpu_linear(big, dtype=torch.bfloat16) is not None) == both
    assert tk.cpu_linear(big, dtype=torch.float16) is None
    assert tk.cpu_linear(torch.randn(4, 8).to(torch.float64)) is None


@pytest.mark.parametrize("kind", ["fp8_block", "int4"])
def test_fp16_quant_linear_reads_its_bytes_for_decode_rows(kind):
    # An fp16 model's fp8 or int4 projection (int4: torch's int4 GEMM is bf16-only): decode
    # rows run the native GEMV on the checkpoint's bytes, 8 rows and more FBGEMM's product
    # on the fp16 copy; both are the reference's weight, to fp16's rounding.
    from freetoken.models.layers.linear import QuantLinear
    from freetoken.models.quant.quantize import quantize_weight
    from triton_kernels.dequant import QuantFormat
    fmt = (QuantFormat("fp8_block", block=(32, 32)) if kind == "fp8_block"
           else QuantFormat("int4", group=32, symmetric=False))
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g) * 0.1
    lin = QuantLinear(64, 48, fmt, bias=True, dtype=torch.float16)
    for name, t in quantize_weight(fmt, w, scale_dtype=torch.float16).items():
        getattr(lin, name).data = t
    lin.bias.data = torch.randn(48, generator=g).half()
    assert lin.pack_cpu() > 0 and isinstance(lin.packed, tk.CpuLinear)
    assert lin.packed.quant is not None and lin.packed.quant.q.data_ptr() == lin.q.data_ptr()
    x = torch.randn(8, 64, generator=g).half()
    want = F.linear(x.double(), lin.dequantized(torch.float64), lin.bias.double())
    one = torch.cat([lin(x[i:i + 1]) for i in range(8)])
    many = lin(x)
    for got in (one, many):
        assert got.dtype == torch.float16
        assert ((got.double() - want).abs() <= 2e-3 * want.abs().max()).all()


def test_native_bank_hands_prefill_rows_to_amx_products():
    # An AMX bank: a call of GEMM_ROWS (token, expert) pairs an expert and more runs torch's
    # bf16 products an expert at a time (grouped, with HF's loop's bits; the float32 biases
    # in x's dtype); fewer, the native kernel. Without AMX, always the native kernel.
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
    # x in another dtype than the bank (an fp16 model's bank beyond fp16's range): native.
    half = fused_moe_reference(c["x"].half(), *amx, *args, b13=b13, b2=b2)
    assert half.dtype == torch.float16
    assert torch.equal(half, fused_moe_reference(c["x"].half(), *plain, *args, b13=b13, b2=b2))


def test_fp8_bank_hands_prefill_rows_to_its_bf16_copy():
    # An fp8 bank with a bf16 copy: prefill chunks (GEMM_ROWS pairs an expert and more) run
    # the AMX products on the copy (the plain AMX bank's bits), fewer rows the native kernel
    # on the bytes (the copyless bank's bits); a copyless bank's prefill chunks run the AMX
    # kernel on its bytes, each chunk of rows decoded as the copy holds them: the copy's
    # bits. A copy of another shape is refused.
    c = biased_experts(seed=5, t=40, d=64, i=32, e=3, k=2, pool=5)
    b13, b2 = c["b13"].float(), c["b2"].float()
    q13, s13, deq13 = fp8_bank(c["w13"], 16, 32)
    q2, s2, deq2 = fp8_bank(c["w2"], 16, 32)
    copies = [tk.NativeBank(d.bfloat16(), kernel, amx=True) for d in (deq13, deq2)]
    with_copy = (tk.NativeFp8Bank(q13, s13, (16, 32), kernel, prefill=copies[0]),
                 tk.NativeFp8Bank(q2, s2, (16, 32), kernel, prefill=copies[1]))
    bytes_only = (tk.NativeFp8Bank(q13, s13, (16, 32), kernel),
                  tk.NativeFp8Bank(q2, s2, (16, 32), kernel))
    assert with_copy[0].nbytes == bytes_only[0].nbytes + copies[0].nbytes
    args = (c["weights"], c["ids"], c["slot_map"])
    got = fused_moe_reference(c["x"], *with_copy, *args, b13=b13, b2=b2)
    assert torch.equal(got, fused_moe_reference(c["x"], *copies, *args, b13=b13, b2=b2))
    from_bytes = fused_moe_reference(c["x"], *bytes_only, *args, b13=b13, b2=b2)
    assert torch.equal(got, from_bytes) == amx_kernel_runs(kernel)      # else the native kernel
    one = [t[:1] for t in args[:2]] + [args[2]]
    assert torch.equal(fused_moe_reference(c["x"][:1], *with_copy, *one, b13=b13, b2=b2),
                       fused_moe_reference(c["x"][:1], *bytes_only, *one, b13=b13, b2=b2))
    with pytest.raises(ValueError, match="prefill copy"):
        tk.NativeFp8Bank(q13, s13, (16, 32), kernel, prefill=copies[1])
    with pytest.raises(ValueError, match="prefill copy"):
        tk.NativeFp8Bank(q13, s13, (16, 32), kernel,
                         prefill=tk.NativeBank(deq13.bfloat16(), kernel, amx=False))


# ---- the decode step of an attention layer (cpu_attention.c) ----------------------------------

def attention_case(seed, lens, hq=4, hk=2, dh=32, rot=32, bs=4, cache_dtype=torch.bfloat16,
                   dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    b, nb = len(lens), max(64, sum(-(-n // bs) for n in lens) + 8)
    perm = torch.randperm(nb, generator=g)
    m = max(-(-n // bs) for n in lens) + 1
    tables = torch.full((b, m), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):                      # scattered blocks, -1 padded
        k = -(-n // bs)
        tables[i, :k] = perm[used:used + k].int()
        used += k
    slots = torch.tensor([int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs
                          for i, n in enumerate(lens)])
    k_cache = torch.randn(nb, bs, hk, dh, generator=g).to(cache_dtype)
    v_cache = torch.randn(nb, bs, hk, dh, generator=g).to(cache_dtype)
    inv = 1.0 / 10000 ** (torch.arange(0, rot, 2).double() / rot)
    ang = torch.arange(32768).double()[:, None] * inv[None]
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=1).float()
    return dict(qkv=torch.randn(b, (hq + 2 * hk) * dh, generator=g).to(dtype),
                q_norm=(1 + 0.3 * torch.randn(dh, generator=g)).to(dtype),
                k_norm=(1 + 0.3 * torch.randn(dh, generator=g)).to(dtype),
                sinks=torch.randn(hq, generator=g), positions=torch.tensor(lens) - 1,
                cos_sin=cos_sin, k_cache=k_cache, v_cache=v_cache, slots=slots,
                tables=tables, lens=torch.tensor(lens, dtype=torch.int32), heads=(hq, hk, dh))


def torch_decode(c, norms, window, sinks, interleaved, scale):
    """The torch path Attention runs on the same inputs (the op references)."""
    hq, hk, dh = c["heads"]
    b = c["qkv"].shape[0]
    q, k, v = c["qkv"].split([hq * dh, hk * dh, hk * dh], dim=-1)
    q, k, v = q.reshape(b, hq, dh), k.reshape(b, hk, dh), v.reshape(b, hk, dh)
    if norms:
        q = tk.rms_norm_reference(q.reshape(-1, dh), c["q_norm"], 1e-6).view(b, hq, dh)
        k = tk.rms_norm_reference(k.reshape(-1, dh), c["k_norm"], 1e-6).view(b, hk, dh)
    q, k = q.contiguous(), k.contiguous()
    tk.apply_rope_reference(q, k, c["positions"], c["cos_sin"], interleaved)
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    tk.write_kv_reference(k, v, kc, vc, c["slots"])
    cu = torch.arange(b + 1, dtype=torch.int32)
    extra = {"sliding_window": window} if window else {}
    if sinks:
        extra["sinks"] = c["sinks"]
    o = tk.paged_attention_reference(q, kc, vc, c["tables"], cu, c["lens"], scale, 1, **extra)
    return o.reshape(b, hq * dh), kc, vc


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("norms,window,sinks,interleaved,rot",
                         [(True, None, False, False, 32), (False, 5, True, False, 32),
                          (True, 3, True, True, 16), (False, None, False, True, 16),
                          (True, 64, True, False, 32)])        # a window past every length
def test_native_decode_attention_matches_the_torch_path(cache_dtype, norms, window, sinks,
                                                        interleaved, rot, threads):
    threads(2)
    c = attention_case(7, [1, 6, 13, 9], rot=rot, cache_dtype=cache_dtype)
    check_decode_step(c, norms, window, sinks, interleaved, 32 ** -0.5)


@pytest.mark.parametrize("hq,hk", [(20, 2), (9, 1), (24, 3)])
def test_native_decode_attention_many_q_heads_a_kv_head(hq, hk, threads):
    # More q heads a kv head than one pass serves (GMAX 8): whole and partial chunks of them,
    # with a window and sinks, against the torch path.
    threads(2)
    c = attention_case(11, [1, 7, 12], hq=hq, hk=hk)
    check_decode_step(c, True, 5, True, False, 32 ** -0.5)


@pytest.mark.parametrize("hq,hk,dh,cache_dtype", [(12, 2, 64, torch.float16),
                                                  (14, 2, 32, torch.float32),
                                                  (6, 2, 40, torch.bfloat16)])
def test_native_decode_attention_splits_long_contexts_for_any_group(hq, hk, dh, cache_dtype,
                                                                   threads):
    # Contexts of several splits (~512 keys each), partial sums joined, for 6, 7 and 3 q heads
    # a kv head (the softmax's vector lanes cycle through the heads over several vectors),
    # each cache format, one with a scalar tail of dh, with a window and sinks, against the
    # torch path.
    threads(2)
    c = attention_case(12, [1700, 3, 600], hq=hq, hk=hk, dh=dh, rot=dh // 2,
                       cache_dtype=cache_dtype)
    check_decode_step(c, True, 1200, True, False, dh ** -0.5)
    # A lone sequence of 2 splits: a work item takes one kv head (on 3 threads) or all of
    # them (on 1), the same bits.
    c = attention_case(13, [700], hq=hq, hk=hk, dh=dh, rot=dh // 2, cache_dtype=cache_dtype)
    step = tk.CpuDecodeAttention(kernel, c["heads"], None, None, 1e-6, dh ** -0.5, None,
                                 c["sinks"], False)
    outs = []
    for n in (1, 3):
        threads(n)
        outs.append(step(c["qkv"], c["positions"], c["cos_sin"], c["k_cache"].clone(),
                         c["v_cache"].clone(), c["slots"], c["tables"], c["lens"]))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_decode_attention_odd_head_dims_no_grouping_and_skipped_slots(dtype, threads):
    # Dh 40 (vector lanes and a scalar tail), Hq == Hk, fp16, and a sequence whose slot is -1
    # (its K/V not written: it attends over what the cache holds).
    threads(2)
    c = attention_case(9, [3, 17, 8], hq=3, hk=3, dh=40, rot=24, cache_dtype=dtype,
                       dtype=dtype)
    c["slots"][1] = -1
    check_decode_step(c, True, None, True, False, 40 ** -0.5)


def check_decode_step(c, norms, window, sinks, interleaved, scale):
    step = tk.CpuDecodeAttention(kernel, c["heads"], c["q_norm"] if norms else None,
                                 c["k_norm"] if norms else None, 1e-6, scale, window,
                                 c["sinks"] if sinks else None, interleaved)
    want, want_k, want_v = torch_decode(c, norms, window, sinks, interleaved, scale)
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    got = step(c["qkv"], c["positions"], c["cos_sin"], kc, vc, c["slots"], c["tables"],
               c["lens"])
    assert got.dtype == c["qkv"].dtype and got.shape == want.shape
    # The values land exactly; the keys to a few bf16 steps of their head's scale (HF
    # rounds after the norm and each of rope's products, which cancel).
    assert torch.equal(vc, want_v)
    scale_k = want_k.float().abs().amax(-1, keepdim=True)
    assert ((kc.float() - want_k.float()).abs() <= 2.0 ** -6 * scale_k + 1e-6).all()
    others = torch.ones(kc.shape[:2], dtype=torch.bool)
    others.view(-1)[c["slots"][c["slots"] >= 0]] = False
    assert torch.equal(kc[others], c["k_cache"][others])     # nothing else written
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert err < 2e-2, err


def blocks_of_4(c):
    """The case's 16-token cache blocks as 4-token ones (block i -> 4i .. 4i + 3): the same
    keys and slots, in blocks that the AMX tiles (16 keys of a block) do not take."""
    nb, _, hk, dh = c["k_cache"].shape
    t = c["tables"].long()
    tables = torch.where(t[:, :, None] >= 0, 4 * t[:, :, None] + torch.arange(4), -1)
    return dict(c, k_cache=c["k_cache"].reshape(4 * nb, 4, hk, dh),
                v_cache=c["v_cache"].reshape(4 * nb, 4, hk, dh),
                tables=tables.reshape(len(t), -1).int())


@pytest.mark.parametrize("lens,hq,hk,dh,window,sinks", [
    ([1, 6, 13, 9], 4, 2, 32, None, False),            # (all the loop's: under 768 keys)
    ([3000, 17, 2049], 8, 2, 64, None, True),          # splits of 512 keys, a ragged last
    ([2500, 300], 20, 2, 64, 800, True),               # 10 q heads a kv head; a window
    ([1300, 2], 40, 2, 64, 1000, True),                # 16 + 4 q heads a kv head
    ([1500], 16, 4, 128, None, False),
    ([1100, 5, 767, 768], 12, 4, 96, 781, True)])      # a window from inside a tile
def test_native_decode_attention_on_amx_tiles_matches_its_loop(lens, hq, hk, dh, window, sinks,
                                                              threads):
    # A bf16 step over 16-token blocks takes AMX's tiles for its scores (cpu_attention.c,
    # decode_units) where this CPU has them, for each sequence of 768 keys or more (its
    # window's; the shorter ones of the same batch the loop); over 4-token blocks the loop
    # for all. The same keys in both: the products are exact in float32 either way and only
    # their sums' order differs, so the outputs agree but for rare last-bit ties; and
    # against the torch path as the loop does.
    threads(2)
    # (the tiles where the AMX kernels run at all; 4-token blocks never)
    assert kernel.attn_decode_tiles(torch.bfloat16, torch.bfloat16, dh, 16) \
        == amx_kernel_runs(kernel)
    assert not kernel.attn_decode_tiles(torch.bfloat16, torch.bfloat16, dh, 4)
    assert not kernel.attn_decode_tiles(torch.float16, torch.float16, dh, 16)
    c = attention_case(5, lens, hq=hq, hk=hk, dh=dh, bs=16)
    step = tk.CpuDecodeAttention(kernel, c["heads"], c["q_norm"], c["k_norm"], 1e-6,
                                 dh ** -0.5, window, c["sinks"] if sinks else None, False)
    outs = []
    for case in (c, blocks_of_4(c)):
        kc, vc = case["k_cache"].clone(), case["v_cache"].clone()
        outs.append(step(case["qkv"], case["positions"], case["cos_sin"], kc, vc,
                         case["slots"], case["tables"], case["lens"]))
    diff = (outs[0].float() - outs[1].float()).abs()
    assert (diff > 0).float().mean() < 0.002
    assert diff.max() <= 2 ** -7 * outs[1].float().abs().max()
    check_decode_step(c, True, window, sinks, False, dh ** -0.5)
    # the same bits on any thread count (the splits follow the context, not the threads)
    for n in (1, 3):
        threads(n)
        kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
        assert torch.equal(outs[0], step(c["qkv"], c["positions"], c["cos_sin"], kc, vc,
                                         c["slots"], c["tables"], c["lens"]))


def test_native_decode_attention_bits_do_not_depend_on_the_batch(threads):
    # Each sequence takes the tiles or the loop on its own keys (768 and more: the tiles,
    # where this CPU has them): one call with both kinds gives each sequence the bits it
    # gets alone (a step's work items, splits and joins of the two paths side by side)
    threads(2)
    lens = [900, 40, 2000, 767, 300, 131]
    c = attention_case(7, lens, hq=16, hk=2, dh=128, bs=16)
    step = tk.CpuDecodeAttention(kernel, c["heads"], c["q_norm"], c["k_norm"], 1e-6, 0.125,
                                 None, None, False)
    batch = step(c["qkv"], c["positions"], c["cos_sin"], c["k_cache"].clone(),
                 c["v_cache"].clone(), c["slots"], c["tables"], c["lens"])
    for b in range(len(lens)):
        one = slice(b, b + 1)
        alone = step(c["qkv"][one], c["positions"][one], c["cos_sin"], c["k_cache"].clone(),
                     c["v_cache"].clone(), c["slots"][one], c["tables"][one], c["lens"][one])
        assert torch.equal(alone, batch[one])


def test_native_decode_attention_on_amx_tiles_reads_no_stale_slot(threads):
    # A tile reads 16 keys of a block whole: slots past a context (nans here, as a freed
    # block may hold) must not reach its softmax.
    threads(2)
    c = attention_case(6, [37, 1030, 5], hq=8, hk=2, dh=64, bs=16)
    step = tk.CpuDecodeAttention(kernel, c["heads"], c["q_norm"], c["k_norm"], 1e-6, 0.125,
                                 None, None, False)
    stale = dict(c, k_cache=c["k_cache"].clone(), v_cache=c["v_cache"].clone())
    for b, n in enumerate(c["lens"].tolist()):
        last = int(c["tables"][b, (n - 1) // 16])
        stale["k_cache"][last, (n - 1) % 16 + 1:] = float("nan")
        stale["v_cache"][last, (n - 1) % 16 + 1:] = float("nan")
    outs = [step(x["qkv"], x["positions"], x["cos_sin"], x["k_cache"].clone(),
                 x["v_cache"].clone(), x["slots"], x["tables"], x["lens"]) for x in (c, stale)]
    assert torch.isfinite(outs[1].float()).all() and torch.equal(outs[0], outs[1])


def test_native_decode_attention_same_bits_any_threads_and_refuses_bad_tables(threads):
    c = attention_case(3, [5, 11, 2])
    step = tk.CpuDecodeAttention(kernel, c["heads"], c["q_norm"], c["k_norm"], 1e-6, 0.2, None,
                                 None, False)
    outs = []
    for n in (1, 2, 3):
        threads(n)
        kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
        outs.append(step(c["qkv"], c["positions"], c["cos_sin"], kc, vc, c["slots"],
                         c["tables"], c["lens"]))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    args = [c[n] for n in ("qkv", "positions", "cos_sin", "k_cache", "v_cache", "slots",
                           "tables", "lens")]
    bad_table = c["tables"].clone()
    bad_table[1, 0] = 64                                      # past the 64 blocks
    with pytest.raises(ValueError, match="outside the cache"):
        step(*args[:6], bad_table, args[7])
    with pytest.raises(ValueError, match="outside the cache"):
        step(*args[:7], c["lens"] + 100)                      # keys past the table
    with pytest.raises(ValueError, match="outside the cache"):
        step(args[0], c["positions"] + len(c["cos_sin"]), *args[2:])    # past the rope table
    with pytest.raises(ValueError, match="caches"):
        step(c["qkv"][:, :-1], *args[1:])


@pytest.mark.parametrize("family", ["olmoe", "olmoe-clip", "minimax_m2", "qwen3_next",
                                    "qwen3_5_moe"])
def test_native_decode_step_with_whole_width_steps_and_gates(tiny_model_dir, family,
                                                             monkeypatch, tmp_path):
    # olmoe and minimax_m2 norm q and k across all heads (natively, in place on qkv before
    # the per-head steps; olmoe-clip: clip_qkv 0.5 in its config, past which most of the tiny
    # model's q, k and v lie), and qwen3_next / qwen3_5_moe gate the output (the native step
    # reads q past each head's gate, and the native sigmoid gate multiplies after). Each
    # decode step's layer output
    # against the torch path's on the same input, in the same step: the difference's norm
    # within a few bf16 steps of the output's (each rounds o, then o_proj sums it).
    # (Not the tokens: one bf16 step in qwen3_next's last layer moves a tiny random model's
    # logprobs by up to 0.5.)
    from freetoken import LLM, SamplingParams
    from freetoken.models.layers.attention import Attention
    path = tiny_model_dir(family.split("-")[0], seed=3)
    if family == "olmoe-clip":
        import json
        import shutil
        path = shutil.copytree(path, tmp_path / "m")
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, "clip_qkv": 0.5}))
    llm = LLM(str(path), skip_tokenizer_init=True,
              dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False)
    attns = [m for m in llm.runner.model.modules() if isinstance(m, Attention)]
    assert all(a.cpu_decode.clip == (0.5 if family == "olmoe-clip" else None) for a in attns)
    gated = family in ("qwen3_next", "qwen3_5_moe")                # (whole-width: the rest)
    assert attns and all(a.cpu_decode is not None and a.cpu_decode.gated == gated
                         and a.cpu_decode.whole != gated for a in attns)
    calls, attn_call = [], tk.cpu_native.AttnCall.__call__
    monkeypatch.setattr(tk.cpu_native.AttnCall, "__call__",
                        lambda *a, **kw: calls.append(1) or attn_call(*a, **kw))
    checked = []
    for a in attns:
        native, forward = a.cpu_decode, a.forward

        def both(x, batch, a=a, native=native, forward=forward):
            if batch.max_seqlen_q != 1:
                return forward(x, batch)
            a.cpu_decode = None
            want = forward(x, batch)
            a.cpu_decode = native
            got = forward(x, batch)
            checked.append(float((got.float() - want.float()).norm() / want.float().norm()))
            return got
        a.forward = both
    llm.generate([[5, 17, 99, 3, 200, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]],
                 SamplingParams(max_tokens=6, min_tokens=6, temperature=0))
    assert len(checked) == len(calls) == 5 * len(attns) and max(checked) <= 2 ** -6, checked


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "olmoe", "minimax_m2"])
def test_bf16_cpu_engine_decodes_through_the_native_step(tiny_model_dir, family, monkeypatch):
    # A bf16 CPU engine's attention layers take the native decode step (gpt-oss: sliding
    # window and sinks on alternate layers; olmoe and minimax_m2: torch's q/k norms across
    # heads before it) and generate what the torch path generates, to bf16's ties: a random
    # tiny model's top two logits can be one bf16 step apart, so where
    # the tokens part, the torch path's top two must be that near (and the rest is not
    # compared); the steps before must agree in token and logprob. "Near" is 0.1: bf16's
    # noise on these models (gpt_oss's first token: HF's bf16 logprob is 0.038 off its
    # float32 one), two bf16 paths twice that apart after a few steps. The torch run routes
    # as the native run did (its routers' outputs replayed in call order): a router's bf16
    # tie sends the two paths to other experts, after which nothing compares (seen on an
    # AVX2 CPU, olmoe's third prompt: two experts' logits 4.96875 both in the torch path, 5.0
    # and 4.97 in the native one, the next layer's router logits 1.27 apart). The routers
    # are tested on their own; here only attention differs.
    from freetoken import LLM, SamplingParams
    from freetoken.models.layers.attention import Attention
    from freetoken.models.layers.router import Router
    path = str(tiny_model_dir(family, seed=3))
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0, logprobs=2)
    # (six prompts: minimax_m2's logits are flat, its top two often one bf16 step apart,
    # and with AMX's decode scores three prompts parted at ties after 16 agreed steps)
    prompts = [[5, 17, 99, 3, 200, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
               [40, 41, 2, 9, 77, 300, 12, 8, 1, 64, 65, 66, 3, 3, 5, 900, 17, 18],
               [8, 500, 31, 2], [70, 71, 1000, 4, 4, 19, 250, 6, 33],
               [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43]]
    # (enforce_eager: the modules' step, which the decode program replays: test_cpu_graph.py;
    # no prefix cache: the second run's prefill would be other batches, its tokens a bf16 step
    # off before any decode step, and only the decode steps are compared)
    llm = LLM(path, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
              enable_prefix_caching=False)
    attns = [m for m in llm.runner.model.modules() if isinstance(m, Attention)]
    assert attns and all(a.cpu_decode is not None for a in attns)
    calls = []                                      # the native steps taken
    attn_call = tk.cpu_native.AttnCall.__call__

    def counted(*args, **kwargs):
        calls.append(1)
        return attn_call(*args, **kwargs)
    monkeypatch.setattr(tk.cpu_native.AttnCall, "__call__", counted)
    routed, route = [], Router.route

    def recorded(self, x):
        routed.append(route(self, x))
        return routed[-1]
    monkeypatch.setattr(Router, "route", recorded)
    native = llm.generate(prompts, params)
    assert len(calls) >= 11 * len(attns) and routed  # every decode step of every layer
    for a in attns:
        a.cpu_decode = None
    calls.clear()
    replay = iter(routed)

    def replayed(self, x):
        weights, ids = next(replay)
        assert ids.shape[0] == x.shape[0]           # the same call of the same step
        return weights, ids
    monkeypatch.setattr(Router, "route", replayed)
    torch_path = llm.generate(prompts, params)
    assert not calls and next(replay, None) is None
    agreed = 0
    for got, want in zip(native, torch_path):
        for step, (tok, ref) in enumerate(zip(got.token_ids, want.token_ids)):
            (lp, _), (ref_lp, top) = got.logprobs[step], want.logprobs[step]
            if tok != ref:
                assert top[0][1] - top[1][1] < 0.1, (step, top)       # a near-tie
                break
            assert abs(lp - ref_lp) < 0.1, (step, lp, ref_lp)
            agreed += 1
    assert agreed >= 18, agreed


# ---- RMSNorm (cpu_norm.c) ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_rms_norm_is_the_reference_to_a_last_place(dtype, threads):
    # 7 rows (one thread) and 40 (shared among the threads); D 200: vector blocks and a tail.
    threads(2)
    g = torch.Generator().manual_seed(5)
    for t in (7, 40):
        x = torch.randn(t, 200, generator=g).to(dtype)
        res = torch.randn(t, 200, generator=g).to(dtype)
        w = (1 + 0.5 * torch.randn(200, generator=g)).to(dtype)
        x[0, 3] = res[1, 199] = float("nan")                   # a nan stays in its row
        got, got_res = kernel.rms_norm(x, w, 1e-6, res)
        want, want_res = tk.rms_norm_reference(x, w, 1e-6, res)
        assert torch.equal(got_res.isnan(), want_res.isnan())
        assert torch.equal(got.isnan(), want.isnan()) and got[:2].isnan().all()
        ok = ~want.isnan()
        assert torch.equal(got_res[ok], want_res[ok])          # the sum: exactly
        ulp = 2.0 ** (-6 if dtype == torch.bfloat16 else -9)   # two roundings apart at most
        assert ((got[ok].float() - want[ok].float()).abs()
                <= ulp * want[ok].float().abs() + 1e-6).all()
        assert (got[ok] == want[ok]).float().mean() > 0.95     # mostly the same bits
        alone = kernel.rms_norm(x[2:], w, 1e-6)
        ref = tk.rms_norm_reference(x[2:], w, 1e-6).float()
        assert ((alone.float() - ref).abs() <= ulp * ref.abs() + 1e-6).all()
    with pytest.raises(ValueError, match="16-bit x"):
        kernel.rms_norm(x.float(), w, 1e-6)
    with pytest.raises(ValueError, match="16-bit x"):
        kernel.rms_norm(x, w[:100], 1e-6)


def test_rms_norm_layer_runs_natively_once_packed():
    from freetoken.models.layers.norm import RMSNorm
    norm = RMSNorm(64, 1e-6, offset=1.0).to(torch.bfloat16)
    norm.weight.data = 0.2 * torch.randn(64).bfloat16()
    x = torch.randn(40, 64).bfloat16()
    before = norm(x)
    assert norm.pack_cpu() == 0 and isinstance(norm.native, tk.cpu_native.RmsNormCall)
    scale = (1.0 + norm.weight.float()).bfloat16()            # the zero-centred scale
    for rows in (2, 40):
        assert torch.equal(norm(x[:rows]), kernel.rms_norm(x[:rows], scale, 1e-6))
    assert ((norm(x).float() - before.float()).abs() <= 2.0 ** -6 * before.float().abs()
            + 1e-6).all()
    assert torch.equal(norm(x.float()), tk.rms_norm_reference(x.float(), scale, 1e-6))


# ---- the router's softmax -> top-k (cpu_route.c) and the MoE call's dtypes --------------------

def assert_same_topk(got, want, logits):
    """The same weights, largest first, and the same experts, but for ties: equal bf16 logits
    are common, torch.topk orders them as it may, the kernel by id; tied experts at the k-th
    place may differ, with the same weight."""
    (w, ids), (want_w, want_ids) = got, want
    assert torch.allclose(w, want_w, rtol=1e-6, atol=1e-7)
    for row in range(ids.shape[0]):
        kth = logits[row, want_ids[row, -1]]
        assert (set(ids[row][logits[row, ids[row]] > kth].tolist())
                == set(want_ids[row][logits[row, want_ids[row]] > kth].tolist()))
        assert bool((logits[row, ids[row]] >= kth).all())
        ties = ids[row][logits[row, ids[row]] == logits[row, ids[row]][0]]   # lower id first
        assert torch.equal(ties, ties.sort().values)


@pytest.mark.parametrize("e,k", [(64, 8), (7, 3), (5, 5)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("renormalize", [True, False])
def test_native_topk_softmax_is_the_reference(e, k, dtype, renormalize):
    g = torch.Generator().manual_seed(e + k)
    logits = torch.randn(9, e, generator=g).to(dtype)
    weights, ids = kernel.topk_softmax(logits, k, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert_same_topk((weights, ids), tk.topk_softmax_reference(logits, k, renormalize), logits)
    with pytest.raises(ValueError, match="1 <= k <= E"):
        kernel.topk_softmax(logits, e + 1, renormalize)


def test_router_routes_natively_once_packed():
    from freetoken.models.layers.router import Router, RouterConfig
    router = Router(64, RouterConfig(num_experts=16, top_k=4, renormalize=True))
    router.weight.data = torch.randn(16, 64) * 0.3
    router = router.to(torch.bfloat16)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    router.pack_cpu()
    assert router.native is kernel
    got = router.route(x)
    logits = router.logits(x)
    want = tk.topk_softmax_reference(logits, 4, True)
    assert got[0].dtype == torch.float32
    assert_same_topk(got, want, logits.float())
    f32 = Router(64, RouterConfig(num_experts=16, top_k=4, renormalize=True))
    f32.pack_cpu()
    assert f32.native is None                       # a float32 model keeps the reference
    biased = Router(64, RouterConfig(num_experts=16, top_k=4, scoring="sigmoid",
                                     selection_bias=True))
    biased.pack_cpu()
    assert biased.native is None                    # grouped / biased routing: torch's ops


def test_native_moe_writes_its_output_in_the_dtype_asked(threads):
    # The float32 sums rounded once to bf16 or fp16: exactly the float32 output's rounding;
    # x in bf16 is read as it is (the same sums as from its float32 copy).
    threads(2)
    c = biased_experts(seed=8, t=6, d=64, i=32)
    args = (c["w13"], c["w2"], c["weights"], c["ids"], c["slot_map"], c["b13"], c["b2"])
    f32 = kernel.moe(c["x"], *args)
    assert torch.equal(kernel.moe(c["x"].float(), *args), f32)
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(kernel.moe(c["x"], *args, out_dtype=dtype), f32.to(dtype))
