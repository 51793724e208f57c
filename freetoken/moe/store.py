"""The expert store: every offloaded MoE layer's experts in host RAM, one contiguous bank per
layer in the layout the MoE kernel reads: {name: [E, *shape]} for each tensor the layer's
ExpertLayout names (w13 [E, 2I, D], w2 [E, D, I], biases when the format has them), in the
model's dtype (the checkpoint's, unless the engine was asked to cast).

The store allocates the banks; the loader fills them from the safetensors files (through the
model's ExpertBank parameters, which are these tensors) so its progress callback covers them.
When CUDA is in use, whole layers are page-locked in place (cudaHostRegister, no copy and no
power-of-two rounding) until `pin_budget_bytes` is spent; the fetcher sends the rest through
a small pinned staging ring.
"""

from __future__ import annotations

import logging
import weakref

import torch

import triton_kernels as tk
from freetoken.moe.layout import ExpertLayout
from freetoken.moe.plan import GiB, MoePlanError
from freetoken.utils.memory import host_available_bytes

log = logging.getLogger("freetoken.moe")
DEFAULT_PIN_FRACTION = 0.6      # of MemAvailable at startup: leave the OS its page cache


def default_pin_budget(available: int) -> int:
    return int(DEFAULT_PIN_FRACTION * available)


class ExpertStore:
    def __init__(self, layers: tuple[int, ...], num_experts: int, layout: ExpertLayout,
                 pin: bool = False, pin_budget_bytes: int | None = None,
                 available_bytes: int | None = None, unpinned: tuple[int, ...] = ()):
        """pin: page-lock within pin_budget_bytes (None: DEFAULT_PIN_FRACTION of free RAM);
        only meaningful with CUDA. available_bytes: host RAM free (None: /proc/meminfo).
        unpinned: layers never fetched (the plan's CPU layers), left pageable for pack_cpu."""
        self.layers = tuple(layers)
        self.num_experts, self.layout = num_experts, layout
        self.hidden, self.width, self.dtype = layout.hidden, layout.width, layout.dtype
        self.expert_bytes = layout.expert_bytes
        self.layer_bytes = num_experts * self.expert_bytes
        self.total_bytes = len(self.layers) * self.layer_bytes
        available = host_available_bytes() if available_bytes is None else available_bytes
        if self.total_bytes > available:
            raise MoePlanError(f"the offloaded experts need {self.total_bytes / GiB:.2f} GiB of "
                               f"host RAM, {available / GiB:.2f} GiB is available")
        self.pin_budget_bytes = (0 if not pin else default_pin_budget(available)
                                 if pin_budget_bytes is None else pin_budget_bytes)
        self.banks: dict[int, dict[str, torch.Tensor]] = {}
        # Layers both fetched and computed on the CPU (hybrid): a second copy packed for the
        # CPU's product (pack_cpu_copy), where host RAM allowed one.
        self.cpu_banks: dict[int, dict] = {}
        self.repacked: dict[int, int] = {}      # CPU layer -> its bank's bytes, repacked (pack_cpu)
        self.pinned: dict[int, bool] = {}
        self._registered: list[int] = []
        for layer in self.layers:
            self.banks[layer] = layout.empty(num_experts)
            self.pinned[layer] = (layer not in unpinned
                                  and self.pinned_bytes + self.layer_bytes <= self.pin_budget_bytes
                                  and self._pin(layer))
        self._finalizer = weakref.finalize(self, _unregister, self._registered)
        if pin:
            log.info("expert store: %d layers, %.2f GiB in host RAM, %.2f GiB pinned (budget %.2f GiB)",
                     len(self.layers), self.total_bytes / GiB, self.pinned_bytes / GiB,
                     self.pin_budget_bytes / GiB)

    @property
    def pinned_bytes(self) -> int:
        return sum(self.layer_bytes for layer, p in self.pinned.items() if p)

    def bank(self, layer: int) -> dict[str, torch.Tensor]:
        """{tensor name: [E, *shape]} of one layer's experts, in host RAM."""
        return self.banks[layer]

    def cpu_bank(self, layer: int) -> dict:
        """The bank the CPU computes a layer's experts from: its packed copy if it has one."""
        return self.cpu_banks.get(layer, self.banks[layer])

    def packs_for_cpu(self, layer: int) -> bool:
        """Whether a layer still in the checkpoint's layout has a faster CPU product to pack
        for (the layout's packs_cpu: 16-bit weights, INT4 in bf16 in shapes the int4 GEMM
        takes)."""
        return self.layout.packs_cpu(self.banks[layer])

    @property
    def host_bytes(self) -> int:
        """Host RAM the banks take now: total_bytes (the checkpoint's layout), with each CPU
        layer repacked in place counted at its packed size (a quantized bank decoded to 16
        bits takes 2-4x its checkpoint bytes)."""
        return self.total_bytes + sum(b - self.layer_bytes for b in self.repacked.values())

    @property
    def cpu_copy_bytes(self) -> int:
        """Host RAM the hybrid layers' packed copies take, beside total_bytes."""
        return sum(_packed_bytes(bank, self.banks[layer]) for layer, bank in self.cpu_banks.items())

    def pack_cpu_copy(self, layer: int, spare_bytes: int) -> int:
        """A layer that is fetched and also computed on the CPU (hybrid): keep a copy of its
        bank packed for the CPU's product (about the checkpoint's bytes again) beside the
        fetched one, if it fits in spare_bytes (the native kernel's bank reads the fetched
        one in place: no bytes). Returns the bytes it took (0: none, or in place)."""
        bank = self.banks[layer]
        if self.layer_bytes > spare_bytes and not self.layout.packs_in_place(bank):
            return 0
        packed = self.layout.pack_cpu(bank)
        if packed is None or _packed_bytes(packed, bank) > spare_bytes:
            return 0        # (an in-place form's own bytes, int4's float32 scales, must fit too)
        self.cpu_banks[layer] = packed
        return _packed_bytes(packed, bank)

    def pack_cpu(self, layer: int, split: tk.CpuSplit | None = None,
                 spare_bytes: int = 0) -> dict | None:
        """A layer whose experts only the CPU computes (never fetched, so never pinned): its
        bank repacked in place for a faster CPU product where the format has one (the
        layout's pack_cpu). Returns the packed bank (the caller hands it to the model's
        ExpertBank at once, so the checkpoint's tensors go before the next layer packs), or
        None: a pinned layer or a format without one stays as it is. split: the CPU
        engine's CpuSplit (the packed bank's prefill chunks on two cores); spare_bytes: host
        RAM a larger packed form may take (a quantized layout's decoded one)."""
        if self.pinned[layer]:
            return None
        packed = self.layout.pack_cpu(self.banks[layer], split, spare_bytes)
        if packed is not None:
            self.banks[layer] = packed
            self.repacked[layer] = _packed_bytes(packed)
        return packed

    def _pin(self, layer: int) -> bool:
        """Page-lock a layer's bank in place; False (and pageable) if the driver refuses."""
        cudart = torch.cuda.cudart()
        done = []
        for t in self.banks[layer].values():
            # cudaHostRegisterPortable: pinned for every CUDA context, not just the current one.
            err = int(cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 1))
            if err != 0:
                log.warning("cannot pin layer %d's experts (cudaError %d); it goes through the "
                            "staging ring", layer, err)
                _unregister(done)
                return False
            done.append(t.data_ptr())
        self._registered.extend(done)
        return True

    def close(self) -> None:
        self._finalizer()


def _unregister(ptrs: list[int]) -> None:
    if ptrs and torch.cuda.is_available():
        cudart = torch.cuda.cudart()
        for p in ptrs:
            cudart.cudaHostUnregister(p)
    ptrs.clear()


def _packed_bytes(bank: dict, source: dict | None = None) -> int:
    """A packed bank's bytes: its w13 and w2 (the biases are the checkpoint bank's own), less
    those a native bank reads in place from source's tensors."""
    def own(which: str) -> int:
        packed, src = bank[which], source or {}
        from_bytes = isinstance(packed, (tk.NativeFp8Bank, tk.NativeInt4Bank))
        t = src.get(f"{which}.q" if from_bytes else which)
        in_place = isinstance(t, torch.Tensor) and t.data_ptr() == (
            packed.q.data_ptr() if from_bytes
            else packed.weight.data_ptr() if isinstance(packed, tk.NativeBank) else -1)
        if not in_place:
            return packed.nbytes
        # an fp8 or int4 bank's bytes are the source's; an fp8 prefill copy and int4's float32
        # group scales are its own
        return packed.nbytes - packed.checkpoint_bytes if from_bytes else 0
    return sum(own(which) for which in ("w13", "w2"))
