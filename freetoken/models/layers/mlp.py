"""SwiGLU MLP with HF's gate_proj/up_proj/down_proj names (dense layers, shared experts)."""

import torch.nn.functional as F
from torch import nn

from freetoken.models.layers.linear import Linear


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, width: int, bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden, width, bias=bias)
        self.up_proj = Linear(hidden, width, bias=bias)
        self.down_proj = Linear(width, hidden, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
