"""An attention layer's decode step on a CPU engine in one native call (cpu_attention.c):
q/k RMSNorm per head, RoPE, the K/V write and paged attention (window, sinks) for a batch of
sequences of one new token each. Its reference is the torch path it replaces (rms_norm,
apply_rope, write_kv, paged_attention_reference), to float32's order of sums and one
rounding where HF rounds after each op.

A 2-core Xeon, the bench model (16/4 heads of 64): torch's ops took ~0.4 ms a layer for
that step (~40 ops, a few us of dispatch each), the native call ~0.02 ms.
"""

from __future__ import annotations

import torch

from triton_kernels.cpu_native import NativeKernels


class CpuDecodeAttention:
    """What one layer's step needs besides the batch, formed once: heads (Hq, Hk, Dh), the q
    and k norms' scales ([Dh] float32, their offset applied; None: no norm), the softmax
    scale, the window and the sinks ([Hq] float32 or None); gated: q_proj yields [q | gate]
    per head (Qwen3-Next/3.5), the output multiplied by sigmoid(gate) after (cpu_gates.c);
    whole_norms: (wq [Hq Dh], wk [Hk Dh]) in the model's dtype, q and k RMS-normed across
    their heads before the per-head steps (OLMoE, MiniMax-M2), and clip: q, k and v clamped
    to +-clip after (OLMoE), both in place on qkv (cpu_gates.c's ft_qkv_whole)."""

    def __init__(self, kernel: NativeKernels, heads: tuple[int, int, int],
                 q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                 scale: float, window: int | None, sinks: torch.Tensor | None,
                 interleaved: bool, gated: bool = False,
                 whole_norms: tuple[torch.Tensor, torch.Tensor] | None = None,
                 clip: float | None = None):
        self.kernel, self.heads, self.eps, self.scale = kernel, heads, eps, scale
        self.q_norm, self.k_norm = (None if w is None else w.detach().float().contiguous()
                                    for w in (q_norm, k_norm))
        self.sinks = None if sinks is None else sinks.detach().float().contiguous()
        self.window, self.interleaved, self.gated = window, interleaved, gated
        self.whole_norms, self.clip = whole_norms, clip
        self.whole = whole_norms is not None or clip is not None
        if gated and self.whole:        # (ft_qkv_whole reads q and k unbroken by gates)
            raise ValueError("native decode attention: an output gate with q/k norms across "
                             "heads or clipping is not a layout the calls take")
        # the kernel call with these constants, checked once (cpu_native.AttnCall)
        self.call = kernel.bind_attn(heads, self.q_norm, self.k_norm, eps, interleaved, window,
                                     self.sinks, scale, gated)

    def whole_op(self, qkv: torch.Tensor):
        """The whole-width steps as a program's op, in place on its qkv [R, width]."""
        hq, hk, dh = self.heads
        return self.kernel.qkv_whole_op(qkv, hq * dh, hk * dh, self.whole_norms, self.eps,
                                        self.clip)

    def takes(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """Whether the call reads and writes these caches (cpu_native.AttnCall.takes: 16-bit
        or float32 [NB, BS, Hk, Dh]; an fp8 cache keeps the torch path)."""
        return self.call.takes(k_cache, v_cache)

    def __call__(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """qkv [B, (Hq + 2Hk) Dh] ([B, (2Hq + 2Hk) Dh] gated) -> attention output [B, Hq Dh]
        in qkv's dtype."""
        qkv = qkv.contiguous()
        if self.whole:
            hq, hk, dh = self.heads
            self.kernel.qkv_whole(qkv, hq * dh, hk * dh, self.whole_norms, self.eps, self.clip)
        o = self.call(qkv, cos_sin, positions, k_cache, v_cache, slot_mapping, block_tables,
                      seq_lens)
        if self.gated:
            hq, _, dh = self.heads
            self.kernel.sigmoid_gate(o, qkv, hq, dh)
        return o
