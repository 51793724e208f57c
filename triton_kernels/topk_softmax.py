"""MoE routing: softmax over the router logits in float32, top-k, optional renormalisation.

logits: [T, E] -> (weights [T, k] float32, ids [T, k] int64). Matches Hugging Face's routers:
softmax first, then top-k of the probabilities, then (renormalize) divide by their sum.
"""

import torch

from triton_kernels._dispatch import use_triton


def topk_softmax_reference(logits: torch.Tensor, top_k: int, renormalize: bool):
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool):
    if use_triton(logits):
        return topk_softmax_triton(logits, top_k, renormalize)
    return topk_softmax_reference(logits, top_k, renormalize)
