"""Rotary position embedding: NeoX layout (rotate_half: dims i and i + R/2 form a pair), as
Qwen and Mixtral use it, or interleaved (dims 2i and 2i + 1 form a pair: ERNIE, GLM's own
code, DeepSeek's rope part), both rotating pair i by position * inv_freq[i].

q: [T, Hq, D], k: [T, Hk, D], positions: [T] int, cos_sin: [P, R] float32 where the first R/2
columns are cos and the last R/2 are sin of position * inv_freq (R = rotary dim <= D; the
model builds this table once, per its rope type and scaling). Rotates the first R dims of
every head in place and returns (q, k). Like HF, the rotation is done in the input dtype.
"""

import torch

from triton_kernels._dispatch import tl, triton, use_triton


def apply_rope_reference(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                         cos_sin: torch.Tensor, interleaved: bool = False):
    half = cos_sin.shape[-1] // 2
    cs = cos_sin[positions][:, None]                     # [T, 1, R]
    cq = cs.to(q.dtype)                                  # converted once for q and k
    for x in (q, k):
        cx = cq if x.dtype == q.dtype else cs.to(x.dtype)
        c, s = cx[..., :half], cx[..., half:]            # [T, 1, R/2]
        rot = x[..., : 2 * half]
        if interleaved:
            pairs = rot.unflatten(-1, (half, 2))         # [T, H, R/2, 2]
            x1, x2 = pairs[..., 0], pairs[..., 1]
            pairs.copy_(torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))
        else:
            x1, x2 = rot[..., :half], rot[..., half:]
            rot.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))
    return q, k


@triton.jit
def _rotate_heads(x_ptr, stride_xt, stride_xh, tok, H, cos, sin, offs_r,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr):
    # Pair i of every head of one token, BLOCK_H heads at a time: dims (i, HALF + i), or
    # (2i, 2i + 1) when INTERLEAVED.
    mask_r = offs_r < HALF
    if INTERLEAVED:
        first, second = 2 * offs_r, 2 * offs_r + 1
    else:
        first, second = offs_r, HALF + offs_r
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = (offs_h < H)[:, None] & mask_r[None, :]
        head = x_ptr + tok * stride_xt + offs_h[:, None] * stride_xh
        x1 = tl.load(head + first[None, :], mask=mask, other=0.0)
        x2 = tl.load(head + second[None, :], mask=mask, other=0.0)
        # In the input dtype, product by product, as the reference's `x1 * c - x2 * s`.
        tl.store(head + first[None, :], x1 * cos - x2 * sin, mask=mask)
        tl.store(head + second[None, :], x2 * cos + x1 * sin, mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cos_sin_ptr,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_cs, Hq, Hk,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
                 INTERLEAVED: tl.constexpr):
    # One program per token: its cos/sin row is read once and applied to all q and k heads.
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_r, mask=mask_r, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_r, mask=mask_r, other=0.0)
    q_cos, q_sin = cos.to(q_ptr.dtype.element_ty)[None, :], sin.to(q_ptr.dtype.element_ty)[None, :]
    _rotate_heads(q_ptr, stride_qt, stride_qh, tok, Hq, q_cos, q_sin, offs_r, HALF, BLOCK_H,
                  INTERLEAVED)
    k_cos, k_sin = cos.to(k_ptr.dtype.element_ty)[None, :], sin.to(k_ptr.dtype.element_ty)[None, :]
    _rotate_heads(k_ptr, stride_kt, stride_kh, tok, Hk, k_cos, k_sin, offs_r, HALF, BLOCK_H,
                  INTERLEAVED)


def apply_rope_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                      cos_sin: torch.Tensor, interleaved: bool = False):
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"apply_rope: q [T, Hq, D] and k [T, Hk, D] expected, got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    t, _, d = q.shape
    rot = cos_sin.shape[1]
    if rot % 2 or rot > d:
        raise ValueError(f"apply_rope: rotary dim {rot} must be even and <= head dim {d}")
    if positions.shape != (t,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"apply_rope: positions must be [{t}] int32/int64, got "
                         f"{tuple(positions.shape)} {positions.dtype}")
    if q.stride(2) != 1 or k.stride(2) != 1 or cos_sin.stride(1) != 1:
        raise ValueError("apply_rope: q, k and cos_sin need a contiguous last dimension")
    if t == 0:
        return q, k
    half = rot // 2
    block_r = triton.next_power_of_2(half)
    # About 4K elements a tile: enough to keep loads in flight without spilling.
    block_h = max(1, min(triton.next_power_of_2(max(q.shape[1], k.shape[1])), 4096 // block_r))
    _rope_kernel[(t,)](
        q, k, positions.contiguous(), cos_sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0),
        q.shape[1], k.shape[1], HALF=half, BLOCK_H=block_h, BLOCK_R=block_r,
        INTERLEAVED=bool(interleaved), num_warps=4)
    return q, k


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
               interleaved: bool = False):
    if use_triton(q):
        return apply_rope_triton(q, k, positions, cos_sin, interleaved)
    return apply_rope_reference(q, k, positions, cos_sin, interleaved)
