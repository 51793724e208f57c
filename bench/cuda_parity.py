#!/usr/bin/env python3
"""The whole model through the Triton kernels against the torch-reference path, per family.

    python bench/cuda_parity.py --device cuda --dtype bfloat16

Greedy tokens must match and logits agree within the dtype's tolerance. Builds tiny
checkpoints of every family on the spot. Exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch

import triton_kernels
from freetoken import LLM, SamplingParams
from freetoken.demo.tiny_model import make_tiny_model

TOL = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=list(TOL))
    p.add_argument("--families", nargs="+", default=["qwen3_moe", "qwen2_moe", "mixtral"])
    args = p.parse_args(argv)
    failures = 0
    prompts = [[(7 * i + j) % 1800 + 3 for j in range(n)] for i, n in enumerate((1, 7, 127, 300))]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for family in args.families:
        with tempfile.TemporaryDirectory() as d:
            make_tiny_model(d, family=family, seed=0, dtype=args.dtype)
            results = {}
            for backend in ("reference", "triton"):
                llm = LLM(d, device=args.device, dtype=args.dtype, kernel_backend=backend)
                logits = llm.logits(prompts[2])
                tokens = [o.token_ids for o in llm.generate(prompts, params)]
                results[backend] = (logits, tokens)
                del llm
                torch.cuda.empty_cache() if torch.cuda.is_available() else None
            ref, tri = results["reference"], results["triton"]
            err = ((ref[0] - tri[0]).abs().max() / ref[0].abs().max()).item()
            same = sum(a == b for a, b in zip(ref[1], tri[1]))
            ok = err < TOL[args.dtype] and same == len(prompts)
            failures += not ok
            print(f"{family:10s} {args.dtype}: logits rel err {err:.2e} (tol {TOL[args.dtype]:.0e}), "
                  f"greedy {same}/{len(prompts)} prompts identical -> {'OK' if ok else 'MISMATCH'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
