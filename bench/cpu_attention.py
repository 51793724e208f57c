#!/usr/bin/env python3
"""A CPU engine's prefill attention over the paged KV cache: the native kernel
(triton_kernels/cpu_prefill_attention.py: on AMX tiles where the CPU has AMX-BF16, else in
vector registers) against the torch path it replaced (paged_attention_reference: torch's CPU
flash attention on the gathered keys), in one run.

    python bench/cpu_attention.py                      # bench/cpu.py's model and two others
    python bench/cpu_attention.py --shapes 32/4x128 --lengths 4096 --reps 5
    python bench/cpu_attention.py --kernel vector      # the vector kernel on an AMX CPU too

Shapes are Hq/Hk x head dim (a "w" suffix: gpt-oss's window of 128 and sinks); each length is
one sequence's prompt, in one chunk and as its last chunk of --chunk tokens over the cached
rest. Random bf16 q, keys and values in a shuffled cache of 16-token blocks. Per case the
median of --reps calls in ms, the causal products' GFLOP/s (4 Hq D flops a visible
query-key pair) and the native kernel's speedup over torch in the same run (the machine is
shared: compare ratios, not milliseconds across runs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # this checkout's freetoken


def step(hq: int, hk: int, d: int, length: int, new: int, g: torch.Generator) -> dict:
    """One sequence of `length` keys whose last `new` are this step's queries."""
    bs = 16
    blocks = -(-length // bs)
    k = torch.randn(blocks, bs, hk, d, generator=g).bfloat16()
    v = torch.randn(blocks, bs, hk, d, generator=g).bfloat16()
    return dict(q=torch.randn(new, hq, d, generator=g).bfloat16(), k=k, v=v,
                tables=torch.randperm(blocks, generator=g).int()[None],
                cu=torch.tensor([0, new], dtype=torch.int32),
                lens=torch.tensor([length], dtype=torch.int32))


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="16/4x64,32/4x128,64/8x64w",
                   help="Hq/Hk x head dim; 'w': a window of 128 and sinks (gpt-oss's)")
    p.add_argument("--lengths", default="512,2048,4096")
    p.add_argument("--chunk", type=int, default=512, help="the last chunk's tokens (0: none)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--kernel", choices=("auto", "amx", "vector"), default="auto",
                   help="auto: AMX where the CPU has AMX-BF16, else vector registers")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import triton_kernels as tk
    from triton_kernels.paged_attention import paged_attention_reference

    kernel = tk.native_kernels()
    if kernel is None:
        print("no native kernels here (no C compiler?): nothing to compare")
        return 1
    amx = {"auto": tk.has_amx_bf16(), "amx": True, "vector": False}[args.kernel]
    if amx and not tk.has_amx_bf16():
        print("no AMX-BF16 here: try --kernel vector")
        return 1
    name = "amx" if amx else "vector"
    g = torch.Generator().manual_seed(0)
    print(f"threads {args.threads}; ms (median of {args.reps}), GFLOP/s, {name} / torch")
    print(f"{'shape':>12} {'length':>7} {'new':>6} {'torch ms':>9} {name + ' ms':>9} "
          f"{'torch GF/s':>10} {name + ' GF/s':>11} {'speedup':>8}")
    for shape in args.shapes.split(","):
        heads, dim = shape.rstrip("w").split("x")
        hq, hk = (int(h) for h in heads.split("/"))
        d, windowed = int(dim), shape.endswith("w")
        window = 128 if windowed else None
        sinks = torch.randn(hq, generator=g) if windowed else None
        att = tk.CpuPrefillAttention(kernel, (hq, hk), d ** -0.5, window, sinks, amx=amx)
        for length in (int(n) for n in args.lengths.split(",")):
            for new in sorted({length, min(args.chunk, length)} - {0}, reverse=True):
                c = step(hq, hk, d, length, new, g)
                run = (c["q"], c["k"], c["v"], c["tables"], c["cu"], c["lens"])
                if att(*run) is None:
                    print(f"{shape:>12} {length:>7} {new:>6}  declined")
                    continue
                ms_native = median_ms(lambda: att(*run), args.reps)
                ms_torch = median_ms(lambda: paged_attention_reference(
                    *run[:6], d ** -0.5, sliding_window=window, sinks=sinks), args.reps)
                pos = torch.arange(length - new, length)           # each query's visible keys
                pairs = float((pos + 1).clamp(max=window or length).sum())
                flops = 4 * hq * d * pairs
                print(f"{shape:>12} {length:>7} {new:>6} {ms_torch:>9.2f} {ms_native:>9.2f} "
                      f"{flops / ms_torch / 1e6:>10.0f} {flops / ms_native / 1e6:>11.0f} "
                      f"{ms_torch / ms_native:>7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
