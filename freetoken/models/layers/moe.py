"""The sparse MoE block: a router, the routed experts as one ExpertBank, and shared experts.

ExpertBank holds all of a layer's experts as the stacked tensors its ExpertLayout names (the
layout the MoE kernel reads: w13 [E, 2I, D] gate rows then up rows, w2 [E, D, I], biases);
checkpoint keys, per expert or fused, load into slices of them (a quantized layout's tensors,
"w13.q", "w13.s", ..., are parameters named w13_q, w13_s, ...). When the engine keeps
experts off the device (freetoken.moe), the bank's tensors are the host expert store's and
`runtime` (x, topk_weights, topk_ids) -> [T, D] runs the layer.
"""

from __future__ import annotations

import torch
from torch import nn

import triton_kernels as tk
from freetoken.models.layers.linear import Linear
from freetoken.models.layers.mlp import DenseMLP
from freetoken.models.layers.router import Router
from freetoken.moe.layout import ExpertLayout
from freetoken.moe.quant_layout import QuantExpertLayout


class ExpertBank(nn.Module):
    # checkpoint projection name -> (bank tensor, which half of w13 or None for the whole)
    PROJ = {"gate_proj": ("w13", 0), "w1": ("w13", 0),
            "up_proj": ("w13", 1), "w3": ("w13", 1),
            "down_proj": ("w2", None), "w2": ("w2", None)}

    def __init__(self, num_experts: int, layout: ExpertLayout):
        super().__init__()
        self.num_experts, self.width = num_experts, layout.width
        self._layout = layout
        for part in layout.tensors:
            self.register_parameter(part.name, nn.Parameter(torch.empty(num_experts, *part.shape)))
        self.runtime = None
        self.packed: dict | None = None         # pack_cpu's bank, when the CPU computes it
        self._pending_g: dict[tuple[int, int], float] = {}

    @staticmethod
    def attr(name: str) -> str:
        """The parameter holding bank tensor `name` ("w13.q" -> w13_q)."""
        return name.replace(".", "_")

    def set_layout(self, layout: QuantExpertLayout) -> None:
        """Swap the (meta-built) float tensors for a quantized layout's, in their own dtypes."""
        for name in self._layout.names:
            delattr(self, self.attr(name))
        for part in layout.tensors:
            self.register_parameter(self.attr(part.name), nn.Parameter(
                torch.empty(self.num_experts, *part.shape, dtype=part.dtype, device="meta"),
                requires_grad=False))
        self._layout, self.width = layout, layout.width

    @property
    def layout(self) -> ExpertLayout:
        """The layout in the dtype the model was cast to (built with a placeholder dtype; a
        quantized layout is built after the cast, in the compute dtype)."""
        if (self.packed is None and not isinstance(self._layout, QuantExpertLayout)
                and self._layout.dtype != self.w13.dtype):
            self._layout = self._layout.with_dtype(self.w13.dtype)
        return self._layout

    def bank(self) -> dict[str, torch.Tensor]:
        if self.packed is not None:
            return self.packed
        return {name: getattr(self, self.attr(name)) for name in self._layout.names}

    def pack_cpu(self, packed: dict | None = None, split: tk.CpuSplit | None = None,
                 spare_bytes: int = 0) -> int:
        """Experts only the CPU computes, in a format it has a faster product for (the
        layout's pack_cpu: 16-bit weights for the fp16-weight GEMM, INT4 for the int4 GEMM),
        replacing the checkpoint's tensors. packed: the host store's bank, already packed
        (ExpertStore.pack_cpu). split: the CPU engine's CpuSplit; spare_bytes: host RAM a
        larger packed form may take (a quantized layout's decoded one). Returns the packed
        bytes (0: nothing to pack)."""
        if packed is None:
            packed = self.layout.pack_cpu(self.bank(), split, spare_bytes)
            if packed is None:
                return 0
        for name in self._layout.names:
            if name not in ("b13", "b2"):
                delattr(self, self.attr(name))
        self.packed = packed
        return sum(w.nbytes for name, w in packed.items() if name in ("w13", "w2"))

    def load_expert(self, expert: int, proj: str, tensor: torch.Tensor, kind: str = "weight") -> str:
        """Copy one checkpoint tensor (`kind` weight or bias) of one expert in; returns the
        bank slice's name for bookkeeping."""
        bank, half = self.PROJ[proj]
        if kind == "bias":
            bank = {"w13": "b13", "w2": "b2"}[bank]
        elif kind != "weight":                  # a quantized layout's q, s, z or g
            bank = f"{bank}.{kind}"
        if not hasattr(self, self.attr(bank)):
            raise ValueError(f"expert {expert} {proj}.{kind}: this layer's experts have no {bank}")
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert index {expert} out of range 0..{self.num_experts - 1}")
        dst = getattr(self, self.attr(bank)).data[expert]
        name = f"{self.attr(bank)}[{expert}]{'' if half is None else ('.gate', '.up')[half]}"
        if isinstance(self._layout, QuantExpertLayout):
            if bank == "w13.g":                 # one global scale per half: see finish_load
                self._pending_g[(expert, half)] = float(tensor.reshape(-1)[0])
            else:
                self._layout.load_part(bank, dst, half, tensor)
            return name
        if half is not None:
            dst = dst[half * self.width:(half + 1) * self.width]
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"expert {expert} {proj}.{kind}: checkpoint shape "
                             f"{tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(tensor)
        return name

    def finish_load(self) -> int:
        """NVFP4: w13 holds one global scale per expert, the checkpoint one for gate and one for
        up. Equal ones (ModelOpt shares them) are taken as they are; otherwise the larger is
        kept and the other half's block scales are rescaled into it (rounded to e4m3, so not
        exact). Returns how many experts were rescaled."""
        if not self._pending_g:
            return 0
        g, s, i = self.w13_g.data, self.w13_s.data, self.width
        rescaled = 0
        for e in range(self.num_experts):
            halves = (self._pending_g[(e, 0)], self._pending_g[(e, 1)])
            g[e] = top = max(halves)
            for h, gh in enumerate(halves):
                if gh != top:
                    part = s[e, h * i:(h + 1) * i]
                    part.copy_((part.float() * (gh / top)).to(part.dtype))
                    rescaled += 1
        self._pending_g = {}
        return rescaled

    def forward(self, x, topk_weights, topk_ids):
        if self.runtime is not None:
            return self.runtime(x, topk_weights, topk_ids)
        return self.layout.run(x, self.bank(), topk_weights, topk_ids)


class SparseMoeBlock(nn.Module):
    """Router (`gate`) + routed experts + optional shared experts, under HF's names:
    qwen2_moe's `shared_expert` scaled by sigmoid(`shared_expert_gate`(x)), or GLM/ERNIE/
    DeepSeek's ungated `shared_experts`."""

    def __init__(self, gate: Router, experts: ExpertBank, shared: DenseMLP | None = None,
                 shared_name: str = "shared_experts", shared_gate: bool = False):
        super().__init__()
        self.gate, self.experts = gate, experts
        self.top_k = gate.top_k
        self.shared_name = shared_name if shared is not None else None
        if shared is not None:
            self.add_module(shared_name, shared)
        hidden = gate.weight.shape[1]
        self.shared_expert_gate = Linear(hidden, 1, bias=False) if shared_gate else None
        self.native: tk.NativeKernels | None = None     # a CPU engine's gated add (bind_cpu)

    def bind_cpu(self) -> None:
        """A 16-bit CPU engine: the shared experts' (gated) add to the routed output in one
        native call (cpu_gates.c), which a decode program records too."""
        kernel = tk.native_kernels()
        if self.shared_name is not None and kernel is not None and kernel.handles(
                self.gate.weight.dtype):
            self.native = kernel

    def shared_out(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The shared experts' output [T, D] and their gate's logit [T, 1] (None: ungated)."""
        gate = self.shared_expert_gate
        return getattr(self, self.shared_name)(x), None if gate is None else gate(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate.route(x)                 # [T, k]
        out = self.experts(x, weights, ids)
        if self.shared_name is None:
            return out
        shared, logit = self.shared_out(x)
        if self.native is not None and out.dtype == shared.dtype and out.device.type == "cpu":
            return self.native.add_gated(out.contiguous(), shared, logit)   # (out: the call's own)
        if logit is not None:
            shared = torch.sigmoid(logit) * shared
        return out + shared
