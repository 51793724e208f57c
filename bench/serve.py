#!/usr/bin/env python3
"""Serving benchmark: TTFT, inter-token latency and throughput at several concurrencies
against a running `ft serve`, plus the cost of the HTTP path against LLM.generate.

    python bench/serve.py --url http://127.0.0.1:1919 --concurrency 1 4 16 64 --out serve.json
    python bench/serve.py --model DIR --overhead      # starts its own server, compares in-process

Streams are read over raw asyncio sockets (a client library's parsing would be measured
otherwise). Every number is printed with its conditions; --out writes them as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path


async def stream_one(host, port, body: dict, api_key: str | None) -> dict:
    raw = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n" + (f"Authorization: Bearer {api_key}\r\n" if api_key else ""))
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(head.encode() + b"\r\n" + raw)
    stamps, buf = [], b""
    while True:
        chunk = await reader.read(65536)
        if not chunk:
            break
        now = time.perf_counter()
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if b'"text"' in event:
                stamps.append(now)
            if b"[DONE]" in event:
                writer.close()
                return {"start": t0, "stamps": stamps}
    writer.close()
    return {"start": t0, "stamps": stamps}


def percentile(values, q):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run_level(host, port, concurrency, prompt, max_tokens, api_key, rounds):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    results = []
    for _ in range(rounds):
        results += await asyncio.gather(*(stream_one(host, port, body, api_key) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    ttft = [r["stamps"][0] - r["start"] for r in results if r["stamps"]]
    itl = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:])]
    tokens = sum(len(r["stamps"]) for r in results)
    return {"concurrency": concurrency, "requests": len(results), "tokens": tokens,
            "throughput_tok_s": tokens / wall, "ttft_p50_s": percentile(ttft, 0.5),
            "ttft_p99_s": percentile(ttft, 0.99), "itl_p50_s": percentile(itl, 0.5),
            "itl_p99_s": percentile(itl, 0.99), "per_stream_tok_s": statistics.median(
                [(len(r["stamps"]) - 1) / (r["stamps"][-1] - r["stamps"][0])
                 for r in results if len(r["stamps"]) > 1] or [0])}


def overhead(model: str, max_tokens: int, prompt: str) -> dict:
    """One stream through `ft serve` against LLM.generate on the same model, same process tree."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from freetoken import LLM, SamplingParams
    from serving import ServerProcess

    import os

    import torch

    # The same thread count `ft serve` picks, so both arms compute alike.
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    llm = LLM(model)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate([prompt], params)
    t0 = time.perf_counter()
    for _ in range(3):
        llm.generate([prompt], params)
    direct = 3 * max_tokens / (time.perf_counter() - t0)
    del llm
    with ServerProcess(model) as server:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True}

        async def three():
            await stream_one("127.0.0.1", server.port, body, None)
            t = time.perf_counter()
            for _ in range(3):
                await stream_one("127.0.0.1", server.port, body, None)
            return 3 * max_tokens / (time.perf_counter() - t)
        served = asyncio.run(three())
    return {"direct_tok_s": direct, "served_tok_s": served, "server_cost": 1 - served / direct}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:1919")
    p.add_argument("--api-key")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt", default="Tell me a long story about the sea.")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--overhead", action="store_true", help="also measure the HTTP path's cost (needs --model)")
    p.add_argument("--model", help="checkpoint for --overhead")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    report = {"conditions": vars(args), "levels": []}
    if args.overhead:
        if not args.model:
            p.error("--overhead needs --model")
        report["overhead"] = overhead(args.model, args.max_tokens, args.prompt)
        o = report["overhead"]
        print(f"HTTP path: direct {o['direct_tok_s']:.1f} tok/s, served {o['served_tok_s']:.1f} tok/s, "
              f"server costs {100 * o['server_cost']:.1f}% (goal < 10%)")
    else:
        host, port = args.url.split("//", 1)[1].rsplit(":", 1)
        for c in args.concurrency:
            level = asyncio.run(run_level(host, int(port), c, args.prompt, args.max_tokens,
                                          args.api_key, args.rounds))
            report["levels"].append(level)
            print(f"c={c:3d}: {level['throughput_tok_s']:8.1f} tok/s total, per stream "
                  f"{level['per_stream_tok_s']:.1f} tok/s, TTFT p50 {1e3 * (level['ttft_p50_s'] or 0):.1f} ms, "
                  f"ITL p50 {1e3 * (level['itl_p50_s'] or 0):.2f} ms p99 {1e3 * (level['itl_p99_s'] or 0):.2f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
