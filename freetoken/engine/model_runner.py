"""ModelRunner: owns the loaded model and the KV cache, and runs one batched forward.

The scheduler hands it a list of SeqChunks (the new tokens of each scheduled sequence, where
they start, and the sequence's block table); it lays them out flat, builds the ForwardBatch
on the host, copies each tensor to the device once, and returns float32 logits for the
sequences that sample this step.

Startup decides where the experts live (EngineConfig.moe, resolved by freetoken.moe.plan)
before any weight is allocated: resident on the device, or in a host-RAM expert store with a
GPU expert cache (offload/hybrid) or CPU compute, run by a MoeRuntime hooked into each layer.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

import triton_kernels
from freetoken.engine.batch import ForwardBatch
from freetoken.engine.config import EngineConfig
from freetoken.engine.cpu_graph import ROWS, CpuDecodeGraph
from freetoken.engine.cache_spec import bytes_per_slot, bytes_per_token
from freetoken.engine.kv_cache import KVCache
from freetoken.models.loader import (checkpoint_files, init_model, load_weights, materialize,
                                     resolve_model_path)
from freetoken.models.layers.linear import Linear, pack_for_cpu
from freetoken.models.quant.apply import describe_parts
from freetoken.moe.plan import DeviceMemory, MoePlan, MoeShape, plan_moe
from freetoken.moe.runtime import MoeRuntime
from freetoken.moe.store import ExpertStore
from freetoken.utils.heap import huge_pages, keep_freed_heap
from freetoken.utils.memory import host_available_bytes

log = logging.getLogger("freetoken.engine")

# State slots an automatically sized pool holds at most (vLLM's default max_num_seqs).
AUTO_STATE_SLOTS = 256
HYBRID_COPY_RESERVE = 4 << 30   # host RAM packed hybrid copies leave free, at least
# Auto expert-cache sizing leaves hybrid models room for this many requests' state slots
# (max_state_slots when set), as it leaves the KV cache kv_reserve_tokens: without it the
# cache could take the memory the first request's state needs.
STATE_RESERVE_SLOTS = 16


@dataclasses.dataclass
class SeqChunk:
    token_ids: list[int]     # this step's tokens of the sequence
    start: int               # position of token_ids[0] (= tokens already in the KV cache)
    block_ids: list[int]     # the sequence's block table, covering start + len(token_ids)
    want_logits: bool        # sample after this chunk (its last token is the newest)
    state_slot: int = -1     # hybrid models: the sequence's state slot (state_slots.py)


class ModelRunner:
    def __init__(self, config: EngineConfig, progress=None):
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            keep_freed_heap()   # a CPU forward's host tensors reuse pages, not fault new ones
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)
        triton_kernels.check_backend(config.kernel_backend)
        self.model_dir = resolve_model_path(config.model)
        model, mc = init_model(self.model_dir, config.dtype)    # config and family errors first
        self.model_config = mc
        self.dtype = next(model.parameters()).dtype
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        blocks = model.moe_blocks()
        self.moe_plan = self._plan_moe(model, blocks)
        self.expert_store = self.moe = None
        if self.moe_plan.experts_on_host:
            self.expert_store = self._expert_store(blocks)
        host_banks = {blocks[i].experts: self.expert_store.bank(i)
                      for i in (self.expert_store.layers if self.expert_store else ())}
        self.cache_specs = model.cache_specs()
        model = materialize(model, self.device, host_banks)
        if self.device.type == "cpu":       # the weights a CPU forward streams: 2 MB pages
            huge_pages(list(model.parameters()))                  # (before they are written)
        load_weights(model, checkpoint_files(self.model_dir), progress)
        self.model = model.eval().requires_grad_(False)
        # A CPU engine's second core for what torch runs on one (a prefill chunk's experts:
        # triton_kernels/cpu_split.py), handed to the expert banks it packs.
        self.cpu_split = triton_kernels.CpuSplit() if self.device.type == "cpu" else None
        if self.device.type == "cpu":
            keep = ()
            if config.lm_head_dtype != "auto":      # (its own packing, not a 16-bit one too)
                kind = config.lm_head_dtype
                if not isinstance(self.model.lm_head, Linear):
                    raise ValueError(f"lm_head_dtype {kind}: this checkpoint's lm_head is "
                                     f"stored quantized already "
                                     f"({type(self.model.lm_head).__name__})")
                packed = self.model.lm_head.pack_cpu_int8()
                keep = (self.model.lm_head,)
                log.info("CPU: lm_head read as %s with a scale a row (%.1f MiB)", kind,
                         packed / 2**20)
            packed = pack_for_cpu(self.model, keep)
            if packed:
                log.info("CPU: projections packed for the CPU's 16-bit or INT4 GEMM (%.1f MiB "
                         "beside their weights)", packed / 2**20)
            if self.expert_store is None:       # resident experts: the CPU computes them all
                packed = sum(b.experts.pack_cpu(split=self.cpu_split,
                                                spare_bytes=self._spare_host_bytes())
                             for b in blocks.values())
                if packed:
                    log.info("CPU: experts repacked for the CPU's fp16-weight or INT4 GEMM "
                             "(%.1f MiB)", packed / 2**20)
        if self.expert_store is not None:
            asked = self.moe_plan.backend            # auto may turn to hybrid in the runtime
            if asked == "hybrid":                     # packed before the CPU's cost is measured
                self._pack_hybrid_copies(self.moe_plan.cache_layers)
            self.moe = self._moe_runtime(blocks)
            # Layers only the CPU computes: packed for its fp16-weight or INT4 GEMM, as a CPU
            # engine's, one layer at a time (its checkpoint tensors freed before the next one
            # packs).
            for i in self.moe_plan.cpu_layers:
                packed = self.expert_store.pack_cpu(i, self.cpu_split, self._spare_host_bytes())
                if packed is not None:
                    blocks[i].experts.pack_cpu(packed)
            if asked != "hybrid" and self.moe.plan.backend == "hybrid":
                # auto chose hybrid from the unpacked CPU's cost: its fetch budget stays
                # on the safe side (more fetches than the packed CPU would need)
                self._pack_hybrid_copies(self.moe.plan.cache_layers)
        elif config.moe.trace_path:
            log.warning("moe_trace=%s records nothing: every expert stays on the device (%s); "
                        "a trace needs experts in host RAM (e.g. moe_backend=offload)",
                        config.moe.trace_path, self.moe_plan.reason)
        if self.device.type == "cpu":       # and the copies packing wrote (decoded, fused)
            huge = huge_pages(_cpu_weights(self.model), collapse=True)
            log.info("CPU: %.1f MiB of weights on 2 MB pages", huge / 2**20)
        self.model.init_rope(self.max_model_len, self.device)
        num_slots = self._num_state_slots()
        per_slot = bytes_per_slot(self.cache_specs, self.dtype)
        num_blocks = self._num_kv_blocks(num_slots * per_slot)
        self.kv = KVCache(self.cache_specs, num_blocks, config.block_size, self.dtype, self.device,
                          num_slots)
        log.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB, %d bytes per token)",
                 num_blocks, config.block_size, num_blocks * config.block_size,
                 num_blocks * config.block_size * self.kv.bytes_per_token / 2**20,
                 self.kv.bytes_per_token)
        if num_slots:
            log.info("state slots: %d (%.1f MiB, %d bytes per request across %d linear-attention "
                     "layers)", num_slots, num_slots * per_slot / 2**20, per_slot,
                     sum(1 for s in self.cache_specs.values() if hasattr(s, "allocate_slots")))
        self.cpu_graph, self.cpu_graph_off = None, "not a CPU engine"
        if self.device.type == "cpu":
            self.cpu_graph, self.cpu_graph_off = (
                (None, "enforce_eager") if config.enforce_eager
                else CpuDecodeGraph.build(self.model, self.kv,
                                          -(-self.max_model_len // config.block_size)))
            log.info("CPU: decode steps of up to %d sequences replayed as one native program"
                     if self.cpu_graph else "CPU: decode steps run the modules (%s)",
                     ROWS if self.cpu_graph else self.cpu_graph_off)

    def _plan_moe(self, model, blocks) -> MoePlan:
        """Resolve EngineConfig.moe against the meta-built model and the free memory."""
        cfg = self.config
        banks = {id(p) for b in blocks.values() for p in b.experts.bank().values()}
        first = next(iter(blocks.values()), None)
        shape = MoeShape(
            moe_layers=tuple(blocks),
            num_experts=first.experts.num_experts if first else 0,
            top_k=first.top_k if first else 0,
            expert_bytes=first.experts.layout.expert_bytes if first else 0,
            dense_bytes=sum(p.numel() * p.element_size() for p in model.parameters()
                            if id(p) not in banks),
            kv_bytes_per_token=bytes_per_token(model.cache_specs(), self.dtype),
            state_bytes=bytes_per_slot(model.cache_specs(), self.dtype)
            * (cfg.max_state_slots if cfg.max_state_slots is not None else STATE_RESERVE_SLOTS))
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            mem = DeviceMemory("cuda", free, int(total * (1 - cfg.gpu_memory_utilization)))
        else:
            mem = DeviceMemory("cpu", host_available_bytes())
        # The KV cache must hold max_model_len tokens, so the reserve is at least that.
        kv_tokens = cfg.kv_cache_tokens or max(cfg.moe.kv_reserve_tokens, self.max_model_len)
        if not blocks:
            return MoePlan(cfg.moe.backend, "resident", "the model has no MoE layers", (), (), 0,
                           0, "no expert cache", kv_tokens)
        # One forward can carry a whole max_model_len sequence (LLM.logits does).
        plan = plan_moe(cfg.moe, shape, mem, self.max_model_len, kv_tokens)
        log.info("MoE experts: %s (%s)%s", plan.backend, plan.reason,
                 f"; expert cache {plan.cache_slots} slots ({plan.sizing})" if plan.cache_slots else "")
        return plan

    def _expert_store(self, blocks) -> ExpertStore:
        m = self.config.moe
        budget = None if m.pin_budget_gb is None else int(m.pin_budget_gb * 2**30)
        first = next(iter(blocks.values())).experts
        layouts = {b.experts.layout for b in blocks.values()}
        if len(layouts) != 1 or {b.experts.num_experts for b in blocks.values()} != {first.num_experts}:
            raise NotImplementedError("experts off the device need every MoE layer to share one "
                                      "expert layout and count (one slot pool serves them all)")
        return ExpertStore(tuple(blocks), first.num_experts, first.layout,
                           pin=self.device.type == "cuda", pin_budget_bytes=budget,
                           unpinned=self.moe_plan.cpu_layers)

    def _moe_runtime(self, blocks) -> MoeRuntime:
        # Prefetch guesses: a layer's own route() on the previous layer's hidden state ->
        # (weights [T, k], expert ids [T, k]); the weights rank the guesses.
        routers = {i: b.gate.route for i, b in blocks.items()}
        runtime = MoeRuntime(self.moe_plan, self.config.moe, self.expert_store, self.device,
                             routers, max(b.top_k for b in blocks.values()))
        for i, b in blocks.items():
            b.experts.runtime = runtime.layer_fn(i)
        if runtime.plan != self.moe_plan:     # auto weighed fetching against the CPU
            self.moe_plan = runtime.plan
            log.info("MoE experts: %s (%s)", runtime.plan.backend, runtime.plan.reason)
        return runtime

    def quant_report(self) -> dict:
        """Each part's weight format (quantized or the float dtype), for /v1/instrumentation."""
        return describe_parts(self.model)

    def moe_report(self) -> dict:
        """Where the experts live and how the cache is doing: the resolved plan, read back off
        the live objects, and live counters (for /v1/instrumentation)."""
        p = self.moe_plan
        report = {"backend": p.backend, "requested": p.requested, "reason": p.reason,
                  "kv_reserve_tokens": p.kv_tokens}
        if self.moe is None:
            return {**report, "policy": None, "cache": None, "host": None, "cpu_layers": [],
                    "hybrid_k": None, "prefetch": "off", "counters": None}
        return {**report, **self.moe.report()}

    def _cache_budget(self) -> int:
        """Bytes the caches (KV blocks and state slots) may take: the device's free memory
        less the reserve on CUDA, cpu_kv_cache_gb on the CPU."""
        cfg = self.config
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return int(max(free - total * (1 - cfg.gpu_memory_utilization), 0))
        return int(cfg.cpu_kv_cache_gb * 2**30)

    def _spare_host_bytes(self) -> int:
        """Host RAM a larger packed form of a CPU layer's experts may take now (a quantized
        bank decoded to 16 bits: QuantExpertLayout.pack_cpu): free RAM less a CPU engine's
        KV cache (allocated after the weights) and a quarter of what is left, at least
        HYBRID_COPY_RESERVE, for the rest of the process."""
        free = host_available_bytes() - (self._cache_budget() if self.device.type == "cpu" else 0)
        return max(0, free - max(HYBRID_COPY_RESERVE, free // 4))

    def _pack_hybrid_copies(self, layers: tuple[int, ...]) -> None:
        """Hybrid layers are fetched in the checkpoint's layout and computed on the CPU as
        well: where the format has a faster CPU product (16-bit weights: the fp16-weight GEMM,
        1.4-2x torch's bf16 products; INT4 in bf16: 3-12x the tile decode) and host RAM has
        room, each keeps a packed copy for the CPU beside it (the layer's bytes again),
        leaving a quarter of free RAM, and at least HYBRID_COPY_RESERVE, to the rest of the
        process."""
        store = self.expert_store
        if not layers or not store.packs_for_cpu(layers[0]):
            return
        reserve = max(HYBRID_COPY_RESERVE, host_available_bytes() // 4)
        for layer in layers:            # free RAM read again for each layer
            store.pack_cpu_copy(layer, host_available_bytes() - reserve)
        packed = len(store.cpu_banks)
        log.info("hybrid: %d of %d layers' experts also packed for the CPU's GEMM (%.1f "
                 "MiB beside the fetched copy)", packed, len(layers), store.cpu_copy_bytes / 2**20)
        if packed < len(layers):
            log.warning("hybrid: %d layers' CPU experts run unpacked: no room in host RAM for "
                        "their packed copy (%.1f MiB a layer, %.1f GiB kept free)",
                        len(layers) - packed, store.layer_bytes / 2**20, reserve / 2**30)

    def _num_state_slots(self) -> int:
        """Hybrid models: max_state_slots, or as many as half the cache budget holds (at most
        AUTO_STATE_SLOTS) while leaving one max_model_len sequence its KV; 0 without
        linear-attention layers."""
        per_slot = bytes_per_slot(self.cache_specs, self.dtype)
        if per_slot == 0:
            return 0
        if self.config.max_state_slots is not None:
            return self.config.max_state_slots
        budget = self._cache_budget()
        room = budget - self.max_model_len * bytes_per_token(self.cache_specs, self.dtype)
        slots = min(AUTO_STATE_SLOTS, int(min(room, budget // 2) // per_slot))
        if slots < 1:
            raise RuntimeError(
                f"no room for one request's linear-attention state ({per_slot / 2**20:.1f} MiB) "
                f"beside the KV of max_model_len {self.max_model_len} tokens; lower "
                f"max_model_len or give the cache more memory")
        return slots

    def _num_kv_blocks(self, reserved: int = 0) -> int:
        """Enough blocks for at least one sequence of max_model_len, more if memory allows
        (after `reserved` bytes of state slots)."""
        cfg = self.config
        per_token = max(bytes_per_token(self.cache_specs, self.dtype), 1)
        if cfg.kv_cache_tokens is not None:
            tokens = cfg.kv_cache_tokens
        else:
            tokens = int(max(self._cache_budget() - reserved, 0) // per_token)
            if self.device.type != "cuda":
                tokens = min(tokens, max(4 * self.max_model_len, 65536))
        if tokens < self.max_model_len:
            if cfg.kv_cache_tokens is not None or self.device.type == "cuda":
                raise RuntimeError(
                    f"the KV cache holds {tokens} tokens, fewer than max_model_len "
                    f"{self.max_model_len}; lower max_model_len or give the cache more memory")
            tokens = self.max_model_len
        return (tokens + cfg.block_size - 1) // cfg.block_size

    def cpu_graph_report(self) -> dict:
        """The CPU engine's decode program (engine/cpu_graph.py): its rows and the steps it
        ran, or why there is none."""
        if self.cpu_graph is None:
            return {"enabled": False, "reason": self.cpu_graph_off}
        return {"enabled": True, "rows": ROWS, "steps": self.cpu_graph.runs}

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
            kv=self.kv,
            **self._state_rows(chunks, to_dev),
        )

    def _state_rows(self, chunks: list[SeqChunk], to_dev) -> dict:
        """Hybrid models: each sequence's state slot, and whether it already holds the state
        of the tokens before this chunk (a first prefill chunk starts from zeros)."""
        if self.kv.slots is None:
            return {}
        self._check_state_slots(chunks)
        return {"state_slots": to_dev([c.state_slot for c in chunks], torch.int32),
                "has_initial_state": to_dev([c.start > 0 for c in chunks], torch.bool)}

    def _check_state_slots(self, chunks: list[SeqChunk]) -> None:
        bad = [c.state_slot for c in chunks if not 0 <= c.state_slot < self.kv.slots.num_slots]
        if bad:
            raise ValueError(f"a sequence has no state slot ({bad[0]}): this model's "
                             f"linear-attention layers need one per sequence")

    def run(self, chunks: list[SeqChunk], all_logits: bool = False) -> torch.Tensor:
        """One forward. Returns float32 logits [N, V]: one row per chunk with want_logits,
        or (all_logits) one row per token, for scoring."""
        if self.moe is not None:
            self.moe.begin_step()
        if self.cpu_graph is not None and not all_logits:
            if self.kv.slots is not None:
                self._check_state_slots(chunks)
            # a decode step the program takes: no torch op at all (not even inference mode's)
            logits = self.cpu_graph.decode(chunks, self.config.block_size)
            if logits is not None:
                return logits
        return self._forward(chunks, all_logits)

    @torch.inference_mode()
    def _forward(self, chunks: list[SeqChunk], all_logits: bool) -> torch.Tensor:
        batch = self.prepare(chunks)
        if all_logits:
            batch.logits_indices = torch.arange(batch.num_tokens, device=self.device)
        with triton_kernels.kernel_backend(self.config.kernel_backend):
            return self.model(batch)


def _cpu_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors a CPU engine's forward streams: the parameters and buffers, and the copies
    packing made (fused projections and their fp8/int4 bytes, int4 GEMM copies, decoded
    expert banks, the fp8 and int4 banks' bytes, scales and bf16 prefill copies)."""
    tk = triton_kernels
    out = list(model.parameters()) + list(model.buffers())
    for m in model.modules():
        for v in vars(m).values():
            if isinstance(v, tk.CpuLinear):
                out += [t for t in (v.weight, v.quant and v.quant.q, v.quant and v.quant.s)
                        if isinstance(t, torch.Tensor)]
            elif isinstance(v, tk.Int4Linear):
                if v.packed is not None:
                    out += [v.packed.q, v.packed.sz]
                if v.rows is not None:
                    out += [v.rows.q, v.rows.s]
            elif isinstance(v, dict):
                for b in v.values():
                    if isinstance(b, tk.NativeBank):
                        out.append(b.weight)
                    elif isinstance(b, tk.NativeFp8Bank):
                        out += [b.q, b.s] + ([b.prefill.weight] if b.prefill is not None else [])
                    elif isinstance(b, tk.NativeInt4Bank):
                        out += [b.q, b.gs]
    return out
