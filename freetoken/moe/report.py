"""What a MoeRuntime reports to /v1/instrumentation: the resolved placement, read back off the
live objects (cache, store, plan), and its live counters, per layer and in all."""

from __future__ import annotations

import torch


def runtime_report(rt) -> dict:
    c, s = rt.cache, rt.store
    window = rt.window.latest_s if rt.window is not None else {}
    per_layer = [{"layer": l, "mode": rt.mode[l],
                  "hits": c.hits.get(l, 0) if c else 0,
                  "misses": c.misses.get(l, 0) if c else 0,
                  "cpu_experts": rt.cpu_experts[l],
                  "waves": rt.waves[l], "wave_steps": rt.wave_steps[l],
                  "prefetch_window_us": window[l] * 1e6 if l in window else None}
                 for l in sorted(rt.mode)]
    lookups = c.num_lookups if c else 0
    hits = sum(c.hits.values()) if c else 0
    return {
        "policy": c.policy.name if c else None,
        "lfu_decay": rt.cfg.lfu_decay if c and c.policy.name == "lfu-decay" else None,
        "cache": None if c is None else {
            "slots": c.num_slots, "bytes": c.pool_bytes, "min_slots": rt.plan.min_slots,
            "sizing": rt.plan.sizing, "layers": list(rt.plan.cache_layers),
            "slots_in_use": len(c.slot_of), "staging_bytes": c.fetcher.staging_bytes,
            # Per cache layer: slots against the experts one step (a prefill chunk) can
            # need, and the waves that step runs in at most.
            "waves": [{"layer": l, "slots": c.num_slots, "step_experts": rt.plan.step_experts,
                       "max_waves": rt.plan.max_waves} for l in rt.plan.cache_layers]},
        "host": {"expert_bytes": s.total_bytes, "resident_bytes": s.host_bytes,
                 "repacked_layers": sorted(s.repacked), "pinned_bytes": s.pinned_bytes,
                 "pin_budget_bytes": s.pin_budget_bytes,
                 "cpu_copy_bytes": s.cpu_copy_bytes, "cpu_copy_layers": sorted(s.cpu_banks)},
        "cpu_layers": list(rt.plan.cpu_layers),
        "cpu_threads": rt.cfg.cpu_threads or torch.get_num_threads(),
        "hybrid_k": rt.hybrid_k, "hybrid_k_source": rt.hybrid_k_source,
        "prefetch": rt.cfg.prefetch if rt.next_cached else "off",
        "counters": {
            "steps": rt.num_steps, "lookups": lookups, "hits": hits,
            "misses": lookups - hits, "hit_rate": hits / lookups if lookups else None,
            "experts_fetched": c.fetcher.num_experts_copied if c else 0,
            "bytes_fetched": c.fetcher.bytes_copied if c else 0,
            "fetch_gbps": c.fetcher.achieved_gbps() if c else None,
            "evictions": c.num_evictions if c else 0,
            "prefetch_fetched": c.num_prefetched if c else 0,
            "prefetch_guessed": rt.prefetch_guessed, "prefetch_used": rt.prefetch_used,
            "prefetch_dropped": rt.prefetch_dropped,
            "prefetch_accuracy_by_rank": rt.accuracy_by_rank(),
            "prefetch_accuracy": (rt.prefetch_used / rt.prefetch_guessed
                                  if rt.prefetch_guessed else None),
            "cpu_experts": sum(rt.cpu_experts.values()), "cpu_expert_s": rt.cpu_seconds,
            "cpu_expert_calls": rt.cpu_calls, "cpu_expert_process_s": rt.cpu_process_seconds,
            "cpu_cost_revisions": rt.live_cpu.revisions,
            "wave_steps": sum(rt.wave_steps.values()), "waves": sum(rt.waves.values()),
            "wave_evictions": rt.wave_evictions, "wave_refetches": rt.wave_refetches,
            "per_layer": per_layer},
    }

