"""`ft bench serve`: the benchmark harness's flags, and the glue to bench/harness.

    ft bench serve --url http://127.0.0.1:1919 --workload short_chat          # one arm
    ft bench serve --url ft=http://h:1919 --url vllm=http://h:8000 --workload concurrency_sweep
    ft bench serve --url URL --transformers /path/to/ckpt --workload short_chat   # + baseline
    ft bench serve --url URL --workload smoke_chat --dry-run       # the plan, and every reason
                                                                   # the run would be refused
    ft bench serve --serve "a=MODEL --kv-cache-tokens 8192" --serve "b=MODEL --kv-cache-tokens 65536" \
                   --varies kv_cache --workload short_chat          # two configurations, launched here
    ft bench bw [--model DIR] [--gpu N]   # host, PCIe, expert fetch and CPU expert bandwidths;
                                          # saves the profile the engine's auto placement reads
The harness and its workloads live in the source checkout's bench/ (not an installed package),
so `ft bench` needs the checkout that freetoken is installed from (pip install -e .). This file
only defines flags (argparse, cheap to import); the harness loads when the command runs.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import io
import re
import signal
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmark against a frozen workload manifest (bench/)")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    s = bsub.add_parser("serve", help="benchmark OpenAI-compatible servers (and baselines)",
                        description="Run frozen workloads against one or more arms under the manifest's "
                                    "protocol; write generations.jsonl, run.json and SUMMARY.md.")
    s.add_argument("--url", action="append", default=[], metavar="[NAME=]URL",
                   help="an OpenAI-compatible server to measure (repeat for more arms)")
    s.add_argument("--serve", action="append", nargs="?", const="", default=[], metavar="[NAME=]ARGS",
                   help="start `ft serve ARGS` as an arm and stop it afterwards; ARGS as one string "
                        "(\"MODEL --kv-cache-tokens 8192\"); alone: the demo model")
    s.add_argument("--transformers", action="append", default=[], metavar="[NAME=]MODEL_DIR",
                   help="a transformers baseline run in this process")
    s.add_argument("--transformers-device", default="cpu", help="its device: cpu, cuda, cuda:1")
    s.add_argument("--transformers-dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    s.add_argument("--transformers-offload", action="store_true",
                   help="device_map=auto offload (needs accelerate and a GPU)")
    s.add_argument("--workload", action="append", required=True, metavar="NAME",
                   help="a workload of the manifest (repeat for more)")
    s.add_argument("--manifest", help="the workload manifest (default: bench/workloads/manifest.json)")
    s.add_argument("--model", help="the model name to request (default: the server's first in /v1/models)")
    s.add_argument("--api-key", help="the servers' key (default: FREETOKEN_API_KEY)")
    s.add_argument("--warmups", type=int, help="warmup rounds per block (default: the manifest's)")
    s.add_argument("--repetitions", type=int, help="measured rounds per block (default: the manifest's)")
    s.add_argument("--sessions", type=int, choices=[1, 2], help="2: a second session in reversed order")
    s.add_argument("--allow", action="append", default=[], metavar="CODE",
                   help="accept this invalidating reason, making the run NON_CANONICAL instead of INVALID "
                        "(PROMPT_OUT_OF_CLASS, PROVENANCE_MISSING, USAGE_MISSING)")
    s.add_argument("--varies", action="append", default=[], metavar="PATH",
                   help="a resolved-configuration field the arms are meant to differ in (e.g. kv_cache)")
    s.add_argument("--force", action="store_true", help="measure even when preflight says INVALID")
    s.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per generation")
    s.add_argument("--out", help="the run's folder (default: bench/results/RUN_ID)")
    s.add_argument("--dry-run", action="store_true", help="print the plan and every reason the run "
                                                          "would be refused; measure nothing")

    w = bsub.add_parser("bw", help="measure the bandwidths that decide where experts run",
                        description="Measure host DRAM copy, host->GPU copies (pinned, pageable), the real "
                                    "expert fetch and the real CPU expert kernel, alone and overlapped; print "
                                    "a table and save the profile (per GPU UUID) that moe_backend=auto and "
                                    "hybrid's K read at startup.")
    w.add_argument("--gpu", help="the GPU: an index or a UUID (default: the current one)")
    w.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    w.add_argument("--model", help="take the expert shape (hidden, width, top-k, dtype) from this checkpoint")
    w.add_argument("--hidden", type=int, default=2048, help="expert shape without --model (Qwen3-30B-A3B's)")
    w.add_argument("--width", type=int, default=768)
    w.add_argument("--top-k", type=int, default=8)
    w.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    w.add_argument("--moe-cpu-threads", type=int, metavar="N",
                   help="threads for the CPU expert kernel (default: torch's); serve with the same")
    w.add_argument("--quick", action="store_true", help="short runs and small buffers (a first look)")
    w.add_argument("--no-save", action="store_true", help="print only; keep any saved profile")
    w.add_argument("--json", action="store_true", help="print the profile as JSON instead of a table")


def load_harness():
    """bench/harness from the checkout freetoken runs from."""
    if not (REPO / "bench" / "harness" / "__init__.py").is_file():
        raise SystemExit(f"ft bench: no bench/harness next to {REPO / 'freetoken'}; `ft bench` needs a "
                         f"source checkout (pip install -e .)")
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return {m: importlib.import_module(f"bench.harness.{m}")
            for m in ("arms", "manifest", "plan", "preflight", "runner", "transformers_arm", "validity")}


def _named(spec: str, default: str) -> tuple[str, str]:
    """`NAME=VALUE` or a bare VALUE (a URL, a path or flags are never taken for a name)."""
    name, sep, value = spec.partition("=")
    if sep and re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.]*", name):
        return name, value
    return default, spec


def _arms(args, h) -> list:
    from freetoken.utils import env

    arms = []
    for i, spec in enumerate(args.url):
        name, url = _named(spec, "ft" if len(args.url) == 1 else f"url{i + 1}")
        arms.append(h["arms"].UrlArm(name, url, args.api_key or env.api_key(), args.model))
    for i, spec in enumerate(args.serve):
        name, serve_args = _named(spec, "ft" if len(args.serve) == 1 and not args.url else f"serve{i + 1}")
        arms.append(h["arms"].LaunchedArm(name, serve_args, args.api_key or env.api_key()))
    for i, spec in enumerate(args.transformers):
        name, path = _named(spec, "transformers" if len(args.transformers) == 1 else f"transformers{i + 1}")
        arms.append(h["transformers_arm"].TransformersArm(name, path, args.transformers_device,
                                                          args.transformers_dtype, args.transformers_offload))
    names = [a.name for a in arms]
    if not arms:
        raise SystemExit("ft bench serve: give at least one arm (--url, --serve or --transformers)")
    if len(set(names)) != len(names):
        raise SystemExit(f"ft bench serve: arm names must differ: {names}")
    return arms


def _configure(args, h):
    """Flags -> (manifest, workloads, arms, protocol), or SystemExit saying what is wrong."""
    v = h["validity"]
    unknown = [c for c in args.allow if c not in v.OVERRIDABLE]
    if unknown:
        raise SystemExit(f"ft bench serve: --allow takes {', '.join(v.OVERRIDABLE)}; not {', '.join(unknown)}")
    try:
        manifest = h["manifest"].load_manifest(args.manifest)
    except ValueError as e:
        raise SystemExit(f"ft bench serve: {e}") from None
    missing = [w for w in args.workload if w not in manifest.workloads]
    if missing:
        raise SystemExit(f"ft bench serve: no workload {', '.join(missing)} in {manifest.path}; it has "
                         f"{', '.join(manifest.workloads)}")
    protocol = h["plan"].Protocol(
        args.warmups if args.warmups is not None else manifest.warmups,
        args.repetitions if args.repetitions is not None else manifest.measured,
        args.sessions or manifest.sessions)
    if protocol.warmups < 0 or protocol.measured < 1:
        raise SystemExit("ft bench serve: --warmups must be >= 0 and --repetitions >= 1")
    try:
        arms = _arms(args, h)
    except ValueError as e:
        raise SystemExit(f"ft bench serve: {e}") from None
    return manifest, [manifest.workloads[w] for w in dict.fromkeys(args.workload)], arms, protocol


def run(args) -> int:
    if args.bench_command == "bw":
        return run_bw(args)
    h = load_harness()
    manifest, workloads, arms, protocol = _configure(args, h)
    blocks = h["plan"].make_plan([a.name for a in arms], workloads, protocol)
    run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + "+".join(w.name for w in workloads)
    out = Path(args.out) if args.out else REPO / "bench" / "results" / run_id
    if not args.dry_run and (out / "run.json").exists():
        raise SystemExit(f"ft bench serve: {out} already holds a run; give another --out")
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:     # SIGTERM ends a run as Ctrl-C does: INCOMPLETE, with what it observed
        previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
        # `kill -USR1` prints every thread's stack to stderr (a run that seems stuck);
        # not where stderr is no file (a caller capturing it in-process)
        try:
            faulthandler.register(signal.SIGUSR1, all_threads=True)
            dumps = True
        except (io.UnsupportedOperation, AttributeError, ValueError):
            dumps = False
    try:
        pre = h["preflight"].run_preflight(manifest, workloads, arms, protocol, args.varies, args.timeout)
        if args.dry_run:
            text, refused = h["runner"].explain(pre, blocks, set(args.allow), args.force)
            print(text)
            return h["runner"].EXIT_REFUSED if refused else 0
        options = h["runner"].Options(out_dir=out, allow=set(args.allow), varies=args.varies, force=args.force,
                                      timeout_s=args.timeout, argv={"argv": sys.argv[:], "args": vars(args)})
        record, code = h["runner"].Runner(manifest, workloads, arms, protocol, blocks, options, pre, run_id).run()
    except KeyboardInterrupt:
        print("ft bench serve: interrupted before measuring; nothing was written", file=sys.stderr)
        return h["runner"].EXIT_INTERRUPTED
    finally:
        for arm in arms:
            arm.close()         # launched servers stop whatever happened
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
            if dumps:
                faulthandler.unregister(signal.SIGUSR1)
    verdict = record["verdict"]
    print(f"{verdict['status']}, {verdict['validity']}: {verdict['observed_generations']} of "
          f"{verdict['expected_generations']} generations; artifacts in {out}")
    for r in verdict["reasons"]:
        print(f"  - {r['code']} [{r['severity']}{', overridden' if r['overridden'] else ''}]: {r['detail']}")
    return code


def run_bw(args) -> int:
    import json

    import torch

    from freetoken.moe.profile import format_table, measure_profile, save_profile

    device = _bw_device(args)
    hidden, width, top_k, dtype = args.hidden, args.width, args.top_k, args.dtype
    if args.model:
        from freetoken.models.loader import init_model, resolve_model_path
        try:
            _, mc = init_model(resolve_model_path(args.model), "auto")
        except Exception as e:
            raise SystemExit(f"ft bench bw: {e}") from None
        if not mc.num_experts:
            raise SystemExit(f"ft bench bw: {args.model} has no routed experts")
        hidden, width, top_k, dtype = (mc.hidden_size, mc.moe_intermediate_size,
                                       mc.num_experts_per_tok, mc.torch_dtype)
    if min(hidden, width, top_k) < 1 or (args.moe_cpu_threads is not None and args.moe_cpu_threads < 1):
        raise SystemExit("ft bench bw: --hidden, --width, --top-k and --moe-cpu-threads must be positive")
    say = (lambda m: print(m, file=sys.stderr)) if args.json else print
    profile = measure_profile(device, hidden, width, getattr(torch, dtype), top_k,
                              args.moe_cpu_threads, args.quick, progress=say)
    print(json.dumps(profile, indent=1) if args.json else format_table(profile))
    if not args.no_save:
        say(f"saved {save_profile(profile)}")
    return 0


def _bw_device(args):
    import torch

    from freetoken.cli import resolve_gpu
    if args.gpu is not None:
        if args.device == "cpu":
            raise SystemExit("ft bench bw: --gpu and --device cpu contradict each other")
        return torch.device(resolve_gpu(args.gpu, "ft bench bw"))
    if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("ft bench bw: --device cuda but no usable CUDA device or driver was found")
    return torch.device("cuda", torch.cuda.current_device())


def main(argv: list[str] | None = None) -> int:
    """`ft bench ...` without the rest of ft's parser (for tests and scripts)."""
    parser = argparse.ArgumentParser(prog="ft")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)]))
