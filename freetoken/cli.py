"""`ft`: the command line. Flags are parsed here, and only here, into the layers' configs.

    ft serve [MODEL] [--model MODEL] [--host H] [--port P] ...   # the server
The serve flags keep the names of FreeToken's published CLI so gateways that launch it by its
flags can launch this one.
"""

from __future__ import annotations

import argparse
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
    s.add_argument("--kv-cache-tokens", type=_positive_int, metavar="N",
                   help="KV cache size in tokens (default: from free memory)")
    s.add_argument("--cpu-threads", type=_positive_int, metavar="N",
                   help="torch CPU threads (default: all cores but one)")
    s.add_argument("--api-key", help="require this key (also FREETOKEN_API_KEY; the flag wins)")
    s.add_argument("--max-body-mb", type=float, default=32.0, help="largest request body accepted")
    s.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"])

    c = sub.add_parser("ctl", help="ask a running server for its health, stats or models")
    c.add_argument("what", choices=["health", "stats", "models", "instrumentation"])
    c.add_argument("--url", help="the server (default: FREETOKEN_URL or http://127.0.0.1:1919)")
    c.add_argument("--api-key", help="the key (default: FREETOKEN_API_KEY)")
    c.add_argument("--timeout", type=float, default=10.0)
    return parser


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


def resolve_gpu(spec: str) -> str:
    """An index or a UUID (with or without the GPU- prefix) -> "cuda:N"; checks capability."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"ft serve: --gpu {spec}: no usable CUDA device or driver was found")
    count = torch.cuda.device_count()
    index = None
    if spec.isdigit():
        index = int(spec)
        if index >= count:
            raise SystemExit(f"ft serve: --gpu {spec}: only {count} GPU(s) visible")
    else:
        want = spec.lower().removeprefix("gpu-")
        for i in range(count):
            if str(torch.cuda.get_device_properties(i).uuid).lower() == want:
                index = i
        if index is None:
            raise SystemExit(f"ft serve: --gpu {spec}: no visible GPU has that UUID")
    major, minor = torch.cuda.get_device_capability(index)
    if major < 8:
        raise SystemExit(f"ft serve: GPU {index} has compute capability {major}.{minor}; "
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
                              cpu_threads=args.cpu_threads)
        engine = EngineConfig(model=model, device=_resolve_device(args), dtype=args.dtype,
                              max_model_len=args.max_seq_len_override,
                              kv_cache_tokens=args.kv_cache_tokens)
        scheduler = SchedulerConfig(max_prefill_length=args.max_prefill_length,
                                    max_running_requests=args.max_running_requests)
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
    return 2


if __name__ == "__main__":
    sys.exit(main())
