"""QuantExpertLayout: experts kept in their checkpoint's quantized format, as data.

The same object as ExpertLayout (the store, slot pool, fetcher, CPU experts and the plan's
byte counts take it unchanged) with quantized bank tensors: for each of w13 [2I, D] and
w2 [D, I] the canonical tensors of triton_kernels.dequant (per expert):
    fp8_block    w13.q e4m3 [2I, D]    w13.s f32 [2I/bn, ceil(D/bk)]   (I padded, see below)
    fp8_channel  w13.q e4m3 [2I, D]    w13.s f32 [2I]
    mxfp4        w13.q u8 [2I, D/2]    w13.s u8 E8M0 [2I, D/32]
    nvfp4        w13.q u8 [2I, D/2]    w13.s e4m3 [2I, D/16]   w13.g f32 [1]
    int4         w13.q u8 [2I, D/2]    w13.s [2I, D/G]         (w13.z u8 [2I, D/G] asymmetric)
and likewise w2.*, plus b13 [2I], b2 [D] in the compute dtype. `expert_bytes` are these true
bytes, so cache sizing, counters and the PCIe bound are in quantized bytes.

FP8 block scales cover bn rows; when I % bn != 0 the gate and up halves of w13 are each padded
with zero rows to `width` (a multiple of bn, and of bk for w2's columns), which is exact:
silu(0) * 0 = 0 and the padded w2 columns are zero. Per-tensor FP8 experts are kept as
fp8_channel (gate and up have a scale each; per-row scales hold both exactly).
"""

from __future__ import annotations

import dataclasses
import math

import torch

import triton_kernels as tk
from freetoken.moe.layout import ExpertLayout, ExpertTensor
from triton_kernels.dequant import QuantFormat, weight_shape


def weight_tensors(fmt: QuantFormat, n: int, k: int, scale_dtype=torch.float32,
                   prefix: str = "") -> list[ExpertTensor]:
    """The canonical tensors of one quantized weight [N, K], named prefix + q/s/z/g."""
    bn, bk = fmt.block
    q = ExpertTensor(prefix + "q", (n, k // 2) if fmt.packed else (n, k),
                     torch.uint8 if fmt.packed else torch.float8_e4m3fn)
    s = {"fp8_block": ((math.ceil(n / bn), math.ceil(k / bk)), torch.float32),
         "fp8_channel": ((n,), torch.float32), "fp8_tensor": ((1,), torch.float32),
         "mxfp4": ((n, k // 32), torch.uint8), "nvfp4": ((n, k // 16), torch.float8_e4m3fn),
         "int4": ((n, k // fmt.group), scale_dtype)}[fmt.kind]
    parts = [q, ExpertTensor(prefix + "s", *s)]
    if "z" in fmt.names():
        parts.append(ExpertTensor(prefix + "z", s[0], torch.uint8))
    if "g" in fmt.names():
        parts.append(ExpertTensor(prefix + "g", (1,), torch.float32))
    return parts


def expert_format(fmt: QuantFormat) -> QuantFormat:
    """The format experts are kept in: per-tensor FP8 becomes per-channel (see above)."""
    return QuantFormat("fp8_channel") if fmt.kind == "fp8_tensor" else fmt


def padded_width(fmt: QuantFormat, width: int) -> int:
    if fmt.kind != "fp8_block":
        return width
    step = math.lcm(*fmt.block)
    return -(-width // step) * step


@dataclasses.dataclass(frozen=True)
class QuantExpertLayout(ExpertLayout):
    fmt: QuantFormat = QuantFormat("fp8_channel")
    scale_dtype: torch.dtype = torch.float32    # int4's s, as the checkpoint stores it
    checkpoint_width: int = 0                   # I before fp8_block padding (0: = width)

    def __post_init__(self):
        super().__post_init__()
        if self.fmt.kind == "fp8_tensor":
            raise ValueError("experts keep per-tensor FP8 as fp8_channel (expert_format)")
        if self.checkpoint_width == 0:
            object.__setattr__(self, "checkpoint_width", self.width)

    @property
    def tensors(self) -> tuple[ExpertTensor, ...]:
        d, i, f = self.hidden, self.width, self.fmt
        parts = [*weight_tensors(f, 2 * i, d, self.scale_dtype, "w13."),
                 *weight_tensors(f, d, i, self.scale_dtype, "w2.")]
        if self.bias:
            parts += [ExpertTensor("b13", (2 * i,), self.dtype), ExpertTensor("b2", (d,), self.dtype)]
        return tuple(parts)

    def describe(self) -> str:
        f = self.fmt
        kind = (f"fp8_block {f.block[0]}x{f.block[1]}" if f.kind == "fp8_block" else
                f"int4 g{f.group} {'symmetric' if f.symmetric else 'asymmetric'}" if f.kind == "int4"
                else f.kind)
        pad = "" if self.checkpoint_width == self.width else f", I {self.checkpoint_width} padded to {self.width}"
        return f"{kind}{pad}, {self.expert_bytes} bytes per expert"

    @staticmethod
    def weights(bank: dict[str, torch.Tensor], which: str) -> dict[str, torch.Tensor]:
        """{"q": .., "s": ..} of "w13" or "w2" out of a bank {"w13.q": .., ...}; or, in a bank
        packed for the CPU (pack_cpu), its Int4Packed."""
        if which in bank:
            return bank[which]
        return {name[len(which) + 1:]: t for name, t in bank.items() if name.startswith(which + ".")}

    def run(self, x, bank, topk_weights, topk_ids, slot_map=None):
        return tk.fused_moe_quant(x, self.fmt, self.weights(bank, "w13"), self.weights(bank, "w2"),
                                  topk_weights, topk_ids, slot_map, **self.kernel_kwargs(bank))

    def packs_cpu(self, bank: dict) -> bool:
        """Whether pack_cpu would pack this bank (without packing it)."""
        return (self._fp8_native(bank) is not None or self._int4_native(bank) is not None
                or self._int4_packable(bank))

    def _int4_native(self, bank: dict) -> tk.NativeKernels | None:
        """The native kernel, where it computes this bank from its nibbles: int4 experts of a
        16-bit model on the CPU, in groups the kernel takes (a power of two from 32)."""
        kernel = tk.native_kernels()
        g = self.fmt.group
        if (kernel is None or self.fmt.kind != "int4" or self.dtype == torch.float32
                or g < 32 or g & (g - 1)):
            return None
        w = [self.weights(bank, which) for which in ("w13", "w2")]
        if not all(isinstance(t, dict) and t["q"].device.type == "cpu"
                   and t["q"].dtype == torch.uint8 and (2 * t["q"].shape[-1]) % g == 0
                   for t in w):
            return None
        return kernel

    def _int4_packable(self, bank: dict) -> bool:
        return all(isinstance(w, dict) and tk.packable_int4(self.fmt, w, self.dtype)
                   for w in (self.weights(bank, which) for which in ("w13", "w2")))

    def packs_in_place(self, bank: dict) -> bool:
        """fp8 and int4 banks for the native kernel read the checkpoint's bytes in place (an
        fp8 prefill copy beside them only where spare bytes allow, int4's group scales in
        float32); the int4 GEMM's and the decoded forms are new tensors."""
        return self._fp8_native(bank) is not None or self._int4_native(bank) is not None

    @property
    def fp8_block(self) -> tuple[int, int]:
        """The native kernels' block for this fp8 format: its own (bn, bk), or for channel
        scales (1, 0), a scale a row applied to its sums (cpu_native.fp8_scales_shape)."""
        return (1, 0) if self.fmt.kind == "fp8_channel" else self.fmt.block

    def _fp8_native(self, bank: dict) -> tk.NativeKernels | None:
        """The native kernel, where it computes this bank from its fp8 bytes: fp8_block or
        fp8_channel experts of a 16-bit model, on the CPU."""
        kernel = tk.native_kernels()
        if (kernel is None or self.fmt.kind not in ("fp8_block", "fp8_channel")
                or self.dtype == torch.float32):
            return None
        w = [self.weights(bank, which) for which in ("w13", "w2")]
        if not all(isinstance(t, dict) and set(t) == {"q", "s"} and t["q"].device.type == "cpu"
                   and t["q"].dtype == tk.NativeFp8Bank.dtype and t["s"].dtype == torch.float32
                   for t in w):
            return None
        return kernel

    def pack_cpu(self, bank: dict, split: tk.CpuSplit | None = None,
                 spare_bytes: int = 0) -> dict | None:
        """A bank only the CPU computes, {"w13.q": [E, ..], ..}, repacked for a CPU GEMM:
        - INT4 in a 16-bit model, groups a power of two from 32: the checkpoint's nibbles as
          they are, for the native kernel (cpu_native.NativeInt4Bank: half a byte a weight
          read; a batch-1 layer ~0.4x a bf16 bank's time), {"w13": NativeInt4Bank, ..};
        - INT4 in bf16 otherwise (no native kernel): for torch's CPU int4 GEMM (triton_kernels/int4_cpu.py: about the
          checkpoint's bytes, 1.8x torch's bf16 product at 1 row and 3-12x the tile decode):
          {"w13": Int4Packed, "w2": .., biases};
        - fp8_block and fp8_channel (per-tensor FP8 experts are kept as it) in a 16-bit
          model: the checkpoint's bytes as they are, for the native
          kernel (cpu_native.NativeFp8Bank: 1 byte a weight read, 0.65x a bf16 bank's time
          for a batch-1 layer, 3-9x faster than the tile decode), {"w13": NativeFp8Bank,
          "w2": .., biases}; on a CPU with AMX-BF16 in a bf16 model, with spare_bytes for
          2 bytes a weight, also a bf16 copy for prefill chunks (AMX's products);
        - the other formats torch's CPU has no GEMM for (mxfp4, nvfp4, INT4 the
          int4 GEMM refuses), in a 16-bit model, where spare_bytes (host RAM the caller can
          give) hold 2 bytes a weight: each expert decoded once, for the native kernel, in
          bfloat16 in a bf16 model on an AMX CPU, else in float16
          (cpu_native.NativeBank.decoded; bfloat16 where an expert is beyond float16's
          range) or, without one, packed for the fp16-weight GEMM (cpu_matmul.Fp16Bank.decoded,
          split: the CPU engine's CpuSplit; a layer with an expert beyond float16's range
          keeps the bank as it is), replacing the tile decode at every call (3-9x a bf16
          layer's time, bench/cpu_moe.py). float16 keeps 11 bits of a decoded value from
          2^-14 up (the tile decode rounds it to bf16's 8; below, within an absolute 2^-25).
        None where none applies."""
        biases = {name: t for name, t in bank.items() if name in ("b13", "b2")}
        if (kernel := self._int4_native(bank)) is not None:
            return {which: tk.NativeInt4Bank(w["q"], w["s"], w.get("z"), self.fmt.group, kernel)
                    for which, w in (("w13", self.weights(bank, "w13")),
                                     ("w2", self.weights(bank, "w2")))} | {
                        name: t.float() for name, t in biases.items()}
        if self._int4_packable(bank):
            return {which: tk.Int4Packed(self.fmt, self.weights(bank, which))
                    for which in ("w13", "w2")} | biases
        w13, w2 = self.weights(bank, "w13"), self.weights(bank, "w2")
        if (not (isinstance(w13, dict) and isinstance(w2, dict)) or self.dtype == torch.float32
                or not tk.packs_fp16()):
            return None
        shapes = {which: weight_shape(self.fmt, w) for which, w in (("w13", w13), ("w2", w2))}
        room = spare_bytes >= sum(2 * lead[0] * n * k for lead, n, k in shapes.values())
        amx = tk.has_amx_bf16() and self.dtype == torch.bfloat16

        def decoder(w):
            def decode(e):
                return tk.dequantize_reference(self.fmt, {name: t[e] for name, t in w.items()},
                                               torch.float32)
            return decode

        if (kernel := self._fp8_native(bank)) is not None:     # fp8 from its bytes
            packed = {}
            for which, w in (("w13", w13), ("w2", w2)):
                (experts,), n, k = shapes[which]
                prefill = (tk.NativeBank.decoded((experts, n, k), decoder(w), kernel, amx=True)
                           if room and amx else None)
                packed[which] = tk.NativeFp8Bank(w["q"], w["s"], self.fp8_block, kernel,
                                                 prefill=prefill)
            return packed | {name: t.float() for name, t in biases.items()}
        if not room:                    # 2 bytes a weight do not fit: the tile decode
            return None
        kernel = tk.native_kernels()
        packed = {}
        for which, w in (("w13", w13), ("w2", w2)):
            (experts,), n, k = shapes[which]
            decode = decoder(w)
            if kernel is not None:
                packed[which] = tk.NativeBank.decoded((experts, n, k), decode, kernel, amx=amx)
            else:
                packed[which] = tk.Fp16Bank.decoded((experts, n, k), self.dtype, decode, split)
                if packed[which] is None:
                    return None
        if kernel is not None:          # the kernel's biases in float32, once
            biases = {name: t.float() for name, t in biases.items()}
        if kernel is not None and packed["w13"].dtype != packed["w2"].dtype:
            # one bank beyond float16's range went to bfloat16: the kernel takes one dtype
            packed = {which: tk.NativeBank(b.weight.to(torch.bfloat16), kernel)
                      for which, b in packed.items()}
        return packed | biases

    def run_reference(self, x, bank, topk_weights, topk_ids, slot_map=None):
        """The CPU experts: one routed expert decoded at a time, a tile of rows at a time,
        never the whole bank (triton_kernels/dequant_cpu.py)."""
        return tk.fused_moe_quant_cpu(
            x, self.fmt, self.weights(bank, "w13"), self.weights(bank, "w2"), topk_weights,
            topk_ids, slot_map, **self.kernel_kwargs(bank))

    def checkpoint_shape(self, name: str, half) -> tuple[int, ...]:
        """The shape the checkpoint stores part `name` of one expert in (one half of w13, or
        w2 whole): the bank's, before fp8_block padding."""
        d, ci, f = self.hidden, self.checkpoint_width, self.fmt
        if name in ("b13", "b2"):
            return (ci,) if name == "b13" else (d,)
        which, leaf = name.split(".")
        n, k = (ci, d) if which == "w13" else (d, ci)
        return next(p.shape for p in weight_tensors(f, n, k, self.scale_dtype) if p.name == leaf)

    def load_part(self, name: str, dst: torch.Tensor, half, t: torch.Tensor) -> None:
        """Copy checkpoint tensor t (part `name` of one expert; one half of w13 when half is
        0/1) into dst, the expert's slice of the bank tensor: rows of its half, padding
        zeroed (scales of padded blocks set to 1), per-tensor FP8 scales spread over rows."""
        if half is not None:
            rows = dst.shape[0] // 2
            dst = dst[half * rows:(half + 1) * rows]
        want = self.checkpoint_shape(name, half)
        if self.fmt.kind == "fp8_channel" and name.endswith(".s") and t.numel() == 1:
            dst.fill_(float(t.reshape(-1)[0]))      # a per-tensor scale, over the rows
            return
        if tuple(t.shape) != want:
            raise ValueError(f"{name}{'' if half is None else ('.gate', '.up')[half]}: checkpoint "
                             f"shape {tuple(t.shape)}, expected {want}")
        if tuple(dst.shape) != want:                # fp8_block padding
            dst.fill_(1 if name.endswith(".s") else 0)
            dst = dst[tuple(slice(0, w) for w in want)]
        dst.copy_(t)
