"""ModelRunner: owns the loaded model and the KV cache, and runs one batched forward.

The scheduler hands it a list of SeqChunks (the new tokens of each scheduled sequence, where
they start, and the sequence's block table); it lays them out flat, builds the ForwardBatch
on the host, copies each tensor to the device once, and returns float32 logits for the
sequences that sample this step.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

import triton_kernels
from freetoken.engine.batch import ForwardBatch
from freetoken.engine.config import EngineConfig
from freetoken.engine.kv_cache import KVCache
from freetoken.models.loader import load_model
from freetoken.models.rope import build_cos_sin

log = logging.getLogger("freetoken.engine")


@dataclasses.dataclass
class SeqChunk:
    token_ids: list[int]     # this step's tokens of the sequence
    start: int               # position of token_ids[0] (= tokens already in the KV cache)
    block_ids: list[int]     # the sequence's block table, covering start + len(token_ids)
    want_logits: bool        # sample after this chunk (its last token is the newest)


class ModelRunner:
    def __init__(self, config: EngineConfig, progress=None):
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)
        triton_kernels.set_backend(config.kernel_backend)
        self.model, self.model_config, self.model_dir = load_model(
            config.model, self.device, config.dtype, progress)
        self.dtype = next(self.model.parameters()).dtype
        mc = self.model_config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        cos_sin = build_cos_sin(mc.rope, mc.head_dim, self.max_model_len, self.device)
        layers = self.model.attention_layers()
        for layer in layers:
            layer.cos_sin = cos_sin
        num_blocks = self._num_kv_blocks(layers)
        self.kv = KVCache(layers, num_blocks, config.block_size, self.dtype, self.device)
        log.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB)", num_blocks,
                 config.block_size, num_blocks * config.block_size,
                 num_blocks * config.block_size * KVCache.bytes_per_token(layers, self.dtype) / 2**20)

    def _num_kv_blocks(self, layers) -> int:
        """Enough blocks for at least one sequence of max_model_len, more if memory allows."""
        cfg = self.config
        per_token = KVCache.bytes_per_token(layers, self.dtype)
        if cfg.kv_cache_tokens is not None:
            tokens = cfg.kv_cache_tokens
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            reserve = total * (1 - cfg.gpu_memory_utilization)
            tokens = int(max(free - reserve, 0) // per_token)
        else:
            tokens = int(cfg.cpu_kv_cache_gb * 2**30 // per_token)
            tokens = min(tokens, max(4 * self.max_model_len, 65536))
        if tokens < self.max_model_len:
            if cfg.kv_cache_tokens is not None or self.device.type == "cuda":
                raise RuntimeError(
                    f"the KV cache holds {tokens} tokens, fewer than max_model_len "
                    f"{self.max_model_len}; lower max_model_len or give the cache more memory")
            tokens = self.max_model_len
        return (tokens + cfg.block_size - 1) // cfg.block_size

    @property
    def allocator(self):
        return self.kv.allocator

    def prepare(self, chunks: list[SeqChunk]) -> ForwardBatch:
        bs = self.config.block_size
        input_ids, positions, slots, cu, lens, logit_rows = [], [], [], [0], [], []
        max_blocks = max(len(c.block_ids) for c in chunks)
        tables = []
        for c in chunks:
            n = len(c.token_ids)
            input_ids.extend(c.token_ids)
            pos = range(c.start, c.start + n)
            positions.extend(pos)
            slots.extend(c.block_ids[p // bs] * bs + p % bs for p in pos)
            cu.append(cu[-1] + n)
            lens.append(c.start + n)
            tables.append(c.block_ids + [-1] * (max_blocks - len(c.block_ids)))
            if c.want_logits:
                logit_rows.append(cu[-1] - 1)
        dev = self.device

        def to_dev(data, dtype):
            t = torch.tensor(data, dtype=dtype, pin_memory=dev.type == "cuda")
            return t.to(dev, non_blocking=True)

        return ForwardBatch(
            input_ids=to_dev(input_ids, torch.int64),
            positions=to_dev(positions, torch.int64),
            cu_seqlens_q=to_dev(cu, torch.int32),
            seq_lens=to_dev(lens, torch.int32),
            block_tables=to_dev(tables, torch.int32),
            slot_mapping=to_dev(slots, torch.int64),
            logits_indices=to_dev(logit_rows, torch.int64),
            max_seqlen_q=max(len(c.token_ids) for c in chunks),
            num_seqs=len(chunks),
        )

    @torch.inference_mode()
    def run(self, chunks: list[SeqChunk], all_logits: bool = False) -> torch.Tensor:
        """One forward. Returns float32 logits [N, V]: one row per chunk with want_logits,
        or (all_logits) one row per token, for scoring."""
        batch = self.prepare(chunks)
        if all_logits:
            batch.logits_indices = torch.arange(batch.num_tokens, device=self.device)
        return self.model(batch)
