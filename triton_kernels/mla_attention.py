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

import inspect
import math

import torch

from triton_kernels._dispatch import fixed_configs, interpreting, tl, triton, use_triton
from triton_kernels.paged_attention import _num_sms, _paged_decode_reduce_kernel

_LOG2E = math.log2(math.e)
# Decode splits a sequence's keys into chunks of at least _MIN_SPLIT_TOKENS (a split's partial
# output, H x L float32, costs about as much to write and reduce as 256 latents cost to read)
# and at most _MAX_SPLITS; chunks are multiples of the widest BLOCK_N tried.
_MIN_SPLIT_TOKENS = 256
_MAX_SPLITS = 32
_SPLIT_ALIGN = 64


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


@triton.jit
def _mla_attend_range(acc, m_i, l_i, q_lat, q_pe, q_pos, cache_ptr, table_ptr, kv_start, kv_end,
                      stride_cb, stride_cs, qk_scale, BS, MASKED: tl.constexpr,
                      BLOCK_N: tl.constexpr, L: tl.constexpr, L_PAD: tl.constexpr,
                      R: tl.constexpr, R_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online softmax of M query rows (q_lat [M, L_PAD], q_pe [M, R_PAD]) over the latents of
    keys kv_start..kv_end-1, BLOCK_N a step, scores in the log2 domain (qk_scale = scale *
    log2 e). Each tile's c_kv [BLOCK_N, L_PAD] is loaded once and serves both the score and
    the output product; k_pe [R_PAD, BLOCK_N] only the score. MASKED tiles apply each row's
    causal limit j <= q_pos. Returns (acc [M, L_PAD] float32, m_i, l_i)."""
    offs_l = tl.arange(0, L_PAD)
    offs_r = tl.arange(0, R_PAD)
    for n0 in range(kv_start, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        block = tl.load(table_ptr + offs_n // BS, mask=mask_n, other=0).to(tl.int64)
        row = block * stride_cb + (offs_n % BS).to(tl.int64) * stride_cs              # [N]
        c_kv = tl.load(cache_ptr + row[:, None] + offs_l[None, :],
                       mask=mask_n[:, None] & (offs_l < L)[None, :], other=0.0)     # [N, L_PAD]
        k_pe = tl.load(cache_ptr + row[None, :] + L + offs_r[:, None],
                       mask=(offs_r < R)[:, None] & mask_n[None, :], other=0.0)     # [R_PAD, N]
        c_kv = c_kv.to(q_lat.dtype)
        s = tl.dot(q_lat, tl.trans(c_kv), input_precision=DOT_PRECISION)
        s = tl.dot(q_pe, k_pe.to(q_pe.dtype), s, input_precision=DOT_PRECISION) * qk_scale
        valid = mask_n[None, :]
        if MASKED:
            valid = valid & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows with no visible key yet keep m = -inf; subtract 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c_kv.dtype), c_kv,
                                            input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _load_q(q_ptr, rows, heads, mask, stride_qt, stride_qh, L: tl.constexpr,
            L_PAD: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr):
    """q_lat [M, L_PAD] and q_pe [M, R_PAD] of M (token row, head) pairs, 0 where masked."""
    offs_l = tl.arange(0, L_PAD)
    offs_r = tl.arange(0, R_PAD)
    base = q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(base + offs_l[None, :], mask=mask[:, None] & (offs_l < L)[None, :], other=0.0)
    q_pe = tl.load(base + L + offs_r[None, :], mask=mask[:, None] & (offs_r < R)[None, :],
                   other=0.0)
    return q_lat, q_pe


@triton.jit(do_not_specialize=["num_splits", "split_tokens", "stride_bt"])
def _mla_decode_kernel(q_ptr, cache_ptr, bt_ptr, cu_q_ptr, seq_lens_ptr, out_ptr, part_o_ptr,
                       part_lse_ptr, qk_scale, num_splits, split_tokens, stride_qt, stride_qh,
                       stride_ot, stride_oh, stride_bt, stride_cb, stride_cs, BS,
                       H: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                       L: tl.constexpr, L_PAD: tl.constexpr, R: tl.constexpr,
                       R_PAD: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Grid (B, cdiv(H, BLOCK_H), num_splits): BLOCK_H query heads of one decoding token over
    # one chunk of its keys, so each latent tile is read once for BLOCK_H heads. With SPLIT
    # the chunk's normalised output and log2-domain log-sum-exp go to part_o [B, H, S, L_PAD]
    # / part_lse [B, H, S] for paged attention's reduce kernel; without, straight to out.
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    q_row = tl.load(cu_q_ptr + b)
    n_q = tl.minimum(tl.load(cu_q_ptr + b + 1) - q_row, 1)   # 0: no query this step
    mask_h = heads < H * n_q
    q_lat, q_pe = _load_q(q_ptr, q_row.to(tl.int64) + 0 * heads, heads, mask_h, stride_qt,
                          stride_qh, L, L_PAD, R, R_PAD)
    kv_start = split * split_tokens
    kv_end = tl.minimum(tl.load(seq_lens_ptr + b) * n_q, kv_start + split_tokens)
    acc = tl.zeros((BLOCK_H, L_PAD), dtype=tl.float32)
    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc, m_i, l_i = _mla_attend_range(
        acc, m_i, l_i, q_lat, q_pe, heads, cache_ptr, bt_ptr + b.to(tl.int64) * stride_bt,
        kv_start, kv_end, stride_cb, stride_cs, qk_scale, BS, False, BLOCK_N, L, L_PAD, R,
        R_PAD, DOT_PRECISION)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    offs_l = tl.arange(0, L_PAD)
    if SPLIT:
        part = (b * H + heads).to(tl.int64) * num_splits + split                  # [BLOCK_H]
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(part_lse_ptr + part, lse, mask=mask_h)
        tl.store(part_o_ptr + part[:, None] * L_PAD + offs_l[None, :], out, mask=mask_h[:, None])
    else:
        tl.store(out_ptr + q_row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
                 + offs_l[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=mask_h[:, None] & (offs_l < L)[None, :])


@triton.jit(do_not_specialize=["stride_bt"])
def _mla_prefill_kernel(q_ptr, cache_ptr, bt_ptr, cu_q_ptr, seq_lens_ptr, out_ptr, qk_scale,
                        stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb,
                        stride_cs, BS, H: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, L: tl.constexpr,
                        L_PAD: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    # Grid (cdiv(max q_len, BLOCK_Q), B, cdiv(H, BLOCK_H)). A program's BLOCK_Q * BLOCK_H rows
    # are BLOCK_Q query tokens times BLOCK_H heads: row r is token r // BLOCK_H, head
    # h0 + r % BLOCK_H, and every row reads the same latent tiles.
    q_block = tl.program_id(0)      # axis 0: up to 2^31 - 1 blocks; axes 1 and 2 stop at 65535
    b = tl.program_id(1)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + b)
    offs_m = tl.arange(0, BLOCK_Q * BLOCK_H)
    q_i = q_block * BLOCK_Q + offs_m // BLOCK_H
    heads = tl.program_id(2) * BLOCK_H + offs_m % BLOCK_H
    mask_m = (q_i < q_len) & (heads < H)
    q_row = (q_start + q_i).to(tl.int64)
    q_lat, q_pe = _load_q(q_ptr, q_row, heads, mask_m, stride_qt, stride_qh, L, L_PAD, R, R_PAD)
    q_pos = ctx - q_len + q_i                                   # this row sees keys 0..q_pos
    first_pos = ctx - q_len + q_block * BLOCK_Q
    kv_end = tl.minimum(ctx, first_pos + BLOCK_Q)
    # Keys before the block's first query are visible to every row (no mask); the tiles
    # from there to kv_end hold the diagonal and are masked per row.
    full_end = tl.minimum((first_pos + 1) // BLOCK_N * BLOCK_N, kv_end)
    table = bt_ptr + b.to(tl.int64) * stride_bt
    acc = tl.zeros((BLOCK_Q * BLOCK_H, L_PAD), dtype=tl.float32)
    m_i = tl.full((BLOCK_Q * BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_Q * BLOCK_H,), dtype=tl.float32)
    acc, m_i, l_i = _mla_attend_range(
        acc, m_i, l_i, q_lat, q_pe, q_pos, cache_ptr, table, 0, full_end, stride_cb, stride_cs,
        qk_scale, BS, False, BLOCK_N, L, L_PAD, R, R_PAD, DOT_PRECISION)
    acc, m_i, l_i = _mla_attend_range(
        acc, m_i, l_i, q_lat, q_pe, q_pos, cache_ptr, table, full_end, kv_end, stride_cb,
        stride_cs, qk_scale, BS, True, BLOCK_N, L, L_PAD, R, R_PAD, DOT_PRECISION)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    offs_l = tl.arange(0, L_PAD)
    tl.store(out_ptr + q_row[:, None] * stride_ot + heads[:, None] * stride_oh + offs_l[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & (offs_l < L)[None, :])


@triton.jit
def _write_latent_kernel(latent_ptr, cache_ptr, slot_ptr, stride_lt, stride_cb, stride_cs, BS,
                         D: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per token: its D = L + R latent values into its cache row.
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK_D)
    x = tl.load(latent_ptr + tok * stride_lt + offs, mask=offs < D)
    tl.store(cache_ptr + (slot // BS) * stride_cb + (slot % BS) * stride_cs + offs,
             x.to(cache_ptr.dtype.element_ty), mask=offs < D)


# ---- launchers --------------------------------------------------------------------------------
# Autotune keys: (H, L, R) and the tensors' dtypes (added by triton), fixed per model, so any
# decode step and any prefill the warmup ladder runs covers them. The tuned knobs (BLOCK_N,
# warps, stages) never change the grid; the heads per program do, so they follow a heuristic.
# Every config fits sm_80's shared memory at L 512, R 64 in bf16 (tools/compile_check.py): a
# 64-key tile of the 512-wide latent does not (decode 164 KiB, prefill 200 KiB > 163 KiB).
# Few candidates: each is compiled for two archs in CI's compile check (about 3 s of CPU each).
# Also compiled and fitting, left out for that: decode BLOCK_N 16 (w4 s2, s3), prefill w8 s1.
# Registers (ptxas -v): decode at 8 warps 175-181, no spills on sm_80/sm_90; at 4 warps 255
# and split-KV spills 52 B on sm_80; prefill 255, spilling 28 B on sm_90 (64 rows x 512 fp32).
_AUTOTUNE_KEY = ["H", "L", "R"]
_DECODE_CONFIGS = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
                   for n, w, s in ((32, 4, 2), (32, 8, 2))]
_PREFILL_CONFIGS = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
                    for n, w, s in ((16, 8, 2), (32, 8, 2))]
_FIXED_GPU_CONFIG = {True: dict(BLOCK_N=32, num_warps=8, num_stages=2),      # decode
                     False: dict(BLOCK_N=32, num_warps=8, num_stages=2)}     # prefill
_INTERPRETER_CONFIG = dict(BLOCK_N=16, num_warps=4, num_stages=1)
_CACHE = ({"cache_results": True}
          if "cache_results" in inspect.signature(triton.autotune).parameters else {})
_DECODE = triton.autotune(configs=_DECODE_CONFIGS, key=_AUTOTUNE_KEY, **_CACHE)(
    _mla_decode_kernel)
_PREFILL = triton.autotune(configs=_PREFILL_CONFIGS, key=_AUTOTUNE_KEY, **_CACHE)(
    _mla_prefill_kernel)


def mla_block_heads(h: int, decode: bool) -> tuple[int, int]:
    """(BLOCK_H heads, BLOCK_Q tokens) per program. tl.dot needs 16 rows; the float32 output
    tile rows x L_PAD lives in registers, so decode keeps 32 heads (DeepSeek's 128 heads: 4
    programs a split, each latent tile read 4 times, from L2 after the first) and prefill 64
    rows (tokens x heads), interpreted 16 heads and 2 tokens."""
    h_pad = max(16, triton.next_power_of_2(h))
    if interpreting():
        return 16, 2
    if decode:
        return min(h_pad, 32), 1
    block_h = min(h_pad, 64)
    return block_h, max(1, 64 // block_h)


def mla_split_plan(num_seqs: int, num_head_blocks: int, max_context: int,
                   num_sms: int) -> tuple[int, int]:
    """(num_splits, tokens per split) for decode over up to max_context keys: about two waves
    of (seq, head block, split) programs, no split under _MIN_SPLIT_TOKENS keys."""
    want = triton.cdiv(2 * num_sms, max(1, num_seqs * num_head_blocks))
    splits = max(1, min(want, max_context // _MIN_SPLIT_TOKENS, _MAX_SPLITS))
    split_tokens = triton.cdiv(triton.cdiv(max_context, splits), _SPLIT_ALIGN) * _SPLIT_ALIGN
    return triton.cdiv(max_context, split_tokens), split_tokens


def _launch(kernel, tuned, grid, decode: bool, args: tuple, **kwargs):
    if fixed_configs():
        config = _INTERPRETER_CONFIG if interpreting() else _FIXED_GPU_CONFIG[decode]
        kernel[grid](*args, **kwargs, **config)
    else:
        tuned[grid](*args, **kwargs)


def mla_attention_triton(q, latent_cache, block_tables, cu_seqlens_q, seq_lens, scale: float,
                         kv_lora_rank: int, max_seqlen_q: int | None = None):
    """Split-KV decode (+ paged attention's reduce) when max_seqlen_q == 1, else the varlen
    causal prefill kernel. max_seqlen_q is the host's bound on the longest q span (read off
    cu_seqlens_q, a device sync, when None); it sizes the prefill grid, so it must not be
    short."""
    _check_mla_args(q, latent_cache, block_tables, cu_seqlens_q, seq_lens, kv_lora_rank)
    t, h, d = q.shape
    l, r = kv_lora_rank, d - kv_lora_rank
    b, bs = seq_lens.shape[0], latent_cache.shape[1]
    out = q.new_empty(t, h, l)
    if t == 0 or b == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    l_pad = max(16, triton.next_power_of_2(l))
    dims = dict(H=h, L=l, L_PAD=l_pad, R=r, R_PAD=max(16, triton.next_power_of_2(r)),
                # fp32 (tests) gets exact products; fp16/bf16 take the backend's default.
                DOT_PRECISION="ieee" if q.dtype == torch.float32 else None)
    strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
               latent_cache.stride(0), latent_cache.stride(1), bs)
    qk_scale = scale * _LOG2E
    decode = max_seqlen_q == 1
    block_h, block_q = mla_block_heads(h, decode)
    head_blocks = triton.cdiv(h, block_h)
    if not decode:
        _launch(_mla_prefill_kernel, _PREFILL, (triton.cdiv(max_seqlen_q, block_q), b, head_blocks),
                False, (q, latent_cache, block_tables, cu_seqlens_q, seq_lens, out, qk_scale,
                        *strides), BLOCK_H=block_h, BLOCK_Q=block_q, **dims)
        return out
    # Split the span a query can see (host-side bound, no sync): the table's capacity.
    splits, split_tokens = mla_split_plan(b, head_blocks, block_tables.shape[1] * bs,
                                          _num_sms(q.device))
    if splits > 1:
        part_o = torch.empty(b, h, splits, l_pad, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(b, h, splits, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out              # unused: SPLIT=False writes out directly
    _launch(_mla_decode_kernel, _DECODE, (b, head_blocks, splits), True,
            (q, latent_cache, block_tables, cu_seqlens_q, seq_lens, out, part_o, part_lse,
             qk_scale, splits, split_tokens, *strides), BLOCK_H=block_h, SPLIT=splits > 1,
            **dims)
    if splits > 1:
        _paged_decode_reduce_kernel[(b, h)](
            part_o, part_lse, cu_seqlens_q, out, out, splits, out.stride(0), out.stride(1),
            Hq=h, HEAD_DIM_V=l, DV_PAD=l_pad, BLOCK_S=16, HAS_SINKS=False, num_warps=4)
    return out


def write_latent_triton(latent, latent_cache, slot_mapping):
    _check_write_args(latent, latent_cache, slot_mapping)
    t, d = latent.shape
    if t == 0:
        return
    _write_latent_kernel[(t,)](latent, latent_cache, slot_mapping.contiguous(), latent.stride(0),
                               latent_cache.stride(0), latent_cache.stride(1),
                               latent_cache.shape[1], D=d, BLOCK_D=triton.next_power_of_2(d),
                               num_warps=4)


def mla_attention(q, latent_cache, block_tables, cu_seqlens_q, seq_lens, scale: float,
                  kv_lora_rank: int, max_seqlen_q: int | None = None):
    """-> o [T, H, kv_lora_rank] in q's dtype (see the module docstring)."""
    op = mla_attention_triton if use_triton(q) else mla_attention_reference
    return op(q, latent_cache, block_tables, cu_seqlens_q, seq_lens, scale, kv_lora_rank,
              max_seqlen_q)


def write_latent(latent, latent_cache, slot_mapping):
    op = write_latent_triton if use_triton(latent) else write_latent_reference
    return op(latent, latent_cache, slot_mapping)
