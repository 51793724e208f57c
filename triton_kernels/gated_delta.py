"""Gated DeltaNet (Qwen3-Next's linear attention) over a flat varlen batch, its state in a pool.

q, k: [T, Hk, Dk]; v: [T, Hv, Dv] for N sequences' new tokens laid end to end (cu_seqlens
[N+1] int32 offsets into T); value head h reads key head h // (Hv // Hk). g: [T, Hv] float32,
the log of each token's decay (<= 0); beta: [T, Hv], already sigmoid'ed. state_pool
[S, Hv, Dk, Dv] float32 holds one recurrent state per slot: row state_slots[i] is sequence i's,
read as its start when has_initial_state[i] (zeros otherwise) and overwritten with its state
after its last token. Per token and value head, in float32 (S is [Dk, Dv]):

    q, k = l2norm(q), l2norm(k)          (use_qk_l2norm; x * rsqrt(sum x^2 + 1e-6))
    q = q * scale
    S = S * exp(g);  S = S + k^T (beta * (v - k S));  o = q S

which is transformers' torch_recurrent_gated_delta_rule (and its chunked twin) with the scale
passed in. Returns o [T, Hv, Dv] in v's dtype.

Two Triton forms: a fused recurrent kernel (one program per sequence, value head and Dv tile,
state in registers, token by token) for decode batches, and a chunked kernel for prefill that
takes each sequence 64 tokens at a time: within a chunk the delta rule's updates solve one
unit lower-triangular system (the WY/UT form of DeltaNet), so most of the work is tl.dot.
"""

import torch

from triton_kernels._dispatch import interpreting, tl, triton, use_triton

CHUNK = 64          # tokens per step of the chunked kernel (Qwen3-Next's chunk size)
_SUB = 16           # diagonal block of the chunk's triangular solve (tl.dot's smallest tile)
_L2_EPS = 1e-6      # transformers' l2norm eps (x * rsqrt(sum x^2 + eps))


# ---- reference ------------------------------------------------------------------------------

def _l2norm(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + _L2_EPS)


def _recurrent_steps(q, k, v, g, beta, state, scale: float, use_qk_l2norm: bool):
    """The delta rule token by token for B sequences of equal length L, in float32.
    q, k [B, L, Hv, Dk] (already one per value head), v [B, L, Hv, Dv], g, beta [B, L, Hv],
    state [B, Hv, Dk, Dv] (a copy, updated) -> (o [B, L, Hv, Dv] float32, state)."""
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * scale
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        k_t = k[:, t]                                                     # [B, Hv, Dk]
        pred = (state * k_t[..., None]).sum(-2)                           # k S [B, Hv, Dv]
        delta = beta[:, t, :, None] * (v[:, t] - pred)                    # [B, Hv, Dv]
        state = state + k_t[..., :, None] * delta[..., None, :]
        out[:, t] = (state * q[:, t, ..., None]).sum(-2)
    return out, state


def gated_delta_rule_reference(q, k, v, g, beta, state_pool, state_slots, cu_seqlens,
                               has_initial_state, scale: float, use_qk_l2norm: bool = True):
    _check_args(q, k, v, g, beta, state_pool, state_slots, cu_seqlens, has_initial_state)
    hv, hk = v.shape[1], k.shape[1]
    q = q.repeat_interleave(hv // hk, dim=1)                             # [T, Hv, Dk]
    k = k.repeat_interleave(hv // hk, dim=1)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    cu = cu_seqlens.tolist()
    slots = state_slots.tolist()
    has = has_initial_state.tolist()

    def start_state(i):
        if has[i]:
            return state_pool[slots[i]].clone()
        return torch.zeros(state_pool.shape[1:], dtype=torch.float32, device=state_pool.device)

    # Decodes (one token each) step together: the CPU serves with this reference.
    groups = [[i for i in range(len(slots)) if cu[i + 1] - cu[i] == 1]]
    groups += [[i] for i in range(len(slots)) if cu[i + 1] - cu[i] != 1]
    for seqs in groups:
        if not seqs:
            continue
        rows = torch.cat([torch.arange(cu[i], cu[i + 1], device=v.device) for i in seqs])
        n = len(seqs)
        state = torch.stack([start_state(i) for i in seqs])
        o, state = _recurrent_steps(*(x[rows].unflatten(0, (n, -1)) for x in (q, k, v, g, beta)),
                                    state, scale, use_qk_l2norm)
        out[rows] = o.flatten(0, 1).to(v.dtype)
        state_pool[[slots[i] for i in seqs]] = state
    return out


# ---- Triton: fused recurrent (decode) -------------------------------------------------------

@triton.jit
def _gated_delta_recurrent_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, slots_ptr, cu_ptr, has_init_ptr,
        scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt,
        stride_bt, stride_ot, stride_oh, stride_ss, stride_sh, stride_sk,
        G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
        BV: tl.constexpr, L2NORM: tl.constexpr):
    # Grid (N, Hv, cdiv(Dv, BV)): sequence i, value head h, columns v0..v0+BV of its state
    # [Dk, Dv], held in registers [BK, BV] across the sequence's tokens.
    i = tl.program_id(0)
    h = tl.program_id(1)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < DK
    mask_v = offs_v < DV
    mask_s = mask_k[:, None] & mask_v[None, :]
    start = tl.load(cu_ptr + i)
    end = tl.load(cu_ptr + i + 1)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    s_ptrs = (state_ptr + slot * stride_ss + h * stride_sh + offs_k[:, None] * stride_sk
              + offs_v[None, :])
    # zeros, not the row, without an initial state (a scalar mask is spelled as a bound: the
    # interpreter rejects scalar & tensor masks)
    init_k = offs_k < tl.load(has_init_ptr + i).to(tl.int32) * DK
    state = tl.load(s_ptrs, mask=init_k[:, None] & mask_v[None, :], other=0.0)
    kh = h // G
    start64 = start.to(tl.int64)
    for t in range(0, end - start):
        t64 = start64 + t
        q = tl.load(q_ptr + t64 * stride_qt + kh * stride_qh + offs_k, mask=mask_k,
                    other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t64 * stride_kt + kh * stride_kh + offs_k, mask=mask_k,
                    other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t64 * stride_vt + h * stride_vh + offs_v, mask=mask_v,
                    other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t64 * stride_gt + h).to(tl.float32)
        beta = tl.load(beta_ptr + t64 * stride_bt + h).to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        q = q * scale
        state = state * tl.exp(g)
        pred = tl.sum(state * k[:, None], axis=0)                                   # [BV]
        state += k[:, None] * (beta * (v - pred))[None, :]
        o = tl.sum(state * q[:, None], axis=0)
        tl.store(o_ptr + t64 * stride_ot + h * stride_oh + offs_v,
                 o.to(o_ptr.dtype.element_ty), mask=mask_v)
    tl.store(s_ptrs, state, mask=mask_s)


# ---- Triton: chunked (prefill) --------------------------------------------------------------

@triton.jit
def _solve_unit_lower(lmat, r, offs_c, C: tl.constexpr, SUB: tl.constexpr, BV: tl.constexpr,
                      PRECISION: tl.constexpr):
    """u [C, BV] with (I + lmat) u = r, lmat [C, C] strictly lower triangular.

    The SUB x SUB diagonal blocks are inverted together, one row of every block per step
    (X = I - D X, D the block-diagonal part: row j of a block needs only its rows < j), so
    SUB - 1 dots instead of C - 1 row steps; then forward substitution block by block,
    u_b = X_bb (r_b - sum_{b' < b} L_bb' u_b'), two dots a block.
    """
    blk = offs_c // SUB
    same = blk[:, None] == blk[None, :]
    diag = tl.where(same, lmat, 0.0)
    off = tl.where(same, 0.0, lmat)
    eye = tl.where(offs_c[:, None] == offs_c[None, :], 1.0, 0.0)
    inv = eye
    for j in range(1, SUB):          # a loop, not unrolled: compile time
        step = eye - tl.dot(diag, inv, input_precision=PRECISION)
        inv = tl.where(((offs_c % SUB) == j)[:, None], step, inv)
    u = tl.zeros((C, BV), dtype=tl.float32)
    for b in range(C // SUB):
        in_b = (blk == b)[:, None]
        rest = tl.where(in_b, r - tl.dot(off, u, input_precision=PRECISION), 0.0)
        u = tl.where(in_b, tl.dot(inv, rest, input_precision=PRECISION), u)
    return u


@triton.jit
def _gated_delta_chunk_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, slots_ptr, cu_ptr, has_init_ptr,
        scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt,
        stride_bt, stride_ot, stride_oh, stride_ss, stride_sh, stride_sk,
        G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
        BV: tl.constexpr, C: tl.constexpr, SUB: tl.constexpr, L2NORM: tl.constexpr,
        DOT_PRECISION: tl.constexpr, INV_PRECISION: tl.constexpr):
    # Grid (N, Hv, cdiv(Dv, BV)), the state tile S [BK, BV] in registers as in the recurrent
    # kernel, taken C tokens a step. With gc the decay's running sum inside the chunk and
    # S0 the state before it, token i's update u_i = beta_i (v_i - k_i S'_i) satisfies
    #   u_i + beta_i sum_{j<i} e^(gc_i - gc_j) (k_i.k_j) u_j = beta_i (v_i - e^(gc_i) k_i S0),
    # a unit lower-triangular system (I + L) u = r, solved by forward substitution; then
    #   o_i = e^(gc_i) q_i S0 + sum_{j<=i} e^(gc_i - gc_j) (q_i.k_j) u_j
    #   S   = e^(gc_last) S0 + sum_j e^(gc_last - gc_j) k_j^T u_j.
    # Tokens past the sequence's end load as zeros (k = v = beta = g = 0): they add nothing.
    i = tl.program_id(0)
    h = tl.program_id(1)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    offs_k = tl.arange(0, BK)
    offs_c = tl.arange(0, C)
    mask_k = offs_k < DK
    mask_v = offs_v < DV
    mask_s = mask_k[:, None] & mask_v[None, :]
    start = tl.load(cu_ptr + i)
    end = tl.load(cu_ptr + i + 1)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    s_ptrs = (state_ptr + slot * stride_ss + h * stride_sh + offs_k[:, None] * stride_sk
              + offs_v[None, :])
    # zeros, not the row, without an initial state (a scalar mask is spelled as a bound: the
    # interpreter rejects scalar & tensor masks)
    init_k = offs_k < tl.load(has_init_ptr + i).to(tl.int32) * DK
    state = tl.load(s_ptrs, mask=init_k[:, None] & mask_v[None, :], other=0.0)
    kh = h // G
    lower = offs_c[:, None] > offs_c[None, :]                 # strictly lower: j < i
    causal = offs_c[:, None] >= offs_c[None, :]
    for c0 in range(start, end, C):
        rows = c0 + offs_c
        mask_t = rows < end
        rows64 = rows.to(tl.int64)
        mask_tk = mask_t[:, None] & mask_k[None, :]
        q_rows = q_ptr + rows64[:, None] * stride_qt + kh * stride_qh + offs_k[None, :]
        k_rows = k_ptr + rows64[:, None] * stride_kt + kh * stride_kh + offs_k[None, :]
        q = tl.load(q_rows, mask=mask_tk, other=0.0).to(tl.float32)                  # [C, BK]
        k = tl.load(k_rows, mask=mask_tk, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + rows64[:, None] * stride_vt + h * stride_vh + offs_v[None, :],
                    mask=mask_t[:, None] & mask_v[None, :], other=0.0).to(tl.float32)  # [C, BV]
        g = tl.load(g_ptr + rows64 * stride_gt + h, mask=mask_t, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + rows64 * stride_bt + h, mask=mask_t, other=0.0).to(tl.float32)
        # per-row factors: q's l2norm and the scale, k's l2norm (the tiles are loaded again
        # after the solve and scaled by these, rather than kept live across it: registers)
        q_f = tl.full((C,), 1.0, tl.float32) * scale
        k_f = tl.full((C,), 1.0, tl.float32)
        if L2NORM:
            q_f = q_f * tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6)
            k_f = tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)
        gc = tl.cumsum(g, axis=0)                                                       # [C]
        gc_last = tl.sum(g, axis=0)
        k = k * k_f[:, None]
        o = (tl.exp(gc) * q_f)[:, None] * tl.dot(q, state, input_precision=DOT_PRECISION)
        # e^(gc_i - gc_j) where j < i, 0 elsewhere (masked before exp: no inf)
        decay = tl.exp(tl.where(lower, gc[:, None] - gc[None, :], float("-inf")))
        kk = tl.dot(k, tl.trans(k), input_precision=DOT_PRECISION)                       # [C, C]
        lmat = kk * decay * beta[:, None]
        ks0 = tl.dot(k, state, input_precision=DOT_PRECISION)                            # [C, BV]
        r = beta[:, None] * (v - tl.exp(gc)[:, None] * ks0)
        u = _solve_unit_lower(lmat, r, offs_c, C, SUB, BV, INV_PRECISION)
        q = tl.load(q_rows, mask=mask_tk, other=0.0).to(tl.float32) * q_f[:, None]
        k = tl.load(k_rows, mask=mask_tk, other=0.0).to(tl.float32) * k_f[:, None]
        decay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * decay
        o += tl.dot(qk, u, input_precision=DOT_PRECISION)
        tl.store(o_ptr + rows64[:, None] * stride_ot + h * stride_oh + offs_v[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_v[None, :])
        k = k * tl.exp(gc_last - gc)[:, None]
        state = state * tl.exp(gc_last) + tl.dot(tl.trans(k), u, input_precision=DOT_PRECISION)
    tl.store(s_ptrs, state, mask=mask_s)


# ---- launcher -------------------------------------------------------------------------------

def _gated_delta_config(dk_pad: int, dv: int, chunked: bool) -> dict:
    """Tiles: BV state columns per program. No autotuning (the kernels are bound by their
    serial token/chunk loop, not a GEMM's tiling): one config per (head dims, form)."""
    if interpreting():
        return dict(BV=16, num_warps=4, num_stages=1)
    if chunked:
        # 8 warps: the chunk's fp32 tiles ([C, Dk] keys, [C, C] systems) want the registers
        return dict(BV=min(32, max(16, triton.next_power_of_2(dv))), num_warps=8, num_stages=1)
    return dict(BV=min(32, max(16, triton.next_power_of_2(dv))), num_warps=4 if dk_pad <= 128
                else 8, num_stages=1)


def gated_delta_rule_triton(q, k, v, g, beta, state_pool, state_slots, cu_seqlens,
                            has_initial_state, scale: float, use_qk_l2norm: bool = True,
                            *, chunked: bool | None = None):
    """The recurrent kernel when every sequence brings one token (T == N: a decode batch, no
    device sync to find out), the chunked kernel otherwise; `chunked` forces one (tests).

    Nothing is autotuned, and no request-dependent integer reaches a kernel (lengths come
    from cu_seqlens on the device), so the compiled variants are keyed by: the form
    (recurrent / chunked), use_qk_l2norm, the q/k/v dtype, and the layer's heads and dims
    (with its strides). A warmup that runs one decode batch and one prefill batch per
    linear-attention layer shape covers every request."""
    _check_args(q, k, v, g, beta, state_pool, state_slots, cu_seqlens, has_initial_state)
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    n = state_slots.shape[0]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if n == 0:
        return out
    if chunked is None:
        chunked = t != n
    bk = max(16, triton.next_power_of_2(dk))
    cfg = _gated_delta_config(bk, dv, chunked)
    grid = (n, hv, triton.cdiv(dv, cfg["BV"]))
    args = (q, k, v, g, beta, out, state_pool, state_slots, cu_seqlens, has_initial_state,
            float(scale), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), g.stride(0), beta.stride(0), out.stride(0), out.stride(1),
            state_pool.stride(0), state_pool.stride(1), state_pool.stride(2))
    dims = dict(G=hv // hk, DK=dk, DV=dv, BK=bk, L2NORM=bool(use_qk_l2norm))
    if chunked:
        # fp32 (tests) gets exact products; fp16/bf16 inputs are upcast too, and the dots take
        # tf32 there: the state recurrence is float32 throughout.
        # The triangular solve's dots take tf32x3 (about float32) so the chunked and recurrent
        # forms agree to float32 rounding at serving dtypes too.
        exact = q.dtype == torch.float32
        _gated_delta_chunk_kernel[grid](*args, **dims, C=CHUNK, SUB=_SUB,
                                        DOT_PRECISION="ieee" if exact else "tf32",
                                        INV_PRECISION="ieee" if exact else "tf32x3", **cfg)
    else:
        _gated_delta_recurrent_kernel[grid](*args, **dims, **cfg)
    return out


def _check_args(q, k, v, g, beta, state_pool, state_slots, cu_seqlens, has_initial_state):
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"gated_delta_rule: q, k must be [T, Hk, Dk] and v [T, Hv, Dv], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if hv % hk:
        raise ValueError(f"gated_delta_rule: {hv} value heads are not a multiple of {hk} key "
                         f"heads")
    if dk > 256 or dv > 256:
        raise ValueError(f"gated_delta_rule: head dims {dk}/{dv} > 256 are not supported")
    if g.shape != (t, hv) or beta.shape != (t, hv):
        raise ValueError(f"gated_delta_rule: g and beta must be [{t}, {hv}], got "
                         f"{tuple(g.shape)}, {tuple(beta.shape)}")
    if g.dtype != torch.float32:
        raise ValueError(f"gated_delta_rule: g must be float32 (a log decay), got {g.dtype}")
    if state_pool.dim() != 4 or state_pool.shape[1:] != (hv, dk, dv) \
            or state_pool.dtype != torch.float32:
        raise ValueError(f"gated_delta_rule: state_pool must be float32 [S, {hv}, {dk}, {dv}], "
                         f"got {state_pool.dtype} {tuple(state_pool.shape)}")
    n = state_slots.shape[0]
    if (state_slots.dim() != 1 or cu_seqlens.shape != (n + 1,)
            or has_initial_state.shape != (n,)):
        raise ValueError(f"gated_delta_rule: state_slots [N], cu_seqlens [N+1] and "
                         f"has_initial_state [N] expected, got {tuple(state_slots.shape)}, "
                         f"{tuple(cu_seqlens.shape)}, {tuple(has_initial_state.shape)}")
    for name, x in (("state_slots", state_slots), ("cu_seqlens", cu_seqlens)):
        if x.dtype not in (torch.int32, torch.int64) or not x.is_contiguous():
            raise ValueError(f"gated_delta_rule: {name} must be contiguous int32/int64, got "
                             f"{x.dtype}")
    others = (k, v, g, beta, state_pool, state_slots, cu_seqlens, has_initial_state)
    if any(x.device != q.device for x in others):
        raise ValueError(f"gated_delta_rule: every tensor must be on {q.device}, got "
                         f"{[str(x.device) for x in others]}")
    if has_initial_state.dtype != torch.bool or not has_initial_state.is_contiguous():
        raise ValueError(f"gated_delta_rule: has_initial_state must be a contiguous bool tensor, "
                         f"got {has_initial_state.dtype}")
    if (q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1 or g.stride(1) != 1
            or beta.stride(1) != 1 or state_pool.stride(3) != 1):
        raise ValueError("gated_delta_rule: q, k, v, g, beta and state_pool need a contiguous "
                         "last dimension")


def gated_delta_rule(q, k, v, g, beta, state_pool, state_slots, cu_seqlens, has_initial_state,
                     scale: float, use_qk_l2norm: bool = True):
    op = gated_delta_rule_triton if use_triton(q) else gated_delta_rule_reference
    return op(q, k, v, g, beta, state_pool, state_slots, cu_seqlens, has_initial_state, scale,
              use_qk_l2norm)
