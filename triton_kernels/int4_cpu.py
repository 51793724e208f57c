"""INT4 weights repacked for torch's CPU int4 GEMM, where only the CPU reads them.

torch._weight_int4pack_mm_for_cpu (the kernel behind weight-only int4 on x86: nibbles
widened in registers, bf16 activations, float32 sums) runs W = (q - 8) * scale + zero from
its own packed layout (torch._convert_weight_to_int4pack_for_cpu: [N, K/2] uint8, the
checkpoint's nibbles rearranged, as many bytes) and one bf16 (scale, zero) pair per group. Measured on the
2-core EPYC, one cold [512, 1024] weight g128: 1 row 52 us (torch's bf16 product 94 us,
dequant_cpu's tile decode 641 us), 8 rows 180 us (bf16 505, decode 1045), 64 rows 1.27 ms
(decode 1.89). Only its bf16 form is vectorized (fp16 and float32 run 10-16x slower), so
only bf16 models pack.

The checkpoint's W = (q - z) * s becomes scale = s and zero = (8 - z) * s (exact in float32),
both rounded to bf16; the kernel forms (q - 8) * scale + zero in float32. That is the
checkpoint's W exactly for symmetric weights with bf16 scales (zero 0, Kimi-K2's experts);
otherwise |W' - W| <= 2^-8 (|q - 8| + |8 - z|) |s| <= |s| / 16, a sixteenth of a quantization
step: the size of the reference's own rounding of W to bf16 (2^-8 |W|, up to 15 |s| / 256).

Int4Packed holds one weight [N, K] or a bank [E, N, K] (one packed matrix per expert);
fused_moe_int4_cpu runs the CPU experts from two banks of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from triton_kernels.cpu_linear import QuantRows
from triton_kernels.cpu_native import has_amx_bf16, native_kernels
from triton_kernels.dequant import QuantFormat, weight_shape
from triton_kernels.fused_moe import SILU, MoeActivation, moe_packed_banks

GROUPS = (32, 64, 128, 256)      # the kernel's group sizes
ROWS = 16                        # N must be a multiple: the packing interleaves 16 rows
# From here an Int4Linear's rows take the decoded weight on AMX: its decode, ~0.2 ms for
# [1024, 1024] g32 on 2 cores, is then below the int4 GEMM's ~13 us a row (8 rows 0.12 ms
# against 0.19, 16 0.21 against 0.20, 64 0.83 against 0.26).
PREFILL_ROWS = 16


def packable_int4(fmt: QuantFormat, w: dict, dtype: torch.dtype) -> bool:
    """Whether weight (or bank) w of format fmt can run the packed CPU GEMM in `dtype`."""
    if (fmt.kind != "int4" or dtype != torch.bfloat16 or fmt.group not in GROUPS
            or not hasattr(torch, "_weight_int4pack_mm_for_cpu")):
        return False
    _, n, k = weight_shape(fmt, w)
    return n % ROWS == 0 and k % fmt.group == 0 and w["q"].device.type == "cpu"


class Int4Packed:
    """w {"q": [.., N, K/2], "s": [.., N, K/G], "z"?} (no leading dim, or one [E]) packed.
    q: [.., N, K/2] uint8 in torch's layout; sz: [.., K/G, N, 2] bf16 (scale, zero)."""

    def __init__(self, fmt: QuantFormat, w: dict):
        lead, n, k = weight_shape(fmt, w, "Int4Packed")
        if len(lead) > 1:
            raise ValueError(f"Int4Packed: one weight or one [E] bank, got leading dims {lead}")
        self.group, self.n, self.k, self.experts = fmt.group, n, k, (lead[0] if lead else None)
        q = w["q"] if lead else w["q"][None]
        s = (w["s"] if lead else w["s"][None]).float()                    # [E, N, K/G]
        z = w.get("z")
        zero = (torch.zeros_like(s) if z is None
                else (8 - (z if lead else z[None]).float()) * s)          # exact in float32
        self.q = torch.stack([torch._convert_weight_to_int4pack_for_cpu(_nibbles(qe), 2)
                              for qe in q])
        self.sz = torch.stack([s, zero], dim=-1).transpose(1, 2).to(torch.bfloat16).contiguous()
        if not lead:
            self.q, self.sz = self.q[0], self.sz[0]

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.sz.nbytes

    def linear(self, x: torch.Tensor, expert: int | None = None) -> torch.Tensor:
        """x [T, K] bf16 @ W^T -> [T, N] bf16 (W: expert `expert` of a bank)."""
        if expert is None:
            return torch._weight_int4pack_mm_for_cpu(x, self.q, self.group, self.sz)
        return torch._weight_int4pack_mm_for_cpu(x, self.q[expert], self.group, self.sz[expert])


class Int4Linear:
    """A projection [N, K] of INT4 weights on the CPU: x [.., K] bf16 -> [.., N] bf16 (+ bias).
    Given the checkpoint's nibbles as the native kernels read them (rows:
    cpu_linear.QuantRows, the nibbles and a symmetric weight's bf16 scales or float32 (scale,
    -zero * scale) pairs):
    - gemv (default: where the native int4 products take bf16 x as int16, AVX2's and
      AVX512-VNNI's): every call but amx's on the native GEMV (cpu_linear.c, the bias added
      in float32 before its one rounding), and no repacked copy. On the 2-core EPYC, g32,
      ms, torch's int4 GEMM against it: [1536, 1024] 1 row 0.167 / 0.120, 7 rows 0.58 /
      0.51, 64 rows 4.4 / 2.8, 512 rows 30 / 20; [32768, 1024] 1 row 2.4 / 1.1. On the
      2-core Sapphire Rapids (VNNI): [1536, 1024] 1 row 0.053 / 0.043, 4 rows 0.093 / 0.118;
      [32768, 1024] 1 row 0.96 / 0.68, 4 rows 1.8 / 2.2; [4096, 2048] 1 row 0.26 / 0.18:
      faster at one row, 0.8x at 4 (the byte products are per token).
    - otherwise torch's int4 GEMM on a repacked copy (Int4Packed, as many bytes again; the
      bias added in x's dtype, as QuantLinear adds it).
    - either way, with amx (default: whether this CPU has AMX-BF16), calls of PREFILL_ROWS
      rows and more (a prefill chunk) decode the nibbles to bf16 (ft_int4_decode: the
      reference's values, rounded once) for AMX's bf16 product: at 512 rows of [1536, 1024]
      g32, 1.0 ms against the int4 GEMM's 9.6.
    The rows' own bytes (a fused copy, the pairs) count in nbytes where a product reads them."""

    def __init__(self, fmt: QuantFormat, w: dict, bias: torch.Tensor | None = None,
                 rows: QuantRows | None = None, amx: bool | None = None,
                 gemv: bool | None = None):
        lead, n, k = weight_shape(fmt, w, "Int4Linear")
        if lead:
            raise ValueError("Int4Linear: one weight [N, K], not a bank")
        self.out_features, self.in_features = n, k
        self.bias = None if bias is None else bias.detach()
        kernel = native_kernels()
        amx = has_amx_bf16() if amx is None else amx
        gemv = (kernel is not None and kernel.int4_activations == "int16") if gemv is None else gemv
        self.rows = rows if (rows is not None and kernel is not None and (amx or gemv)) else None
        self.gemv = None
        if self.rows is not None:
            q, gs, (bn, group) = self.rows.q, self.rows.s, self.rows.block
            groups = (n, k // group)
            if not (q.shape == (n, k // 2) and bn == 1
                    and (gs.shape == (*groups, 2) or (gs.shape == groups
                                                      and gs.dtype == torch.bfloat16))):
                raise ValueError(f"Int4Linear: rows [N, K/2] with scales [N, K/G] bf16 "
                                 f"or pairs [N, K/G, 2] for [{n}, {k}] expected, got "
                                 f"{tuple(q.shape)}, {tuple(gs.shape)}")
            self.kernel = kernel
            if gemv:
                bias32 = None if bias is None else self.bias.float().contiguous()
                self.gemv = kernel.bind_linear(q, bias32, gs, self.rows.block)
        self.packed = Int4Packed(fmt, w) if self.gemv is None else None
        self.prefill = self.rows is not None and amx
        # its own bytes: a fused copy whole, else the pairs made for it (a symmetric
        # weight's bf16 scales are the checkpoint's)
        rows = self.rows
        extra = 0 if rows is None else (rows.nbytes if rows.own else 0 if
                                         rows.s.dtype == torch.bfloat16 else rows.s.nbytes)
        self.nbytes = (self.packed.nbytes if self.packed is not None else 0) + extra

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.prefill and rows.shape[0] >= PREFILL_ROWS and rows.dtype == torch.bfloat16:
            y = F.linear(rows, self.decoded())
        elif self.gemv is not None:
            return self.gemv(rows).reshape(*x.shape[:-1], self.out_features)
        else:
            y = self.packed.linear(rows)
        y = y if self.bias is None else y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def decoded(self) -> torch.Tensor:
        """The weight [N, K] in bf16, decoded from the rows (a call's, not kept)."""
        rows = self.rows
        return self.kernel.int4_decode(rows.q[None], rows.s[None], rows.block[1],
                                       torch.zeros(1, dtype=torch.int64))[0]


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 -> [N, K] int32 (unpack_nibbles' order), the packer's input. Written
    through out= views: 2.7x the speed of unpack_nibbles(q).to(int32) (packing a model's
    experts at load is ~2.6 ns a weight on 2 cores, the packer itself 1.6 of it)."""
    w = q.to(torch.int32)
    out = torch.empty(*q.shape, 2, dtype=torch.int32)
    torch.bitwise_and(w, 15, out=out[..., 0])
    torch.bitwise_right_shift(w, 4, out=out[..., 1])
    return out.view(q.shape[0], -1)


def fused_moe_int4_cpu(x, w13: Int4Packed, w2: Int4Packed, topk_weights, topk_ids,
                       slot_map=None, *, b13=None, b2=None,
                       activation: MoeActivation = SILU) -> torch.Tensor:
    """fused_moe_quant_cpu's arithmetic on packed banks (w13 [S, 2I, D], w2 [S, D, I]):
    fused_moe.moe_packed_banks."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or w13.experts is None \
            or w2.experts != w13.experts or w13.k != x.shape[1] or w2.n != x.shape[1] \
            or w13.n != 2 * w2.k:
        raise ValueError(f"fused_moe_int4_cpu: x [T, D] bf16 and banks w13 [S, 2I, D], w2 "
                         f"[S, D, I] expected, got x {tuple(x.shape)} {x.dtype}, w13 "
                         f"[{w13.experts}, {w13.n}, {w13.k}], w2 [{w2.experts}, {w2.n}, {w2.k}]")
    return moe_packed_banks(x, w13, w2, topk_weights, topk_ids, slot_map, b13, b2, activation)
