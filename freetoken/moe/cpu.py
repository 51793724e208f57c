"""Experts computed on the CPU straight from the host banks, with torch matmuls.

The arithmetic is the layout's torch reference (triton_kernels.fused_moe_reference), so a layer
computed here with every expert equals the reference; `experts` restricts the work to some of
them (the hybrid backend's share): the other (token, expert) pairs are dropped before it runs.
"""

from __future__ import annotations

import contextlib

import torch

from freetoken.moe.layout import ExpertLayout


def cpu_moe(layout: ExpertLayout, x: torch.Tensor, bank: dict[str, torch.Tensor],
            topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            experts: list[int] | None = None) -> torch.Tensor:
    """x [T, D], bank {name: [E, *shape]}, topk [T, k], all host tensors -> [T, D]."""
    if experts is None:
        return layout.run_reference(x, bank, topk_weights, topk_ids)
    chosen = torch.isin(topk_ids, torch.tensor(sorted(experts), dtype=topk_ids.dtype))
    if x.shape[0] == 1:
        # One token (decode at batch 1, hybrid's usual step): its chosen pairs are a routing
        # of their own, one call as the full path makes (one row of P one-expert tokens cost
        # ~1.6x: 1.72 ms against 1.10 for 6 experts of [1536, 2048] on 2 cores).
        keep = chosen[0]
        if not keep.any():
            return torch.zeros_like(x)
        return layout.run_reference(x, bank, topk_weights[:, keep], topk_ids[:, keep])
    # Only the (token, expert) pairs routed to `experts`, one row each: [P, D] through the
    # reference as P one-expert tokens, then summed into their tokens.
    token, pos = torch.where(chosen)
    out = torch.zeros_like(x)
    if token.numel():
        rows = layout.run_reference(x[token], bank, topk_weights[token, pos, None],
                                    topk_ids[token, pos, None])
        out.index_add_(0, token, rows)
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
