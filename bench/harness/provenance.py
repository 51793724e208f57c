"""What ran, where: the harness's checkout and host, package versions, GPUs, model hashes,
and the projection of a server's resolved configuration that the runner compares.

Versions come from package metadata, not imports, so recording them costs nothing and loads
no CUDA. Every field that cannot be read is None and its dotted name goes into a `missing`
list; the runner turns those into PROVENANCE_MISSING reasons.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Live counters and timings in /v1/instrumentation: they change while the configuration does not.
VOLATILE_KEYS = {"free_blocks", "counters", "warmup", "uptime_s", "served_name", "path",
                 "step_cost"}


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_state(repo: Path = REPO) -> dict:
    def git(*args):
        out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30)
        return out.stdout if out.returncode == 0 else None
    try:
        commit = git("rev-parse", "HEAD")
        porcelain = git("status", "--porcelain")
    except (OSError, subprocess.SubprocessError):
        commit = porcelain = None
    changed = porcelain.splitlines() if porcelain is not None else None
    return {"repo": str(repo), "commit": commit.strip() if commit else None,
            "dirty": bool(changed) if changed is not None else None,
            "changed_files": changed[:200] if changed else []}


def host() -> dict:
    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = int(line.split()[1]) * 1024
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"hostname": socket.gethostname(), "platform": platform.platform(),
            "cpu": cpu or platform.processor() or None, "logical_cpus": os.cpu_count(),
            "usable_cpus": usable, "ram_bytes": ram, "python": sys.version.split()[0]}


def nvidia_gpus() -> list[dict] | None:
    """Every GPU nvidia-smi lists (name, UUID, driver, memory); None without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=index,name,uuid,driver_version,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = []
    for line in out.stdout.strip().splitlines():
        idx, name, uuid, driver, mem = [f.strip() for f in line.split(",")]
        gpus.append({"index": int(idx), "name": name, "uuid": uuid, "driver": driver,
                     "memory_mib": int(mem) if mem.isdigit() else None})
    return gpus


def harness() -> dict:
    return {"git": git_state(), "host": host(), "gpus": nvidia_gpus(),
            "versions": {p: version(p) for p in ("freetoken", "torch", "triton", "transformers",
                                                 "accelerate")}}


def harness_missing(h: dict) -> list[str]:
    missing = [f"harness.git.{k}" for k in ("commit", "dirty") if h["git"][k] is None]
    return missing + [f"host.{k}" for k in ("cpu", "ram_bytes") if h["host"][k] is None]


def model_config_sha256(path: str | None) -> str | None:
    """sha256 of a checkpoint's config.json, when the folder is readable from here."""
    if not path:
        return None
    config = Path(path) / "config.json"
    try:
        return hashlib.sha256(config.read_bytes()).hexdigest()
    except OSError:
        return None


def gpu_by_uuid(uuid: str | None, gpus: list[dict] | None) -> dict | None:
    want = (uuid or "").lower().removeprefix("gpu-")
    for g in gpus or []:
        if want and g["uuid"].lower().removeprefix("gpu-") == want:
            return g
    return None


def config_projection(instrumentation: dict, config_sha256: str | None) -> dict:
    """The configuration part of /v1/instrumentation: live counters and names dropped, the
    model identified by its config hash rather than its path (a copy serves the same model)."""
    def strip(v):
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items() if k not in VOLATILE_KEYS}
        if isinstance(v, list):
            return [strip(x) for x in v]
        return v
    out = strip(instrumentation)
    out.setdefault("model", {})["config_sha256"] = config_sha256
    return out


def flatten(obj, prefix: str = "") -> dict:
    if isinstance(obj, dict) and obj:
        out = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: obj}


def diff(a: dict, b: dict) -> dict:
    """Dotted paths whose values differ: {path: [a's value, b's value]}."""
    fa, fb = flatten(a), flatten(b)
    return {k: [fa.get(k), fb.get(k)] for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)}


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()
