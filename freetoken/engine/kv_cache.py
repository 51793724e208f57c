"""The paged KV cache: fixed-size blocks of token slots, and the allocator that hands them out.

Per layer, keys and values are [NB, BS, Hk, Dh] tensors (NB blocks of BS tokens). A sequence
owns a block table (list of block ids); token position p lives in block table[p // BS] at
offset p % BS. The allocator exposes check/do pairs so the scheduler can plan before acting.
"""

from __future__ import annotations

import torch


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
    """Allocates every layer's K and V tensors and binds them to the attention modules."""

    def __init__(self, attention_layers, num_blocks: int, block_size: int, dtype, device):
        first = attention_layers[0]
        shape = (num_blocks, block_size, first.num_kv_heads, first.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in attention_layers]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in attention_layers]
        for layer, k, v in zip(attention_layers, self.k, self.v):
            layer.k_cache, layer.v_cache = k, v
        self.allocator = BlockAllocator(num_blocks, block_size)

    @staticmethod
    def bytes_per_token(attention_layers, dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return sum(2 * a.num_kv_heads * a.head_dim * elem for a in attention_layers)
