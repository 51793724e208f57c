"""The serving metrics the engine loop records, and the one log line per finished request."""

from __future__ import annotations

import logging
import time

from freetoken.utils.metrics import Counter, Gauge, Histogram, Registry

log = logging.getLogger("freetoken.requests")


class EngineMetrics:
    def __init__(self, core):
        alloc = core.runner.allocator
        sched = core.scheduler
        r = self.registry = Registry()
        r.add(Gauge("freetoken_requests_running", "Requests in the running batch", lambda: len(sched.running)))
        r.add(Gauge("freetoken_requests_waiting", "Requests queued for admission", lambda: len(sched.waiting)))
        r.add(Gauge("freetoken_kv_cache_usage_ratio", "Fraction of KV cache blocks in use",
                    lambda: 1.0 - alloc.num_free / alloc.num_blocks))
        r.add(Gauge("freetoken_kv_cache_blocks_total", "KV cache blocks", lambda: alloc.num_blocks))
        prefix = alloc.prefix
        r.add(Counter("freetoken_prefix_cache_queries", "Prompt tokens looked up in the prefix cache at admission",
                      lambda: prefix.stats.queried_tokens))
        r.add(Counter("freetoken_prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled)",
                      lambda: prefix.stats.hit_tokens))
        r.add(Gauge("freetoken_prefix_cache_blocks", "KV blocks holding a cached prefix (shared or idle)",
                    lambda: prefix.num_hashed))
        self.prompt_tokens = r.add(Counter("freetoken_prompt_tokens", "Prompt tokens of finished requests"))
        self.generation_tokens = r.add(Counter("freetoken_generation_tokens", "Tokens generated"))
        self.requests = r.add(Counter("freetoken_requests_finished", "Finished requests by finish reason"))
        self.preemptions = r.add(Counter("freetoken_preemptions", "Requests preempted for KV space",
                                         lambda: sched.num_preemptions))
        self.ttft = r.add(Histogram("freetoken_time_to_first_token_seconds", "Time to first token"))
        self.itl = r.add(Histogram("freetoken_inter_token_latency_seconds", "Time between tokens"))
        self.e2e = r.add(Histogram("freetoken_e2e_request_latency_seconds", "Request latency"))
        self.step = r.add(Histogram("freetoken_step_seconds", "Engine step time (forward + sampling)"))
        moe = getattr(core.runner, "moe", None)
        if moe is not None:     # experts offloaded: the expert cache's own counters
            def counter(key):
                return lambda: moe.report()["counters"][key] or 0
            r.add(Counter("freetoken_expert_cache_hits", "Routed experts found in the GPU cache", counter("hits")))
            r.add(Counter("freetoken_expert_cache_misses", "Routed experts not in the GPU cache", counter("misses")))
            r.add(Counter("freetoken_expert_bytes_fetched", "Expert bytes copied host to device",
                          counter("bytes_fetched")))
            r.add(Counter("freetoken_expert_prefetch_guessed", "Experts the next layer's guess named",
                          counter("prefetch_guessed")))
            r.add(Counter("freetoken_expert_prefetch_used", "Guessed experts the next layer then used",
                          counter("prefetch_used")))
            r.add(Counter("freetoken_expert_prefetched", "Guessed experts copied ahead of their layer",
                          counter("prefetch_fetched")))
            r.add(Counter("freetoken_expert_prefetch_dropped",
                          "Guessed experts not copied ahead (the link's idle window was full)",
                          counter("prefetch_dropped")))
            r.add(Counter("freetoken_expert_cpu_computed", "Routed experts computed on the CPU",
                          counter("cpu_experts")))
            r.add(Counter("freetoken_expert_waves", "Waves run by MoE layers that needed more "
                          "experts than the cache has slots", counter("waves")))
            r.add(Counter("freetoken_expert_wave_refetches", "Experts fetched again after their "
                          "own layer's later waves evicted them", counter("wave_refetches")))

    def on_step(self, seconds: float) -> None:
        self.step.observe(seconds)

    def on_delta(self, stream, delta, now: float) -> None:
        n = len(delta.new_token_ids)
        self.generation_tokens.inc(n)
        if stream.first_token_at is None:
            stream.first_token_at = now
            self.ttft.observe(now - stream.arrival)
        elif stream.last_token_at is not None:
            self.itl.observe(now - stream.last_token_at)
        stream.last_token_at = now
        if delta.finished:
            self.on_finish(stream, delta.finish_reason or "abort", delta.num_output_tokens, now)

    def on_finish(self, stream, reason: str, num_output: int, now: float | None = None) -> None:
        now = now or time.monotonic()
        e2e = now - stream.arrival
        self.e2e.observe(e2e)
        self.prompt_tokens.inc(stream.num_prompt_tokens)
        self.requests.inc(reason=reason)
        ttft = (stream.first_token_at - stream.arrival) if stream.first_token_at else None
        decode_s = now - stream.first_token_at if stream.first_token_at else 0.0
        rate = (num_output - 1) / decode_s if num_output > 1 and decode_s > 0 else 0.0
        log.info("request id=%s prompt_tokens=%d output_tokens=%d ttft_ms=%s tokens_per_s=%.1f "
                 "e2e_ms=%.1f finish=%s", stream.request_id, stream.num_prompt_tokens, num_output,
                 f"{ttft * 1e3:.1f}" if ttft is not None else "-", rate, e2e * 1e3, reason)
