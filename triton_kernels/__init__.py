"""FreeToken's kernel layer: one file per hot op, each a Triton kernel beside its torch reference.

Every public op dispatches on its input: CUDA tensors with Triton available run the Triton
kernel, anything else runs the torch reference (which is also the correctness oracle).
This package knows nothing of requests, models or the server: it imports torch and triton only.
Ops: rms_norm, apply_rope, silu_and_mul, topk_softmax and biased_topk (routing), fused_moe (with
expert biases and a MoeActivation: SILU or gpt-oss's SWIGLU_OAI), write_kv, paged_attention
(sliding window, attention sinks, V head dim != K head dim); Gated DeltaNet's gated_delta_rule
and causal_conv1d (varlen, their states in slot pools); mla_attention and write_latent
(absorbed multi-head latent attention over a paged latent cache); quant_linear and fused_moe_quant on
quantized weights (QuantFormat: FP8 block/channel/tensor, MXFP4, NVFP4, INT4), dequantized in
registers.
"""

from triton_kernels._dispatch import (check_backend, fixed_configs_scope, get_backend,
                                      kernel_backend)
from triton_kernels.rms_norm import rms_norm, rms_norm_reference
from triton_kernels.rope import apply_rope, apply_rope_reference
from triton_kernels.silu_mul import silu_and_mul, silu_and_mul_reference
from triton_kernels.topk_softmax import topk_softmax, topk_softmax_reference
from triton_kernels.routing import biased_topk, biased_topk_reference
from triton_kernels.fused_moe import (FUSED_MOE_TOKEN_BUCKETS, SILU, SWIGLU_OAI, MoeActivation,
                                      fused_moe, fused_moe_autotune_keys, fused_moe_reference)
from triton_kernels.kv_write import write_kv, write_kv_reference
from triton_kernels.paged_attention import paged_attention, paged_attention_reference
from triton_kernels.gated_delta import gated_delta_rule, gated_delta_rule_reference
from triton_kernels.causal_conv1d import causal_conv1d, causal_conv1d_reference
from triton_kernels.mla_attention import (mla_attention, mla_attention_reference, write_latent,
                                          write_latent_reference)
from triton_kernels.dequant import (QuantFormat, dequantize_reference, fused_moe_quant,
                                    fused_moe_quant_reference, quant_linear,
                                    quant_linear_reference)
from triton_kernels.dequant_cpu import fused_moe_quant_cpu, quant_linear_cpu
from triton_kernels.cpu_matmul import Fp16Bank, Fp16Weight, linear, packable, packs_fp16
from triton_kernels.cpu_split import CpuSplit
from triton_kernels.cpu_native import (NativeBank, NativeFp8Bank, NativeInt4Bank, NativeKernels,
                                       bound_moe, has_amx_bf16, int4_alike, int4_group_pairs,
                                       int4_scales, native_kernels)
from triton_kernels.cpu_linear import CpuLinear, QuantRows, cpu_linear
from triton_kernels.cpu_prefill_attention import CpuPrefillAttention
from triton_kernels.cpu_attention import CpuDecodeAttention
from triton_kernels.cpu_gated_delta import CpuGatedDelta, GdnDecodeCall
from triton_kernels.cpu_mla import CpuMlaDecode
from triton_kernels.cpu_program import CpuProgram
from triton_kernels.int4_cpu import Int4Linear, Int4Packed, fused_moe_int4_cpu, packable_int4

__all__ = [
    "linear", "Fp16Weight", "Fp16Bank", "packable", "packs_fp16", "CpuSplit",
    "NativeBank", "NativeFp8Bank", "NativeInt4Bank", "NativeKernels", "native_kernels",
    "bound_moe", "has_amx_bf16", "int4_alike", "int4_group_pairs", "int4_scales", "CpuLinear",
    "QuantRows", "cpu_linear",
    "CpuDecodeAttention", "CpuPrefillAttention", "CpuGatedDelta", "GdnDecodeCall", "CpuMlaDecode", "CpuProgram",
    "kernel_backend", "check_backend", "get_backend", "fixed_configs_scope",
    "rms_norm", "rms_norm_reference",
    "apply_rope", "apply_rope_reference",
    "silu_and_mul", "silu_and_mul_reference",
    "topk_softmax", "topk_softmax_reference",
    "biased_topk", "biased_topk_reference",
    "fused_moe", "fused_moe_reference", "fused_moe_autotune_keys", "FUSED_MOE_TOKEN_BUCKETS",
    "MoeActivation", "SILU", "SWIGLU_OAI",
    "write_kv", "write_kv_reference",
    "paged_attention", "paged_attention_reference",
    "gated_delta_rule", "gated_delta_rule_reference",
    "causal_conv1d", "causal_conv1d_reference",
    "mla_attention", "mla_attention_reference", "write_latent", "write_latent_reference",
    "QuantFormat", "dequantize_reference", "quant_linear", "quant_linear_reference",
    "fused_moe_quant", "fused_moe_quant_reference", "fused_moe_quant_cpu", "quant_linear_cpu",
    "Int4Linear", "Int4Packed", "fused_moe_int4_cpu", "packable_int4",
]
