"""Quantized weights (FP8 block/channel/tensor, MXFP4, NVFP4, INT4): dequantize_reference
against decodes written out here bit by bit, and the dequantizing Triton kernels (quant_linear,
both fused_moe_quant forms) against the torch references. Interpreter on CPU (float32,
float16 compute), compiled kernels on a GPU, as in test_kernels.py."""

import math

import pytest
import torch

import triton_kernels as tk
from test_kernels import DTYPES, TOL_ACCUM, _kernel_device, _seed, assert_close  # noqa: F401
from triton_kernels.dequant import (QuantFormat, dequantize_reference, e8m0_to_float,
                                    fused_moe_quant_reference, quant_linear_reference,
                                    weight_shape)
from triton_kernels.fused_moe import SILU, SWIGLU_OAI, fused_moe_reference
from triton_kernels.quant_matmul import quant_linear_triton
from triton_kernels.quant_moe import fused_moe_quant_triton

pytestmark = pytest.mark.usefixtures("kernel_device")

FORMATS = {
    # Non-square, so a swapped row/column block size fails (the decode tests use (16, 16)).
    # The interpreter's K tiles are 32 wide: one scale column per tile here (the kernels' vector
    # path); "fp8_block_odd" (48-wide blocks) the per-column gather.
    "fp8_block": QuantFormat("fp8_block", block=(16, 32)),
    "fp8_channel": QuantFormat("fp8_channel"),
    "fp8_tensor": QuantFormat("fp8_tensor"),
    "mxfp4": QuantFormat("mxfp4"),
    "nvfp4": QuantFormat("nvfp4"),
    "int4": QuantFormat("int4", group=32),
    "int4_sym": QuantFormat("int4", group=64, symmetric=True),
}


# ---- decodes written out bit by bit (independent of the module's tables) --------------------

def e2m1(nibble: int) -> float:
    sign = -1.0 if nibble & 8 else 1.0
    e, m = (nibble >> 1) & 3, nibble & 1
    return sign * (m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2))


def e4m3(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 15, byte & 7
    if e == 15 and m == 7:
        return math.nan
    return sign * (m / 8 * 2.0 ** -6 if e == 0 else 2.0 ** (e - 7) * (1 + m / 8))


def fp8(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8).view(torch.float8_e4m3fn)


def test_e2m1_nibble_order_and_values():
    # Byte 0x2F: element 0 is the low nibble 0xF (-6.0), element 1 the high nibble 0x2 (1.0).
    q = torch.zeros(2, 16, dtype=torch.uint8)
    q[0, 0] = 0x2F
    q[1] = torch.tensor([(j << 4) | (15 - j) for j in range(16)], dtype=torch.uint8)
    s = torch.tensor([[127], [128]], dtype=torch.uint8)          # factors 1 and 2
    w = dequantize_reference(QuantFormat("mxfp4"), {"q": q, "s": s}, torch.float64)
    assert w[0, 0] == -6.0 and w[0, 1] == 1.0 and (w[0, 2:] == 0).all()
    want = [2 * e2m1(15 - j if i % 2 == 0 else j) for j in range(16) for i in range(2)]
    assert w[1].tolist() == want
    assert sorted({abs(e2m1(n)) for n in range(16)}) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def test_e8m0_extremes():
    s = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    got = e8m0_to_float(s)
    assert got.dtype == torch.float32
    for byte, value in zip(s.tolist(), got.tolist()):
        if byte == 255:
            assert math.isnan(value)
        else:
            assert value == math.ldexp(1.0, byte - 127), (byte, value)
    # Through a weight: 0.5 * 2^127 and 6 * 2^-127 stay exact in float32.
    q = torch.tensor([[0x01] + [0] * 15, [0x07] + [0] * 15], dtype=torch.uint8)   # 0.5; 6.0
    w = dequantize_reference(QuantFormat("mxfp4"), {"q": q, "s": torch.tensor([[254], [0]],
                                                                             dtype=torch.uint8)})
    assert w[0, 0].item() == math.ldexp(0.5, 127) and w[1, 0].item() == math.ldexp(6.0, -127)


def test_nvfp4_decodes_e4m3_scales_and_global_multiplier():
    scale_bytes = [0x38, 0x40, 0x01, 0x7E, 0x33]                # 1, 2, 2^-9, 448, 0.6875
    k = 16 * len(scale_bytes)
    q = torch.randint(0, 256, (3, k // 2), dtype=torch.uint8)
    s = fp8(scale_bytes * 3).reshape(3, len(scale_bytes))
    g = torch.tensor([0.375])
    w = dequantize_reference(QuantFormat("nvfp4"), {"q": q, "s": s, "g": g}, torch.float64)
    assert [e4m3(b) for b in scale_bytes] == [1.0, 2.0, 2.0 ** -9, 448.0, 0.6875]
    for n in range(3):
        for c in range(k):
            byte = int(q[n, c // 2])
            nibble = byte & 0xF if c % 2 == 0 else byte >> 4
            want = e2m1(nibble) * e4m3(scale_bytes[c // 16]) * 0.375
            assert w[n, c].item() == pytest.approx(want, rel=1e-7), (n, c)


@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_zero_points_and_nibble_order(symmetric):
    fmt = QuantFormat("int4", group=32, symmetric=symmetric)
    q = torch.randint(0, 256, (2, 32), dtype=torch.uint8)             # K = 64: two groups
    q[0, 0] = 0x2F
    s = torch.tensor([[0.5, -2.0], [0.25, 3.0]], dtype=torch.float16)
    w = {"q": q, "s": s}
    if not symmetric:
        w["z"] = torch.tensor([[3, 0], [15, 8]], dtype=torch.uint8)
    got = dequantize_reference(fmt, w, torch.float64)
    zero = 8 if symmetric else 3
    assert got[0, 0] == (15 - zero) * 0.5 and got[0, 1] == (2 - zero) * 0.5
    for n in range(2):
        for c in range(64):
            byte = int(q[n, c // 2])
            nibble = byte & 0xF if c % 2 == 0 else byte >> 4
            z = 8 if symmetric else int(w["z"][n, c // 32])
            assert got[n, c] == (nibble - z) * float(s[n, c // 32]), (n, c)


def test_fp8_kinds_known_bytes_ragged_blocks_and_leading_dims():
    # fp8_block with N, K not multiples of the (16, 16) block: the last tiles are cut off.
    n, k = 40, 36
    raw = torch.randint(0, 256, (2, n, k), dtype=torch.uint8)
    raw[raw & 0x7F == 0x7F] = 0x38                                     # no NaN bytes
    raw[0, 0, :4] = torch.tensor([0x38, 0xB8, 0x01, 0x7E], dtype=torch.uint8)
    s = torch.exp2(torch.randint(-5, 6, (2, 3, 3)).float()) * (1 + torch.rand(2, 3, 3))
    w = dequantize_reference(QuantFormat("fp8_block", block=(16, 16)),
                             {"q": raw.view(torch.float8_e4m3fn), "s": s}, torch.float64)
    assert w.shape == (2, n, k)
    assert w[0, 0, :4].tolist() == pytest.approx(
        [float(s[0, 0, 0]) * v for v in (1.0, -1.0, 2.0 ** -9, 448.0)], rel=1e-7)
    for e, r, c in [(0, 39, 35), (1, 16, 15), (1, 31, 32), (0, 15, 16), (1, 33, 2)]:
        want = e4m3(int(raw[e, r, c])) * float(s[e, r // 16, c // 16])
        assert w[e, r, c].item() == pytest.approx(want, rel=1e-7), (e, r, c)
    q = raw.view(torch.float8_e4m3fn)
    sc = torch.rand(2, n) + 0.5
    w = dequantize_reference(FORMATS["fp8_channel"], {"q": q, "s": sc}, torch.float64)
    assert w[1, 7, 5].item() == pytest.approx(e4m3(int(raw[1, 7, 5])) * float(sc[1, 7]), rel=1e-7)
    st = torch.tensor([[0.25], [3.0]])
    w = dequantize_reference(FORMATS["fp8_tensor"], {"q": q, "s": st}, torch.float64)
    assert w[1, 3, 9].item() == e4m3(int(raw[1, 3, 9])) * 3.0
    assert w[0, 0, :2].tolist() == [0.25, -0.25]


def test_bad_weights_are_rejected():
    q4 = torch.zeros(8, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="kind"):
        QuantFormat("fp6")
    with pytest.raises(ValueError, match="group"):
        QuantFormat("int4", group=48)
    with pytest.raises(ValueError, match=r"\['q', 's', 'z'\]"):
        weight_shape(QuantFormat("int4", group=32), {"q": q4, "s": torch.ones(8, 2)})
    with pytest.raises(ValueError, match="'s' must be"):
        weight_shape(QuantFormat("mxfp4"), {"q": q4, "s": torch.ones(8, 2)})   # not uint8
    with pytest.raises(ValueError, match="K % 32"):
        weight_shape(QuantFormat("mxfp4"), {"q": q4[:, :24], "s": q4[:, :1]})
    with pytest.raises(ValueError, match="q must be"):
        weight_shape(QuantFormat("fp8_tensor"), {"q": q4, "s": torch.ones(1)})
    with pytest.raises(ValueError, match=r"'s' must be \[2, 3\]"):
        weight_shape(QuantFormat("fp8_block", block=(4, 16)),
                     {"q": torch.zeros(7, 40).to(torch.float8_e4m3fn), "s": torch.ones(2, 2)})
    with pytest.raises(ValueError, match="quant_linear"):
        quant_linear_reference(torch.randn(3, 48), QuantFormat("mxfp4"),
                               {"q": q4, "s": q4[:, :2]})


# ---- random quantized weights with scales that jump between neighbouring blocks -------------

def random_weight(fmt: QuantFormat, lead: tuple, n: int, k: int) -> dict:
    """Random tensors for W [*lead, n, k] with entries of size ~1 / sqrt(k); every scale (per
    block, row or group) is a random power of two in [2^-2, 2^2] times a random mantissa, so
    neighbouring blocks differ up to 32-fold. The divisors undo the elements' RMS (e2m1 ~2.9,
    int4 q - z ~6.5) and the scales' (~2)."""
    def jumpy(shape):
        return torch.exp2(torch.randint(-2, 3, shape).float()) * (0.5 + torch.rand(shape))
    bn, bk = fmt.block
    norm = k ** -0.5
    if fmt.kind.startswith("fp8"):
        q = torch.randn(*lead, n, k).to(torch.float8_e4m3fn)
        s_shape = {"fp8_block": (math.ceil(n / bn), math.ceil(k / bk)), "fp8_channel": (n,),
                   "fp8_tensor": (1,)}[fmt.kind]
        return {"q": q, "s": jumpy(lead + s_shape) * norm / 2}
    q = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8)
    groups = lead + (n, k // fmt.group_k)
    if fmt.kind == "mxfp4":                   # pure powers of two: 2^(s - 127)
        s = 127 + round(math.log2(norm / 2.9)) + torch.randint(-2, 3, groups)
        return {"q": q, "s": s.to(torch.uint8)}
    if fmt.kind == "nvfp4":
        return {"q": q, "s": jumpy(groups).to(torch.float8_e4m3fn),
                "g": norm / 6 * (0.5 + torch.rand(lead + (1,)))}
    w = {"q": q, "s": (jumpy(groups) * norm / 13).to(torch.float16)}
    if not fmt.symmetric:
        w["z"] = torch.randint(0, 16, groups, dtype=torch.uint8)
    return w


def test_fused_moe_quant_reference_equals_the_dense_reference():
    # Decoding one expert at a time must give fused_moe_reference on the whole decoded bank.
    t, d, inter, e, k, pool = 6, 64, 32, 6, 2, 9
    for name in ("fp8_block", "nvfp4", "int4"):
        fmt = FORMATS[name]
        w13, w2 = random_weight(fmt, (pool,), 2 * inter, d), random_weight(fmt, (pool,), d, inter)
        x = torch.randn(t, d)
        weights, ids = torch.topk(torch.randn(t, e).softmax(-1), k, dim=-1)
        slot_map = torch.randperm(pool)[:e]
        b13, b2 = torch.randn(pool, 2 * inter), torch.randn(pool, d)
        for act in (SILU, SWIGLU_OAI):
            kw = dict(b13=b13, b2=b2, activation=act)
            got = fused_moe_quant_reference(x, fmt, w13, w2, weights, ids, slot_map, **kw)
            want = fused_moe_reference(x, dequantize_reference(fmt, w13), dequantize_reference(
                fmt, w2), weights, ids, slot_map, **kw)
            assert_close(got, want, atol=0, rtol=0, what=f"{name} {act.kind}")


# ---- Triton kernels (interpreter on CPU) against the references ----------------------------

def _shapes(name):
    # fp8: N, K, I off the blocks (D 72, I 40: gate/up halves meet inside a scale block);
    # 4-bit: K a whole number of groups (int4_sym's are 64 wide).
    return (72, 40) if name.startswith("fp8") else (64, 64)


# float32 and float16 compute alternate over the formats to keep the interpreter's time down.
CASES = [(name, DTYPES[i % 2]) for i, name in enumerate(FORMATS)]
FORMATS_LINEAR = dict(FORMATS, fp8_block_odd=QuantFormat("fp8_block", block=(32, 48)))
LINEAR_CASES = CASES + [("fp8_block_odd", DTYPES[0])]
# The MoE kernels share the decode with quant_linear: int4 runs there asymmetric only.
MOE_CASES = [case for case in CASES if case[0] != "int4_sym"]


@pytest.mark.parametrize("name,dtype", LINEAR_CASES,
                         ids=[f"{n}-{str(d)[6:]}" for n, d in LINEAR_CASES])
def test_quant_linear_matches_reference(name, dtype):
    fmt = FORMATS_LINEAR[name]
    k, n = _shapes(name)
    w = random_weight(fmt, (), n, k)
    bias = torch.randn(n).to(dtype)
    for t, path in ((3, "gemv"), (20, "gemm")):
        x = torch.randn(t, k).to(dtype)
        got = quant_linear_triton(x, fmt, w, bias, path=path)
        assert_close(got, quant_linear_reference(x, fmt, w, bias), **TOL_ACCUM[dtype],
                     what=f"{name} {path}")


@pytest.mark.parametrize("path", ["gemv", "grouped"])
@pytest.mark.parametrize("name,dtype", MOE_CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in MOE_CASES])
def test_fused_moe_quant_matches_reference(name, dtype, path):
    fmt = FORMATS[name]
    d, inter = _shapes(name)
    t, e, k, pool = (3 if path == "gemv" else 10), 6, 2, 9
    w13, w2 = random_weight(fmt, (pool,), 2 * inter, d), random_weight(fmt, (pool,), d, inter)
    x = torch.randn(t, d).to(dtype)
    weights, ids = torch.topk(torch.randn(t, e).softmax(-1), k, dim=-1)
    slot_map = torch.randperm(pool)[:e]
    b13, b2 = torch.randn(pool, 2 * inter).to(dtype), (0.5 * torch.randn(pool, d)).to(dtype)
    kw = dict(b13=b13, b2=b2, activation=SWIGLU_OAI if len(name) % 2 else SILU)
    got = fused_moe_quant_triton(x, fmt, w13, w2, weights, ids, slot_map, **kw, path=path)
    want = fused_moe_quant_reference(x, fmt, w13, w2, weights, ids, slot_map, **kw)
    assert_close(got, want, **TOL_ACCUM[dtype], what=f"{name} {path}")


def test_kernels_decode_e8m0_extremes_and_bfloat16_scales():
    # x = I makes the GEMM's output W^T exactly: rows with 2^-127 (kept on CPU, where nothing
    # flushes subnormals), 2^-126, 2^127 (elements |v| <= 1, still finite) and NaN scales.
    fmt = QuantFormat("mxfp4")
    exps = [1, 254, 255, 127] + ([] if torch.cuda.is_available() else [0])
    q = torch.randint(0, 256, (len(exps), 16), dtype=torch.uint8)
    small = torch.tensor([0, 1, 2, 8, 9, 10], dtype=torch.uint8)
    q[1] = small[torch.randint(0, 6, (16,))] | (small[torch.randint(0, 6, (16,))] << 4)
    w = {"q": q, "s": torch.tensor(exps, dtype=torch.uint8)[:, None]}
    got = quant_linear_triton(torch.eye(32), fmt, w, path="gemm")
    want = dequantize_reference(fmt, w).T
    assert torch.isinf(want).sum() == 0 and torch.isnan(want[:, 2]).all()
    assert_close(got, want, atol=0, rtol=0, what="mxfp4 extremes")
    # bfloat16 int4 scales reach the kernel as their bits (the interpreter cannot load bf16).
    fmt = QuantFormat("int4", group=32)
    w = random_weight(fmt, (), 24, 64)
    w["s"] = w["s"].to(torch.bfloat16)
    x = torch.randn(2, 64)
    assert_close(quant_linear_triton(x, fmt, w, path="gemv"), quant_linear_reference(x, fmt, w),
                 **TOL_ACCUM[torch.float32], what="int4 bf16 scales")


def test_public_ops_dispatch_and_launchers_reject_bad_layouts():
    fmt = FORMATS["nvfp4"]
    w13, w2 = random_weight(fmt, (4,), 64, 32), random_weight(fmt, (4,), 32, 32)
    x = torch.randn(2, 32)
    weights, ids = torch.topk(torch.randn(2, 4).softmax(-1), 2, dim=-1)
    want = fused_moe_quant_reference(x, fmt, w13, w2, weights, ids)
    lin = random_weight(fmt, (), 16, 32)
    for backend in ("triton", "reference"):
        with tk.kernel_backend(backend):
            assert_close(tk.fused_moe_quant(x, fmt, w13, w2, weights, ids), want,
                         **TOL_ACCUM[torch.float32], what=backend)
            assert_close(tk.quant_linear(x, fmt, lin), quant_linear_reference(x, fmt, lin),
                         **TOL_ACCUM[torch.float32], what=backend)
    strided = dict(lin, s=lin["s"].t().contiguous().t())
    with pytest.raises(ValueError, match="contiguous"):
        quant_linear_triton(x, fmt, strided)
    with pytest.raises(ValueError, match="path"):
        fused_moe_quant_triton(x, fmt, w13, w2, weights, ids, path="dense")
    with pytest.raises(ValueError, match="w2"):
        fused_moe_quant_triton(x, fmt, w13, random_weight(fmt, (4,), 32, 48), weights, ids)
