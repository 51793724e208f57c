"""A prefill chunk's routed experts on AMX's bf16 tiles (cpu_amx.c, ft_moe_amx), in one call.

fused_moe hands a CPU bf16 bank's prefill chunks here first (GEMM_ROWS (token, expert) pairs an
expert and more, on a CPU with AMX-BF16): its int4 and fp8 banks' too, once their used experts
are decoded to bf16. Where this does not apply (a build without AMX, widths not multiples of
32, more than 64 experts a token) it returns None and the caller keeps torch's products
(fused_moe._moe_grouped_torch: one oneDNN product per expert and projection).

Against that path, one 512-token chunk of one layer (64 experts of [512, 1024] and [1024, 256],
top-8, 2-core Xeon, bf16): 10.5 ms against 24.7 (bench/cpu_moe.py). Its roundings are HF's
loop's (each product's output, the bias add, the activation, the weighting and each add of a
token's experts, in expert id order, to bf16); the products' float32 sums differ from
oneDNN's in the last bits where oneDNN splits K (on this CPU from K 512): ~0.1% of outputs
off by one bf16 step.
"""

from __future__ import annotations

import torch

from triton_kernels.cpu_native import ACTIVATIONS, NativeKernels


def moe_amx(kernel: NativeKernels, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
            topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            slot_map: torch.Tensor | None, b13: torch.Tensor | None, b2: torch.Tensor | None,
            activation) -> torch.Tensor | None:
    """x [T, D] bf16 through w13 [S, 2I, D] and w2 [S, D, I] bf16 (contiguous), biases
    [S, 2I] / [S, D] (any float dtype: used in bf16, as HF's loop adds them) or None,
    topk_ids [T, k] expert ids (slot_map [E] -> slots, or None) -> [T, D] bf16; None where
    the kernel does not take these shapes or this build has no AMX."""
    t, d = x.shape
    slots, width = w2.shape[0], w2.shape[2]
    if not (x.dtype == w13.dtype == w2.dtype == torch.bfloat16
            and tuple(w13.shape) == (slots, 2 * width, d) and tuple(w2.shape[:2]) == (slots, d)
            and w13.is_contiguous() and w2.is_contiguous() and activation.kind in ACTIVATIONS
            and d % 32 == 0 and width % 32 == 0 and topk_ids.dim() == 2
            and topk_ids.shape[1] <= 64 and topk_ids.shape[0] == t):
        return None
    x = x.contiguous()
    ids = topk_ids.contiguous().long()
    weights = topk_weights.float().contiguous()
    smap = None if slot_map is None else slot_map.contiguous().long()
    biases = [None if b is None else b.to(torch.bfloat16).contiguous() for b in (b13, b2)]
    k = ids.shape[1]
    scratch = kernel.kept_buffer("moe_amx", kernel.moe_amx_scratch(t, k, slots, d, width),
                                 torch.uint8)
    out = torch.empty_like(x)
    rc = kernel.moe_amx_fn(
        x.data_ptr(), ids.data_ptr(), 0 if smap is None else smap.data_ptr(),
        0 if smap is None else smap.numel(), weights.data_ptr(), t, k, w13.data_ptr(),
        w2.data_ptr(), *(0 if b is None else b.data_ptr() for b in biases), slots, d, width,
        ACTIVATIONS[activation.kind], activation.alpha, activation.limit,
        torch.get_num_threads(), scratch.data_ptr(), out.data_ptr())
    if rc == -2:
        raise ValueError(f"AMX MoE: an expert id is outside the slot map or maps outside the "
                         f"bank's {slots} slots")
    if rc == -4:
        raise MemoryError("AMX MoE: out of host memory for its routing tables")
    return out if rc == 0 else None
