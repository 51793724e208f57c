#!/usr/bin/env python3
"""Sampling cost per step against the full-vocabulary sort it replaced, in the same run.

    python bench/sampler.py [--device cuda] [--vocab 151936]

For each filter setting and batch size: ms per sample() call (filters on candidates, inverse
CDF draw) and ms for the reference (filtered_probs_reference: sort the whole vocabulary,
then draw), and their ratio. Runs on CPU (the demo's path) and on a GPU.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from freetoken.engine.sampler import SampleRow, _pick, filtered_probs_reference, sample
from freetoken.engine.sampling_params import SamplingParams

SETTINGS = {"top_k=20 top_p=0.8": dict(top_k=20, top_p=0.8), "top_p=0.95": dict(top_p=0.95),
            "min_p=0.05": dict(min_p=0.05), "temperature only": {}}


def timed(fn, device, reps: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--vocab", type=int, default=151936)       # Qwen3's
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    print(f"{'setting':<20} {'rows':>4} {'sample ms':>10} {'sort ms':>9} {'speedup':>8}")
    for name, kw in SETTINGS.items():
        for n in args.batches:
            # Logits scaled like a real model's: a peaked head and a long flat tail.
            logits = torch.randn(n, args.vocab, device=device) * 4
            rows = [SampleRow(SamplingParams(temperature=0.7, **kw), None) for _ in range(n)]
            ours = timed(lambda: sample(logits, rows), device, args.reps)
            ref = timed(lambda: _pick(filtered_probs_reference(logits / 0.7, rows), rows).tolist(),
                        device, args.reps)
            print(f"{name:<20} {n:>4} {ours:>10.2f} {ref:>9.2f} {ref / ours:>7.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
