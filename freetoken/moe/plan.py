"""Resolve a MoeConfig once, at startup, against the model's shape and the device's memory.

Pure arithmetic on numbers the engine measures (so tests can pass fake free-memory figures):
which backend `auto` means, which layers run their experts on the CPU, and how many slots the
GPU expert cache gets. The result, MoePlan, is what /v1/instrumentation reports.

Auto cache sizing on CUDA: slots = (free - reserve - dense - kv_tokens * kv_bytes_per_token
- state_bytes) // expert_bytes, capped at the number of offloaded experts (state_bytes: the
recurrent state slots a hybrid model's running requests hold), where `reserve` is what the engine
keeps back for activations and allocator slack (total * (1 - gpu_memory_utilization), the same
reserve the KV cache sizing leaves). On a CPU device auto means every offloaded expert.

The floor is top_k slots (one token's experts). A step that needs more of one layer's experts
than there are slots (a prefill chunk routes T * k pairs, up to all E experts) runs that layer
in waves (waves.py); the plan reports how many at worst.
"""

from __future__ import annotations

import dataclasses
import math

from freetoken.moe.config import MoeConfig
from freetoken.moe.waves import max_waves

GiB = 2 ** 30


class MoePlanError(ValueError):
    """The requested MoE placement cannot work on this model and device."""


@dataclasses.dataclass(frozen=True)
class MoeShape:
    """What placement needs to know of the model. Bytes are in the model's dtype."""
    moe_layers: tuple[int, ...]     # decoder layers with routed experts
    num_experts: int                # E per MoE layer
    top_k: int
    expert_bytes: int               # one expert's w13 [2I, D] + w2 [D, I]
    dense_bytes: int                # every weight that is not a routed expert
    kv_bytes_per_token: int
    state_bytes: int = 0            # hybrid models: the state slots to leave room for

    @property
    def all_expert_bytes(self) -> int:
        return len(self.moe_layers) * self.num_experts * self.expert_bytes


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    kind: str                       # "cuda" | "cpu"
    free_bytes: int                 # free before any weight is placed
    reserve_bytes: int = 0          # kept back for activations and allocator slack


@dataclasses.dataclass(frozen=True)
class MoePlan:
    requested: str                  # the backend asked for
    backend: str                    # resident | offload | cpu | hybrid
    reason: str                     # why (auto's decision in words)
    cpu_layers: tuple[int, ...]     # MoE layers whose experts run on the CPU
    cache_layers: tuple[int, ...]   # MoE layers served through the GPU expert cache
    cache_slots: int
    min_slots: int                  # the floor: top_k (one token's experts)
    sizing: str                     # how cache_slots was chosen
    kv_tokens: int                  # KV tokens the sizing left room for
    step_experts: int = 0           # one layer's worst step: min(T * k, E) experts
    max_waves: int = 1              # waves that step runs in with cache_slots (waves.py)

    @property
    def experts_on_host(self) -> bool:
        return self.backend != "resident"


def step_experts(num_experts: int, top_k: int, max_step_tokens: int) -> int:
    """The most experts one layer can need in one step: T tokens route T * k pairs."""
    return min(max_step_tokens * top_k, num_experts)


def resolve_cpu_layers(spec, moe_layers: tuple[int, ...]) -> tuple[int, ...]:
    """ids -> themselves (each must be a MoE layer); a count -> the first n MoE layers; a
    fraction -> the first round(f * n) of them."""
    if spec is None:
        return ()
    if isinstance(spec, tuple):
        bad = [i for i in spec if i not in moe_layers]
        if bad:
            raise MoePlanError(f"moe_cpu_layers {bad} are not MoE layers of this model "
                               f"(MoE layers: {list(moe_layers)})")
        return tuple(sorted(set(spec)))
    count = round(spec * len(moe_layers)) if isinstance(spec, float) else spec
    if count > len(moe_layers):
        raise MoePlanError(f"moe_cpu_layers={spec} asks for {count} layers; the model has "
                           f"{len(moe_layers)} MoE layers")
    return moe_layers[:count]


def resolve_backend(cfg: MoeConfig, shape: MoeShape, mem: DeviceMemory, kv_tokens: int):
    """(backend, reason) for cfg.backend; only `auto` depends on memory."""
    if cfg.backend != "auto":
        return cfg.backend, f"moe_backend={cfg.backend} was asked for"
    if cfg.cpu_layers not in (None, 0, 0.0, ()):
        return "offload", "auto with moe_cpu_layers set: offload (the other layers use the cache)"
    if cfg.cache_size is not None or cfg.cache_rate is not None:
        return "offload", "auto with the expert cache sized (moe_cache_size/rate): offload"
    if mem.kind != "cuda":
        return "resident", "auto on a CPU device: the experts already live in host RAM"
    need = (shape.dense_bytes + shape.all_expert_bytes + kv_tokens * shape.kv_bytes_per_token
            + shape.state_bytes + mem.reserve_bytes)
    state = f" + state slots {shape.state_bytes / GiB:.2f} GiB" if shape.state_bytes else ""
    words = (f"dense {shape.dense_bytes / GiB:.2f} GiB + experts "
             f"{shape.all_expert_bytes / GiB:.2f} GiB + KV {kv_tokens} tokens "
             f"{kv_tokens * shape.kv_bytes_per_token / GiB:.2f} GiB{state} + reserve "
             f"{mem.reserve_bytes / GiB:.2f} GiB = {need / GiB:.2f} GiB")
    if need <= mem.free_bytes:
        return "resident", f"auto: {words} fit in {mem.free_bytes / GiB:.2f} GiB free"
    return "offload", f"auto: {words} exceed {mem.free_bytes / GiB:.2f} GiB free"


def auto_cache_budget(shape: MoeShape, mem: DeviceMemory, kv_tokens: int) -> int:
    """Device bytes left for the expert cache after dense weights, the KV and state-slot
    reserves and the allocator reserve."""
    return (mem.free_bytes - mem.reserve_bytes - shape.dense_bytes
            - kv_tokens * shape.kv_bytes_per_token - shape.state_bytes)


def cache_slots(cfg: MoeConfig, shape: MoeShape, mem: DeviceMemory, kv_tokens: int,
                num_cached: int, min_slots: int) -> tuple[int, str]:
    """(slots, how) for num_cached offloaded experts; raises when below min_slots (top_k)."""
    if cfg.cache_size is not None:
        slots, how = min(cfg.cache_size, num_cached), f"moe_cache_size={cfg.cache_size}"
    elif cfg.cache_rate is not None:
        slots = min(num_cached, math.ceil(cfg.cache_rate * num_cached))
        how = f"moe_cache_rate={cfg.cache_rate} of {num_cached} experts"
    elif mem.kind != "cuda":
        slots, how = num_cached, "auto on a CPU device: every offloaded expert"
    else:
        budget = auto_cache_budget(shape, mem, kv_tokens)
        slots = max(0, min(num_cached, budget // shape.expert_bytes))
        how = (f"auto: {mem.free_bytes / GiB:.2f} GiB free - reserve "
               f"{mem.reserve_bytes / GiB:.2f} - dense {shape.dense_bytes / GiB:.2f} - KV "
               f"{kv_tokens} tokens {kv_tokens * shape.kv_bytes_per_token / GiB:.2f}"
               + (f" - state slots {shape.state_bytes / GiB:.2f}" if shape.state_bytes else "")
               + f" = {budget / GiB:.2f} GiB for experts of {shape.expert_bytes / 2**20:.2f} MiB")
    if slots < min_slots:
        raise MoePlanError(
            f"the GPU expert cache gets {slots} slots ({how}), fewer than the {min_slots} "
            f"experts one token routes to (top_k); give it more memory (lower "
            f"kv_reserve_tokens or max_model_len, raise moe_cache_size/moe_cache_rate) or use "
            f"moe_backend=cpu")
    explicit = cfg.cache_size is not None or cfg.cache_rate is not None
    if explicit and mem.kind == "cuda":
        room = mem.free_bytes - mem.reserve_bytes - shape.dense_bytes
        if slots * shape.expert_bytes > room:
            raise MoePlanError(
                f"{how}: {slots} slots need {slots * shape.expert_bytes / GiB:.2f} GiB but the "
                f"device has {room / GiB:.2f} GiB after dense weights and reserve")
    return slots, how


def plan_moe(cfg: MoeConfig, shape: MoeShape, mem: DeviceMemory, max_step_tokens: int,
             kv_tokens: int) -> MoePlan:
    """Resolve backend, CPU layers and cache size. max_step_tokens: the most tokens one
    forward can carry (how many experts, so how many waves, one layer's step can need);
    kv_tokens: KV room to leave."""
    backend, reason = resolve_backend(cfg, shape, mem, kv_tokens)
    min_slots = min(shape.top_k, shape.num_experts)
    step = step_experts(shape.num_experts, shape.top_k, max_step_tokens)
    if backend in ("resident", "cpu"):
        cpu = shape.moe_layers if backend == "cpu" else ()
        return MoePlan(cfg.backend, backend, reason, cpu, (), 0, min_slots, "no expert cache",
                       kv_tokens, step)
    cpu = resolve_cpu_layers(cfg.cpu_layers, shape.moe_layers)
    cached = tuple(i for i in shape.moe_layers if i not in cpu)
    if not cached:
        return MoePlan(cfg.backend, backend, reason + "; every MoE layer is a CPU layer", cpu,
                       (), 0, min_slots, "no expert cache", kv_tokens, step)
    slots, how = cache_slots(cfg, shape, mem, kv_tokens, len(cached) * shape.num_experts,
                             min_slots)
    return MoePlan(cfg.backend, backend, reason, cpu, cached, slots, min_slots, how, kv_tokens,
                   step, max_waves(step, slots))


def hybrid_k(top_k: int, fetch_s: float, cpu_s: float, serial_s: float = 0.0) -> int:
    """Misses to fetch in a decode step with top_k misses of one row each: hybrid's K, as
    reported and as the prefetch limit (hybrid_fetch_count picks each step's own split)."""
    return hybrid_fetch_count([1] * top_k, fetch_s, lambda rows: cpu_s, serial_s)


def hybrid_fetch_count(miss_rows: list[int], fetch_s: float, cpu_cost,
                       serial_s: float = 0.0) -> int:
    """How many of a hybrid step's misses to fetch: miss_rows are the rows (token, k pairs)
    of each missing expert, busiest first; the first j are fetched (j * fetch_s on the copy
    stream) while the CPU computes the rest (sum of cpu_cost(rows)), in parallel. Returns
    the j with the least max of the two, the largest such j on ties (fetching warms the
    cache). A prefill chunk's busy experts cost the CPU far more than a fetch, so they are
    fetched. serial_s: engine-thread time per fetched expert before the CPU work can start
    (the host copy into the staging ring, for layers beyond the pin budget)."""
    m = len(miss_rows)
    cpu_rest = [0.0] * (m + 1)          # cpu_rest[j]: CPU time for misses j..m-1
    for i in range(m - 1, -1, -1):
        cpu_rest[i] = cpu_rest[i + 1] + cpu_cost(miss_rows[i])
    best_j, best = m, m * max(fetch_s, serial_s)
    for j in range(m - 1, -1, -1):
        cost = max(j * fetch_s, j * serial_s + cpu_rest[j])
        if cost < best:
            best_j, best = j, cost
    return best_j
