#!/usr/bin/env python3
"""Experts in RAM on one GPU: decode speed against the PCIe bound, hit rates per policy,
prefetch accuracy, and the baselines a user would reach for, in one run.

    python bench/offload.py                       # Qwen3-30B-A3B-shaped, 8 layers, bf16, GPU
    python bench/offload.py --scale tiny --device cpu --skip-transformers   # logic check on CPU
    python bench/offload.py --quant fp8           # the same with FP8 experts (any --quant of
                                                  # tools/make_tiny_model.py; mxfp4: --family gpt_oss)

With --quant the checkpoint is written in that method's layout and kept quantized; the cache
gets the same bytes as bf16's --cache-rate (so 2-4x more experts fit) and the bounds use the
quantized expert bytes.

The model (hidden 2048, 128 experts, top-8, expert width 768, 32/4 heads of 128) is generated
on the spot with random weights. The expert cache holds --cache-rate of all expert bytes.
Random weights route almost uniformly, where no policy can beat another, so every arm also
runs a "skewed" variant: router rows scaled by 1 + 2 / rank^0.8 over a random expert order
(a Zipf-like popularity; consecutive tokens share much of their hidden state, which makes the
choices temporally correlated). Arms: resident; offload with plain LRU (no prefetch), with
lfu-decay prefetching every guess, and with the defaults (lfu-decay, prefetch as many guesses as
the link carries while the GPU computes); hybrid and auto (which read `ft bench bw`'s profile, else
calibrate); transformers resident and accelerate offload. Decode is measured apart from
prefill (a run of 1 + N tokens minus a run of 1). Printed per arm at batch 1 and 8: tokens/s,
hit rate, prefetch accuracy, bytes fetched per token, achieved fetch GB/s (copy-stream busy
time, and over wall time) against the pinned host->device ceiling measured in the same run,
and two PCIe bounds: the issue's (expert bytes missed at the measured hit rate / ceiling) and
the bytes this arm really moved per token / ceiling (prefetches count there).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

# `python bench/offload.py` puts bench/ first on sys.path, where bench/kernels.py would shadow
# the `kernels` package transformers imports when it finds one (transformers 5.x).
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))           # this checkout's freetoken

SHAPES = {
    "qwen3-30b-a3b-8l": dict(hidden_size=2048, num_layers=8, num_heads=32, num_kv_heads=4, head_dim=128,
                             num_experts=128, top_k=8, moe_intermediate_size=768, intermediate_size=6144,
                             max_position_embeddings=4096, norm_topk_prob=True),
    "tiny": dict(hidden_size=64, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=16,
                 top_k=4, moe_intermediate_size=32, max_position_embeddings=512, norm_topk_prob=True),
}


def pinned_h2d_gbps(device) -> float | None:
    if device.type != "cuda":
        return None
    src = torch.empty(256 * 2**20, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * src.numel() / (time.perf_counter() - t0) / 1e9


def _counters(llm) -> dict:
    return llm.runner.moe_report()["counters"] or {} if llm.runner.moe is not None else {}


def _timed_generate(llm, prompts, tokens) -> tuple[float, dict]:
    from freetoken import SamplingParams
    if llm.runner.moe is not None:
        llm.runner.moe.reset_counters()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    if llm.runner.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    # Page faults the run took: a bank read through fresh page mappings faults once a 4 KB page
    # (a 9 MB expert: ~2300 faults, ms of a step in a VM).
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return seconds, {**_counters(llm), "minor_faults": faults}


def prefill_run(llm, tokens: int) -> float:
    """One prompt of `tokens` tokens and one output token, after a warm run of another prompt
    of the same length (no cached prefix): prompt tokens per second."""
    _timed_generate(llm, [[5 + (7 * j) % 97 for j in range(tokens)]], 1)
    seconds, _ = _timed_generate(llm, [[3 + (11 * j) % 89 for j in range(tokens)]], 1)
    return tokens / seconds


def decode_run(llm, batch: int, tokens: int) -> dict:
    """Decode alone: a run of 1 + tokens output tokens minus a run of 1 (the same 64-token
    prefill), for the time and for the cache counters, so prefill's fetches do not count.
    The warm run is the long one: its prompt's blocks are then cached, so the timed runs
    prefill the same few tokens, a shape (compiled and tuned on first use) the warm run has
    already met; each timed run is the faster of two (this machine is shared)."""
    prompts = [[11 + 7 * i + j for j in range(64)] for i in range(batch)]
    _timed_generate(llm, prompts, 1 + tokens)                     # warm: compile, tune, fill
    t1, c1 = min((_timed_generate(llm, prompts, 1) for _ in range(2)), key=lambda r: r[0])
    tn, cn = min((_timed_generate(llm, prompts, 1 + tokens) for _ in range(2)), key=lambda r: r[0])
    seconds = max(tn - t1, 1e-9)
    out = {"tok_s": batch * tokens / seconds,
           "minor_faults_per_token": (cn["minor_faults"] - c1["minor_faults"]) / (batch * tokens)}
    if "lookups" in cn:
        lookups = cn["lookups"] - c1["lookups"]
        hits = cn["hits"] - c1["hits"]
        guessed = cn["prefetch_guessed"] - c1["prefetch_guessed"]
        fetched = cn["bytes_fetched"] - c1["bytes_fetched"]
        out.update(hit_rate=hits / lookups if lookups else None,
                   prefetch_accuracy=(cn["prefetch_used"] - c1["prefetch_used"]) / guessed if guessed else None,
                   fetched_bytes_per_token=fetched / (batch * tokens),
                   prefetched_per_token=(cn["prefetch_fetched"] - c1["prefetch_fetched"]) / (batch * tokens),
                   prefetch_dropped_per_token=(cn["prefetch_dropped"] - c1["prefetch_dropped"]) / (batch * tokens),
                   fetch_gbps=cn["fetch_gbps"],                   # copy-stream busy time
                   fetch_gbps_wall=fetched / seconds / 1e9,
                   cpu_experts_per_token=(cn["cpu_experts"] - c1["cpu_experts"]) / (batch * tokens),
                   # the CPU's expert products' share of the decode time
                   cpu_share=(cn["cpu_expert_s"] - c1["cpu_expert_s"]) / seconds)
        experts = cn["cpu_experts"] - c1["cpu_experts"]
        if experts:     # the CPU's product per expert it computed, ms (decode's calls only)
            wall = cn["cpu_expert_s"] - c1["cpu_expert_s"]
            out["cpu_ms_per_expert"] = 1e3 * wall / experts
            # the process's CPU seconds in the CPU's calls / (their wall time x its threads),
            # over the long run (a difference of two runs' is noise at this size): ~1 when the
            # team computes (or spins) throughout; far under 1 when its threads sleep or are
            # preempted (a slow call's first suspect)
            threads = llm.runner.moe_report()["cpu_threads"]
            out["cpu_busy"] = (cn["cpu_expert_process_s"] / (cn["cpu_expert_s"] * threads)
                               if cn["cpu_expert_s"] else None)
    return out


# (arm name, LLM kwargs): "plain LRU" is the cache everyone has, without our prefetch;
# prefetch-all against the default (auto) says whether the window limit pays.
OFFLOAD_ARMS = [
    ("offload-lru-noprefetch", dict(moe_backend="offload", moe_cache_policy="lru", moe_prefetch="off")),
    ("offload-lfu-decay-prefetch-all", dict(moe_backend="offload", moe_cache_policy="lfu-decay",
                                            moe_prefetch="all")),
    ("offload-lfu-decay", dict(moe_backend="offload", moe_cache_policy="lfu-decay")),
]
OTHER_ARMS = [
    ("hybrid", dict(moe_backend="hybrid")),      # K from `ft bench bw`'s profile or calibration
    ("auto", dict(moe_backend="auto")),          # offload or hybrid, from the same figures
    ("cpu", dict(moe_backend="cpu")),            # every expert on the CPU, attention on the GPU
]


def freetoken_arm(model_dir, args, name, kw) -> dict:
    from freetoken import LLM
    kw = dict(device=args.device, dtype=args.dtype, max_model_len=max(512, args.prefill_tokens + 64),
              moe_cpu_threads=args.moe_cpu_threads, **kw)
    if kw["moe_backend"] not in ("resident", "cpu"):       # the backends with a cache
        if args.cache_slots:        # --quant: bf16's byte budget, in quantized experts
            kw["moe_cache_size"] = args.cache_slots
        else:
            kw["moe_cache_rate"] = args.cache_rate
    llm = LLM(str(model_dir), skip_tokenizer_init=True, **kw)
    out = {"arm": f"freetoken-{name}"}
    for batch in args.batches:
        out.update({f"{k}_b{batch}": v for k, v in decode_run(llm, batch, args.decode_tokens).items()})
        if llm.runner.moe is not None:  # auto prefetch: the link's idle time a layer, this batch's
            windows = [p["prefetch_window_us"] for p in llm.runner.moe_report()["counters"]["per_layer"]
                       if p["prefetch_window_us"] is not None]
            if windows:
                out[f"prefetch_window_us_b{batch}"] = sum(windows) / len(windows)
    if args.prefill_tokens:
        out["prefill_tok_s"] = prefill_run(llm, args.prefill_tokens)
    report = llm.runner.moe_report()
    if llm.runner.moe is not None:
        out["cache"] = report["cache"]
        out["backend"], out["hybrid_k"], out["reason"] = report["backend"], report["hybrid_k"], report["reason"]
        if report["counters"]["cpu_cost_revisions"]:     # K revised from the CPU it measured
            out["cpu_cost_revisions"] = report["counters"]["cpu_cost_revisions"]
            out["reason"] += f"; K now from: {report['hybrid_k_source']}"
        by_rank = report["counters"]["prefetch_accuracy_by_rank"][:8]
        if by_rank:     # how often the likeliest guess, the next, ... was right
            out["guess_accuracy_by_rank"] = " ".join(f"{a:.2f}" for a in by_rank)
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def transformers_arms(model_dir, args) -> list[dict]:
    from transformers import AutoModelForCausalLM
    dtype = getattr(torch, args.dtype)
    arms = []
    for name, kw in (("transformers-resident", {}),
                     ("transformers-accelerate-offload", dict(device_map="auto", max_memory={
                         0: f"{args.accelerate_gpu_gb}GiB", "cpu": "200GiB"}))):
        if name.endswith("offload") and args.device != "cuda":
            continue
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kw)
            if not kw:
                model = model.to(args.device)
        except Exception as e:  # noqa: BLE001 - a missing accelerate is a result, not a crash
            arms.append({"arm": name, "error": f"{type(e).__name__}: {e}"})
            continue
        ids = torch.arange(11, 75)[None].to(model.device)
        n = max(4, args.decode_tokens // 8) if name.endswith("offload") else args.decode_tokens
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        arms.append({"arm": name, "tok_s_b1": n / (time.perf_counter() - t0)})
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return arms


SKEWED = "skewed-routers"       # in a kept --model: the skewed pass rewrote its routers


def _print_arm(a: dict) -> None:
    print("  " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in a.items() if k not in ("cache", "reason")), flush=True)
    if a.get("reason"):
        print(f"    why: {a['reason']}", flush=True)


def _bounds(a: dict, report: dict, ceiling: float | None) -> None:
    """Two PCIe bounds at batch 1: the issue's (bytes not cached at the measured hit rate over
    the pinned ceiling), and the bytes this arm really moved per token (prefetches included,
    hits they produced too) over the same ceiling. The CPU arm: active expert bytes per token
    x tok/s over the host's DRAM read ceiling (#21's roofline)."""
    hit, moved = a.get("hit_rate_b1"), a.get("fetched_bytes_per_token_b1")
    active = report["active_expert_bytes_per_token"]
    if ceiling and hit is not None and hit < 1:
        a["pcie_bound_at_hit_rate_b1"] = ceiling * 1e9 / ((1 - hit) * active)
        a["fraction_of_that_bound_b1"] = a["tok_s_b1"] / a["pcie_bound_at_hit_rate_b1"]
    if ceiling and moved:
        a["pcie_bound_for_bytes_moved_b1"] = ceiling * 1e9 / moved
        a["fraction_of_moved_bound_b1"] = a["tok_s_b1"] / a["pcie_bound_for_bytes_moved_b1"]
    if a.get("backend") == "cpu" and "tok_s_b1" in a:
        a["dram_roofline_b1"] = active * a["tok_s_b1"] / (report["host_read_gbps"] * 1e9)
        if a.get("cpu_share_b1"):       # the CPU products alone, against the same ceiling
            a["cpu_products_roofline_b1"] = a["dram_roofline_b1"] / a["cpu_share_b1"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", choices=list(SHAPES), default="qwen3-30b-a3b-8l")
    p.add_argument("--family", default="qwen3_moe",
                   help="the tiny checkpoint's family (tools/make_tiny_model.py --family)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--cache-rate", type=float, default=0.25)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--batches", default="1,8", help="decode batch sizes (comma-separated)")
    p.add_argument("--prefill-tokens", type=int, default=512, help="each arm's prefill of one "
                   "prompt this long, tokens/s (0: skip)")
    p.add_argument("--arms", help="comma-separated arm names to run (default: all), e.g. "
                   "resident,offload-lfu-decay,cpu")
    p.add_argument("--moe-cpu-threads", type=int, help="the CPU experts' threads (default: torch's)")
    p.add_argument("--accelerate-gpu-gb", type=float, default=4.0,
                   help="accelerate's GPU budget (dense + about 25%% of experts)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--workdir", help="where to write the model (default: a temp folder)")
    p.add_argument("--model", type=Path, help="keep the checkpoint here: built if the folder has "
                   "none, reused if it has (the skewed pass rewrites its routers)")
    p.add_argument("--build-only", action="store_true", help="build --model's checkpoint and stop")
    p.add_argument("--out", help="the report as JSON, rewritten after each arm")
    p.add_argument("--quant", default=None, help="tools/make_tiny_model.py --quant: experts and "
                   "projections quantized in that method's layout (fp8 blocks 128x128, int4 g32)")
    args = p.parse_args(argv)
    args.cache_slots = None
    args.batches = [int(b) for b in args.batches.split(",")]
    from freetoken.moe.bandwidth import host_read_gbps
    if args.build_only and args.model is None:
        p.error("--build-only needs --model")
    order = args.arms.split(",") if args.arms else []
    wanted = set(order) if args.arms else None
    known = {"resident"} | {n for n, _ in OFFLOAD_ARMS + OTHER_ARMS}
    if wanted and wanted - known:
        p.error(f"unknown arms {sorted(wanted - known)}; known: {sorted(known)}")

    device = torch.device(args.device)
    if args.build_only:
        build_model(args.model, args)
        return 0
    ceiling = pinned_h2d_gbps(device)
    report = {"conditions": vars(args), "pinned_h2d_gbps": ceiling,
              "host_read_gbps": host_read_gbps(torch.get_num_threads()),
              "host_threads": torch.get_num_threads(),
              "routing": {}}
    print(f"pinned H2D {ceiling or float('nan'):.1f} GB/s, host DRAM read "
          f"{report['host_read_gbps']:.1f} GB/s with {report['host_threads']} threads", flush=True)

    def save():
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2, default=str))

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        model_dir = args.model or Path(tmp) / "model"
        t0 = time.perf_counter()
        float_bytes = build_model(model_dir, args)
        report["model_build_s"] = time.perf_counter() - t0
        from freetoken.models.loader import init_model
        blocks = init_model(model_dir, args.dtype)[0].moe_blocks()
        expert_bytes = next(iter(blocks.values())).experts.layout.expert_bytes
        report["expert_bytes"] = expert_bytes
        if args.quant:      # the cache gets bf16's bytes, in quantized experts
            args.skip_transformers = True     # its loaders are not the oracle of this bench
            n = sum(b.experts.num_experts for b in blocks.values())
            args.cache_slots = min(n, int(args.cache_rate * n * float_bytes) // expert_bytes)
            report["quant"] = {"format": next(iter(blocks.values())).experts.layout.describe(),
                               "bf16_expert_bytes": float_bytes, "cache_slots": args.cache_slots,
                               "bf16_cache_slots": int(args.cache_rate * n)}
        report["active_expert_bytes_per_token"] = expert_bytes * sum(b.top_k for b in blocks.values())
        for routing in ("uniform", "skewed"):
            todo = ([("resident", dict(moe_backend="resident"))] if routing == "uniform" else [])
            todo += OFFLOAD_ARMS + (OTHER_ARMS if routing == "uniform" else [])
            if wanted is not None:      # --arms' order: the ones that matter first
                todo = sorted((a for a in todo if a[0] in wanted), key=lambda a: order.index(a[0]))
            if not todo:
                continue
            if routing == "skewed":     # in place: a kept --model is marked, not reused as uniform
                from freetoken.demo.tiny_model import skew_routers
                skew_routers(model_dir)
                (model_dir / SKEWED).touch()
            print(f"== {routing} routing", flush=True)
            arms = report["routing"][routing] = []
            for name, kw in todo:
                try:
                    a = freetoken_arm(model_dir, args, name, kw)
                except Exception as e:  # noqa: BLE001 - one arm's failure is a result; go on
                    a = {"arm": f"freetoken-{name}", "error": f"{type(e).__name__}: {e}"}
                _bounds(a, report, ceiling)
                arms.append(a)
                _print_arm(a)
                save()
            if routing == "uniform" and not args.skip_transformers:
                for a in transformers_arms(model_dir, args):
                    arms.append(a)
                    _print_arm(a)
                    save()
    save()
    return 0


def build_model(model_dir: Path, args) -> int | None:
    """The checkpoint in model_dir (built unless it holds one); returns the bf16 expert bytes
    when --quant re-encodes it (the cache's byte budget), else None."""
    import shutil

    from freetoken.demo.tiny_model import make_tiny_model
    from freetoken.models.loader import init_model
    if (model_dir / SKEWED).exists():
        raise SystemExit(f"{model_dir}: an earlier run skewed its routers in place; its uniform "
                         "figures would be skewed ones. Delete the folder to build it again.")
    if model_dir.exists():          # only a whole build is ever renamed to model_dir
        return json.loads((model_dir / "float_expert_bytes.json").read_text()) \
            if (model_dir / "float_expert_bytes.json").exists() else None
    partial = model_dir.with_name(model_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)      # a build cut short before
    make_tiny_model(partial, family=args.family, seed=0, dtype=args.dtype, **SHAPES[args.scale])
    float_bytes = None
    if args.quant:
        # The family's own expert layout (gpt-oss adds biases), read off the meta-built model.
        blocks = init_model(partial, args.dtype)[0].moe_blocks()
        float_bytes = next(iter(blocks.values())).experts.layout.expert_bytes
        from freetoken.models.quant.encode import quantize_checkpoint
        quantize_checkpoint(partial, args.quant)
        (partial / "float_expert_bytes.json").write_text(json.dumps(float_bytes))
    partial.rename(model_dir)
    return float_bytes


if __name__ == "__main__":
    sys.exit(main())
