"""Causal attention of a flat batch of query tokens over the paged KV cache (GQA).

One op serves prefill, chunked prefill over a cached prefix, and decode:
q: [T, Hq, Dk] for B sequences laid end to end; cu_seqlens_q: [B+1] int32 offsets into T;
seq_lens: [B] int32 total context per sequence *including* this step's tokens (the new
keys are already written to the cache); block_tables: [B, M] int32 block ids;
k_cache: [NB, BS, Hk, Dk], v_cache: [NB, BS, Hk, Dv] (Dv may differ from Dk, as in
DeepSeek's prefill: K 192 wide, V 128). Query i of sequence b sits at position
p = seq_lens[b] - q_len_b + i and sees keys 0..p. Returns [T, Hq, Dv].

sliding_window W (gpt-oss, Gemma-style local layers): p sees key j iff p - W < j <= p
(Hugging Face's `kv_idx > q_idx - sliding_window`); the kernels skip tiles wholly before the
window, so a long context costs O(W). sinks [Hq] (gpt-oss): one extra logit per head, not
scaled, that joins each query's softmax and takes mass but has no value:
out = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sink - m)).
"""

import functools
import math

import torch
import torch.nn.functional as F

from triton_kernels._dispatch import interpreting, tl, triton, use_triton

# Decode splits each sequence's context into chunks of at least this many KV tiles, and into
# at most this many chunks; the chunk count targets about two waves of programs on the GPU.
_MIN_TILES_PER_SPLIT = 4
_MAX_SPLITS = 64
_DEFAULT_NUM_SMS = 132     # an H100/H200, for the plan when the tensors live on the CPU
# The kernels' stand-in for "no window": wider than any context, small enough that
# p - _NO_WINDOW + 1 stays in int32.
_NO_WINDOW = 1 << 30
_LOG2E = math.log2(math.e)
# Queries a pass of the CPU reference's spelled-out prefill with sinks (its scores' rows).
_SINK_QUERIES = 256


def paged_attention_reference(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                              scale: float, max_seqlen_q: int | None = None, *,
                              sliding_window: int | None = None,
                              sinks: torch.Tensor | None = None):
    """max_seqlen_q is accepted for the same signature as the Triton path and unused."""
    # Only the new options are checked: CPU callers' layouts (strides, dtypes) stay free.
    _check_window_and_sinks(q.shape[1], sliding_window, sinks)
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[3])
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    # Decodes (one query each) go together in one padded batch: the CPU serves with this
    # reference, and a Python loop over 32 decoding sequences per layer dominated a step.
    decodes = [b for b in range(len(lens)) if cu[b + 1] - cu[b] == 1]
    if lens and len(decodes) == len(lens):   # a decode step: every sequence one query
        return _decode_batch(q, k_cache, v_cache, block_tables, lens, scale, sliding_window,
                             sinks)
    if decodes:
        rows = [cu[b] for b in decodes]
        out[rows] = _decode_batch(q[rows], k_cache, v_cache, block_tables[decodes],
                                  [lens[b] for b in decodes], scale, sliding_window, sinks)
    for b in range(len(lens)):
        n_q = cu[b + 1] - cu[b]
        if n_q > 1:
            out[cu[b]:cu[b + 1]] = _prefill_one(q[cu[b]:cu[b + 1]], k_cache, v_cache,
                                                block_tables[b], lens[b], scale,
                                                sliding_window, sinks)
    return out


def _key_blocks(tables, lens: list[int], first: list[int], bs: int):
    """The whole cache blocks holding keys first[b]..lens[b]-1 of each sequence, padded to the
    longest span: ([B, NB] block ids, [B, NB*BS] key positions, [B, NB*BS] valid). Whole
    blocks are gathered (one contiguous copy each) rather than key by key: the CPU serves
    with this reference. Padding table ids (-1) read block 0, masked out."""
    start = [f // bs for f in first]
    span = max(-(-n // bs) - s0 for n, s0 in zip(lens, start))
    device = tables.device
    if not any(first):                     # no window: each table's first blocks, as they are
        pos = torch.arange(span * bs, device=device)[None]
        return (tables[:, :span].long().clamp(min=0), pos,
                pos < torch.tensor(lens, device=device)[:, None])
    cols = torch.tensor(start, device=device)[:, None] + torch.arange(span, device=device)[None]
    blocks = tables.long().gather(1, cols.clamp(max=tables.shape[1] - 1)).clamp(min=0)
    pos = (cols[:, :1] * bs + torch.arange(span * bs, device=device)[None])      # [B, L]
    valid = ((pos >= torch.tensor(first, device=device)[:, None])
             & (pos < torch.tensor(lens, device=device)[:, None]))
    return blocks, pos, valid


def _gather_kv(cache, blocks):
    """[B, NB] block ids -> [B, NB*BS, Hk, D] keys or values (index_select: ~4x cheaper on
    the CPU than indexing with the 2-D tensor)."""
    b, nb = blocks.shape
    return cache.index_select(0, blocks.reshape(-1)).view(b, nb * cache.shape[1], *cache.shape[2:])


def _softmax_with_sinks(scores, sinks):
    """softmax over the last axis of float32 scores [..., Hq', L], with an extra sink logit per
    head when sinks [...Hq'] broadcast against scores[..., 0] (the sink's mass is dropped)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.float().expand(scores.shape[:-1])[..., None]
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def _decode_batch(q, k_cache, v_cache, tables, lens: list[int], scale: float, window, sinks):
    # q [B, Hq, Dk]; keys of each sequence's window (all of it without one), padded to the
    # longest span and masked past each one's length. The CPU serves decode with this: the
    # keys are widened to float32 once and go through torch's fused CPU attention (SDPA; its
    # bf16 products on AVX2 cost 2-3x more than widening first); scores, softmax and the
    # value sums in float32, rounded once. The mask is dropped where every key is visible.
    b, hq, dk = q.shape
    bs, hk = k_cache.shape[1], k_cache.shape[2]
    n = max(lens)
    if window:
        first = [max(0, n - window) for n in lens]
        blocks, _, mask = _key_blocks(tables, lens, first, bs)    # mask [B, L]
    else:                                # keys 0..n-1 of each table's first blocks
        blocks, mask = tables[:, :-(-n // bs)], None
        if min(lens) != n:               # shorter ones: padding ids (-1) read block 0, masked
            blocks = blocks.clamp(min=0)
            mask = torch.arange(n, device=q.device) < torch.tensor(lens, device=q.device)[:, None]
    k = _gather_kv(k_cache, blocks)                               # [B, L, Hk, Dk]
    v = _gather_kv(v_cache, blocks)                               # [B, L, Hk, Dv]
    if not window:
        k, v = k[:, :n], v[:, :n]
    k, v = k.transpose(1, 2).float(), v.transpose(1, 2).float()   # [B, Hk, L, D]
    qf = q.float()
    if sinks is None:
        o = F.scaled_dot_product_attention(
            qf[:, :, None], k, v, scale=scale, enable_gqa=True,
            attn_mask=None if mask is None else mask[:, None, None, :])[:, :, 0]
    else:                                # SDPA has no sink logit: the same math spelled out
        qg = qf.view(b, hk, hq // hk, dk)                         # [B, Hk, G, Dk]
        scores = torch.matmul(qg, k.transpose(2, 3)) * scale      # [B, Hk, G, L]
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        probs = _softmax_with_sinks(scores, sinks.view(hk, hq // hk))
        o = torch.matmul(probs, v).reshape(b, hq, v.shape[-1])
    return o.to(q.dtype)


def _prefill_one(q, k_cache, v_cache, table, ctx: int, scale: float, window, sinks):
    # q [n_q, Hq, Dk] at positions ctx - n_q .. ctx - 1, causal over the cached prefix; only
    # keys from the first query's window on are gathered.
    n_q, hq, _ = q.shape
    hk = k_cache.shape[2]
    first = max(0, ctx - n_q - window + 1) if window else 0
    blocks, pos, valid = _key_blocks(table[None], [ctx], [first], k_cache.shape[1])
    k = _gather_kv(k_cache, blocks)[0].transpose(0, 1).to(q.dtype)   # [Hk, L, Dk]
    v = _gather_kv(v_cache, blocks)[0].transpose(0, 1).to(q.dtype)   # [Hk, L, Dv]
    q_pos = torch.arange(ctx - n_q, ctx, device=q.device)[:, None]
    mask = (pos <= q_pos) & valid                                               # [n_q, L]
    if window:
        mask &= pos > q_pos - window
    qt = q.transpose(0, 1)                                                      # [Hq, n_q, Dk]
    if sinks is None:
        # Batched 4-D, grouped heads: torch's fused CPU kernel (3-D inputs fall to its
        # unfused math path, 2.5x slower at 512 tokens; HF calls it 4-D too).
        o = F.scaled_dot_product_attention(qt[None], k[None], v[None], attn_mask=mask,
                                           scale=scale, enable_gqa=True)[0]
    else:
        k = k.repeat_interleave(hq // hk, dim=0)
        v = v.repeat_interleave(hq // hk, dim=0)
        # SDPA has no sink logit: the same math spelled out (HF's eager gpt-oss attention),
        # _SINK_QUERIES queries at a time over the keys any of them sees: their scores are
        # [Hq, 256, <= L] float32, not the prompt's [Hq, n_q, L] (a 4096-token prompt of
        # gpt-oss's 64 heads: 4.3 GB and ~12 s a layer on 2 cores). A masked key's exp is
        # exactly 0, so dropping the keys no query of a chunk sees changes no sum.
        o = qt.new_empty(hq, n_q, v.shape[-1])
        for i in range(0, n_q, _SINK_QUERIES):
            rows = mask[i:i + _SINK_QUERIES]
            seen = rows.any(0).nonzero()
            lo, hi = int(seen[0]), int(seen[-1]) + 1
            scores = (qt[:, i:i + _SINK_QUERIES] @ k[:, lo:hi].transpose(1, 2) * scale)
            scores = scores.masked_fill(~rows[:, lo:hi], float("-inf"))
            probs = _softmax_with_sinks(scores.float(), sinks[:, None]).to(q.dtype)
            o[:, i:i + _SINK_QUERIES] = probs @ v[:, lo:hi]
    return o.transpose(0, 1)


@triton.jit
def _attend_kv_range(acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
                     kv_start, kv_end, window, stride_kb, stride_ks, stride_kh,
                     stride_vb, stride_vs, stride_vh, qk_scale, BS,
                     MASKED: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                     D_PAD: tl.constexpr, HEAD_DIM_V: tl.constexpr, DV_PAD: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    """Online softmax of q [M, D_PAD] over keys kv_start..kv_end, BLOCK_N keys a step.

    Scores are kept in the log2 domain (qk_scale = scale * log2 e). A tile may span several
    cache blocks: each key finds its block id through the table. MASKED tiles apply each
    row's own visibility, q_pos - window < j <= q_pos; the others are visible to every row.
    Returns (acc [M, DV_PAD], m_i, l_i).
    """
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, DV_PAD)
    mask_dv = offs_dv < HEAD_DIM_V
    for n0 in range(kv_start, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        block = tl.load(table_ptr + offs_n // BS, mask=mask_n, other=0).to(tl.int64)
        in_block = (offs_n % BS).to(tl.int64)
        k_off = block * stride_kb + in_block * stride_ks + kv_head * stride_kh     # [N]
        k_t = tl.load(k_cache_ptr + k_off[None, :] + offs_d[:, None],
                      mask=mask_d[:, None] & mask_n[None, :], other=0.0)       # [D_PAD, N]
        s = tl.dot(q, k_t.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
        valid = mask_n[None, :]
        if MASKED:
            valid = valid & (offs_n[None, :] <= q_pos[:, None])
            valid = valid & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows with no visible key yet keep m = -inf; subtract 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_off = block * stride_vb + in_block * stride_vs + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_off[:, None] + offs_dv[None, :],
                    mask=mask_n[:, None] & mask_dv[None, :], other=0.0)        # [N, DV_PAD]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                            input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _finish(acc, m_i, l_i, sinks_ptr, heads, mask_rows, HAS_SINKS: tl.constexpr):
    """acc / l, the softmax denominator gaining exp2(sink2 - m) per row (sink2 = sink * log2 e,
    in the scores' log2 domain) when HAS_SINKS. Rows with no key and no sink give 0."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=mask_rows, other=0.0).to(tl.float32)
        sink = sink * 1.4426950408889634
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)                      # m_i = -inf (no key): alpha 0
        l_i = l_i * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]
    return acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]


@triton.jit(do_not_specialize=["stride_bt", "window"])
def _paged_prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, cu_q_ptr, seq_lens_ptr, out_ptr,
                          sinks_ptr, qk_scale, window, stride_qt, stride_qh, stride_ot, stride_oh,
                          stride_bt, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                          stride_vh, BS, G: tl.constexpr, G_PAD: tl.constexpr,
                          BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                          D_PAD: tl.constexpr, HEAD_DIM_V: tl.constexpr, DV_PAD: tl.constexpr,
                          HAS_SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Grid (query blocks, B, Hk). A program's BLOCK_M = BLOCK_Q * G_PAD rows are BLOCK_Q
    # query tokens times the G query heads sharing kv_head, so each K/V tile is read once
    # for the whole group. Row r is token r // G_PAD, head kv_head * G + r % G_PAD.
    # window is the sliding window, or _NO_WINDOW for full causal attention.
    q_block = tl.program_id(0)      # axis 0: up to 2^31 - 1 blocks; axes 1 and 2 stop at 65535
    b = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + b)
    offs_m = tl.arange(0, BLOCK_Q * G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    q_i = q_block * BLOCK_Q + offs_m // G_PAD
    g = offs_m % G_PAD
    mask_m = (q_i < q_len) & (g < G)
    heads = kv_head * G + g
    q_row = (q_start + q_i).to(tl.int64)
    q = tl.load(q_ptr + q_row[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    q_pos = ctx - q_len + q_i                        # this query sees keys q_pos-window+1..q_pos
    first_pos = ctx - q_len + q_block * BLOCK_Q      # the block's queries: first_pos..kv_end-1
    kv_end = tl.minimum(ctx, first_pos + BLOCK_Q)
    acc = tl.zeros((BLOCK_Q * G_PAD, DV_PAD), dtype=tl.float32)
    m_i = tl.full((BLOCK_Q * G_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_Q * G_PAD,), dtype=tl.float32)
    # Three key ranges, tile-aligned: [lo, mid) reaches back to the first query's window
    # edge and is masked per row; [mid, full_end) is visible to every query of the block
    # (after the last query's window edge, up to the first query's position) and skips the
    # mask; [full_end, kv_end) is the diagonal, masked. Tiles before lo are never read.
    table = bt_ptr + b.to(tl.int64) * stride_bt
    lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
    full_end = tl.minimum((first_pos + 1) // BLOCK_N * BLOCK_N, kv_end)
    mid = tl.minimum(tl.cdiv(tl.maximum(kv_end - window, 0), BLOCK_N) * BLOCK_N, full_end)
    acc, m_i, l_i = _attend_kv_range(
        acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, table, kv_head, lo, mid, window,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        qk_scale, BS, True, BLOCK_N, HEAD_DIM, D_PAD, HEAD_DIM_V, DV_PAD, DOT_PRECISION)
    acc, m_i, l_i = _attend_kv_range(
        acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, table, kv_head, mid, full_end, window,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        qk_scale, BS, False, BLOCK_N, HEAD_DIM, D_PAD, HEAD_DIM_V, DV_PAD, DOT_PRECISION)
    acc, m_i, l_i = _attend_kv_range(
        acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, table, kv_head, full_end, kv_end,
        window, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        qk_scale, BS, True, BLOCK_N, HEAD_DIM, D_PAD, HEAD_DIM_V, DV_PAD, DOT_PRECISION)
    out = _finish(acc, m_i, l_i, sinks_ptr, heads, mask_m, HAS_SINKS)
    tl.store(out_ptr + q_row[:, None] * stride_ot + heads[:, None] * stride_oh + offs_dv[None, :],
             out.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & (offs_dv < HEAD_DIM_V)[None, :])


@triton.jit(do_not_specialize=["num_splits", "split_tokens", "stride_bt", "window"])
def _paged_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, cu_q_ptr, seq_lens_ptr, out_ptr,
                         part_o_ptr, part_lse_ptr, sinks_ptr, qk_scale, window, num_splits,
                         split_tokens, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                         stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BS,
                         Hq: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                         BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                         HEAD_DIM_V: tl.constexpr, DV_PAD: tl.constexpr, SPLIT: tl.constexpr,
                         HAS_SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Grid (B, Hk, num_splits): the G query heads of one kv head (rows padded to G_PAD >= 16
    # for tl.dot) over one chunk of the keys the query sees, max(0, ctx - window)..ctx-1 (a
    # plain range: decode needs no per-key mask). With SPLIT the chunk's normalised output
    # and log-sum-exp go to part_o [B, Hq, S, DV_PAD] / part_lse [B, Hq, S] for the reduce
    # kernel, which adds the sink once; without, this program adds it.
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(cu_q_ptr + b)
    num_rows = tl.minimum(tl.load(cu_q_ptr + b + 1) - q_row, 1) * G   # 0 when b has no query
    ctx = tl.load(seq_lens_ptr + b)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    mask_g = offs_g < num_rows
    heads = kv_head * G + offs_g
    q = tl.load(q_ptr + q_row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :], mask=mask_g[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    kv_start = tl.maximum(ctx - window, 0) + split * split_tokens
    kv_end = tl.minimum(ctx, kv_start + split_tokens)
    acc = tl.zeros((G_PAD, DV_PAD), dtype=tl.float32)
    m_i = tl.full((G_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((G_PAD,), dtype=tl.float32)
    acc, m_i, l_i = _attend_kv_range(
        acc, m_i, l_i, q, offs_g, k_cache_ptr, v_cache_ptr, bt_ptr + b.to(tl.int64) * stride_bt,
        kv_head, kv_start, kv_end, window, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
        stride_vh, qk_scale, BS, False, BLOCK_N, HEAD_DIM, D_PAD, HEAD_DIM_V, DV_PAD,
        DOT_PRECISION)
    if SPLIT:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        part = (b * Hq + heads).to(tl.int64) * num_splits + split                  # [G_PAD]
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(part_lse_ptr + part, lse, mask=mask_g)
        tl.store(part_o_ptr + part[:, None] * DV_PAD + offs_dv[None, :], out, mask=mask_g[:, None])
    else:
        out = _finish(acc, m_i, l_i, sinks_ptr, heads, mask_g, HAS_SINKS)
        tl.store(out_ptr + q_row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
                 + offs_dv[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=mask_g[:, None] & (offs_dv < HEAD_DIM_V)[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _paged_decode_reduce_kernel(part_o_ptr, part_lse_ptr, cu_q_ptr, out_ptr, sinks_ptr,
                                num_splits, stride_ot, stride_oh, Hq: tl.constexpr,
                                HEAD_DIM_V: tl.constexpr, DV_PAD: tl.constexpr,
                                BLOCK_S: tl.constexpr, HAS_SINKS: tl.constexpr):
    # Grid (B, Hq): merge the splits' outputs weighted by exp2(lse_s - max lse); the sink
    # (sink * log2 e, in the same log2 domain) joins the max and the denominator only.
    b = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(cu_q_ptr + b)
    if tl.load(cu_q_ptr + b + 1) == q_row:
        return
    base = (b * Hq + head).to(tl.int64) * num_splits
    offs_d = tl.arange(0, DV_PAD)
    m_vec = tl.full((BLOCK_S,), float("-inf"), dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        lse = tl.load(part_lse_ptr + base + offs_s, mask=offs_s < num_splits, other=float("-inf"))
        m_vec = tl.maximum(m_vec, lse)
    m = tl.max(m_vec, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros((DV_PAD,), dtype=tl.float32)
    den = tl.zeros((BLOCK_S,), dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        lse = tl.load(part_lse_ptr + base + offs_s, mask=offs_s < num_splits, other=float("-inf"))
        w = tl.exp2(lse - m)                       # empty splits (lse = -inf) weigh 0
        o = tl.load(part_o_ptr + (base + offs_s)[:, None] * DV_PAD + offs_d[None, :],
                    mask=(lse > float("-inf"))[:, None], other=0.0)
        acc += tl.sum(w[:, None] * o, axis=0)
        den += w
    total = tl.sum(den, axis=0)
    if HAS_SINKS:
        total += tl.exp2(sink - m)
    out = acc / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + q_row.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM_V)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_split_plan(num_seqs: int, num_kv_heads: int, max_context: int, block_n: int,
                      num_sms: int = _DEFAULT_NUM_SMS) -> tuple[int, int]:
    """(num_splits, tokens per split) for decode over spans of up to max_context keys (the
    window, for a sliding-window layer).

    Enough splits for about two waves of (seq, kv head, split) programs, but no split shorter
    than _MIN_TILES_PER_SPLIT tiles: short contexts stay in one program and skip the reduce.
    """
    tiles = max(1, triton.cdiv(max_context, block_n))
    want = triton.cdiv(2 * num_sms, max(1, num_seqs * num_kv_heads))
    splits = max(1, min(want, tiles // _MIN_TILES_PER_SPLIT, _MAX_SPLITS))
    tiles_per_split = triton.cdiv(tiles, splits)
    return triton.cdiv(tiles, tiles_per_split), tiles_per_split * block_n


def _attention_config(head_dim_pad: int, decode: bool) -> dict:
    """Tile sizes: BLOCK_N keys a step; prefill rows BLOCK_M = query tokens x group heads.
    head_dim_pad is the wider of the padded K and V head dims."""
    if interpreting():            # small tiles: cheap to interpret, and many loop trips
        return dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
    if decode:
        return dict(BLOCK_N=64 if head_dim_pad <= 128 else 32, num_warps=4, num_stages=2)
    if head_dim_pad <= 128:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
    return dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2)


def paged_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                           scale: float, max_seqlen_q: int | None = None, *,
                           sliding_window: int | None = None,
                           sinks: torch.Tensor | None = None):
    """Decode path (split-KV + reduce) when max_seqlen_q == 1, else the prefill path.

    max_seqlen_q is the host's hint of the longest query span; without it the launcher reads
    it off cu_seqlens_q (a device sync). It sizes the prefill grid, so it must not be short.
    """
    _check_attention_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                          sliding_window, sinks)
    t, hq, d = q.shape
    dv = v_cache.shape[3]
    bs, hk = k_cache.shape[1], k_cache.shape[2]
    b = seq_lens.shape[0]
    out = q.new_empty(t, hq, dv)
    if t == 0 or b == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    g = hq // hk
    d_pad = max(16, triton.next_power_of_2(d))
    dv_pad = max(16, triton.next_power_of_2(dv))
    # fp32 (tests) gets exact products; fp16/bf16 take the backend's default.
    precision = "ieee" if q.dtype == torch.float32 else None
    qk_scale = scale * _LOG2E
    window = _NO_WINDOW if sliding_window is None else int(sliding_window)
    has_sinks = sinks is not None
    sinks_arg = sinks if has_sinks else q          # never read without HAS_SINKS
    dims = dict(HEAD_DIM=d, D_PAD=d_pad, HEAD_DIM_V=dv, DV_PAD=dv_pad, HAS_SINKS=has_sinks)
    strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
               k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
               v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), bs)
    if max_seqlen_q == 1:
        cfg = _attention_config(max(d_pad, dv_pad), decode=True)
        block_n = cfg.pop("BLOCK_N")
        cfg.pop("BLOCK_M", None)
        # Split the span a query sees (host-side bound, no sync): the table's capacity, or
        # the window when that is shorter.
        span = min(block_tables.shape[1] * bs, window)
        splits, split_tokens = decode_split_plan(b, hk, span, block_n, _num_sms(q.device))
        if splits > 1:
            part_o = torch.empty(b, hq, splits, dv_pad, dtype=torch.float32, device=q.device)
            part_lse = torch.empty(b, hq, splits, dtype=torch.float32, device=q.device)
        else:
            part_o = part_lse = out          # unused: SPLIT=False writes out directly
        _paged_decode_kernel[(b, hk, splits)](
            q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out, part_o, part_lse,
            sinks_arg, qk_scale, window, splits, split_tokens, *strides,
            Hq=hq, G=g, G_PAD=max(16, triton.next_power_of_2(g)), BLOCK_N=block_n,
            SPLIT=splits > 1, DOT_PRECISION=precision, **dims, **cfg)
        if splits > 1:
            _paged_decode_reduce_kernel[(b, hq)](
                part_o, part_lse, cu_seqlens_q, out, sinks_arg, splits, out.stride(0),
                out.stride(1), Hq=hq, HEAD_DIM_V=dv, DV_PAD=dv_pad, BLOCK_S=16,
                HAS_SINKS=has_sinks, num_warps=4)
        return out
    cfg = _attention_config(max(d_pad, dv_pad), decode=False)
    g_pad = triton.next_power_of_2(g)
    block_q = max(1, cfg.pop("BLOCK_M") // g_pad)
    _paged_prefill_kernel[(triton.cdiv(max_seqlen_q, block_q), b, hk)](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out, sinks_arg, qk_scale,
        window, *strides, G=g, G_PAD=g_pad, BLOCK_Q=block_q, DOT_PRECISION=precision,
        **dims, **cfg)
    return out


def _check_attention_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                          sliding_window=None, sinks=None):
    if q.dim() != 3:
        raise ValueError(f"paged_attention: q must be [T, Hq, Dk], got {tuple(q.shape)}")
    t, hq, d = q.shape
    if (k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[3] != d
            or v_cache.shape[:3] != k_cache.shape[:3]):
        raise ValueError(f"paged_attention: caches must be [NB, BS, Hk, {d}] and [NB, BS, Hk, "
                         f"Dv], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    hk = k_cache.shape[2]
    if hq % hk:
        raise ValueError(f"paged_attention: {hq} query heads are not a multiple of {hk} kv heads")
    if d > 256 or v_cache.shape[3] > 256:
        raise ValueError(f"paged_attention: head dims {d}/{v_cache.shape[3]} > 256 are not "
                         f"supported")
    _check_window_and_sinks(hq, sliding_window, sinks)
    b = seq_lens.shape[0]
    if (block_tables.dim() != 2 or block_tables.shape[0] != b or cu_seqlens_q.shape != (b + 1,)
            or seq_lens.dim() != 1):
        raise ValueError(f"paged_attention: block_tables [B, M], cu_seqlens_q [B+1] and seq_lens "
                         f"[B] expected, got {tuple(block_tables.shape)}, "
                         f"{tuple(cu_seqlens_q.shape)}, {tuple(seq_lens.shape)}")
    for name, x in (("block_tables", block_tables), ("cu_seqlens_q", cu_seqlens_q),
                    ("seq_lens", seq_lens)):
        if x.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"paged_attention: {name} must be int32/int64, got {x.dtype}")
    if not (block_tables.stride(1) == 1 and cu_seqlens_q.is_contiguous()
            and seq_lens.is_contiguous()):
        raise ValueError("paged_attention: block_tables rows, cu_seqlens_q and seq_lens must be "
                         "contiguous")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("paged_attention: q and the caches need a contiguous last dimension")


def _check_window_and_sinks(hq: int, sliding_window, sinks):
    if sliding_window is not None and (not isinstance(sliding_window, int)
                                       or not 1 <= sliding_window < _NO_WINDOW):
        raise ValueError(f"paged_attention: sliding_window must be a positive int or None, got "
                         f"{sliding_window!r}")
    if sinks is not None and (sinks.shape != (hq,) or not sinks.is_floating_point()
                              or not sinks.is_contiguous()):
        raise ValueError(f"paged_attention: sinks must be a contiguous float [{hq}] tensor, got "
                         f"{tuple(sinks.shape)} {sinks.dtype}")


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale: float,
                    max_seqlen_q: int | None = None, *, sliding_window: int | None = None,
                    sinks: torch.Tensor | None = None):
    op = paged_attention_triton if use_triton(q) else paged_attention_reference
    return op(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, max_seqlen_q,
              sliding_window=sliding_window, sinks=sinks)
