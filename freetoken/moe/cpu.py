"""Experts computed on the CPU straight from the host banks, with torch matmuls.

The arithmetic is triton_kernels.fused_moe_reference's, expert by expert in ascending id, so a
layer computed here with every expert equals the reference bit for bit; `experts` restricts
the work to some of them (the hybrid backend's share).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def cpu_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, experts: list[int] | None = None) -> torch.Tensor:
    """x [T, D], w13 [E, 2I, D], w2 [E, D, I], topk [T, k], all host tensors -> [T, D]."""
    out = torch.zeros_like(x)
    chosen = torch.unique(topk_ids).tolist() if experts is None else sorted(experts)
    for e in chosen:
        token_idx, pos = torch.where(topk_ids == e)
        if token_idx.numel() == 0:
            continue
        gate, up = F.linear(x[token_idx], w13[e]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, w2[e])
        h = h * topk_weights[token_idx, pos, None].to(h.dtype)
        out.index_add_(0, token_idx, h.to(out.dtype))
    return out


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Run the block with n intra-op threads (None: leave torch's setting)."""
    old = torch.get_num_threads()
    if n is None or n == old:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
