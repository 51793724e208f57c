#!/usr/bin/env python3
"""Compile every Triton kernel form for real GPUs, without one: does each compile, and fit?

    python tools/compile_check.py                 # sm_90 (H100/H200) and sm_80 (A100), bf16
    python tools/compile_check.py --arch 90 --dtype fp16

The interpreter (tests/test_kernels.py) checks what the kernels compute; only a real compile
rejects what the interpreter lets through: tl.dot shapes, shared memory and register budgets,
constructs the compiler does not accept. Triton's bundled ptxas builds each cubin for the
target, so no GPU or driver is needed. A form is a kernel with the constexprs and launch
config a launcher really uses: every autotune candidate of the fused MoE kernels, the fixed
config the GPU tests use, and each other kernel at Qwen3-30B-A3B's shapes. Exit status 1 when
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
D, I, E, K = 2048, 768, 128, 8        # hidden, expert width, experts, top-k
HQ, HK, HEAD = 32, 4, 128             # query heads, KV heads, head dim


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


def moe_forms(p: str):
    """(label, kernel, args, num_warps, num_stages) for the fused MoE kernels."""
    fm = importlib.import_module("triton_kernels.fused_moe")   # the package's `fused_moe` is the op
    gemm = dict(sorted_ids_ptr="*i32", block_slot_ptr="*i32", num_padded_ptr="*i32", num_pairs=1000,
                M_BUCKET=64, GROUP_M=8, DOT_PRECISION=None)
    gemm1 = dict(gemm, x_ptr=p, w13_ptr=p, act_ptr=p, N=I, K=D, stride_xt=D, stride_ws=2 * I * D,
                 stride_wn=D, stride_at=I, TOP_K=K)
    gemm2 = dict(gemm, act_ptr=p, w2_ptr=p, out_ptr=p, topk_w_ptr="*fp32", N=D, K=I, stride_at=I,
                 stride_ws=I * D, stride_wn=I, stride_ot=D)
    gemv = dict(ids_ptr="*i64", slot_map_ptr="*i32", M_BUCKET=1, TOP_K=K, HAS_SLOT_MAP=True)
    gemv1 = dict(gemv, x_ptr=p, w13_ptr=p, act_ptr=p, N=I, K=D, stride_xt=D, stride_ws=2 * I * D,
                 stride_wn=D, stride_at=I)
    gemv2 = dict(gemv, act_ptr=p, w2_ptr=p, out_ptr=p, topk_w_ptr="*fp32", N=D, K=I, stride_at=I,
                 stride_ws=I * D, stride_wn=I, stride_ot=D)
    fixed = fm._FIXED_GPU_CONFIG
    fixed_kw = dict(BLOCK_N=fixed["BLOCK_N"], BLOCK_K=fixed["BLOCK_K"])
    # Decode runs BLOCK_M 16 tiles, prefill up to 64 (the most shared memory).
    for name, configs, block_ms in (("decode", fm._DECODE_CONFIGS, (16,)),
                                    ("prefill", fm._PREFILL_CONFIGS, (16, 64))):
        for c in configs:
            for bm in block_ms:
                tile = dict(c.kwargs, BLOCK_M=bm)
                label = f"{name} BM{bm} BN{c.kwargs['BLOCK_N']} BK{c.kwargs['BLOCK_K']}"
                yield f"gemm1 {label}", fm._moe_gemm1_kernel, dict(gemm1, **tile), c.num_warps, c.num_stages
                yield f"gemm2 {label}", fm._moe_gemm2_kernel, dict(gemm2, **tile), c.num_warps, c.num_stages
    for bm in (16, 64):
        yield (f"gemm1 fixed BM{bm}", fm._moe_gemm1_kernel, dict(gemm1, BLOCK_M=bm, **fixed_kw),
               fixed["num_warps"], fixed["num_stages"])
        yield (f"gemm2 fixed BM{bm}", fm._moe_gemm2_kernel, dict(gemm2, BLOCK_M=bm, **fixed_kw),
               fixed["num_warps"], fixed["num_stages"])
    for c in list(fm._GEMV_CONFIGS) + [None]:
        kw, warps, stages = ((fixed_kw, fixed["num_warps"], fixed["num_stages"]) if c is None
                             else (c.kwargs, c.num_warps, c.num_stages))
        label = "fixed" if c is None else f"BN{kw['BLOCK_N']} BK{kw['BLOCK_K']}"
        yield f"gemv1 {label}", fm._moe_gemv1_kernel, dict(gemv1, **kw), warps, stages
        yield f"gemv2 {label}", fm._moe_gemv2_kernel, dict(gemv2, **kw), warps, stages
    yield ("moe_sum", fm._moe_sum_kernel,
           dict(pairs_ptr=p, out_ptr=p, D=D, stride_pt=D, stride_ot=D, TOP_K=K, BLOCK_D=1024), 4, 3)


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


def attention_forms(p: str):
    import triton
    pa = importlib.import_module("triton_kernels.paged_attention")
    pa.interpreting = lambda: False          # the GPU's tiles, even if this env says otherwise
    strides = dict(stride_qt=HQ * HEAD, stride_qh=HEAD, stride_ot=HQ * HEAD, stride_oh=HEAD,
                   stride_bt=77, stride_kb=16 * HK * HEAD, stride_ks=HK * HEAD, stride_kh=HEAD,
                   stride_vb=16 * HK * HEAD, stride_vs=HK * HEAD, stride_vh=HEAD, BS=16)
    ptrs = dict(q_ptr=p, k_cache_ptr=p, v_cache_ptr=p, bt_ptr="*i32", cu_q_ptr="*i32",
                seq_lens_ptr="*i32", out_ptr=p)
    g = HQ // HK
    g_pad = triton.next_power_of_2(g)
    cfg = pa._attention_config(HEAD, decode=False)
    block_q = max(1, cfg.pop("BLOCK_M") // g_pad)
    yield ("prefill attention", pa._paged_prefill_kernel,
           dict(ptrs, **strides, qk_scale=0.1, G=g, G_PAD=g_pad, BLOCK_Q=block_q,
                BLOCK_N=cfg["BLOCK_N"], HEAD_DIM=HEAD, D_PAD=HEAD, DOT_PRECISION=None),
           cfg["num_warps"], cfg["num_stages"])
    cfg = pa._attention_config(HEAD, decode=True)
    for split in (False, True):
        yield (f"decode attention split={split}", pa._paged_decode_kernel,
               dict(ptrs, **strides, part_o_ptr="*fp32" if split else p, part_lse_ptr="*fp32" if split else p,
                    qk_scale=0.1, num_splits=4, split_tokens=256, Hq=HQ, G=g, G_PAD=max(16, g_pad),
                    BLOCK_N=cfg["BLOCK_N"], HEAD_DIM=HEAD, D_PAD=HEAD, SPLIT=split, DOT_PRECISION=None),
               cfg["num_warps"], cfg["num_stages"])
    yield ("decode attention reduce", pa._paged_decode_reduce_kernel,
           dict(part_o_ptr="*fp32", part_lse_ptr="*fp32", cu_q_ptr="*i32", out_ptr=p, num_splits=4,
                stride_ot=HQ * HEAD, stride_oh=HEAD, Hq=HQ, HEAD_DIM=HEAD, D_PAD=HEAD, BLOCK_S=16), 4, 3)


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
    yield ("rope", rp._rope_kernel,
           dict(q_ptr=p, k_ptr=p, pos_ptr="*i64", cos_sin_ptr="*fp32", stride_qt=HQ * HEAD,
                stride_qh=HEAD, stride_kt=HK * HEAD, stride_kh=HEAD, stride_cs=HEAD, Hq=HQ, Hk=HK,
                HALF=HEAD // 2, BLOCK_H=HQ, BLOCK_R=HEAD // 2), 4, 3)
    yield ("silu_and_mul", sm._silu_and_mul_kernel,
           dict(x_ptr=p, out_ptr=p, stride_xt=2 * 6144, stride_ot=6144, I=6144, BLOCK=1024), 4, 3)
    yield ("topk_softmax", ts._topk_softmax_kernel,
           dict(logits_ptr=p, w_ptr="*fp32", ids_ptr="*i64", T=100, E=E, stride_lt=E, stride_le=1, K=K,
                RENORMALIZE=True, BLOCK_T=16, BLOCK_E=E, BLOCK_K=K), 4, 3)


def forms(dtype: str):
    p = POINTER[dtype]
    yield from moe_forms(p)
    yield from align_forms()
    yield from attention_forms(p)
    yield from small_forms(p)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, action="append", choices=sorted(SHARED_LIMIT),
                    help="compute capability x10 (default: 90 and 80)")
    ap.add_argument("--dtype", choices=sorted(POINTER), default="bf16")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile_check: unset TRITON_INTERPRET (under it @triton.jit builds interpreter "
              "functions, which cannot be compiled)", file=sys.stderr)
        return 2
    failed = 0
    for arch in args.arch or [90, 80]:
        for label, fn, kernel_args, warps, stages in forms(args.dtype):
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
