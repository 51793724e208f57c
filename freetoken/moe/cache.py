"""The GPU expert cache: one pool of S expert slots shared by every offloaded layer.

    pool {name: [S, *shape]}                  the layout's tensors (w13 [S, 2I, D], w2 [S, D, I],
                                              biases...) on the device (a separate buffer on the CPU)
    slot_of  {(layer, expert): slot}          which slot holds what (host side)
    slot_map(layer) -> [E] int32 on device    expert id -> slot, -1 if absent: what the MoE
                                              kernel reads, re-uploaded only when it changed

`ensure(layer, experts)` makes a layer's experts resident for its step: hits are touched,
misses take a free slot or evict the policy's victim, and the copies go out as one batch.
The experts of that step are protected: neither its own misses nor a prefetch may evict
them. Counters: hits and misses per layer (hits + misses = lookups), bytes fetched, evictions.
"""

from __future__ import annotations

import dataclasses

import torch

from freetoken.moe.fetch import ExpertFetcher
from freetoken.moe.store import ExpertStore

Key = tuple[int, int]


@dataclasses.dataclass
class EnsureResult:
    hits: list[int]                 # experts that were resident
    fetched: list[int]              # misses copied in by this call
    skipped: list[int]              # misses left out (max_fetch reached): the caller runs them
    evicted: list[Key]
    event: object = None            # CUDA: the copy stream's event after every copy issued so
                                    # far (this call's included); None: nothing left to wait for


class ExpertCache:
    def __init__(self, store: ExpertStore, layers: tuple[int, ...], num_slots: int, policy,
                 device: torch.device, force_staging: bool = False):
        if num_slots < 1:
            raise ValueError("the expert cache needs at least one slot")
        self.store, self.layers, self.num_slots, self.policy = store, tuple(layers), num_slots, policy
        self.device = torch.device(device)
        s = store
        self.pool = s.layout.empty(num_slots, device=self.device)
        self.fetcher = ExpertFetcher(store, self.pool, force_staging)
        self.slot_of: dict[Key, int] = {}
        self.owner: list[Key | None] = [None] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))     # pop() hands out slot 0 first
        self._host_map = {l: torch.full((s.num_experts,), -1, dtype=torch.int32) for l in self.layers}
        # A separate tensor even on the CPU, so the upload path runs there too.
        self._dev_map = {l: m.to(self.device, copy=True) for l, m in self._host_map.items()}
        self._dirty: set[int] = set()
        self.hits = {l: 0 for l in self.layers}
        self.misses = {l: 0 for l in self.layers}
        self.num_evictions = 0
        self.num_prefetched = 0

    @property
    def pool_bytes(self) -> int:
        return sum(t.nbytes for t in self.pool.values())

    @property
    def num_lookups(self) -> int:
        return sum(self.hits.values()) + sum(self.misses.values())

    def reset_counters(self) -> None:
        self.hits = dict.fromkeys(self.hits, 0)
        self.misses = dict.fromkeys(self.misses, 0)
        self.num_evictions = self.num_prefetched = 0
        self.fetcher.reset_counters()

    def begin_step(self) -> None:
        self.policy.advance()

    def ensure(self, layer: int, experts: list[int], max_fetch: int | None = None,
               keep: frozenset | set = frozenset()) -> EnsureResult:
        """Make `experts` (distinct, in priority order) of layer resident; fetch at most
        max_fetch misses (None: all). Returns what hit, what was fetched and what was not.
        keep: more keys nothing may evict (a wave whose kernel is not enqueued yet)."""
        protected = {(layer, e) for e in experts} | set(keep)
        result = EnsureResult([], [], [], [])
        moves = []
        for e in experts:
            key = (layer, e)
            if key in self.slot_of:
                self.policy.touch(key)
                result.hits.append(e)
            elif max_fetch is not None and len(result.fetched) >= max_fetch:
                self.policy.used_elsewhere(key)       # run on the CPU: still a use to count
                result.skipped.append(e)
            else:
                slot = self._take_slot(protected, result.evicted)
                if slot is None:
                    raise RuntimeError(
                        f"expert cache of {self.num_slots} slots cannot hold the "
                        f"{len(experts)} experts layer {layer} needs in this step")
                self._place(key, slot)
                self.policy.insert(key)
                self.policy.touch(key)
                moves.append((e, slot))
                result.fetched.append(e)
        self.hits[layer] += len(result.hits)
        self.misses[layer] += len(result.fetched) + len(result.skipped)
        self.fetcher.fetch(layer, moves)
        result.event = self.fetcher.event
        return result

    def skip(self, layer: int, experts: list[int]) -> None:
        """Count experts of layer that this step computes elsewhere (hybrid's CPU share) as
        misses and as uses, as ensure does for the ones past max_fetch."""
        for e in experts:
            self.policy.used_elsewhere((layer, e))
        self.misses[layer] += len(experts)

    def prefetch(self, layer: int, experts: list[int], protected: set[Key],
                 limit: int | None = None) -> list[int]:
        """Start fetching the guessed `experts` of layer, evicting nothing in `protected` (the
        current step's experts) nor another guess. Not a lookup: counters stay as they are."""
        keep = protected | {(layer, e) for e in experts}
        moves, evicted = [], []
        for e in experts:
            if limit is not None and len(moves) >= limit:
                break
            key = (layer, e)
            if key in self.slot_of:
                continue
            slot = self._take_slot(keep, evicted)
            if slot is None:
                break
            self._place(key, slot)
            self.policy.insert(key, cold=True)
            moves.append((e, slot))
        self.num_prefetched += len(moves)
        self.fetcher.fetch(layer, moves)
        return [e for e, _ in moves]

    def wait(self) -> None:
        """The compute stream waits for every copy issued so far."""
        self.fetcher.wait()

    def wait_for(self, event) -> None:
        """The compute stream waits for the copies up to an EnsureResult's event only."""
        self.fetcher.wait_for(event)

    def slot_map(self, layer: int) -> torch.Tensor:
        if layer in self._dirty:
            host = self._host_map[layer]
            cuda = self.device.type == "cuda"
            # A pinned snapshot: the host map may change before an async copy would run.
            self._dev_map[layer].copy_(host.pin_memory() if cuda else host, non_blocking=cuda)
            self._dirty.discard(layer)
        return self._dev_map[layer]

    def host_slot_map(self, layer: int) -> torch.Tensor:
        return self._host_map[layer]

    def _take_slot(self, protected: set[Key], evicted: list[Key]) -> int | None:
        if self._free:
            return self._free.pop()
        victim = self.policy.victim(protected)
        if victim is None:
            return None
        slot = self.slot_of.pop(victim)
        self.policy.remove(victim)
        self._host_map[victim[0]][victim[1]] = -1
        self._dirty.add(victim[0])
        self.owner[slot] = None
        self.num_evictions += 1
        evicted.append(victim)
        return slot

    def _place(self, key: Key, slot: int) -> None:
        self.slot_of[key] = slot
        self.owner[slot] = key
        self._host_map[key[0]][key[1]] = slot
        self._dirty.add(key[0])
