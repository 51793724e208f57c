"""Each method's on-disk tensors of one weight -> the canonical form (triton_kernels.dequant).

For one weight W [N, K] the canonical tensors are (see triton_kernels/dequant.py):
    fp8_*:  q float8_e4m3fn [N, K], s float32 [Nb, Kb] | [N] | [1]
    mxfp4:  q uint8 [N, K/2] (element 2j in the low nibble), s uint8 E8M0 [N, K/32]
    nvfp4:  q uint8 [N, K/2], s float8_e4m3fn [N, K/16], g float32 [1] (a multiplier)
    int4:   q uint8 [N, K/2] (unsigned 0..15), s [N, K/G], z uint8 [N, K/G] (asymmetric only)
`convert(method, fmt, suffix, tensor)` maps one checkpoint tensor `<module>.<suffix>` to
(canonical name, tensor); SKIP for tensors no weight-only forward reads (activation scales,
compressed-tensors' weight_shape); None for a suffix the method does not have.
"""

from __future__ import annotations

import torch

from triton_kernels.dequant import QuantFormat

SKIP = "skip"
# Activation-side scales (static W8A8/W4A4 checkpoints): weights are dequantized in registers
# and multiplied in the compute dtype, so nothing reads them.
_ACTIVATION = ("input_scale", "input_global_scale", "output_scale", "k_scale", "v_scale",
               "weight_shape")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)     # nibble i of an AWQ word holds column AWQ_ORDER[i]


class QuantTensorError(ValueError):
    """A checkpoint tensor of a quantized weight has the wrong dtype or shape."""


def convert(method: str, fmt: QuantFormat, suffix: str, t: torch.Tensor):
    if suffix in _ACTIVATION:
        return SKIP
    table = _TABLES[method]
    if suffix not in table:
        return None
    name, fn = table[suffix]
    return name, fn(t, fmt)


def _fp8_q(t, fmt):
    if t.dtype != torch.float8_e4m3fn:
        raise QuantTensorError(f"dtype {t.dtype}, expected float8_e4m3fn")
    return t


def _f32_scale(t, fmt):
    """fp8 scales: [Nb, Kb] blocks, [N, 1] or [N] per channel, [], [1] per tensor."""
    t = t.float()
    if fmt.kind == "fp8_channel" and t.dim() == 2 and t.shape[1] == 1:
        return t[:, 0]
    if fmt.kind == "fp8_tensor" and t.numel() == 1:
        return t.reshape(1)
    return t


def _u8(t, fmt):
    if t.dtype != torch.uint8:
        raise QuantTensorError(f"dtype {t.dtype}, expected uint8")
    return t


def _e4m3(t, fmt):
    if t.dtype != torch.float8_e4m3fn:
        raise QuantTensorError(f"dtype {t.dtype}, expected float8_e4m3fn")
    return t


def _global(t, fmt):
    return t.float().reshape(-1)[:1].clone() if t.numel() == 1 else _bad_numel(t)


def _global_reciprocal(t, fmt):
    """compressed-tensors stores NVFP4's global scale as the divisor: W = q * s / global."""
    return 1.0 / _global(t, fmt)


def _bad_numel(t):
    raise QuantTensorError(f"shape {tuple(t.shape)}, expected one element")


def unpack_int32(t: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words of 8 nibbles (nibble i at bits 4i) -> uint8 values, unpacked along dim."""
    if t.dtype != torch.int32:
        raise QuantTensorError(f"dtype {t.dtype}, expected int32")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    v = ((t.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)        # [..., 8]
    if dim in (-1, t.dim() - 1):
        return v.reshape(*t.shape[:-1], t.shape[-1] * 8)
    v = v.movedim(-1, dim + 1)                                      # word, then nibble, along dim
    shape = list(t.shape)
    shape[dim] *= 8
    return v.reshape(shape)


def pack_nibbles(v: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [..., K] -> [..., K/2], element 2j in the low nibble."""
    return (v[..., 0::2] | (v[..., 1::2] << 4)).to(torch.uint8)


def _ct_packed(t, fmt):
    """compressed-tensors weight_packed int32 [N, K/8] (nibble i = column 8w+i, values offset
    by 8 when signed): on a little-endian host its bytes already are the canonical nibbles."""
    return pack_nibbles(unpack_int32(t, -1))


def _ct_zero(t, fmt):
    """compressed-tensors weight_zero_point int32 [N/8, K/G], packed along the rows."""
    return unpack_int32(t, 0)


def _awq_cols(t: torch.Tensor) -> torch.Tensor:
    """AWQ int32 [R, C/8] -> uint8 [R, C] in natural column order."""
    v = unpack_int32(t, -1).reshape(t.shape[0], t.shape[1], 8)
    inverse = [AWQ_ORDER.index(i) for i in range(8)]
    return v[..., inverse].reshape(t.shape[0], -1)


def _awq_q(t, fmt):
    """qweight int32 [K, N/8] (W transposed) -> q [N, K/2]."""
    return pack_nibbles(_awq_cols(t).t().contiguous())


def _awq_z(t, fmt):
    """qzeros int32 [K/G, N/8] -> z [N, K/G]."""
    return _awq_cols(t).t().contiguous()


def _awq_s(t, fmt):
    """scales [K/G, N] -> s [N, K/G]."""
    return t.t().contiguous()


def _same(t, fmt):
    return t


def _mx_blocks(t, fmt):
    """gpt-oss `*_blocks` uint8 [..., R, K/32, 16] -> q [..., R, K/2]."""
    if t.dtype != torch.uint8 or t.shape[-1] != 16:
        raise QuantTensorError(f"dtype {t.dtype} shape {tuple(t.shape)}, expected uint8 [..., K/32, 16]")
    return t.reshape(*t.shape[:-2], t.shape[-2] * 16)


_TABLES = {
    "fp8": {"weight": ("q", _fp8_q), "weight_scale_inv": ("s", _f32_scale)},
    "compressed-tensors": {
        "weight": ("q", _fp8_q), "weight_scale": ("s", _f32_scale),       # float-quantized
        "weight_packed": ("q", None), "weight_zero_point": ("z", _ct_zero),
        "weight_global_scale": ("g", _global_reciprocal)},
    "modelopt": {"weight": ("q", None), "weight_scale": ("s", None), "weight_scale_2": ("g", _global)},
    "awq": {"qweight": ("q", _awq_q), "qzeros": ("z", _awq_z), "scales": ("s", _awq_s)},
    "mxfp4": {"blocks": ("q", _mx_blocks), "scales": ("s", _u8)},
}


def _by_format(fp8, nvfp4, int4):
    def fn(t, fmt):
        k = fmt.kind
        return (nvfp4 if k == "nvfp4" else int4 if k == "int4" else fp8)(t, fmt)
    return fn


# Suffixes whose meaning depends on the format (one method, several formats).
_TABLES["compressed-tensors"]["weight_packed"] = ("q", _by_format(_fp8_q, _u8, _ct_packed))
_TABLES["compressed-tensors"]["weight_scale"] = ("s", _by_format(_f32_scale, _e4m3, _same))
_TABLES["modelopt"]["weight"] = ("q", _by_format(_fp8_q, _u8, _u8))
_TABLES["modelopt"]["weight_scale"] = ("s", _by_format(_f32_scale, _e4m3, _same))
