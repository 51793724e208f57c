"""A prefill chunk's routed experts on AMX's bf16 tiles (cpu_amx.c, ft_moe_amx), in one call.

fused_moe hands a CPU bank's prefill chunks here first (GEMM_ROWS (token, expert) pairs an
expert and more, on a CPU with AMX-BF16): bf16 banks read as they lie, int4 and fp8 banks from
their bytes, each work item's 32 rows decoded once into L2 as its reference decodes them.
Where this does not apply (a build without AMX, widths not multiples of 32, more than 64
experts a token, a slot map sending two routed ids to one slot) it returns None and the caller
keeps torch's products (fused_moe._moe_grouped_torch: one oneDNN product per expert and
projection).

One 512-token chunk of one layer, 2-core Xeon (`python bench/cpu_moe.py --tokens 512`, ms):
64 experts of [512, 1024] and [1024, 256], top-8 (bench/cpu.py's model): bf16 10-12 against
torch's 36 (3.0x); int4 g32 from its nibbles and fp8 from its bytes about as bf16 and as fp8's
bf16 copy. Qwen3-30B-A3B's layer (`--experts 128 --hidden 2048 --width 768`): bf16 79-94
against 179-238 (2.3-2.5x), int4 g32 69-82, fp8 from its bytes 120-123.

Its roundings are HF's loop's (each product's output, the bias add, the activation, the
weighting and each add of a token's experts, in expert id order, to bf16); the products'
float32 sums differ from oneDNN's in the last bits where oneDNN splits K (on this CPU from K
512): ~0.1% of outputs off by one bf16 step.
"""

from __future__ import annotations

import torch

from triton_kernels.cpu_native import (ACTIVATIONS, E4M3_FORMAT, NativeFp8Bank, NativeInt4Bank,
                                       NativeKernels, _int4_format)


# The most scratch a call keeps (a thread's, kept for the next: NativeKernels.kept_buffer;
# not in the host RAM plans): a 2048-token step of Qwen3-30B-A3B's experts takes ~100 MB, of
# DeepSeek-V3's ~370 MB; a longer step runs in slices.
SCRATCH_BYTES = 512 << 20


def moe_amx(kernel: NativeKernels, x: torch.Tensor, w13, w2, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, slot_map: torch.Tensor | None, b13: torch.Tensor | None,
            b2: torch.Tensor | None, activation) -> torch.Tensor | None:
    """x [T, D] bf16 through w13 [S, 2I, D] and w2 [S, D, I]: bf16 tensors (contiguous), or
    two NativeInt4Bank or two NativeFp8Bank, read from their bytes (each work item's 32 rows
    decoded once, as their reference decodes it: the bits of this kernel on their decoded
    bf16 copy); biases [S, 2I] / [S, D] (any float dtype: used in bf16, as HF's loop adds
    them) or None; topk_ids [T, k] expert ids (slot_map [E] -> slots, or None) -> [T, D]
    bf16. None where the kernel does not take these shapes or formats (or a slot map that
    sends two routed ids to one slot), or this build has no AMX; a ValueError for routing
    weights or biases of other shapes than the ids' and the banks'."""
    weights = _weights(w13, w2)
    t, d = x.shape
    if weights is None or not (
            x.dtype == torch.bfloat16 and weights[-2] == d and activation.kind in ACTIVATIONS
            and d % 32 == 0 and weights[-1] % 32 == 0 and topk_ids.dim() == 2
            and topk_ids.shape[1] <= 64 and topk_ids.shape[0] == t):
        return None
    *pointers, slots, _, width = weights
    if topk_weights.shape != topk_ids.shape or any(
            b is not None and tuple(b.shape) != shape
            for b, shape in ((b13, (slots, 2 * width)), (b2, (slots, d)))):
        raise ValueError(f"AMX MoE: weights [T, k] as the ids and biases [S, 2I] / [S, D] for "
                         f"{slots} slots of I {width}, D {d} expected, got weights "
                         f"{tuple(topk_weights.shape)}, ids {tuple(topk_ids.shape)}, biases "
                         f"{None if b13 is None else tuple(b13.shape)} / "
                         f"{None if b2 is None else tuple(b2.shape)}")
    x = x.contiguous()
    ids = topk_ids.contiguous().long()
    routing = topk_weights.float().contiguous()
    smap = None if slot_map is None else slot_map.contiguous().long()
    biases = [None if b is None else b.to(torch.bfloat16).contiguous() for b in (b13, b2)]
    k = ids.shape[1]
    # Tokens a call: as many as SCRATCH_BYTES of scratch holds (x and the activations packed
    # per pair: ~2 (D + I) bytes a pair), the step's tokens in slices beyond (a token's
    # output is its own routing's alone: the same bits).
    full = kernel.moe_amx_scratch(64, k, slots, d, width)
    per_token = max(1, full - kernel.moe_amx_scratch(63, k, slots, d, width))
    piece = max(64, (SCRATCH_BYTES - (full - 64 * per_token)) // per_token)
    scratch = kernel.kept_buffer(
        "moe_amx", kernel.moe_amx_scratch(min(t, piece), k, slots, d, width), torch.uint8)
    out = torch.empty_like(x)
    for t0 in range(0, t, piece):
        n = min(piece, t - t0)
        rc = kernel.moe_amx_fn(
            x[t0].data_ptr(), ids[t0].data_ptr(), 0 if smap is None else smap.data_ptr(),
            0 if smap is None else smap.numel(), routing[t0].data_ptr(), n, k, *pointers,
            *(0 if b is None else b.data_ptr() for b in biases), slots, d, width,
            ACTIVATIONS[activation.kind], activation.alpha, activation.limit,
            torch.get_num_threads(), scratch.data_ptr(), out[t0].data_ptr())
        if rc == -2:
            raise ValueError(f"AMX MoE: an expert id is outside the slot map or maps outside "
                             f"the bank's {slots} slots")
        if rc == -4:
            raise MemoryError("AMX MoE: out of host memory for its routing tables")
        if rc != 0:
            return None
    return out


def _weights(w13, w2) -> tuple | None:
    """The kernel's weight arguments (w13, w2, s13, s2, fmt, bn, bk) and (S, D, I), or None."""
    if isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor):
        slots, d, width = w2.shape if w2.dim() == 3 else (0, 0, 0)
        if not (w13.dtype == w2.dtype == torch.bfloat16 and w13.is_contiguous()
                and w2.is_contiguous() and tuple(w13.shape) == (slots, 2 * width, d)):
            return None
        return w13.data_ptr(), w2.data_ptr(), 0, 0, 0, 1, 1, slots, d, width
    if type(w13) is not type(w2) or not isinstance(w13, (NativeInt4Bank, NativeFp8Bank)):
        return None
    slots, d, width = w2.experts, w2.n, w2.k
    if (w13.experts, w13.n, w13.k) != (slots, 2 * width, d):
        return None
    if isinstance(w13, NativeFp8Bank):
        if w13.block != w2.block or w13.block[1] == 0:
            return None                     # (row scales: the kernel decodes blocks only)
        return (w13.q.data_ptr(), w2.q.data_ptr(), w13.s.data_ptr(), w2.s.data_ptr(),
                E4M3_FORMAT, *w13.block, slots, d, width)
    fmt = _int4_format(w13.gs, (slots, 2 * width, d // w13.group))
    if fmt is None or w2.group != w13.group or fmt != _int4_format(
            w2.gs, (slots, d, width // w2.group)):
        return None                         # (one scale form for both: the kernel takes one)
    return (w13.q.data_ptr(), w2.q.data_ptr(), w13.gs.data_ptr(), w2.gs.data_ptr(), fmt, 1,
            w13.group, slots, d, width)
