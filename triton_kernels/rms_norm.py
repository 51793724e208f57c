"""RMSNorm with an optional fused residual add.

x: [T, D], weight: [D]. With `residual` ([T, D]) the op first forms s = x + residual in the
input dtype (as HF models add residuals), returns (rmsnorm(s), s) so the caller keeps s as the
next residual. Statistics are computed in float32, then cast back before the weight multiply,
exactly as Hugging Face's Qwen/Mixtral RMSNorm does.
"""

import torch

from triton_kernels._dispatch import use_triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None):
    if residual is not None:
        x = x + residual
        residual = x
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_reference(x, weight, eps, residual)
