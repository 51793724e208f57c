"""Dense projections on the CPU: a 16-bit weight widened to float32 for many rows at once.

torch's bfloat16 and float16 matmuls on a CPU without AVX-512 BF16 / AMX (AVX2 machines,
most desktops) run one matrix-vector product per row: 16 rows cost 16x one row, 512 rows
(a prefill chunk) 290x. float32 goes to the BLAS GEMM. Widening the weight (one vectorized
copy, ~0.2 ns a weight) and multiplying in float32 costs about the same as the 16-bit
product at 8 rows, half at 16, a sixth at 512 (measured on a 2-core AVX2 EPYC, [512, 1024]):
so from WIDE_ROWS rows on the weight is widened, a tile of rows at a time. Both accumulate in float32 and round the
output to x's dtype once; the sums run in other orders, so the bits differ in the last place.
On the GPU and in float32 this is F.linear.

Packed weights (Fp16Weight, Fp16Bank), for the projections and experts of a model that runs
on the CPU: torch's fp16-weight GEMM (FBGEMM, the kernel behind dynamic fp16 quantization:
2-byte weights widened in registers by F16C, float32 activations and sums) is the fastest
16-bit product torch has on AVX2 at every row count; a large weight takes its threaded entry
point (both cores: a 2-core CPU engine's batch-1 step 24.7 -> 19.3 ms, prefill 1.36x).
torch's bf16 product at one row is bound by its bf16 widening, not by DRAM: on the 2-core EPYC, weights cold in DRAM, one row
read 6-11 GB/s of bf16 ([1024, 256] to [1024, 1024]; 16 for a [32768, 1024] lm_head) where the
packed fp16 GEMM read 16-20 (27) GB/s: 1.7-2.7x. From 2 rows (against the bf16 product and the
widened one from 12 rows): 2 rows 1.4-1.8x, 8 rows 3-5x, 16 rows 2.6-3.8x, 64 rows 1.5-1.9x,
512 rows 1.2-1.8x. One MoE layer of packed experts (Fp16Bank; 64 experts, top-8, D 1024,
I 256) against fused_moe's bf16 CPU forms: 2.0x at 1 token, 1.7x at 8-16, 1.44x at 64. A
bfloat16 weight converts to float16 exactly where 2^-14 <= |w| <= 65504 (float16 has more
mantissa bits); smaller weights lose bits, at most 2^-25 in absolute value (bfloat16's own
rounding of a weight of 0.05 is 2^-13). A weight with |w| > 65504 is not packed. Outputs
are not HF's bf16 bits (other sums, in float32): a packed model is held to tolerance.
"""

from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
import torch.nn.functional as F

from triton_kernels.cpu_split import CpuSplit

WIDE_ROWS = 12
TILE_ELEMENTS = 1 << 20   # weights widened at a time: 4 MB of float32 that stays in cache (a
                          # whole lm_head, 128 MB for 32k x 1024, was 2x slower than bf16)
_NARROW = (torch.bfloat16, torch.float16)
FP16_MAX = 65504.0
THREADED_ELEMENTS = 1 << 20   # from here a packed weight takes the threaded entry point (Fp16Weight)


def widens(x: torch.Tensor, rows: float | None = None) -> bool:
    """True when a product of x ([rows, K]; rows: x's unless given, e.g. the mean rows per
    expert of a MoE call) with a weight in x's dtype runs faster widened."""
    return (x.device.type == "cpu" and x.dtype in _NARROW
            and (x.shape[0] if rows is None else rows) >= WIDE_ROWS)


def packs_fp16() -> bool:
    """Whether this torch has the fp16-weight CPU GEMM (FBGEMM: x86 builds)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


class Fp16Weight:
    """One weight [N, K] (and its bias) packed for the fp16-weight CPU GEMM; x @ W^T + b in
    x's dtype, the product and the bias add in float32, rounded once.

    Two entry points to the same FBGEMM kernel, which give the same bits:
    - torch.fbgemm_linear_fp16_weight: one thread, ~4 us of dispatch a call. torch marks it
      deprecated, with a one-time warning, which the first (packing) call takes in silence.
    - torch.ops.quantized.linear_dynamic_fp16: the same GEMM over torch's intra-op threads,
      but its packed argument is a TorchScript object whose conversion costs ~15 us a call.
    So a weight of THREADED_ELEMENTS and more takes the threaded op, a smaller one (a
    router, a small expert) the one-thread call. Per product on 2 threads, weights cold
    (ms; one-thread / threaded): [1024, 1024] 0.15/0.12 at 1 row, 1.5/0.81 at 64;
    [4096, 1024] 0.58/0.42, 6.9/3.4; [1024, 2048] 0.31/0.16, 3.0/1.8; an expert
    [512, 1024] 0.072/0.066 at 1 row, [1024, 256] 0.040/0.047 (a batch-1 MoE layer over the
    threaded op was ~10% slower; the prefill split is the experts' way to both cores,
    see CpuSplit). One packing is held, never both (the RAM of the weight)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.nbytes = weight.numel() * 2
        self.threaded = weight.numel() >= THREADED_ELEMENTS and _has_threaded_fp16()
        self.bias = (torch.zeros(self.out_features) if bias is None else bias.float()).contiguous()
        if self.threaded:
            ops = torch.ops.quantized
            self.packed = ops.linear_prepack_fp16(weight.float().contiguous(), self.bias)
            self._threaded_linear = ops.linear_dynamic_fp16.default
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.packed = torch.fbgemm_pack_gemm_matrix_fp16(weight.float().contiguous())
            self(torch.zeros(1, self.in_features, dtype=weight.dtype))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.f32(x.reshape(-1, self.in_features).float())
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def f32(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [T, K] float32 -> [T, N] float32, nothing converted: for callers that chain
        products in float32 (the CPU experts: a decode step's ~400 dtype copies, ~1/5 of it)."""
        if self.threaded:
            return self._threaded_linear(rows, self.packed)
        return torch.fbgemm_linear_fp16_weight(rows, self.packed, self.bias)


def _has_threaded_fp16() -> bool:
    try:
        return hasattr(torch.ops.quantized, "linear_prepack_fp16")
    except (AttributeError, RuntimeError):     # a build without the quantized ops
        return False


class Fp16Bank:
    """A bank of 16-bit experts [E, N, K], each packed for the fp16-weight GEMM (Fp16Weight),
    for experts only the CPU computes where the native kernel is not built (no C compiler:
    cpu_native.NativeBank is 1.3-2x faster): the same 2 bytes a weight as the bank it replaces.
    One MoE layer (64 experts, top-8, D 1024, I 256, fresh routing per call) against
    fused_moe's bf16 CPU forms: 2.0x at 1 token, 1.7x at 8 and 16, 1.44x at 64.
    split: the CPU engine's CpuSplit (cpu_split.py), which runs half of a prefill chunk's
    experts on the second core (None: one thread computes them); a bank whose experts take
    the threaded entry point keeps none (its products are on every core already)."""

    def __init__(self, w: torch.Tensor, split: CpuSplit | None = None):
        self._pack(w.shape, w.dtype, lambda e: w[e], split)

    @classmethod
    def decoded(cls, shape: tuple[int, int, int], dtype: torch.dtype,
                decode: Callable[[int], torch.Tensor],
                split: CpuSplit | None = None) -> Fp16Bank | None:
        """A bank [E, N, K] from each expert's weight decoded from a quantized format
        (decode(e) -> [N, K] float32, one expert at a time: never the bank in float32), for
        a bank in a format torch's CPU has no GEMM for (fp8, the 4-bit float formats); None
        where an expert is beyond float16's range. dtype: the model's compute dtype."""
        bank = cls.__new__(cls)
        return bank if bank._pack(shape, dtype, decode, split, check=True) else None

    def _pack(self, shape, dtype, weight, split, check: bool = False) -> bool:
        self.experts, self.n, self.k = shape
        self.dtype = dtype
        self.nbytes = self.experts * self.n * self.k * 2
        failed = []

        def pack(e: int) -> Fp16Weight | None:
            if failed:                          # one expert out of range: the bank is refused
                return None
            w = weight(e)
            if check and not packable(w, decoded=True):
                failed.append(e)
                return None
            return Fp16Weight(w)
        # FBGEMM's packer is one thread a matrix (~4 ns a weight with the float32 copy it
        # takes; a model's experts at load): experts packed on torch's thread count at once.
        with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
            self.mats = list(pool.map(pack, range(self.experts)))
        # Experts of the threaded entry point use every core already: never split.
        self.threaded = any(m is not None and m.threaded for m in self.mats)
        self.split = None if self.threaded else split
        return all(m is not None for m in self.mats)

    # The experts run in float32 end to end (fused_moe.moe_packed_banks): x widened once a
    # layer, the products, activation and weighted sum in float32, rounded once.
    float32 = True

    def linear(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """x [T, K] float32 @ W[expert]^T -> [T, N] float32."""
        return self.mats[expert].f32(x)


def packable(weight: torch.Tensor, decoded: bool = False) -> bool:
    """A 16-bit CPU weight (decoded: one in any float dtype, decoded from a quantized format)
    inside float16's range, on a torch that has the GEMM."""
    if not (weight.device.type == "cpu" and (decoded or weight.dtype in _NARROW)
            and weight.numel() > 0
            and packs_fp16() and hasattr(torch, "fbgemm_linear_fp16_weight")):
        return False
    low, high = torch.aminmax(weight)           # no |w| copy (a bank's experts: 12x faster)
    return bool((low >= -FP16_MAX) & (high <= FP16_MAX))        # nan: False


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           wide: bool | None = None) -> torch.Tensor:
    """F.linear(x [.., K], weight [N, K], bias) in x's dtype; wide: widen (None: decide by
    x's rows, see widens)."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if not (widens(rows) if wide is None else wide):
        return F.linear(x, weight, bias)
    xf = rows.float()
    n, k = weight.shape
    step = max(1, TILE_ELEMENTS // k)
    buf = torch.empty(min(step, n), k)
    parts = []
    for r in range(0, n, step):
        w = buf[:min(step, n - r)].copy_(weight[r:r + step])
        parts.append(F.linear(xf, w, None if bias is None else bias[r:r + step].float()))
    y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)
