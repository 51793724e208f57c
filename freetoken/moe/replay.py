"""Replay a routing trace through the real expert cache, and the offline optimum to compare with.

`replay` drives ExpertCache exactly as MoeRuntime does under the offload backend: per step
`begin_step`, then per layer `ensure(layer, experts)` and, when prefetch is on, `prefetch` of
the next layer's whole recorded guess (moe_prefetch=all), protecting this layer's experts. The
store behind it holds one-element experts, so a replay of thousands of steps costs only the
cache's own logic. A trace recorded from a live engine under offload with moe_prefetch=all
(or off, replayed with prefetch=False) replays to the same hits and fetches that engine
counted; the window limit of moe_prefetch=auto, CPU layers and hybrid's CPU misses are not
modelled.

`belady_fetches` is the fewest fetches any cache of that many slots can do on the trace
(Belady's MIN: on a miss evict the resident expert whose next use is furthest away, never one
the current layer's step uses). No prefetch can do better: prefetching moves a fetch earlier,
it does not remove one. So experts fetched per token against this bound says how far a policy
is from the best possible, and the bytes behind them are what the PCIe link must carry.
"""

from __future__ import annotations

import dataclasses
import heapq

import torch

from freetoken.moe.cache import ExpertCache
from freetoken.moe.policy import make_policy
from freetoken.moe.layout import ExpertLayout
from freetoken.moe.store import ExpertStore
from freetoken.moe.trace import RoutingTrace

NEVER = float("inf")


@dataclasses.dataclass
class ReplayResult:
    name: str
    slots: int
    tokens: int
    lookups: int
    hits: int
    fetched: int                  # experts copied in: demand misses plus prefetches
    prefetched: int = 0
    guessed: int = 0
    guessed_used: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def fetched_per_token(self) -> float:
        return self.fetched / self.tokens

    @property
    def stalls_per_token(self) -> float:
        """Demand misses per token: fetches the step had to wait for."""
        return (self.lookups - self.hits) / self.tokens

    @property
    def prefetch_accuracy(self) -> float | None:
        return self.guessed_used / self.guessed if self.guessed else None


def replay(trace: RoutingTrace, slots: int, policy: str = "lru", decay: float = 0.9,
           prefetch: bool = True, depth: int | None = None) -> ReplayResult:
    """depth: prefetch only the `depth` most likely guesses of each layer (None: all)."""
    store = ExpertStore(trace.layers, trace.num_experts, ExpertLayout(1, 1, torch.float32),
                        available_bytes=2 ** 62)
    cache = ExpertCache(store, trace.layers, slots, make_policy(policy, decay), torch.device("cpu"))
    guessed = used = 0
    for step in trace.steps:
        cache.begin_step()
        for i, route in enumerate(step.routes):
            if prefetch and route.guess is not None:
                guessed += len(route.guess)
                used += len(set(route.guess).intersection(route.experts))
            cache.ensure(route.layer, route.experts)
            nxt = step.routes[i + 1] if i + 1 < len(step.routes) else None
            if prefetch and nxt is not None and nxt.guess is not None:
                cache.prefetch(nxt.layer, nxt.guess, {(route.layer, e) for e in route.experts}, depth)
    name = policy + (f"({decay})" if policy == "lfu-decay" else "") + (" +prefetch" + (f" {depth}" if depth is not None else "") if prefetch else "")
    hits = sum(cache.hits.values())
    return ReplayResult(name, slots, trace.num_tokens, cache.num_lookups, hits,
                        cache.fetcher.num_experts_copied, cache.num_prefetched, guessed, used)


def belady_fetches(trace: RoutingTrace, slots: int) -> ReplayResult:
    """The offline optimum (see the module docstring); raises if a step needs more experts
    than there are slots."""
    events = [(r.layer, r.experts) for s in trace.steps for r in s.routes]
    uses: dict[tuple[int, int], list[int]] = {}
    for i, (layer, experts) in enumerate(events):
        for e in experts:
            uses.setdefault((layer, e), []).append(i)
    for u in uses.values():
        u.reverse()                 # pop() yields the next use
    resident: set = set()
    heap: list[tuple[float, tuple[int, int]]] = []   # (-next use, key), lazily invalidated
    next_use: dict[tuple[int, int], float] = {}
    lookups = hits = fetched = 0
    for i, (layer, experts) in enumerate(events):
        if len(experts) > slots:
            raise ValueError(f"a step of layer {layer} needs {len(experts)} experts, the cache "
                             f"has {slots} slots")
        keys = [(layer, e) for e in experts]
        misses = []
        for key in keys:
            uses[key].pop()                           # this use (i)
            next_use[key] = uses[key][-1] if uses[key] else NEVER
            lookups += 1
            if key in resident:
                hits += 1
            else:
                misses.append(key)
        protected = set(keys)
        for key in misses:
            if len(resident) >= slots:
                held = []
                while True:
                    neg, victim = heapq.heappop(heap)
                    if victim not in resident or -neg != next_use[victim]:
                        continue                      # stale entry
                    if victim in protected:
                        held.append((neg, victim))
                        continue
                    break
                for entry in held:
                    heapq.heappush(heap, entry)
                resident.discard(victim)
            resident.add(key)
            fetched += 1
        for key in keys:
            heapq.heappush(heap, (-next_use[key], key))
    return ReplayResult("belady (offline optimum)", slots, trace.num_tokens, lookups, hits, fetched)
