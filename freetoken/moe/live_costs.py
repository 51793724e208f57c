"""Hybrid's CPU cost as serving measures it.

Hybrid splits a step's misses between the copy stream and the CPU by two costs set at
startup: `ft bench bw`'s profile, or half a second of calibration. Both are read in other
conditions than serving's (another process busy beside the profile, the engine's own threads,
the DMA of the fetches sharing the host's memory), and a wrong CPU cost sets the wrong K for
the life of the server: on an H200 host a profile read beside a busy process put a CPU
expert at 1.9 ms where serving then ran it at ~0.1, and hybrid fetched 7 misses of 8.

So the runtime times each hybrid CPU call whose experts have a few rows each (their cost is
the read of their weights, cpu_s), and once a window of such calls is in, compares their
median cost per expert with the one it splits by: off by more than RATIO either way, it takes
the measured one and recomputes K. Where the CPU computes nothing (every miss fetched), one
miss in `probe_every` layer steps is left to it, so there is always something to measure.
"""

from __future__ import annotations

import collections
import statistics

FEW_ROWS = 4        # rows an expert up to which a CPU expert costs its weights' read (cpu_s)
RATIO = 1.5         # how far the measured cost may be from the assumed one before it is taken


class LiveCpuCost:
    """The CPU's cost of one expert of a few rows, from the last `window` hybrid CPU calls."""

    def __init__(self, window: int = 32, probe_every: int = 256):
        self.window, self.probe_every = window, probe_every
        self.samples: collections.deque[float] = collections.deque(maxlen=window)
        self.fresh = 0              # samples since the last comparison
        self.idle_steps = 0         # hybrid layer steps since the last sample
        self.revisions = 0

    def step(self) -> None:
        """A hybrid layer step began."""
        self.idle_steps += 1

    def wants_probe(self) -> bool:
        """Whether this step should leave a miss to the CPU that K would fetch."""
        return self.idle_steps >= self.probe_every

    def observe(self, seconds: float, rows: list[int]) -> None:
        """One CPU call: its wall time and the rows of each expert it computed."""
        if rows and max(rows) <= FEW_ROWS:
            self.samples.append(seconds / len(rows))
            self.fresh += 1
            self.idle_steps = 0

    def revised(self, cpu_s: float) -> float | None:
        """The measured cost per expert, when a window of fresh calls puts it more than RATIO
        away from cpu_s; else None."""
        if self.fresh < self.window:
            return None
        self.fresh = 0
        measured = statistics.median(self.samples)
        if cpu_s / RATIO <= measured <= cpu_s * RATIO:
            return None
        self.revisions += 1
        return measured
