"""How many guessed experts a prefetch may move without delaying the fetch behind it.

Layer L's prefetch of layer L+1's guesses goes out on the copy stream behind layer L's own
misses, while the GPU runs layer L's experts, layer L+1's attention and its router. Until the
host enqueues layer L+1's misses (its demand fetch) the link would otherwise sit idle: that
interval is the window. A prefetched expert that lands inside it costs nothing. One beyond it
delays layer L+1's demand fetch by a whole copy when the guess was wrong, and gains nothing
when it was right (it only replaces a copy the demand fetch would have made). So per layer
the runtime prefetches the guesses most likely to be used, as many as fit:

    count(L+1) = floor(window(L+1) / copy time of one expert)
    window(L+1) = EMA over steps of  t(demand of L+1 enqueued)
                                     - max(t(prefetch enqueued), t(copies queued before it done))
    copy time = expert bytes / the fetcher's achieved rate (copy-stream busy time)

At batch 1 on a fast GPU the window is a fraction of one copy, so little is prefetched; when
the GPU computes longer (bigger batches, long contexts, CPU layers) more is.

Timestamps: on CUDA an event recorded on a stream that runs nothing else stamps the moment
the host enqueues it, on the GPU's clock, comparable with the copy stream's events. They are
read once complete, a step later, so nothing waits. On the CPU copies are synchronous and
perf_counter stamps the same points, so the same code runs in CI.
"""

from __future__ import annotations

import collections
import time

import torch

SMOOTHING = 0.3       # EMA weight of the newest window


class PrefetchWindow:
    def __init__(self, device: torch.device):
        self.is_cuda = device.type == "cuda"
        self._marker = torch.cuda.Stream(device) if self.is_cuda else None
        self.window_s: dict[int, float] = {}          # layer -> EMA of its window, seconds
        self._open: dict[int, tuple] = {}              # layer -> (prefetch stamp, copies-done stamp)
        self._pending: collections.deque = collections.deque()   # (layer, issue, done, demand)

    def stamp(self):
        if not self.is_cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(self._marker)
        return ev

    def opened(self, layer: int, copies_done) -> None:
        """The prefetch for `layer` was just enqueued; copies_done: the copy stream's event
        after the copies queued before it (None: none pending), or its perf_counter time."""
        self._open[layer] = (self.stamp(), copies_done)

    def closed(self, layer: int) -> None:
        """The host is about to enqueue `layer`'s demand fetch."""
        opened = self._open.pop(layer, None)
        if opened is not None:
            self._pending.append((layer, *opened, self.stamp()))
        self._drain()

    def count(self, layer: int, copy_s: float | None) -> int | None:
        """Experts that fit in layer's window; None (no limit) until both are measured."""
        window = self.window_s.get(layer)
        if window is None or not copy_s:
            return None
        return int(window / copy_s)

    def _drain(self) -> None:
        while self._pending and self._complete(self._pending[0]):
            layer, issue, done, demand = self._pending.popleft()
            busy_after_issue = 0.0 if done is None else max(0.0, self._elapsed(issue, done))
            window = max(0.0, self._elapsed(issue, demand) - busy_after_issue)
            old = self.window_s.get(layer)
            self.window_s[layer] = window if old is None else old + SMOOTHING * (window - old)

    def _complete(self, entry) -> bool:
        return not self.is_cuda or all(e.query() for e in entry[1:] if e is not None)

    def _elapsed(self, a, b) -> float:
        return b - a if not self.is_cuda else a.elapsed_time(b) / 1e3
