"""Causal attention of a flat batch of query tokens over the paged KV cache (GQA).

One op serves prefill, chunked prefill over a cached prefix, and decode:
q: [T, Hq, D] for B sequences laid end to end; cu_seqlens_q: [B+1] int32 offsets into T;
seq_lens: [B] int32 total context per sequence *including* this step's tokens (the new
keys are already written to the cache); block_tables: [B, M] int32 block ids;
k_cache, v_cache: [NB, BS, Hk, D]. Query i of sequence b sits at position
seq_lens[b] - q_len_b + i and sees keys 0..that position. Returns [T, Hq, D].
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


def paged_attention_reference(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                              scale: float):
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    # Decodes (one query each) go together in one padded batch: the CPU serves with this
    # reference, and a Python loop over 32 decoding sequences per layer dominated a step.
    decodes = [b for b in range(len(lens)) if cu[b + 1] - cu[b] == 1]
    if decodes:
        rows = [cu[b] for b in decodes]
        out[rows] = _decode_batch(q[rows], k_cache, v_cache, block_tables[decodes],
                                  [lens[b] for b in decodes], scale)
    for b in range(len(lens)):
        n_q = cu[b + 1] - cu[b]
        if n_q > 1:
            out[cu[b]:cu[b + 1]] = _prefill_one(q[cu[b]:cu[b + 1]], k_cache, v_cache,
                                                block_tables[b], lens[b], scale)
    return out


def _gather_kv(cache, tables, ctx: int):
    """[B, M] block tables -> [B, ctx, Hk, D] keys or values (padding ids read block 0)."""
    bs = cache.shape[1]
    blocks = tables[:, : (ctx + bs - 1) // bs].long().clamp(min=0)
    return cache[blocks].flatten(1, 2)[:, :ctx]


def _decode_batch(q, k_cache, v_cache, tables, lens: list[int], scale: float):
    # q [B, Hq, D]; keys padded to the longest context and masked past each one's length.
    b, hq, d = q.shape
    hk = k_cache.shape[2]
    ctx = max(lens)
    k = _gather_kv(k_cache, tables, ctx).to(q.dtype)              # [B, L, Hk, D]
    v = _gather_kv(v_cache, tables, ctx).to(q.dtype)
    qg = q.view(b, hk, hq // hk, d)                               # [B, Hk, G, D]
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale       # [B, Hk, G, L]
    length = torch.tensor(lens, device=q.device)
    valid = torch.arange(ctx, device=q.device)[None, :] < length[:, None]   # [B, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.einsum("bhgl,blhd->bhgd", probs, v).reshape(b, hq, d)


def _prefill_one(q, k_cache, v_cache, table, ctx: int, scale: float):
    # q [n_q, Hq, D] at positions ctx - n_q .. ctx - 1, causal over the cached prefix.
    n_q, hq, _ = q.shape
    hk = k_cache.shape[2]
    k = _gather_kv(k_cache, table[None], ctx)[0].transpose(0, 1).to(q.dtype)   # [Hk, L, D]
    v = _gather_kv(v_cache, table[None], ctx)[0].transpose(0, 1).to(q.dtype)
    k = k.repeat_interleave(hq // hk, dim=0)
    v = v.repeat_interleave(hq // hk, dim=0)
    q_pos = torch.arange(ctx - n_q, ctx, device=q.device)
    mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]      # [n_q, L]
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale)
    return o.transpose(0, 1)


@triton.jit
def _attend_kv_range(acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
                     kv_start, kv_end, stride_kb, stride_ks, stride_kh,
                     stride_vb, stride_vs, stride_vh, qk_scale, BS,
                     CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                     D_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online softmax of q [M, D_PAD] over keys kv_start..kv_end, BLOCK_N keys a step.

    Scores are kept in the log2 domain (qk_scale = scale * log2 e). A tile may span several
    cache blocks: each key finds its block id through the table. Returns (acc, m_i, l_i).
    """
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d < HEAD_DIM
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
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows with no visible key yet keep m = -inf; subtract 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_off = block * stride_vb + in_block * stride_vs + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)         # [N, D_PAD]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                            input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["stride_bt"])
def _paged_prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, cu_q_ptr, seq_lens_ptr, out_ptr,
                          qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                          stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BS,
                          G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                          BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                          DOT_PRECISION: tl.constexpr):
    # Grid (query blocks, B, Hk). A program's BLOCK_M = BLOCK_Q * G_PAD rows are BLOCK_Q
    # query tokens times the G query heads sharing kv_head, so each K/V tile is read once
    # for the whole group. Row r is token r // G_PAD, head kv_head * G + r % G_PAD.
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
    q_i = q_block * BLOCK_Q + offs_m // G_PAD
    g = offs_m % G_PAD
    mask_m = (q_i < q_len) & (g < G)
    mask = mask_m[:, None] & (offs_d < HEAD_DIM)[None, :]
    heads = kv_head * G + g
    q_row = (q_start + q_i).to(tl.int64)
    q = tl.load(q_ptr + q_row[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask, other=0.0)
    q_pos = ctx - q_len + q_i                        # this query sees keys 0..q_pos
    kv_end = tl.minimum(ctx, ctx - q_len + (q_block + 1) * BLOCK_Q)
    acc = tl.zeros((BLOCK_Q * G_PAD, D_PAD), dtype=tl.float32)
    m_i = tl.full((BLOCK_Q * G_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_Q * G_PAD,), dtype=tl.float32)
    # Keys up to the block's first query position are visible to every query of the block:
    # those whole tiles skip the causal mask, and only the tiles along the diagonal pay it.
    table = bt_ptr + b.to(tl.int64) * stride_bt
    full_end = tl.minimum((ctx - q_len + q_block * BLOCK_Q + 1) // BLOCK_N * BLOCK_N, kv_end)
    acc, m_i, l_i = _attend_kv_range(
        acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, table, kv_head, 0, full_end,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        qk_scale, BS, False, BLOCK_N, HEAD_DIM, D_PAD, DOT_PRECISION)
    acc, m_i, l_i = _attend_kv_range(
        acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, table, kv_head, full_end, kv_end,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        qk_scale, BS, True, BLOCK_N, HEAD_DIM, D_PAD, DOT_PRECISION)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + q_row[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_splits", "split_tokens", "stride_bt"])
def _paged_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, cu_q_ptr, seq_lens_ptr, out_ptr,
                         part_o_ptr, part_lse_ptr, qk_scale, num_splits, split_tokens,
                         stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                         stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BS,
                         Hq: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                         BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                         SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Grid (B, Hk, num_splits): the G query heads of one kv head (rows padded to G_PAD >= 16
    # for tl.dot) over one chunk of the context. With SPLIT the chunk's normalised output and
    # log-sum-exp go to part_o [B, Hq, S, D_PAD] / part_lse [B, Hq, S] for the reduce kernel.
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(cu_q_ptr + b)
    num_rows = tl.minimum(tl.load(cu_q_ptr + b + 1) - q_row, 1) * G   # 0 when b has no query
    ctx = tl.load(seq_lens_ptr + b)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask_g = offs_g < num_rows
    heads = kv_head * G + offs_g
    q = tl.load(q_ptr + q_row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :], mask=mask_g[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    kv_start = split * split_tokens
    kv_end = tl.minimum(ctx, kv_start + split_tokens)
    acc = tl.zeros((G_PAD, D_PAD), dtype=tl.float32)
    m_i = tl.full((G_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((G_PAD,), dtype=tl.float32)
    acc, m_i, l_i = _attend_kv_range(
        acc, m_i, l_i, q, offs_g, k_cache_ptr, v_cache_ptr, bt_ptr + b.to(tl.int64) * stride_bt,
        kv_head, kv_start, kv_end, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
        stride_vh, qk_scale, BS, False, BLOCK_N, HEAD_DIM, D_PAD, DOT_PRECISION)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if SPLIT:
        part = (b * Hq + heads).to(tl.int64) * num_splits + split                  # [G_PAD]
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(part_lse_ptr + part, lse, mask=mask_g)
        tl.store(part_o_ptr + part[:, None] * D_PAD + offs_d[None, :], out, mask=mask_g[:, None])
    else:
        tl.store(out_ptr + q_row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
                 + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=mask_g[:, None] & (offs_d < HEAD_DIM)[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _paged_decode_reduce_kernel(part_o_ptr, part_lse_ptr, cu_q_ptr, out_ptr, num_splits,
                                stride_ot, stride_oh, Hq: tl.constexpr, HEAD_DIM: tl.constexpr,
                                D_PAD: tl.constexpr, BLOCK_S: tl.constexpr):
    # Grid (B, Hq): merge the splits' outputs weighted by exp2(lse_s - max lse).
    b = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(cu_q_ptr + b)
    if tl.load(cu_q_ptr + b + 1) == q_row:
        return
    base = (b * Hq + head).to(tl.int64) * num_splits
    offs_d = tl.arange(0, D_PAD)
    m_vec = tl.full((BLOCK_S,), float("-inf"), dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        lse = tl.load(part_lse_ptr + base + offs_s, mask=offs_s < num_splits, other=float("-inf"))
        m_vec = tl.maximum(m_vec, lse)
    m = tl.max(m_vec, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros((D_PAD,), dtype=tl.float32)
    den = tl.zeros((BLOCK_S,), dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        lse = tl.load(part_lse_ptr + base + offs_s, mask=offs_s < num_splits, other=float("-inf"))
        w = tl.exp2(lse - m)                       # empty splits (lse = -inf) weigh 0
        o = tl.load(part_o_ptr + (base + offs_s)[:, None] * D_PAD + offs_d[None, :],
                    mask=(lse > float("-inf"))[:, None], other=0.0)
        acc += tl.sum(w[:, None] * o, axis=0)
        den += w
    total = tl.sum(den, axis=0)
    out = acc / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + q_row.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_split_plan(num_seqs: int, num_kv_heads: int, max_context: int, block_n: int,
                      num_sms: int = _DEFAULT_NUM_SMS) -> tuple[int, int]:
    """(num_splits, tokens per split) for decode over contexts up to max_context tokens.

    Enough splits for about two waves of (seq, kv head, split) programs, but no split shorter
    than _MIN_TILES_PER_SPLIT tiles: short contexts stay in one program and skip the reduce.
    """
    tiles = max(1, triton.cdiv(max_context, block_n))
    want = triton.cdiv(2 * num_sms, max(1, num_seqs * num_kv_heads))
    splits = max(1, min(want, tiles // _MIN_TILES_PER_SPLIT, _MAX_SPLITS))
    tiles_per_split = triton.cdiv(tiles, splits)
    return triton.cdiv(tiles, tiles_per_split), tiles_per_split * block_n


def _attention_config(head_dim_pad: int, decode: bool) -> dict:
    """Tile sizes: BLOCK_N keys a step; prefill rows BLOCK_M = query tokens x group heads."""
    if interpreting():            # small tiles: cheap to interpret, and many loop trips
        return dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
    if decode:
        return dict(BLOCK_N=64 if head_dim_pad <= 128 else 32, num_warps=4, num_stages=2)
    if head_dim_pad <= 128:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
    return dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2)


def paged_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                           scale: float, max_seqlen_q: int | None = None):
    """Decode path (split-KV + reduce) when max_seqlen_q == 1, else the prefill path.

    max_seqlen_q is the host's hint of the longest query span; without it the launcher reads
    it off cu_seqlens_q (a device sync). It sizes the prefill grid, so it must not be short.
    """
    _check_attention_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens)
    t, hq, d = q.shape
    bs, hk = k_cache.shape[1], k_cache.shape[2]
    b = seq_lens.shape[0]
    out = torch.empty_like(q)
    if t == 0 or b == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    g = hq // hk
    d_pad = max(16, triton.next_power_of_2(d))
    # fp32 (tests) gets exact products; fp16/bf16 take the backend's default.
    precision = "ieee" if q.dtype == torch.float32 else None
    qk_scale = scale * math.log2(math.e)
    strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
               k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
               v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), bs)
    if max_seqlen_q == 1:
        cfg = _attention_config(d_pad, decode=True)
        block_n = cfg.pop("BLOCK_N")
        cfg.pop("BLOCK_M", None)
        splits, split_tokens = decode_split_plan(b, hk, block_tables.shape[1] * bs, block_n,
                                                 _num_sms(q.device))
        if splits > 1:
            part_o = torch.empty(b, hq, splits, d_pad, dtype=torch.float32, device=q.device)
            part_lse = torch.empty(b, hq, splits, dtype=torch.float32, device=q.device)
        else:
            part_o = part_lse = out          # unused: SPLIT=False writes out directly
        _paged_decode_kernel[(b, hk, splits)](
            q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out, part_o, part_lse,
            qk_scale, splits, split_tokens, *strides,
            Hq=hq, G=g, G_PAD=max(16, triton.next_power_of_2(g)), BLOCK_N=block_n, HEAD_DIM=d,
            D_PAD=d_pad, SPLIT=splits > 1, DOT_PRECISION=precision, **cfg)
        if splits > 1:
            _paged_decode_reduce_kernel[(b, hq)](
                part_o, part_lse, cu_seqlens_q, out, splits, out.stride(0), out.stride(1),
                Hq=hq, HEAD_DIM=d, D_PAD=d_pad, BLOCK_S=16, num_warps=4)
        return out
    cfg = _attention_config(d_pad, decode=False)
    g_pad = triton.next_power_of_2(g)
    block_q = max(1, cfg.pop("BLOCK_M") // g_pad)
    _paged_prefill_kernel[(triton.cdiv(max_seqlen_q, block_q), b, hk)](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out, qk_scale, *strides,
        G=g, G_PAD=g_pad, BLOCK_Q=block_q, HEAD_DIM=d, D_PAD=d_pad, DOT_PRECISION=precision,
        **cfg)
    return out


def _check_attention_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens):
    if q.dim() != 3:
        raise ValueError(f"paged_attention: q must be [T, Hq, D], got {tuple(q.shape)}")
    t, hq, d = q.shape
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[3] != d:
        raise ValueError(f"paged_attention: caches must be [NB, BS, Hk, {d}], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    hk = k_cache.shape[2]
    if hq % hk:
        raise ValueError(f"paged_attention: {hq} query heads are not a multiple of {hk} kv heads")
    if d > 256:
        raise ValueError(f"paged_attention: head dim {d} > 256 is not supported")
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


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale: float,
                    max_seqlen_q: int | None = None):
    if use_triton(q):
        return paged_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                      seq_lens, scale, max_seqlen_q)
    return paged_attention_reference(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                     seq_lens, scale)
