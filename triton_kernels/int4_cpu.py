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

from triton_kernels.dequant import QuantFormat, weight_shape
from triton_kernels.fused_moe import SILU, MoeActivation, moe_packed_banks

GROUPS = (32, 64, 128, 256)      # the kernel's group sizes
ROWS = 16                        # N must be a multiple: the packing interleaves 16 rows


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
    """A projection [N, K] through the int4 GEMM at every row count: x [.., K] bf16 ->
    [.., N] bf16 (+ bias, in x's dtype, as QuantLinear adds it). (The native GEMV on the
    checkpoint's nibbles ran 1.5x slower at one row: [1536, 1024] g32, 0.075 ms against
    0.048.) own: a copy made for this product (a fused q/k/v), whose bytes count."""

    def __init__(self, fmt: QuantFormat, w: dict, bias: torch.Tensor | None = None):
        self.packed = Int4Packed(fmt, w)
        if self.packed.experts is not None:
            raise ValueError("Int4Linear: one weight [N, K], not a bank")
        self.out_features, self.in_features = self.packed.n, self.packed.k
        self.bias = None if bias is None else bias.detach()
        self.nbytes = self.packed.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.packed.linear(x.reshape(-1, self.in_features))
        y = y if self.bias is None else y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


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
