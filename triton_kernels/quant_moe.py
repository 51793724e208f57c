"""fused_moe_quant's Triton kernels: fused_moe.py's two forms on quantized expert banks.

w13 {"q": [S, 2I, ..], "s": [S, ..], ..} and w2 {"q": [S, D, ..], ..} in dequant.py's formats;
each kernel reads its slot's weight tile and scales and decodes them in registers (dequant.
_dequant_tile) to x's dtype, then runs fused_moe's arithmetic unchanged:
- GEMV (decode, up to fused_moe._GEMV_MAX_TOKENS tokens): (1) per (token, k) pair and I tile,
  act(x . gate, x . up); (2) per token and D tile, the k weighted down projections summed in
  registers. At batch 1 the layer streams k experts' quantized bytes once.
- Grouped (above it): moe_align sorts the pairs into expert blocks, GEMM1 (tl.dot) with the
  activation in its epilogue, GEMM2 times the routing weight, then fused_moe's per-token sum.
The routing (slot_map, biases, activations, autotune keys and launch configs) is fused_moe's.
"""

import torch

from triton_kernels._dispatch import tl, triton
from triton_kernels.dequant import KernelWeight, QuantFormat, _check_moe, _dequant_tile
from triton_kernels.fused_moe import (_CACHE, _DECODE_CONFIGS, _DECODE_MAX_TOKENS, _GEMV_CONFIGS,
                                      _GROUP_M, _PATHS, _PREFILL_CONFIGS, SILU, MoeActivation,
                                      _Epilogue, _expert_slot, _gated_act, _grouped_block_m,
                                      _launch, _moe_path, _moe_sum_kernel, _tile_ids,
                                      _token_bucket)
from triton_kernels.moe_align import moe_align


@triton.jit(do_not_specialize=["num_pairs", "M_BUCKET"])
def _qmoe_gemm1_kernel(x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, b13_ptr, act_ptr, sorted_ids_ptr,
                       block_slot_ptr, num_padded_ptr, num_pairs, M_BUCKET, N, K, stride_xt,
                       stride_qs, stride_qn, stride_ss, stride_sn, stride_gs, stride_bs,
                       stride_at, alpha, limit, KIND: tl.constexpr, SCALE_ROWS: tl.constexpr,
                       GROUP_K: tl.constexpr, HAS_ZERO: tl.constexpr, SCALE_BF16: tl.constexpr,
                       TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # fused_moe._moe_gemm1_kernel with W13 rows n (gate) and N + n (up) decoded per K tile.
    pid_m, pid_n = _tile_ids(N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    slot = tl.load(block_slot_ptr + pid_m).to(tl.int64)
    q_ptr += slot * stride_qs
    s_ptr += slot * stride_ss
    z_ptr += slot * stride_ss
    g_ptr += slot * stride_gs
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    mask_m = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    dtype = x_ptr.dtype.element_ty
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + offs_k
        mask_k = cols < K
        a = tl.load(x_ptr + token[:, None] * stride_xt + cols[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        gate = tl.trans(_dequant_tile(q_ptr, s_ptr, z_ptr, g_ptr, offs_n, k0, mask_n, K,
                                      stride_qn, stride_sn, KIND, SCALE_ROWS, GROUP_K, HAS_ZERO,
                                      SCALE_BF16, BLOCK_N, BLOCK_K))
        up = tl.trans(_dequant_tile(q_ptr, s_ptr, z_ptr, g_ptr, N + offs_n, k0, mask_n, K,
                                    stride_qn, stride_sn, KIND, SCALE_ROWS, GROUP_K, HAS_ZERO,
                                    SCALE_BF16, BLOCK_N, BLOCK_K))
        acc_gate = tl.dot(a, gate.to(dtype), acc=acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(a, up.to(dtype), acc=acc_up, input_precision=DOT_PRECISION)
    gate = acc_gate.to(dtype)
    up = acc_up.to(dtype)
    if HAS_BIAS:
        b_ptrs = b13_ptr + slot * stride_bs + offs_n
        gate = gate + tl.load(b_ptrs, mask=mask_n, other=0.0)[None, :]
        up = up + tl.load(b_ptrs + N, mask=mask_n, other=0.0)[None, :]
    act = _gated_act(gate, up, alpha, limit, ACTIVATION)
    tl.store(act_ptr + offs_m.to(tl.int64)[:, None] * stride_at + offs_n[None, :], act,
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["num_pairs", "M_BUCKET"])
def _qmoe_gemm2_kernel(act_ptr, q_ptr, s_ptr, z_ptr, g_ptr, b2_ptr, out_ptr, sorted_ids_ptr,
                       block_slot_ptr, num_padded_ptr, topk_w_ptr, num_pairs, M_BUCKET, N, K,
                       stride_at, stride_qs, stride_qn, stride_ss, stride_sn, stride_gs,
                       stride_bs, stride_ot, KIND: tl.constexpr, SCALE_ROWS: tl.constexpr,
                       GROUP_K: tl.constexpr, HAS_ZERO: tl.constexpr, SCALE_BF16: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
    # fused_moe._moe_gemm2_kernel with W2 [N = D, K = I] decoded per K tile.
    pid_m, pid_n = _tile_ids(N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    slot = tl.load(block_slot_ptr + pid_m).to(tl.int64)
    q_ptr += slot * stride_qs
    s_ptr += slot * stride_ss
    z_ptr += slot * stride_ss
    g_ptr += slot * stride_gs
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    mask_m = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + offs_k
        mask_k = cols < K
        a = tl.load(act_ptr + offs_m.to(tl.int64)[:, None] * stride_at + cols[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.trans(_dequant_tile(q_ptr, s_ptr, z_ptr, g_ptr, offs_n, k0, mask_n, K, stride_qn,
                                   stride_sn, KIND, SCALE_ROWS, GROUP_K, HAS_ZERO, SCALE_BF16,
                                   BLOCK_N, BLOCK_K))
        acc = tl.dot(a, w.to(dtype), acc=acc, input_precision=DOT_PRECISION)
    route_w = tl.load(topk_w_ptr + pair, mask=mask_m, other=0.0).to(dtype)
    y = acc.to(dtype)
    if HAS_BIAS:
        y = y + tl.load(b2_ptr + slot * stride_bs + offs_n, mask=mask_n, other=0.0)[None, :]
    y = y * route_w[:, None]
    tl.store(out_ptr + pair.to(tl.int64)[:, None] * stride_ot + offs_n[None, :], y,
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["M_BUCKET"])
def _qmoe_gemv1_kernel(x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, b13_ptr, act_ptr, ids_ptr,
                       slot_map_ptr, M_BUCKET, N, K, stride_xt, stride_qs, stride_qn, stride_ss,
                       stride_sn, stride_gs, stride_bs, stride_at, alpha, limit,
                       KIND: tl.constexpr, SCALE_ROWS: tl.constexpr, GROUP_K: tl.constexpr,
                       HAS_ZERO: tl.constexpr, SCALE_BF16: tl.constexpr, TOP_K: tl.constexpr,
                       HAS_SLOT_MAP: tl.constexpr, HAS_BIAS: tl.constexpr,
                       ACTIVATION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # fused_moe._moe_gemv1_kernel: grid (T*k pairs, cdiv(N = I, BLOCK_N)), K = D.
    pair = tl.program_id(0)
    slot = _expert_slot(ids_ptr, slot_map_ptr, pair, HAS_SLOT_MAP)
    q_ptr += slot * stride_qs
    s_ptr += slot * stride_ss
    z_ptr += slot * stride_ss
    g_ptr += slot * stride_gs
    token = (pair // TOP_K).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    dtype = x_ptr.dtype.element_ty
    acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + offs_k
        mask_k = cols < K
        a = tl.load(x_ptr + token * stride_xt + cols, mask=mask_k, other=0.0).to(tl.float32)
        gate = _dequant_tile(q_ptr, s_ptr, z_ptr, g_ptr, offs_n, k0, mask_n, K, stride_qn,
                             stride_sn, KIND, SCALE_ROWS, GROUP_K, HAS_ZERO, SCALE_BF16, BLOCK_N,
                             BLOCK_K)
        up = _dequant_tile(q_ptr, s_ptr, z_ptr, g_ptr, N + offs_n, k0, mask_n, K, stride_qn,
                           stride_sn, KIND, SCALE_ROWS, GROUP_K, HAS_ZERO, SCALE_BF16, BLOCK_N,
                           BLOCK_K)
        acc_gate += a[None, :] * gate.to(dtype).to(tl.float32)
        acc_up += a[None, :] * up.to(dtype).to(tl.float32)
    gate = tl.sum(acc_gate, axis=1).to(dtype)
    up = tl.sum(acc_up, axis=1).to(dtype)
    if HAS_BIAS:
        b_ptrs = b13_ptr + slot * stride_bs + offs_n
        gate = gate + tl.load(b_ptrs, mask=mask_n, other=0.0)
        up = up + tl.load(b_ptrs + N, mask=mask_n, other=0.0)
    act = _gated_act(gate, up, alpha, limit, ACTIVATION)
    tl.store(act_ptr + pair.to(tl.int64) * stride_at + offs_n, act, mask=mask_n)


@triton.jit(do_not_specialize=["M_BUCKET"])
def _qmoe_gemv2_kernel(act_ptr, q_ptr, s_ptr, z_ptr, g_ptr, b2_ptr, out_ptr, ids_ptr,
                       slot_map_ptr, topk_w_ptr, M_BUCKET, N, K, stride_at, stride_qs,
                       stride_qn, stride_ss, stride_sn, stride_gs, stride_bs, stride_ot,
                       KIND: tl.constexpr, SCALE_ROWS: tl.constexpr, GROUP_K: tl.constexpr,
                       HAS_ZERO: tl.constexpr, SCALE_BF16: tl.constexpr, TOP_K: tl.constexpr,
                       HAS_SLOT_MAP: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # fused_moe._moe_gemv2_kernel: grid (T, cdiv(N = D, BLOCK_N)), K = I; the k weighted
    # terms summed in float32 registers and stored once (a loop over k, as there: unrolled it
    # spills).
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    dtype = out_ptr.dtype.element_ty
    acc_out = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in range(TOP_K):
        pair = token * TOP_K + j
        slot = _expert_slot(ids_ptr, slot_map_ptr, pair, HAS_SLOT_MAP)
        a_ptrs = act_ptr + pair.to(tl.int64) * stride_at + offs_k
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + offs_k
            mask_k = cols < K
            a = tl.load(a_ptrs + k0, mask=mask_k, other=0.0).to(tl.float32)
            w = _dequant_tile(q_ptr + slot * stride_qs, s_ptr + slot * stride_ss,
                              z_ptr + slot * stride_ss, g_ptr + slot * stride_gs, offs_n, k0,
                              mask_n, K, stride_qn, stride_sn, KIND, SCALE_ROWS, GROUP_K, HAS_ZERO,
                              SCALE_BF16, BLOCK_N, BLOCK_K)
            acc += a[None, :] * w.to(dtype).to(tl.float32)
        route_w = tl.load(topk_w_ptr + pair).to(dtype)
        y = tl.sum(acc, axis=1).to(dtype)
        if HAS_BIAS:
            y = y + tl.load(b2_ptr + slot * stride_bs + offs_n, mask=mask_n, other=0.0)
        acc_out += (y * route_w).to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + offs_n, acc_out.to(dtype), mask=mask_n)


# fused_moe's keys, plus the format (one kernel per format and group size).
_KEY = ["M_BUCKET", "BLOCK_M", "N", "K", "KIND", "GROUP_K"]
_GEMV_KEY = ["M_BUCKET", "N", "K", "KIND", "GROUP_K"]
_GEMM1 = {decode: triton.autotune(configs=cfgs, key=_KEY, **_CACHE)(_qmoe_gemm1_kernel)
          for decode, cfgs in ((True, _DECODE_CONFIGS), (False, _PREFILL_CONFIGS))}
_GEMM2 = {decode: triton.autotune(configs=cfgs, key=_KEY, **_CACHE)(_qmoe_gemm2_kernel)
          for decode, cfgs in ((True, _DECODE_CONFIGS), (False, _PREFILL_CONFIGS))}
_GEMV1 = triton.autotune(configs=_GEMV_CONFIGS, key=_GEMV_KEY, **_CACHE)(_qmoe_gemv1_kernel)
_GEMV2 = triton.autotune(configs=_GEMV_CONFIGS, key=_GEMV_KEY, **_CACHE)(_qmoe_gemv2_kernel)


def _strides(kw: KernelWeight) -> tuple:
    return kw.stride_qs, kw.stride_qn, kw.stride_ss, kw.stride_sn, kw.stride_gs


def fused_moe_quant_triton(x, fmt: QuantFormat, w13: dict, w2: dict, topk_weights, topk_ids,
                           slot_map=None, *, b13=None, b2=None,
                           activation: MoeActivation = SILU, path="auto"):
    """path: "auto" runs fused_moe._moe_path(T)'s form; "gemv" or "grouped" forces one."""
    _check_moe(x, fmt, w13, w2, topk_weights, topk_ids, slot_map, b13, b2, activation)
    if path not in _PATHS:
        raise ValueError(f"fused_moe_quant: path must be one of {_PATHS}, got {path!r}")
    if x.stride(1) != 1 or any(b is not None and b.stride(1) != 1 for b in (b13, b2)):
        raise ValueError("fused_moe_quant: x, b13 and b2 need a contiguous last dimension")
    k13 = KernelWeight.of(fmt, w13, "fused_moe_quant w13")
    k2 = KernelWeight.of(fmt, w2, "fused_moe_quant w2")
    out = torch.empty_like(x)
    if x.shape[0] == 0:
        return out
    if path == "auto":
        path = _moe_path(x.shape[0])
    run = _gemv if path == "gemv" else _grouped
    run(x, k13, k2, topk_weights, topk_ids, slot_map, out, _Epilogue.of(x, b13, b2, activation))
    return out


def _gemv(x, k13, k2, topk_weights, topk_ids, slot_map, out, epi):
    t, d = x.shape
    inter = k13.q.shape[1] // 2
    top_k = topk_ids.shape[1]
    num_pairs = t * top_k
    bucket = _token_bucket(t)
    ids = topk_ids.reshape(-1)
    slots = ids if slot_map is None else slot_map
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _launch(_qmoe_gemv1_kernel, _GEMV1, lambda block_n: (num_pairs, triton.cdiv(inter, block_n)),
            (x, *k13.pointers(), epi.b13, act, ids, slots, bucket, inter, d, x.stride(0),
             *_strides(k13), epi.stride_b13, act.stride(0), *epi.act_args()),
            **k13.constexprs, TOP_K=top_k, HAS_SLOT_MAP=slot_map is not None,
            HAS_BIAS=epi.has_b13, ACTIVATION=epi.activation.kind)
    _launch(_qmoe_gemv2_kernel, _GEMV2, lambda block_n: (t, triton.cdiv(d, block_n)),
            (act, *k2.pointers(), epi.b2, out, ids, slots, topk_weights.reshape(-1), bucket, d,
             inter, act.stride(0), *_strides(k2), epi.stride_b2, out.stride(0)),
            **k2.constexprs, TOP_K=top_k, HAS_SLOT_MAP=slot_map is not None,
            HAS_BIAS=epi.has_b2)


def _grouped(x, k13, k2, topk_weights, topk_ids, slot_map, out, epi):
    t, d = x.shape
    inter = k13.q.shape[1] // 2
    top_k = topk_ids.shape[1]
    num_experts = k13.q.shape[0] if slot_map is None else slot_map.shape[0]
    bucket = _token_bucket(t)
    block_m = _grouped_block_m(bucket, top_k, num_experts)
    decode = bucket <= _DECODE_MAX_TOKENS
    sorted_ids, block_slot, num_padded = moe_align(topk_ids, num_experts, block_m, slot_map)
    max_blocks = block_slot.shape[0]
    num_pairs = t * top_k
    precision = "ieee" if x.dtype == torch.float32 else None
    act = torch.empty(max_blocks * block_m, inter, dtype=x.dtype, device=x.device)
    _launch(_qmoe_gemm1_kernel, _GEMM1[decode],
            lambda block_n: (max_blocks * triton.cdiv(inter, block_n),),
            (x, *k13.pointers(), epi.b13, act, sorted_ids, block_slot, num_padded, num_pairs,
             bucket, inter, d, x.stride(0), *_strides(k13), epi.stride_b13, act.stride(0),
             *epi.act_args()),
            **k13.constexprs, TOP_K=top_k, HAS_BIAS=epi.has_b13,
            ACTIVATION=epi.activation.kind, BLOCK_M=block_m, GROUP_M=_GROUP_M,
            DOT_PRECISION=precision)
    # One row per pair, summed per token after (deterministic, no atomics), as fused_moe does.
    pairs = out if top_k == 1 else torch.empty(num_pairs, d, dtype=x.dtype, device=x.device)
    _launch(_qmoe_gemm2_kernel, _GEMM2[decode],
            lambda block_n: (max_blocks * triton.cdiv(d, block_n),),
            (act, *k2.pointers(), epi.b2, pairs, sorted_ids, block_slot, num_padded,
             topk_weights.contiguous(), num_pairs, bucket, d, inter, act.stride(0),
             *_strides(k2), epi.stride_b2, pairs.stride(0)),
            **k2.constexprs, HAS_BIAS=epi.has_b2, BLOCK_M=block_m, GROUP_M=_GROUP_M,
            DOT_PRECISION=precision)
    if top_k > 1:
        block_d = min(triton.next_power_of_2(d), 1024)
        _moe_sum_kernel[(t, triton.cdiv(d, block_d))](
            pairs, out, d, pairs.stride(0), out.stride(0), TOP_K=top_k, BLOCK_D=block_d,
            num_warps=4)
