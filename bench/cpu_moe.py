#!/usr/bin/env python3
"""One MoE layer on the CPU: bf16 experts (and the forms of experts only the CPU computes: the
native kernel's, cpu_native.NativeBank (on an AMX CPU its prefill chunks on cpu_amx.c, and
"bf16 onednn", the torch path it replaced: oneDNN's products an expert at a time), and the
fp16-weight GEMM's, cpu_matmul.Fp16Bank, alone and with the CPU engine's CpuSplit) against
each quantized format's CPU decode (triton_kernels/dequant_cpu.py), the packed forms of
experts only the CPU computes (INT4's for the int4 GEMM, int4_cpu.py, and its nibbles on the
native kernel, NativeInt4Bank; FP8 blocks' bytes on the native kernel, NativeFp8Bank,
"bytes"; the others decoded once to 16 bits, NativeBank.decoded, and Fp16Bank.decoded without
the native kernel) and the float32 reference, in one run.

    python bench/cpu_moe.py                  # 64 experts, top-8, D 1024, I 256 (bench/cpu.py's)
    python bench/cpu_moe.py --tokens 1,8,64 --formats fp8_block,int4
    python bench/cpu_moe.py --formats int4_g32 --tokens 1 --layers 12 --skip-reference
                                             # a decode step's weights from DRAM, not the L3

Random weights quantized by the project's own quantizer; per format and token count the
median of --reps calls (routing redrawn each call), in ms, and the ratio to bf16 in the same
run (the machine is shared: compare ratios, not milliseconds across runs).
"""

from __future__ import annotations

import argparse
import itertools
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # this checkout's freetoken

FORMATS = {"fp8_block": dict(kind="fp8_block"), "fp8_channel": dict(kind="fp8_channel"),
           "mxfp4": dict(kind="mxfp4"), "nvfp4": dict(kind="nvfp4"),
           "int4": dict(kind="int4", group=128, symmetric=False),
           "int4_g32": dict(kind="int4", group=32, symmetric=True)}


def bank(fmt, experts: int, n: int, k: int, g: torch.Generator) -> dict:
    from freetoken.models.quant.quantize import quantize_weight
    parts = [quantize_weight(fmt, torch.randn(n, k, generator=g) * k ** -0.5,
                             scale_dtype=torch.bfloat16) for _ in range(experts)]
    return {name: torch.stack([p[name] for p in parts]) for name in parts[0]}


def median_ms(fn, x, experts: int, top_k: int, reps: int, g) -> float:
    times = []
    for _ in range(reps + 1):
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(len(x))])
        weights = torch.rand(len(x), top_k, generator=g).softmax(-1)
        t0 = time.perf_counter()
        fn(x, weights, ids.int())
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def build_arms(args, g: torch.Generator) -> dict:
    """Every arm's banks for one layer, random from g: name -> fn(x, weights, ids)."""
    import triton_kernels as tk
    from triton_kernels.dequant import QuantFormat, fused_moe_quant_reference
    from triton_kernels.dequant_cpu import fused_moe_quant_cpu
    from triton_kernels.fused_moe import fused_moe_reference

    e, d, i = args.experts, args.hidden, args.width
    w13 = (torch.randn(e, 2 * i, d, generator=g) * d ** -0.5).bfloat16()
    w2 = (torch.randn(e, d, i, generator=g) * i ** -0.5).bfloat16()
    arms = {"bf16": lambda x, w, ids: fused_moe_reference(x, w13, w2, w, ids)}
    split = tk.CpuSplit()           # the CPU engine's: calls of ~1 GFLOP and more on two cores
    native = tk.native_kernels()        # None without a C compiler
    if native is not None:          # CPU-only experts' form where the kernel builds
        n13, n2 = tk.NativeBank(w13, native), tk.NativeBank(w2, native)
        arms["bf16 native"] = lambda x, w, ids: fused_moe_reference(x, n13, n2, w, ids)
        if tk.has_amx_bf16():       # its prefill chunks' fallback: oneDNN an expert at a time
            from triton_kernels.fused_moe import SILU, _moe_grouped_torch
            arms["bf16 onednn"] = lambda x, w, ids: _moe_grouped_torch(
                x, w13, w2, w, ids.long(), None, None, None, SILU)
    if tk.packable(w13) and tk.packable(w2):         # CPU-only experts' form (FBGEMM fp16)
        f13, f2 = tk.Fp16Bank(w13), tk.Fp16Bank(w2)
        arms["bf16 packed"] = lambda x, w, ids: fused_moe_reference(x, f13, f2, w, ids)
        s13, s2 = tk.Fp16Bank(w13, split), tk.Fp16Bank(w2, split)
        arms["bf16 packed split"] = lambda x, w, ids: fused_moe_reference(x, s13, s2, w, ids)
    for name in [f for f in args.formats.split(",") if f]:
        fmt = QuantFormat(**FORMATS[name])
        q13, q2 = bank(fmt, e, 2 * i, d, g), bank(fmt, e, d, i, g)
        arms[f"{name} cpu"] = (lambda x, w, ids, fmt=fmt, q13=q13, q2=q2:
                               fused_moe_quant_cpu(x, fmt, q13, q2, w, ids))
        if tk.packable_int4(fmt, q13, torch.bfloat16) and tk.packable_int4(fmt, q2, torch.bfloat16):
            p13, p2 = tk.Int4Packed(fmt, q13), tk.Int4Packed(fmt, q2)   # CPU-only experts' form
            arms[f"{name} packed"] = (lambda x, w, ids, fmt=fmt, p13=p13, p2=p2:
                                      fused_moe_quant_cpu(x, fmt, p13, p2, w, ids))
            if native is not None:      # the nibbles as they are (the CPU engine's experts)
                n13, n2 = (tk.NativeInt4Bank(q["q"], q["s"], q.get("z"), fmt.group, native)
                           for q in (q13, q2))
                arms[f"{name} native"] = (lambda x, w, ids, fmt=fmt, n13=n13, n2=n2:
                                          fused_moe_quant_cpu(x, fmt, n13, n2, w, ids))
        else:       # the 16-bit CPU engine's forms where RAM holds 2 bytes a weight
            if fmt.kind == "fp8_block" and native is not None:   # and its bytes as they are
                b13, b2 = (tk.NativeFp8Bank(q["q"], q["s"], fmt.block, native) for q in (q13, q2))
                arms[f"{name} bytes"] = (lambda x, w, ids, fmt=fmt, b13=b13, b2=b2:
                                         fused_moe_quant_cpu(x, fmt, b13, b2, w, ids))
            if native is not None:
                m13, m2 = (tk.NativeBank.decoded((e, n, kk), lambda j, q=q: (
                               tk.dequantize_reference(fmt, {t: v[j] for t, v in q.items()},
                                                       torch.float32)), native)
                           for q, n, kk in ((q13, 2 * i, d), (q2, d, i)))
                if m13.dtype == m2.dtype:
                    arms[f"{name} native"] = (lambda x, w, ids, fmt=fmt, m13=m13, m2=m2:
                                              fused_moe_quant_cpu(x, fmt, m13, m2, w, ids))
            d13, d2 = (tk.Fp16Bank.decoded((e, n, kk), torch.bfloat16, lambda j, q=q: (
                           tk.dequantize_reference(fmt, {t: v[j] for t, v in q.items()},
                                                   torch.float32)), split)
                       for q, n, kk in ((q13, 2 * i, d), (q2, d, i)))
            if d13 is not None and d2 is not None:
                arms[f"{name} decoded"] = (lambda x, w, ids, fmt=fmt, d13=d13, d2=d2:
                                           fused_moe_quant_cpu(x, fmt, d13, d2, w, ids))
        if not args.skip_reference:
            arms[f"{name} reference"] = (lambda x, w, ids, fmt=fmt, q13=q13, q2=q2:
                                         fused_moe_quant_reference(x, fmt, q13, q2, w, ids))
    return arms


def _in_turn(fns: list):
    """One call of fns after another, round and round (each call its own layer's banks)."""
    turn = itertools.cycle(fns)
    return lambda x, w, ids: next(turn)(x, w, ids)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--width", type=int, default=256, help="the expert's intermediate size I")
    p.add_argument("--tokens", default="1,8,64")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--skip-reference", action="store_true", help="the float32 reference is slow")
    p.add_argument("--arms", help="comma-separated arm names to time (default: all), e.g. "
                   "'bf16 native,bf16 packed'; the first one timed is the ratios' base")
    p.add_argument("--layers", type=int, default=1, help="copies of every arm's banks, "
                   "called in turn as a model's layers are: with enough of them (12 for the "
                   "default shape's int4) a call reads its weights from DRAM, not the L3")
    args = p.parse_args(argv)
    if args.layers < 1:
        p.error("--layers must be at least 1")
    torch.set_num_threads(args.threads)

    g = torch.Generator().manual_seed(0)
    e, d, i = args.experts, args.hidden, args.width
    # Each layer's arms (those --arms keeps: the others' banks freed as each layer is built).
    # One bench layer's bf16 bank is ~100 MB, its int4 one ~25 MB: an L3 of 32 MB holds the
    # latter between calls, where a model's decode step reads each layer's once from DRAM.
    layers, keep = [], args.arms.split(",") if args.arms else None
    for _ in range(args.layers):
        built = build_arms(args, g)
        if keep and set(keep) - set(built):
            p.error(f"unknown arms {sorted(set(keep) - set(built))}; built here: {sorted(built)}")
        layers.append({name: built[name] for name in keep or built})
    arms = {name: _in_turn([layer[name] for layer in layers]) for name in layers[0]}
    tokens = [int(t) for t in args.tokens.split(",")]
    # One OpenMP runtime is torch's and the native kernels' both (cpu_native._openmp_runtime);
    # two would spin against each other.
    print("OpenMP runtimes in this process:", sorted({
        line.split()[-1] for line in open("/proc/self/maps")
        if re.search(r"/lib(gomp|iomp5|omp)\b", line)}) or "none")
    from triton_kernels.cpu_native import native_kernels
    native = native_kernels()
    if native is not None:
        print(f"native kernels: {native.forms()}")
    print(f"one MoE layer: {e} experts, top-{args.top_k}, D {d}, I {i}, {args.threads} threads, "
          f"{args.layers} layer{'s' if args.layers > 1 else ''} of banks called in turn; ms "
          f"(median of {args.reps}) and x bf16")
    print("arm".ljust(22) + "".join(f"T={t}".ljust(20) for t in tokens))
    base = {}
    for name, fn in arms.items():
        cells = []
        for t in tokens:
            x = torch.randn(t, d, generator=g).bfloat16()
            ms = median_ms(fn, x, e, args.top_k, args.reps, g)
            base.setdefault(t, ms)
            cells.append(f"{ms:.2f} ({ms / base[t]:.2f}x)")
        print(name.ljust(22) + "".join(c.ljust(20) for c in cells), flush=True)
    if 1 in tokens:     # batch 1 streams top_k experts' weights once: bf16's bytes / time
        print(f"bf16 bytes of one token's experts: {args.top_k * 3 * d * i * 2 / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
