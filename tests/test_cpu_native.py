"""The CPU experts' native kernel (triton_kernels/cpu_moe.c, cpu_native.py): built at first
use, it runs a whole MoE layer's routed experts in one call. Its oracle is the torch reference
on the same weights widened to float32 (the kernel reads the 16-bit weights as they are and
sums in float32, so only the order of the sums differs)."""

import pytest
import torch

import triton_kernels as tk
from tiny_fixtures import amx_kernel_runs, biased_experts, fp8_bank, fp8_rel, int16_x_bound
from triton_kernels import cpu_native
from triton_kernels.fused_moe import SILU, SWIGLU_OAI, fused_moe_reference

pytestmark = pytest.mark.skipif(tk.native_kernels() is None,
                                reason="no C compiler: the native kernel is not built")


def reference(c, activation, dtype, biased=True):
    """float32 torch reference on the 16-bit weights, exactly widened."""
    kw = dict(b13=c["b13"].float(), b2=c["b2"].float()) if biased else {}
    return fused_moe_reference(c["x"].float(), c["w13"].to(dtype).float(),
                               c["w2"].to(dtype).float(), c["weights"], c["ids"],
                               c["slot_map"], activation=activation, **kw)


def rel(a, b):
    return ((a.float() - b).norm() / b.norm()).item()


def on_1_to_3_threads(threads, call):
    """call() on 1, 2 and 3 threads: its one output, asserted the same bits on each."""
    outs = []
    for n in (1, 2, 3):
        threads(n)
        outs.append(call())
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    return outs[0]


# d and i: multiples of 32 (whole paired blocks), and ones with tails in both products.
@pytest.mark.parametrize("d,i", [(64, 32), (72, 40)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", [SILU, SWIGLU_OAI])
def test_native_moe_matches_the_float32_reference(d, i, dtype, activation, threads):
    # Token counts 1 (decode), 3 (a partial token block), 9 and 40 (several experts with
    # 4 tokens and more: the 4-row tiles, and their remainders), 100 (experts of 16 tokens
    # and more: the GEMM form, a partial block of tokens, rows past a whole panel, beside
    # the tiles of the others); slots mapped, biases on.
    threads(2)
    kernel = tk.native_kernels()
    for t in (1, 3, 9, 40, 100):
        c = biased_experts(seed=t, t=t, d=d, i=i, e=6, k=2, pool=9)
        w13, w2 = c["w13"].to(dtype), c["w2"].to(dtype)
        want = reference(c, activation, dtype)
        got = kernel.moe(c["x"], w13, w2, c["weights"], c["ids"], c["slot_map"], c["b13"],
                     c["b2"], activation.kind, activation.alpha, activation.limit)
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert rel(got, want) < 1e-5, (t, rel(got, want))
        # Without biases and slot map (ids index the bank directly).
        ids = c["slot_map"][c["ids"]]
        plain = kernel.moe(c["x"], w13, w2, c["weights"], ids)
        want = fused_moe_reference(c["x"].float(), w13.float(), w2.float(), c["weights"], ids)
        assert rel(plain, want) < 1e-5


def test_native_moe_gives_the_same_bits_on_any_thread_count(threads):
    # Each output is summed in one fixed order whoever computes it.
    c = biased_experts(seed=5, t=60, d=64, i=32, e=6, k=3, pool=9)    # (tiles and GEMMs)
    kernel = tk.native_kernels()
    outs = []
    for n in (1, 2, 3):
        threads(n)
        outs.append(kernel.moe(c["x"], c["w13"], c["w2"], c["weights"], c["ids"], c["slot_map"],
                           c["b13"], c["b2"]))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_native_banks_through_fused_moe():
    # fused_moe (and its reference) hand two native banks to the kernel: x's dtype back,
    # float32 inside; an empty routing gives zeros; mixed or foreign banks are refused.
    c = biased_experts(seed=2, t=5, d=64, i=32)
    kernel = tk.native_kernels()
    b13, b2 = tk.NativeBank(c["w13"], kernel), tk.NativeBank(c["w2"], kernel)
    assert (b13.experts, b13.n, b13.k, b13.nbytes) == (9, 64, 64, 9 * 64 * 64 * 2)
    got = tk.fused_moe(c["x"], b13, b2, c["weights"], c["ids"], c["slot_map"],
                       b13=c["b13"], b2=c["b2"])
    want = reference(c, SILU, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and rel(got, want) < 1e-2
    empty = tk.fused_moe(c["x"], b13, b2, c["weights"][:, :0], c["ids"][:, :0])
    assert torch.equal(empty, torch.zeros_like(c["x"]))
    with pytest.raises(ValueError, match="native banks"):
        tk.fused_moe(c["x"], b13, c["w2"], c["weights"], c["ids"], c["slot_map"])
    with pytest.raises(ValueError, match="native banks"):
        tk.fused_moe(c["x"], b13, tk.NativeBank(c["w2"].half(), kernel), c["weights"],
                     c["ids"], c["slot_map"])
    with pytest.raises(ValueError, match="bf16 or fp16"):
        tk.NativeBank(c["w13"].float(), kernel)


def test_native_moe_refuses_bad_input():
    c = biased_experts(seed=3, t=4, d=64, i=32)
    kernel = tk.native_kernels()
    with pytest.raises(ValueError, match="outside the bank's 9 slots"):
        kernel.moe(c["x"], c["w13"], c["w2"], c["weights"], c["ids"] + 100)
    with pytest.raises(ValueError, match="outside"):
        kernel.moe(c["x"], c["w13"], c["w2"], c["weights"], -c["ids"] - 1)
    with pytest.raises(ValueError, match="outside the slot map"):      # 6 experts mapped
        kernel.moe(c["x"], c["w13"], c["w2"], c["weights"], c["ids"] + 6, c["slot_map"])
    with pytest.raises(ValueError, match=r"w13 \[S, 2I, D\]"):
        kernel.moe(c["x"], c["w13"], c["w2"].half(), c["weights"], c["ids"], c["slot_map"])
    with pytest.raises(ValueError, match=r"w13 \[S, 2I, D\]"):
        kernel.moe(c["x"][:, :32], c["w13"], c["w2"], c["weights"], c["ids"], c["slot_map"])
    with pytest.raises(ValueError, match=r"w13 \[S, 2I, D\]"):
        kernel.moe(c["x"], c["w13"], c["w2"], c["weights"][:2], c["ids"], c["slot_map"])


def test_decoded_bank_keeps_float16_or_falls_back_to_bfloat16_or_takes_bfloat16_for_amx():
    kernel = tk.native_kernels()
    small = [torch.randn(8, 32) for _ in range(3)]
    bank = tk.NativeBank.decoded((3, 8, 32), lambda e: small[e], kernel, amx=False)
    assert bank.dtype == torch.float16
    assert torch.equal(bank.weight, torch.stack(small).half())
    big = [s.clone() for s in small]
    big[1][0, 0] = 1e6                              # beyond float16's range
    bank = tk.NativeBank.decoded((3, 8, 32), lambda e: big[e], kernel, amx=False)
    assert bank.dtype == torch.bfloat16 and not bank.gemm
    assert torch.equal(bank.weight, torch.stack(big).bfloat16())
    # With AMX: bfloat16 whatever the range, and prefill chunks to its products.
    bank = tk.NativeBank.decoded((3, 8, 32), lambda e: small[e], kernel, amx=True)
    assert bank.dtype == torch.bfloat16 and bank.gemm
    assert torch.equal(bank.weight, torch.stack(small).bfloat16())


def test_build_is_cached_and_a_failed_build_says_why(tmp_path, monkeypatch):
    # The library lands in FREETOKEN_CACHE, keyed by source, compiler and CPU, and is reused;
    # a compiler that fails raises with its command (native_kernels() then warns and gives None).
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path))
    path = cpu_native._build()
    assert path.parent == tmp_path / "native" and path.exists()
    mtime = path.stat().st_mtime_ns
    assert cpu_native._build() == path and path.stat().st_mtime_ns == mtime
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "other"))
    monkeypatch.setenv("CC", "false")
    with pytest.raises(RuntimeError, match="false -O3"):
        cpu_native._build()
    assert not list((tmp_path / "other" / "native").glob("*.so"))


# ---- fp8 experts from their bytes (cpu_dot.h's load_e4m3 / load_e4m3_f8l, NativeFp8Bank) -------

@pytest.mark.parametrize("d,i,bn,bk", [(64, 32, 16, 32), (72, 40, 32, 16), (256, 128, 128, 128),
                                        (72, 40, 1, 0), (256, 128, 1, 0)])
@pytest.mark.parametrize("activation", [SILU, SWIGLU_OAI])
def test_native_fp8_moe_matches_the_decoded_reference(d, i, bn, bk, activation, threads):
    # Blocks that tile the banks, ragged ones (rows and columns of a block past the edge, and
    # blocks that a 4-row tile would straddle), row scales (block (1, 0): a checkpoint's
    # channel scales, on each row's sums), 1 to 100 tokens (9 and 40: experts of more than 4
    # tokens, whose rows AVX2 decodes once to bf16 words where K is whole 32-byte blocks,
    # f8l_decodes; 100: experts of 16 and more, the GEMM form, each row decoded with its
    # blocks' scales); against the float32 reference on the exactly decoded weights,
    # subnormal e4m3 codes included (fp8_rel: x rounded to float16 where this build does).
    threads(2)
    kernel = tk.native_kernels()
    for t in (1, 3, 9, 40, 100):
        c = biased_experts(seed=t, t=t, d=d, i=i, e=6, k=2, pool=9)
        q13, s13, deq13 = fp8_bank(c["w13"], bn, bk or d)
        q2, s2, deq2 = fp8_bank(c["w2"], bn, bk or i)
        if not bk:                                          # [S, N]: a row's own
            s13, s2 = s13[..., 0].contiguous(), s2[..., 0].contiguous()
        got = kernel.moe(c["x"], q13, q2, c["weights"], c["ids"], c["slot_map"], c["b13"],
                         c["b2"], activation.kind, activation.alpha, activation.limit,
                         scales=(s13, s2), block=(bn, bk))
        want = fused_moe_reference(c["x"].float(), deq13, deq2, c["weights"], c["ids"],
                                   c["slot_map"], b13=c["b13"].float(), b2=c["b2"].float(),
                                   activation=activation)
        assert rel(got, want) < fp8_rel(kernel), (t, rel(got, want))


def test_native_forms_name_this_builds_products():
    # What the benches print beside their figures: the forms differ by CPU.
    kernel = tk.native_kernels()
    forms = kernel.forms()
    assert forms.startswith(f"e4m3 {kernel.e4m3_decode}, int4 against "
                            f"{kernel.int4_activations} x, AMX-BF16 ")
    assert forms.endswith("yes" if tk.has_amx_bf16() else "no")


def test_native_fp8_banks_through_fused_moe(threads):
    c = biased_experts(seed=6, t=7, d=64, i=32)
    kernel = tk.native_kernels()
    q13, s13, deq13 = fp8_bank(c["w13"], 32, 32)
    q2, s2, deq2 = fp8_bank(c["w2"], 32, 32)
    b13, b2 = tk.NativeFp8Bank(q13, s13, (32, 32), kernel), tk.NativeFp8Bank(q2, s2, (32, 32), kernel)
    assert b13.nbytes == q13.numel() + s13.numel() * 4
    out = on_1_to_3_threads(threads, lambda: tk.fused_moe(
        c["x"], b13, b2, c["weights"], c["ids"], c["slot_map"], b13=c["b13"].float(),
        b2=c["b2"].float()))
    assert out.dtype == torch.bfloat16
    want = fused_moe_reference(c["x"].float(), deq13, deq2, c["weights"], c["ids"],
                               c["slot_map"], b13=c["b13"].float(), b2=c["b2"].float())
    assert rel(out, want) < 1e-2
    with pytest.raises(ValueError, match="native banks"):
        tk.fused_moe(c["x"], b13, tk.NativeBank(c["w2"], kernel), c["weights"], c["ids"],
                     c["slot_map"])
    with pytest.raises(ValueError, match="block scales"):        # scales of another block
        kernel.moe(c["x"], q13, q2, c["weights"], c["ids"], c["slot_map"], scales=(s13, s2),
                   block=(16, 16))
    with pytest.raises(ValueError, match="block scales"):
        kernel.moe(c["x"], q13, q2, c["weights"], c["ids"], c["slot_map"])
    with pytest.raises(ValueError, match="NativeFp8Bank"):
        tk.NativeFp8Bank(q13, s13[:, :1], (32, 32), kernel)
    # row scales (a checkpoint's channel scales): [E, N], block (1, 0) only
    q13, s13, deq13 = fp8_bank(c["w13"], 1, 64)
    q2, s2, deq2 = fp8_bank(c["w2"], 1, 32)
    s13, s2 = s13[..., 0].contiguous(), s2[..., 0].contiguous()
    b13, b2 = (tk.NativeFp8Bank(q, s, (1, 0), kernel) for q, s in ((q13, s13), (q2, s2)))
    assert b13.nbytes == q13.numel() + s13.numel() * 4
    for t in (7, 48):       # (48: 8 rows an expert and more, a prefill chunk's: AMX declines)
        c = biased_experts(seed=t, t=t, d=64, i=32)
        out = on_1_to_3_threads(threads, lambda: tk.fused_moe(
            c["x"], b13, b2, c["weights"], c["ids"], c["slot_map"]))
        want = fused_moe_reference(c["x"].float(), deq13, deq2, c["weights"], c["ids"],
                                   c["slot_map"])
        assert rel(out, want) < 1e-2, t
    with pytest.raises(ValueError, match=r"fp8 blocks .* got \(2, 0\)"):
        kernel.moe(c["x"], q13, q2, c["weights"], c["ids"], c["slot_map"], scales=(s13, s2),
                   block=(2, 0))
    with pytest.raises(ValueError, match="NativeFp8Bank"):
        tk.NativeFp8Bank(q13, s13, (2, 0), kernel)


# ---- int4 experts from their nibbles (cpu_dot.h's load_int4, NativeInt4Bank) -----------------

def int4_bank(w, group, symmetric, scale_dtype):
    """w [E, N, K] quantized to int4 by the project's quantizer, and its reference decode."""
    from freetoken.models.quant.quantize import quantize_weight
    from triton_kernels.dequant import QuantFormat, dequantize_reference
    fmt = QuantFormat("int4", group=group, symmetric=symmetric)
    parts = [quantize_weight(fmt, e.float(), scale_dtype=scale_dtype) for e in w]
    bank = {name: torch.stack([p[name] for p in parts]) for name in parts[0]}
    return bank, dequantize_reference(fmt, bank, torch.float32)


@pytest.mark.parametrize("group,symmetric,scale_dtype", [(32, False, torch.bfloat16),
                                                         (64, True, torch.bfloat16),
                                                         (32, True, torch.float32)])
@pytest.mark.parametrize("activation", [SILU, SWIGLU_OAI])
def test_native_int4_moe_matches_the_decoded_reference(group, symmetric, scale_dtype,
                                                       activation, threads):
    # Asymmetric (zero points) and symmetric groups, 16-bit and float32 scales, 1 to 100
    # tokens (one row at a time, 4-row tiles, and at 100 experts of 16 tokens and more: the
    # GEMM form, each row's groups decoded in order), against the float32 reference on the
    # decoded weights; the same bits on 1 to 3 threads.
    kernel = tk.native_kernels()
    for t in (1, 3, 9, 40, 100):
        c = biased_experts(seed=t, t=t, d=128, i=64, e=6, k=2, pool=9)
        q13, deq13 = int4_bank(c["w13"], group, symmetric, scale_dtype)
        q2, deq2 = int4_bank(c["w2"], group, symmetric, scale_dtype)
        b13 = tk.NativeInt4Bank(q13["q"], q13["s"], q13.get("z"), group, kernel)
        b2 = tk.NativeInt4Bank(q2["q"], q2["s"], q2.get("z"), group, kernel)
        outs = []
        for n in (1, 2, 3):
            threads(n)
            outs.append(tk.fused_moe(c["x"].float(), b13, b2, c["weights"], c["ids"],
                                     c["slot_map"], b13=c["b13"].float(), b2=c["b2"].float(),
                                     activation=activation))
        assert all(torch.equal(outs[0], o) for o in outs[1:])
        want = fused_moe_reference(c["x"].float(), deq13, deq2, c["weights"], c["ids"],
                                   c["slot_map"], b13=c["b13"].float(), b2=c["b2"].float(),
                                   activation=activation)
        assert rel(outs[0], want) < 1e-5, (t, rel(outs[0], want))


@pytest.mark.parametrize("group,symmetric", [(32, False), (64, True), (128, False), (32, True)])
def test_native_int4_moe_with_bf16_activations_takes_the_prepared_products(group, symmetric,
                                                                           threads):
    # bf16 x (cpu_dot.h's i4v or i4w where the build has one: x rounded to int16 per group,
    # integer products, the offset taken back per group): against float64 on the decoded
    # weights with the activations rounded to bf16 between the products, as a bf16 model
    # rounds them;
    # groups of 32 to 128 (several a block, or one; symmetric rows of 4 and 8 groups); 1 to
    # 100 tokens (one row at a time, 4-row tiles, and the GEMM form's experts of 16 tokens
    # and more, float32 activations, beside the others); the same bits on 1 to 3 threads.
    from triton_kernels.fused_moe import _activate
    kernel = tk.native_kernels()
    for t in (1, 3, 9, 40, 100):
        c = biased_experts(seed=t, t=t, d=256, i=256, e=6, k=2, pool=9)
        q13, deq13 = int4_bank(c["w13"], group, symmetric, torch.bfloat16)
        q2, deq2 = int4_bank(c["w2"], group, symmetric, torch.bfloat16)
        # (amx=False: on an AMX CPU a bank's busy experts would go to the bf16 GEMM)
        b13 = tk.NativeInt4Bank(q13["q"], q13["s"], q13.get("z"), group, kernel, amx=False)
        b2 = tk.NativeInt4Bank(q2["q"], q2["s"], q2.get("z"), group, kernel, amx=False)
        out = on_1_to_3_threads(threads, lambda: tk.fused_moe(
            c["x"], b13, b2, c["weights"], c["ids"], c["slot_map"], b13=c["b13"].float(),
            b2=c["b2"].float()))
        assert out.dtype == torch.bfloat16
        want = torch.zeros(t, 256, dtype=torch.float64)
        for tok in range(t):
            for j in range(2):
                slot = c["slot_map"][c["ids"][tok, j]]
                h = deq13[slot].double() @ c["x"][tok].double() + c["b13"][slot].double()
                act = _activate(h[:256].float(), h[256:].float(), SILU).bfloat16()
                y = deq2[slot].double() @ act.double() + c["b2"][slot].double()
                want[tok] += c["weights"][tok, j].double() * y
        assert rel(out.double(), want) < 4e-3, (t, rel(out.double(), want))
        # and the float32 products' path (float32 x) on the same banks
        assert rel(out.double(), tk.fused_moe(c["x"].float(), b13, b2, c["weights"], c["ids"],
                                                  c["slot_map"], b13=c["b13"].float(),
                                                  b2=c["b2"].float()).double()) < 4e-3


@pytest.mark.parametrize("group", [32, 256])
def test_native_int4_linear_takes_groups_longer_than_a_block(group, threads):
    # Groups of 256 span two of i4v's 128-weight blocks (each block takes back its lanes'
    # share of the offset) and eight of i4w's 32-weight ones; nibbles, scales and zero
    # points drawn directly, against float64 on W = (q - z) s; one to five tokens, the same
    # bits on 1 and 2 threads.
    g = torch.Generator().manual_seed(group)
    n, k = 48, 512
    q = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    s = (torch.rand(n, k // group, generator=g) * 0.02 + 0.001).bfloat16()
    z = torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.uint8)
    nib = torch.stack([q & 15, q >> 4], dim=-1).reshape(n, k).double()
    w = (nib - z.double().repeat_interleave(group, 1)) * s.double().repeat_interleave(group, 1)
    pairs = tk.int4_group_pairs(s, z)
    kernel = tk.native_kernels()
    for t in (1, 5):
        x = torch.randn(t, k, generator=g).bfloat16()
        outs = []
        for nthreads in (1, 2):
            threads(nthreads)
            outs.append(kernel.linear(x, q, None, scales=pairs, block=(1, group)))
        assert torch.equal(outs[0], outs[1])
        want = x.double() @ w.T
        bound = (want.abs() * 2.0 ** -8 + (x.double().abs() @ w.abs().T) * 2.0 ** -20
                 + int16_x_bound(kernel, x, w.abs(), group))
        assert ((outs[0].double() - want).abs() <= bound).all(), t


@pytest.mark.parametrize("group,zeros", [(32, True), (64, False), (128, True), (256, False)])
def test_native_int4_int16_activations_are_the_documented_rounding(group, zeros, threads):
    # AVX2 and AVX512-VNNI builds (cpu_dot.h's i4w, i4v) round 16-bit x to int16 per group:
    # sx = max |x| / 32767, xq = round(x * (32767 / max |x|)) in float32, and the sums are
    # W . (sx xq) (q xq exact in int32, the offsets from sx sum xq). That in float64 matches
    # the kernel to float32's summing of the two terms before they cancel (q s and m X), and
    # the float64 product on the unrounded x within the rounding's own bound. One group
    # carries a 1000x outlier (its small elements lose bits) and one is all zeros; 7 groups a
    # row (i4w's two-group loop and its tail; i4v's 128-weight blocks and a last one of 96 or
    # 64 at groups of 32 and 64); 41 rows (4-row tiles and a last single row); 1 to 5 tokens
    # (4-row tiles at one, a row at a time at more); 1 and 2 threads.
    kernel = tk.native_kernels()
    if kernel.int4_activations != "int16":
        pytest.skip(f"this build's int4 products take 16-bit x as it is "
                    f"({kernel.int4_activations})")
    g = torch.Generator().manual_seed(group)
    n, k = 41, 7 * group
    q = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    s = (torch.rand(n, k // group, generator=g) * 0.02 + 0.001).bfloat16()
    z = torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.uint8) if zeros else None
    scales = tk.int4_scales(s, z)
    nib = torch.stack([q & 15, q >> 4], dim=-1).reshape(n, k).double()
    zero = (z.double() if zeros else torch.full_like(s, 8, dtype=torch.float64))
    w = (nib - zero.repeat_interleave(group, 1)) * s.double().repeat_interleave(group, 1)
    m = -zero * s.double()                                                   # [N, G]
    # float32's summing, of the two terms before they cancel: q s and m X
    wterms = (nib * s.double().repeat_interleave(group, 1) + m.abs().repeat_interleave(group, 1))
    for t in (1, 2, 3, 5):
        x = torch.randn(t, k, generator=g).bfloat16()
        x[0, 3] = 1000.0
        x[-1, group:2 * group] = 0
        outs = []
        for nthreads in (1, 2):
            threads(nthreads)
            outs.append(kernel.bind_linear(q, None, scales, (1, group))(x, torch.float32))
        assert torch.equal(outs[0], outs[1])
        xf = x.float().view(t, -1, group)
        amax = xf.abs().amax(-1, keepdim=True)
        inv = torch.where(amax > 0, 32767 / amax, torch.zeros_like(amax))     # float32
        xq = torch.round(xf * inv).clamp(-32767, 32767).double()            # half to even
        rounded = (xq * (amax / 32767).double()).view(t, k)
        emulated = rounded @ w.T
        terms = x.double().abs() @ wterms.T
        assert ((outs[0].double() - emulated).abs() <= terms * 2.0 ** -19).all(), t
        rounding = int16_x_bound(kernel, x, w.abs(), group)
        assert ((outs[0].double() - x.double() @ w.T).abs()
                <= rounding + terms * 2.0 ** -19).all(), t
        assert (rounding > terms * 2.0 ** -15).any()    # the rounding is not lost in the slack


def test_decode_buffer_is_kept_per_thread_and_grown():
    # A prefill chunk's decoded experts go to one buffer a thread, reused (fresh memory's
    # page faults cost 7x the decode), grown when a call needs more, never shared by threads.
    import threading
    kernel = tk.native_kernels()
    a = kernel.decode_buffer(1000)
    assert a.dtype == torch.bfloat16 and a.numel() == 1000
    assert kernel.decode_buffer(10).data_ptr() == a.data_ptr()          # reused
    big = kernel.decode_buffer(5000)
    assert big.numel() == 5000 and kernel.decode_buffer(3000).data_ptr() == big.data_ptr()
    other = []
    t = threading.Thread(target=lambda: other.append(kernel.decode_buffer(1000).data_ptr()))
    t.start()
    t.join()
    assert other[0] != big.data_ptr()


def test_native_int4_banks_in_both_scale_forms_run_as_pairs(threads):
    # w13 symmetric with bf16 scales (read in place), w2 with fp16 scales (pairs): the call
    # takes pairs for both, against the decoded reference.
    kernel = tk.native_kernels()
    c = biased_experts(seed=4, t=5, d=128, i=64, e=6, k=2, pool=9)
    q13, deq13 = int4_bank(c["w13"], 32, True, torch.bfloat16)
    q2, deq2 = int4_bank(c["w2"], 32, True, torch.float16)
    b13 = tk.NativeInt4Bank(q13["q"], q13["s"], None, 32, kernel, amx=False)
    b2 = tk.NativeInt4Bank(q2["q"], q2["s"], None, 32, kernel, amx=False)
    assert b13.gs.dtype == torch.bfloat16 and b2.gs.dtype == torch.float32
    got = tk.fused_moe(c["x"].float(), b13, b2, c["weights"], c["ids"], c["slot_map"])
    want = fused_moe_reference(c["x"].float(), deq13, deq2, c["weights"], c["ids"],
                               c["slot_map"])
    assert rel(got, want) < 1e-5


def test_native_int4_bank_refuses_bad_groups_and_mixed_banks():
    c = biased_experts(seed=1, t=2, d=64, i=32)
    kernel = tk.native_kernels()
    q, _ = int4_bank(c["w13"], 32, False, torch.bfloat16)
    with pytest.raises(ValueError, match="G a power of two"):
        tk.NativeInt4Bank(q["q"], q["s"], q["z"], 16, kernel)
    with pytest.raises(ValueError, match="G a power of two"):
        tk.NativeInt4Bank(q["q"], q["s"][:, :, :1], q["z"], 32, kernel)
    bank = tk.NativeInt4Bank(q["q"], q["s"], q["z"], 32, kernel)
    assert bank.nbytes == q["q"].numel() + q["s"].numel() * 8
    with pytest.raises(ValueError, match="native banks"):
        tk.fused_moe(c["x"], bank, tk.NativeBank(c["w2"], kernel), c["weights"], c["ids"],
                     c["slot_map"])


@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_bank_decodes_prefill_chunks_for_amx(symmetric, threads, monkeypatch):
    # An int4 bank on an AMX CPU: a chunk of GEMM_ROWS pairs an expert and more runs the AMX
    # kernel on its nibbles, each chunk of rows decoded to bf16 as the reference decodes it:
    # the kernel's bits on the reference's decode (and HF's bf16 loop's roundings); fewer
    # rows, the native kernel (the gemm=False bank's bits). int4_decode is the reference's
    # decode, bit for bit, from float32 pairs (zero points) or a symmetric bank's own bf16
    # scales.
    from triton_kernels.cpu_amx import moe_amx
    from triton_kernels.fused_moe import _moe_loop_torch
    kernel = tk.native_kernels()
    c = biased_experts(seed=3, t=40, d=128, i=64, e=3, k=2, pool=5)   # ~27 pairs an expert
    q13, deq13 = int4_bank(c["w13"], 32, symmetric, torch.bfloat16)
    q2, deq2 = int4_bank(c["w2"], 32, symmetric, torch.bfloat16)
    banks = {amx: (tk.NativeInt4Bank(q13["q"], q13["s"], q13.get("z"), 32, kernel, amx=amx),
                   tk.NativeInt4Bank(q2["q"], q2["s"], q2.get("z"), 32, kernel, amx=amx))
             for amx in (True, False)}
    b13, b2 = c["b13"].float(), c["b2"].float()
    args = (c["weights"], c["ids"], c["slot_map"])
    # a symmetric bank reads its bf16 scales in place: no bytes of its own
    assert (banks[True][0].gs.data_ptr() == q13["s"].data_ptr()) == symmetric
    assert banks[True][0].nbytes - banks[True][0].checkpoint_bytes == (0 if symmetric else
                                                                       q13["s"].numel() * 8)
    decoded = kernel.int4_decode(q13["q"], banks[True][0].gs, 32, torch.tensor([4, 0]))
    assert torch.equal(decoded, deq13[[4, 0]].bfloat16())
    got = tk.fused_moe(c["x"], *banks[True], *args, b13=b13, b2=b2)
    want = _moe_loop_torch(c["x"], deq13.bfloat16(), deq2.bfloat16(), *args, c["b13"],
                           c["b2"], SILU)
    if amx_kernel_runs(kernel):         # the kernel's bits on the decoded bank
        assert torch.equal(got, moe_amx(kernel, c["x"], deq13.bfloat16(), deq2.bfloat16(),
                                        *args, b13, b2, SILU))
        assert rel(got.float(), want.float()) < 1e-3
    else:                               # the decoded experts through the loop itself
        assert torch.equal(got, want)
    native = tk.fused_moe(c["x"], *banks[False], *args, b13=b13, b2=b2)
    assert not torch.equal(native, got) and rel(native, want.float()) < 1e-2
    one = [t[:1] for t in args[:2]] + [args[2]]
    assert torch.equal(tk.fused_moe(c["x"][:1], *banks[True], *one, b13=b13, b2=b2),
                       tk.fused_moe(c["x"][:1], *banks[False], *one, b13=b13, b2=b2))
    with pytest.raises(ValueError, match="int4 decode"):
        kernel.int4_decode(q13["q"], banks[True][0].gs, 32, torch.tensor([9]))
    # into a given buffer: the same bits; a buffer of the wrong size is refused
    into = torch.full((2 * 128 * 128,), float("nan"), dtype=torch.bfloat16)
    got_into = kernel.int4_decode(q13["q"], banks[True][0].gs, 32, torch.tensor([4, 0]), out=into)
    assert torch.equal(got_into, decoded) and got_into.data_ptr() == into.data_ptr()
    with pytest.raises(ValueError, match="out of"):
        kernel.int4_decode(q13["q"], banks[True][0].gs, 32, torch.tensor([4, 0]), out=into[1:])
    # A layer past the decode budget (INT4_DECODE_BYTES: where the kernel declines, the used
    # experts are decoded whole first) still runs the kernel, which decodes 32 rows at a time;
    # without it, the native kernel on the nibbles.
    import sys
    monkeypatch.setattr(sys.modules["triton_kernels.fused_moe"], "INT4_DECODE_BYTES", 1 << 10)
    assert torch.equal(tk.fused_moe(c["x"], *banks[True], *args, b13=b13, b2=b2),
                       got if amx_kernel_runs(kernel) else native)


def test_the_kernels_run_on_torchs_openmp_runtime():
    # The library links to the OpenMP runtime torch loaded, by its file: one runtime in the
    # process, whatever that file's soname (a wheel's libgomp-<hash>.so.1 included), so the
    # kernels' threads are torch's pool and no second team spins on the same cores.
    import shutil
    import subprocess
    runtime = cpu_native._openmp_runtime()
    assert runtime is not None and runtime.exists()
    kernel = tk.native_kernels()
    mapped = {line.split()[-1] for line in open("/proc/self/maps")
              if cpu_native.re.search(r"/lib(gomp|iomp5|omp)\b", line)}
    # (other packages a test process imported may map runtimes of their own: not asserted)
    assert str(runtime) in mapped, mapped
    if shutil.which("readelf"):
        dynamic = subprocess.run(["readelf", "-d", str(kernel.path)], capture_output=True,
                                 text=True).stdout
        soname = subprocess.run(["readelf", "-d", str(runtime)], capture_output=True,
                                text=True).stdout
        name = cpu_native.re.search(r"\(SONAME\)\s+Library soname: \[(.+?)\]", soname)
        assert name and f"[{name.group(1)}]" in dynamic and str(runtime.parent) in dynamic


def test_a_runtime_without_the_compilers_symbols_falls_back_to_fopenmp(monkeypatch, tmp_path):
    # Linked by path with --no-undefined, a runtime that lacks what the compiler's OpenMP code
    # calls (clang's __kmpc_* against libgomp; here libm, which has no OpenMP at all) fails the
    # link, and the library is linked by -fopenmp instead: it builds, loads and runs.
    import ctypes
    from pathlib import Path
    libm = sorted({line.split()[-1] for line in open("/proc/self/maps") if "/libm." in line})
    if not libm:
        pytest.skip("no libm mapped to stand in for a runtime")
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_native, "_openmp_runtime", lambda: Path(libm[0]))
    path = cpu_native._build()
    assert path.parent == tmp_path / "native"
    lib = cpu_native.NativeKernels(ctypes.CDLL(str(path)), path)
    assert lib.path == path
    import shutil
    import subprocess
    if shutil.which("readelf"):      # linked by -fopenmp: the compiler's own runtime
        dynamic = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
        assert "gomp" in dynamic and "libm" in dynamic


# ---- cpu_gates.c: the elementwise steps between products ------------------------------------

def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """The most 16-bit steps between two tensors of one 16-bit dtype (the same sign)."""
    return int((a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 5, 40])
def test_native_gates_round_as_torchs_ops(dtype, t, threads):
    # Each step rounded where torch's ops on 16-bit tensors round: the same bits but where
    # torch's vectorized exp and the C library's differ in a float32 value's last place and
    # that moves a rounding (one 16-bit step, rarely).
    kernel = tk.native_kernels()
    g = torch.Generator().manual_seed(t)
    x = (torch.randn(t, 2 * 96, generator=g) * 3).to(dtype)
    want = (torch.nn.functional.silu(x[:, :96]) * x[:, 96:])
    got = on_1_to_3_threads(threads, lambda: kernel.silu_mul(x))
    assert got.dtype == dtype and ulps_apart(got, want) <= 1
    assert (got == want).float().mean() > 0.99
    # the attention output's gate: q_proj's [q | gate] per head ahead of k and v in the row
    heads, dh = 3, 32
    qkv = (torch.randn(t, heads * 2 * dh + 40, generator=g) * 3).to(dtype)
    o = torch.randn(t, heads * dh, generator=g).to(dtype)
    gate = qkv[:, :heads * 2 * dh].view(t, heads, 2, dh)[:, :, 1].reshape(t, -1)
    want = o * torch.sigmoid(gate)
    got = on_1_to_3_threads(threads, lambda: kernel.sigmoid_gate(o.clone(), qkv, heads, dh))
    assert ulps_apart(got, want) <= 1 and (got == want).float().mean() > 0.99
    # a shared expert's add: gated by sigmoid(logit), or not
    h, y = (torch.randn(t, 64, generator=g).to(dtype) for _ in range(2))
    logit = (torch.randn(t, 1, generator=g) * 4).to(dtype)
    want = h + torch.sigmoid(logit) * y
    got = on_1_to_3_threads(threads, lambda: kernel.add_gated(h.clone(), y, logit))
    assert ulps_apart(got, want) <= 1 and (got == want).float().mean() > 0.99
    assert torch.equal(kernel.add_gated(h.clone(), y), h + y)


def test_native_gates_refuse_bad_shapes():
    kernel = tk.native_kernels()
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="silu_mul"):
        kernel.silu_mul_op(x, torch.empty(2, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="one 16-bit or float32 dtype"):
        kernel.add_gated(x, x.half())
    with pytest.raises(ValueError, match="cannot hold"):
        kernel.sigmoid_gate(torch.empty(2, 8, dtype=torch.bfloat16), x, 2, 4)


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
@pytest.mark.parametrize("groups", [(1, 1), (8, 3), (4, 2), (16, 4)])
@pytest.mark.parametrize("biased", [True, False])
def test_native_biased_topk_is_the_reference(scoring, groups, biased):
    # biased_topk_reference's choice (the same ids, ties to the lower id: bf16 logits tie
    # often) and weights to float32's last places (another order of the renorm's sum)
    from triton_kernels.routing import biased_topk_reference
    kernel = tk.native_kernels()
    g = torch.Generator().manual_seed(groups[0])
    n_group, keep = groups
    for renorm, scale in ((True, 2.5), (False, 1.0)):
        logits = torch.randn(9, 64, generator=g).bfloat16()
        bias = torch.randn(64, generator=g) * 0.1 if biased else None
        kw = dict(bias=bias, scoring=scoring, n_group=n_group, topk_group=keep,
                  renormalize=renorm, scale=scale)
        w, ids = kernel.topk_biased(logits, 6, **kw)
        rw, rids = biased_topk_reference(logits, 6, **kw)
        assert torch.equal(ids, rids)
        torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-7)
    # weights rounded to the model's dtype in the op, as Router.route's cast rounds them
    out_w, out_ids = torch.empty(9, 6), torch.empty(9, 6, dtype=torch.int64)
    from triton_kernels.cpu_program import CpuProgram
    prog = CpuProgram(kernel, 9)
    prog.add(kernel.topk_biased_op(logits, 6, out_w, out_ids, round_to=torch.bfloat16, **kw),
             "routing")
    prog.run(9)
    assert torch.equal(out_ids, ids) and torch.equal(out_w, w.bfloat16().float())
    with pytest.raises(ValueError, match="groups dividing"):
        kernel.topk_biased(logits, 6, **{**kw, "n_group": 5})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_program_gathers_the_embedding_and_widens_the_logits(dtype):
    # A decode program's first and last ops: the step's token ids are data (rows of the
    # table gathered natively) and its logits end in float32, each the torch op's values;
    # an id outside the table fails the run, naming the op, before it writes a row
    from triton_kernels.cpu_program import CpuProgram
    kernel = tk.native_kernels()
    g = torch.Generator().manual_seed(6)
    table = (torch.randn(50, 24, generator=g) * 300).to(dtype)
    table[7, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    ids = torch.zeros(5, dtype=torch.int64)
    rows = torch.zeros(5, 24, dtype=dtype)
    logits = torch.zeros(5, 24 * 700)        # (rows past 16K values: the threads' parts)
    wide = (torch.randn(5, 24 * 700, generator=g) * 1e4).to(dtype)
    prog = CpuProgram(kernel, 5)
    prog.add(kernel.embed_op(table, ids, rows), "the embedding")
    prog.add(kernel.widen_op(wide, logits), "the logits' widening")
    ids[:4] = torch.tensor([7, 0, 49, 7])
    prog.run(4)
    assert torch.equal(rows[:4].view(torch.int16), table[ids[:4]].view(torch.int16))
    assert torch.equal(rows[4], torch.zeros(24, dtype=dtype))           # past the run's rows
    assert torch.equal(logits[:4], wide[:4].float()) and not logits[4].any()
    before = rows.clone()
    ids[1] = 50
    with pytest.raises(ValueError, match="the embedding: a token id outside the vocabulary"):
        prog.run(2)
    assert torch.equal(rows.view(torch.int16), before.view(torch.int16))
    with pytest.raises(ValueError, match="native embed"):
        kernel.embed_op(table, ids.int(), rows)
    with pytest.raises(ValueError, match="native widen"):
        kernel.widen_op(logits, logits)


def test_native_whole_width_steps_are_the_norms_and_clamp_bits():
    # q and k normed across their heads as RMSNorm's native call norms them (the same bits),
    # then q, k and v clamped as torch clamps 16-bit tensors: the limit rounded first (8.3 is
    # 8.3125 in bf16), the columns past v untouched
    kernel = tk.native_kernels()
    g = torch.Generator().manual_seed(5)
    nq, nk = 64, 32
    qkv = (torch.randn(3, nq + 2 * nk + 8, generator=g) * 9).bfloat16()
    wq, wk = (torch.randn(n, generator=g).bfloat16() for n in (nq, nk))
    got = kernel.qkv_whole(qkv.clone(), nq, nk, (wq, wk), 1e-6, 8.3)
    q = kernel.bind_rms_norm(wq, 1e-6)(qkv[:, :nq])
    k = kernel.bind_rms_norm(wk, 1e-6)(qkv[:, nq:nq + nk])
    want = torch.cat([q, k, qkv[:, nq + nk:nq + 2 * nk]], dim=1).clamp(-8.3, 8.3)
    assert torch.equal(got[:, :nq + 2 * nk], want)
    assert torch.equal(got[:, nq + 2 * nk:], qkv[:, nq + 2 * nk:])
    assert (want.abs() == 8.3125).any()                 # the limit reached, as rounded
