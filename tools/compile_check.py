#!/usr/bin/env python3
"""Compile every Triton kernel form for real GPUs, without one: does each compile, and fit?

    python tools/compile_check.py                 # sm_90 (H100/H200) and sm_80 (A100), bf16
    python tools/compile_check.py --arch 90 --dtype fp16

The interpreter (tests/test_kernels.py) checks what the kernels compute; only a real compile
rejects what the interpreter lets through: tl.dot shapes, shared memory and register budgets,
constructs the compiler does not accept. Triton's bundled ptxas builds each cubin for the
target, so no GPU or driver is needed. A form is a kernel with the constexprs and launch
config a launcher really uses: every autotune candidate of the fused MoE kernels and the fixed
config the GPU tests use, at Qwen3-30B-A3B's shapes and at gpt-oss-20b's (biases, swiglu_oai);
attention at Qwen3's heads, gpt-oss's (window 128 and full, sinks) and DeepSeek-V3's prefill
(Dk 192, Dv 128); MLA attention over the latent at DeepSeek-V3's heads (L 512, R 64);
biased_topk at DeepSeek-V3's groups and plain 32/128/512-expert routers;
Gated DeltaNet (recurrent and chunked, fp32 state pool) and its causal conv1d at
Qwen3.6-35B-A3B's linear-attention heads; the other kernels at Qwen3-30B-A3B's shapes. Exit
status 1 when
a form fails to compile or needs more shared memory than the SM has.
Run without TRITON_INTERPRET (under it, @triton.jit builds interpreter functions).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Shared memory a block may use, per architecture (bytes).
SHARED_LIMIT = {80: 166912, 90: 232448}
POINTER = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
D, I, E, K = 2048, 768, 128, 8        # Qwen3-30B-A3B: hidden, expert width, experts, top-k
HQ, HK, HEAD = 32, 4, 128             # query heads, KV heads, head dim
# gpt-oss-20b: hidden 2880, 32 experts of width 2880, top-4 (biases, swiglu_oai); 64 query
# heads over 8 KV heads of 64, window 128 on the sliding layers, attention sinks.
OSS_MOE = dict(d=2880, inter=2880, experts=32, top_k=4, bias=True, activation="swiglu_oai")
OSS_HQ, OSS_HK, OSS_HEAD, OSS_WINDOW = 64, 8, 64, 128
# DeepSeek-V3 prefill attention: 128 heads, K 192 wide (nope 128 + rope 64), V 128.
DS_HQ, DS_DK, DS_DV = 128, 192, 128
# MLA's absorbed attention over the latent (kv_lora_rank 512, qk_rope_head_dim 64), DeepSeek-V3
# (and Kimi-K2) at 128 heads.
MLA_L, MLA_R = 512, 64
# Qwen3.6-35B-A3B's Gated DeltaNet layers: 16 key heads, 32 value heads, both 128 wide, conv
# kernel 4 over q, k and v's channels (2 * 16 * 128 + 32 * 128).
GDN_HK, GDN_HV, GDN_D, GDN_W = 16, 32, 128, 4
GDN_CONV = 2 * GDN_HK * GDN_D + GDN_HV * GDN_D


def compile_form(fn, args: dict, num_warps: int, num_stages: int, arch: int) -> int:
    """Compile fn for sm_<arch> with these arguments (a pointer as its type string, e.g.
    "*bf16"; ints and floats as values; constexprs as values) -> shared memory bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    target = GPUTarget("cuda", arch, 32)
    backend = triton.compiler.make_backend(target)
    no_spec = {fn.arg_names[i] if isinstance(i, int) else i
               for i in (getattr(fn, "do_not_specialize", None) or [])}
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        name, value = param.name, args[param.name]
        if param.is_constexpr:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, str):
            signature[name] = value
            attrs[(i,)] = [["tt.divisibility", 16]]          # torch allocations are aligned
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif name not in no_spec and value == 1:            # triton specializes 1 as a constant
            signature[name], constexprs[name] = "constexpr", 1
        else:
            signature[name] = "i32" if abs(value) < 2**31 else "i64"
            if name not in no_spec and value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = backend.parse_options({"num_warps": num_warps, "num_stages": num_stages})
    return triton.compile(source, target=target, options=options.__dict__).metadata.shared


def moe_forms(p: str, d=D, inter=I, experts=E, top_k=K, bias=False, activation="silu"):
    """(label, kernel, args, num_warps, num_stages) for the fused MoE kernels at one model's
    shapes and expert epilogue (biases, activation)."""
    fm = importlib.import_module("triton_kernels.fused_moe")   # the package's `fused_moe` is the op
    tag = f"{'bias ' if bias else ''}{activation} D{d} I{inter}"
    act = dict(alpha=1.702, limit=7.0, ACTIVATION=activation)
    gemm = dict(sorted_ids_ptr="*i32", block_slot_ptr="*i32", num_padded_ptr="*i32", num_pairs=1000,
                M_BUCKET=64, GROUP_M=8, DOT_PRECISION=None, HAS_BIAS=bias)
    gemm1 = dict(gemm, **act, x_ptr=p, w13_ptr=p, b13_ptr=p, act_ptr=p, N=inter, K=d, stride_xt=d,
                 stride_ws=2 * inter * d, stride_wn=d, stride_bs=2 * inter, stride_at=inter,
                 TOP_K=top_k)
    gemm2 = dict(gemm, act_ptr=p, w2_ptr=p, b2_ptr=p, out_ptr=p, topk_w_ptr="*fp32", N=d, K=inter,
                 stride_at=inter, stride_ws=inter * d, stride_wn=inter, stride_bs=d, stride_ot=d)
    gemv = dict(ids_ptr="*i64", slot_map_ptr="*i32", M_BUCKET=1, TOP_K=top_k, HAS_SLOT_MAP=True,
                HAS_BIAS=bias)
    gemv1 = dict(gemv, **act, x_ptr=p, w13_ptr=p, b13_ptr=p, act_ptr=p, N=inter, K=d, stride_xt=d,
                 stride_ws=2 * inter * d, stride_wn=d, stride_bs=2 * inter, stride_at=inter)
    gemv2 = dict(gemv, act_ptr=p, w2_ptr=p, b2_ptr=p, out_ptr=p, topk_w_ptr="*fp32", N=d, K=inter,
                 stride_at=inter, stride_ws=inter * d, stride_wn=inter, stride_bs=d, stride_ot=d)
    fixed = fm._FIXED_GPU_CONFIG
    fixed_kw = dict(BLOCK_N=fixed["BLOCK_N"], BLOCK_K=fixed["BLOCK_K"])
    # Decode runs BLOCK_M 16 tiles, prefill up to 64 (the most shared memory).
    for name, configs, block_ms in (("decode", fm._DECODE_CONFIGS, (16,)),
                                    ("prefill", fm._PREFILL_CONFIGS, (16, 64))):
        for c in configs:
            for bm in block_ms:
                tile = dict(c.kwargs, BLOCK_M=bm)
                label = f"{tag} {name} BM{bm} BN{c.kwargs['BLOCK_N']} BK{c.kwargs['BLOCK_K']}"
                yield f"gemm1 {label}", fm._moe_gemm1_kernel, dict(gemm1, **tile), c.num_warps, c.num_stages
                yield f"gemm2 {label}", fm._moe_gemm2_kernel, dict(gemm2, **tile), c.num_warps, c.num_stages
    for bm in (16, 64):
        yield (f"gemm1 {tag} fixed BM{bm}", fm._moe_gemm1_kernel, dict(gemm1, BLOCK_M=bm, **fixed_kw),
               fixed["num_warps"], fixed["num_stages"])
        yield (f"gemm2 {tag} fixed BM{bm}", fm._moe_gemm2_kernel, dict(gemm2, BLOCK_M=bm, **fixed_kw),
               fixed["num_warps"], fixed["num_stages"])
    for c in list(fm._GEMV_CONFIGS) + [None]:
        kw, warps, stages = ((fixed_kw, fixed["num_warps"], fixed["num_stages"]) if c is None
                             else (c.kwargs, c.num_warps, c.num_stages))
        label = "fixed" if c is None else f"BN{kw['BLOCK_N']} BK{kw['BLOCK_K']}"
        yield f"gemv1 {tag} {label}", fm._moe_gemv1_kernel, dict(gemv1, **kw), warps, stages
        yield f"gemv2 {tag} {label}", fm._moe_gemv2_kernel, dict(gemv2, **kw), warps, stages
    yield (f"moe_sum D{d}", fm._moe_sum_kernel,
           dict(pairs_ptr=p, out_ptr=p, D=d, stride_pt=d, stride_ot=d, TOP_K=top_k,
                BLOCK_D=min(triton_next_pow2(d), 1024)), 4, 3)


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def align_forms():
    ma = importlib.import_module("triton_kernels.moe_align")
    chunk = ma._ALIGN_CHUNK
    yield ("moe_count", ma._moe_count_kernel,
           dict(ids_ptr="*i64", chunk_counts_ptr="*i32", num_pairs=999, BLOCK_E=E, CHUNK=chunk), 4, 3)
    for bm in (16, 64):
        yield (f"moe_offsets BM{bm}", ma._moe_offsets_kernel,
               dict(chunk_counts_ptr="*i32", chunk_base_ptr="*i32", expert_start_ptr="*i32",
                    sorted_ids_ptr="*i32", block_slot_ptr="*i32", num_padded_ptr="*i32",
                    slot_map_ptr="*i32", num_pairs=999, num_chunks=8, max_blocks=100, HAS_SLOT_MAP=True,
                    BLOCK_M=bm, BLOCK_E=E, BLOCK_C=32, BLOCK_B=32), 4, 3)
    yield ("moe_scatter", ma._moe_scatter_kernel,
           dict(ids_ptr="*i64", chunk_base_ptr="*i32", expert_start_ptr="*i32", sorted_ids_ptr="*i32",
                num_pairs=999, BLOCK_E=E, CHUNK=chunk), 4, 3)


def attention_forms(p: str, hq=HQ, hk=HK, dk=HEAD, dv=HEAD, window=None, sinks=False,
                    label="qwen3"):
    """The prefill, decode (one split and split-KV) and reduce kernels at one model's heads;
    window None compiles the full-causal call (the kernels get _NO_WINDOW)."""
    pa = importlib.import_module("triton_kernels.paged_attention")
    pa.interpreting = lambda: False          # the GPU's tiles, even if this env says otherwise
    strides = dict(stride_qt=hq * dk, stride_qh=dk, stride_ot=hq * dv, stride_oh=dv,
                   stride_bt=77, stride_kb=16 * hk * dk, stride_ks=hk * dk, stride_kh=dk,
                   stride_vb=16 * hk * dv, stride_vs=hk * dv, stride_vh=dv, BS=16)
    ptrs = dict(q_ptr=p, k_cache_ptr=p, v_cache_ptr=p, bt_ptr="*i32", cu_q_ptr="*i32",
                seq_lens_ptr="*i32", out_ptr=p, sinks_ptr="*fp32")
    d_pad, dv_pad = triton_next_pow2(max(16, dk)), triton_next_pow2(max(16, dv))
    dims = dict(HEAD_DIM=dk, D_PAD=d_pad, HEAD_DIM_V=dv, DV_PAD=dv_pad, HAS_SINKS=sinks,
                window=pa._NO_WINDOW if window is None else window, qk_scale=0.1)
    tag = f"{label} Hq{hq} Hk{hk} Dk{dk} Dv{dv}" + (f" window{window}" if window else "") + (
        " sinks" if sinks else "")
    g = hq // hk
    g_pad = triton_next_pow2(g)
    cfg = pa._attention_config(max(d_pad, dv_pad), decode=False)
    block_q = max(1, cfg.pop("BLOCK_M") // g_pad)
    yield (f"prefill attention {tag}", pa._paged_prefill_kernel,
           dict(ptrs, **strides, **dims, G=g, G_PAD=g_pad, BLOCK_Q=block_q,
                BLOCK_N=cfg["BLOCK_N"], DOT_PRECISION=None),
           cfg["num_warps"], cfg["num_stages"])
    cfg = pa._attention_config(max(d_pad, dv_pad), decode=True)
    for split in (False, True):
        yield (f"decode attention split={split} {tag}", pa._paged_decode_kernel,
               dict(ptrs, **strides, **dims, part_o_ptr="*fp32" if split else p,
                    part_lse_ptr="*fp32" if split else p, num_splits=4, split_tokens=256, Hq=hq,
                    G=g, G_PAD=max(16, g_pad), BLOCK_N=cfg["BLOCK_N"], SPLIT=split,
                    DOT_PRECISION=None),
               cfg["num_warps"], cfg["num_stages"])
    yield (f"decode attention reduce {tag}", pa._paged_decode_reduce_kernel,
           dict(part_o_ptr="*fp32", part_lse_ptr="*fp32", cu_q_ptr="*i32", out_ptr=p,
                sinks_ptr="*fp32", num_splits=4, stride_ot=hq * dv, stride_oh=dv, Hq=hq,
                HEAD_DIM_V=dv, DV_PAD=dv_pad, BLOCK_S=16, HAS_SINKS=sinks), 4, 3)


def mla_forms(p: str, h=DS_HQ, label="deepseek-v3"):
    """MLA attention at the real latent dims (L 512, R 64) and DeepSeek-V3's 128 heads: every
    autotune candidate and the fixed GPU config of the decode (one split and split-KV) and
    prefill kernels, the reduce at L 512, and write_latent. GLM-4.7-Flash's 20 heads take the
    same tiles (decode 32 heads a program, prefill 64 rows as 2 tokens x 32 heads: the same
    shared memory to the KiB when last compiled), so they are left out to keep CI short."""
    ma = importlib.import_module("triton_kernels.mla_attention")
    ma.interpreting = lambda: False          # the GPU's tiles, even if this env says otherwise
    d = MLA_L + MLA_R
    common = dict(q_ptr=p, cache_ptr=p, bt_ptr="*i32", cu_q_ptr="*i32", seq_lens_ptr="*i32",
                  out_ptr=p, qk_scale=0.1, stride_qt=h * d, stride_qh=d, stride_ot=h * MLA_L,
                  stride_oh=MLA_L, stride_bt=77, stride_cb=16 * d, stride_cs=d, BS=16, H=h,
                  L=MLA_L, L_PAD=MLA_L, R=MLA_R, R_PAD=MLA_R, DOT_PRECISION=None)
    tag = f"{label} H{h} L{MLA_L} R{MLA_R}"
    block_h, _ = ma.mla_block_heads(h, decode=True)
    for c in list(ma._DECODE_CONFIGS) + [None]:
        kw = (dict(ma._FIXED_GPU_CONFIG[True]) if c is None
              else dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages))
        warps, stages = kw.pop("num_warps"), kw.pop("num_stages")
        for split in (False, True):
            yield (f"mla decode split={split} {tag} BH{block_h} BN{kw['BLOCK_N']}"
                   f"{' fixed' if c is None else ''}", ma._mla_decode_kernel,
                   dict(common, **kw, part_o_ptr="*fp32" if split else p,
                        part_lse_ptr="*fp32" if split else p, num_splits=4, split_tokens=256,
                        BLOCK_H=block_h, SPLIT=split), warps, stages)
    block_h, block_q = ma.mla_block_heads(h, decode=False)
    for c in list(ma._PREFILL_CONFIGS) + [None]:
        kw = (dict(ma._FIXED_GPU_CONFIG[False]) if c is None
              else dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages))
        warps, stages = kw.pop("num_warps"), kw.pop("num_stages")
        yield (f"mla prefill {tag} BH{block_h} BQ{block_q} BN{kw['BLOCK_N']}"
               f"{' fixed' if c is None else ''}", ma._mla_prefill_kernel,
               dict(common, **kw, BLOCK_H=block_h, BLOCK_Q=block_q), warps, stages)
    pa = importlib.import_module("triton_kernels.paged_attention")
    yield (f"mla decode reduce {tag}", pa._paged_decode_reduce_kernel,
           dict(part_o_ptr="*fp32", part_lse_ptr="*fp32", cu_q_ptr="*i32", out_ptr=p,
                sinks_ptr=p, num_splits=4, stride_ot=h * MLA_L, stride_oh=MLA_L, Hq=h,
                HEAD_DIM_V=MLA_L, DV_PAD=MLA_L, BLOCK_S=16, HAS_SINKS=False), 4, 3)
    yield (f"write_latent D{d}", ma._write_latent_kernel,
           dict(latent_ptr=p, cache_ptr=p, slot_ptr="*i64", stride_lt=d, stride_cb=16 * d,
                stride_cs=d, BS=16, D=d, BLOCK_D=triton_next_pow2(d)), 4, 3)


def routing_forms():
    """biased_topk as its launcher calls it: DeepSeek-V3 (256 experts, 8 groups keep 4, top-8,
    sigmoid + bias, scaled), a 128-expert softmax router (top-8) and Qwen3-Next's 512 (top-10),
    gpt-oss's 32 experts (softmax, top-4)."""
    rt = importlib.import_module("triton_kernels.routing")
    for e, k, n_group, topk_group, softmax, bias in ((256, 8, 8, 4, False, True),
                                                       (128, 8, 1, 1, True, False),
                                                       (512, 10, 1, 1, True, False),
                                                       (32, 4, 1, 1, True, False)):
        g_pad, s_pad = triton_next_pow2(n_group), triton_next_pow2(e // n_group)
        yield (f"biased_topk E{e} k{k} groups{n_group}/{topk_group} "
               f"{'softmax' if softmax else 'sigmoid'}{' bias' if bias else ''}",
               rt._biased_topk_kernel,
               dict(logits_ptr="*fp32", bias_ptr="*fp32", w_ptr="*fp32", ids_ptr="*i64", T=100,
                    stride_lt=e, stride_le=1, scale=2.5, E=e, K=k, SOFTMAX=softmax,
                    HAS_BIAS=bias, GROUP_SIZE=e // n_group, N_GROUP=n_group,
                    TOPK_GROUP=topk_group, RENORMALIZE=True,
                    BLOCK_T=max(1, min(16, 2048 // (g_pad * s_pad))), G_PAD=g_pad, S_PAD=s_pad,
                    BLOCK_K=triton_next_pow2(k)), 4, 3)


def gated_delta_forms(p: str):
    """Both gated_delta_rule kernels as the launcher configures them for 16-bit inputs, and
    the two conv1d kernels."""
    gd = importlib.import_module("triton_kernels.gated_delta")
    cv = importlib.import_module("triton_kernels.causal_conv1d")
    gd.interpreting = cv.interpreting = lambda: False     # the GPU's tiles
    hk, hv, d = GDN_HK, GDN_HV, GDN_D
    args = dict(q_ptr=p, k_ptr=p, v_ptr=p, g_ptr="*fp32", beta_ptr=p, o_ptr=p,
                state_ptr="*fp32", slots_ptr="*i32", cu_ptr="*i32", has_init_ptr="*i1",
                scale=0.088, stride_qt=3 * hk * d, stride_qh=d, stride_kt=3 * hk * d,
                stride_kh=d, stride_vt=3 * hk * d, stride_vh=d, stride_gt=hv, stride_bt=hv,
                stride_ot=hv * d, stride_oh=d, stride_ss=hv * d * d, stride_sh=d * d,
                stride_sk=d, G=hv // hk, DK=d, DV=d, BK=d)
    tag = f"Hk{hk} Hv{hv} D{d}"
    for chunked in (False, True):
        cfg = gd._gated_delta_config(d, d, chunked)
        warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
        if not chunked:
            yield (f"gated_delta recurrent {tag} BV{cfg['BV']}", gd._gated_delta_recurrent_kernel,
                   dict(args, **cfg, L2NORM=True), warps, stages)
            continue
        # Qwen3-Next's layers always l2norm q and k (the form without compiles the same dots)
        yield (f"gated_delta chunk{gd.CHUNK} {tag} BV{cfg['BV']} l2norm=True",
               gd._gated_delta_chunk_kernel,
               dict(args, **cfg, C=gd.CHUNK, SUB=gd._SUB, L2NORM=True, DOT_PRECISION="tf32",
                    INV_PRECISION="tf32x3"), warps, stages)
    cfg = cv._conv_config()
    for bias, silu in ((False, True), (True, False)):
        yield (f"causal_conv1d C{GDN_CONV} W{GDN_W} bias={bias} silu={silu}",
               cv._causal_conv1d_kernel,
               dict(x_ptr=p, w_ptr=p, bias_ptr=p, state_ptr=p, y_ptr=p, seq_idx_ptr="*i64",
                    cu_ptr="*i32", slots_ptr="*i32", has_init_ptr="*i1", T=1000, C=GDN_CONV,
                    stride_xt=GDN_CONV, stride_yt=GDN_CONV, stride_wc=GDN_W,
                    stride_ss=GDN_CONV * (GDN_W - 1), stride_sc=GDN_W - 1, W=GDN_W,
                    HAS_BIAS=bias, SILU=silu, BLOCK_T=cfg["BLOCK_T"], BLOCK_C=cfg["BLOCK_C"]),
               cfg["num_warps"], 3)
    yield (f"conv_state_update C{GDN_CONV} W{GDN_W}", cv._conv_state_update_kernel,
           dict(x_ptr=p, state_ptr=p, cu_ptr="*i32", slots_ptr="*i32", has_init_ptr="*i1",
                C=GDN_CONV, stride_xt=GDN_CONV, stride_ss=GDN_CONV * (GDN_W - 1),
                stride_sc=GDN_W - 1, W=GDN_W, E_PAD=triton_next_pow2(GDN_W - 1),
                BLOCK_C=cfg["BLOCK_C"]), cfg["num_warps"], 3)


def small_forms(p: str):
    kv, rn, rp, sm, ts = (importlib.import_module(f"triton_kernels.{m}") for m in
                          ("kv_write", "rms_norm", "rope", "silu_mul", "topk_softmax"))
    kv_stride = dict(stride_kc_b=16 * HK * HEAD, stride_kc_s=HK * HEAD, stride_kc_h=HEAD,
                     stride_vc_b=16 * HK * HEAD, stride_vc_s=HK * HEAD, stride_vc_h=HEAD)
    yield ("write_kv", kv._write_kv_kernel,
           dict(k_ptr=p, v_ptr=p, k_cache_ptr=p, v_cache_ptr=p, slot_ptr="*i64", stride_kt=HK * HEAD,
                stride_kh=HEAD, stride_vt=HK * HEAD, stride_vh=HEAD, **kv_stride, Hk=HK, D=HEAD, BS=16,
                BLOCK_H=HK, BLOCK_D=HEAD), 4, 3)
    for residual in (False, True):
        yield (f"rms_norm residual={residual}", rn._rms_norm_kernel,
               dict(x_ptr=p, res_ptr=p, w_ptr=p, out_ptr=p, res_out_ptr=p, stride_xt=D, stride_rt=D,
                    stride_ot=D, stride_rot=D, D=D, eps=1e-6, HAS_RESIDUAL=residual, BLOCK_D=D), 4, 3)
    for interleaved in (False, True):        # NeoX halves, or ERNIE's interleaved pairs
        yield (f"rope interleaved={interleaved}", rp._rope_kernel,
               dict(q_ptr=p, k_ptr=p, pos_ptr="*i64", cos_sin_ptr="*fp32", stride_qt=HQ * HEAD,
                    stride_qh=HEAD, stride_kt=HK * HEAD, stride_kh=HEAD, stride_cs=HEAD, Hq=HQ,
                    Hk=HK, HALF=HEAD // 2, BLOCK_H=HQ, BLOCK_R=HEAD // 2,
                    INTERLEAVED=interleaved), 4, 3)
    yield ("silu_and_mul", sm._silu_and_mul_kernel,
           dict(x_ptr=p, out_ptr=p, stride_xt=2 * 6144, stride_ot=6144, I=6144, BLOCK=1024), 4, 3)
    yield ("topk_softmax", ts._topk_softmax_kernel,
           dict(logits_ptr=p, w_ptr="*fp32", ids_ptr="*i64", T=100, E=E, stride_lt=E, stride_le=1, K=K,
                RENORMALIZE=True, BLOCK_T=16, BLOCK_E=E, BLOCK_K=K), 4, 3)


QUANT_KINDS = ("fp8_block", "fp8_channel", "fp8_tensor", "mxfp4", "nvfp4", "int4")


def quant_forms(p: str, d=D, inter=I, top_k=K, every_config=False):
    """quant_linear (GEMV, GEMM) and fused_moe_quant (GEMV, grouped) for every format at
    Qwen3-30B-A3B's expert shapes. By default (CI time) each format compiles the GEMVs' fixed
    config, the linear GEMM's first decode tile and GEMM1's largest prefill tile (the most shared
    memory); the second MoE kernels (one weight tile, same decode) only for int4, which compiles
    asymmetric with bfloat16 scales (the most code). every_config: each autotune config."""
    fm = importlib.import_module("triton_kernels.fused_moe")
    qm = importlib.import_module("triton_kernels.quant_matmul")
    qo = importlib.import_module("triton_kernels.quant_moe")
    fixed = fm._FIXED_GPU_CONFIG
    fixed_c = [(dict(BLOCK_N=fixed["BLOCK_N"], BLOCK_K=fixed["BLOCK_K"]), fixed["num_warps"],
                fixed["num_stages"])]
    gemv_c = [(c.kwargs, c.num_warps, c.num_stages) for c in fm._GEMV_CONFIGS] + fixed_c
    gemm_c = ([(dict(c.kwargs, BLOCK_M=16), c.num_warps, c.num_stages) for c in fm._DECODE_CONFIGS]
              + [(dict(c.kwargs, BLOCK_M=64), c.num_warps, c.num_stages)
                 for c in fm._PREFILL_CONFIGS]
              + [(dict(fixed_c[0][0], BLOCK_M=64),) + fixed_c[0][1:]])
    if not every_config:
        gemv_c, gemm_c = fixed_c, [(dict(c.kwargs, BLOCK_M=bm), c.num_warps, c.num_stages)
                                   for bm, c in ((16, fm._DECODE_CONFIGS[0]),
                                                 (64, fm._PREFILL_CONFIGS[-1]))]
    for kind in QUANT_KINDS:
        group = {"fp8_block": 128, "mxfp4": 32, "nvfp4": 16, "int4": 128}.get(kind, 1)
        packed = kind in ("mxfp4", "nvfp4", "int4")
        fmt = dict(KIND=kind, SCALE_ROWS=128, GROUP_K=group, HAS_ZERO=kind == "int4",
                   SCALE_BF16=kind == "int4", q_ptr="*u8", s_ptr="*i16" if kind == "int4" else
                   ("*u8" if kind in ("mxfp4", "nvfp4") else "*fp32"), z_ptr="*u8", g_ptr="*fp32")
        qstride = lambda k: k // 2 if packed else k                      # noqa: E731
        sstride = lambda k: k // group if group > 1 else 0               # noqa: E731
        lin = dict(fmt, x_ptr=p, b_ptr=p, out_ptr=p, M_BUCKET=1, N=d, K=d, stride_xt=d,
                   stride_qn=qstride(d), stride_sn=sstride(d), stride_ot=d, HAS_BIAS=True)
        second = every_config or kind == "int4"
        for kw, w, s in gemv_c:
            yield (f"quant gemv {kind} BN{kw['BLOCK_N']} BK{kw['BLOCK_K']}", qm._quant_gemv_kernel,
                   dict(lin, **kw), w, s)
        for kw, w, s in gemm_c[:1] if not every_config else gemm_c:
            yield (f"quant gemm {kind} BM{kw['BLOCK_M']} BN{kw['BLOCK_N']} BK{kw['BLOCK_K']}",
                   qm._quant_linear_kernel, dict(lin, **kw, T=1000, GROUP_M=8,
                                                 DOT_PRECISION=None), w, s)
        act = dict(alpha=1.702, limit=7.0, ACTIVATION="silu")
        w13 = dict(stride_qs=2 * inter * qstride(d), stride_qn=qstride(d),
                   stride_ss=2 * inter * max(1, sstride(d)), stride_sn=sstride(d), stride_gs=1)
        w2 = dict(stride_qs=d * qstride(inter), stride_qn=qstride(inter),
                  stride_ss=d * max(1, sstride(inter)), stride_sn=sstride(inter), stride_gs=1)
        gemv = dict(fmt, ids_ptr="*i64", slot_map_ptr="*i32", M_BUCKET=1, TOP_K=top_k,
                    HAS_SLOT_MAP=True, HAS_BIAS=True)
        gemv1 = dict(gemv, **act, **w13, x_ptr=p, b13_ptr=p, act_ptr=p, N=inter, K=d,
                     stride_xt=d, stride_bs=2 * inter, stride_at=inter)
        gemv2 = dict(gemv, **w2, act_ptr=p, b2_ptr=p, out_ptr=p, topk_w_ptr="*fp32", N=d,
                     K=inter, stride_at=inter, stride_bs=d, stride_ot=d)
        for kw, w, s in gemv_c:
            label = f"{kind} BN{kw['BLOCK_N']} BK{kw['BLOCK_K']}"
            yield f"qmoe gemv1 {label}", qo._qmoe_gemv1_kernel, dict(gemv1, **kw), w, s
            if second:
                yield f"qmoe gemv2 {label}", qo._qmoe_gemv2_kernel, dict(gemv2, **kw), w, s
        gemm = dict(fmt, sorted_ids_ptr="*i32", block_slot_ptr="*i32", num_padded_ptr="*i32",
                    num_pairs=1000, M_BUCKET=64, GROUP_M=8, DOT_PRECISION=None, HAS_BIAS=True)
        gemm1 = dict(gemm, **act, **w13, x_ptr=p, b13_ptr=p, act_ptr=p, N=inter, K=d,
                     stride_xt=d, stride_bs=2 * inter, stride_at=inter, TOP_K=top_k)
        gemm2 = dict(gemm, **w2, act_ptr=p, b2_ptr=p, out_ptr=p, topk_w_ptr="*fp32", N=d,
                     K=inter, stride_at=inter, stride_bs=d, stride_ot=d)
        for kw, w, s in gemm_c[1:] if not every_config else gemm_c:
            label = f"{kind} BM{kw['BLOCK_M']} BN{kw['BLOCK_N']} BK{kw['BLOCK_K']}"
            yield f"qmoe gemm1 {label}", qo._qmoe_gemm1_kernel, dict(gemm1, **kw), w, s
            if second:
                yield f"qmoe gemm2 {label}", qo._qmoe_gemm2_kernel, dict(gemm2, **kw), w, s


def forms(dtype: str, every_quant_config=False):
    p = POINTER[dtype]
    yield from moe_forms(p)
    yield from moe_forms(p, **OSS_MOE)
    yield from align_forms()
    yield from attention_forms(p)
    for window in (None, OSS_WINDOW):        # gpt-oss alternates full and sliding layers
        yield from attention_forms(p, OSS_HQ, OSS_HK, OSS_HEAD, OSS_HEAD, window, True, "gpt-oss")
    yield from attention_forms(p, DS_HQ, DS_HQ, DS_DK, DS_DV, label="deepseek-v3")
    yield from mla_forms(p)
    yield from small_forms(p)
    yield from routing_forms()
    yield from quant_forms(p, every_config=every_quant_config)
    yield from gated_delta_forms(p)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, action="append", choices=sorted(SHARED_LIMIT),
                    help="compute capability x10 (default: 90 and 80)")
    ap.add_argument("--dtype", choices=sorted(POINTER), default="bf16")
    ap.add_argument("--every-quant-config", action="store_true",
                    help="compile the quantized kernels in each autotune config (slow)")
    ap.add_argument("--only", help="compile only the forms whose label contains this")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile_check: unset TRITON_INTERPRET (under it @triton.jit builds interpreter "
              "functions, which cannot be compiled)", file=sys.stderr)
        return 2
    failed = 0
    for arch in args.arch or [90, 80]:
        for label, fn, kernel_args, warps, stages in forms(args.dtype, args.every_quant_config):
            if args.only and args.only not in label:
                continue
            try:
                shared = compile_form(fn, kernel_args, warps, stages, arch)
            except Exception as e:          # noqa: BLE001 - a failed compile is the finding
                failed += 1
                lines = str(e).strip().splitlines() or [type(e).__name__]
                print(f"FAIL sm_{arch} {args.dtype} {label} (w{warps} s{stages}): {lines[-1][:300]}")
                continue
            over = shared > SHARED_LIMIT[arch]
            failed += over
            print(f"{'OVER' if over else 'ok  '} sm_{arch} {args.dtype} {label} (w{warps} s{stages}): "
                  f"{shared / 1024:.0f} KiB shared")
    print(f"{failed} form(s) failed" if failed else "every form compiled and fits")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
