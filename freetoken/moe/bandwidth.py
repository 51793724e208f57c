"""Measured bandwidths that decide where experts run: what `ft bench bw` prints and saves.

Every figure is bytes moved per second of wall time, in GB/s (1e9):
  host copy      a large host tensor copied to another, read + write counted (as STREAM's
                 copy counts), with one thread and with all of them;
  H2D            host -> device copies from pinned and from pageable memory, per size;
  expert fetch   the real ExpertFetcher copying a decode step's top_k experts into pool slots
                 (pinned banks, and the staging ring that unpinned banks go through), expert
                 bytes / time, sync included;
  CPU experts    the real CPU expert kernel (moe.cpu.cpu_moe) on one token over top_k
                 experts, expert bytes streamed / time; and on ROWS tokens per expert, in
                 GFLOP/s (6 * D * I per row and expert): a prefill chunk's experts are
                 compute-bound on the CPU, so their cost grows with their rows;
  overlapped     the fetch and the CPU kernel running at once (a hybrid step), each one's rate
                 while the other runs: they share host DRAM, so these are what hybrid gets.
The expert figures are rates, so a profile measured on one expert shape prices another's
experts by their bytes and FLOPs (ExpertCosts.of).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

import torch

from freetoken.moe.cpu import cpu_moe, torch_threads
from freetoken.moe.fetch import ExpertFetcher
from freetoken.moe.store import ExpertStore

GB = 1e9
ROWS = 32      # tokens per expert in the compute-bound CPU measurement


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rate(fn: Callable[[], int], min_time: float, device: torch.device,
         stop: threading.Event | None = None) -> float:
    """Bytes per second of fn (which does its work and returns the bytes it moved), run after
    one warmup call until min_time has passed (or `stop` is set), synced at both ends."""
    fn()
    _sync(device)
    moved, t0 = 0, time.perf_counter()
    while True:
        moved += fn()
        elapsed = time.perf_counter() - t0
        if elapsed >= min_time or (stop is not None and stop.is_set()):
            break
    _sync(device)
    return moved / (time.perf_counter() - t0)


def host_copy_gbps(nbytes: int, threads: int, min_time: float) -> float:
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)

    def copy() -> int:
        dst.copy_(src)
        return 2 * src.nbytes
    with torch_threads(threads):
        return rate(copy, min_time, torch.device("cpu")) / GB


def host_read_gbps(threads: int, gib: float = 1.0) -> float:
    """The host's DRAM read ceiling with `threads` threads: a float32 matrix-vector product
    over `gib` GiB, best of 3 (the CPU experts' roofline in bench/cpu.py and bench/offload.py)."""
    with torch_threads(threads):
        w = torch.empty(int(gib * 2**28) // 4096, 4096).uniform_()
        x = torch.ones(4096)
        torch.mv(w, x)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            torch.mv(w, x)
            best = min(best, time.perf_counter() - t0)
        return w.numel() * 4 / best / 1e9


def h2d_gbps(device: torch.device, nbytes: int, pinned: bool, min_time: float) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)

    calls = 0

    def copy() -> int:
        nonlocal calls
        dst.copy_(src, non_blocking=pinned)
        calls += 1
        if calls % 16 == 0:      # bound the queue, so a run ends near min_time
            _sync(device)
        return nbytes
    return rate(copy, min_time, device) / GB


class ExpertBench:
    """One MoE layer's worth of experts in an ExpertStore, a pool of top_k slots on the device,
    and the two things a decode step does with them: fetch top_k experts, or compute top_k
    experts for one token on the CPU. The runtime's startup calibration uses the same calls
    on the live store and pool."""

    def __init__(self, store: ExpertStore, layer: int, pool: dict[str, torch.Tensor],
                 top_k: int, cpu_threads: int | None, force_staging: bool = False):
        """pool: device slots {name: [S, *shape]} (S >= top_k; slots 0..top_k-1 are used)."""
        self.store, self.layer, self.cpu_threads = store, layer, cpu_threads
        first = next(iter(pool.values()))           # w13, or a quantized layout's w13.q
        self.device = first.device
        self.top_k = min(top_k, first.shape[0], store.num_experts)
        self.fetcher = ExpertFetcher(store, pool, force_staging)
        self._turn = 0
        self.x = torch.randn(1, store.hidden).to(store.dtype)
        self.weights = torch.full((1, self.top_k), 1.0 / self.top_k, dtype=store.dtype)
        self.x_rows = torch.randn(ROWS, store.hidden).to(store.dtype)

    def _experts(self) -> list[int]:
        # Walk the bank so repeated calls do not keep hitting the same experts in a CPU cache.
        e = self.store.num_experts
        first = self._turn * self.top_k % e
        self._turn += 1
        return [(first + j) % e for j in range(self.top_k)]

    def fetch(self) -> int:
        self.fetcher.fetch(self.layer, list(zip(self._experts(), range(self.top_k))))
        event, self.fetcher.event = self.fetcher.event, None
        # Poll rather than Event.synchronize(), which spins a core: in a hybrid step the
        # engine thread only enqueues copies, so a spinning waiter would understate the CPU.
        while event is not None and not event.query():
            time.sleep(20e-6)
        return self.top_k * self.store.expert_bytes

    def cpu(self) -> int:
        ids = torch.tensor([self._experts()])
        with torch_threads(self.cpu_threads):
            cpu_moe(self.store.layout, self.x, self.store.cpu_bank(self.layer), self.weights, ids)
        return self.top_k * self.store.expert_bytes

    def cpu_rows(self) -> int:
        """ROWS tokens through the same top_k experts; returns the FLOPs done."""
        ids = torch.tensor([self._experts()]).expand(ROWS, -1)
        with torch_threads(self.cpu_threads):
            cpu_moe(self.store.layout, self.x_rows, self.store.cpu_bank(self.layer),
                    self.weights.expand(ROWS, -1), ids)
        return ROWS * self.top_k * 6 * self.store.hidden * self.store.width

    def measure_fetch(self, min_time: float) -> float:
        return rate(self.fetch, min_time, self.device) / GB

    def measure(self, min_time: float) -> dict[str, float]:
        """GB/s of fetch and CPU experts, each alone, then both at once; GFLOP/s of the CPU
        experts on ROWS tokens."""
        out = {"fetch_gbps": self.measure_fetch(min_time),
               "cpu_expert_gbps": rate(self.cpu, min_time, self.device) / GB,
               "cpu_expert_gflops": rate(self.cpu_rows, min_time, self.device) / GB}
        stop, result = threading.Event(), {}

        def fetch_loop():
            try:
                result["fetch"] = rate(self.fetch, 1e9, self.device, stop)
            except BaseException as e:      # re-raised below, on the measuring thread
                result["error"] = e
        worker = threading.Thread(target=fetch_loop, name="bw-fetch", daemon=True)
        worker.start()
        try:
            cpu = rate(self.cpu, min_time, self.device)
        finally:
            stop.set()
            worker.join()
        if "error" in result:
            raise result["error"]
        out["overlap_fetch_gbps"] = result["fetch"] / GB
        out["overlap_cpu_expert_gbps"] = cpu / GB
        return out


@dataclasses.dataclass(frozen=True)
class ExpertCosts:
    """What one expert costs a step: fetching it, or computing it on the CPU for n rows,
    max(cpu_s, n * cpu_row_s) (memory-bound for a few rows, compute-bound for many)."""
    fetch_s: float
    cpu_s: float
    cpu_row_s: float
    source: str = ""
    stage_s: float = 0.0     # engine-thread host copy per staged fetch (0: pinned, DMA only)

    @classmethod
    def of(cls, rates: dict[str, float], expert_bytes: int, hidden: int, width: int,
           source: str = "", host_copy_gbps: float | None = None) -> "ExpertCosts":
        """From measured rates, at the overlapped ones (what a hybrid step sees) when there.
        host_copy_gbps (read + write counted): the fetches are staged, and each one first
        copies the expert on the engine thread at that rate."""
        fetch = rates.get("overlap_fetch_gbps") or rates["fetch_gbps"]
        cpu = rates.get("overlap_cpu_expert_gbps") or rates["cpu_expert_gbps"]
        stage = 2 * expert_bytes / (host_copy_gbps * GB) if host_copy_gbps else 0.0
        return cls(expert_bytes / (fetch * GB), expert_bytes / (cpu * GB),
                   6 * hidden * width / (rates["cpu_expert_gflops"] * GB), source, stage)

    def cpu_cost(self, rows: int) -> float:
        return max(self.cpu_s, rows * self.cpu_row_s)

    def words(self) -> str:
        staged = f" (staged: {self.stage_s * 1e3:.3f} ms of it on the engine thread)" if self.stage_s else ""
        return (f"fetch {self.fetch_s * 1e3:.3f} ms/expert{staged}, CPU {self.cpu_s * 1e3:.3f} "
                f"ms/expert for one token and {self.cpu_row_s * 1e6:.2f} us more per token "
                f"({self.source})")
