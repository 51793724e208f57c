"""RMSNorm with HF's `weight` name; the residual add is fused into the same op when given.

`offset` 1.0 is the zero-centred form (Gemma, Qwen3-Next, Qwen3.5): the checkpoint stores w
and the norm scales by 1 + w (formed in float32, then in the weight's dtype for the kernel).
"""

import torch
from torch import nn

import triton_kernels as tk


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        weight = (self.weight if not self.offset
                  else (self.offset + self.weight.float()).to(self.weight.dtype))
        return tk.rms_norm(x, weight, self.eps, residual)
