"""SwiGLU MLP with HF's gate_proj/up_proj/down_proj names (dense layers, shared experts).

On a 16-bit CPU engine gate and up run as one product (pack_cpu; linear.pack_for_cpu) and
the activation natively (cpu_gates.c: silu(g) * u in one call, rounded as HF's two ops), so
a decode program (engine/cpu_graph.py) records the MLP as three native calls.
"""

import torch.nn.functional as F
from torch import nn

import triton_kernels as tk
from freetoken.models.layers.linear import Linear, pack_fused


class DenseMLP(nn.Module):
    cpu_fused = ("gate_proj", "up_proj")

    def __init__(self, hidden: int, width: int, bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden, width, bias=bias)
        self.up_proj = Linear(hidden, width, bias=bias)
        self.down_proj = Linear(width, hidden, bias=bias)
        self.gate_up: tk.CpuLinear | tk.Int4Linear | None = None
        self.native: tk.NativeKernels | None = None     # the native SwiGLU, beside gate_up

    def pack_cpu(self) -> int:
        """CPU engine: gate and up as one product [2I, D] and the native SwiGLU after it.
        Returns the product's bytes (0: packed alone, or not at all)."""
        self.gate_up = pack_fused([self.gate_proj, self.up_proj])
        kernel = tk.native_kernels()
        if self.gate_up is not None and kernel is not None and kernel.handles(
                self.down_proj.weight.dtype if isinstance(self.down_proj, Linear)
                else self.down_proj.dtype):
            self.native = kernel
        return 0 if self.gate_up is None else self.gate_up.nbytes

    def forward(self, x):
        if self.gate_up is not None:
            y = self.gate_up(x)                                      # [T, 2I]: g, then u
            if self.native is not None and y.dtype == x.dtype and y.device.type == "cpu":
                return self.down_proj(self.native.silu_mul(y))
            g, u = y.chunk(2, dim=-1)
            return self.down_proj(F.silu(g) * u)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
