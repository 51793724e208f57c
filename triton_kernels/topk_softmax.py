"""MoE routing: softmax over the router logits in float32, top-k, optional renormalisation.

logits: [T, E] -> (weights [T, k] float32, ids [T, k] int64). Matches Hugging Face's routers:
softmax first, then top-k of the probabilities, then (renormalize) divide by their sum.
"""

import torch

from triton_kernels._dispatch import tl, triton, use_triton


def topk_softmax_reference(logits: torch.Tensor, top_k: int, renormalize: bool):
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@triton.jit(do_not_specialize=["T"])
def _topk_softmax_kernel(logits_ptr, w_ptr, ids_ptr, T, E, stride_lt, stride_le,
                         K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    # A [BLOCK_T, BLOCK_E] tile of rows per program; k rounds of argmax pick the top k.
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, BLOCK_E)
    mask_t = offs_t < T
    mask_e = offs_e < E
    ptrs = logits_ptr + offs_t.to(tl.int64)[:, None] * stride_lt + offs_e[None, :] * stride_le
    x = tl.load(ptrs, mask=mask_t[:, None] & mask_e[None, :], other=float("-inf"))
    x = tl.where(mask_t[:, None], x.to(tl.float32), 0.0)   # keep padding rows finite
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    # Padding experts sit at -1, below every probability, so they are never picked.
    p = tl.where(mask_e[None, :], p, -1.0)
    offs_k = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    top_id = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.argmax(p, axis=1)                              # ties: lowest expert id
        best_p = tl.max(p, axis=1)
        top_w = tl.where(offs_k[None, :] == j, best_p[:, None], top_w)
        top_id = tl.where(offs_k[None, :] == j, best[:, None], top_id)
        p = tl.where(offs_e[None, :] == best[:, None], -2.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]
    out_offs = offs_t.to(tl.int64)[:, None] * K + offs_k[None, :]
    out_mask = mask_t[:, None] & (offs_k < K)[None, :]
    tl.store(w_ptr + out_offs, top_w, mask=out_mask)
    tl.store(ids_ptr + out_offs, top_id.to(tl.int64), mask=out_mask)


def topk_softmax_triton(logits: torch.Tensor, top_k: int, renormalize: bool):
    if logits.dim() != 2:
        raise ValueError(f"topk_softmax: logits must be [T, E], got {tuple(logits.shape)}")
    t, e = logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"topk_softmax: top_k {top_k} must be in 1..{e}")
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    block_e = triton.next_power_of_2(e)
    # About 2K logits a program: 16 rows of 128 experts, 8 of 256.
    block_t = max(1, min(16, 2048 // block_e))
    _topk_softmax_kernel[(triton.cdiv(t, block_t),)](
        logits, weights, ids, t, e, logits.stride(0), logits.stride(1),
        K=top_k, RENORMALIZE=bool(renormalize), BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k), num_warps=4)
    return weights, ids


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool):
    if use_triton(logits):
        return topk_softmax_triton(logits, top_k, renormalize)
    return topk_softmax_reference(logits, top_k, renormalize)
