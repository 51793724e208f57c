#!/usr/bin/env python3
"""Expert cache policies on the same routing: experts fetched per token against the optimum.

    python bench/cache_policy.py                   # synthetic + recorded traces, ~2 min on CPU
    python bench/cache_policy.py --quick           # fewer steps, one cache size
    python bench/cache_policy.py --trace t.json    # a saved RoutingTrace (e.g. a real model's)

Every arm replays the same trace through the real ExpertCache (freetoken.moe.replay), so the
figures are counts, the same on any machine: what the PCIe link must carry per token is
`fetched/token` x the expert's bytes. The ceiling is Belady's offline optimum for the same
slots (no policy, with or without prefetch, fetches fewer experts). Arms: plain LRU (the
cache everyone has), LRU + our prefetch, lfu-decay, lfu-decay + prefetch. `stalls/token` are
demand misses, the fetches a step waits for; prefetch trades them for more bytes moved.
For the recorded traces (whose guesses are ranked by router probability, as prefetch uses
them) a sweep of prefetch depth (the n likeliest guesses per layer) shows what each rank costs
in bytes and saves in stalls: moe_prefetch=auto picks the depth from the link's idle time.

Traces, each at batch 1 and 8, shaped like Qwen3-30B-A3B's routing (8 MoE layers, 128
experts, top-8; the cache holds --rates of all experts):
  synthetic   freetoken.moe.trace.synthetic_trace at four stated distributions, from uniform
              to strongly skewed and correlated; the guess holds each true pick with
              probability 0.7;
  recorded    a random-weight model of that routing shape (hidden 256) through the live
              engine, sampled at temperature 1 (greedy random models loop), uniform and
              with skewed routers (freetoken.demo.tiny_model.skew_routers); the guesses are
              prefetch's real ones. Only decode steps are kept.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from freetoken.moe.replay import belady_fetches, replay
from freetoken.moe.trace import RoutingTrace, synthetic_trace

LAYERS, EXPERTS, TOP_K = 8, 128, 8
SYNTHETIC = {            # name -> (zipf exponent, probability a pick repeats the last step's)
    "uniform": (0.0, 0.0),
    "mild": (0.6, 0.1),
    "skewed": (1.0, 0.25),
    "very-skewed": (1.2, 0.5),
}
ARMS = [("lru", False), ("lru", True), ("lfu-decay", False), ("lfu-decay", True)]


def record_trace(skewed: bool, batch: int, steps: int, seed: int = 0) -> RoutingTrace:
    """Route a random-weight model of the bench's routing shape through the live engine."""
    from freetoken import LLM, SamplingParams
    from freetoken.demo.tiny_model import make_tiny_model, skew_routers
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_model(tmp, family="qwen3_moe", seed=seed, hidden_size=256, num_layers=LAYERS,
                        num_heads=4, num_kv_heads=2, num_experts=EXPERTS, top_k=TOP_K,
                        moe_intermediate_size=32, max_position_embeddings=1024)
        if skewed:
            skew_routers(tmp, seed)
        # Every expert cached: the runtime routes and guesses as under any cache, recording.
        llm = LLM(tmp, device="cpu", skip_tokenizer_init=True, max_model_len=1024,
                  moe_backend="offload", moe_cache_rate=1.0)
        moe = llm.runner.moe
        trace = moe.trace = RoutingTrace(tuple(sorted(moe.mode)), EXPERTS, TOP_K,
                                         source=f"recorded {'skewed' if skewed else 'uniform'} "
                                                f"routers, batch {batch}, temperature 1")
        prompts = [[11 + 7 * i + j for j in range(16)] for i in range(batch)]
        llm.generate(prompts, [SamplingParams(max_tokens=steps, temperature=1.0, seed=seed + i,
                                              ignore_eos=True) for i in range(batch)])
        moe.trace = None
    trace.steps = [s for s in trace.steps if s.rows <= batch]      # decode only
    return trace


def cache_slots(trace: RoutingTrace, rate: float) -> int:
    """`rate` of all experts, but at least what the busiest layer step needs at once."""
    return max(int(rate * len(trace.layers) * trace.num_experts),
               max(len(r.experts) for s in trace.steps for r in s.routes))


def compare(trace: RoutingTrace, rate: float) -> list[dict]:
    slots = cache_slots(trace, rate)
    best = belady_fetches(trace, slots)
    rows = []
    for r in [best] + [replay(trace, slots, policy, prefetch=pf) for policy, pf in ARMS]:
        rows.append({"arm": r.name, "slots": slots, "hit_rate": r.hit_rate,
                     "fetched_per_token": r.fetched_per_token,
                     "stalls_per_token": r.stalls_per_token,
                     "x_optimum": r.fetched / best.fetched,
                     "prefetch_accuracy": r.prefetch_accuracy})
    return rows


def depth_sweep(trace: RoutingTrace, rate: float, depths=(0, 1, 2, 4, None)) -> list[dict]:
    slots = cache_slots(trace, rate)
    rows = []
    for depth in depths:
        r = replay(trace, slots, "lfu-decay", prefetch=depth != 0, depth=depth)
        rows.append({"depth": "all" if depth is None else depth,
                     "fetched_per_token": r.fetched_per_token, "stalls_per_token": r.stalls_per_token})
    print("  lfu-decay, prefetch depth -> fetched/token, stalls/token: " + ", ".join(
        f"{r['depth']}: {r['fetched_per_token']:.1f} / {r['stalls_per_token']:.1f}" for r in rows))
    return rows


def print_table(name: str, rate: float, rows: list[dict]) -> None:
    print(f"== {name}, cache {rate:.0%} ({rows[0]['slots']} slots)")
    for r in rows:
        acc = "" if r["prefetch_accuracy"] is None else f"  guess accuracy {r['prefetch_accuracy']:.2f}"
        print(f"  {r['arm']:28s} hit {r['hit_rate']:.3f}  fetched/token {r['fetched_per_token']:6.2f}"
              f"  stalls/token {r['stalls_per_token']:6.2f}  x optimum {r['x_optimum']:.2f}{acc}")
    lru, ours = rows[1], rows[4]
    print(f"  lfu-decay + prefetch vs plain LRU: fetched x{ours['fetched_per_token'] / lru['fetched_per_token']:.2f}, "
          f"stalls x{ours['stalls_per_token'] / lru['stalls_per_token']:.2f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", action="append", default=[], help="a saved RoutingTrace (JSON)")
    p.add_argument("--steps", type=int, default=300, help="decode steps per trace at batch 1")
    p.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5])
    p.add_argument("--no-record", action="store_true", help="skip the traces recorded from a model")
    p.add_argument("--quick", action="store_true", help="60 steps, the first rate only")
    p.add_argument("--save-traces", help="write every trace as JSON into this folder")
    p.add_argument("--out", help="write the results as JSON")
    args = p.parse_args(argv)
    steps, rates = (60, args.rates[:1]) if args.quick else (args.steps, args.rates)

    try:
        traces = {Path(t).stem: RoutingTrace.load(t) for t in args.trace}
    except (OSError, ValueError) as e:
        print(f"cache_policy: {e}", file=sys.stderr)
        return 2
    if not args.trace:
        for batch in (1, 8):
            n = steps if batch == 1 else steps // 2
            for name, (zipf, repeat) in SYNTHETIC.items():
                traces[f"synthetic-{name}-b{batch}"] = synthetic_trace(
                    LAYERS, EXPERTS, TOP_K, n, batch=batch, zipf=zipf, repeat=repeat)
            if not args.no_record:
                for skewed in (False, True):
                    traces[f"recorded-{'skewed' if skewed else 'uniform'}-b{batch}"] = \
                        record_trace(skewed, batch, n)
    results = {}
    for name, trace in traces.items():
        if args.save_traces:
            Path(args.save_traces).mkdir(parents=True, exist_ok=True)
            trace.save(Path(args.save_traces) / f"{name}.json")
        print(f"# {name}: {trace.source}, {len(trace.steps)} steps")
        for rate in rates:
            rows = compare(trace, rate)
            print_table(name, rate, rows)
            results[f"{name}@{rate}"] = rows
            if not name.startswith("synthetic"):         # ranked guesses
                results[f"{name}@{rate} depth"] = depth_sweep(trace, rate)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
