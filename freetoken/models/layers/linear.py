"""The model's projections: Linear (nn.Linear through triton_kernels.linear) and QuantLinear.

Linear is nn.Linear (same parameters, same checkpoint names) whose forward is tk.linear:
F.linear, except on the CPU where a 16-bit weight is widened for products of many rows
(triton_kernels/cpu_matmul.py: a prefill chunk's projections run 6x faster on AVX2), or, in a
model the runner packed for the CPU (pack_for_cpu), its fp16-packed copy.

QuantLinear: a projection whose weight stays in its checkpoint's quantized format.

It replaces an nn.Linear of the same name (q_proj, down_proj, ...) when the checkpoint stores
that module quantized; its parameters are the canonical tensors of triton_kernels.dequant
(`q`, `s`, and `z` or `g` where the format has them, shapes in freetoken.moe.quant_layout)
and `bias` in the compute dtype. The forward is quant_linear, which dequantizes in registers
on the GPU and per call in the torch reference: the dense weight is never materialized,
except in a model the runner packed for the CPU (pack_cpu: an INT4 GEMM copy, or the decoded
weight in fp16 for the formats torch's CPU has no GEMM for).
"""

from __future__ import annotations

import torch
from torch import nn

import triton_kernels as tk
from freetoken.models.layers.norm import RMSNorm
from freetoken.models.layers.router import Router
from freetoken.moe.quant_layout import weight_tensors
from triton_kernels.dequant import QuantFormat


class Linear(nn.Linear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.packed: tk.CpuLinear | None = None

    def cpu_dense(self) -> torch.Tensor | None:
        """The 16-bit weight a CPU engine's product takes (None: not one)."""
        return self.weight if self.weight.dtype in (torch.bfloat16, torch.float16) else None

    def pack_cpu(self) -> int:
        """Multiply through the CPU engine's product for the weight (cpu_linear.py: the native
        GEMV for a few rows, AMX or FBGEMM's GEMM for more; the weight stays: tied embeddings
        and MLA's folded kv_b_proj read it). Returns the bytes it added."""
        if (dense := self.cpu_dense()) is None:
            return 0
        self.packed = tk.cpu_linear(dense, self.bias)
        return 0 if self.packed is None else self.packed.nbytes

    def pack_cpu_int8(self, chunk_rows: int = 4096) -> int:
        """pack_cpu for a weight read as int8 (an opt-in output layer: EngineConfig's
        lm_head_dtype): the 16-bit weight rounded to nearest in steps of its row's max |w| /
        127, that float32 scale applied to the row's sums. The native GEMV reads those bytes
        for decode rows, 1 a weight instead of 2, and every other product their decode (a
        16-bit copy of q * s: the same weight at every row count, to the copy's rounding).
        Lossy, so opt-in (e4m3 at the same bytes and speed moved the bench model's logits 3x
        as far: 2.7% against 0.8%). Quantized a chunk of rows at a time (DeepSeek-V3's head
        is 0.9 G weights; FBGEMM's packing of the copy still widens it whole, as it does any
        16-bit weight's). Returns the bytes added (the rows, their scales, the copy: a byte a
        weight more than a 16-bit head's FBGEMM packing, three on AMX, where a 16-bit head
        has none; the module's weight stays, tied embeddings read it). Raises where this CPU has no native GEMV or the model is not 16-bit."""
        w = self.cpu_dense()
        if w is None or tk.native_kernels() is None:
            raise ValueError("an int8 output layer needs a 16-bit model and the native CPU "
                             "kernels (a C compiler)")
        n, k = w.shape
        # the copy: bf16 where AMX's GEMM takes a bf16 model's rows, else float16 (11 bits
        # of q * s, within the row's own range: float16's where the model's was)
        amx = tk.has_amx_bf16() and w.dtype == torch.bfloat16
        q = torch.empty(n, k, dtype=torch.int8)
        s = torch.empty(n, dtype=torch.float32)
        copy = torch.empty(n, k, dtype=torch.bfloat16 if amx else torch.float16)
        for r0 in range(0, n, chunk_rows):
            part = w[r0:r0 + chunk_rows].float()
            sp = (part.abs().amax(1) / 127).clamp(min=1e-12)
            qp = (part / sp[:, None]).round_().clamp_(-127, 127).to(torch.int8)
            q[r0:r0 + chunk_rows], s[r0:r0 + chunk_rows] = qp, sp
            copy[r0:r0 + chunk_rows] = qp.float() * sp[:, None]
        self.packed = tk.cpu_linear(copy, self.bias, own_weight=True,
                                    quant=tk.QuantRows(q, s, (1, 0), own=True))
        if self.packed is None or self.packed.quant is None:
            raise ValueError("an int8 output layer: no GEMM takes its decoded copy (beyond "
                             "float16's range without AMX-BF16, or a torch without FBGEMM)")
        return self.packed.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        return tk.linear(x, self.weight, self.bias)


def pack_for_cpu(model: nn.Module, keep: tuple[nn.Module, ...] = ()) -> int:
    """A model that runs on the CPU in 16 bits: every Linear and MoE router multiplies
    through triton_kernels.CpuLinear (the native GEMV below 8 rows, 2-2.5x torch's bf16
    product at one row; AMX's bf16 GEMM or FBGEMM's fp16 one from there), every QuantLinear
    through a copy the CPU multiplies fast, every RMSNorm's decode rows natively (pack_cpu).
    - A module that runs several projections of one input as one product (Attention: q, k
      and v) names them in `cpu_fused` and packs them together in its own pack_cpu (see
      pack_fused); where it does, they are not packed alone.
    - Projections a module names in its `matrix_only` (read as matrices, never called: MLA's
      kv_b_proj) are left as they are.
    - A module with native calls to bind and no projections to pack together (MLA's prefill
      attention) binds them in its `bind_cpu`.
    - Modules in `keep` were packed by the caller (an int8 lm_head: pack_cpu_int8).
    Returns the bytes added."""
    skip = {id(getattr(m, name)) for m in model.modules() for name in getattr(m, "matrix_only", ())}
    skip |= {id(m) for m in keep}
    added = 0
    for m in model.modules():
        if hasattr(m, "bind_cpu"):
            m.bind_cpu()
    for m in model.modules():
        if getattr(m, "cpu_fused", ()) and (n := m.pack_cpu()):
            added += n
            skip |= {id(getattr(m, name)) for name in m.cpu_fused}
    return added + sum(m.pack_cpu() for m in model.modules()
                       if isinstance(m, (Linear, QuantLinear, Router, RMSNorm))
                       and id(m) not in skip)


def pack_fused(projs) -> tk.CpuLinear | tk.Int4Linear | None:
    """Projections of one input ([N_i, K] each) as one product [sum N_i, K] (one GEMV and one
    call instead of one each; the outputs are its column slices), or None where one of them
    has no 16-bit form or the biases differ in kind. The weights are concatenated in their
    dtype where they share one (2 bytes a weight more), else in float32 for a float16 copy;
    INT4 ones the int4 GEMM takes, as one int4 GEMM (their nibbles concatenated, as many
    bytes again)."""
    biases = [p.bias for p in projs]
    if len({b is None for b in biases}) != 1:
        return None
    bias = None if biases[0] is None else torch.cat([b.float() for b in biases])
    if all(isinstance(p, QuantLinear) and p.int4_gemm() for p in projs):
        # INT4 in one format: one int4 GEMM on the concatenated weights
        if len({p.fmt for p in projs}) != 1:
            return None
        w = {name: torch.cat([p.weight_dict()[name] for p in projs]) for name in projs[0].names}
        return tk.Int4Linear(projs[0].fmt, w, None if bias is None else bias.to(projs[0].dtype),
                             rows=_fused_rows(projs))
    dense = [p.cpu_dense() for p in projs]
    if any(d is None for d in dense):
        return None
    dtypes = {d.dtype for d in dense}
    fused = torch.cat([d if len(dtypes) == 1 else d.float() for d in dense])
    first = projs[0]                            # the model's compute dtype
    model_dtype = first.dtype if isinstance(first, QuantLinear) else first.weight.dtype
    return tk.cpu_linear(fused, bias, own_weight=True, dtype=model_dtype,
                         quant=_fused_rows(projs))


def _fused_rows(projs) -> tk.QuantRows | None:
    """The projections' quantized bytes as one weight (and their scales as one), where all
    have them in one block shape and each but the last ends on a whole row block; else None
    (the fused product reads its 16-bit copy)."""
    parts = [p.cpu_rows() if isinstance(p, QuantLinear) else None for p in projs]
    if any(f is None for f in parts) or len({f.block for f in parts}) != 1:
        return None
    bn = parts[0].block[0]
    if any(f.q.shape[0] % bn for f in parts[:-1]):
        return None
    # (int4 members in both scale forms, e.g. two config groups: pairs for all)
    scales = tk.int4_alike([f.s for f in parts])
    return tk.QuantRows(torch.cat([f.q for f in parts]), torch.cat(scales), parts[0].block,
                        own=True)


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, fmt: QuantFormat, bias: bool,
                 dtype: torch.dtype, scale_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.dtype = dtype                      # the compute dtype (x's, the bias's)
        self.names = tuple(p.name for p in weight_tensors(fmt, out_features, in_features, scale_dtype))
        for p in weight_tensors(fmt, out_features, in_features, scale_dtype):
            self.register_parameter(p.name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                                         requires_grad=False))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

        self.packed: tk.Int4Linear | tk.CpuLinear | None = None

    def pack_cpu(self) -> int:
        """A quantized weight on the CPU, in 16 bits: keep a copy the CPU multiplies fast (the
        checkpoint's tensors stay for dequantized()).
        - INT4 (bf16): an Int4Linear (triton_kernels/int4_cpu.py) on the checkpoint's
          nibbles (cpu_rows: a symmetric weight's bf16 scales as they are, else float32 group
          pairs, a quarter of a byte a weight at G 32): on AVX2 the native GEMV at every row
          count, no copy; elsewhere a copy packed for torch's CPU int4 GEMM, as many bytes,
          and on an AMX CPU a prefill chunk's rows decoded to bf16 for AMX's product.
        - The rest (fp8, mxfp4, nvfp4, INT4 the int4 GEMM cannot take), which torch has no CPU
          GEMM for: decoded once into a 2-byte copy for the CPU's products (cpu_linear: bf16
          for the native GEMV and AMX's GEMM in a bf16 model on an AMX CPU, else fp16 for the
          fp16-weight GEMM), instead of decoded at every call
          (dequant_cpu.py: 3-8x a bf16 product; an fp8 CPU engine's decode steps ran at 0.28x
          the bf16 model's). float16 keeps 11 bits of a decoded value from 2^-14 up (bf16's
          reference 8; below, an absolute 2^-25 at most); a weight beyond float16's range
          stays unpacked.
        fp8 (block or tensor scales) and the int4 the GEMM cannot take keep the checkpoint's
        bytes for the native GEMV of decode rows beside the copy (cpu_rows). Returns the
        copy's bytes."""
        w = self.weight_dict()
        if self.int4_gemm():
            # (the rows kept only where AMX's product or the native GEMV reads them)
            self.packed = tk.Int4Linear(self.fmt, w, self.bias, rows=self.cpu_rows())
            return self.packed.nbytes
        if (dense := self.cpu_dense()) is None:
            return 0
        self.packed = tk.cpu_linear(dense, self.bias, dtype=self.dtype, quant=self.cpu_rows())
        return 0 if self.packed is None else self.packed.nbytes

    def int4_gemm(self) -> bool:
        """Whether the CPU multiplies this weight through torch's int4 GEMM (Int4Linear)."""
        return tk.packable_int4(self.fmt, self.weight_dict(), self.dtype)

    def cpu_rows(self) -> tk.QuantRows | None:
        """The checkpoint's bytes as the native GEMV reads them (decode rows: 1 byte a weight
        for fp8, half for int4, instead of a copy's 2), where it can: in a 16-bit model,
        with the native kernels built, fp8 with block scales, or channel or tensor ones
        (as row scales: block (1, 0)), and int4 in groups of a power of two from 32
        (cpu_native.int4_scales: a symmetric
        weight's bf16 scales as they are, else float32 (scale, -zero * scale) pairs)."""
        if tk.native_kernels() is None or self.dtype == torch.float32:
            return None
        q, g = self.q.detach(), self.fmt.group
        if self.fmt.kind in ("fp8_tensor", "fp8_channel"):
            # a scale a row, applied to its sums (a tensor's repeated: projections fuse)
            return tk.QuantRows(q, self.s.float().expand(q.shape[0]).contiguous(), (1, 0))
        if self.fmt.kind == "fp8_block":
            return tk.QuantRows(q, self.s.float().contiguous(), self.fmt.block)
        if (self.fmt.kind == "int4" and g >= 32 and g & (g - 1) == 0
                and self.in_features % g == 0):
            z = getattr(self, "z", None)
            return tk.QuantRows(q, tk.int4_scales(self.s, z), (1, g))
        return None

    def cpu_dense(self) -> torch.Tensor | None:
        """The decoded weight in float32 a CPU engine's product takes (cpu_linear decides its
        copy), None where it takes none: INT4 for the int4 GEMM, a float32 model (it keeps
        the reference's exact decode)."""
        w = self.weight_dict()
        if self.dtype == torch.float32 or tk.packable_int4(self.fmt, w, self.dtype):
            return None
        return tk.dequantize_reference(self.fmt, w, torch.float32)

    def weight_dict(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.names}

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in `dtype`: for the few callers that need the matrix itself
        (MLA folds kv_b_proj into its query and output), once, not per forward."""
        return tk.dequantize_reference(self.fmt, self.weight_dict(), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:                     # CpuLinear or Int4Linear: bias inside
            return self.packed(x)
        shape = x.shape
        y = tk.quant_linear(x.reshape(-1, shape[-1]), self.fmt, self.weight_dict(), self.bias)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.fmt.kind}"
