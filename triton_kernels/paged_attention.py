"""Causal attention of a flat batch of query tokens over the paged KV cache (GQA).

One op serves prefill, chunked prefill over a cached prefix, and decode:
q: [T, Hq, D] for B sequences laid end to end; cu_seqlens_q: [B+1] int32 offsets into T;
seq_lens: [B] int32 total context per sequence *including* this step's tokens (the new
keys are already written to the cache); block_tables: [B, M] int32 block ids;
k_cache, v_cache: [NB, BS, Hk, D]. Query i of sequence b sits at position
seq_lens[b] - q_len_b + i and sees keys 0..that position. Returns [T, Hq, D].
"""

import torch
import torch.nn.functional as F

from triton_kernels._dispatch import use_triton


def paged_attention_reference(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                              scale: float):
    out = torch.empty_like(q)
    bs = k_cache.shape[1]
    hq, hk = q.shape[1], k_cache.shape[2]
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b in range(len(lens)):
        q_start, q_end, ctx = cu[b], cu[b + 1], lens[b]
        n_q = q_end - q_start
        if n_q == 0:
            continue
        blocks = block_tables[b, : (ctx + bs - 1) // bs].long()
        k = k_cache[blocks].reshape(-1, hk, k_cache.shape[-1])[:ctx]   # [L, Hk, D]
        v = v_cache[blocks].reshape(-1, hk, v_cache.shape[-1])[:ctx]
        qb = q[q_start:q_end].transpose(0, 1)                          # [Hq, n_q, D]
        k = k.transpose(0, 1).to(q.dtype).repeat_interleave(hq // hk, dim=0)
        v = v.transpose(0, 1).to(q.dtype).repeat_interleave(hq // hk, dim=0)
        q_pos = torch.arange(ctx - n_q, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]  # [n_q, L]
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale)
        out[q_start:q_end] = o.transpose(0, 1)
    return out


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale: float,
                    max_seqlen_q: int | None = None):
    if use_triton(q):
        return paged_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                      seq_lens, scale, max_seqlen_q)
    return paged_attention_reference(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                     seq_lens, scale)
