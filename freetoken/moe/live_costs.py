"""Hybrid's CPU cost as serving measures it.

Hybrid splits a step's misses between the copy stream and the CPU by two costs set at
startup: `ft bench bw`'s profile, or half a second of calibration. Both are read in other
conditions than serving's (another process busy beside the profile, the engine's own threads,
the DMA of the fetches sharing the host's memory), and a wrong CPU cost sets the wrong K for
the life of the server: on an H200 host a profile read beside a busy process put a CPU
expert at 1.9 ms where serving then ran it at ~0.1, and hybrid fetched 7 misses of 8.

So the runtime times each hybrid CPU call whose experts have a few rows each (decode's calls,
whose cost is mostly the read of their weights) against what its costs predicted for them,
and once a window of such calls is in, takes their median ratio: off by more than RATIO either
way, the CPU's costs are scaled by it and K recomputed. Where the CPU computes nothing (every
miss fetched), one miss of a few rows is left to it once in `probe_every` layer steps, so there
is something to measure. auto that chose offload (the CPU priced out at startup) has no CPU
calls to time and is not revisited.
"""

from __future__ import annotations

import collections
import statistics

FEW_ROWS = 4        # rows an expert up to which a CPU expert costs its weights' read (cpu_s)
RATIO = 1.5         # how far the measured cost may be from the assumed one before it is taken


class LiveCpuCost:
    """How the CPU's expert costs compare with what serving measures: the ratio of measured to
    predicted time of the last `window` few-row hybrid CPU calls."""

    def __init__(self, window: int = 32, probe_every: int = 256):
        self.window, self.probe_every = window, probe_every
        self.ratios: collections.deque[float] = collections.deque(maxlen=window)
        self.fresh = 0              # samples since the last comparison
        self.idle_steps = 0         # hybrid layer steps since the last sample or probe
        self.revisions = 0

    def step(self) -> None:
        """A hybrid layer step began."""
        self.idle_steps += 1

    def probe(self, rows: list[int]) -> bool:
        """Whether this step, whose misses K fetches all (rows: each miss's, busiest first),
        leaves its last miss to the CPU: it has a few rows and no sample came for a while."""
        if not rows or rows[-1] > FEW_ROWS or self.idle_steps < self.probe_every:
            return False
        self.idle_steps = 0
        return True

    def observe(self, seconds: float, rows: list[int], predicted: float) -> None:
        """One CPU call: its wall time, the rows of each expert it computed, and the time the
        costs predicted for it."""
        if rows and max(rows) <= FEW_ROWS and predicted > 0:
            self.ratios.append(seconds / predicted)
            self.fresh += 1
            self.idle_steps = 0

    def revised(self) -> float | None:
        """The factor to scale the CPU's costs by, when a window of fresh calls puts their
        median ratio beyond RATIO either way; else None."""
        if self.fresh < self.window:
            return None
        self.fresh = 0
        ratio = statistics.median(self.ratios)
        if 1 / RATIO <= ratio <= RATIO:
            return None
        self.revisions += 1
        self.ratios.clear()         # the next window is measured against the revised costs
        return ratio
