"""What a layer keeps per token, declared by the layer and allocated by the engine.

A model's `cache_specs()` maps each layer index that keeps state to its spec; KVCache allocates
one pool per spec and the layer reads its own through the ForwardBatch it is given. Bytes per
token come from the specs, so the engine sizes the cache (and /v1/instrumentation reports it)
for whatever mix of layers a family has. Later kinds (an MLA latent, a recurrent state) are new
spec classes here: each says how many bytes a token costs and allocates its own paged pool
(`allocate`), so KVCache never branches on the kind.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Paged K [.., Hk, Dk] and V [.., Hk, Dv] per token. sliding_window: the layer attends to
    the last W positions only (its blocks still hold every token: the window bounds the work,
    not yet the memory)."""
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    sliding_window: int | None = None

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return self.num_kv_heads * (self.head_dim + self.v_head_dim) * elem

    def allocate(self, num_blocks: int, block_size: int, dtype, device) -> tuple[torch.Tensor, ...]:
        """(k [NB, BS, Hk, Dk], v [NB, BS, Hk, Dv]): what `KVCache.layer(i)` returns."""
        k = torch.zeros(num_blocks, block_size, self.num_kv_heads, self.head_dim,
                        dtype=dtype, device=device)
        v = torch.zeros(num_blocks, block_size, self.num_kv_heads, self.v_head_dim,
                        dtype=dtype, device=device)
        return k, v

    def describe(self) -> str:
        window = f", window {self.sliding_window}" if self.sliding_window else ""
        return f"attention K/V {self.num_kv_heads}x{self.head_dim}/{self.v_head_dim}{window}"


@dataclasses.dataclass(frozen=True)
class LatentSpec:
    """Multi-head latent attention (DeepSeek-V3, GLM-4.7-Flash): one shared row per token,
    [c_kv (kv_lora_rank) | k_pe (rope_dim)], whatever the head count; the heads' keys and
    values are the latent times kv_b_proj, folded into the query and output at attention time.
    A per-token function of the prefix, so prefix caching covers it as it covers K/V."""
    kv_lora_rank: int
    rope_dim: int

    @property
    def width(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.width * torch.empty((), dtype=dtype).element_size()

    def allocate(self, num_blocks: int, block_size: int, dtype, device) -> tuple[torch.Tensor, ...]:
        """(latent [NB, BS, L+R],): what `KVCache.layer(i)` returns."""
        return (torch.zeros(num_blocks, block_size, self.width, dtype=dtype, device=device),)

    def describe(self) -> str:
        return f"MLA latent {self.kv_lora_rank}+{self.rope_dim}"


# Kinds whose state is a per-token function of the prefix: a cached block restores them.
PREFIX_CACHEABLE = (AttentionSpec, LatentSpec)


def bytes_per_token(specs: dict[int, CacheSpec], dtype: torch.dtype) -> int:
    return sum(spec.bytes_per_token(dtype) for spec in specs.values())


@dataclasses.dataclass(frozen=True)
class RecurrentStateSpec:
    """A linear-attention layer's state (Gated DeltaNet): per request, not per token. One slot
    per running request (state_slots.py): the recurrent state [Hv, Dk, Dv] in float32 (it sums
    the whole history, so it never rounds to the model dtype) and the causal conv's last W-1
    inputs [C, W-1] in the model dtype. A request's slot is the same row of every such layer."""
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_channels: int
    conv_kernel: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return 0            # the state does not grow with the context

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return (self.num_v_heads * self.head_k_dim * self.head_v_dim * 4
                + self.conv_channels * (self.conv_kernel - 1) * elem)

    def allocate_slots(self, num_slots: int, dtype, device) -> tuple[torch.Tensor, ...]:
        """(state [S, Hv, Dk, Dv] float32, conv [S, C, W-1]): what `KVCache.layer(i)` returns."""
        state = torch.zeros(num_slots, self.num_v_heads, self.head_k_dim, self.head_v_dim,
                            dtype=torch.float32, device=device)
        conv = torch.zeros(num_slots, self.conv_channels, self.conv_kernel - 1, dtype=dtype,
                           device=device)
        return state, conv

    def describe(self) -> str:
        return (f"recurrent state {self.num_v_heads}x{self.head_k_dim}x{self.head_v_dim} f32, "
                f"conv {self.conv_channels}x{self.conv_kernel - 1} per request")


def bytes_per_slot(specs: dict, dtype: torch.dtype) -> int:
    """Bytes one request's state slot costs across every layer that keeps one."""
    return sum(s.bytes_per_slot(dtype) for s in specs.values() if hasattr(s, "allocate_slots"))


CacheSpec = AttentionSpec | LatentSpec | RecurrentStateSpec      # the union of the kinds there are
