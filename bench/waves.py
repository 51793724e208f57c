#!/usr/bin/env python3
"""An expert cache from top_k slots to every expert: prefill and decode speed, waves and the
fetches they cost, against the resident run (the same greedy tokens at every size).

    python bench/waves.py                                   # GPU, bf16, Qwen3-MoE-shaped layers
    python bench/waves.py --device cpu --dtype float32 --scale small   # the logic on a CPU

A random checkpoint (bench/offload.py's shapes) is written on the spot. Per cache size: prefill
tokens/s of a --prompt-tokens prompt in chunks of --chunk (each chunk routes to nearly every
expert of a layer, so caches below one layer run it in waves), decode tokens/s at batch 1 (a run
of 1 + N tokens minus a run of 1), the waves per prefill chunk and layer, the experts fetched
per prefill token and per decoded token, and the fetches waves cost (experts fetched again after
their own layer's later waves evicted them). On a CPU a fetch is a memcpy, so the table shows
what waves cost the host, not the PCIe link.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offload import SHAPES, SKEWED  # noqa: E402  (bench/ is not a package)

SHAPES = {**SHAPES, "small": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                                  head_dim=64, num_experts=32, top_k=4, moe_intermediate_size=128,
                                  max_position_embeddings=2048, norm_topk_prob=True)}


def _generate(llm, prompts, tokens):
    from freetoken import SamplingParams
    if llm.runner.moe is not None:
        llm.runner.moe.reset_counters()
    t0 = time.perf_counter()
    out = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    if llm.runner.device.type == "cuda":
        torch.cuda.synchronize()
    counters = llm.runner.moe_report()["counters"] if llm.runner.moe is not None else {}
    return time.perf_counter() - t0, [o.token_ids for o in out], dict(counters or {})


def arm(model_dir, args, size: int | None) -> dict:
    from freetoken import LLM
    kw = dict(moe_backend="resident") if size is None else dict(moe_backend="offload",
                                                                 moe_cache_size=size)
    llm = LLM(str(model_dir), device=args.device, dtype=args.dtype, skip_tokenizer_init=True,
              max_prefill_length=args.chunk, enable_prefix_caching=False, **kw)
    prompt = [[(13 * i + 7) % 250 + 3 for i in range(args.prompt_tokens)]]
    _generate(llm, prompt, 2)                                       # warm: compile, fill
    prefill_s, first, cp = _generate(llm, prompt, 1)
    short = [[11 + j for j in range(16)]]
    _generate(llm, short, 1 + args.decode_tokens)     # warm: the short prompt's shapes too
    t1, _, c1 = _generate(llm, short, 1)
    tn, tokens, cn = _generate(llm, short, 1 + args.decode_tokens)
    decode_s = max(tn - t1, 1e-9)
    row = {"slots": size, "prefill_tok_s": args.prompt_tokens / prefill_s,
           "decode_tok_s": args.decode_tokens / decode_s, "tokens": first + tokens}
    if cp:
        chunks = -(-args.prompt_tokens // args.chunk)
        layers = len(llm.runner.moe_report()["cache"]["layers"])
        row.update(
            # Layer steps that fit ran as one wave each.
            waves_per_chunk_layer=(cp["waves"] + chunks * layers - cp["wave_steps"])
            / (chunks * layers),
            max_waves=llm.runner.moe_plan.max_waves,
            prefill_fetched_per_token=cp["experts_fetched"] / args.prompt_tokens,
            prefill_wave_refetches=cp["wave_refetches"],
            decode_fetched_per_token=(cn["experts_fetched"] - c1["experts_fetched"])
            / args.decode_tokens)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", choices=list(SHAPES), default="qwen3-30b-a3b-8l")
    p.add_argument("--family", default="qwen3_moe")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--sizes", help="comma-separated slot counts (default: top_k, 2 top_k, half a "
                                   "layer, a layer, 2 layers, every expert)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--model", type=Path, help="keep the checkpoint here: built if the folder has "
                   "none, reused if it has (bench/offload.py --model's, for the same --scale)")
    p.add_argument("--out", help="the report as JSON, rewritten after each cache size")
    args = p.parse_args(argv)
    from freetoken.demo.tiny_model import make_tiny_model

    shape = SHAPES[args.scale]
    e, k, n = shape["num_experts"], shape["top_k"], shape["num_layers"]
    sizes = ([int(s) for s in args.sizes.split(",")] if args.sizes
             else sorted({k, 2 * k, e // 2, e, 2 * e, e * n}))
    report = {"conditions": vars(args), "rows": []}
    def save():
        if args.out:
            Path(args.out).write_text(json.dumps(
                {**report, "rows": [{k: v for k, v in r.items() if k != "tokens"}
                                    for r in report["rows"]]}, indent=1, default=str))

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or Path(tmp) / "model"
        if args.model is not None and (model_dir / SKEWED).exists():
            raise SystemExit(f"{model_dir}: bench/offload.py's skewed pass rewrote its routers")
        if not model_dir.exists():      # built aside and renamed: never a half-built one
            partial = model_dir.with_name(model_dir.name + ".partial")
            make_tiny_model(partial, family=args.family, seed=0, dtype=args.dtype, **shape)
            partial.rename(model_dir)
        ref = arm(model_dir, args, None)
        report["rows"].append(ref)
        for size in sizes:
            row = arm(model_dir, args, size)
            row["same_tokens"] = row["tokens"] == ref["tokens"]
            report["rows"].append(row)
            print(f"slots {size}: {({k: v for k, v in row.items() if k != 'tokens'})}", flush=True)
            save()
    print("| slots | prefill tok/s | decode tok/s | waves/chunk/layer (max) | fetched/prefill tok "
          "| wave refetches | fetched/decode tok | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for r in report["rows"]:
        if r["slots"] is None:
            print(f"| resident | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} | - | - | - | - | - |")
            continue
        print(f"| {r['slots']} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} | "
              f"{r['waves_per_chunk_layer']:.2f} ({r['max_waves']}) | "
              f"{r['prefill_fetched_per_token']:.2f} | {r['prefill_wave_refetches']} | "
              f"{r['decode_fetched_per_token']:.2f} | {r['same_tokens']} |")
    save()
    return 0 if all(r.get("same_tokens", True) for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
