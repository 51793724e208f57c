"""Float weights -> the canonical quantized form (what tools/make_tiny_model.py --quant writes).

Round-to-nearest quantizers, one per QuantFormat kind, for a weight W [N, K] (float32 math).
They are not calibrated: their job is checkpoints whose every code, scale and zero point is
exercised. `skew` multiplies each scale block of W by a random factor first (log-uniform over
`skew` octaves each way), so neighbouring blocks get very different scales and an indexing
mistake in a loader or kernel shows as a large error rather than a small one.
"""

from __future__ import annotations

import math

import torch

from freetoken.models.quant.convert import pack_nibbles
from triton_kernels.dequant import QuantFormat

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FP8_MAX = 448.0


def scale_block(fmt: QuantFormat) -> tuple[int, int]:
    """(rows, columns) sharing one scale."""
    return {"fp8_block": fmt.block, "mxfp4": (1, 32), "nvfp4": (1, 16),
            "int4": (1, fmt.group)}.get(fmt.kind, (1, 1))


def skew_blocks(w: torch.Tensor, fmt: QuantFormat, octaves: float, g: torch.Generator) -> torch.Tensor:
    """W with each scale block multiplied by 2^U(-octaves, octaves)."""
    if octaves <= 0 or fmt.kind in ("fp8_tensor", "fp8_channel"):
        return w
    bn, bk = scale_block(fmt)
    n, k = w.shape
    f = torch.exp2((torch.rand(math.ceil(n / bn), math.ceil(k / bk), generator=g) * 2 - 1) * octaves)
    f = f.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return w * f


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float (already divided by its scale) -> 4-bit codes: bit 3 sign, bits 0-2 the index of
    the nearest magnitude in E2M1 (ties to the lower one), saturating at 6."""
    mag = x.abs().clamp(max=6.0)
    idx = (mag.unsqueeze(-1) - E2M1).abs().argmin(-1).to(torch.uint8)
    return idx | ((x < 0).to(torch.uint8) << 3)


def quantize_weight(fmt: QuantFormat, w: torch.Tensor, global_amax: float | None = None,
                    scale_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """W [N, K] -> {q, s, (z), (g)}. global_amax: NVFP4's tensor amax, shared when several
    weights must share one global scale (an expert's gate and up); scale_dtype: int4's s."""
    w = w.float()
    n, k = w.shape
    kind = fmt.kind
    if kind == "fp8_block":
        bn, bk = fmt.block
        nb, kb = math.ceil(n / bn), math.ceil(k / bk)
        pad = torch.zeros(nb * bn, kb * bk)
        pad[:n, :k] = w
        amax = pad.reshape(nb, bn, kb, bk).abs().amax((1, 3))
        s = (amax / FP8_MAX).clamp(min=1e-12)
        full = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        return {"q": (w / full).to(torch.float8_e4m3fn), "s": s}
    if kind == "fp8_channel":
        s = (w.abs().amax(1) / FP8_MAX).clamp(min=1e-12)
        return {"q": (w / s[:, None]).to(torch.float8_e4m3fn), "s": s}
    if kind == "fp8_tensor":
        s = (w.abs().amax() / FP8_MAX).clamp(min=1e-12).reshape(1)
        return {"q": (w / s).to(torch.float8_e4m3fn), "s": s}
    if kind == "mxfp4":
        blocks = w.reshape(n, k // 32, 32)
        amax = blocks.abs().amax(-1).clamp(min=2.0 ** -126)
        # The largest E2M1 magnitude is 6 = 1.5 * 2^2: an exponent that maps amax into [4, 8).
        e = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)
        codes = encode_e2m1(blocks / torch.exp2(e)[..., None]).reshape(n, k)
        return {"q": pack_nibbles(codes), "s": (e + 127).to(torch.uint8)}
    if kind == "nvfp4":
        amax = float(w.abs().max()) if global_amax is None else global_amax
        g = torch.tensor([max(amax, 1e-12) / (FP8_MAX * 6.0)])
        blocks = w.reshape(n, k // 16, 16)
        s = (blocks.abs().amax(-1) / 6.0 / g).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
        sf = s.float() * g
        codes = encode_e2m1(blocks / torch.where(sf > 0, sf, 1.0)[..., None]).reshape(n, k)
        return {"q": pack_nibbles(codes), "s": s, "g": g}
    if kind == "int4":
        gs = fmt.group
        blocks = w.reshape(n, k // gs, gs)
        if fmt.symmetric:
            s = (blocks.abs().amax(-1) / 7.0).clamp(min=1e-12).to(scale_dtype)
            q = (torch.round(blocks / s.float()[..., None]) + 8).clamp(0, 15)
            return {"q": pack_nibbles(q.to(torch.uint8).reshape(n, k)), "s": s}
        lo, hi = blocks.amin(-1).clamp(max=0), blocks.amax(-1).clamp(min=0)
        s = ((hi - lo) / 15.0).clamp(min=1e-12).to(scale_dtype)
        z = torch.round(-lo / s.float()).clamp(0, 15)
        q = (torch.round(blocks / s.float()[..., None]) + z[..., None]).clamp(0, 15)
        return {"q": pack_nibbles(q.to(torch.uint8).reshape(n, k)), "s": s, "z": z.to(torch.uint8)}
    raise ValueError(f"no quantizer for {kind!r}")
