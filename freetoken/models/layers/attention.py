"""Self-attention over the paged KV cache, configured by data: GQA, q/k/v and o biases, q/k
RMSNorm per head or across all heads (zero-centred or not), partial rotary, a sliding window,
per-head sinks, a sigmoid output gate (Qwen3-Next/Qwen3.5: q_proj also yields the gate).

Each layer declares what it keeps (`cache_spec()`), the engine allocates it, and the forward
reads its pool from the batch (`batch.kv.layer(i)`). Shapes: T tokens, D hidden, Hq/Hk query
and kv heads of Dh.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

import triton_kernels as tk
from freetoken.engine.batch import ForwardBatch
from freetoken.engine.cache_spec import AttentionSpec
from freetoken.models.layers.linear import Linear, pack_fused
from freetoken.models.layers.norm import RMSNorm
from freetoken.models.rope import RopeTable


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None          # None, "head" (qwen3: per head) or "all" (olmoe, minimax)
    sliding_window: int | None = None   # attend to the last W positions (gpt-oss's even layers)
    sinks: bool = False                 # gpt-oss: a learned logit per head in the softmax
    clip_qkv: float | None = None       # olmoe: clamp q, k, v (after the norms) to +-clip
    rope_interleaved: bool = False      # ERNIE: rotate dims (2i, 2i+1), not (i, i + R/2)
    # Qwen3-Next/Qwen3.5: q_proj yields [q | gate] per head ([T, H, 2*Dh]); the output is
    # o * sigmoid(gate) before o_proj.
    output_gate: bool = False
    qk_norm_offset: float = 0.0         # 1.0: zero-centred q/k norms (scale 1 + w)

    def __post_init__(self):
        if self.qk_norm not in (None, "head", "all"):
            raise ValueError(f"qk_norm must be None, 'head' or 'all', got {self.qk_norm!r}")


class Attention(nn.Module):
    # On a CPU engine q, k and v run as one packed product (pack_cpu; linear.pack_for_cpu).
    cpu_fused = ("q_proj", "k_proj", "v_proj")

    def __init__(self, cfg: AttentionConfig, layer_idx: int, rope: RopeTable):
        super().__init__()
        self.cfg, self.layer_idx, self.rope = cfg, layer_idx, rope
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = self.head_dim ** -0.5
        d, hd = cfg.hidden_size, self.head_dim
        q_width = self.num_heads * hd * (2 if cfg.output_gate else 1)
        self.q_proj = Linear(d, q_width, bias=cfg.qkv_bias)
        self.k_proj = Linear(d, self.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = Linear(d, self.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.num_heads * hd, d, bias=cfg.o_bias)
        self.q_norm = self.k_norm = None
        off = cfg.qk_norm_offset
        if cfg.qk_norm == "head":
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, off)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, off)
        elif cfg.qk_norm == "all":
            self.q_norm = RMSNorm(self.num_heads * hd, cfg.rms_norm_eps, off)
            self.k_norm = RMSNorm(self.num_kv_heads * hd, cfg.rms_norm_eps, off)
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if cfg.sinks else None
        self.qkv_packed: tk.CpuLinear | tk.Int4Linear | None = None
        self.qkv_widths = (q_width, self.num_kv_heads * hd, self.num_kv_heads * hd)
        self.cpu_decode: tk.CpuDecodeAttention | None = None
        self.cpu_prefill: tk.CpuPrefillAttention | None = None

    def pack_cpu(self) -> int:
        """CPU engine: q, k and v as one product [(Hq' + 2Hk)*Dh, D] (linear.pack_fused: one
        GEMV a layer instead of three). Returns its bytes (0: they are packed alone, or not
        at all)."""
        self.qkv_packed = pack_fused([self.q_proj, self.k_proj, self.v_proj])
        self.cpu_decode = self._native_decode()
        kernel = tk.native_kernels()
        if kernel is not None:          # other steps' attention (on AMX tiles where it can)
            self.cpu_prefill = tk.CpuPrefillAttention(
                kernel, (self.num_heads, self.num_kv_heads), self.scale, self.cfg.sliding_window,
                self.sinks)
        return 0 if self.qkv_packed is None else self.qkv_packed.nbytes

    def _native_decode(self) -> tk.CpuDecodeAttention | None:
        """A decode step after the fused product in native calls (cpu_attention.py): the
        whole-width steps (q/k norms across heads, clipping: in place on qkv), per-head q/k
        norms, RoPE, the K/V write and attention, the output gate (read in qkv: its q heads
        skip each head's gate). None in a model the native calls do not take (not 16-bit)."""
        cfg, kernel = self.cfg, tk.native_kernels()
        if kernel is None or self.qkv_packed is None:
            return None
        q_w, k_w = ((None if n is None or cfg.qk_norm != "head" else n.weight if not n.offset
                     else (n.offset + n.weight.float()).to(n.weight.dtype))
                    for n in (self.q_norm, self.k_norm))
        o_proj = self.o_proj
        dtype = o_proj.weight.dtype if isinstance(o_proj, Linear) else o_proj.dtype
        if not kernel.handles(dtype):
            return None
        norms = (None if cfg.qk_norm != "all" else
                 tuple(n.scale().detach().contiguous() for n in (self.q_norm, self.k_norm)))
        if cfg.output_gate and (norms is not None or cfg.clip_qkv is not None):
            return None                 # (no family has both: CpuDecodeAttention refuses it)
        return tk.CpuDecodeAttention(
            kernel, (self.num_heads, self.num_kv_heads, self.head_dim), q_w, k_w,
            cfg.rms_norm_eps, self.scale, cfg.sliding_window, self.sinks,
            cfg.rope_interleaved, cfg.output_gate, norms, cfg.clip_qkv)

    def cache_spec(self) -> AttentionSpec:
        return AttentionSpec(self.num_kv_heads, self.head_dim, self.head_dim,
                             self.cfg.sliding_window)

    def _whole_width_steps(self, q, k, v, t: int):
        """[T, H*Dh] q, k, v -> (q, k, v, gate): the output gate split off q ([T, H, 2*Dh] ->
        q, gate [T, H*Dh]), q/k norms across all heads, clipping."""
        gate = None
        if self.cfg.output_gate:
            q, gate = q.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            q, gate = q.reshape(t, -1), gate.reshape(t, -1)
        if self.cfg.qk_norm == "all":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.cfg.clip_qkv is not None:
            c = self.cfg.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        return q, k, v, gate

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t, hd = x.shape[0], self.head_dim
        k_cache, v_cache = batch.kv.layer(self.layer_idx)
        qkv = None                      # (cpu_decode is bound only beside qkv_packed)
        if self.qkv_packed is not None:                               # [T, H*Dh] views
            qkv = self.qkv_packed(x)
            q, k, v = qkv.split(self.qkv_widths, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [T, H*Dh]
        # A CPU engine's pure decode step: native calls after the fused product.
        if (self.cpu_decode is not None and batch.max_seqlen_q == 1
                and self.cpu_decode.takes(k_cache, v_cache)):
            o = self.cpu_decode(qkv, batch.positions, self.rope.cos_sin, k_cache, v_cache,
                                batch.slot_mapping, batch.block_tables, batch.seq_lens)
            return self.o_proj(o)
        q, k, v, gate = self._whole_width_steps(q, k, v, t)
        q = q.view(t, self.num_heads, hd)
        k = k.view(t, self.num_kv_heads, hd)
        v = v.view(t, self.num_kv_heads, hd)
        if self.cfg.qk_norm == "head":
            q = self.q_norm(q.reshape(-1, hd)).view_as(q)
            k = self.k_norm(k.reshape(-1, hd)).view_as(k)
        q, k = q.contiguous(), k.contiguous()
        tk.apply_rope(q, k, batch.positions, self.rope.cos_sin, self.cfg.rope_interleaved)
        tk.write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        extra = {}
        if self.cfg.sliding_window is not None:
            extra["sliding_window"] = self.cfg.sliding_window
        if self.sinks is not None:
            extra["sinks"] = self.sinks
        o = None
        if self.cpu_prefill is not None:        # None where it does not take these caches
            o = self.cpu_prefill(q, k_cache, v_cache, batch.block_tables, batch.cu_seqlens_q,
                                 batch.seq_lens)
        if o is None:
            o = tk.paged_attention(q, k_cache, v_cache, batch.block_tables,
                                   batch.cu_seqlens_q, batch.seq_lens, self.scale,
                                   batch.max_seqlen_q, **extra)
        o = o.reshape(t, self.num_heads * hd)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)
