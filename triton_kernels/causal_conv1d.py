"""Depthwise causal conv1d over a flat varlen batch, each sequence's last inputs in a state pool.

x: [T, C] for N sequences' new tokens laid end to end (cu_seqlens [N+1] int32 offsets into T);
weight: [C, W] (one W-tap filter per channel; Qwen3-Next's W is 4); bias: [C] or None.
conv_state_pool: [S, C, W-1] in x's dtype: row state_slots[i] holds the W-1 inputs before
sequence i's first new token, oldest first (zeros instead when has_initial_state[i] is False),
and is overwritten with its last W-1 inputs (a sequence shorter than W-1 keeps the newest of
the old ones, shifted). Returns y [T, C] in x's dtype:

    y_t = act(bias + sum_j weight[:, j] * x_{t-(W-1)+j})

inputs before the sequence's first new token coming from the state: torch's conv1d with W-1
left padding when the state is zeros (transformers' causal_conv1d_fn), its
causal_conv1d_update when it is not. act is silu or None.
"""

import torch
import torch.nn.functional as F

from triton_kernels._dispatch import interpreting, tl, triton, use_triton

_ACTIVATIONS = (None, "silu")


# ---- reference ------------------------------------------------------------------------------

def causal_conv1d_reference(x, weight, bias, conv_state_pool, state_slots, cu_seqlens,
                            has_initial_state, activation: str | None = "silu"):
    _check_args(x, weight, bias, conv_state_pool, state_slots, cu_seqlens, has_initial_state,
                activation)
    c, w = weight.shape
    cu = cu_seqlens.tolist()
    slots = state_slots.tolist()
    has = has_initial_state.tolist()
    y = torch.empty_like(x)
    wf = weight.float()[:, None, :]                                   # [C, 1, W] for conv1d
    bf = None if bias is None else bias.float()
    for i, slot in enumerate(slots):
        lo, hi = cu[i], cu[i + 1]
        prev = (conv_state_pool[slot].float() if has[i]
                else torch.zeros(c, w - 1, dtype=torch.float32, device=x.device))
        xs = torch.cat([prev, x[lo:hi].float().t()], dim=1)           # [C, W-1 + L]
        if hi > lo:
            out = F.conv1d(xs[None], wf, bf, groups=c)[0]              # [C, L]
            if activation == "silu":
                out = F.silu(out)
            y[lo:hi] = out.t().to(x.dtype)
        conv_state_pool[slot] = xs[:, xs.shape[1] - (w - 1):].to(conv_state_pool.dtype)
    return y


# ---- Triton ---------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["T"])
def _causal_conv1d_kernel(x_ptr, w_ptr, bias_ptr, state_ptr, y_ptr, seq_idx_ptr, cu_ptr,
                          slots_ptr, has_init_ptr, T, C, stride_xt, stride_yt, stride_wc,
                          stride_ss, stride_sc, W: tl.constexpr, HAS_BIAS: tl.constexpr,
                          SILU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    # Grid (cdiv(T, BLOCK_T), cdiv(C, BLOCK_C)): a tile of flat tokens by channels. Each tap
    # j reads input t-(W-1)+j: from x when it is in the token's own sequence, else from that
    # sequence's state (entry W-1 + (s - start), oldest first), else 0 without one.
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_t = offs_t < T
    mask_c = offs_c < C
    seq = tl.load(seq_idx_ptr + offs_t, mask=mask_t, other=0)
    start = tl.load(cu_ptr + seq, mask=mask_t, other=0)
    slot = tl.load(slots_ptr + seq, mask=mask_t, other=0).to(tl.int64)
    has_init = tl.load(has_init_ptr + seq, mask=mask_t, other=0) != 0
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(W):
        src = offs_t - (W - 1) + j                                          # [BLOCK_T]
        in_seq = src >= start
        from_x = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_xt + offs_c[None, :],
                         mask=(mask_t & in_seq)[:, None] & mask_c[None, :], other=0.0)
        entry = (W - 1) + src - start                                       # < W-1 off x
        from_state = tl.load(state_ptr + slot[:, None] * stride_ss
                             + offs_c[None, :] * stride_sc + entry[:, None],
                             mask=(mask_t & ~in_seq & has_init)[:, None] & mask_c[None, :],
                             other=0.0)
        tap = tl.load(w_ptr + offs_c * stride_wc + j, mask=mask_c, other=0.0).to(tl.float32)
        acc += (from_x.to(tl.float32) + from_state.to(tl.float32)) * tap[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptr + offs_t.to(tl.int64)[:, None] * stride_yt + offs_c[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_c[None, :])


@triton.jit
def _conv_state_update_kernel(x_ptr, state_ptr, cu_ptr, slots_ptr, has_init_ptr, C, stride_xt,
                              stride_ss, stride_sc, W: tl.constexpr, E_PAD: tl.constexpr,
                              BLOCK_C: tl.constexpr):
    # Grid (N, cdiv(C, BLOCK_C)), after the conv kernel has read the old states: entry e of
    # the new state is input L-(W-1)+e of the sequence (L its new tokens), from x when that
    # is >= 0, else the old state's entry L+e. All entries load before any is stored.
    i = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    start = tl.load(cu_ptr + i)
    n_new = tl.load(cu_ptr + i + 1) - start
    slot = tl.load(slots_ptr + i).to(tl.int64)
    row = state_ptr + slot * stride_ss + offs_c * stride_sc
    offs_e = tl.arange(0, E_PAD)                              # entries 0..W-2, padded
    rel = n_new - (W - 1) + offs_e                            # [E_PAD]
    mask_e = offs_e < W - 1
    # scalar & tensor masks fail in the interpreter: has_init becomes a bound on the entries
    init_e = offs_e < tl.load(has_init_ptr + i).to(tl.int32) * E_PAD
    m_x = mask_c[:, None] & (mask_e & (rel >= 0))[None, :]
    from_x = tl.load(x_ptr + (start + rel).to(tl.int64)[None, :] * stride_xt
                     + offs_c[:, None], mask=m_x, other=0.0)
    m_s = mask_c[:, None] & (mask_e & (rel < 0) & init_e)[None, :]
    from_state = tl.load(row[:, None] + (n_new + offs_e)[None, :], mask=m_s, other=0.0)
    new = tl.where(m_x, from_x.to(state_ptr.dtype.element_ty),
                   from_state.to(state_ptr.dtype.element_ty))
    tl.debug_barrier()
    tl.store(row[:, None] + offs_e[None, :], new, mask=mask_c[:, None] & mask_e[None, :])


def _conv_config() -> dict:
    if interpreting():
        return dict(BLOCK_T=16, BLOCK_C=32, num_warps=4)
    return dict(BLOCK_T=16, BLOCK_C=256, num_warps=4)


def causal_conv1d_triton(x, weight, bias, conv_state_pool, state_slots, cu_seqlens,
                         has_initial_state, activation: str | None = "silu"):
    """Two launches: the conv over (token tile, channel tile), then the state update per
    (sequence, channel tile) once every old state has been read.

    Nothing is autotuned. Compiled variants are keyed by the constexprs only: W, HAS_BIAS,
    SILU (and x's dtype); T is not specialized, so a warmup of one batch per (activation,
    bias) pair covers every request."""
    _check_args(x, weight, bias, conv_state_pool, state_slots, cu_seqlens, has_initial_state,
                activation)
    t, c = x.shape
    w = weight.shape[1]
    n = state_slots.shape[0]
    y = torch.empty_like(x)
    if n == 0:
        return y
    # token -> its sequence, on the device (no sync): the number of offsets cu[1..N] <= t
    tokens = torch.arange(t, device=x.device, dtype=cu_seqlens.dtype)
    seq_idx = torch.searchsorted(cu_seqlens[1:].contiguous(), tokens, right=True)
    cfg = _conv_config()
    bias_arg = bias if bias is not None else weight            # never read without HAS_BIAS
    if t:
        grid = (triton.cdiv(t, cfg["BLOCK_T"]), triton.cdiv(c, cfg["BLOCK_C"]))
        _causal_conv1d_kernel[grid](
            x, weight, bias_arg, conv_state_pool, y, seq_idx, cu_seqlens, state_slots,
            has_initial_state, t, c, x.stride(0), y.stride(0), weight.stride(0),
            conv_state_pool.stride(0), conv_state_pool.stride(1), W=w,
            HAS_BIAS=bias is not None, SILU=activation == "silu", **cfg)
    _conv_state_update_kernel[(n, triton.cdiv(c, cfg["BLOCK_C"]))](
        x, conv_state_pool, cu_seqlens, state_slots, has_initial_state, c, x.stride(0),
        conv_state_pool.stride(0), conv_state_pool.stride(1), W=w,
        E_PAD=triton.next_power_of_2(w - 1), BLOCK_C=cfg["BLOCK_C"],
        num_warps=cfg["num_warps"])
    return y


def _check_args(x, weight, bias, conv_state_pool, state_slots, cu_seqlens, has_initial_state,
                activation):
    if activation not in _ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation must be one of {_ACTIVATIONS}, got "
                         f"{activation!r}")
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"causal_conv1d: x must be [T, C] and weight [C, W], got "
                         f"{tuple(x.shape)}, {tuple(weight.shape)}")
    c, w = weight.shape
    if not 2 <= w <= 16:
        raise ValueError(f"causal_conv1d: kernel size {w} outside 2..16")
    if bias is not None and bias.shape != (c,):
        raise ValueError(f"causal_conv1d: bias must be [{c}], got {tuple(bias.shape)}")
    if conv_state_pool.dim() != 3 or conv_state_pool.shape[1:] != (c, w - 1) \
            or conv_state_pool.dtype != x.dtype:
        raise ValueError(f"causal_conv1d: conv_state_pool must be {x.dtype} [S, {c}, {w - 1}], "
                         f"got {conv_state_pool.dtype} {tuple(conv_state_pool.shape)}")
    n = state_slots.shape[0]
    if (state_slots.dim() != 1 or cu_seqlens.shape != (n + 1,)
            or has_initial_state.shape != (n,)):
        raise ValueError(f"causal_conv1d: state_slots [N], cu_seqlens [N+1] and "
                         f"has_initial_state [N] expected, got {tuple(state_slots.shape)}, "
                         f"{tuple(cu_seqlens.shape)}, {tuple(has_initial_state.shape)}")
    for name, tensor in (("state_slots", state_slots), ("cu_seqlens", cu_seqlens)):
        if tensor.dtype not in (torch.int32, torch.int64) or not tensor.is_contiguous():
            raise ValueError(f"causal_conv1d: {name} must be contiguous int32/int64, got "
                             f"{tensor.dtype}")
    others = [weight, conv_state_pool, state_slots, cu_seqlens, has_initial_state]
    others += [] if bias is None else [bias]
    if any(t.device != x.device for t in others):
        raise ValueError(f"causal_conv1d: every tensor must be on {x.device}, got "
                         f"{[str(t.device) for t in others]}")
    if has_initial_state.dtype != torch.bool or not has_initial_state.is_contiguous():
        raise ValueError(f"causal_conv1d: has_initial_state must be a contiguous bool tensor, "
                         f"got {has_initial_state.dtype}")
    if (x.stride(1) != 1 or weight.stride(1) != 1 or conv_state_pool.stride(2) != 1
            or (bias is not None and not bias.is_contiguous())):
        raise ValueError("causal_conv1d: x, weight and conv_state_pool need a contiguous last "
                         "dimension, bias a contiguous vector")


def causal_conv1d(x, weight, bias, conv_state_pool, state_slots, cu_seqlens, has_initial_state,
                  activation: str | None = "silu"):
    op = causal_conv1d_triton if use_triton(x) else causal_conv1d_reference
    return op(x, weight, bias, conv_state_pool, state_slots, cu_seqlens, has_initial_state,
              activation)
