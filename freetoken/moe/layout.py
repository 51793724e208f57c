"""ExpertLayout: what one expert of a layer is made of, as data.

Every part that holds or moves experts (the model's ExpertBank, the host-RAM store, the GPU
slot pool, the fetcher, the CPU experts, the plan's byte counts) works from this object, so a
new expert format (biases, another activation, later quantized tensors with their scales) is a
new layout, not a new code path in each of them.

Per expert, with D the hidden size and I the expert width (gate/up rows de-interleaved: rows
[0, I) gate, [I, 2I) up, whatever order the checkpoint stores them in):
    w13 [2I, D]   w2 [D, I]   and with biases   b13 [2I]   b2 [D]
A bank holds E experts of a layer: {name: tensor [E, *shape]}; the slot pool is a bank of S.
"""

from __future__ import annotations

import dataclasses

import torch

import triton_kernels as tk


@dataclasses.dataclass(frozen=True)
class ExpertTensor:
    name: str
    shape: tuple[int, ...]          # per expert
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    hidden: int                     # D
    width: int                      # I
    dtype: torch.dtype
    bias: bool = False              # b13 and b2 (gpt-oss)
    activation: str = "silu"        # "silu": silu(gate) * up; "swiglu_oai": gpt-oss's clamped form
    alpha: float = 1.702            # swiglu_oai only
    limit: float = 7.0              # swiglu_oai only

    def __post_init__(self):
        if self.activation not in ("silu", "swiglu_oai"):
            raise ValueError(f"unknown expert activation {self.activation!r}")

    @property
    def tensors(self) -> tuple[ExpertTensor, ...]:
        d, i, t = self.hidden, self.width, self.dtype
        parts = [ExpertTensor("w13", (2 * i, d), t), ExpertTensor("w2", (d, i), t)]
        if self.bias:
            parts += [ExpertTensor("b13", (2 * i,), t), ExpertTensor("b2", (d,), t)]
        return tuple(parts)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.tensors)

    @property
    def expert_bytes(self) -> int:
        return sum(p.nbytes for p in self.tensors)

    def with_dtype(self, dtype: torch.dtype) -> "ExpertLayout":
        return dataclasses.replace(self, dtype=dtype)

    def empty(self, count: int, device="cpu", pin_memory: bool = False) -> dict[str, torch.Tensor]:
        """A bank of `count` experts (uninitialised): {name: [count, *shape]}."""
        return {p.name: torch.empty(count, *p.shape, dtype=p.dtype, device=device,
                                    pin_memory=pin_memory) for p in self.tensors}

    def kernel_kwargs(self, bank: dict[str, torch.Tensor]) -> dict:
        """The fused-MoE keyword arguments beyond (x, w13, w2, ...): biases and activation,
        given only when they differ from the plain SiLU expert."""
        kwargs = {}
        if self.bias:
            kwargs.update(b13=bank["b13"], b2=bank["b2"])
        if self.activation != "silu":
            kwargs["activation"] = tk.MoeActivation(self.activation, self.alpha, self.limit)
        return kwargs

    def run(self, x: torch.Tensor, bank: dict[str, torch.Tensor], topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, slot_map: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, D] through the routed experts of `bank` (indexed by slot_map when given)."""
        return tk.fused_moe(x, bank["w13"], bank["w2"], topk_weights, topk_ids, slot_map,
                            **self.kernel_kwargs(bank))

    def run_reference(self, x, bank, topk_weights, topk_ids, slot_map=None) -> torch.Tensor:
        """The same through the torch reference, whatever the device (the CPU experts)."""
        return tk.fused_moe_reference(x, bank["w13"], bank["w2"], topk_weights, topk_ids,
                                      slot_map, **self.kernel_kwargs(bank))

    def packs_cpu(self, bank: dict) -> bool:
        """Whether pack_cpu would pack this bank (without packing it): 16-bit weights on the
        CPU, for the native kernel or (without one) the fp16-weight GEMM, inside float16's
        range, on a torch that has it."""
        return self._native(bank) is not None or all(
            isinstance(bank[w], torch.Tensor) and tk.packable(bank[w]) for w in ("w13", "w2"))

    def packs_in_place(self, bank: dict) -> bool:
        """Whether pack_cpu reads the bank's own tensors (the native kernel): no bytes taken."""
        return self._native(bank) is not None

    @staticmethod
    def _native(bank: dict) -> tk.NativeKernels | None:
        kernel = tk.native_kernels()
        if kernel is None or not all(
                isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous()
                and kernel.handles(t.dtype) for t in (bank.get("w13"), bank.get("w2"))):
            return None
        return kernel

    def pack_cpu(self, bank: dict, split: tk.CpuSplit | None = None,
                 spare_bytes: int = 0) -> dict | None:
        """A bank only the CPU computes, {"w13": [E, 2I, D], ..}, for its fastest product:
        - the native kernel (cpu_native.NativeBank: the tensors as they are, 1.3-2x the
          fp16-weight GEMM at every token count): {"w13": NativeBank, "w2": .., biases};
        - without it (no C compiler), w13 and w2 packed for the fp16-weight GEMM
          (cpu_matmul.Fp16Bank: as many bytes, 1.4-2x torch's bf16 products), split: the
          CPU engine's second core for prefill chunks (cpu_split.py).
        None where neither applies. spare_bytes: unused (neither takes more bytes)."""
        kernel = self._native(bank)
        if kernel is not None:
            # biases in float32 once here, not widened at every call (the kernel's dtype)
            return {name: tk.NativeBank(t, kernel) if name in ("w13", "w2") else t.float()
                    for name, t in bank.items()}
        if not all(isinstance(bank[w], torch.Tensor) and tk.packable(bank[w])
                   for w in ("w13", "w2")):
            return None
        return {name: tk.Fp16Bank(t, split) if name in ("w13", "w2") else t
                for name, t in bank.items()}
