#!/usr/bin/env python3
"""Where a CPU engine's decode step goes: each op of the decode program (engine/cpu_graph.py)
timed inside real steps (CpuProgram.profile: the library's ft_run_timed), summed by kind over
the layers, against the whole step; the rest of the step is the host's (scheduler, sampler,
Python around the program).

    python bench/cpu_profile.py                           # bench/cpu.py's shape, bf16
    python bench/cpu_profile.py --quant fp8 --prompt 512  # its FP8 checkpoint, 512-token context
    python bench/cpu_profile.py --model DIR --batch 4

Per op kind: us a step, its share of the step, and for the products the GB/s their weights
streamed at (the op's weight bytes over its time; a MoE layer's at batch 1 only: its top_k
experts' bytes). The machine is shared: read shares and rates, not one run's milliseconds.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT))                      # this checkout's freetoken


def _bench_cpu():
    """bench/cpu.py as a module (its SHAPES), without bench/ on sys.path."""
    spec = importlib.util.spec_from_file_location("bench_cpu", _ROOT / "bench" / "cpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def profile(model_dir, dtype: str, batch: int, prompt: int, tokens: int) -> None:
    from freetoken import LLM, SamplingParams
    llm = LLM(str(model_dir), device="cpu", dtype=dtype, skip_tokenizer_init=True,
              max_model_len=prompt + tokens + 64, enable_prefix_caching=False)
    graph = llm.runner.cpu_graph
    if graph is None:
        sys.exit(f"no decode program on this model: {llm.runner.cpu_graph_off}")
    vocab = llm.runner.model_config.vocab_size
    prompts = [[(11 + 7 * i + 13 * j) % vocab for j in range(prompt)] for i in range(batch)]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, params)                   # warm
    engine, prog = llm.engine, graph.program
    reqs = [engine.add_request(ids, params) for ids in prompts]
    while engine.has_work and not all(r.output_token_ids for r in reqs):   # the prompts
        engine.step()
    prog.profile = np.zeros(len(prog.items))
    runs, steps = graph.runs, 0
    start = time.perf_counter()
    while engine.has_work:                          # the decode steps alone, timed
        engine.step()
        steps += 1
    wall = time.perf_counter() - start
    times, prog.profile = prog.profile, None
    if graph.runs - runs != steps:
        sys.exit(f"{steps - graph.runs + runs} of {steps} steps did not run the program "
                 f"(a batch above its rows?)")
    step_us = wall / steps * 1e6
    kinds = collections.defaultdict(float)
    for label, ns in zip(prog.labels, times):
        kinds[re.sub(r"^layer \d+'s ", "", label)] += ns / steps / 1e3
    weights = _weight_bytes(prog, batch)
    print(f"{model_dir} ({dtype}), batch {batch}, context {prompt}-{prompt + tokens}: "
          f"step {step_us:.0f} us ({steps} decode steps)")
    print(f"  {'op':34s} {'us/step':>8s} {'share':>6s} {'GB/s':>6s}")
    for kind, us in sorted(kinds.items(), key=lambda kv: -kv[1]):
        rate = f"{weights[kind] / us / 1e3:6.1f}" if weights.get(kind) else ""
        print(f"  {kind:34s} {us:8.0f} {us / step_us:6.1%} {rate:>6s}")
    program = sum(kinds.values())
    print(f"  {'host (the step less the program)':34s} {step_us - program:8.0f} "
          f"{(step_us - program) / step_us:6.1%}")


def _weight_bytes(prog, batch: int) -> dict[str, int]:
    """Bytes a step's products read, by op kind: each linear op's bound call's tensors
    (weight, scales, bias), and at batch 1 a MoE op's top_k of its bank's experts."""
    from triton_kernels.cpu_native import OP_LINEAR, OP_MOE
    out: dict[str, int] = collections.defaultdict(int)
    for item, label in zip(prog.items, prog.labels):
        kind = getattr(item, "kind", None)
        if kind not in (OP_LINEAR, OP_MOE) or (kind == OP_MOE and batch != 1):
            continue
        call, held = item.keep[0], []
        for v in vars(call).values():
            held += [v] if isinstance(v, torch.Tensor) else \
                [t for t in v if isinstance(t, torch.Tensor)] if isinstance(v, tuple) else []
        nbytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in held}.values())
        if kind == OP_MOE:                  # (ints[6]: top_k; the bank's slots on the call)
            nbytes = nbytes * item.ints[6] // call.slots
        out[re.sub(r"^layer \d+'s ", "", label)] += nbytes
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a checkpoint directory (default: bench/cpu.py's shape, made "
                   "here)")
    p.add_argument("--quant", default="", help="make_tiny_model --quant format of the made "
                   "checkpoint (fp8, int4, ...)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--quick", action="store_true", help="bench/cpu.py's quick shape")
    args = p.parse_args(argv)
    if args.model:
        profile(Path(args.model), args.dtype, args.batch, args.prompt, args.tokens)
        return 0
    from freetoken.demo.tiny_model import make_tiny_model
    shape = _bench_cpu().SHAPES["quick" if args.quick else "qwen3-moe-1.4g"]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        make_tiny_model(model_dir, family="qwen3_moe", seed=0, dtype=args.dtype, **shape)
        if args.quant:
            from freetoken.models.quant.encode import quantize_checkpoint
            quantize_checkpoint(model_dir, args.quant)
        profile(model_dir, args.dtype, args.batch, args.prompt, args.tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
