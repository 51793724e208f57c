"""Multi-head latent attention (DeepSeek-V3, Kimi-K2, GLM-4.7-Flash) over a paged latent cache,
in the absorbed form: multi-query attention of H query heads against one latent per token.

The cache keeps, per token and layer, latent = [c_kv (L = kv_lora_rank) | k_pe (R =
qk_rope_head_dim, RoPE applied)]: latent_cache [NB, BS, L + R]. The query is absorbed into
latent space, q [T, H, L + R] = [q_nope @ W_UK (L) | q_pe (R)], so for query i and key j
    score = (q_lat . c_kv_j + q_pe . k_pe_j) * scale,    o_i = softmax_j(score) @ c_kv
and o [T, H, L] stays in latent space (the caller applies W_UV). block_tables [B, M],
cu_seqlens_q [B+1] and seq_lens [B] mean what they mean in paged_attention.py: sequence b's
q rows are its last q_len positions of seq_lens[b], causal among them; decode is q_len 1.

The kernels split each score into its L and R parts (576 is not padded to 1024), accumulate in
float32 with an online softmax, and read each latent tile once for a block of query heads.
"""

import math

import torch

from triton_kernels._dispatch import tl, triton, use_triton


def mla_attention_reference(q, latent_cache, block_tables, cu_seqlens_q, seq_lens,
                            scale: float, kv_lora_rank: int, max_seqlen_q: int | None = None):
    """max_seqlen_q is accepted for the Triton path's signature and unused. The CPU serves
    with this: decodes go in one padded batch, each prefill on its own (no per-head copy of
    the latent: every head reads the same one)."""
    _check_mla_args(q, latent_cache, block_tables, cu_seqlens_q, seq_lens, kv_lora_rank)
    t, h, _ = q.shape
    out = q.new_empty(t, h, kv_lora_rank)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    decodes = [b for b in range(len(lens)) if cu[b + 1] - cu[b] == 1]
    if decodes:
        rows = [cu[b] for b in decodes]
        out[rows] = _decode_batch(q[rows], latent_cache, block_tables[decodes],
                                  [lens[b] for b in decodes], scale, kv_lora_rank)
    for b in range(len(lens)):
        if cu[b + 1] - cu[b] > 1:
            out[cu[b]:cu[b + 1]] = _prefill_one(q[cu[b]:cu[b + 1]], latent_cache,
                                                block_tables[b], lens[b], scale, kv_lora_rank)
    return out


def _gather_latent(latent_cache, tables, span_blocks: int):
    """[B, M] tables -> [B, span_blocks * BS, L + R] latents of each table's first blocks
    (padding ids -1 read block 0; the caller masks them)."""
    blocks = tables[:, :span_blocks].long().clamp(min=0)
    return latent_cache[blocks].flatten(1, 2)


def _decode_batch(q, latent_cache, tables, lens: list[int], scale: float, l: int):
    # q [B, H, L+R]: scores [B, H, N] against each sequence's N keys, padded to the longest.
    bs = latent_cache.shape[1]
    span = max(1, max(-(-n // bs) for n in lens))
    kv = _gather_latent(latent_cache, tables, span).to(q.dtype)          # [B, N, L+R]
    valid = (torch.arange(span * bs, device=q.device)[None]
             < torch.tensor(lens, device=q.device)[:, None])              # [B, N]
    scores = torch.einsum("bhd,bnd->bhn", q, kv).float() * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0).to(q.dtype)   # a 0-length row: 0
    return torch.einsum("bhn,bnl->bhl", probs, kv[..., :l])


def _prefill_one(q, latent_cache, table, ctx: int, scale: float, l: int):
    # q [n_q, H, L+R] at positions ctx - n_q .. ctx - 1, causal over the ctx cached keys.
    n_q = q.shape[0]
    bs = latent_cache.shape[1]
    kv = _gather_latent(latent_cache, table[None], -(-ctx // bs))[0, :ctx].to(q.dtype)  # [N, L+R]
    q_pos = torch.arange(ctx - n_q, ctx, device=q.device)[:, None, None]             # [n_q,1,1]
    visible = torch.arange(ctx, device=q.device)[None, None, :] <= q_pos           # [n_q,1,N]
    scores = torch.einsum("ihd,nd->ihn", q, kv).float() * scale                    # [n_q,H,N]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).to(q.dtype)
    return torch.einsum("ihn,nl->ihl", probs, kv[:, :l])


def write_latent_reference(latent, latent_cache, slot_mapping):
    """latent [T, L+R] -> latent_cache [NB, BS, L+R] rows at slot_mapping [T] (block * BS +
    offset); slot -1 skips the token."""
    _check_write_args(latent, latent_cache, slot_mapping)
    keep = slot_mapping >= 0
    latent_cache.view(-1, latent_cache.shape[2])[slot_mapping[keep]] = \
        latent[keep].to(latent_cache.dtype)


def _check_mla_args(q, latent_cache, block_tables, cu_seqlens_q, seq_lens, kv_lora_rank):
    if q.dim() != 3:
        raise ValueError(f"mla_attention: q must be [T, H, L + R], got {tuple(q.shape)}")
    if latent_cache.dim() != 3 or latent_cache.shape[2] != q.shape[2]:
        raise ValueError(f"mla_attention: latent_cache must be [NB, BS, {q.shape[2]}] (q's "
                         f"L + R), got {tuple(latent_cache.shape)}")
    if not isinstance(kv_lora_rank, int) or not 0 < kv_lora_rank < q.shape[2]:
        raise ValueError(f"mla_attention: kv_lora_rank must be an int in 1..{q.shape[2] - 1} "
                         f"(the latent is L + R = {q.shape[2]} wide), got {kv_lora_rank!r}")
    b = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if (block_tables.dim() != 2 or block_tables.shape[0] != b
            or cu_seqlens_q.shape != (b + 1,)):
        raise ValueError(f"mla_attention: block_tables [B, M], cu_seqlens_q [B+1] and seq_lens "
                         f"[B] expected, got {tuple(block_tables.shape)}, "
                         f"{tuple(cu_seqlens_q.shape)}, {tuple(seq_lens.shape)}")
    for name, x in (("block_tables", block_tables), ("cu_seqlens_q", cu_seqlens_q),
                    ("seq_lens", seq_lens)):
        if x.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"mla_attention: {name} must be int32/int64, got {x.dtype}")
    if q.stride(2) != 1 or latent_cache.stride(2) != 1:
        raise ValueError("mla_attention: q and latent_cache need a contiguous last dimension")


def _check_write_args(latent, latent_cache, slot_mapping):
    if latent.dim() != 2 or latent_cache.dim() != 3 or latent_cache.shape[2] != latent.shape[1]:
        raise ValueError(f"write_latent: latent [T, D] and latent_cache [NB, BS, D] expected, "
                         f"got {tuple(latent.shape)} and {tuple(latent_cache.shape)}")
    if (slot_mapping.shape != (latent.shape[0],)
            or slot_mapping.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"write_latent: slot_mapping must be [{latent.shape[0]}] int32/int64, "
                         f"got {tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    if latent.stride(1) != 1 or not latent_cache.is_contiguous():
        raise ValueError("write_latent: latent needs a contiguous last dimension and "
                         "latent_cache must be contiguous")


def mla_attention(q, latent_cache, block_tables, cu_seqlens_q, seq_lens, scale: float,
                  kv_lora_rank: int, max_seqlen_q: int | None = None):
    """-> o [T, H, kv_lora_rank] in q's dtype (see the module docstring)."""
    return mla_attention_reference(q, latent_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                   kv_lora_rank, max_seqlen_q)


def write_latent(latent, latent_cache, slot_mapping):
    return write_latent_reference(latent, latent_cache, slot_mapping)
