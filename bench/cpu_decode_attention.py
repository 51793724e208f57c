#!/usr/bin/env python3
"""A CPU engine's decode attention over the paged KV cache: the native step
(triton_kernels/cpu_attention.c, CpuDecodeAttention: q/k norm, RoPE, the K/V write and the
attention) against the torch path it replaced (paged_attention_reference's decode) and
against this machine's DRAM read ceiling, in one run.

    python bench/cpu_decode_attention.py                     # bench/cpu.py's model's shape
    python bench/cpu_decode_attention.py --shapes 32/4x128 --contexts 32768 --batches 1,8

Shapes are Hq/Hk x head dim; each case is `batch` sequences of `context` cached keys in a
shuffled cache of 16-token blocks (random bf16), decoding one token each. Per case the
median of --reps calls in ms each way, the speedup, and the native call's K/V read rate
(the keys' and values' bytes over its time) as a share of the DRAM read ceiling measured
here with the same threads (a context whose cache fits the L3 can pass 100%). The machine
is shared: compare ratios, not milliseconds across runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # this checkout's freetoken
from cpu_attention import median_ms  # noqa: E402 - bench/, the script's own folder


def case(hq: int, hk: int, d: int, batch: int, context: int, g: torch.Generator) -> dict:
    """`batch` sequences of `context` keys (the new one's slot the last) in shuffled blocks."""
    bs, per = 16, -(-context // 16)
    nb = batch * per + 1
    blocks = torch.randperm(nb, generator=g)[:batch * per].int().view(batch, per)
    slots = blocks[:, -1].long() * bs + (context - 1) % bs
    half = torch.arange(0, d, 2).double() / d
    ang = torch.arange(context).double()[:, None] / 10000 ** half[None]
    return dict(qkv=torch.randn(batch, (hq + 2 * hk) * d, generator=g).bfloat16(),
                k=torch.randn(nb, bs, hk, d, generator=g).bfloat16(),
                v=torch.randn(nb, bs, hk, d, generator=g).bfloat16(),
                cos_sin=torch.cat([ang.cos(), ang.sin()], dim=1).float(),
                positions=torch.full((batch,), context - 1), slots=slots, tables=blocks,
                lens=torch.full((batch,), context, dtype=torch.int32))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="16/4x64,32/4x128,64/8x64")
    p.add_argument("--contexts", default="1024,8192,32768")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import triton_kernels as tk
    from freetoken.moe.bandwidth import host_read_gbps
    from triton_kernels.paged_attention import paged_attention_reference

    kernel = tk.native_kernels()
    if kernel is None:
        print("no native kernels here (no C compiler?): nothing to compare")
        return 1
    dram = host_read_gbps(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"threads {args.threads}; DRAM read {dram:.1f} GB/s; ms (median of {args.reps}); "
          f"K/V: the native call's read rate / DRAM's")
    print(f"{'shape':>10} {'batch':>5} {'context':>7} {'torch ms':>9} {'native ms':>9} "
          f"{'speedup':>8} {'K/V GB/s':>9} {'of DRAM':>8}")
    for shape in args.shapes.split(","):
        heads, dim = shape.split("x")
        hq, hk = (int(h) for h in heads.split("/"))
        d = int(dim)
        step = tk.CpuDecodeAttention(kernel, (hq, hk, d), None, None, 1e-6, d ** -0.5, None,
                                     None, False)
        for batch in (int(b) for b in args.batches.split(",")):
            for context in (int(n) for n in args.contexts.split(",")):
                c = case(hq, hk, d, batch, context, g)
                native = lambda: step(c["qkv"], c["positions"], c["cos_sin"], c["k"], c["v"],
                                      c["slots"], c["tables"], c["lens"])
                q = c["qkv"][:, :hq * d].reshape(batch, hq, d)
                cu = torch.arange(batch + 1, dtype=torch.int32)
                reference = lambda: paged_attention_reference(q, c["k"], c["v"], c["tables"],
                                                              cu, c["lens"], d ** -0.5, 1)
                ms_native = median_ms(native, args.reps)
                ms_torch = median_ms(reference, max(3, args.reps // 3))
                gbs = 2 * batch * context * hk * d * 2 / ms_native / 1e6
                print(f"{shape:>10} {batch:>5} {context:>7} {ms_torch:>9.2f} {ms_native:>9.3f} "
                      f"{ms_torch / ms_native:>7.1f}x {gbs:>9.1f} {gbs / dram:>7.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
