"""Quantized weights as they come off disk: their formats, torch references and public ops.

A weight W [N, K] (N output rows, K input columns; expert banks stack a leading [E]) is a dict
of named tensors, decoded by QuantFormat.kind:
- fp8_block:   "q" float8_e4m3fn [N, K], "s" float32 [ceil(N/bn), ceil(K/bk)];
               W[n, k] = q * s[n // bn, k // bk]
- fp8_channel: "q" float8_e4m3fn [N, K], "s" float32 [N];  W = q * s[n]
- fp8_tensor:  "q" float8_e4m3fn [N, K], "s" float32 [1];  W = q * s
- mxfp4 (OCP MX): "q" uint8 [N, K/2] e2m1 pairs, "s" uint8 [N, K/32] E8M0; W = e2m1 * 2^(s-127)
- nvfp4: "q" uint8 [N, K/2] e2m1 pairs, "s" float8_e4m3fn [N, K/16], "g" float32 [1] (a
         multiplier); W = e2m1 * s * g
- int4:  "q" uint8 [N, K/2] unsigned nibbles, "s" [N, K/G] (f16, bf16 or f32), "z" uint8
         [N, K/G] zero points (absent when symmetric: zero 8); W = (q - z) * s
Packed bytes hold element 2j in the low nibble and 2j+1 in the high one. e2m1: bit 3 sign,
magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.

The kernels (quant_matmul.py, quant_moe.py) decode a tile in registers with _dequant_tile
below and never write a dequantized weight; the references here decode in float32, round once
to the compute dtype and run the dense op, one expert at a time for MoE banks. On the CPU the
public ops run dequant_cpu.py: the reference's values, a tile of rows at a time.
"""

import dataclasses
import math

import torch
import torch.nn.functional as F

from triton_kernels._dispatch import tl, triton, use_triton
from triton_kernels.fused_moe import SILU, MoeActivation, _activate

KINDS = ("fp8_block", "fp8_channel", "fp8_tensor", "mxfp4", "nvfp4", "int4")
_INT4_GROUPS = (32, 64, 128)
_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# e2m1 nibble -> value: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """How a weight's tensors decode. block (rows, cols) is fp8_block's scale tile; group and
    symmetric are int4's (columns per scale; symmetric: no "z", the zero point is 8)."""
    kind: str
    block: tuple[int, int] = (128, 128)
    group: int = 128
    symmetric: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"QuantFormat: kind must be one of {KINDS}, got {self.kind!r}")
        if (len(self.block) != 2 or any(not isinstance(b, int) or b < 1 for b in self.block)):
            raise ValueError(f"QuantFormat: block must be two positive ints, got {self.block!r}")
        if self.kind == "int4" and self.group not in _INT4_GROUPS:
            raise ValueError(f"QuantFormat: int4 group must be one of {_INT4_GROUPS}, "
                             f"got {self.group!r}")

    @property
    def packed(self) -> bool:
        """Two 4-bit elements per byte of "q"."""
        return self.kind in ("mxfp4", "nvfp4", "int4")

    @property
    def group_k(self) -> int:
        """Columns per scale along K (fp8_channel/fp8_tensor: 1, the scale does not vary in K)."""
        return {"fp8_block": self.block[1], "mxfp4": 32, "nvfp4": 16,
                "int4": self.group}.get(self.kind, 1)

    def names(self) -> tuple[str, ...]:
        """The tensor names one weight of this format has."""
        if self.kind == "nvfp4":
            return ("q", "s", "g")
        if self.kind == "int4" and not self.symmetric:
            return ("q", "s", "z")
        return ("q", "s")


def weight_shape(fmt: QuantFormat, w: dict, what: str = "weight") -> tuple[tuple, int, int]:
    """Check w's tensors against fmt -> (leading dims, N, K). Raises ValueError naming what."""
    if not isinstance(fmt, QuantFormat):
        raise ValueError(f"{what}: fmt must be a QuantFormat, got {fmt!r}")
    if not isinstance(w, dict) or set(w) != set(fmt.names()):
        got = sorted(w) if isinstance(w, dict) else type(w).__name__
        raise ValueError(f"{what}: {fmt.kind} needs tensors {list(fmt.names())}, got {got}")
    q, s = w["q"], w["s"]
    want_q = torch.uint8 if fmt.packed else torch.float8_e4m3fn
    if q.dtype != want_q or q.dim() < 2:
        cols = "K/2" if fmt.packed else "K"
        raise ValueError(f"{what}: {fmt.kind} q must be {want_q} [.., N, {cols}], got "
                         f"{q.dtype} {tuple(q.shape)}")
    lead, n, k = tuple(q.shape[:-2]), q.shape[-2], q.shape[-1] * (2 if fmt.packed else 1)
    if k % fmt.group_k and fmt.kind != "fp8_block":
        raise ValueError(f"{what}: {fmt.kind} needs K % {fmt.group_k} == 0, got K={k}")
    bn, bk = fmt.block
    s_shape, s_dtypes = {
        "fp8_block": ((math.ceil(n / bn), math.ceil(k / bk)), (torch.float32,)),
        "fp8_channel": ((n,), (torch.float32,)),
        "fp8_tensor": ((1,), (torch.float32,)),
        "mxfp4": ((n, k // 32), (torch.uint8,)),
        "nvfp4": ((n, k // 16), (torch.float8_e4m3fn,)),
        "int4": ((n, k // fmt.group), _SCALE_DTYPES),
    }[fmt.kind]
    expect = {"s": (lead + s_shape, s_dtypes), "z": (lead + s_shape, (torch.uint8,)),
              "g": (lead + (1,), (torch.float32,))}
    for name in fmt.names()[1:]:
        shape, dtypes = expect[name]
        t = w[name]
        if tuple(t.shape) != shape or t.dtype not in dtypes:
            raise ValueError(f"{what}: {fmt.kind} {name!r} must be {list(shape)} "
                             f"{'/'.join(str(d) for d in dtypes)}, got {tuple(t.shape)} {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{what}: {name!r} is on {t.device}, q on {q.device}")
    return lead, n, k


# ---- torch reference ------------------------------------------------------------------------

def unpack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[.., N, K/2] uint8 -> [.., N, K] uint8 in 0..15: byte j -> elements 2j (low), 2j+1 (high)."""
    return torch.stack([q & 0xF, q >> 4], dim=-1).flatten(-2)


def e8m0_to_float(s: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float32 2^(s - 127); 255 is NaN. Built from the exponent bits, so 0
    gives 2^-127 (a float32 subnormal) exactly."""
    e = s.to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 1 << 22), e << 23)
    return torch.where(e == 255, torch.nan, bits.view(torch.float32))


def _expand(s: torch.Tensor, n: int, k: int, rows: int, cols: int) -> torch.Tensor:
    """Per-tile scales [.., ceil(n/rows), ceil(k/cols)] -> [.., n, k], ragged tiles cut off."""
    s = s.repeat_interleave(rows, dim=-2)[..., :n, :]
    return s.repeat_interleave(cols, dim=-1)[..., :k]


def dequantize_reference(fmt: QuantFormat, w: dict, dtype: torch.dtype = torch.float32):
    """w's tensors [.., *] -> W [.., N, K] in dtype: decoded in float32, rounded once."""
    _, n, k = weight_shape(fmt, w)
    s = w["s"]
    if fmt.kind == "fp8_block":
        out = w["q"].float() * _expand(s, n, k, *fmt.block)
    elif fmt.kind == "fp8_channel":
        out = w["q"].float() * s[..., :, None]
    elif fmt.kind == "fp8_tensor":
        out = w["q"].float() * s[..., None]
    else:
        nib = unpack_nibbles(w["q"])
        g = fmt.group_k
        if fmt.kind == "int4":
            zero = w["z"].float() if "z" in w else torch.full_like(s, 8, dtype=torch.float32)
            out = (nib.float() - _expand(zero, n, k, 1, g)) * _expand(s.float(), n, k, 1, g)
        else:
            value = torch.tensor(E2M1_VALUES, device=nib.device)[nib.long()]
            scale = e8m0_to_float(s) if fmt.kind == "mxfp4" else s.float()
            out = value * _expand(scale, n, k, 1, g)
            if fmt.kind == "nvfp4":
                out = out * w["g"][..., None]
    return out.to(dtype)


def quant_linear_reference(x: torch.Tensor, fmt: QuantFormat, w: dict,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ W^T (+ bias [N]) -> [T, N] in x's dtype, W decoded and rounded to x's dtype."""
    _check_linear(x, fmt, w, bias)
    y = F.linear(x, dequantize_reference(fmt, w, x.dtype))
    return y if bias is None else y + bias


def _expert(w: dict, slot: int) -> dict:
    return {name: t[slot] for name, t in w.items()}


def fused_moe_quant_reference(x, fmt, w13, w2, topk_weights, topk_ids, slot_map=None, *,
                              b13=None, b2=None, activation: MoeActivation = SILU):
    """fused_moe_reference's semantics on quantized banks, decoding one expert at a time."""
    _check_moe(x, fmt, w13, w2, topk_weights, topk_ids, slot_map, b13, b2, activation)
    out = torch.zeros_like(x)
    for e in torch.unique(topk_ids.reshape(-1)).tolist():
        token_idx, pos = torch.where(topk_ids == e)
        slot = e if slot_map is None else int(slot_map[e])
        gate_up = F.linear(x[token_idx], dequantize_reference(fmt, _expert(w13, slot), x.dtype))
        if b13 is not None:
            gate_up = gate_up + b13[slot]
        gate, up = gate_up.chunk(2, dim=-1)
        h = F.linear(_activate(gate, up, activation),
                     dequantize_reference(fmt, _expert(w2, slot), x.dtype))
        if b2 is not None:
            h = h + b2[slot]
        out.index_add_(0, token_idx, h * topk_weights[token_idx, pos, None].to(h.dtype))
    return out


# ---- the in-kernel decode -------------------------------------------------------------------
# Every byte is decoded by bit arithmetic rather than through float8 pointers: the same code runs
# on sm_80 (no fp8 conversions), sm_90 and in the interpreter. An e4m3 byte's exponent and
# mantissa moved into float16's (bits 13-7) give its value / 2^8, subnormals included; an e2m1
# nibble's (bits 11-9) its value / 2^14; an E8M0 byte is float32's exponent field. These
# decodes are exact; the one rounding is the product with the scale, in float32 as the
# reference does it. Difference: a NaN e4m3 byte (0x7F, 0xFF) decodes as +-480, not NaN.

@triton.jit
def _e4m3_to_f32(byte):
    b = byte.to(tl.int32)
    half = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
    return half.to(tl.float32) * 256.0


@triton.jit
def _e2m1_to_f32(nibble):
    half = (((nibble & 8) << 12) | ((nibble & 7) << 9)).to(tl.int16).to(tl.float16, bitcast=True)
    return half.to(tl.float32) * 16384.0


@triton.jit
def _e8m0_to_f32(byte):
    e = byte.to(tl.int32)
    f = tl.where(e == 0, 1 << 22, e << 23).to(tl.float32, bitcast=True)
    return tl.where(e == 255, float("nan"), f)


@triton.jit
def _group_scale(s_ptr, rows, row_mask, k0, K, stride_sn, GROUP_K: tl.constexpr,
                 BLOCK_K: tl.constexpr, OTHER: tl.constexpr):
    """The raw scale bytes/values of rows [BN, 1] over the K tile k0 + arange(BLOCK_K), as
    [BN, BLOCK_K // GROUP_K, 1] (whole groups in the tile), [BN, 1, 1] (the tile inside one
    group) or [BN, BLOCK_K, 1] gathered per column (neither; ragged fp8 blocks): loaded once
    per group, not per element."""
    if BLOCK_K % GROUP_K == 0:
        offs_g = k0 // GROUP_K + tl.arange(0, BLOCK_K // GROUP_K)
        mask = row_mask & (offs_g[None, :] < tl.cdiv(K, GROUP_K))
        s = tl.load(s_ptr + rows * stride_sn + offs_g[None, :], mask=mask, other=OTHER)
    elif GROUP_K % BLOCK_K == 0:
        s = tl.load(s_ptr + rows * stride_sn + k0 // GROUP_K, mask=row_mask, other=OTHER)
    else:
        cols = k0 + tl.arange(0, BLOCK_K)[None, :]
        s = tl.load(s_ptr + rows * stride_sn + cols // GROUP_K, mask=row_mask & (cols < K),
                    other=OTHER)
    return s[:, :, None]


@triton.jit
def _apply_groups(w, scale, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_K: tl.constexpr, SUBTRACT: tl.constexpr):
    """w [BN, BK] float32 times (or, SUBTRACT, minus) its per-group value from _group_scale."""
    if BLOCK_K % GROUP_K == 0:
        w = w.reshape(BLOCK_N, BLOCK_K // GROUP_K, GROUP_K)
    elif GROUP_K % BLOCK_K == 0:
        scale = scale.reshape(BLOCK_N, 1)
    else:
        scale = scale.reshape(BLOCK_N, BLOCK_K)
    if SUBTRACT:
        w = w - scale
    else:
        w = w * scale
    return w.reshape(BLOCK_N, BLOCK_K)


@triton.jit
def _dequant_tile(q_ptr, s_ptr, z_ptr, g_ptr, offs_n, k0, mask_n, K, stride_qn, stride_sn,
                  KIND: tl.constexpr, SCALE_ROWS: tl.constexpr, GROUP_K: tl.constexpr,
                  HAS_ZERO: tl.constexpr, SCALE_BF16: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """W[offs_n, k0 : k0 + BLOCK_K] in float32, [BLOCK_N, BLOCK_K] (tl.trans it for tl.dot);
    rows off mask_n and columns past K are 0. The pointers are at one weight's (or expert's)
    base, "q" rows stride_qn apart, scale rows stride_sn; fp8 "q" and e4m3 "s" come as uint8,
    bfloat16 "s" as int16 (the interpreter cannot load bfloat16). Packed "q" is loaded as
    contiguous bytes [BN, BK/2] and its nibbles interleaved in registers; scales once per group."""
    rows = offs_n[:, None]
    row_mask = mask_n[:, None]
    if KIND == "fp8_block" or KIND == "fp8_channel" or KIND == "fp8_tensor":
        cols = k0 + tl.arange(0, BLOCK_K)[None, :]
        byte = tl.load(q_ptr + rows * stride_qn + cols, mask=row_mask & (cols < K), other=0)
        w = _e4m3_to_f32(byte)
        if KIND == "fp8_block":
            scale = _group_scale(s_ptr, rows // SCALE_ROWS, row_mask, k0, K, stride_sn, GROUP_K,
                                 BLOCK_K, 0.0)
            w = _apply_groups(w, scale, BLOCK_N, BLOCK_K, GROUP_K, False)
        elif KIND == "fp8_channel":
            w = w * tl.load(s_ptr + rows, mask=row_mask, other=0.0)
        else:
            w = w * tl.load(s_ptr)
    else:
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)[None, :]
        byte = tl.load(q_ptr + rows * stride_qn + offs_b, mask=row_mask & (offs_b < K // 2),
                       other=0).to(tl.int32)
        # Element 2j is byte j's low nibble, 2j+1 its high one: join [BN, BK/2, 2] -> [BN, BK].
        nibble = tl.join(byte & 0xF, byte >> 4).reshape(BLOCK_N, BLOCK_K)
        s = _group_scale(s_ptr, rows, row_mask, k0, K, stride_sn, GROUP_K, BLOCK_K,
                         127 if KIND == "mxfp4" else 0)
        if KIND == "int4":
            w = nibble.to(tl.float32)
            if HAS_ZERO:
                zero = _group_scale(z_ptr, rows, row_mask, k0, K, stride_sn, GROUP_K, BLOCK_K, 0)
                w = _apply_groups(w, zero.to(tl.float32), BLOCK_N, BLOCK_K, GROUP_K, True)
            else:
                w = w - 8.0
            if SCALE_BF16:
                s = (s.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32,
                                                                         bitcast=True)
            w = _apply_groups(w, s.to(tl.float32), BLOCK_N, BLOCK_K, GROUP_K, False)
        elif KIND == "mxfp4":
            w = _apply_groups(_e2m1_to_f32(nibble), _e8m0_to_f32(s), BLOCK_N, BLOCK_K, GROUP_K,
                              False)
        else:
            w = _apply_groups(_e2m1_to_f32(nibble), _e4m3_to_f32(s), BLOCK_N, BLOCK_K, GROUP_K,
                              False)
            w = w * tl.load(g_ptr)
    return w


@dataclasses.dataclass(frozen=True)
class KernelWeight:
    """One checked weight (or bank) as the kernels take it: the four pointers' tensors (absent
    ones stand in with "s", never read), their strides (slot strides 0 for a 2-d weight) and
    the decode's constexprs."""
    q: torch.Tensor
    s: torch.Tensor
    z: torch.Tensor
    g: torch.Tensor
    stride_qs: int
    stride_qn: int
    stride_ss: int
    stride_sn: int
    stride_gs: int
    constexprs: dict

    @staticmethod
    def of(fmt: QuantFormat, w: dict, what: str) -> "KernelWeight":
        lead, _, _ = weight_shape(fmt, w, what)
        q, s = w["q"], w["s"]
        if q.stride(-1) != 1 or not all(w[name].is_contiguous() for name in fmt.names()[1:]):
            raise ValueError(f"{what}: the kernels need q with a contiguous last dimension and "
                             f"contiguous {list(fmt.names()[1:])}")
        if q.dtype == torch.float8_e4m3fn:
            q = q.view(torch.uint8)
        if s.dtype in (torch.float8_e4m3fn, torch.bfloat16):
            s = s.view(torch.uint8 if s.dtype == torch.float8_e4m3fn else torch.int16)
        z, g = w.get("z", s), w.get("g", s)
        banked = bool(lead)
        return KernelWeight(
            q, s, z, g, q.stride(0) if banked else 0, q.stride(-2),
            s.stride(0) if banked else 0, s.stride(-2) if s.dim() - banked == 2 else 0,
            g.stride(0) if banked and "g" in w else 0,
            dict(KIND=fmt.kind, SCALE_ROWS=fmt.block[0], GROUP_K=fmt.group_k,
                 HAS_ZERO="z" in w, SCALE_BF16=w["s"].dtype == torch.bfloat16))

    def pointers(self) -> tuple:
        return self.q, self.s, self.z, self.g


# ---- argument checks ------------------------------------------------------------------------

def _check_linear(x, fmt, w, bias):
    lead, n, k = weight_shape(fmt, w, "quant_linear")
    if lead or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"quant_linear: x [T, {k}] and a 2-d weight expected, got x "
                         f"{tuple(x.shape)}, weight leading dims {lead}")
    if bias is not None and (tuple(bias.shape) != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"quant_linear: bias must be [{n}] {x.dtype}, got {tuple(bias.shape)} "
                         f"{bias.dtype}")


def _check_moe(x, fmt, w13, w2, topk_weights, topk_ids, slot_map, b13, b2, activation):
    lead13, two_i, d13 = weight_shape(fmt, w13, "fused_moe_quant w13")
    lead2, d2, inter = weight_shape(fmt, w2, "fused_moe_quant w2")
    if x.dim() != 2 or len(lead13) != 1 or lead2 != lead13 or two_i != 2 * inter \
            or d13 != x.shape[1] or d2 != x.shape[1]:
        raise ValueError(f"fused_moe_quant: x [T, D], w13 [S, 2I, D], w2 [S, D, I] expected, got "
                         f"x {tuple(x.shape)}, w13 {lead13 + (two_i, d13)}, w2 "
                         f"{lead2 + (d2, inter)}")
    t, s = x.shape[0], lead13[0]
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"fused_moe_quant: topk_ids and topk_weights must be [{t}, k], got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64) or not topk_weights.is_floating_point():
        raise ValueError(f"fused_moe_quant: topk_ids must be int32/int64 and topk_weights float, "
                         f"got {topk_ids.dtype} and {topk_weights.dtype}")
    if slot_map is not None and (slot_map.dim() != 1 or slot_map.dtype not in (torch.int32,
                                                                                 torch.int64)):
        raise ValueError(f"fused_moe_quant: slot_map must be a 1-d int tensor, got "
                         f"{tuple(slot_map.shape)} {slot_map.dtype}")
    for name, bias, shape in (("b13", b13, (s, two_i)), ("b2", b2, (s, d2))):
        if bias is not None and (tuple(bias.shape) != shape or bias.dtype != x.dtype):
            raise ValueError(f"fused_moe_quant: {name} must be {list(shape)} {x.dtype}, got "
                             f"{tuple(bias.shape)} {bias.dtype}")
    if not isinstance(activation, MoeActivation):
        raise ValueError(f"fused_moe_quant: activation must be a MoeActivation, got "
                         f"{activation!r}")


# ---- public ops -----------------------------------------------------------------------------

# The Triton launchers import this module (formats, checks, the decode), so they are imported
# where they run.

def quant_linear(x: torch.Tensor, fmt: QuantFormat, w: dict,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ W^T (+ bias) -> [T, N] in x's dtype, W quantized as fmt says."""
    if use_triton(x):
        from triton_kernels.quant_matmul import quant_linear_triton
        return quant_linear_triton(x, fmt, w, bias)
    from triton_kernels.dequant_cpu import quant_linear_cpu
    return quant_linear_cpu(x, fmt, w, bias)


def fused_moe_quant(x, fmt, w13, w2, topk_weights, topk_ids, slot_map=None, *, b13=None,
                    b2=None, activation: MoeActivation = SILU):
    """triton_kernels.fused_moe on quantized banks: w13 {"q": [S, 2I, ..], ..}, w2 {"q":
    [S, D, ..], ..}."""
    if use_triton(x):
        from triton_kernels.quant_moe import fused_moe_quant_triton
        op = fused_moe_quant_triton
    else:
        from triton_kernels.dequant_cpu import fused_moe_quant_cpu
        op = fused_moe_quant_cpu
    return op(x, fmt, w13, w2, topk_weights, topk_ids, slot_map, b13=b13, b2=b2,
              activation=activation)
