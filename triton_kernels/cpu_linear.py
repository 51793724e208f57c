"""A dense 16-bit projection on a CPU engine, by rows: the fastest product this machine has
for each row count, from one weight held once.

- Below NATIVE_ROWS rows (decode): the native GEMV (cpu_linear.c), reading the weight as it
  is. One row of [1024, 1024] bf16 on a 2-core Sapphire Rapids: 0.054 ms against 0.116
  for FBGEMM's fp16 GEMM and 0.134 for torch's bf16 product; [1536, 1024] 0.094 / 0.19 /
  0.24; the [32768, 1024] lm_head, DRAM-bound, 3.3 / 3.6 / 3.8.
- From GEMM_ROWS on a CPU with AMX-BF16 (Sapphire Rapids and later), bf16 weights: torch's
  bf16 product (oneDNN's AMX kernels). At 64 rows it ran 3-4x FBGEMM's fp16 GEMM, at 512
  rows 4-7x ([1024, 1024]: 2350 GFLOP/s against 330).
- Otherwise (no AMX, fp16 weights, no C compiler): FBGEMM's fp16-weight GEMM
  (cpu_matmul.Fp16Weight), as fast as anything torch has on AVX2 at every row count.

A weight that comes quantized (QuantRows: a checkpoint's fp8 projection with block or
tensor scales, or an int4 one) keeps its bytes for the native GEMV's rows, 1 or half a byte
a weight read instead of 2 ([1536, 1024] fp8: 0.079 ms a row against 0.099 in bf16), and a
decoded 16-bit copy for the GEMMs.

All sum in float32; the native and FBGEMM products round once to x's dtype, oneDNN's bf16
product rounds as F.linear does. A packed model is held to tolerance, not to HF's bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from triton_kernels.cpu_matmul import Fp16Weight, packable
from triton_kernels.cpu_native import NativeKernels, has_amx_bf16, native_kernels

NATIVE_ROWS = 8     # below: the native GEMV (at 8 rows oneDNN's AMX product is as fast)
GEMM_ROWS = 8       # from here, with AMX and a bf16 weight: torch's bf16 product


@dataclass(frozen=True)
class QuantRows:
    """A weight's quantized form for the native GEMV (NativeKernels.linear): fp8, q [N, K]
    e4m3 with s [ceil(N/bn), ceil(K/bk)] float32 block scales, block (bn, bk), or s [N] a
    row's own, block (1, 0); int8, q [N, K] with s [N], block (1, 0); or int4,
    q [N, K/2] nibbles with s its cpu_native.int4_scales ([N, K/G] bf16, a symmetric
    weight's own, or [N, K/G, 2] float32 (scale, -zero * scale) pairs), block (1, G). own:
    made for the product (a fused copy: its bytes count in CpuLinear.nbytes), else a
    checkpoint's tensors."""
    q: torch.Tensor
    s: torch.Tensor
    block: tuple[int, int]
    own: bool = False

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.s.nbytes



class CpuLinear:
    """x [.., K] @ weight [N, K]^T + bias -> [.., N] in x's dtype (see the module doc for the
    product each row count takes). weight: bf16 or fp16, on the CPU, held as it is (a
    module's parameter is not copied). kernel: the native library (None: no GEMV);
    amx: whether bf16 products of GEMM_ROWS and more go to oneDNN. own_weight: the weight
    was made for this product (a fused or decoded copy), so its bytes count in nbytes, the
    host RAM the packing added. quant: the same weight quantized (QuantRows), which the
    native GEMV reads instead."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 kernel: NativeKernels | None, amx: bool, own_weight: bool = False,
                 quant: QuantRows | None = None):
        if weight.dim() != 2 or weight.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"CpuLinear: a 16-bit weight [N, K] expected, got "
                             f"{tuple(weight.shape)} {weight.dtype}")
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach()
        self.bias32 = None if bias is None else self.bias.float().contiguous()
        self.kernel = kernel
        self.quant = quant if kernel is not None else None
        self.gemm = amx and weight.dtype == torch.bfloat16
        weight = weight.detach().contiguous()
        self.bias16 = None if bias is None else self.bias.to(weight.dtype)     # oneDNN's
        # FBGEMM's packing only for the rows neither other product takes; the weight itself
        # only where a product reads it.
        self.fbgemm = None if (self.gemm and kernel is not None) else Fp16Weight(weight, bias)
        self.weight = weight if ((kernel is not None and self.quant is None) or self.gemm) else None
        # the native GEMV's calls, their weight checked once (cpu_native.LinearCall)
        self.gemv = (None if kernel is None
                     else kernel.bind_linear(self.quant.q, self.bias32, self.quant.s,
                                             self.quant.block) if self.quant is not None
                     else kernel.bind_linear(weight, self.bias32))
        self.nbytes = ((self.fbgemm.nbytes if self.fbgemm is not None else 0)
                       + (weight.numel() * 2 if own_weight and self.weight is not None else 0)
                       + (self.quant.nbytes if self.quant is not None and self.quant.own else 0))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        n = rows.shape[0]
        if self.gemv is not None and n < NATIVE_ROWS:
            y = self.gemv(rows)
        elif self.gemm and (self.fbgemm is None or n >= GEMM_ROWS):
            y = F.linear(rows.to(self.weight.dtype), self.weight, self.bias16).to(x.dtype)
        else:
            y = self.fbgemm(rows)
        return y.reshape(*x.shape[:-1], self.out_features)


def cpu_linear(weight: torch.Tensor, bias: torch.Tensor | None = None,
               own_weight: bool = False, dtype: torch.dtype | None = None,
               quant: QuantRows | None = None) -> CpuLinear | None:
    """The CPU engine's product for a weight [N, K] on this machine's kernels, None where none
    takes it (outside float16's range where FBGEMM is needed, a torch without FBGEMM).
    - bf16 or fp16: held as it is (own_weight: see CpuLinear).
    - float32, a weight decoded from a quantized format (fp8, the 4-bit float formats) for a
      model computing in `dtype`: one 2-byte copy, bf16 for the native GEMV and AMX's GEMM
      in a bf16 model where both run (bf16's rounding, the tile decode's), else float16
      packed for FBGEMM alone (11 bits from 2^-14 up); quant: its quantized bytes for the
      native GEMV's rows (the copy then serves the GEMMs' only).
    - bf16 or fp16 with quant: a decoded copy (own_weight) whose quantized bytes the native
      GEMV reads for decode rows, as above.
    The weight stays where a product reads it."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not weight.numel():
        return None
    kernel, amx = native_kernels(), has_amx_bf16()
    if weight.dtype == torch.float32:
        if kernel is not None and amx and dtype == torch.bfloat16:
            return CpuLinear(weight.bfloat16(), bias, kernel=kernel, amx=True, own_weight=True,
                             quant=quant)
        if not packable(weight, decoded=True):
            return None
        return CpuLinear(weight.half(), bias, kernel=kernel if quant is not None else None,
                         amx=False, own_weight=True, quant=quant)
    if weight.dtype not in (torch.bfloat16, torch.float16):
        return None
    needs_fbgemm = not (kernel is not None and amx and weight.dtype == torch.bfloat16)
    if needs_fbgemm and not packable(weight):
        return None
    return CpuLinear(weight, bias, kernel=kernel, amx=amx, own_weight=own_weight,
                     quant=quant if kernel is not None else None)
