"""Prefix caching: full KV blocks named by a hash chain, and the pool of cached blocks.

A full block of BS tokens is named by sha256(parent's hash + its token ids + extra), so a
hash names the whole prefix up to the block's end: two sequences share a block exactly when
they share every token before it. `extra` is whatever else changes a block's KV (nothing
today; a LoRA id or multimodal inputs later).

PrefixCache maps hash -> block id for blocks whose KV is computed. A block nobody references
stays in the map, in a least-recently-used order, until an allocation needs it (the KV pool is
the cache: no separate size). The BlockAllocator owns one and keeps the reference counts.

Caching applies to per-token state (attention K/V, an MLA latent) only: a layer kind whose
state is not a per-token function of its prefix (a linear-attention or Mamba state) cannot
take a cached block without its state at the block's end as well. `unsupported_reason`
names such a kind, and caching is then off.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import hashlib

from freetoken.engine.cache_spec import PREFIX_CACHEABLE

ROOT_HASH = b""      # the parent of a sequence's first block


def hash_block(parent: bytes, token_ids, extra: bytes = b"") -> bytes:
    h = hashlib.sha256(parent)
    h.update(array.array("q", token_ids).tobytes())
    if extra:
        h.update(extra)
    return h.digest()


def extend_hashes(hashes: list[bytes], token_ids, block_size: int, num_tokens: int,
                  extra: bytes = b"") -> list[bytes]:
    """Append the hashes of the full blocks among the first num_tokens of token_ids(start, end)
    that `hashes` lacks; returns `hashes`. token_ids is a callable (Request.token_ids), so a
    long context is never joined or copied."""
    for b in range(len(hashes), num_tokens // block_size):
        parent = hashes[-1] if hashes else ROOT_HASH
        hashes.append(hash_block(parent, token_ids(b * block_size, (b + 1) * block_size), extra))
    return hashes


def unsupported_reason(specs: dict) -> str | None:
    """Why these cache specs cannot share prefix blocks, or None when they can. The hook for
    hybrid linear-attention families: their state spec is not a per-token kind (attention K/V,
    an MLA latent), so caching is off for them until a cached prefix restores that state too."""
    others = sorted({type(s).__name__ for s in specs.values() if not isinstance(s, PREFIX_CACHEABLE)})
    if others:
        return (f"the model keeps {', '.join(others)} state, which a cached prefix does not "
                f"restore (caching covers per-token K/V and MLA latents only)")
    return None


@dataclasses.dataclass
class PrefixStats:
    """Token counts over admissions (vLLM's prefix_cache_queries / prefix_cache_hits)."""
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float | None:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else None


class PrefixCache:
    """hash <-> block id for computed full blocks, and the LRU order of the unreferenced ones."""

    def __init__(self):
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        # Unreferenced cached blocks, least recently used first: evicted from the front.
        self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.stats = PrefixStats()

    @property
    def num_cached(self) -> int:
        """Blocks holding a cached prefix that nobody references (evictable)."""
        return len(self.idle)

    @property
    def num_hashed(self) -> int:
        """Blocks findable by hash, referenced or not."""
        return len(self.by_hash)

    def match(self, hashes: list[bytes]) -> list[int]:
        """The blocks of the longest cached prefix of the chain `hashes`."""
        out = []
        for h in hashes:
            block = self.by_hash.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def register(self, block: int, h: bytes) -> bool:
        """Name a computed full block; False when the hash already names another block (two
        sequences computed the same prefix at once: the first stays the cached one)."""
        if h in self.by_hash or block in self.hash_of:
            return False
        self.by_hash[h] = block
        self.hash_of[block] = h
        return True

    def park(self, block: int) -> bool:
        """A block's last reference went away: keep it cached (True) if it has a hash."""
        if block not in self.hash_of:
            return False
        self.idle[block] = None
        return True

    def unpark(self, block: int) -> None:
        self.idle.pop(block, None)

    def evict(self) -> int:
        """Forget the least recently used unreferenced block and return its id."""
        block, _ = self.idle.popitem(last=False)
        del self.by_hash[self.hash_of.pop(block)]
        return block

    def forget_all(self) -> list[int]:
        """Drop every hash (no later prefix matches); returns the unreferenced blocks, now plain
        free blocks. Referenced blocks keep their data and owners, only lose their names."""
        idle = list(self.idle)
        self.idle.clear()
        self.by_hash.clear()
        self.hash_of.clear()
        return idle
