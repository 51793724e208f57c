"""Mixture-of-experts FFN over routed tokens.

x: [T, D]; w13: [S, 2I, D] (gate rows then up rows, per expert slot); w2: [S, D, I];
topk_weights: [T, k] (any float dtype; applied in x's dtype); topk_ids: [T, k] expert ids.
slot_map: optional [E] int tensor mapping expert id -> slot in w13/w2 (the GPU expert cache's
pool); None means slot == expert id. Returns [T, D] = sum_j w_j * down(silu(gate) * up).

The Triton path: (1) align: sort the T*k (token, k) pairs by expert and pad each expert's list
to a multiple of BLOCK_M (three small kernels, no host sync); (2) GEMM1 over (expert block,
I tile): x @ w13[slot]^T with SiLU-and-multiply fused in the epilogue; (3) GEMM2: act @
w2[slot]^T times the routing weight, one row per pair; (4) sum each token's k rows.
"""

import inspect

import torch
import torch.nn.functional as F

from triton_kernels._dispatch import interpreting, tl, triton, use_triton


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        slot_map: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.zeros_like(x)
    flat_ids = topk_ids.reshape(-1)
    # Group (token, k) pairs by expert so each expert runs one matmul, like HF's loop.
    for e in torch.unique(flat_ids).tolist():
        token_idx, pos = torch.where(topk_ids == e)
        slot = e if slot_map is None else int(slot_map[e])
        h = x[token_idx]
        gate, up = F.linear(h, w13[slot]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, w2[slot])
        h = h * topk_weights[token_idx, pos, None].to(h.dtype)
        out.index_add_(0, token_idx, h.to(out.dtype))
    return out


# Autotune keys. Token counts map to a power-of-two bucket (capped), never the raw count, so
# the warmup ladder can visit every key. Up to _DECODE_MAX_TOKENS tokens the decode configs
# apply: BLOCK_M = 16 (tl.dot's minimum) and narrow, deep tiles that stream each active
# expert's weights once, as a grouped GEMV would.
FUSED_MOE_TOKEN_BUCKETS = tuple(2 ** i for i in range(13))       # 1 .. 4096
_DECODE_MAX_TOKENS = 64
_ALIGN_CHUNK = 128        # pairs per program in the align kernels
_GROUP_M = 8              # M blocks (one expert's, mostly) walked together for L2 reuse


def fused_moe_autotune_keys(num_tokens: int, top_k: int, num_experts: int) -> tuple[int, int]:
    """The (token bucket, BLOCK_M) a call with num_tokens tokens autotunes under.

    With the model's hidden and expert widths and its dtype (the rest of the key, fixed per
    model), this is the whole autotune key of both GEMM kernels: a warmup that runs one
    forward per FUSED_MOE_TOKEN_BUCKETS entry covers every key a request can hit.
    """
    # Plain Python (no triton call), so the scheduler can plan its warmup anywhere.
    bucket = min(1 << (max(1, num_tokens) - 1).bit_length(), FUSED_MOE_TOKEN_BUCKETS[-1])
    if bucket <= _DECODE_MAX_TOKENS:
        return bucket, 16
    # Expected pairs per expert under uniform routing: keep most blocks full.
    per_expert = bucket * top_k / max(1, num_experts)
    return bucket, 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_count_kernel(ids_ptr, chunk_counts_ptr, num_pairs,
                      BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    # Grid (num_chunks,): histogram of the experts of CHUNK pairs -> chunk_counts[chunk, :].
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    expert = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
    offs_e = tl.arange(0, BLOCK_E)
    hist = tl.sum((expert[:, None] == offs_e[None, :]).to(tl.int32), axis=0)
    tl.store(chunk_counts_ptr + chunk * BLOCK_E + offs_e, hist)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "max_blocks"])
def _moe_offsets_kernel(chunk_counts_ptr, chunk_base_ptr, expert_start_ptr, sorted_ids_ptr,
                        block_slot_ptr, num_padded_ptr, slot_map_ptr,
                        num_pairs, num_chunks, max_blocks, HAS_SLOT_MAP: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
                        BLOCK_B: tl.constexpr):
    # One program. chunk_base[c, e] = pairs of expert e in chunks before c; each expert's
    # padded list starts at expert_start[e]; its tail is filled with the sentinel num_pairs;
    # block_slot[j] = the weight slot of the expert owning M block j.
    offs_e = tl.arange(0, BLOCK_E)
    total = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        ptrs = offs_c[:, None] * BLOCK_E + offs_e[None, :]
        mask = (offs_c < num_chunks)[:, None]
        counts = tl.load(chunk_counts_ptr + ptrs, mask=mask, other=0)
        tl.store(chunk_base_ptr + ptrs, total[None, :] + tl.cumsum(counts, axis=0) - counts,
                 mask=mask)
        total += tl.sum(counts, axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    num_padded = tl.sum(padded, axis=0)
    tl.store(expert_start_ptr + offs_e, start)
    tl.store(num_padded_ptr, num_padded)
    pos = (start + total)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_ids_ptr + pos, tl.zeros_like(pos) + num_pairs, mask=pos < end[:, None])
    for b0 in range(0, max_blocks, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        # The owner of block j is the first expert whose padded list ends after j * BLOCK_M.
        expert = tl.sum((end[None, :] <= offs_b[:, None] * BLOCK_M).to(tl.int32), axis=1)
        valid = offs_b * BLOCK_M < num_padded
        if HAS_SLOT_MAP:
            slot = tl.load(slot_map_ptr + expert, mask=valid, other=0).to(tl.int32)
        else:
            slot = expert
        tl.store(block_slot_ptr + offs_b, tl.where(valid, slot, 0), mask=offs_b < max_blocks)


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_scatter_kernel(ids_ptr, chunk_base_ptr, expert_start_ptr, sorted_ids_ptr, num_pairs,
                        BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    # Grid (num_chunks,): pair p goes to expert_start[e] + chunk_base[chunk, e] + its rank
    # among the chunk's earlier pairs of e, so each expert's list keeps token order (stable).
    chunk = tl.program_id(0)
    offs_i = tl.arange(0, CHUNK)
    offs = chunk * CHUNK + offs_i
    mask = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=mask, other=-1).to(tl.int32)
    earlier = (expert[:, None] == expert[None, :]) & (offs_i[None, :] < offs_i[:, None])
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    base = tl.load(chunk_base_ptr + chunk * BLOCK_E + expert, mask=mask, other=0)
    start = tl.load(expert_start_ptr + expert, mask=mask, other=0)
    tl.store(sorted_ids_ptr + start + base + rank, offs, mask=mask)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
              slot_map: torch.Tensor | None):
    """Sort pairs by expert, padded per expert to BLOCK_M, without a host sync.

    Returns (sorted_ids [max_blocks * BLOCK_M] int32: pair index or the sentinel T*k,
    block_slot [max_blocks] int32: weight slot per M block, num_padded [1] int32: blocks in
    use times BLOCK_M). max_blocks bounds the padded length from host-side sizes: every
    active expert (at most min(E, T*k)) wastes at most BLOCK_M - 1 rows.
    """
    ids = topk_ids.reshape(-1)
    num_pairs = ids.numel()
    dev = ids.device
    block_e = triton.next_power_of_2(num_experts)
    num_chunks = triton.cdiv(num_pairs, _ALIGN_CHUNK)
    max_blocks = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    chunk_counts = torch.empty(num_chunks, block_e, dtype=torch.int32, device=dev)
    chunk_base = torch.empty_like(chunk_counts)
    expert_start = torch.empty(block_e, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    block_slot = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    _moe_count_kernel[(num_chunks,)](ids, chunk_counts, num_pairs,
                                     BLOCK_E=block_e, CHUNK=_ALIGN_CHUNK, num_warps=4)
    _moe_offsets_kernel[(1,)](
        chunk_counts, chunk_base, expert_start, sorted_ids, block_slot, num_padded,
        block_slot if slot_map is None else slot_map, num_pairs, num_chunks, max_blocks,
        HAS_SLOT_MAP=slot_map is not None, BLOCK_M=block_m, BLOCK_E=block_e,
        BLOCK_C=max(1, 4096 // block_e), BLOCK_B=max(1, 4096 // block_e), num_warps=4)
    _moe_scatter_kernel[(num_chunks,)](ids, chunk_base, expert_start, sorted_ids, num_pairs,
                                       BLOCK_E=block_e, CHUNK=_ALIGN_CHUNK, num_warps=4)
    return sorted_ids, block_slot, num_padded


@triton.jit
def _tile_ids(N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of this program; GROUP_M consecutive M blocks share each N tile's turn."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_m = tl.num_programs(0) // num_pid_n
    per_group = GROUP_M * num_pid_n
    first_m = pid // per_group * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    return pid_m, pid_n


@triton.jit(do_not_specialize=["num_pairs", "M_BUCKET"])
def _moe_gemm1_kernel(x_ptr, w13_ptr, act_ptr, sorted_ids_ptr, block_slot_ptr, num_padded_ptr,
                      num_pairs, M_BUCKET, N, K, stride_xt, stride_ws, stride_wn, stride_at,
                      TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    # act[r, n] = silu(x[tok(r)] . w13[slot, n]) * (x[tok(r)] . w13[slot, N + n]) for the
    # BLOCK_M padded rows r of one expert block and BLOCK_N of the N = I columns.
    # M_BUCKET only feeds the autotune key.
    pid_m, pid_n = _tile_ids(N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    slot = tl.load(block_slot_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    mask_m = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :]
    gate_ptrs = w13_ptr + slot * stride_ws + offs_n[None, :] * stride_wn + offs_k[:, None]
    up_ptrs = gate_ptrs + N * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w_mask = mask_k[:, None] & mask_n[None, :]
        acc_gate = tl.dot(a, tl.load(gate_ptrs, mask=w_mask, other=0.0), acc=acc_gate,
                          input_precision=DOT_PRECISION)
        acc_up = tl.dot(a, tl.load(up_ptrs, mask=w_mask, other=0.0), acc=acc_up,
                        input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    # Round as the reference does: linear outputs, then silu, then the product, in x's dtype.
    dtype = x_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype) * acc_up.to(dtype)
    tl.store(act_ptr + offs_m.to(tl.int64)[:, None] * stride_at + offs_n[None, :], act,
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["num_pairs", "M_BUCKET"])
def _moe_gemm2_kernel(act_ptr, w2_ptr, out_ptr, sorted_ids_ptr, block_slot_ptr, num_padded_ptr,
                      topk_w_ptr, num_pairs, M_BUCKET, N, K, stride_at, stride_ws, stride_wn,
                      stride_ot, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    # out[pair(r), n] = w(pair) * (act[r] . w2[slot, n]) for N = D output columns, K = I.
    pid_m, pid_n = _tile_ids(N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    slot = tl.load(block_slot_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    mask_m = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + offs_m.to(tl.int64)[:, None] * stride_at + offs_k[None, :]
    w_ptrs = w2_ptr + slot * stride_ws + offs_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, w, acc=acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    route_w = tl.load(topk_w_ptr + pair, mask=mask_m, other=0.0).to(dtype)
    y = acc.to(dtype) * route_w[:, None]
    tl.store(out_ptr + pair.to(tl.int64)[:, None] * stride_ot + offs_n[None, :], y,
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _moe_sum_kernel(pairs_ptr, out_ptr, D, stride_pt, stride_ot,
                    TOP_K: tl.constexpr, BLOCK_D: tl.constexpr):
    # Grid (T, cdiv(D, BLOCK_D)): out[t] = sum_j pairs[t * k + j], in float32.
    tok = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(pairs_ptr + (tok * TOP_K + j) * stride_pt + offs, mask=mask,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + tok * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _configs(block_n_k_warps_stages):
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
            for n, k, w, s in block_n_k_warps_stages]


# Decode: a few rows per expert, memory bound; narrow N tiles give enough programs to keep
# every SM streaming weights, deep K tiles and stages keep the loads in flight.
_DECODE_CONFIGS = _configs([(16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3),
                            (64, 128, 4, 4), (64, 64, 4, 5), (128, 64, 4, 4)])
_PREFILL_CONFIGS = _configs([(64, 64, 4, 4), (128, 64, 4, 4), (128, 64, 8, 3),
                             (64, 128, 4, 3), (128, 128, 8, 3)])
_INTERPRETER_CONFIG = dict(BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1)
_AUTOTUNE_KEY = ["M_BUCKET", "BLOCK_M", "N", "K"]     # + the tensors' dtypes, added by triton
# Autotune results persist in triton's cache dir where triton supports it (>= 3.4).
_CACHE = ({"cache_results": True}
          if "cache_results" in inspect.signature(triton.autotune).parameters else {})
_GEMM1 = {decode: triton.autotune(configs=cfgs, key=_AUTOTUNE_KEY, **_CACHE)(_moe_gemm1_kernel)
          for decode, cfgs in ((True, _DECODE_CONFIGS), (False, _PREFILL_CONFIGS))}
_GEMM2 = {decode: triton.autotune(configs=cfgs, key=_AUTOTUNE_KEY, **_CACHE)(_moe_gemm2_kernel)
          for decode, cfgs in ((True, _DECODE_CONFIGS), (False, _PREFILL_CONFIGS))}


def _launch_gemm(kernel, tuned, max_blocks: int, n: int, args: tuple, **kwargs):
    """Autotuned on a GPU; one fixed config under the interpreter, which cannot tune."""
    if interpreting():
        grid = (max_blocks * triton.cdiv(n, _INTERPRETER_CONFIG["BLOCK_N"]),)
        kernel[grid](*args, **kwargs, **_INTERPRETER_CONFIG)
    else:
        tuned[lambda meta: (max_blocks * triton.cdiv(n, meta["BLOCK_N"]),)](*args, **kwargs)


def fused_moe_triton(x, w13, w2, topk_weights, topk_ids, slot_map=None):
    _check_moe_args(x, w13, w2, topk_weights, topk_ids, slot_map)
    t, d = x.shape
    inter = w2.shape[2]
    top_k = topk_ids.shape[1]
    num_experts = w13.shape[0] if slot_map is None else slot_map.shape[0]
    out = torch.empty_like(x)
    if t == 0:
        return out
    bucket, block_m = fused_moe_autotune_keys(t, top_k, num_experts)
    decode = bucket <= _DECODE_MAX_TOKENS
    sorted_ids, block_slot, num_padded = moe_align(topk_ids, num_experts, block_m, slot_map)
    max_blocks = block_slot.shape[0]
    num_pairs = t * top_k
    # fp32 (tests) gets exact products; fp16/bf16 take the backend's default.
    precision = "ieee" if x.dtype == torch.float32 else None
    # act rows follow the sorted, padded order, so GEMM2 reads them without a gather.
    act = torch.empty(max_blocks * block_m, inter, dtype=x.dtype, device=x.device)
    _launch_gemm(_moe_gemm1_kernel, _GEMM1[decode], max_blocks, inter,
                 (x, w13, act, sorted_ids, block_slot, num_padded, num_pairs, bucket, inter, d,
                  x.stride(0), w13.stride(0), w13.stride(1), act.stride(0)),
                 TOP_K=top_k, BLOCK_M=block_m, GROUP_M=_GROUP_M, DOT_PRECISION=precision)
    # Each pair's weighted output gets its own row, summed per token afterwards, rather than
    # atomically added into a float32 [T, D] buffer: the result is deterministic, nothing
    # needs zeroing (autotune reruns are harmless), and no extra float32 -> dtype pass runs;
    # the T*k*D round trip is small next to the expert weights streamed.
    pairs = out if top_k == 1 else torch.empty(num_pairs, d, dtype=x.dtype, device=x.device)
    _launch_gemm(_moe_gemm2_kernel, _GEMM2[decode], max_blocks, d,
                 (act, w2, pairs, sorted_ids, block_slot, num_padded, topk_weights.contiguous(),
                  num_pairs, bucket, d, inter, act.stride(0), w2.stride(0), w2.stride(1),
                  pairs.stride(0)),
                 BLOCK_M=block_m, GROUP_M=_GROUP_M, DOT_PRECISION=precision)
    if top_k > 1:
        block_d = min(triton.next_power_of_2(d), 1024)
        _moe_sum_kernel[(t, triton.cdiv(d, block_d))](
            pairs, out, d, pairs.stride(0), out.stride(0), TOP_K=top_k, BLOCK_D=block_d,
            num_warps=4)
    return out


def _check_moe_args(x, w13, w2, topk_weights, topk_ids, slot_map):
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fused_moe: x [T, D], w13 [S, 2I, D], w2 [S, D, I] expected, got "
                         f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    t, d = x.shape
    s, two_i, _ = w13.shape
    if w13.shape[2] != d or two_i % 2 or tuple(w2.shape) != (s, d, two_i // 2):
        raise ValueError(f"fused_moe: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit "
                         f"hidden size {d} (w13 [S, 2I, {d}], w2 [S, {d}, I])")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"fused_moe: weights {w13.dtype}/{w2.dtype} must match x {x.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"fused_moe: topk_ids and topk_weights must be [{t}, k], got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64) or not topk_weights.is_floating_point():
        raise ValueError(f"fused_moe: topk_ids must be int32/int64 and topk_weights float, got "
                         f"{topk_ids.dtype} and {topk_weights.dtype}")
    if slot_map is not None and (slot_map.dim() != 1 or slot_map.dtype not in (torch.int32,
                                                                                 torch.int64)):
        raise ValueError(f"fused_moe: slot_map must be a 1-d int tensor, got "
                         f"{tuple(slot_map.shape)} {slot_map.dtype}")
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("fused_moe: x, w13 and w2 need a contiguous last dimension")


def fused_moe(x, w13, w2, topk_weights, topk_ids, slot_map=None):
    if use_triton(x):
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, slot_map)
    return fused_moe_reference(x, w13, w2, topk_weights, topk_ids, slot_map)
