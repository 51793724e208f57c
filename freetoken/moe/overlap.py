"""How many guessed experts a prefetch may move without delaying the fetch behind it.

Layer L's prefetch of layer L+1's guesses goes out on the copy stream behind layer L's own
misses, while the GPU runs layer L's experts, layer L+1's attention and its router. Until the
host enqueues layer L+1's misses (its demand fetch) the link would otherwise sit idle: that
interval is the window. A prefetched expert that lands inside it costs nothing. One beyond it
delays layer L+1's demand fetch by a whole copy when the guess was wrong, and gains nothing
when it was right (it only replaces a copy the demand fetch would have made). So per layer
the runtime prefetches the guesses most likely to be used, as many as fit:

    count(L+1) = the copies that fit whole in window(L+1), plus the next one when the part of
                 it the window hides is worth more than it costs: its tail delays the demand
                 fetch always, and saves a whole copy with the probability a that a guess of
                 its rank is right, so it goes when  window left > (1 - a) * copy
    window(L+1) = GPU time from "layer L's experts may run" (its misses have landed) to
                  "layer L+1's router is done" (events on the compute stream)
                + host time from the sync for L+1's routing to L+1's demand fetch
    copy time = expert bytes / the fetcher's achieved rate (copy-stream busy time)

Neither term depends on how much was prefetched, so the count does not feed back on itself.
Windows are kept per layer and per size of step (rows rounded to a power of two): a prefill
chunk computes far longer than a decode step, and one average of both would prefetch
everything in decode. At batch 1 on a fast GPU the window is a fraction of one copy, so
little is prefetched; when the GPU computes longer (big batches, CPU layers) more is.

The start is stamped after the prefetch is enqueued, so the host time that takes is not
counted as compute. On CUDA both events are complete once the host has synced for L+1's
routing, so reading them never waits. On the CPU perf_counter stamps the same points (copies
are synchronous there, and a CPU computes slowly, so the window holds most guesses), and CI
runs the same logic.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

SMOOTHING = 0.3       # EMA weight of the newest window


def rows_bucket(rows: int) -> int:
    """Steps of 1, 2-3, 4-7, ... rows share a window."""
    return max(1, rows).bit_length()


class PrefetchWindow:
    def __init__(self, device: torch.device):
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.window_s: dict[tuple[int, int], float] = {}    # (layer, rows bucket) -> EMA seconds
        self.latest_s: dict[int, float] = {}                 # layer -> its latest EMA (reports)
        self._start: dict[int, object] = {}
        self._routed: dict[int, object] = {}
        self._synced: dict[int, float] = {}

    def started(self, layer: int) -> None:
        """The experts of the layer before `layer` may run now (their misses are waited for),
        and `layer`'s prefetch is about to be enqueued."""
        self._start[layer] = self._stamp()

    def routed(self, layer: int) -> None:
        """`layer`'s router output is enqueued; the host syncs for it next."""
        if layer in self._start:
            self._routed[layer] = self._stamp()

    def synced(self, layer: int) -> None:
        if layer in self._routed:
            self._synced[layer] = self._now()

    def closed(self, layer: int, rows: int) -> None:
        """The host is about to enqueue `layer`'s demand fetch: the window is complete."""
        start, routed = self._start.pop(layer, None), self._routed.pop(layer, None)
        synced = self._synced.pop(layer, None)
        if start is None or routed is None or synced is None:
            return
        gpu = routed - start if not self.is_cuda else start.elapsed_time(routed) / 1e3
        window = max(0.0, gpu) + (self._now() - synced)
        key = (layer, rows_bucket(rows))
        old = self.window_s.get(key)
        self.window_s[key] = window if old is None else old + SMOOTHING * (window - old)
        self.latest_s[layer] = self.window_s[key]

    def count(self, layer: int, rows: int, copy_s: float | None,
              accuracy: Callable[[int], float] = lambda rank: 0.0) -> int | None:
        """Guesses worth prefetching for layer in a step of `rows` (see the module docstring);
        accuracy(rank): how often a guess of that rank (0 = most likely) is right. None (no
        limit) until the window and the copy time are measured."""
        window = self.window_s.get((layer, rows_bucket(rows)))
        if window is None or not copy_s:
            return None
        whole = int(window / copy_s)
        left = window - whole * copy_s
        return whole + (left > (1.0 - accuracy(whole)) * copy_s)

    def _now(self) -> float:
        return time.perf_counter()

    def _stamp(self):
        """A point on the compute stream: a timing event on CUDA, the host clock elsewhere."""
        if not self.is_cuda:
            return self._now()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev
