"""Multi-head latent attention (DeepSeek-V3, Kimi-K2, GLM-4.7-Flash) over a paged latent cache.

DeepSeek-V2 has the same attention, but its family (softmax router) is not built.

Per token the layer keeps one row shared by every head: latent = [c_kv | k_pe], c_kv the
normed compressed KV (L = kv_lora_rank) and k_pe the rotated shared rope key (R =
qk_rope_head_dim). kv_b_proj [H*(N+V), L] expands c_kv into each head's no-rope key (W_UK
[H, N, L]) and value (W_UV [H, V, L]).

Two equal ways to attend (the choice is per sequence, by arithmetic cost):
- absorbed: W_UK folded into the query (q_abs = q_nope @ W_UK [T, H, L]), attention over the
  latents themselves as one shared key [c_kv | k_pe] and value c_kv, then W_UV applied to the
  output: no per-token decompression, which is what makes decode cheap;
- decompressed: the sequence's latents expanded into per-head K [ctx, H, N+R] and V [ctx, H, V]
  once, then ordinary attention: cheaper for a long prefill chunk over a short cached prefix,
  whose queries would each pay for the absorbed form's wider heads.

Shapes: T tokens, D hidden, H heads, N qk_nope_head_dim, R qk_rope_head_dim, V v_head_dim,
L kv_lora_rank, Q q_lora_rank.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

import triton_kernels as tk
from freetoken.engine.batch import ForwardBatch
from freetoken.engine.cache_spec import LatentSpec
from freetoken.models.layers.linear import Linear
from freetoken.models.layers.norm import RMSNorm
from freetoken.models.rope import RopeTable

# Hugging Face builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps, not the
# config's rms_norm_eps.
LORA_NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None         # None: one q_proj (DeepSeek-V2-Lite), else q_a -> norm -> q_b
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    bias: bool = False              # attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj
    rope_interleaved: bool = True   # rope_interleave: pairs (2i, 2i+1) of the rope part
    softmax_mscale: float = 1.0     # YaRN's mscale^2 on the softmax scale (rope.softmax_mscale)

    def __post_init__(self):
        for name in ("num_heads", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"MLA: {name} must be positive, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLA: qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"MLA: q_lora_rank must be positive or null, got {self.q_lora_rank}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class MlaAttention(nn.Module):
    # kv_b_proj is read only as a matrix (kv_b_weight), never called: pack_for_cpu leaves it.
    matrix_only = ("kv_b_proj",)

    def __init__(self, cfg: MlaConfig, layer_idx: int, rope: RopeTable):
        super().__init__()
        self.cfg, self.layer_idx, self.rope = cfg, layer_idx, rope
        d, h, qk = cfg.hidden_size, cfg.num_heads, cfg.qk_head_dim
        self.num_heads = h
        self.scale = qk ** -0.5 * cfg.softmax_mscale
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(d, h * qk, bias=False)
        else:
            self.q_a_proj = Linear(d, cfg.q_lora_rank, bias=cfg.bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = Linear(cfg.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                            bias=cfg.bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                   bias=False)
        self._kv_b_decoded: torch.Tensor | None = None     # kv_b_weight() of a quantized kv_b_proj
        self.o_proj = Linear(h * cfg.v_head_dim, d, bias=cfg.bias)
        self.cpu_prefill: tk.CpuPrefillAttention | None = None
        self.cpu_decode: tk.CpuMlaDecode | None = None

    def bind_cpu(self) -> None:
        """CPU engine (linear.pack_for_cpu calls this): a decode step from the projections'
        outputs to o_proj's input in one native call (cpu_mla.py) in a 16-bit model; the
        decompressed prefill's attention in another (cpu_prefill_attention.py,
        CpuPrefillAttention.dense: on AMX tiles where the CPU has them, else in vector
        registers)."""
        kernel = tk.native_kernels()
        if kernel is None:
            return
        c, w = self.cfg, self.kv_b_weight()
        if kernel.handles(w.dtype) and self.kv_a_layernorm.weight.dtype == w.dtype:
            self.cpu_decode = tk.CpuMlaDecode(
                kernel, (self.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim,
                         c.kv_lora_rank, c.v_head_dim),
                self.kv_a_layernorm.scale(), LORA_NORM_EPS, w, self.scale, c.rope_interleaved)
        self.cpu_prefill = tk.CpuPrefillAttention(
            kernel, (self.num_heads, self.num_heads), self.scale, None, None)

    def cache_spec(self) -> LatentSpec:
        return LatentSpec(self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim)

    # -- projections ---------------------------------------------------------------------
    def _query(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> q [T, H, N+R] (rope not yet applied)."""
        if self.cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.num_heads, self.cfg.qk_head_dim)

    def _latent(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> latent [T, L+R]: normed c_kv, then k_pe (rope not yet applied)."""
        kv = self.kv_a_proj_with_mqa(x)
        lr = self.cfg.kv_lora_rank
        return torch.cat([self.kv_a_layernorm(kv[:, :lr].contiguous()), kv[:, lr:]], dim=-1)

    def kv_b_weight(self) -> torch.Tensor:
        """kv_b_proj's weight [H*(N+V), L] as a matrix in the compute dtype. Both attention
        forms multiply by pieces of it, so a quantized kv_b_proj (DeepSeek-V3 ships FP8) is
        decoded once, on first use, and kept (H*(N+V)*L values a layer: 32 MB in bf16 for
        DeepSeek-V3, as the absorbed form needs it anyway)."""
        if isinstance(self.kv_b_proj, nn.Linear):
            return self.kv_b_proj.weight
        if self._kv_b_decoded is None:
            dtype = self.kv_a_layernorm.weight.dtype
            self._kv_b_decoded = self.kv_b_proj.dequantized(dtype)
        return self._kv_b_decoded

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight split per head: W_UK [H, N, L], W_UV [H, V, L]."""
        c = self.cfg
        w = self.kv_b_weight().view(self.num_heads, c.qk_nope_head_dim + c.v_head_dim,
                                       c.kv_lora_rank)
        return w[:, :c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        c, t = self.cfg, x.shape[0]
        (latent_cache,) = batch.kv.layer(self.layer_idx)
        # A CPU engine's decode step: one native call between the projections and o_proj.
        if (self.cpu_decode is not None and batch.max_seqlen_q == 1
                and self.cpu_decode.takes(latent_cache)):
            o = self.cpu_decode(self._query(x).reshape(t, -1), self.kv_a_proj_with_mqa(x),
                                batch.positions, self.rope.cos_sin, latent_cache,
                                batch.slot_mapping, batch.block_tables, batch.seq_lens)
            return self.o_proj(o)
        q, latent = self._query(x), self._latent(x)
        # Rotate the rope parts in place: q's last R dims per head, the latent's k_pe.
        tk.apply_rope(q[..., c.qk_nope_head_dim:], latent[:, None, c.kv_lora_rank:],
                      batch.positions, self.rope.cos_sin, c.rope_interleaved)
        tk.write_latent(latent, latent_cache, batch.slot_mapping)
        o = self.attend(q, latent_cache, batch)                          # [T, H, V]
        return self.o_proj(o.reshape(t, self.num_heads * c.v_head_dim))

    # -- attention -------------------------------------------------------------------------
    def attend(self, q: torch.Tensor, latent_cache: torch.Tensor,
               batch: ForwardBatch) -> torch.Tensor:
        """q [T, H, N+R] (rope applied), this step's latents already in the cache -> [T, H, V].
        Decode-only steps go absorbed without reading lengths back to the host."""
        if batch.max_seqlen_q == 1:
            return self.attend_absorbed(q, latent_cache, batch.block_tables, batch.cu_seqlens_q,
                                        batch.seq_lens, 1)
        cu, lens = batch.cu_seqlens_q.tolist(), batch.seq_lens.tolist()
        long = {b for b in range(len(lens)) if self._decompress_pays(cu[b + 1] - cu[b], lens[b])}
        # A CPU engine's decode rows beside the chunks: the decode step's native call.
        native = self.cpu_decode is not None and self.cpu_decode.takes(latent_cache)
        single = sorted(b for b in range(len(lens))
                        if native and cu[b + 1] - cu[b] == 1 and b not in long)
        if not long and not single:
            return self.attend_absorbed(q, latent_cache, batch.block_tables, batch.cu_seqlens_q,
                                        batch.seq_lens, batch.max_seqlen_q)
        out = q.new_empty(q.shape[0], self.num_heads, self.cfg.v_head_dim)
        for b in long:
            out[cu[b]:cu[b + 1]] = self.attend_decompressed(q[cu[b]:cu[b + 1]], latent_cache,
                                                            batch.block_tables[b], lens[b])
        if single:
            rows = [cu[b] for b in single]
            out[rows] = self._native_decode_rows(q[rows], latent_cache, batch.block_tables[single],
                                                 batch.seq_lens[single])
        rest = [b for b in range(len(lens)) if b not in long and b not in single]
        if rest:
            rows = torch.cat([torch.arange(cu[b], cu[b + 1]) for b in rest]).to(q.device)
            spans = [cu[b + 1] - cu[b] for b in rest]
            cu_rest = torch.tensor([0, *spans], dtype=batch.cu_seqlens_q.dtype).cumsum(0)
            sel = torch.tensor(rest, device=q.device)
            out[rows] = self.attend_absorbed(q[rows], latent_cache, batch.block_tables[sel],
                                             cu_rest.to(q.device), batch.seq_lens[sel],
                                             max(spans))
        return out

    def _native_decode_rows(self, q: torch.Tensor, latent_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Decode rows q [n, H, N+R] (q_pe rotated, their latents in the cache) -> [n, H, V]
        through the decode step's native call (cpu_mla.c), as a pure decode step runs it:
        RoPE by the identity, no latent written (slots -1: kv unread). torch's absorbed path
        gathered each row's latents into bf16 einsums: a DeepSeek-V3-shaped model (16 heads,
        L 512, 4 layers), 4 sequences decoding at 4000 keys beside a 512-token prompt, the
        step 1.44-1.49 -> 0.81-0.85 s, its attention 1.16-1.20 -> 0.53-0.54 s."""
        n, c = q.shape[0], self.cfg
        r = c.qk_rope_head_dim
        identity = torch.cat([torch.ones(1, r // 2), torch.zeros(1, r // 2)], dim=1)
        o = self.cpu_decode(q.reshape(n, -1), q.new_zeros(n, c.kv_lora_rank + r),
                            torch.zeros(n, dtype=torch.long), identity, latent_cache,
                            torch.full((n,), -1), block_tables, seq_lens)
        return o.view(n, self.num_heads, c.v_head_dim)

    def _decompress_pays(self, n_q: int, ctx: int) -> bool:
        """Decompressing ctx latents costs ctx*L*(N+V) multiply-adds a head; absorbing costs
        n_q*L*(N+V) (W_UK into the queries, W_UV out of the outputs) plus, on each of the
        chunk's causal query-key pairs, 2L+R instead of N+R+V. Decompress when cheaper."""
        c = self.cfg
        expand = c.kv_lora_rank * (c.qk_nope_head_dim + c.v_head_dim)
        per_pair = 2 * c.kv_lora_rank - c.qk_nope_head_dim - c.v_head_dim
        pairs = n_q * (ctx - n_q) + n_q * (n_q + 1) // 2
        return (ctx - n_q) * expand < pairs * per_pair

    def attend_absorbed(self, q, latent_cache, block_tables, cu_seqlens_q, seq_lens,
                        max_seqlen_q: int) -> torch.Tensor:
        """q [T, H, N+R] -> [T, H, V] through the latents: scores q_nope W_UK c_kv + q_pe k_pe,
        outputs W_UV (sum_j p_j c_kv_j)."""
        c = self.cfg
        w_uk, w_uv = self._w_uk_uv()
        q_nope, q_pe = q[..., :c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:]
        q_abs = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)     # [T, H, L]
        q_lat = torch.cat([q_abs, q_pe], dim=-1).contiguous()              # [T, H, L+R]
        o_lat = tk.mla_attention(q_lat, latent_cache, block_tables, cu_seqlens_q, seq_lens,
                                 self.scale, c.kv_lora_rank, max_seqlen_q)  # [T, H, L]
        return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def attend_decompressed(self, q, latent_cache, block_table, ctx: int) -> torch.Tensor:
        """One sequence's chunk q [n, H, N+R] at positions ctx-n..ctx-1 -> [n, H, V], through
        per-head K and V expanded from its ctx cached latents."""
        c, n, bs = self.cfg, q.shape[0], latent_cache.shape[1]
        blocks = block_table[:-(-ctx // bs)].long()
        latent = latent_cache[blocks].flatten(0, 1)[:ctx].to(q.dtype)     # [ctx, L+R]
        kv = F.linear(latent[:, :c.kv_lora_rank], self.kv_b_weight())
        kv = kv.view(ctx, self.num_heads, c.qk_nope_head_dim + c.v_head_dim)
        k_pe = latent[:, None, c.kv_lora_rank:].expand(ctx, self.num_heads, c.qk_rope_head_dim)
        k = torch.cat([kv[..., :c.qk_nope_head_dim], k_pe], dim=-1)      # [ctx, H, N+R]
        v = kv[..., c.qk_nope_head_dim:]                                  # [ctx, H, V]
        if self.cpu_prefill is not None:        # None where it does not take these
            o = self.cpu_prefill.dense(q, k, v)
            if o is not None:
                return o
        # Query i (position ctx-n+i) sees keys 0..ctx-n+i: causal aligned to the lower right,
        # which SDPA's fused kernels take without an [n, ctx] mask in memory.
        # (Imported here: torch.nn.attention.bias pulls in torch._dynamo, 2 s of every start.)
        from torch.nn.attention.bias import causal_lower_right
        mask = causal_lower_right(n, ctx)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attn_mask=mask,
                                           scale=self.scale)                # [1, H, n, V]
        return o[0].transpose(0, 1)

