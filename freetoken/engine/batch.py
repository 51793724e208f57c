"""ForwardBatch: the metadata of one forward pass over a flat mix of prefill chunks and decodes.

T tokens of B sequences laid end to end. Built on the host by the model runner, copied to
the device once per tensor, and passed explicitly down the model (no module-global context).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from freetoken.engine.kv_cache import KVCache


@dataclasses.dataclass
class ForwardBatch:
    input_ids: torch.Tensor      # [T] int64
    positions: torch.Tensor      # [T] int64, position of each token in its sequence
    cu_seqlens_q: torch.Tensor   # [B+1] int32, offsets of each sequence's tokens in T
    seq_lens: torch.Tensor       # [B] int32, context length after this step (cached + new)
    block_tables: torch.Tensor   # [B, M] int32, KV block ids per sequence (-1 padded)
    slot_mapping: torch.Tensor   # [T] int64, flat KV slot each new token's K/V is written to
    logits_indices: torch.Tensor  # [N] int64, rows of T whose logits are wanted
    max_seqlen_q: int            # longest query span in this batch (1 = pure decode)
    num_seqs: int
    kv: KVCache | None = None    # each layer's cache pool: batch.kv.layer(i)
    # Linear-attention layers (hybrid models): each sequence's state slot, and whether the
    # slot holds its state so far (False for a first prefill chunk: start from zeros).
    state_slots: torch.Tensor | None = None        # [B] int32
    has_initial_state: torch.Tensor | None = None  # [B] bool

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]
