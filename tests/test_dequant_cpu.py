"""The CPU experts' decode (triton_kernels/dequant_cpu.py) equals dequantize_reference bit for
bit in every compute dtype and format, ragged fp8 blocks included; fused_moe_quant_cpu equals fused_moe_quant_reference
with its buffers reused across experts and calls (to bf16's rounding: fp8 keeps the scales out
of the weight up to FOLD_ROWS rows, the 4-bit formats sum the columns in another order); fp8's
scaled products are float32-exact and do not overflow where the result is finite."""

import pytest
import torch

from test_kernels import assert_close
from test_kernels_dequant import FORMATS, random_weight
from triton_kernels.dequant import QuantFormat, dequantize_reference, fused_moe_quant_reference
from triton_kernels.dequant_cpu import Decoder, fused_moe_quant_cpu
from triton_kernels.fused_moe import SILU, SWIGLU_OAI

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ALL = dict(FORMATS, fp8_block_ragged=QuantFormat("fp8_block", block=(16, 48)),
           int4_bf16=QuantFormat("int4", group=32))


def _weight(name, lead, n, k):
    w = random_weight(ALL[name], lead, n, k)
    if name == "int4_bf16":
        w["s"] = w["s"].to(torch.bfloat16)
    return w


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", list(ALL))
def test_decode_equals_the_reference_bit_for_bit(name, dtype):
    torch.manual_seed(3)
    dec = Decoder(ALL[name], dtype)

    k = 100 if name.endswith("ragged") else 192          # ragged: K % 48 != 0
    for n in (64, 40):                                 # a second shape: a buffer of its own
        w = _weight(name, (), n, k)
        got = dec.decode(w)
        want = dequantize_reference(ALL[name], w, dtype)
        assert got.dtype == dtype and torch.equal(got, want), name
    again = dec.decode(w)                              # the same buffer, rewritten
    assert again.data_ptr() == got.data_ptr() and torch.equal(again, want)


def routed_batch(t, d, inter, e, k, pool, act):
    """x [t, d] bf16, top-k routing over e experts mapped into a pool of slots, bf16 biases:
    (x, weights, ids, slot_map, keyword arguments)."""
    x = torch.randn(t, d).bfloat16()
    weights, ids = torch.topk(torch.randn(t, e).softmax(-1), k, dim=-1)
    slot_map = torch.randperm(pool)[:e]
    kw = dict(b13=torch.randn(pool, 2 * inter).bfloat16(), b2=torch.randn(pool, d).bfloat16(),
              activation=act)
    return x, weights, ids, slot_map, kw


@pytest.mark.parametrize("t", [1, 7])          # batch 1: the k experts' rest done once
@pytest.mark.parametrize("name", ["fp8_block", "mxfp4", "nvfp4", "int4", "int4_sym"])
def test_fused_moe_quant_cpu_equals_the_reference(name, t):
    torch.manual_seed(4)
    fmt = ALL[name]
    d, inter, e, k, pool = 64, 64, 6, 2, 9
    w13, w2 = _weight(name, (pool,), 2 * inter, d), _weight(name, (pool,), d, inter)
    dec = Decoder(fmt, torch.bfloat16)
    for act in (SILU, SWIGLU_OAI):
        x, weights, ids, slot_map, kw = routed_batch(t, d, inter, e, k, pool, act)
        got = fused_moe_quant_cpu(x, fmt, w13, w2, weights, ids, slot_map, decoder=dec, **kw)
        want = fused_moe_quant_reference(x, fmt, w13, w2, weights, ids, slot_map, **kw)
        assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2, what=name)


FP8 = ["fp8_block", "fp8_block_ragged", "fp8_channel", "fp8_tensor"]


def _exact(x, fmt, w):
    return x.double() @ dequantize_reference(fmt, w, torch.float32).double().T


def _within(got, x, fmt, w, rel):
    """|got - x @ W^T| <= rel * (|x| @ |W|^T): rel of the terms' magnitude (a sum may cancel)."""
    deq = dequantize_reference(fmt, w, torch.float32).double()
    bound = rel * (x.double().abs() @ deq.abs().T)
    return bool(((got.double() - x.double() @ deq.T).abs() <= bound).all())


@pytest.mark.parametrize("name", FP8)
def test_fp8_products_are_float32_exact(name):
    # Up to FOLD_ROWS rows the scales multiply x (per block) or the sums (per row, tensor),
    # never the weight: the float32 result is the float64 product to float32's precision,
    # at 1 row, a few and FOLD_ROWS (the ragged blocks take the decoded, scaled weight).
    from triton_kernels.dequant_cpu import FOLD_ROWS
    torch.manual_seed(8)
    fmt = ALL[name]
    w = _weight(name, (), 64, 100 if name.endswith("ragged") else 192)
    for t in (1, 3, FOLD_ROWS):
        x = torch.randn(t, w["q"].shape[1])
        got = Decoder(fmt, torch.float32).linear(x, w)
        assert got.dtype == torch.float32 and got.shape == (t, 64)
        assert _within(got, x, fmt, w, 2.0 ** -20), f"{name} {t}"
        got16 = Decoder(fmt, torch.bfloat16).linear(x.bfloat16(), w)   # bf16's roundings
        assert got16.dtype == torch.bfloat16 and _within(got16, x.bfloat16(), fmt, w, 2.0 ** -7)
        strided = Decoder(fmt, torch.float32).linear(x.T.contiguous().T, w)  # transposed x
        assert _within(strided, x, fmt, w, 2.0 ** -20)


@pytest.mark.parametrize("name", ["fp8_block", "fp8_channel", "fp8_tensor"])
def test_fp8_products_do_not_overflow_where_the_result_is_finite(name):
    # x 2^120 (the bytes decode to value / 2^120) would overflow for |x| >= 256: the power
    # applied to x shrinks to fit (x s, for blocks), the rest goes on the sums in float64.
    # Huge x with a scale of 1000, tiny x; inf in x still reaches its row's outputs.
    torch.manual_seed(9)
    fmt = ALL[name]
    w = _weight(name, (), 32, 64)
    w["s"] = torch.full_like(w["s"], 1000.0)
    for magnitude in (1e28, 1e-30):
        x = torch.randn(2, 64) * magnitude
        want = _exact(x, fmt, w)
        assert torch.isfinite(want).all()
        got = Decoder(fmt, torch.float32).linear(x, w)
        assert _within(got, x, fmt, w, 2.0 ** -20), f"{name} {magnitude}"
    x = torch.randn(2, 64)
    x[1, 5] = float("inf")
    got = Decoder(fmt, torch.float32).linear(x, w)
    assert torch.isfinite(got[0]).all() and not torch.isfinite(got[1]).any()
    # Huge x with a tiny scale: x q overflows float32, x q s does not.
    w["q"] = torch.full_like(w["q"], 448.0, dtype=torch.float32).to(torch.float8_e4m3fn)
    w["s"] = torch.full_like(w["s"], 1e-5)
    x = torch.full((1, 64), 1e37)
    assert _within(Decoder(fmt, torch.float32).linear(x, w), x, fmt, w, 2.0 ** -20), name


def test_fp8_block_scales_of_zero_inf_and_huge():
    # All-zero scales give zeros; an inf scale reaches only its own row block's outputs (as
    # in the reference); x s beyond 2^134 with zero products stays 0, not inf * 0.
    fmt = ALL["fp8_block"]                                 # 16 x 32 blocks
    torch.manual_seed(10)
    w = _weight("fp8_block", (), 64, 128)
    zero = dict(w, s=torch.zeros_like(w["s"]))
    assert torch.equal(Decoder(fmt, torch.float32).linear(torch.randn(2, 128), zero),
                       torch.zeros(2, 64))
    bad = dict(w, s=w["s"].clone())
    bad["s"][1, 0] = float("inf")                          # rows 16-31
    x = torch.randn(1, 128)
    got = Decoder(fmt, torch.float32).linear(x, bad)
    assert torch.equal(torch.isfinite(got), torch.isfinite(_exact(x, fmt, bad)))
    assert torch.isfinite(got[0, :16]).all() and torch.isfinite(got[0, 32:]).all()
    huge = dict(w, q=w["q"].clone(), s=torch.full_like(w["s"], 1e10))
    huge["q"][:, :64] = 0
    x = torch.zeros(1, 128)
    x[0, :64] = 1e30
    assert torch.equal(Decoder(fmt, torch.float32).linear(x, huge), torch.zeros(1, 64))


def test_large_scales_do_not_overflow_the_folded_power_of_two():
    # The decode leaves e4m3 values / 2^120 and folds the power into the scale: a scale of
    # 1000 must not overflow; nor e4m3's largest, 448, as an nvfp4 group scale.
    torch.manual_seed(5)
    for fmt, big in ((QuantFormat("fp8_channel"), 1000.0), (QuantFormat("nvfp4"), 448.0)):
        w = random_weight(fmt, (), 32, 64)
        w["s"] = torch.full_like(w["s"], big, dtype=torch.float32).to(w["s"].dtype)
        for dtype in DTYPES:
            want = dequantize_reference(fmt, w, dtype)
            got = Decoder(fmt, dtype).decode(w)
            assert torch.equal(got, want) and torch.isfinite(want).all(), (fmt.kind, dtype)


@pytest.mark.parametrize("name", ["fp8_block", "fp8_channel", "nvfp4", "int4"])
def test_linear_in_row_tiles_equals_one_piece(name, monkeypatch):
    # Weights larger than a tile are decoded a tile of whole rows (whole scale blocks) at a
    # time: 40 rows of 192 columns in tiles of 16 rows, a ragged last tile.
    import triton_kernels.dequant_cpu as dc
    torch.manual_seed(6)
    w = _weight(name, (), 40, 192)
    x = torch.randn(3, 192)
    whole = Decoder(ALL[name], torch.float32).linear(x, w)
    monkeypatch.setattr(dc, "TILE_ELEMENTS", 16 * 192)
    tiled = Decoder(ALL[name], torch.float32).linear(x, w)
    assert torch.equal(tiled, whole)
    want = x @ dequantize_reference(ALL[name], w).T
    assert_close(tiled, want, atol=1e-5, rtol=1e-5, what=name)


@pytest.mark.parametrize("name", ["fp8_block", "mxfp4", "int4"])
def test_many_rows_multiply_the_decoded_weights_widened(name):
    # A prefill chunk's rows, multiplied in float32 (cpu_matmul.py): fp8's weight decoded and
    # rounded to bf16 as the reference does; the 4-bit formats' float32 values as decoded
    # (the reference's before it rounds them: INT4's (q - z) * s is not a bf16).
    from triton_kernels.cpu_matmul import WIDE_ROWS
    from triton_kernels.dequant_cpu import FOLD_ROWS
    torch.manual_seed(7)
    w = _weight(name, (), 64, 192)
    rows = max(WIDE_ROWS, FOLD_ROWS + 1 if name.startswith("fp8") else 0) + 4
    x = torch.randn(rows, 192).bfloat16()
    got = Decoder(ALL[name], torch.bfloat16).linear(x, w)
    rounded = torch.float32 if ALL[name].packed else torch.bfloat16
    deq = dequantize_reference(ALL[name], w, rounded).float()
    assert torch.equal(got, torch.nn.functional.linear(x.float(), deq).bfloat16())
