"""The model's projections: Linear (nn.Linear through triton_kernels.linear) and QuantLinear.

Linear is nn.Linear (same parameters, same checkpoint names) whose forward is tk.linear:
F.linear, except on the CPU where a 16-bit weight is widened for products of many rows
(triton_kernels/cpu_matmul.py: a prefill chunk's projections run 6x faster on AVX2).

QuantLinear: a projection whose weight stays in its checkpoint's quantized format.

It replaces an nn.Linear of the same name (q_proj, down_proj, ...) when the checkpoint stores
that module quantized; its parameters are the canonical tensors of triton_kernels.dequant
(`q`, `s`, and `z` or `g` where the format has them, shapes in freetoken.moe.quant_layout)
and `bias` in the compute dtype. The forward is quant_linear, which dequantizes in registers
on the GPU and per call in the torch reference: the dense weight is never materialized.
"""

from __future__ import annotations

import torch
from torch import nn

import triton_kernels as tk
from freetoken.moe.quant_layout import weight_tensors
from triton_kernels.dequant import QuantFormat


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tk.linear(x, self.weight, self.bias)


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, fmt: QuantFormat, bias: bool,
                 dtype: torch.dtype, scale_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.names = tuple(p.name for p in weight_tensors(fmt, out_features, in_features, scale_dtype))
        for p in weight_tensors(fmt, out_features, in_features, scale_dtype):
            self.register_parameter(p.name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                                         requires_grad=False))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def weight_dict(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.names}

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in `dtype`: for the few callers that need the matrix itself
        (MLA folds kv_b_proj into its query and output), once, not per forward."""
        return tk.dequantize_reference(self.fmt, self.weight_dict(), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = tk.quant_linear(x.reshape(-1, shape[-1]), self.fmt, self.weight_dict(), self.bias)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.fmt.kind}"
