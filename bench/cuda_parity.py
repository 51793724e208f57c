#!/usr/bin/env python3
"""The whole model through the Triton kernels against the torch-reference path, per family.

    python bench/cuda_parity.py --device cuda --dtype bfloat16
    python bench/cuda_parity.py --where        # and each module's error on a mismatch

A router's top-k is a discontinuity: where two experts' scores nearly tie, rounding a 16-bit
kernel does differently from the reference (both right) sends a token to another expert, and
from there its hidden state, its logits and the greedy tokens after it part, by as much as a
wrong kernel would. (On the tiny random checkpoints, whose routers are near-uniform, one such
token in 127 moves the logits by 10-30%.) So the check runs the logits prompt through the
Triton path with every MoE layer given the reference run's routing (a forward pre-hook on
each ExpertBank, from outside the model), and that run's logits must agree within the dtype's
tolerance: a kernel's error is all that is left. Printed beside it: how many tokens the
Triton path's own routing sent elsewhere, and how many greedy generations are identical
(required in float32, where no tie should flip; informational in 16 bits).

With --where, a family that mismatches runs the prompt again with every module's output
recorded under both backends (the routing given as above) and prints the modules in the
order they ran with their outputs' relative error: the first one far above the tolerance is
where the kernels part from the references. Once with the autotuned configs and once with
each kernel's fixed config (the kernel tests'): a mismatch that goes away with fixed configs
is a tuned config's. Builds tiny checkpoints of every family on the spot; exits 1 on any
mismatch.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # this checkout's freetoken
import triton_kernels  # noqa: E402
from freetoken import LLM, SamplingParams  # noqa: E402
from freetoken.demo.tiny_model import make_tiny_model  # noqa: E402
from freetoken.models.layers.moe import ExpertBank  # noqa: E402

TOL = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item()


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


class Routing:
    """Each ExpertBank call's (topk_weights, topk_ids), in call order: recorded from one run
    (record), then handed to another run's calls in the same order (replay), or compared
    with that run's own (compare)."""

    def __init__(self):
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.flipped = 0        # (token, layer) pairs whose expert set differed (compare)

    def attach(self, model, mode: str) -> list:
        def hook(mod, args):
            x, w, ids = args
            if mode == "record":
                self.calls.append((w.clone(), ids.clone()))
                return None
            ref_w, ref_ids = self.calls[hook.n]
            hook.n += 1
            if mode == "replay":
                return x, ref_w.to(w.dtype), ref_ids.to(ids.dtype)
            self.flipped += int((ref_ids.sort(-1).values != ids.sort(-1).values).any(-1).sum())
            return None
        hook.n = 0
        return [m.register_forward_pre_hook(hook) for m in model.modules()
                if isinstance(m, ExpertBank)]


def run(model_dir, args, backend: str, prompt, routing: Routing | None = None, mode: str = "",
        modules: list | None = None, fixed: bool = False) -> torch.Tensor:
    """Logits of `prompt` on `backend`; routing recorded, replayed or compared (mode);
    modules: filled with every module's outputs (float32, on the CPU) in the order they ran."""
    llm = LLM(model_dir, device=args.device, dtype=args.dtype, kernel_backend=backend)
    model = llm.runner.model
    hooks = routing.attach(model, mode) if routing is not None else []
    if modules is not None:
        hooks += [m.register_forward_hook(
            lambda mod, inp, out, name=name: modules.append(
                (name, [t.detach().float().cpu() for t in _tensors(out)])))
            for name, m in model.named_modules() if name]
    try:
        with triton_kernels.fixed_configs_scope(fixed):
            return llm.logits(prompt)
    finally:
        for h in hooks:
            h.remove()
        del llm, model
        torch.cuda.empty_cache() if torch.cuda.is_available() else None


def greedy(model_dir, args, backend: str, prompts) -> list[list[int]]:
    llm = LLM(model_dir, device=args.device, dtype=args.dtype, kernel_backend=backend)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    out = [o.token_ids for o in llm.generate(prompts, params)]
    del llm
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def where(model_dir, args, prompt, routing: Routing, show: int = 40) -> None:
    ref: list = []
    run(model_dir, args, "reference", prompt, modules=ref)
    for fixed in (False, True):
        tri: list = []
        routing_again = Routing()
        routing_again.calls = routing.calls
        run(model_dir, args, "triton", prompt, routing_again, "replay", tri, fixed)
        print(f"  per module, triton ({'fixed configs' if fixed else 'autotuned'}) against the "
              f"reference, routing given ({len(ref)} and {len(tri)} module calls):")
        if [n for n, _ in ref] != [n for n, _ in tri]:
            print("    the two backends ran different modules; compared by position")
        shown = 0
        for (name, r), (_, t) in zip(ref, tri):
            worst = max((_rel(a, b) for a, b in zip(r, t) if a.shape == b.shape),
                        default=float("nan"))
            if shown < show and (worst > TOL[args.dtype] / 3 or shown < 8):
                print(f"    {name:50s} {worst:.2e} {[tuple(a.shape) for a in r][:2]}")
                shown += 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=list(TOL))
    p.add_argument("--families", nargs="+", default=["qwen3_moe", "qwen2_moe", "mixtral"])
    p.add_argument("--where", action="store_true", help="on a mismatch, each module's error")
    args = p.parse_args(argv)
    failures = 0
    prompts = [[(7 * i + j) % 1800 + 3 for j in range(n)] for i, n in enumerate((1, 7, 127, 300))]
    for family in args.families:
        with tempfile.TemporaryDirectory() as d:
            make_tiny_model(d, family=family, seed=0, dtype=args.dtype)
            routing, own = Routing(), Routing()
            ref = run(d, args, "reference", prompts[2], routing, "record")
            own.calls = routing.calls
            run(d, args, "triton", prompts[2], own, "compare")
            tri = run(d, args, "triton", prompts[2], routing, "replay")
            err = _rel(ref, tri)
            same = sum(a == b for a, b in zip(greedy(d, args, "reference", prompts),
                                              greedy(d, args, "triton", prompts)))
            ok = err < TOL[args.dtype] and (same == len(prompts) or args.dtype != "float32")
            failures += not ok
            print(f"{family:10s} {args.dtype}: logits rel err {err:.2e} with the reference's "
                  f"routing (tol {TOL[args.dtype]:.0e}); its own routing chose other experts in "
                  f"{own.flipped} (token, layer) pairs of {len(prompts[2])} tokens; greedy {same}/{len(prompts)} "
                  f"prompts identical -> {'OK' if ok else 'MISMATCH'}", flush=True)
            if args.where and not ok:
                where(d, args, prompts[2], routing)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
