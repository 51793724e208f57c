"""Gated DeltaNet (linear attention) over per-request state slots: Qwen3-Next, Qwen3.5/3.6.

Per token t of a sequence, with Hk key heads of Dk and Hv value heads of Dv (each key head
serves Hv/Hk consecutive value heads):
    q, k, v = silu(causal_conv1d([q | k | v] projections))     (W-wide depthwise conv)
    g = -exp(A_log) * softplus(a + dt_bias)   (log decay, per value head), beta = sigmoid(b)
    S = S * exp(g);  S += k^T (beta (v - k S));  o = (q / sqrt(Dk)) S   (q, k l2-normed)
    out = out_proj(rmsnorm(o) * w * silu(z))                   (the gated RMSNorm, per head)
The state S [Hv, Dk, Dv] (float32) and the conv's last W-1 inputs live in the request's slot
of this layer's pool (`batch.kv.layer(i)`, cache_spec.RecurrentStateSpec); a first prefill
chunk starts from zeros (batch.has_initial_state), later chunks and decodes carry on from the
slot, so chunked prefill and batched decode run in the same flat forward as attention.

Projections, as data: Qwen3.5 splits them (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a);
Qwen3-Next fuses them per key head (in_proj_qkvz: [q | k | v | z] per key head, in_proj_ba:
[b | a] per key head), un-interleaved here. Shapes: T tokens, D hidden, C conv channels.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

import triton_kernels as tk
from freetoken.engine.batch import ForwardBatch
from freetoken.engine.cache_spec import RecurrentStateSpec
from freetoken.models.layers.linear import Linear, pack_fused


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig:
    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4
    rms_norm_eps: float = 1e-6
    fused_projections: bool = False     # Qwen3-Next's in_proj_qkvz / in_proj_ba

    def __post_init__(self):
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear attention: {self.num_v_heads} value heads is not a multiple "
                             f"of {self.num_k_heads} key heads")
        if self.conv_kernel < 2:
            raise ValueError(f"linear attention: conv kernel {self.conv_kernel} must be >= 2")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


class GatedRMSNorm(nn.Module):
    """rmsnorm(x) * weight * silu(gate), per head: x, gate [N, Dv] (HF's RMSNormGated)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (tk.rms_norm(x, self.weight, self.eps) * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """HF's `linear_attn`: projections, conv1d, A_log / dt_bias, the gated norm, out_proj."""

    def __init__(self, cfg: LinearAttentionConfig, layer_idx: int):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        d, hv = cfg.hidden_size, cfg.num_v_heads
        if cfg.fused_projections:
            self.in_proj_qkvz = Linear(d, cfg.conv_dim + cfg.value_dim, bias=False)
            self.in_proj_ba = Linear(d, 2 * hv, bias=False)
        else:
            self.in_proj_qkv = Linear(d, cfg.conv_dim, bias=False)
            self.in_proj_z = Linear(d, cfg.value_dim, bias=False)
            self.in_proj_b = Linear(d, hv, bias=False)
            self.in_proj_a = Linear(d, hv, bias=False)
        # Depthwise: HF's nn.Conv1d weight [C, 1, W], no bias.
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.conv_kernel, groups=cfg.conv_dim,
                                bias=False)
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.norm = GatedRMSNorm(cfg.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(cfg.value_dim, d, bias=False)
        # On a CPU engine the input projections run as one packed product (pack_cpu;
        # linear.pack_for_cpu), and the conv and the delta rule as native calls.
        self.cpu_fused = (("in_proj_qkvz", "in_proj_ba") if cfg.fused_projections
                          else ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
        self.proj_widths = ((cfg.conv_dim + cfg.value_dim, 2 * hv) if cfg.fused_projections
                            else (cfg.conv_dim, cfg.value_dim, hv, hv))
        self.proj_packed: tk.CpuLinear | tk.Int4Linear | None = None
        self.cpu_native: tk.CpuGatedDelta | None = None
        self.cpu_decode: tk.GdnDecodeCall | None = None

    def pack_cpu(self) -> int:
        """CPU engine: the input projections as one product (pack_fused), and the conv and
        delta rule on the native kernels where they build (cpu_gated_delta.py); a decode
        step's whole layer between the projections in one native call (GdnDecodeCall) in a
        16-bit model. Returns the packed product's bytes (0: the projections are packed
        alone, or not at all)."""
        self.proj_packed = pack_fused([getattr(self, name) for name in self.cpu_fused])
        kernel = tk.native_kernels()
        if kernel is None:
            return 0 if self.proj_packed is None else self.proj_packed.nbytes
        c = self.cfg
        self.cpu_native = tk.CpuGatedDelta(kernel, self.conv1d.weight.squeeze(1))
        if (self.proj_packed is not None and kernel.handles(self.norm.weight.dtype)
                and 2 <= c.conv_kernel <= 16):                  # (the kernel's conv widths)
            self.cpu_decode = tk.GdnDecodeCall(
                kernel, self.conv1d.weight.squeeze(1), self.proj_layout(),
                sum(self.proj_widths), (c.num_k_heads, c.num_v_heads, c.head_k_dim, c.head_v_dim),
                -self.A_log.float().exp(), self.dt_bias, self.norm.weight, self.norm.eps,
                c.head_k_dim ** -0.5)
        return 0 if self.proj_packed is None else self.proj_packed.nbytes

    def proj_layout(self) -> tuple[int, ...]:
        """Where q, k, v, z, b and a lie in a row of the packed projections' output, as
        (offset, stride a key head) pairs in that order (ft_gdn_decode's `lay`)."""
        c = self.cfg
        r, dk, dv = c.num_v_heads // c.num_k_heads, c.head_k_dim, c.head_v_dim
        if c.fused_projections:                 # per key head [q | k | v | z], then [b | a]
            g, ba = 2 * dk + 2 * r * dv, c.conv_dim + c.value_dim
            return (0, g, dk, g, 2 * dk, g, 2 * dk + r * dv, g, ba, 2 * r, ba + r, 2 * r)
        kd, cd, vd = c.key_dim, c.conv_dim, c.value_dim     # [q | k | v], z, b, a
        return (0, dk, kd, dk, 2 * kd, r * dv, cd, r * dv, cd + vd, r, cd + vd + c.num_v_heads, r)

    def cache_spec(self) -> RecurrentStateSpec:
        c = self.cfg
        return RecurrentStateSpec(c.num_v_heads, c.head_k_dim, c.head_v_dim, c.conv_dim,
                                  c.conv_kernel)

    def _project(self, x: torch.Tensor):
        """x [T, D] -> (qkv [T, C] as [q heads | k heads | v heads], z [T, Hv*Dv], b, a [T, Hv])."""
        c, t = self.cfg, x.shape[0]
        if self.proj_packed is not None:
            outs = self.proj_packed(x).split(self.proj_widths, dim=-1)
        else:
            outs = [getattr(self, name)(x) for name in self.cpu_fused]
        if not c.fused_projections:
            return tuple(outs)
        r = c.num_v_heads // c.num_k_heads
        # Per key head: [q Dk | k Dk | v r*Dv | z r*Dv] and [b r | a r].
        q, k, v, z = outs[0].reshape(t, c.num_k_heads, -1).split(
            [c.head_k_dim, c.head_k_dim, r * c.head_v_dim, r * c.head_v_dim], dim=-1)
        b, a = outs[1].reshape(t, c.num_k_heads, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return qkv, z.reshape(t, -1), b.reshape(t, -1), a.reshape(t, -1)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        c, t = self.cfg, x.shape[0]
        state, conv_state = batch.kv.layer(self.layer_idx)
        # A CPU engine's decode step: the layer between its projections in one native call.
        if (self.cpu_decode is not None and batch.max_seqlen_q == 1
                and self.cpu_decode.takes(conv_state, state)):
            o = self.cpu_decode(self.proj_packed(x), conv_state, state, batch.state_slots,
                                batch.has_initial_state)
            return self.out_proj(o)
        qkv, z, b, a = self._project(x)
        seqs = (batch.state_slots, batch.cu_seqlens_q, batch.has_initial_state)
        native = self.cpu_native
        conv = None if native is None else native.conv1d(qkv, conv_state, *seqs)
        if conv is None:
            conv = tk.causal_conv1d(qkv.contiguous(), self.conv1d.weight.squeeze(1), None,
                                    conv_state, *seqs, activation="silu")
        qkv = conv                                                           # [T, C]
        q, k, v = qkv.split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
        q = q.reshape(t, c.num_k_heads, c.head_k_dim)
        k = k.reshape(t, c.num_k_heads, c.head_k_dim)
        v = v.reshape(t, c.num_v_heads, c.head_v_dim)
        beta = torch.sigmoid(b)                                              # [T, Hv]
        # float32 first: in half precision exp(A_log) * softplus could overflow to -inf.
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        o = None if native is None else native.rule(q, k, v, g, beta, state, *seqs,
                                                    c.head_k_dim ** -0.5)
        if o is None:
            o = tk.gated_delta_rule(q, k, v, g, beta, state, *seqs, c.head_k_dim ** -0.5,
                                    use_qk_l2norm=True)                      # [T, Hv, Dv]
        o = self.norm(o.reshape(-1, c.head_v_dim), z.reshape(-1, c.head_v_dim))
        return self.out_proj(o.reshape(t, c.value_dim))
