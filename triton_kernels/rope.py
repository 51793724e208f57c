"""Rotary position embedding, NeoX layout (rotate_half), as Qwen and Mixtral use it.

q: [T, Hq, D], k: [T, Hk, D], positions: [T] int, cos_sin: [P, R] float32 where the first R/2
columns are cos and the last R/2 are sin of position * inv_freq (R = rotary dim <= D; the
model builds this table once, per its rope type and scaling). Rotates the first R dims of
every head in place and returns (q, k). Like HF, the rotation is done in the input dtype.
"""

import torch

from triton_kernels._dispatch import use_triton


def apply_rope_reference(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                         cos_sin: torch.Tensor):
    half = cos_sin.shape[-1] // 2
    cs = cos_sin[positions]                              # [T, R]
    cos = torch.cat([cs[:, :half], cs[:, :half]], -1)[:, None, :]  # [T, 1, R]
    sin = torch.cat([cs[:, half:], cs[:, half:]], -1)[:, None, :]
    for x in (q, k):
        rot = x[..., : 2 * half]
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        x1, x2 = rot[..., :half], rot[..., half:]
        rotated = torch.cat((-x2, x1), dim=-1)
        rot.copy_(rot * c + rotated * s)
    return q, k


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor):
    if use_triton(q):
        return apply_rope_triton(q, k, positions, cos_sin)
    return apply_rope_reference(q, k, positions, cos_sin)
