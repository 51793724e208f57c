"""RMSNorm with HF's `weight` name; the residual add is fused into the same op when given.

`offset` 1.0 is the zero-centred form (Gemma, Qwen3-Next, Qwen3.5): the checkpoint stores w
and the norm scales by 1 + w (formed in float32, then in the weight's dtype for the kernel).

A 16-bit CPU engine's norms of a few rows (decode) run natively (pack_cpu; cpu_norm.c: the
same arithmetic in one call instead of torch's eight ops, ~33 us a norm on a 2-core Xeon).
"""

import torch
from torch import nn

import triton_kernels as tk

NATIVE_ROWS = 16        # a CPU engine's norms of up to this many rows run natively


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset
        self.native: tk.NativeKernels | None = None

    def scale(self) -> torch.Tensor:
        """The weight the norm multiplies by (1 + w for the zero-centred form)."""
        return (self.weight if not self.offset
                else (self.offset + self.weight.float()).to(self.weight.dtype))

    def pack_cpu(self) -> int:
        """A 16-bit CPU engine: decode rows through the native norm. Returns 0 (no bytes)."""
        kernel = tk.native_kernels()
        if kernel is not None and kernel.handles(self.weight.dtype):
            self.native = kernel
        return 0

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if (self.native is not None and x.dim() == 2 and x.shape[0] <= NATIVE_ROWS
                and x.dtype == self.weight.dtype and x.device.type == "cpu"):
            return self.native.rms_norm(x, self.scale(), self.eps, residual)
        return tk.rms_norm(x, self.scale(), self.eps, residual)
