"""quant_linear's Triton kernels: x [T, K] @ W^T (+ bias [N]) -> [T, N] with W [N, K] quantized
(dequant.py's formats), each weight tile decoded in registers to x's dtype and never stored.

Two forms, picked by token count as fused_moe picks its own (fused_moe._moe_path): a GEMV,
one program per token and N tile, up to 8 tokens (decode: a 16-row tl.dot tile would be
mostly padding); above it a tiled GEMM (tl.dot, float32 accumulators). On every architecture
the weight is decoded to x's dtype before the dot (bf16 on sm_80, which has no fp8 tensor
cores; sm_90 does the same: decode streams the bytes, the dot is not the bound at decode).
"""

import torch

from triton_kernels._dispatch import tl, triton
from triton_kernels.dequant import KernelWeight, QuantFormat, _check_linear, _dequant_tile
from triton_kernels.fused_moe import (_CACHE, _DECODE_CONFIGS, _GEMV_CONFIGS, _PREFILL_CONFIGS,
                                      _launch, _moe_path, _tile_ids, _token_bucket)

_GROUP_M = 8
_PATHS = ("auto", "gemv", "gemm")


@triton.jit(do_not_specialize=["T", "M_BUCKET"])
def _quant_linear_kernel(x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, b_ptr, out_ptr, T, M_BUCKET, N, K,
                         stride_xt, stride_qn, stride_sn, stride_ot, KIND: tl.constexpr,
                         SCALE_ROWS: tl.constexpr, GROUP_K: tl.constexpr,
                         HAS_ZERO: tl.constexpr, SCALE_BF16: tl.constexpr,
                         HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    # out[m, n] = x[m] . W[n] (+ b[n]) for a BLOCK_M x BLOCK_N tile; the weight tile is
    # [BLOCK_K, BLOCK_N] (K down the rows) as tl.dot takes it. M_BUCKET only feeds the key.
    pid_m, pid_n = _tile_ids(N, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < T
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + offs_k
        mask_k = cols < K
        a = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xt + cols[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.trans(_dequant_tile(q_ptr, s_ptr, z_ptr, g_ptr, offs_n, k0, mask_n, K, stride_qn,
                                   stride_sn, KIND, SCALE_ROWS, GROUP_K, HAS_ZERO, SCALE_BF16,
                                   BLOCK_N, BLOCK_K))
        acc = tl.dot(a, w.to(dtype), acc=acc, input_precision=DOT_PRECISION)
    y = acc.to(dtype)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_ot + offs_n[None, :], y,
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["M_BUCKET"])
def _quant_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, b_ptr, out_ptr, M_BUCKET, N, K,
                       stride_xt, stride_qn, stride_sn, stride_ot, KIND: tl.constexpr,
                       SCALE_ROWS: tl.constexpr, GROUP_K: tl.constexpr, HAS_ZERO: tl.constexpr,
                       SCALE_BF16: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    # Grid (T, cdiv(N, BLOCK_N)): out[t, n] = x[t] . W[n] (+ b[n]), [BLOCK_N, BLOCK_K] partial
    # products summed over K once after the loop, the decoded weight rounded to x's dtype first.
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + offs_k
        mask_k = cols < K
        a = tl.load(x_ptr + token * stride_xt + cols, mask=mask_k, other=0.0).to(tl.float32)
        w = _dequant_tile(q_ptr, s_ptr, z_ptr, g_ptr, offs_n, k0, mask_n, K, stride_qn, stride_sn,
                          KIND, SCALE_ROWS, GROUP_K, HAS_ZERO, SCALE_BF16, BLOCK_N, BLOCK_K)
        acc += a[None, :] * w.to(dtype).to(tl.float32)
    y = tl.sum(acc, axis=1).to(dtype)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + offs_n, mask=mask_n, other=0.0)
    tl.store(out_ptr + token * stride_ot + offs_n, y, mask=mask_n)


_KEY = ["M_BUCKET", "BLOCK_M", "N", "K", "KIND", "GROUP_K"]
_GEMV_KEY = ["M_BUCKET", "N", "K", "KIND", "GROUP_K"]
_GEMM = {decode: triton.autotune(configs=cfgs, key=_KEY, **_CACHE)(_quant_linear_kernel)
         for decode, cfgs in ((True, _DECODE_CONFIGS), (False, _PREFILL_CONFIGS))}
_GEMV = triton.autotune(configs=_GEMV_CONFIGS, key=_GEMV_KEY, **_CACHE)(_quant_gemv_kernel)


def _block_m(num_tokens: int) -> int:
    return 16 if num_tokens <= 64 else 64


def quant_linear_triton(x: torch.Tensor, fmt: QuantFormat, w: dict,
                        bias: torch.Tensor | None = None, path: str = "auto") -> torch.Tensor:
    """path: "auto" runs the GEMV up to fused_moe's crossover, else the GEMM; or force one."""
    _check_linear(x, fmt, w, bias)
    if path not in _PATHS:
        raise ValueError(f"quant_linear: path must be one of {_PATHS}, got {path!r}")
    if x.stride(1) != 1 or (bias is not None and bias.stride(0) != 1):
        raise ValueError("quant_linear: x and bias need a contiguous last dimension")
    kw = KernelWeight.of(fmt, w, "quant_linear")
    t, k = x.shape
    n = w["q"].shape[0]
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    if path == "auto":
        path = "gemv" if _moe_path(t) == "gemv" else "gemm"
    bucket = _token_bucket(t)
    args = (x, *kw.pointers(), x if bias is None else bias, out)
    strides = (x.stride(0), kw.stride_qn, kw.stride_sn, out.stride(0))
    if path == "gemv":
        _launch(_quant_gemv_kernel, _GEMV, lambda block_n: (t, triton.cdiv(n, block_n)),
                (*args, bucket, n, k, *strides), **kw.constexprs, HAS_BIAS=bias is not None)
    else:
        block_m = _block_m(t)
        _launch(_quant_linear_kernel, _GEMM[block_m == 16],
                lambda block_n: (triton.cdiv(t, block_m) * triton.cdiv(n, block_n),),
                (*args, t, bucket, n, k, *strides), **kw.constexprs, HAS_BIAS=bias is not None,
                BLOCK_M=block_m, GROUP_M=_GROUP_M,
                DOT_PRECISION="ieee" if x.dtype == torch.float32 else None)
    return out
