"""Mixture-of-experts FFN over routed tokens.

x: [T, D]; w13: [S, 2I, D] (gate rows then up rows, per expert slot); w2: [S, D, I];
topk_weights: [T, k] (any float dtype; applied in x's dtype); topk_ids: [T, k] expert ids.
slot_map: optional [E] int tensor mapping expert id -> slot in w13/w2 (the GPU expert cache's
pool); None means slot == expert id. Returns [T, D] = sum_j w_j * down(silu(gate) * up).
"""

import torch
import torch.nn.functional as F

from triton_kernels._dispatch import use_triton


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        slot_map: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.zeros_like(x)
    flat_ids = topk_ids.reshape(-1)
    # Group (token, k) pairs by expert so each expert runs one matmul, like HF's loop.
    for e in torch.unique(flat_ids).tolist():
        token_idx, pos = torch.where(topk_ids == e)
        slot = e if slot_map is None else int(slot_map[e])
        h = x[token_idx]
        gate, up = F.linear(h, w13[slot]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, w2[slot])
        h = h * topk_weights[token_idx, pos, None].to(h.dtype)
        out.index_add_(0, token_idx, h.to(out.dtype))
    return out


def fused_moe(x, w13, w2, topk_weights, topk_ids, slot_map=None):
    if use_triton(x):
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, slot_map)
    return fused_moe_reference(x, w13, w2, topk_weights, topk_ids, slot_map)
