"""Quantized weights decoded on the CPU: a tile of whole rows at a time, into reused buffers.

dequant.dequantize_reference decodes in float32 with each scale spread to [N, K] first
(repeat_interleave): ~20 bytes of memory traffic per weight, fine for an oracle and 13-25x
slower than a bf16 expert when the CPU experts ran on it. Here a tile of rows (TILE_ELEMENTS
weights, whole scale blocks) is decoded into an int32 buffer whose float32 view holds the
values, in passes of torch's vectorized integer and float loops:

    fp8_*  bits <- q as int8 (sign-extended); << 20; & sign|7 bits  -> value / 2^120
           value *= s * 2^120                          (per block / row / tensor, as views)
    4-bit  pairs <- table[q]: one gather, each byte -> its two values as float32 (the low
           nibble is element 2j), the buffer seen as int64 [N, K/2]
      e2m1   *= scale per group (mxfp4: 2^(e - 127); nvfp4: * s then * g, as the reference)
      int4   the table holds q - 8 (or q, then -= z); *= s per group
    then the float32 tile is rounded once to the compute dtype.

Each value equals dequantize_reference's bit for bit (the same float32 products, one
rounding). Ragged fp8 blocks (N or K off the block; experts pad theirs) take the reference.
A tile of many rows' product is widened to float32 (cpu_matmul.py); the 4-bit formats' products
take the float32 values at every row count (as fast at one row as rounding them and a bf16
GEMV; INT4 with zero points and NVFP4 then skip the reference's rounding of the weight).
One MoE layer (bench/cpu_moe.py's, in-process A/B against the shift-and-mask decode that
built the 4-bit bits in 8 passes): 1.5-1.8x at 1 token, 1.4-1.6x at 8-16, 1.2-1.5x at 64.

fp8 products of up to FOLD_ROWS rows skip the scale multiply and the rounding: the bits'
float32 values (value / 2^120) are the operand of a float32 product, and the scales multiply
x (per block) or the sums (per row): two of the five passes a weight gone, and float32's
GEMV (~2x bf16's bytes a second on AVX2). One layer of 64 experts (bench/cpu_moe.py), 1 and
8 tokens: 1.25-1.6x the decode-then-multiply path, still ~3x bf16 experts (the three passes
a weight cost more than reading bf16). Those results are sums of x s q to float32's
rounding, nearer the exact product than the reference's (which rounds q s to the compute
dtype first), so not bit-equal to it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from triton_kernels.dequant import (E2M1_VALUES, QuantFormat, _check_linear, _check_moe,
                                    _expert, dequantize_reference, e8m0_to_float, weight_shape)
from triton_kernels.cpu_matmul import Fp16Bank, widens
from triton_kernels.cpu_native import NativeBank, NativeFp8Bank, NativeInt4Bank
from triton_kernels.fused_moe import (SILU, MoeActivation, _activate, fused_moe_reference,
                                      moe_one_token)
from triton_kernels.int4_cpu import Int4Packed, fused_moe_int4_cpu


F32_E4M3 = 2.0 ** 120     # an e4m3 byte's bits moved into float32's give its value / 2^120
SIGN_E4M3 = -0x78100000   # 0x87F00000 as int32: the sign and e4m3's seven bits at 20-26


TILE_ELEMENTS = 1 << 20   # weights decoded at a time: 4 MB of int32 bits + the output tile
FP32_MAX = torch.finfo(torch.float32).max
FOLD_ROWS = 128           # up to this many rows, fp8 products keep the scales out of the weight
                          # (from 512 rows the scaled weight in one GEMM was faster: 0.74-0.86x)


class Decoder:
    """Decodes weights of one format into reused buffers, in one compute dtype: one per
    call of the CPU experts or a dense layer, its buffers reused across the tiles and experts
    of that call.

    Every pass is one of torch's vectorized CPU loops: 8-bit to int32/int64 copies, int32
    shifts and masks, a gather, float32 multiplies, the float32 to bf16 copy (8-bit to float
    conversions and mixed-dtype multiplies are scalar loops on the CPU, ~30x slower). An fp8
    byte's float32 bits are built as the Triton kernels build them (dequant._e4m3_to_f32):
    exact, subnormals included; the power of two that leaves is folded into the scale
    multiply. A 4-bit byte's two values come from a table (_pairs)."""

    def __init__(self, fmt: QuantFormat, dtype: torch.dtype):
        self.fmt, self.dtype = fmt, dtype
        self._bits: dict[tuple[int, int], torch.Tensor] = {}
        self._out: dict[tuple[int, int], torch.Tensor] = {}
        self._indices: dict[tuple[int, int], torch.Tensor] = {}
        self._tables: dict[bool, torch.Tensor] = {}

    def _buffers(self, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(int32 [N, K] bits, whose float32 view is decoded in place; the [N, K] output in
        self.dtype: the same memory when that is float32)."""
        bits = self._bits.get((n, k))
        if bits is None:
            bits = self._bits[(n, k)] = torch.empty(n, k, dtype=torch.int32)
            self._out[(n, k)] = (bits.view(torch.float32) if self.dtype == torch.float32
                                 else torch.empty(n, k, dtype=self.dtype))
        return bits, self._out[(n, k)]

    def _index(self, n: int, half: int) -> torch.Tensor:
        """A reused int64 [N, K/2]: a 4-bit weight's bytes, as gather's index."""
        index = self._indices.get((n, half))
        if index is None:
            index = self._indices[(n, half)] = torch.empty(n, half, dtype=torch.int64)
        return index

    def _pairs(self, fmt: QuantFormat, zero_point: bool) -> torch.Tensor:
        """int64 [1, 256]: byte b -> the float32 values of its low and high nibbles (elements
        2j, 2j+1), as one int64's two halves. e2m1's values; int4's nibble (less 8 where the
        zero point is the implicit 8: exact, as the reference's subtraction)."""
        table = self._tables.get(zero_point)
        if table is None:
            b = torch.arange(256)
            nib = torch.stack([b & 15, b >> 4], dim=1)
            if fmt.kind == "int4":
                value = nib.float() if zero_point else (nib - 8).float()
            else:
                value = torch.tensor(E2M1_VALUES)[nib]
            table = self._tables[zero_point] = value.contiguous().view(torch.int64).view(1, 256)
        return table

    def linear(self, x: torch.Tensor, w: dict) -> torch.Tensor:
        """x [T, K] @ W^T -> [T, N], W decoded TILE_ELEMENTS at a time (whole rows, whole
        scale blocks) into reused buffers that stay in the last-level cache."""
        _, n, k = weight_shape(self.fmt, w)
        step = self.fmt.block[0] if self.fmt.kind == "fp8_block" else 1
        rows = max(step, TILE_ELEMENTS // k // step * step)
        if self.fmt.packed:
            # 4-bit values in float32 are the operand as decoded: at one row a float32 GEMV
            # in cache costs what rounding to bf16 and a bf16 GEMV do, from 12 rows the
            # product is widened anyway (the values differ from the reference's only where
            # it rounds them: NVFP4's * g, INT4's (q - z) * s).
            x32 = x.float()

            def product(tile: dict) -> torch.Tensor:
                return F.linear(x32, self.values(tile))
        elif self._folds(x, n, k):
            x32 = x.float()
            headroom = _headroom(x32)

            def product(tile: dict) -> torch.Tensor:
                return self._fp8_product(x32, tile, headroom)
        else:
            wide = widens(x)         # many rows: the decoded tile widened (cpu_matmul.py)
            xs = x.float() if wide else x

            def product(tile: dict) -> torch.Tensor:
                w = self.decode(tile)
                return F.linear(xs, w.float()) if wide else F.linear(xs, w)
        if rows >= n:
            y = product(w)
        else:
            y = torch.cat([product(_rows(self.fmt, w, r, min(r + rows, n)))
                           for r in range(0, n, rows)], dim=1)
        return y.to(x.dtype)

    def _folds(self, x: torch.Tensor, n: int, k: int) -> bool:
        """Whether x's product with an fp8 weight takes _fp8_product: up to FOLD_ROWS rows,
        whole scale blocks."""
        fmt = self.fmt
        if not fmt.kind.startswith("fp8") or x.shape[0] > FOLD_ROWS:
            return False
        bn, bk = fmt.block
        return fmt.kind != "fp8_block" or not (n % bn or k % bk)

    def _fp8_product(self, x32: torch.Tensor, w: dict, headroom: float) -> torch.Tensor:
        """x32 [T, K] float32 @ (q * s)^T -> [T, N] float32, the scales kept out of the
        weight: the bytes' values / 2^120 are the float32 operand as decoded (three integer
        passes, no multiply, no rounding), and the scales multiply x or the sums:

            fp8_tensor, fp8_channel   y = (x 2^a @ v^T) * (s 2^(120-a))   (s per row of y)
            fp8_block                 y[:, rows of block r] = (x (s[r] 2^a)) @ v[rows]^T * 2^(120-a)

        the block form one batched product over row blocks, x scaled per column block by that
        row block's scales: xs [N/bn, T, K], T x K x N/bn multiplies (N x K at T = bn). 2^a
        (a <= 120, from headroom and the largest finite scale) keeps x s 2^a finite and away
        from float32's subnormals; when x needed a smaller power than 2^120 (|x s| or |x|
        beyond 2^6), the last factor is applied in float64, so it neither overflows nor
        underflows where the result does not. Each product term is x s q to
        float32's rounding, without the reference's rounding of q s to the compute dtype:
        nearer the exact sum, not bit-equal to fused_moe_quant_reference. An inf or nan
        scale reaches only its own block's (row's) outputs, as in the reference."""
        fmt = self.fmt
        q, s = w["q"], w["s"].float()
        n, k = q.shape
        t = x32.shape[0]
        v = self._fp8_bits(q)
        if fmt.kind != "fp8_block":
            a = _exponent(headroom)
            y = F.linear(x32 * 2.0 ** a, v)
            scale = s[None, :] if fmt.kind == "fp8_channel" else s
            if a == 120:                    # |x| <= 2^6: y = x q is far from overflowing
                return y.mul_(scale)
            return (y.double() * (scale.double() * 2.0 ** (120 - a))).float()
        bn, bk = fmt.block
        top = float(s.abs().nan_to_num(0.0, 0.0, 0.0).amax()) if s.numel() else 0.0
        a = _exponent(headroom / top if top > 0.0 else headroom)
        if top * 2.0 ** a < FP32_MAX:                 # s 2^a finite: one multiply of x
            xs = x32.view(1, t, k // bk, bk) * (s * 2.0 ** a)[:, None, :, None]
        else:                                          # x s first (small x, large s)
            xs = (x32.view(1, t, k // bk, bk) * s[:, None, :, None]).mul_(2.0 ** a)
        y = torch.bmm(xs.view(n // bn, t, k), v.view(n // bn, bn, k).transpose(1, 2))
        y = y.transpose(0, 1).reshape(t, n)                               # [T, N]
        return y if a == 120 else (y.double() * 2.0 ** (120 - a)).float()

    def _fp8_bits(self, q: torch.Tensor) -> torch.Tensor:
        """q [N, K] e4m3 -> float32 [N, K] of its values / 2^120, in the reused buffer: the
        byte sign-extended to int32, its seven bits moved to float32's exponent and mantissa
        (subnormals land on subnormals, so every value is exact)."""
        bits = self._buffers(*q.shape)[0]
        bits.copy_(q.view(torch.int8))          # sign-extended: bit 7 fills 8-31
        bits.bitwise_left_shift_(20).bitwise_and_(SIGN_E4M3)
        return bits.view(torch.float32)

    def decode(self, w: dict) -> torch.Tensor:
        """One weight {"q": [N, ..], "s": ..} -> [N, K] in self.dtype, in a reused buffer
        (valid until the next decode of that shape)."""
        fmt = self.fmt
        _, n, k = weight_shape(fmt, w)
        bn, bk = fmt.block
        out = self._buffers(n, k)[1]
        if fmt.kind == "fp8_block" and (n % bn or k % bk):
            return out.copy_(dequantize_reference(fmt, w, self.dtype))
        value = self.values(w)
        return out if self.dtype == torch.float32 else out.copy_(value)

    def values(self, w: dict) -> torch.Tensor:
        """One weight (whole fp8 blocks) -> float32 [N, K], the reference's values before it
        rounds them to the compute dtype, in the reused buffer."""
        fmt = self.fmt
        _, n, k = weight_shape(fmt, w)
        bn, bk = fmt.block
        bits = self._buffers(n, k)[0]
        value = bits.view(torch.float32)
        q, s = w["q"], w["s"]
        if fmt.kind.startswith("fp8"):
            self._fp8_bits(q)
            scale = _folded(value, s, F32_E4M3)
            if fmt.kind == "fp8_block":
                value.view(n // bn, bn, k // bk, bk).mul_(scale[:, None, :, None])
            else:
                value.mul_(scale[:, None] if fmt.kind == "fp8_channel" else scale)
        else:
            # Each byte's two values (elements 2j, 2j+1) in one gather from a 256-entry table
            # of float32 pairs, into the int32 buffer seen as int64: one read of the bytes, one
            # write of the values, in their columns' order (the shift-and-mask passes that
            # built the bits, 8 of them, were 2.3-3x slower). Then the group scales, as the
            # reference applies them.
            index = self._index(n, k // 2)
            index.copy_(q)
            torch.gather(self._pairs(fmt, "z" in w).expand(n, 256), 1, index,
                         out=bits.view(torch.int64))
            grouped = value.view(n, k // fmt.group_k, fmt.group_k)
            if fmt.kind == "int4":
                if "z" in w:
                    grouped.sub_(w["z"].float()[:, :, None])
                grouped.mul_(s.float()[:, :, None])
            elif fmt.kind == "mxfp4":
                grouped.mul_(e8m0_to_float(s)[:, :, None])
            else:
                grouped.mul_(s.float()[:, :, None])
                value.mul_(w["g"])
        return value


def _headroom(x32: torch.Tensor) -> float:
    """How far x32's largest finite magnitude may be scaled up and stay below 2^126 (inf when
    there is none). An inf or nan in x reaches its own row's outputs, as in the reference."""
    top = float(x32.abs().amax()) if x32.numel() else 0.0
    if not math.isfinite(top):
        top = float(x32.abs().nan_to_num(0.0, 0.0, 0.0).amax())
    return 2.0 ** 126 / top if top > 0.0 else float("inf")


def _exponent(headroom: float) -> int:
    """The a <= 120 with 2^a <= headroom (the power _fp8_product scales x by)."""
    if headroom >= 2.0 ** 120:
        return 120
    return math.floor(math.log2(headroom)) if headroom > 0.0 else -126


def _rows(fmt: QuantFormat, w: dict, r0: int, r1: int) -> dict:
    """Rows [r0, r1) of one weight's tensors (fp8_block: r0 on a block boundary)."""
    out = dict(w, q=w["q"][r0:r1])
    if fmt.kind == "fp8_block":
        bn = fmt.block[0]
        out["s"] = w["s"][r0 // bn:-(-r1 // bn)]
    elif fmt.kind != "fp8_tensor":
        out["s"] = w["s"][r0:r1]
        if "z" in w:
            out["z"] = w["z"][r0:r1]
    return out


def _folded(value: torch.Tensor, scale: torch.Tensor, power: float) -> torch.Tensor:
    """scale * power (a power of two: exact), to multiply `value` by in one pass; when that
    would overflow, value is multiplied by power first (a pass more) and scale returned."""
    scale = scale.float()
    folded = scale * power
    if torch.isfinite(folded).all() or not torch.isfinite(scale).all():
        return folded
    value.mul_(power)
    return scale


def quant_linear_cpu(x: torch.Tensor, fmt: QuantFormat, w: dict,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """quant_linear_reference's result, decoded a tile at a time: the same decoded weights
    (the sum over K in another order for 4-bit formats), except fp8 up to FOLD_ROWS rows,
    whose scales stay out of the weight (to float32's rounding, not bit-equal)."""
    _check_linear(x, fmt, w, bias)
    y = Decoder(fmt, x.dtype).linear(x, w)
    return y if bias is None else y + bias


def fused_moe_quant_cpu(x, fmt, w13, w2, topk_weights, topk_ids, slot_map=None, *,
                        b13=None, b2=None, activation: MoeActivation = SILU,
                        decoder: Decoder | None = None):
    """fused_moe_quant_reference's arithmetic, each routed expert decoded once into
    `decoder`'s buffers (a fresh Decoder when None) and its tokens run through two matmuls
    (Decoder.linear: fp8 experts' scales kept out of the weight, so to bf16's rounding, not
    bit-equal). Banks packed for the CPU run torch's int4 GEMM (int4_cpu.Int4Packed), the
    native kernel (cpu_native.NativeBank decoded once; fp8 and int4 from their bytes,
    NativeFp8Bank, NativeInt4Bank) or the fp16-weight GEMM (cpu_matmul.Fp16Bank) instead."""
    if isinstance(w13, Int4Packed):          # a bank only the CPU reads, packed for it
        return fused_moe_int4_cpu(x, w13, w2, topk_weights, topk_ids, slot_map, b13=b13,
                                  b2=b2, activation=activation)
    if isinstance(w13, (Fp16Bank, NativeBank, NativeFp8Bank, NativeInt4Bank)):
        return fused_moe_reference(x, w13, w2, topk_weights, topk_ids, slot_map, b13=b13,
                                   b2=b2, activation=activation)
    _check_moe(x, fmt, w13, w2, topk_weights, topk_ids, slot_map, b13, b2, activation)
    if decoder is None or decoder.dtype != x.dtype or decoder.fmt != fmt:
        decoder = Decoder(fmt, x.dtype)
    if x.shape[0] == 1 and topk_ids.numel():
        return moe_one_token(x, lambda h, s: decoder.linear(h, _expert(w13, s)),
                             lambda h, s: decoder.linear(h, _expert(w2, s)),
                             topk_weights, topk_ids, slot_map, b13, b2, activation)
    out = torch.zeros_like(x)
    for e in torch.unique(topk_ids.reshape(-1)).tolist():
        token_idx, pos = torch.where(topk_ids == e)
        slot = e if slot_map is None else int(slot_map[e])
        xs = x[token_idx]
        gate_up = decoder.linear(xs, _expert(w13, slot))
        if b13 is not None:
            gate_up = gate_up + b13[slot]
        gate, up = gate_up.chunk(2, dim=-1)
        h = decoder.linear(_activate(gate, up, activation), _expert(w2, slot))
        if b2 is not None:
            h = h + b2[slot]
        out.index_add_(0, token_idx, h * topk_weights[token_idx, pos, None].to(h.dtype))
    return out
