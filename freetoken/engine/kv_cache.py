"""The paged KV cache: fixed-size blocks of token slots, and the allocator that hands them out.

One pool per layer, shaped by the layer's AttentionSpec: keys [NB, BS, Hk, Dk] and values
[NB, BS, Hk, Dv] (NB blocks of BS tokens). Every layer shares the block tables: a sequence owns
a block table (list of block ids); token position p lives in block table[p // BS] at offset
p % BS of every layer's pool. The allocator exposes check/do pairs so the scheduler can plan
before acting. Layers find their pool through the ForwardBatch (`batch.kv.layer(i)`).
"""

from __future__ import annotations

import torch

from freetoken.engine.cache_spec import AttentionSpec, CacheSpec, bytes_per_token


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A stack: the most recently freed block is reused first (still warm in caches).
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV cache exhausted: asked for {n} blocks, {len(self._free)} free")
        taken = self._free[-n:] if n else []
        del self._free[len(self._free) - n:]
        return taken[::-1]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class KVCache:
    """Allocates each layer's pool from its spec; one allocator for the shared block tables."""

    def __init__(self, specs: dict[int, CacheSpec], num_blocks: int, block_size: int, dtype,
                 device):
        self.specs = dict(specs)
        self.dtype = dtype
        self._pools: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer, spec in self.specs.items():
            if not isinstance(spec, AttentionSpec):
                raise TypeError(f"layer {layer}: no KV pool for a {type(spec).__name__}")
            k = torch.zeros(num_blocks, block_size, spec.num_kv_heads, spec.head_dim,
                            dtype=dtype, device=device)
            v = torch.zeros(num_blocks, block_size, spec.num_kv_heads, spec.v_head_dim,
                            dtype=dtype, device=device)
            self._pools[layer] = (k, v)
        self.allocator = BlockAllocator(num_blocks, block_size)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache [NB, BS, Hk, Dk], v_cache [NB, BS, Hk, Dv]) of one layer."""
        return self._pools[index]

    @property
    def bytes_per_token(self) -> int:
        return bytes_per_token(self.specs, self.dtype)

    def describe(self) -> list[dict]:
        """Per layer, what it keeps: for /v1/instrumentation."""
        return [{"layer": i, "kind": type(s).__name__, "spec": s.describe(),
                 "bytes_per_token": s.bytes_per_token(self.dtype)} for i, s in self.specs.items()]
