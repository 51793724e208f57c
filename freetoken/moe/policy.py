"""Replacement policies of the GPU expert cache. Keys are (layer, expert).

The cache tells a policy when a key is used (`touch`; `used_elsewhere` when a step used an
expert it did not cache, e.g. one hybrid ran on the CPU), placed (`insert`; a prefetch places
keys `cold`: not used yet, so a wrong guess is the first thing evicted instead of pushing
out experts that were really used), dropped (`remove`) and when a forward step begins
(`advance`); `victim(protected)` names the key to evict, never
one in `protected` (the experts the current layer's step uses), or None if all are protected.

  lru        evict the least recently used key.
  lfu-decay  every use adds 1 to a key's count and every step multiplies all counts by
             `decay`; evict the cached key with the lowest count, ties to the least recently
             used. Counts outlive eviction: an expert that comes back starts from its decayed
             count, one never used from 0 (so a cold insert needs nothing more). Forgetting
             them on eviction made a popular expert that was once pushed out the next victim,
             and when a step's experts exceed the cache (batch 8 at a 25% cache) it thrashed
             like LRU: bench/cache_policy.py measures both. The table holds at most every
             (layer, expert) pair. Counts are kept as count * decay**-step (one global
             rescale, not a pass over every key per step); the cached keys sit in a heap with
             lazy deletion, so every call is O(log n).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict

Key = tuple[int, int]


class LRUPolicy:
    name = "lru"

    def __init__(self):
        self._order: OrderedDict[Key, None] = OrderedDict()   # oldest first

    def advance(self) -> None:
        pass

    def insert(self, key: Key, cold: bool = False) -> None:
        self._order[key] = None
        # Cold keys go to the old end: the next victim unless a use promotes them first.
        self._order.move_to_end(key, last=not cold)

    def touch(self, key: Key) -> None:
        self._order.move_to_end(key)

    def used_elsewhere(self, key: Key) -> None:
        pass                              # recency of an uncached key: nothing to keep

    def remove(self, key: Key) -> None:
        del self._order[key]

    def victim(self, protected) -> Key | None:
        # Protected keys were just used, so they sit at the young end: the scan is short.
        return next((k for k in self._order if k not in protected), None)

    def score(self, key: Key) -> float:
        return 0.0


class LFUDecayPolicy:
    name = "lfu-decay"
    _RESCALE_AT = 1e150

    def __init__(self, decay: float):
        self.decay = decay
        self._unit = 1.0                  # what one use adds now: decay ** -steps
        self._raw: dict[Key, float] = {}  # count * decay ** -step
        self._cached: set[Key] = set()
        self._stamp: dict[Key, int] = {}  # last use, for ties
        self._clock = itertools.count()
        self._heap: list[tuple[float, int, Key]] = []

    def advance(self) -> None:
        self._unit /= self.decay
        if self._unit > self._RESCALE_AT:
            self._raw = {k: v / self._unit for k, v in self._raw.items()}
            self._unit = 1.0
            self._rebuild()

    def insert(self, key: Key, cold: bool = False) -> None:
        self._raw.setdefault(key, 0.0)      # an expert seen before comes back with its count
        self._cached.add(key)
        self._stamp[key] = next(self._clock)
        self._push(key)

    def touch(self, key: Key) -> None:
        self._raw[key] += self._unit
        self._stamp[key] = next(self._clock)
        self._push(key)

    def used_elsewhere(self, key: Key) -> None:
        self._raw[key] = self._raw.get(key, 0.0) + self._unit    # not cached: no heap entry

    def remove(self, key: Key) -> None:
        self._cached.discard(key)           # its count stays: see the module docstring

    def score(self, key: Key) -> float:
        """The decayed count of key now."""
        return self._raw[key] / self._unit

    def victim(self, protected) -> Key | None:
        held, found = [], None
        while self._heap:
            entry = heapq.heappop(self._heap)
            raw, stamp, key = entry
            if key not in self._cached or self._raw[key] != raw or self._stamp[key] != stamp:
                continue                          # stale: the key was used or removed since
            if key in protected:
                held.append(entry)
                continue
            found = key
            held.append(entry)                    # stays valid until the cache removes it
            break
        for entry in held:
            heapq.heappush(self._heap, entry)
        return found

    def _push(self, key: Key) -> None:
        heapq.heappush(self._heap, (self._raw[key], self._stamp[key], key))
        if len(self._heap) > 4 * len(self._cached) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(self._raw[k], self._stamp[k], k) for k in self._cached]
        heapq.heapify(self._heap)


def make_policy(name: str, decay: float = 0.9):
    if name == "lru":
        return LRUPolicy()
    if name == "lfu-decay":
        return LFUDecayPolicy(decay)
    raise ValueError(f"unknown expert cache policy {name!r}")
