"""The paged KV cache: fixed-size blocks of token slots, and the allocator that hands them out.

One pool per layer, allocated by the layer's spec (cache_spec.py; for attention: keys
[NB, BS, Hk, Dk] and values [NB, BS, Hk, Dv], NB blocks of BS tokens). Every layer shares the block tables: a sequence owns
a block table (list of block ids); token position p lives in block table[p // BS] at offset
p % BS of every layer's pool. The allocator exposes check/do pairs so the scheduler can plan
before acting; it counts references so full blocks of a shared prefix can be shared and kept
cached after their sequences end (prefix_cache.py). Layers find their pool through the ForwardBatch (`batch.kv.layer(i)`).
Linear-attention layers keep per-request state instead: a slot pool per layer and one
SlotAllocator for them all (state_slots.py).
"""

from __future__ import annotations

import torch

from freetoken.engine.cache_spec import CacheSpec, bytes_per_slot, bytes_per_token
from freetoken.engine.prefix_cache import PrefixCache
from freetoken.engine.state_slots import SlotAllocator


class BlockAllocator:
    """Blocks with reference counts. A block is empty (no KV worth keeping), used (referenced
    by a sequence; shared prefix blocks by several) or cached (unreferenced, holding a named
    prefix: see prefix_cache.py). Cached blocks count as free: an allocation takes empty ones
    first, then evicts cached ones least recently used first. empty + cached + used = total."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A stack: the most recently freed block is reused first (still warm in caches).
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        self.prefix = PrefixCache()

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: empty ones and unreferenced cached ones."""
        return len(self._free) + self.prefix.num_cached

    @property
    def num_empty(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return self.prefix.num_cached

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_allocate(self, n: int, reuse: list[int] = ()) -> bool:
        """n new blocks, after taking `reuse` (cached blocks, some of which may be idle and so
        would no longer be free)."""
        return n + sum(1 for b in reuse if self._refs[b] == 0) <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"KV cache exhausted: asked for {n} blocks, {self.num_free} free")
        fresh = min(n, len(self._free))
        taken = self._free[len(self._free) - fresh:][::-1]
        del self._free[len(self._free) - fresh:]
        taken += [self.prefix.evict() for _ in range(n - fresh)]
        for b in taken:
            self._refs[b] = 1
        return taken

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block. Reversed, so a sequence's last blocks are the
        least recently used of its cached ones: evicted before the prefix they extend."""
        for b in reversed(blocks):
            if self._refs[b] <= 0:
                raise RuntimeError(f"block {b} freed with no reference")
            self._refs[b] -= 1
            if self._refs[b] == 0 and not self.prefix.park(b):
                self._free.append(b)

    # -- prefix caching (check: match, can_allocate(reuse=); do: take, allocate) ----------
    def match(self, hashes: list[bytes]) -> list[int]:
        return self.prefix.match(hashes)

    def take(self, blocks: list[int]) -> None:
        """One more reference to each cached block (a sequence starts from this prefix)."""
        for b in blocks:
            if self._refs[b] == 0:
                self.prefix.unpark(b)
            self._refs[b] += 1

    def register(self, block: int, h: bytes) -> bool:
        """A used block's KV is now complete: name it, so later prompts can take it."""
        return self.prefix.register(block, h)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (after warmup); returns the blocks that were cached."""
        idle = self.prefix.forget_all()
        self._free.extend(idle)
        return len(idle)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def check(self) -> None:
        """Assert the invariants (tests): counts add up, no negative or stray references."""
        idle = set(self.prefix.idle)
        free = set(self._free)
        assert len(free) == len(self._free) and not free & idle
        assert all(self._refs[b] == 0 for b in free | idle)
        assert all(r >= 0 for r in self._refs)
        used = sum(1 for r in self._refs if r > 0)
        assert self.num_empty + self.num_cached + used == self.num_blocks
        assert idle <= set(self.prefix.hash_of)
        assert all(self.prefix.by_hash[h] == b for b, h in self.prefix.hash_of.items())


class KVCache:
    """Allocates each layer's pool from its spec; one allocator for the shared block tables,
    and (for the specs that keep per-request state, `allocate_slots`) one slot allocator for
    the state slots every such layer shares (state_slots.py)."""

    def __init__(self, specs: dict[int, CacheSpec], num_blocks: int, block_size: int, dtype,
                 device, num_slots: int = 0):
        self.specs = dict(specs)
        self.dtype = dtype
        self._pools: dict[int, tuple[torch.Tensor, ...]] = {}
        slotted = [i for i, s in self.specs.items() if hasattr(s, "allocate_slots")]
        if slotted and num_slots < 1:
            raise ValueError(f"layers {slotted} keep per-request state: give num_slots >= 1")
        for layer, spec in self.specs.items():
            if layer in slotted:
                self._pools[layer] = spec.allocate_slots(num_slots, dtype, device)
            elif hasattr(spec, "allocate"):
                self._pools[layer] = spec.allocate(num_blocks, block_size, dtype, device)
            else:
                raise TypeError(f"layer {layer}: no KV pool for a {type(spec).__name__}")
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.slots = SlotAllocator(num_slots) if slotted else None

    def layer(self, index: int) -> tuple[torch.Tensor, ...]:
        """The layer's pool as its spec allocated it (attention: k_cache [NB, BS, Hk, Dk],
        v_cache [NB, BS, Hk, Dv]; recurrent: state [S, Hv, Dk, Dv] f32, conv [S, C, W-1])."""
        return self._pools[index]

    @property
    def bytes_per_token(self) -> int:
        return bytes_per_token(self.specs, self.dtype)

    @property
    def bytes_per_slot(self) -> int:
        return bytes_per_slot(self.specs, self.dtype)

    def describe(self) -> list[dict]:
        """Per layer, what it keeps: for /v1/instrumentation."""
        out = []
        for i, s in self.specs.items():
            row = {"layer": i, "kind": type(s).__name__, "spec": s.describe(),
                   "bytes_per_token": s.bytes_per_token(self.dtype)}
            if hasattr(s, "bytes_per_slot"):
                row["bytes_per_slot"] = s.bytes_per_slot(self.dtype)
            out.append(row)
        return out

    def slots_report(self) -> dict | None:
        """The state slots (hybrid linear-attention models), for /v1/instrumentation."""
        if self.slots is None:
            return None
        return {"slots": self.slots.num_slots, "used": self.slots.num_used,
                "free": self.slots.num_free, "bytes_per_slot": self.bytes_per_slot,
                "bytes": self.slots.num_slots * self.bytes_per_slot}
