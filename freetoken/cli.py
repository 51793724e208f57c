"""`ft`: the command line. Flags are parsed here, and only here, into the layers' configs.

    ft serve [MODEL] [--model MODEL] [--host H] [--port P] ...   # the server
The serve flags keep the names of FreeToken's published CLI so gateways that launch it by its
flags can launch this one.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from freetoken.utils import env


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ft", description="FreeToken: serve MoE models from one GPU")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve a model over HTTP (OpenAI API)")
    s.add_argument("model_pos", nargs="?", metavar="MODEL",
                   help="checkpoint folder or cached hub id; none: the built-in demo model")
    s.add_argument("--model", help="the same as MODEL")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=1919)
    s.add_argument("--served-model-name", help="the model name clients use (default: the folder's name)")
    s.add_argument("--gpu", help="the GPU to use: an index or a UUID (implies --device cuda)")
    s.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    s.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    s.add_argument("--max-seq-len-override", type=_positive_int, metavar="N",
                   help="context length to serve (default: the model's)")
    s.add_argument("--max-prefill-length", type=_positive_int, default=2048, metavar="N",
                   help="tokens computed per step: longer prompts are prefilled in chunks")
    s.add_argument("--max-running-requests", type=_positive_int, default=64, metavar="N")
    s.add_argument("--max-step-time-ms", type=float, default=1000.0, metavar="MS",
                   help="shorten prefill chunks so a step (and so every running stream's gap "
                        "between tokens) takes about this long; 0: chunks of --max-prefill-length")
    s.add_argument("--kv-cache-tokens", type=_positive_int, metavar="N",
                   help="KV cache size in tokens (default: from free memory)")
    s.add_argument("--max-state-slots", type=_positive_int, metavar="N",
                   help="hybrid linear-attention models: per-request state slots (default: from "
                        "free memory, at most 256); --max-running-requests is lowered to it")
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of a prompt's cached prefix and keep finished requests' "
                        "full blocks cached until the space is needed (default: on)")
    s.add_argument("--enforce-eager", action="store_true",
                   help="a CPU engine runs its layers' modules at every decode step instead of "
                        "replaying them as one native program")
    s.add_argument("--lm-head-dtype", choices=("auto", "int8"), default="auto",
                   help="a CPU engine's output layer: auto (as the checkpoint has it) or int8 "
                        "(a scale a row: half a 16-bit head's bytes a decode step; lossy)")
    s.add_argument("--cpu-threads", type=_positive_int, metavar="N",
                   help="torch CPU threads (default: all cores but one)")
    s.add_argument("--api-key", help="require this key (also FREETOKEN_API_KEY; the flag wins)")
    s.add_argument("--max-body-mb", type=float, default=32.0, help="largest request body accepted")
    s.add_argument("--reasoning-parser", default="auto", metavar="auto|off|NAME",
                   help="split the model's thinking from its answer: auto (the family's markers), "
                        "off, or a parser name (qwen3, deepseek_r1, deepseek_v3, glm45, gpt_oss, "
                        "kimi_k2, minimax_m2, minimax_m3, mistral, gemma4)")
    s.add_argument("--tool-call-parser", default="auto", metavar="auto|NAME",
                   help="read tool calls in the model's markup: auto (from the model type and its "
                        "chat template), or hermes, qwen3_coder, glm45, glm47, gpt_oss (openai), "
                        "deepseek_v3, deepseek_v31, deepseek_v32, kimi_k2, minimax_m2, mistral, "
                        "llama4_pythonic, gemma4")
    s.add_argument("--ping-interval", type=float, default=15.0, metavar="S",
                   help="streams send a keep-alive ping after S seconds without output")
    s.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="S",
                   help="on SIGTERM/SIGINT, let running requests finish for up to S seconds, then abort them")
    s.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                   help='CORS: origins browsers may call from, a JSON list or comma-separated '
                        '(["*"]: any); default none')
    _add_moe_flags(s)
    s.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"])

    c = sub.add_parser("ctl", help="ask a running server for its health, stats or models")
    c.add_argument("what", choices=["health", "stats", "models", "instrumentation"])
    c.add_argument("--url", help="the server (default: FREETOKEN_URL or http://127.0.0.1:1919)")
    c.add_argument("--api-key", help="the key (default: FREETOKEN_API_KEY)")
    c.add_argument("--timeout", type=float, default=10.0)

    from freetoken.bench_cli import add_bench_parser    # flags only; the harness loads when run
    add_bench_parser(sub)
    return parser


def _add_moe_flags(s) -> None:
    from freetoken.moe.config import BACKENDS, POLICIES, PREFETCH, parse_cpu_layers

    def cpu_layers(text):
        try:
            return parse_cpu_layers(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    g = s.add_argument_group("experts (MoE placement)")
    g.add_argument("--moe-backend", choices=BACKENDS, default="auto",
                   help="where experts live and run (auto: resident if everything fits, else offload or "
                        "hybrid from the measured fetch and CPU costs; see ft bench bw)")
    size = g.add_mutually_exclusive_group()
    size.add_argument("--moe-cache-size", type=_positive_int, metavar="SLOTS", help="GPU expert cache slots")
    size.add_argument("--moe-cache-rate", type=float, metavar="FRAC", help="GPU expert cache as a fraction of all experts")
    size.add_argument("--moe-cache-auto", action="store_true", help="size the cache from free GPU memory (default)")
    g.add_argument("--moe-cache-policy", choices=POLICIES, default="lfu-decay",
                   help="what the expert cache evicts (bench/cache_policy.py compares them)")
    g.add_argument("--moe-cpu-layers", type=cpu_layers, metavar="IDS|COUNT|FRACTION",
                   help="compute these layers' experts on the CPU (0,3,5 | 4 | 0.25)")
    g.add_argument("--moe-cpu-threads", type=_positive_int, metavar="N")
    g.add_argument("--moe-hybrid-k", type=_positive_int, metavar="K",
                   help="hybrid: misses fetched per layer and step (default: from measured bandwidth)")
    g.add_argument("--pin-budget-gb", type=float, metavar="GB",
                   help="host RAM to page-lock for experts (also FREETOKEN_PIN_BUDGET_GB)")
    g.add_argument("--kv-reserve-tokens", type=_positive_int, default=8192, metavar="N",
                   help="KV tokens to keep free when sizing the expert cache")
    g.add_argument("--moe-prefetch", choices=PREFETCH, default="auto",
                   help="fetch the next layer's likely experts ahead: auto = as many as the link "
                        "carries while the GPU computes, all = every guess, off = none")
    g.add_argument("--no-moe-prefetch", dest="moe_prefetch", action="store_const", const="off",
                   help="the same as --moe-prefetch off (a baseline)")
    g.add_argument("--moe-trace", metavar="PATH",
                   help="record every MoE layer's experts and prefetch guesses per step into PATH "
                        "(JSON, written at shutdown, or after 10000 steps, when recording stops) for "
                        "`python bench/cache_policy.py --trace PATH`; needs experts in host RAM "
                        "(--moe-backend offload, hybrid or cpu)")
    g.add_argument("--moe-lfu-decay", type=float, default=0.9, metavar="D",
                   help="lfu-decay: every step multiplies each expert's use count by D (0 < D <= 1)")


def _moe_config(args):
    from freetoken.moe.config import MoeConfig

    pin = args.pin_budget_gb if args.pin_budget_gb is not None else env.pin_budget_gb()
    if args.moe_trace:
        from freetoken.moe.trace import check_trace_path
        check_trace_path(args.moe_trace)          # fail now, not after hours of serving
    return MoeConfig(backend=args.moe_backend, cache_size=args.moe_cache_size,
                     cache_rate=args.moe_cache_rate, cache_policy=args.moe_cache_policy,
                     cpu_layers=args.moe_cpu_layers, cpu_threads=args.moe_cpu_threads,
                     hybrid_k=args.moe_hybrid_k, pin_budget_gb=pin,
                     kv_reserve_tokens=args.kv_reserve_tokens, prefetch=args.moe_prefetch,
                     lfu_decay=args.moe_lfu_decay, trace_path=args.moe_trace)


def _origins(value: str | None) -> tuple[str, ...]:
    """--allowed-origins as vLLM spells it (a JSON list) or comma-separated."""
    if not value:
        return ()
    if value.lstrip().startswith("["):
        try:
            items = json.loads(value)
        except ValueError as e:
            raise SystemExit(f"ft serve: --allowed-origins is not a JSON list: {e}") from None
    else:
        items = value.split(",")
    return tuple(str(o).strip() for o in items if str(o).strip())


def _resolve_device(args) -> str:
    import torch

    if args.gpu is not None:
        if args.device == "cpu":
            raise SystemExit("ft serve: --gpu and --device cpu contradict each other")
        return resolve_gpu(args.gpu)
    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("ft serve: --device cuda but no usable CUDA device or driver was found")
    return args.device


def resolve_gpu(spec: str, prog: str = "ft serve") -> str:
    """An index or a UUID (with or without the GPU- prefix) -> "cuda:N"; checks capability."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"{prog}: --gpu {spec}: no usable CUDA device or driver was found")
    from freetoken.utils.device import find_gpu
    try:
        index = find_gpu(spec)
    except ValueError as e:
        raise SystemExit(f"{prog}: --gpu {spec}: {e}") from None
    major, minor = torch.cuda.get_device_capability(index)
    if major < 8:
        raise SystemExit(f"{prog}: GPU {index} has compute capability {major}.{minor}; "
                         f"FreeToken's Triton kernels need 8.0 or newer")
    return f"cuda:{index}"


def serve(args) -> int:
    from pathlib import Path

    from freetoken.engine.config import EngineConfig
    from freetoken.scheduler.config import SchedulerConfig
    from freetoken.server.config import ServerConfig
    from freetoken.server.serve import run_server

    if args.model and args.model_pos and args.model != args.model_pos:
        raise SystemExit("ft serve: give the model once (MODEL or --model)")
    model = args.model or args.model_pos
    if model is None:
        from freetoken.demo.builtin import demo_model_path
        model = str(demo_model_path())
    name = args.served_model_name or Path(model.rstrip("/")).name
    try:
        server = ServerConfig(host=args.host, port=args.port, served_model_name=name,
                              model_path=model, api_key=args.api_key or env.api_key(),
                              max_body_bytes=int(args.max_body_mb * 2**20),
                              cpu_threads=args.cpu_threads, reasoning_parser=args.reasoning_parser,
                              tool_call_parser=args.tool_call_parser,
                              ping_interval_s=args.ping_interval,
                              shutdown_timeout_s=args.shutdown_timeout,
                              allowed_origins=_origins(args.allowed_origins))
        engine = EngineConfig(model=model, device=_resolve_device(args), dtype=args.dtype,
                              max_model_len=args.max_seq_len_override,
                              kv_cache_tokens=args.kv_cache_tokens, moe=_moe_config(args),
                              max_state_slots=args.max_state_slots,
                              enforce_eager=args.enforce_eager,
                              lm_head_dtype=args.lm_head_dtype)
        scheduler = SchedulerConfig(max_prefill_length=args.max_prefill_length,
                                    max_step_time_s=args.max_step_time_ms / 1e3 or None,
                                    max_running_requests=args.max_running_requests,
                                    enable_prefix_caching=args.enable_prefix_caching)
    except ValueError as e:
        raise SystemExit(f"ft serve: {e}") from None
    return run_server(server, engine, scheduler)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = (getattr(args, "log_level", None) or env.log_level() or "info").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return serve(args)
    if args.command == "ctl":
        from freetoken.ctl import run
        return run(args.what, args.url or env.server_url(), args.api_key or env.api_key(), args.timeout)
    if args.command == "bench":
        from freetoken.bench_cli import run as bench
        return bench(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
