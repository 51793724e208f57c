"""MoeConfig: where a MoE model's experts live and run, as asked; plan.py resolves the autos.

Backends: `resident` (every expert on the device, as a plain model), `offload` (experts in host
RAM, the ones a step needs cached on the device), `cpu` (experts computed on the CPU from host
RAM), `hybrid` (per layer and step fetch up to K misses, compute the rest on the CPU), `auto`
(resident when everything fits on the device; else offload, or hybrid when the measured cost
of a CPU expert says the CPU should take some misses; resident on a CPU device).
"""

from __future__ import annotations

import dataclasses

BACKENDS = ("auto", "resident", "offload", "cpu", "hybrid")
POLICIES = ("lru", "lfu-decay")
# auto: as many of the guesses as the link can carry while the GPU computes (overlap.py);
# all: every guess; off: none.
PREFETCH = ("auto", "all", "off")

# moe_cpu_layers: explicit MoE layer ids, a count of MoE layers (the first ones, as
# llama.cpp's --n-cpu-moe), or a fraction of them.
CpuLayers = tuple[int, ...] | int | float | None


def parse_cpu_layers(text: str) -> CpuLayers:
    """The CLI spelling of moe_cpu_layers: "0,3,5" (ids), "4" (a count), "0.25" (a fraction)."""
    text = text.strip()
    try:
        if "," in text or text.startswith("["):
            return tuple(int(t) for t in text.strip("[]").split(",") if t.strip())
        if "." in text:
            return float(text)
        return int(text)
    except ValueError:
        raise ValueError(f"moe_cpu_layers must be layer ids (0,3,5), a count (4) or a fraction "
                         f"(0.25), got {text!r}") from None


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    backend: str = "auto"
    cache_size: int | None = None       # slots of the GPU expert cache (>= top_k; fewer than a
                                        # step's experts of a layer: it runs in waves)
    cache_rate: float | None = None     # ... or a fraction of all offloaded experts
    cache_policy: str = "lfu-decay"     # lru | lfu-decay (bench/cache_policy.py)
    lfu_decay: float = 0.9              # lfu-decay: counts are multiplied by this every step
    cpu_layers: CpuLayers = None        # offload/hybrid: these layers' experts run on the CPU
    cpu_threads: int | None = None      # torch threads for CPU experts (None: torch's setting)
    hybrid_k: int | None = None         # hybrid: misses fetched per layer and step (None: measured)
    pin_budget_gb: float | None = None  # host bytes to page-lock for experts (None: 60% of free RAM)
    kv_reserve_tokens: int = 8192       # auto cache sizing leaves the KV cache this many tokens
    prefetch: str = "auto"              # guess layer L+1's experts from layer L's state: PREFETCH
    trace_path: str | None = None       # record the routing here (JSON, for bench/cache_policy.py)

    def __post_init__(self):
        if isinstance(self.cpu_layers, list):
            object.__setattr__(self, "cpu_layers", tuple(self.cpu_layers))
        if isinstance(self.prefetch, bool):       # moe_prefetch=True/False reads as on/off
            object.__setattr__(self, "prefetch", "auto" if self.prefetch else "off")
        self.validate()

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"moe_backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.cache_policy not in POLICIES:
            raise ValueError(f"moe_cache_policy must be one of {', '.join(POLICIES)}, "
                             f"got {self.cache_policy!r}")
        if self.cache_size is not None and self.cache_rate is not None:
            raise ValueError("give moe_cache_size or moe_cache_rate, not both (neither: auto)")
        if self.cache_size is not None and (not _is_int(self.cache_size) or self.cache_size < 1):
            raise ValueError(f"moe_cache_size must be a positive number of slots, got {self.cache_size!r}")
        if self.cache_rate is not None and not 0.0 < float(self.cache_rate) <= 1.0:
            raise ValueError(f"moe_cache_rate must be in (0, 1], got {self.cache_rate!r}")
        if self.prefetch not in PREFETCH:
            raise ValueError(f"moe_prefetch must be one of {', '.join(PREFETCH)}, got {self.prefetch!r}")
        if not 0.0 < self.lfu_decay <= 1.0:
            raise ValueError(f"moe_lfu_decay must be in (0, 1], got {self.lfu_decay!r}")
        _check_cpu_layers(self.cpu_layers)
        if self.cpu_threads is not None and (not _is_int(self.cpu_threads) or self.cpu_threads < 1):
            raise ValueError(f"moe_cpu_threads must be a positive integer, got {self.cpu_threads!r}")
        if self.hybrid_k is not None and (not _is_int(self.hybrid_k) or self.hybrid_k < 0):
            raise ValueError(f"moe_hybrid_k must be a non-negative integer, got {self.hybrid_k!r}")
        if self.pin_budget_gb is not None and self.pin_budget_gb < 0:
            raise ValueError(f"pin_budget_gb must be >= 0, got {self.pin_budget_gb!r}")
        if not _is_int(self.kv_reserve_tokens) or self.kv_reserve_tokens < 0:
            raise ValueError(f"kv_reserve_tokens must be a non-negative integer, "
                             f"got {self.kv_reserve_tokens!r}")
        wants_cache = self.cache_size is not None or self.cache_rate is not None
        if wants_cache and self.backend in ("resident", "cpu"):
            raise ValueError(f"moe_cache_size/moe_cache_rate size the expert cache of the offload "
                             f"and hybrid backends; moe_backend={self.backend} has none")
        if self.cpu_layers not in (None, 0, 0.0, ()) and self.backend in ("resident", "cpu"):
            raise ValueError(f"moe_cpu_layers applies to moe_backend offload, hybrid or auto, "
                             f"not {self.backend}")
        if self.hybrid_k is not None and self.backend not in ("hybrid",):
            raise ValueError("moe_hybrid_k applies to moe_backend=hybrid only")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_cpu_layers(v) -> None:
    if v is None:
        return
    if isinstance(v, tuple):
        if not all(_is_int(i) and i >= 0 for i in v):
            raise ValueError(f"moe_cpu_layers ids must be non-negative integers, got {v!r}")
    elif _is_int(v):
        if v < 0:
            raise ValueError(f"moe_cpu_layers count must be >= 0, got {v}")
    elif isinstance(v, float):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"moe_cpu_layers fraction must be in [0, 1], got {v}")
    else:
        raise ValueError(f"moe_cpu_layers must be layer ids, a count or a fraction, got {v!r}")
