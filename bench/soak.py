#!/usr/bin/env python3
"""Soak: N minutes of mixed traffic against a real `ft serve`, with the stall sentinel beside it.

    python bench/soak.py --minutes 30                 # starts its own server on the demo model
    python bench/soak.py --url http://127.0.0.1:1919 --pid PID --minutes 30

Traffic, from a few client threads: short chats (streamed and not), long prompts of several
thousand tokens, streams the client drops half way, and fuzzed bodies (tools/fuzz_bodies.py).
/health is probed every 100 ms throughout and tools/stall_sentinel.py runs beside it.

Reports: stalls > 10 s (goal 0), /health worst and p99 latency, the server's RSS at the start
and the end (goal flat), KV blocks free at the end (goal all), request errors (goal 0: a 5xx,
a dropped connection, a stream without its terminator).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import fuzz_bodies  # noqa: E402


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def post(url: str, path: str, body: dict, timeout: float = 300):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


class Soak:
    def __init__(self, url: str, seconds: float, seed: int):
        self.url, self.deadline, self.rng = url, time.monotonic() + seconds, random.Random(seed)
        self.errors: list[str] = []
        self.counts = {"short": 0, "long": 0, "dropped": 0, "fuzz": 0}
        self.health: list[float] = []
        self.lock = threading.Lock()

    def alive(self) -> bool:
        return time.monotonic() < self.deadline

    def error(self, what: str) -> None:
        with self.lock:
            self.errors.append(what)

    def short_chat(self, rng):
        stream = rng.random() < 0.5
        body = {"messages": [{"role": "user", "content": "Tell me about the sea."}],
                "max_tokens": rng.randint(4, 48), "stream": stream}
        with post(self.url, "/v1/chat/completions", body) as r:
            raw = r.read()
        if stream and not raw.rstrip().endswith(b"data: [DONE]"):
            self.error("a chat stream ended without [DONE]")

    def long_prompt(self, rng):
        n = rng.randint(2000, 6000)
        body = {"prompt": [rng.randrange(1, 1800) for _ in range(n)], "max_tokens": 8}
        with post(self.url, "/v1/completions", body) as r:
            if json.loads(r.read())["usage"]["prompt_tokens"] != n:
                self.error("a long prompt's usage is wrong")

    def dropped_stream(self, rng):
        body = {"prompt": "the keeper", "max_tokens": 200, "stream": True, "ignore_eos": True}
        with post(self.url, "/v1/completions", body) as r:
            for _ in range(rng.randint(1, 10)):
                r.readline()
        # closing the response drops the connection: the server aborts the request

    def fuzz(self, rng):
        route = rng.choice(fuzz_bodies.ROUTES)
        status = fuzz_bodies.send(self.url, route, fuzz_bodies.body_for(rng, route))
        if status >= 500:
            self.error(f"{route}: {status}")

    def client(self, seed: int):
        rng = random.Random(seed)
        kinds = [("short", self.short_chat, 5), ("long", self.long_prompt, 1),
                 ("dropped", self.dropped_stream, 2), ("fuzz", self.fuzz, 3)]
        while self.alive():
            name, fn, _ = rng.choices(kinds, weights=[k[2] for k in kinds])[0]
            try:
                fn(rng)
                with self.lock:
                    self.counts[name] += 1
            except urllib.error.HTTPError as e:
                if e.code >= 500:
                    self.error(f"{name}: HTTP {e.code}")
            except Exception as e:   # noqa: BLE001 - a dropped connection is an error here
                self.error(f"{name}: {type(e).__name__}: {e}")

    def prober(self):
        while self.alive():
            t0 = time.perf_counter()
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=60) as r:
                    r.read()
            except Exception as e:   # noqa: BLE001
                self.error(f"/health: {type(e).__name__}: {e}")
            self.health.append(time.perf_counter() - t0)
            time.sleep(0.1)


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = args.port
    log = open(Path(tempfile.gettempdir()) / f"soak-ft-serve-{port}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "freetoken.cli", "serve", "--port", str(port),
                             "--device", args.device, *args.serve_flags], stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if json.loads(r.read()).get("status") == "ok":
                    return proc, url
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not become ready")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: start one on the demo model)")
    p.add_argument("--pid", type=int, help="the running server's pid (RSS, sentinel snapshots)")
    p.add_argument("--port", type=int, default=19391)
    p.add_argument("--device", default="cpu")
    p.add_argument("--serve-flag", dest="serve_flags", action="append", default=[],
                   help="a flag for the server this starts (repeat)")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the report as JSON here too")
    args = p.parse_args(argv)
    proc = None
    url, pid = args.url, args.pid
    if url is None:
        proc, url = start_server(args)
        pid = proc.pid
    host, port = url.split("//")[1].split(":")
    try:
        seconds = args.minutes * 60
        soak = Soak(url, seconds, args.seed)
        rss0 = rss_mb(pid)
        sentinel = subprocess.Popen(
            [sys.executable, str(ROOT / "tools" / "stall_sentinel.py"), "--host", host, "--port",
             port, "--interval", "15", "--duration", str(seconds), "--threshold", "10",
             "--report", str(Path(tempfile.gettempdir()) / "soak-stalls.jsonl")]
            + (["--pid", str(pid)] if pid else []), stdout=subprocess.PIPE, text=True)
        threads = [threading.Thread(target=soak.client, args=(args.seed * 100 + i,))
                   for i in range(args.clients)] + [threading.Thread(target=soak.prober)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        sentinel_out, _ = sentinel.communicate(timeout=600)
        time.sleep(2)        # let dropped streams' aborts land
        with urllib.request.urlopen(url + "/v1/stats", timeout=30) as r:
            stats = json.loads(r.read())
        lat = sorted(soak.health) or [float("nan")]
        report = {
            "minutes": args.minutes, "requests": soak.counts, "errors": len(soak.errors),
            "error_samples": soak.errors[:10],
            "stalls_over_10s": sentinel_out.strip().splitlines()[-1] if sentinel_out.strip() else None,
            "sentinel_exit": sentinel.returncode,
            "health_probes": len(soak.health), "health_p99_ms": lat[int(0.99 * (len(lat) - 1))] * 1e3,
            "health_worst_ms": lat[-1] * 1e3, "rss_start_mb": rss0, "rss_end_mb": rss_mb(pid),
            "kv_blocks_free": stats["kv_blocks_free"], "kv_blocks_total": stats["kv_blocks_total"],
        }
        print(json.dumps(report, indent=2))
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        ok = (not soak.errors and sentinel.returncode == 0
              and stats["kv_blocks_free"] == stats["kv_blocks_total"])
        return 0 if ok else 1
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    sys.exit(main())
