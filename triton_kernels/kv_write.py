"""Write new keys and values into the paged KV cache.

k, v: [T, Hk, D]; k_cache, v_cache: [NB, BS, Hk, D] (NB blocks of BS token slots);
slot_mapping: [T] int64 flat slot index (block * BS + offset) per token; -1 skips a token.
"""

import torch

from triton_kernels._dispatch import tl, triton, use_triton


def write_kv_reference(k, v, k_cache, v_cache, slot_mapping):
    k_flat, v_flat = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    # The engine's batches: one index_copy_ per cache (the CPU writes with this: ~4x cheaper
    # than the masked form's index and index_put; it has no kernel for 8-bit caches).
    if k_cache.element_size() > 1 and bool((slot_mapping >= 0).all()):
        k_flat.index_copy_(0, slot_mapping.long(), k.to(k_cache.dtype))
        v_flat.index_copy_(0, slot_mapping.long(), v.to(v_cache.dtype))
        return
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_flat[slots] = k[keep].to(k_cache.dtype)
    v_flat[slots] = v[keep].to(v_cache.dtype)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,
                     Hk, D, BS, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per token: all Hk heads of its key and value, BLOCK_H heads at a time.
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    block = slot // BS
    offset = slot % BS
    offs_d = tl.arange(0, BLOCK_D)
    k_dst = k_cache_ptr + block * stride_kc_b + offset * stride_kc_s
    v_dst = v_cache_ptr + block * stride_vc_b + offset * stride_vc_s
    for h0 in range(0, Hk, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = (offs_h < Hk)[:, None] & (offs_d < D)[None, :]
        key = tl.load(k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :],
                      mask=mask)
        tl.store(k_dst + offs_h[:, None] * stride_kc_h + offs_d[None, :],
                 key.to(k_cache_ptr.dtype.element_ty), mask=mask)
        val = tl.load(v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
                      mask=mask)
        tl.store(v_dst + offs_h[:, None] * stride_vc_h + offs_d[None, :],
                 val.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(k, v, k_cache, v_cache, slot_mapping):
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"write_kv: k and v must both be [T, Hk, D], got {tuple(k.shape)} "
                         f"and {tuple(v.shape)}")
    t, hk, d = k.shape
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or tuple(k_cache.shape[2:]) != (hk, d):
        raise ValueError(f"write_kv: caches must be [NB, BS, {hk}, {d}], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if slot_mapping.shape != (t,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"write_kv: slot_mapping must be [{t}] int32/int64, got "
                         f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    if any(x.stride(-1) != 1 for x in (k, v, k_cache, v_cache)):
        raise ValueError("write_kv: k, v and the caches need a contiguous last dimension")
    if t == 0:
        return
    block_d = triton.next_power_of_2(d)
    block_h = max(1, min(triton.next_power_of_2(hk), 2048 // block_d))
    _write_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping.contiguous(),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        hk, d, k_cache.shape[1], BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4)


def write_kv(k, v, k_cache, v_cache, slot_mapping):
    if use_triton(k):
        return write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    return write_kv_reference(k, v, k_cache, v_cache, slot_mapping)
