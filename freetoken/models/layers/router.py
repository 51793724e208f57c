"""The router: one `route()` per MoE layer, used by the forward and by prefetch's guesses.

x [T, D] -> logits = x @ weight^T (+ bias) [T, E] -> (weights [T, k], ids [T, k]). Variants,
as data:
- softmax -> top-k, renormalised or not (Qwen, Mixtral, OLMoE); with a logit bias and
  renormalisation this is also gpt-oss's top-k -> softmax over the chosen (softmax is
  monotonic, and renormalised probabilities are the softmax of the chosen logits);
- a selection bias (`e_score_correction_bias`) added to the scores for choosing only, sigmoid
  or softmax scores, group-limited top-k (n_group, topk_group), renormalisation and a
  routed scaling factor (GLM-4.x, MiniMax-M2, DeepSeek-V3, ERNIE-4.5).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

import triton_kernels as tk
from triton_kernels.cpu_linear import NATIVE_ROWS


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    num_experts: int
    top_k: int
    scoring: str = "softmax"            # "softmax" or "sigmoid"
    renormalize: bool = False
    logit_bias: bool = False            # gpt-oss: the gate Linear has a bias
    selection_bias: bool = False        # e_score_correction_bias, for choosing only
    n_group: int = 1
    topk_group: int = 1
    scale: float = 1.0                  # routed_scaling_factor
    weights_in_model_dtype: bool = False    # qwen/olmoe cast the weights before scaling experts
    float32: bool = False               # logits from a float32 copy of x and the weight

    def __post_init__(self):
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"router scoring must be softmax or sigmoid, got {self.scoring!r}")
        if self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"{self.num_experts} experts in {self.n_group} groups, keeping "
                             f"{self.topk_group}: not a valid grouping")

    @property
    def plain(self) -> bool:
        """Softmax -> top-k, the kernel without bias or groups."""
        return (self.scoring == "softmax" and not self.selection_bias and self.n_group == 1
                and self.scale == 1.0)


class Router(nn.Module):
    """HF's `gate`: weight [E, D] (+ bias [E]) (+ e_score_correction_bias [E])."""

    def __init__(self, hidden: int, cfg: RouterConfig):
        super().__init__()
        self.cfg = cfg
        self.top_k = cfg.top_k
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(cfg.num_experts)) if cfg.logit_bias else None
        self.e_score_correction_bias = (nn.Parameter(torch.empty(cfg.num_experts))
                                        if cfg.selection_bias else None)

        self.packed: tk.CpuLinear | None = None
        self.native: tk.NativeKernels | None = None     # a CPU engine's top-k (pack_cpu)
        self.native_bias: torch.Tensor | None = None    # its float32 selection bias
        self.exact = None       # a float32 router's native product (cpu_native.LinearCall)

    def pack_cpu(self) -> int:
        """On a CPU engine in 16 bits: the gate through the CPU's product (cpu_linear.py; a
        bf16 [64, 1024] product cost ~100 us a layer, 1/20 of a decode step; packed, ~10).
        The logits are still rounded to x's dtype, as F.linear's. A float32 router (GLM,
        DeepSeek, MiniMax: HF widens x and the weight) takes the native GEMV from the 16-bit
        weight as it is, each product exact in float32 and the sums float32, unrounded: the
        float32 product's math in another order of sums. The top-k runs natively
        (cpu_route.c: one call for torch's four ops, the plain softmax -> top-k; or ~15, the
        biased, sigmoid and grouped ones). Returns the bytes it added."""
        if self.weight.dtype not in (torch.bfloat16, torch.float16):
            return 0                     # (a float32 model keeps the reference's routing)
        self.native = kernel = tk.native_kernels()
        if self.e_score_correction_bias is not None:
            self.native_bias = self.e_score_correction_bias.detach().float().contiguous()
        if self.cfg.float32:
            if kernel is not None:
                self.exact = kernel.bind_linear(self.weight.detach().contiguous(), None
                                                if self.bias is None else self.bias.float())
            return 0
        self.packed = tk.cpu_linear(self.weight, self.bias)
        return 0 if self.packed is None else self.packed.nbytes

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        if (self.exact is not None and x.dtype == self.weight.dtype and x.device.type == "cpu"
                and x.shape[0] < NATIVE_ROWS):              # (decode rows: the GEMV's)
            return self.exact(x, torch.float32)
        if self.cfg.float32:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias)
        return F.linear(x, self.weight, self.bias)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (weights [T, k] float32, or x's dtype when the family casts; ids [T, k])."""
        c, logits = self.cfg, self.logits(x)
        if self.native is not None and logits.device.type == "cpu":
            weights, ids = (self.native.topk_softmax(logits, c.top_k, c.renormalize) if c.plain
                            else self.native.topk_biased(logits, c.top_k, **self.biased_args()))
        elif c.plain:
            weights, ids = tk.topk_softmax(logits, c.top_k, c.renormalize)
        else:
            bias = (None if self.e_score_correction_bias is None
                    else self.e_score_correction_bias.float())
            weights, ids = tk.biased_topk(logits, c.top_k, bias=bias, scoring=c.scoring,
                                          n_group=c.n_group, topk_group=c.topk_group,
                                          renormalize=c.renormalize, scale=c.scale)
        if c.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        return weights, ids

    def biased_args(self) -> dict:
        """The native biased top-k's arguments for this router (cpu_native.topk_biased_op)."""
        c = self.cfg
        return dict(bias=self.native_bias, scoring=c.scoring, n_group=c.n_group,
                    topk_group=c.topk_group, renormalize=c.renormalize, scale=c.scale)

    forward = route
