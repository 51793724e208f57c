"""Bandwidth profiles: `ft bench bw` measures a machine once, the engine reads it at startup.

A profile is one JSON file per device, <cache>/bw/<device key>.json (the key is the GPU's UUID,
or cpu-HOSTNAME; cache is FREETOKEN_CACHE_DIR, else $XDG_CACHE_HOME/freetoken, else
~/.cache/freetoken). The runtime prices a fetch and a CPU expert from it (hybrid's K, and
auto's choice between offload and hybrid); without one it calibrates briefly at startup.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

from freetoken.moe.bandwidth import ROWS, ExpertBench, h2d_gbps, host_copy_gbps
from freetoken.moe.layout import ExpertLayout
from freetoken.moe.store import ExpertStore
from freetoken.utils import env
from freetoken.utils.device import device_key
from freetoken.utils.memory import host_available_bytes

log = logging.getLogger("freetoken.moe")
PROFILE_VERSION = 3      # 2: + cpu_expert_gflops; 3: CPU experts from the packed bank
H2D_SIZES = (2 * 2**20, 16 * 2**20, 256 * 2**20)


def profile_path(key: str) -> Path:
    return env.cache_dir() / "bw" / f"{key}.json"


def save_profile(profile: dict) -> Path:
    """Write atomically (a reader never sees half a file)."""
    path = profile_path(profile["key"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(profile, indent=1))
    tmp.replace(path)
    return path


def load_profile(key: str) -> dict | None:
    """The saved profile for this device, or None (missing; unreadable or stale ones are
    logged and ignored: the caller calibrates instead)."""
    path = profile_path(key)
    try:
        profile = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring the bandwidth profile %s: %s", path, e)
        return None
    if not isinstance(profile, dict) or profile.get("version") != PROFILE_VERSION:
        log.warning("ignoring the bandwidth profile %s: not a version %d profile (rerun `ft bench bw`)",
                    path, PROFILE_VERSION)
        return None
    experts = profile.get("experts")
    if not isinstance(experts, dict) or not all(
            isinstance(experts.get(k), (int, float)) and experts[k] > 0
            for k in ("fetch_gbps", "cpu_expert_gbps", "cpu_expert_gflops")):
        log.warning("ignoring the bandwidth profile %s: no expert figures", path)
        return None
    profile["path"] = str(path)
    return profile


def measure_profile(device: torch.device, hidden: int = 2048, width: int = 768,
                    dtype: torch.dtype = torch.bfloat16, top_k: int = 8,
                    cpu_threads: int | None = None, quick: bool = False,
                    progress=print) -> dict:
    """Everything `ft bench bw` reports, for this device and an expert shape (default:
    Qwen3-30B-A3B's). quick: shorter runs and smaller buffers (tests, a first look)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)      # pinning and copies in this card's context
    threads = cpu_threads or torch.get_num_threads()
    min_time = 0.05 if quick else 0.5
    copy_bytes = (64 if quick else 1024) * 2**20
    profile = {"version": PROFILE_VERSION, "key": device_key(device),
               "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torch": torch.__version__,
               "device": _describe(device), "cpu_threads": threads}
    progress(f"host copy, 1 and {threads} threads ...")
    profile["host_copy_gbps"] = {str(n): host_copy_gbps(copy_bytes, n, min_time)
                                 for n in sorted({1, threads})}
    if device.type == "cuda":
        progress("host -> device copies, pinned and pageable ...")
        sizes = H2D_SIZES[:2] if quick else H2D_SIZES
        profile["h2d_pinned_gbps"] = {str(n): h2d_gbps(device, n, True, min_time) for n in sizes}
        profile["h2d_pageable_gbps"] = {str(n): h2d_gbps(device, n, False, min_time)
                                        for n in sizes}
    num_experts = 2 * top_k if quick else max(32, 4 * top_k)
    layout = ExpertLayout(hidden, width, dtype)
    store = ExpertStore((0,), num_experts, layout, pin=device.type == "cuda")
    try:
        for bank in store.bank(0).values():
            bank.normal_(0, 0.02)
        # The CPU computes a hybrid layer's experts from its packed copy (the native kernel's
        # in place, or the fp16-weight GEMM's beside it): measure that product, not the
        # torch reference on the raw bank (16-bit torch products on the CPU: several times
        # slower, and hybrid's K would be set from them).
        store.pack_cpu_copy(0, host_available_bytes() // 2)
        pool = layout.empty(top_k, device=device)
        progress(f"expert fetch and CPU experts ({num_experts} experts of "
                 f"{store.expert_bytes / 2**20:.2f} MiB, top-{top_k}), alone and overlapped ...")
        bench = ExpertBench(store, 0, pool, top_k, threads)
        experts = bench.measure(min_time)
        if device.type == "cuda":
            staged = ExpertBench(store, 0, pool, top_k, threads, force_staging=True)
            experts["fetch_staged_gbps"] = staged.measure_fetch(min_time)
        profile["experts"] = {"hidden": hidden, "width": width, "dtype": str(dtype).removeprefix("torch."),
                              "expert_bytes": store.expert_bytes, "top_k": bench.top_k,
                              "pinned": store.pinned[0], "cpu_packed": 0 in store.cpu_banks,
                              **experts}
    finally:
        store.close()
    return profile


def _describe(device: torch.device) -> dict:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"kind": "cuda", "name": props.name, "capability": f"{props.major}.{props.minor}"}
    return {"kind": "cpu", "name": f"{os.cpu_count()} CPUs"}


def format_table(profile: dict) -> str:
    rows = [("what", "GB/s")]      # GB/s unless the row says otherwise
    for n, v in profile["host_copy_gbps"].items():
        rows.append((f"host DRAM copy, {n} thread(s) (read + write)", f"{v:.1f}"))
    for name, label in (("h2d_pinned_gbps", "pinned"), ("h2d_pageable_gbps", "pageable")):
        for n, v in profile.get(name, {}).items():
            rows.append((f"host -> device, {label}, {int(n) / 2**20:.0f} MiB", f"{v:.1f}"))
    e = profile["experts"]
    k, mib = e["top_k"], e["expert_bytes"] / 2**20
    rows += [(f"expert fetch, {k} x {mib:.2f} MiB ({'pinned' if e['pinned'] else 'pageable'} bank)",
              f"{e['fetch_gbps']:.1f}")]
    if "fetch_staged_gbps" in e:
        rows.append(("expert fetch through the staging ring", f"{e['fetch_staged_gbps']:.1f}"))
    rows += [(f"CPU experts, 1 token x {k} experts, {profile['cpu_threads']} threads",
              f"{e['cpu_expert_gbps']:.1f}"),
             (f"CPU experts, {ROWS} tokens x {k} experts (GFLOP/s)", f"{e['cpu_expert_gflops']:.1f}"),
             ("overlapped: expert fetch", f"{e['overlap_fetch_gbps']:.1f}"),
             ("overlapped: CPU experts", f"{e['overlap_cpu_expert_gbps']:.1f}")]
    width = max(len(r[0]) for r in rows)
    lines = [f"{profile['key']} ({profile['device']['name']}), {profile['measured_at']}"]
    lines += [f"{a.ljust(width)}  {b.rjust(7)}" for a, b in rows]
    return "\n".join(lines)
