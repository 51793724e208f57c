"""A second core for work torch runs on one: a helper thread that takes half of it.

FBGEMM's one-thread fp16 GEMM (cpu_matmul.Fp16Weight below THREADED_ELEMENTS: the experts of
small and mid-sized models, e.g. [512, 1024]) runs a prefill chunk's experts on one core while
the other idles; torch's threaded entry point to it costs ~15 us a call, too much for a decode
step's hundreds of small products (cpu_matmul.py). So a CPU engine splits a prefill chunk's
experts in two and gives one half to a helper thread: torch's ops release the GIL, so the two
halves run on two cores. Banks whose experts take the threaded entry point already use every
core and are not split (Fp16Bank.threaded).

Two things make it pay (measured on the 2-core EPYC, one MoE layer of 512 tokens, 64
experts, top-8, D 1024, I 256: 72-92 -> 48-50 ms, the same bits):
- The helper's own OpenMP team is one thread (set once, in its initializer), so an op on it
  never wakes a pool of its own; the caller drops to one thread for the split (0.4 us a
  set/restore pair) so its ops do not wake the workers the helper's core is running.
- Work is split only from min_flops (SPLIT_FLOPS, ~12 ms of one core's FBGEMM): after any
  parallel op, the caller's idle OpenMP worker spins for milliseconds (libgomp's default
  GOMP_SPINCOUNT) on the core the helper needs, so a split loses ~10 ms of the helper's
  time. That layer of 64 experts, split against one thread: 8 and 64 tokens the same (4.4,
  ~15 ms), 128 the same (22 ms), 256 1.35x, 512 1.55x. A lower spin count for the whole
  process makes small splits pay (64 tokens 1.5x) but slowed batch-1 decode (19-22 ->
  22-29 ms a step), and libgomp reads it once, from the environment, before torch loads.

The split is an object its owner (the CPU engine) makes and hands to the banks it packs; it
holds the thread and its threshold, nothing else.
"""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence, TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")

SPLIT_FLOPS = 1e9   # a call's work before it is split (see the module's docstring)


def _one_thread_team() -> None:
    # torch's per-thread lazy init first (it would set the team back to the global count),
    # then this thread's OpenMP team to 1, then one parallel op to start it that way.
    torch.get_num_threads()
    torch.set_num_threads(1)
    torch.ones(1 << 17).sum()


class CpuSplit:
    """One helper thread that runs half of a split call (see the module's docstring).
    min_flops: the work from which a caller splits (worth)."""

    def __init__(self, min_flops: float = SPLIT_FLOPS):
        self.min_flops = min_flops
        threads = torch.get_num_threads()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ft-cpu-split",
                                        initializer=_one_thread_team)
        try:
            self._pool.submit(lambda: None).result()
        finally:
            # torch.set_num_threads also sets the count new threads start with: set it back.
            torch.set_num_threads(threads)

    def worth(self, flops: float) -> bool:
        return flops >= self.min_flops

    def map(self, fn: Callable[[Sequence[T]], list[R]], items: Sequence[T],
            weights: Sequence[int]) -> list[R]:
        """fn(items) as fn(first part) + fn(second part), the parts cut where the weights
        (rows per item) are halved, the second on the helper; the results in items' order.
        Called from the thread that owns the work; serial on a caller with one thread."""
        threads = torch.get_num_threads()
        cut = _halfway(weights)
        if threads < 2 or not 0 < cut < len(items):
            return fn(items)
        # The helper runs in the caller's grad and inference modes (both are per thread).
        modes = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        torch.set_num_threads(1)
        second = None
        try:
            second = self._pool.submit(_in_modes, modes, fn, items[cut:])
            first = fn(items[:cut])
            return first + second.result()
        finally:
            if second is not None and not second.done():
                concurrent.futures.wait([second])     # the caller's half raised: no work left behind
            torch.set_num_threads(threads)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _in_modes(modes: tuple[bool, bool], fn, part):
    grad, inference = modes
    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
        return fn(part)


def _halfway(weights: Sequence[int]) -> int:
    """The cut i for which weights[:i] and weights[i:] sum most nearly equal."""
    total, run, best, best_gap = sum(weights), 0, 0, sum(weights)
    for i, w in enumerate(weights, 1):
        run += w
        if abs(total - 2 * run) < best_gap:
            best, best_gap = i, abs(total - 2 * run)
    return best
