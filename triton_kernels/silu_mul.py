"""SiLU-and-multiply: x [T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""

import torch
import torch.nn.functional as F

from triton_kernels._dispatch import tl, triton, use_triton


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_xt, stride_ot, I, BLOCK: tl.constexpr):
    # Grid (T, cdiv(I, BLOCK)): each program does BLOCK columns of one row.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(x_ptr + row * stride_xt + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_xt + I + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # silu rounds to the input dtype before the multiply, as F.silu(gate) * up does.
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * stride_ot + offs, act * up, mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dim {x.shape[-1]} must be even (gate | up)")
    i = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * i)
    if x2.stride(-1) != 1:
        raise ValueError(f"silu_and_mul: x needs a contiguous last dimension, "
                         f"got strides {tuple(x.stride())}")
    out = torch.empty(*x.shape[:-1], i, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    out2 = out.view(-1, i)
    block = min(triton.next_power_of_2(i), 1024)
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(i, block))](
        x2, out2, x2.stride(0), out2.stride(0), i, BLOCK=block, num_warps=4)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        return silu_and_mul_triton(x)
    return silu_and_mul_reference(x)
