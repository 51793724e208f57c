#!/usr/bin/env python3
"""Stall sentinel: probe a running `ft serve` and catch the stalls users feel.

Every --interval seconds it sends one streaming completion over a raw socket (no client
library, so the probe itself cannot stall inside one), and records the time to the first
byte and to the last byte, plus the server process's read_bytes delta over the probe (from
/proc/PID/io). A probe slower than --threshold writes a snapshot of every server thread's
state and wchan and the process io counters to a report file. Bounded by --count or
--duration; prints a summary; exits 1 if it saw a stall, 2 if the server was unreachable.

    python tools/stall_sentinel.py --port 1919 --pid $(pgrep -f 'ft serve') --count 20
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path


def probe(host: str, port: int, model: str | None, api_key: str | None, max_tokens: int,
          timeout: float) -> dict:
    body = {"prompt": "The sentinel asks:", "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    if model:
        body["model"] = model
    raw = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\nConnection: close\r\n")
    if api_key:
        head += f"Authorization: Bearer {api_key}\r\n"
    t0 = time.monotonic()
    first = None
    data = b""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.settimeout(timeout)
        s.sendall(head.encode() + b"\r\n" + raw)
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            if first is None:
                first = time.monotonic()
            data += chunk
            if b"data: [DONE]" in data:
                break
    end = time.monotonic()
    status = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "?"
    return {"status": status, "ttfb_s": (first or end) - t0, "total_s": end - t0,
            "events": data.count(b"data: ")}


def read_io(pid: int | None) -> dict:
    if not pid:
        return {}
    try:
        return {k: int(v) for k, v in (line.split(": ") for line in
                                       Path(f"/proc/{pid}/io").read_text().splitlines())}
    except (OSError, ValueError):
        return {}


def snapshot(pid: int) -> dict:
    """Every thread's name, state and wchan, and the process io counters."""
    threads = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        info = {"tid": int(task.name)}
        for name in ("comm", "wchan"):
            try:
                info[name] = (task / name).read_text().strip()
            except OSError:
                info[name] = "?"
        try:
            for line in (task / "status").read_text().splitlines():
                if line.startswith("State:"):
                    info["state"] = line.split(":", 1)[1].strip()
        except OSError:
            info["state"] = "?"
        threads.append(info)
    return {"time": time.time(), "pid": pid, "io": read_io(pid), "threads": threads}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=1919)
    p.add_argument("--pid", type=int, help="the server's pid, for /proc io counters and snapshots")
    p.add_argument("--model")
    p.add_argument("--api-key", default=os.environ.get("FREETOKEN_API_KEY"))
    p.add_argument("--interval", type=float, default=45.0, help="seconds between probes")
    p.add_argument("--threshold", type=float, default=10.0, help="a probe slower than this is a stall")
    p.add_argument("--count", type=int, default=0, help="stop after this many probes (0: no limit)")
    p.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--timeout", type=float, default=300.0, help="give up on one probe after this")
    p.add_argument("--report", default="stall-report.jsonl", help="where stall snapshots go")
    args = p.parse_args(argv)
    if not args.count and not args.duration:
        p.error("give --count or --duration: the sentinel's run is bounded")

    start, results, stalls, failures = time.monotonic(), [], 0, 0
    while True:
        io_before = read_io(args.pid)
        try:
            r = probe(args.host, args.port, args.model, args.api_key, args.max_tokens, args.timeout)
        except OSError as e:
            r = {"status": "unreachable", "error": str(e), "ttfb_s": None, "total_s": None}
            failures += 1
        io_after = read_io(args.pid)
        r["read_bytes_delta"] = io_after.get("read_bytes", 0) - io_before.get("read_bytes", 0) if io_after else None
        r["stall"] = r["total_s"] is not None and r["total_s"] > args.threshold
        if r["stall"]:
            stalls += 1
            if args.pid:
                with open(args.report, "a") as f:
                    f.write(json.dumps({"probe": r, "snapshot": snapshot(args.pid)}) + "\n")
        results.append(r)
        print(json.dumps(r), flush=True)
        done = (args.count and len(results) >= args.count) or \
               (args.duration and time.monotonic() - start >= args.duration)
        if done:
            break
        time.sleep(args.interval)

    ok = [r for r in results if r["total_s"] is not None]
    worst = max((r["total_s"] for r in ok), default=None)
    print(f"sentinel: {len(results)} probes, {stalls} stalls (> {args.threshold}s), "
          f"{failures} unreachable, worst {worst if worst is None else round(worst, 3)}s"
          + (f"; snapshots in {args.report}" if stalls and args.pid else ""))
    if stalls:
        return 1
    return 2 if failures == len(results) else 0


if __name__ == "__main__":
    sys.exit(main())
