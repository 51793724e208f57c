"""SiLU-and-multiply: x [T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""

import torch
import torch.nn.functional as F

from triton_kernels._dispatch import use_triton


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        return silu_and_mul_triton(x)
    return silu_and_mul_reference(x)
