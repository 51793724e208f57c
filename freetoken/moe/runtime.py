"""MoeRuntime: runs each MoE layer's routed experts under the resolved plan.

Per layer and step (the router has already picked ids [T, k] and weights [T, k]):

  1. guess: the next MoE layer's router applied to this layer's hidden state x;
  2. one device -> host copy of ids, the guess (and x, weights for CPU work), one sync;
  3. cache layers: ensure the experts resident (misses go out as one batch on the copy
     stream), make the compute stream wait for that batch, start prefetching the guess for
     the next layer, most likely first (its copies overlap this layer's kernel; under
     moe_prefetch=auto only as many as overlap.py measures the link can carry before the
     next layer's own misses go out), then
     the layout's fused MoE over the slot pool through the layer's slot map;
     hybrid: only some misses are fetched (the busiest; how many from the measured costs
     and each miss's rows, or a fixed moe_hybrid_k), the others run on the CPU while the
     kernel runs;
     cpu layers: x goes to the host, the experts run there, the result comes back.
     A layer that needs more experts than the cache has slots (a prefill chunk on a cache
     smaller than one layer) runs in waves (waves.py); hybrid's CPU share is left out of
     them, priced as always (a wave's copies keep the copy stream busy, so fetching j
     misses costs j fetches however many waves carry them).

Prefetch accuracy = guessed experts the next layer then used / experts guessed. A RoutingTrace
set on `trace` records every layer's experts and guess (bench/cache_policy.py replays them).

At startup the cost of fetching one expert and of computing it on the CPU (this device's
`ft bench bw` profile, else a half-second calibration) sets hybrid's K, and decides whether
`auto`, when the experts do not fit on the card, means offload or hybrid.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable

import torch

from freetoken.moe.bandwidth import ExpertBench, ExpertCosts, host_copy_gbps
from freetoken.moe.cache import ExpertCache
from freetoken.moe.config import MoeConfig
from freetoken.moe.cpu import cpu_moe, torch_threads
from freetoken.moe.live_costs import LiveCpuCost
from freetoken.moe.overlap import PrefetchWindow
from freetoken.moe.plan import MoePlan, hybrid_fetch_count, hybrid_k
from freetoken.moe.policy import make_policy
from freetoken.moe.profile import load_profile
from freetoken.moe.report import runtime_report
from freetoken.moe.store import ExpertStore
from freetoken.moe.trace import RoutingTrace, check_trace_path
from freetoken.moe.waves import run_waves, split_waves
from freetoken.utils.device import device_key

log = logging.getLogger("freetoken.moe")

CALIBRATION_S = 0.1     # per measured rate, four rates: about half a second at startup
TRACE_MAX_STEPS = 10_000    # --moe-trace: written and closed after this many steps
Router = Callable[[torch.Tensor], tuple]    # x [T, D] -> (probabilities [T, k], expert ids [T, k])
SMALL_ROUTING = 256     # up to this many (token, expert) pairs, count in Python: torch's ops
                        # on tiny host tensors cost ~10 us each, and this runs per layer per step


def expert_rows(ids_h: torch.Tensor, num_experts: int, weights_h: torch.Tensor | None = None) -> dict:
    """{expert: rows routed to it} over ids [T, k] on the host, or with weights [T, k] the sum
    of their weights; only experts that appear."""
    flat = ids_h.reshape(-1)
    if flat.numel() <= SMALL_ROUTING:
        out: dict[int, float] = {}
        values = [1] * flat.numel() if weights_h is None else weights_h.reshape(-1).tolist()
        for e, v in zip(flat.tolist(), values):
            out[e] = out.get(e, 0) + v
        return out
    rows = torch.bincount(flat, minlength=num_experts)
    present = rows.nonzero().reshape(-1).tolist()
    totals = rows if weights_h is None else torch.zeros(num_experts, dtype=torch.float64).index_add_(
        0, flat, weights_h.reshape(-1).double())
    values = totals.tolist()
    return {e: values[e] for e in present}


class MoeRuntime:
    def __init__(self, plan: MoePlan, cfg: MoeConfig, store: ExpertStore, device,
                 routers: dict[int, Router], top_k: int, force_staging: bool = False):
        self.plan, self.cfg, self.store, self.top_k = plan, cfg, store, top_k
        self.device = torch.device(device)
        self.routers = routers
        self.cache = None
        if plan.cache_layers:
            policy = make_policy(cfg.cache_policy, cfg.lfu_decay)
            self.cache = ExpertCache(store, plan.cache_layers, plan.cache_slots, policy,
                                     self.device, force_staging)
        moe_layers = sorted(set(plan.cpu_layers) | set(plan.cache_layers))
        self.mode = {l: "cpu" if l in plan.cpu_layers else plan.backend for l in moe_layers}
        # Prefetch targets the next MoE layer, when the cache serves it.
        self.next_cached = {a: b for a, b in zip(moe_layers, moe_layers[1:])
                            if b in plan.cache_layers and cfg.prefetch != "off"}
        self.window = (PrefetchWindow(self.device)
                       if self.next_cached and cfg.prefetch == "auto" else None)
        self.hybrid_k, self.hybrid_k_source = None, None
        self.costs: dict[bool, ExpertCosts] = {}     # staged fetches? -> measured costs
        if plan.backend == "hybrid" and self.cache is not None:
            self._resolve_hybrid_k()
        elif plan.requested == "auto" and plan.backend == "offload" and self.cache is not None:
            self._refine_auto()
        self._guesses: dict[int, list[int]] = {}     # layer -> its guess, most likely first
        self.trace: RoutingTrace | None = None      # set one to record the routing
        if cfg.trace_path:
            check_trace_path(cfg.trace_path)
            self.trace = RoutingTrace(tuple(moe_layers), store.num_experts, top_k,
                                      source=f"recorded by ft serve ({plan.backend}, prefetch {cfg.prefetch})")
        self.num_steps = 0
        self._step_serial = 0          # never reset: tells a trace's steps apart
        self.prefetch_guessed = 0
        self.prefetch_used = 0
        self.prefetch_dropped = 0      # guesses left out: the window or hybrid's K was full, or no slot free
        self._rank_guessed: list[int] = []    # per rank of a guess (0: most likely): how often
        self._rank_used: list[int] = []       # it was made, and how often the layer used it
        self.cpu_experts = {l: 0 for l in moe_layers}
        self.cpu_seconds = 0.0          # wall time of the CPU's expert products (all layers)
        self.cpu_calls = 0              # ... and how many calls they were
        # the process's CPU time over those calls: against wall time x threads, how busy the
        # team was (a slow call with its threads asleep or preempted reads far under 1)
        self.cpu_process_seconds = 0.0
        self.live_cpu = LiveCpuCost()   # hybrid's CPU cost as serving measures it
        self._startup_cpu = None        # the CPU's costs before their first revision
        self.waves = {l: 0 for l in moe_layers}         # waves run (layer steps in waves only)
        self.wave_steps = {l: 0 for l in moe_layers}    # layer steps that ran in waves
        self.wave_evictions = 0     # experts a layer's later waves evicted from its earlier ones
        self.wave_refetches = 0     # ... fetched again later: the extra fetches waves cost
        self._wave_evicted: set = set()

    def layer_fn(self, layer: int):
        """The callable an ExpertBank runs instead of the resident kernel."""
        return lambda x, weights, ids: self.run_layer(layer, x, weights, ids)

    def begin_step(self) -> None:
        self.num_steps += 1
        self._step_serial += 1
        if self.cfg.trace_path and self.trace is not None and len(self.trace.steps) >= TRACE_MAX_STEPS:
            self.close(background=True)     # serving goes on while the file is written
        self._guesses.clear()
        if self.cache is not None:
            self.cache.begin_step()

    def close(self, background: bool = False) -> None:
        """Stop a --moe-trace recording and write it (on a thread of its own if background).
        A write that fails is logged: it must not fail a step or the shutdown."""
        trace, path = self.trace, self.cfg.trace_path
        if not path or trace is None:
            return
        self.trace = None

        def write():
            try:
                trace.save(path)
                log.info("routing trace of %d steps written to %s", len(trace.steps), path)
            except OSError as e:
                log.error("could not write the routing trace to %s: %s", path, e)
        if background:
            threading.Thread(target=write, name="moe-trace-writer").start()
        else:
            write()

    def reset_counters(self) -> None:
        """Zero the live counters (e.g. after warmup) and restart a --moe-trace recording;
        the cache keeps its contents."""
        if self.cfg.trace_path and self.trace is not None:
            self.trace.steps.clear()
        self.num_steps = self.prefetch_guessed = self.prefetch_used = self.prefetch_dropped = 0
        self._rank_guessed, self._rank_used = [], []
        self.cpu_experts = dict.fromkeys(self.cpu_experts, 0)
        self.cpu_seconds = 0.0
        self.cpu_calls = 0
        self.cpu_process_seconds = 0.0
        self.waves = dict.fromkeys(self.waves, 0)
        self.wave_steps = dict.fromkeys(self.wave_steps, 0)
        self.wave_evictions = self.wave_refetches = 0
        if self.cache is not None:
            self.cache.reset_counters()

    # -- one layer ----------------------------------------------------------------------------
    def run_layer(self, layer: int, x: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
        mode = self.mode[layer]
        nxt = self.next_cached.get(layer)
        guess_w, guess = self.routers[nxt](x) if nxt is not None else (None, None)
        cpu_work = mode in ("cpu", "hybrid")
        rows = ids.shape[0]
        if self.window is not None:
            self.window.routed(layer)
        ids_h, guess_h, guess_w_h, x_h, w_h = self._to_host(
            ids, guess, guess_w, x if cpu_work else None, weights if cpu_work else None)
        if self.window is not None:
            self.window.synced(layer)
        guessed = None if nxt is None else self._rank(guess_h, guess_w_h)
        # Distinct experts, busiest first: hybrid fetches the ones with the most rows.
        counts = expert_rows(ids_h, self.store.num_experts)
        needed = sorted(counts, key=lambda e: (-counts[e], e))
        if self.trace is not None:
            self.trace.record(self._step_serial, layer, needed, self._guesses.get(layer), rows)
        self._score_guess(layer, needed)
        if mode == "cpu":
            self._prefetch(nxt, guessed, set(), rows)
            self.cpu_experts[layer] += len(needed)
            return self._cpu(layer, x_h, w_h, ids_h, None).to(x.device)

        if mode == "hybrid":
            self.live_cpu.step()
        budget = self._fetch_budget(layer, needed, counts) if mode == "hybrid" else None
        if self.window is not None:
            self.window.closed(layer, rows)
        resident = [e for e in needed if (layer, e) in self.cache.slot_of]
        missing = [e for e in needed if (layer, e) not in self.cache.slot_of]
        fetch = missing if budget is None else missing[:budget]
        if len(resident) + len(fetch) > self.cache.num_slots:
            return self._waves(layer, x, weights, ids, (ids_h, x_h, w_h), resident, fetch,
                               missing[len(fetch):], (nxt, guessed, rows))
        res = self.cache.ensure(layer, needed, budget)
        self._count_refetches(layer, res.fetched)
        self.cache.wait()
        self._prefetch(nxt, guessed, {(layer, e) for e in needed}, rows)
        on_device = res.hits + res.fetched
        if not res.skipped:
            return self._kernel(layer, x, weights, ids)
        cpu_ids = torch.tensor(res.skipped, device=ids.device)
        out = None
        if on_device:      # CPU pairs point at a resident expert with weight 0
            off = torch.isin(ids, cpu_ids)
            out = self._kernel(layer, x, weights.masked_fill(off, 0),
                               ids.masked_fill(off, on_device[0]))
        self.cpu_experts[layer] += len(res.skipped)
        cpu_out = self._timed_cpu(layer, x_h, w_h, ids_h, res.skipped, counts).to(x.device)
        return cpu_out if out is None else out + cpu_out

    def _waves(self, layer, x, weights, ids, host, resident, fetch, cpu_part, prefetch):
        """The layer in waves: resident first, then `fetch` in groups; cpu_part (hybrid's
        share) runs on the CPU while the device computes the waves."""
        ids_h, x_h, w_h = host
        nxt, guessed, rows = prefetch
        if cpu_part:
            self.cache.skip(layer, cpu_part)
        waves = split_waves(resident, fetch, self.cache.num_slots)
        out, st = run_waves(self.cache, self.store.layout, layer, x, weights, ids, ids_h, waves,
                            lambda keep: self._prefetch(nxt, guessed, keep, rows))
        self._count_refetches(layer, st.fetched)
        self.waves[layer] += st.waves
        self.wave_steps[layer] += 1
        self.wave_evictions += len(st.self_evicted)
        self._wave_evicted.update((layer, e) for e in st.self_evicted)
        if cpu_part:
            self.cpu_experts[layer] += len(cpu_part)
            counts = expert_rows(ids_h, self.store.num_experts)
            out += self._timed_cpu(layer, x_h, w_h, ids_h, cpu_part, counts).to(x.device).float()
        return out.to(x.dtype)

    def _count_refetches(self, layer: int, fetched: list[int]) -> None:
        """Fetches of experts that their own layer's waves had evicted: what waves cost."""
        if self._wave_evicted:
            again = self._wave_evicted.intersection((layer, e) for e in fetched)
            self.wave_refetches += len(again)
            self._wave_evicted -= again

    def _fetch_budget(self, layer: int, needed: list[int], counts: dict[int, int]) -> int:
        """Hybrid: misses to fetch this step. A fixed moe_hybrid_k, or from the measured
        costs and each miss's rows, so a prefill chunk's busy experts are not left to the CPU."""
        if not self.costs:
            return self.hybrid_k
        c = self.costs[self._staged(layer)]
        rows = [counts[e] for e in needed if (layer, e) not in self.cache.slot_of]
        budget = hybrid_fetch_count(rows, c.fetch_s, c.cpu_cost, c.stage_s)
        if budget == len(rows) and self.live_cpu.probe(rows):
            budget -= 1         # the least busy miss to the CPU: a sample of its cost
        return budget

    def _timed_cpu(self, layer, x_h, w_h, ids_h, experts, counts) -> torch.Tensor:
        """A hybrid layer's CPU share, timed against what its costs predicted (live_costs.py)."""
        before = self.cpu_seconds
        out = self._cpu(layer, x_h, w_h, ids_h, experts)
        if self.costs and self.cfg.hybrid_k is None:
            rows = [counts[e] for e in experts]
            c = self.costs[self._staged(layer)]
            self.live_cpu.observe(self.cpu_seconds - before, rows, sum(map(c.cpu_cost, rows)))
            self._revise_cpu_cost()
        return out

    def _revise_cpu_cost(self) -> None:
        """Scale the CPU's costs by what serving measures where they are far off, and take K
        from them (live_costs.py)."""
        ratio = self.live_cpu.revised()
        if ratio is None:
            return
        first = self._startup_cpu = self._startup_cpu or next(iter(self.costs.values()))
        source = (f"CPU measured while serving: {ratio:.3g}x the costs it ran by, the median of "
                  f"{self.live_cpu.window} calls; at startup {first.cpu_s * 1e3:.3f} ms/expert, "
                  f"{first.source}")
        self.costs = {kind: dataclasses.replace(c, cpu_s=c.cpu_s * ratio,
                                                cpu_row_s=c.cpu_row_s * ratio, source=source)
                      for kind, c in self.costs.items()}
        costs = self.costs[self._staged(self.plan.cache_layers[0])]
        k = hybrid_k(self.top_k, costs.fetch_s, costs.cpu_cost(1), costs.stage_s)
        log.info("hybrid: the CPU's experts take %.3gx the time they were priced at while "
                 "serving: %.3f ms/expert, K %s -> %s", ratio, costs.cpu_s * 1e3, self.hybrid_k, k)
        self.hybrid_k, self.hybrid_k_source = k, costs.words()

    def _kernel(self, layer, x, weights, ids) -> torch.Tensor:
        c = self.cache
        return self.store.layout.run(x, c.pool, weights, ids, c.slot_map(layer))

    def _cpu(self, layer, x_h, w_h, ids_h, experts) -> torch.Tensor:
        t0, c0 = time.perf_counter(), time.process_time()
        with torch_threads(self.cfg.cpu_threads):
            out = cpu_moe(self.store.layout, x_h, self.store.cpu_bank(layer), w_h, ids_h, experts)
        self.cpu_seconds += time.perf_counter() - t0
        self.cpu_process_seconds += time.process_time() - c0
        self.cpu_calls += 1
        return out

    def _rank(self, guess_h: torch.Tensor, guess_w_h: torch.Tensor) -> list[int]:
        """The guessed experts [T, k], most likely first: by router probability summed over
        the tokens that picked them."""
        score = expert_rows(guess_h, self.store.num_experts, guess_w_h)
        return sorted(score, key=lambda e: (-score[e], e))

    def _prefetch(self, nxt, guessed: list[int] | None, protected, rows: int) -> None:
        if nxt is None:
            return
        self._guesses[nxt] = guessed
        limit = self.hybrid_k if self.mode[nxt] == "hybrid" else None
        if self.window is not None:
            fit = self.window.count(nxt, rows, self._copy_s(), self._rank_accuracy)
            limit = fit if limit is None else limit if fit is None else min(limit, fit)
        missing = sum((nxt, e) not in self.cache.slot_of for e in guessed)
        moved = self.cache.prefetch(nxt, guessed, protected, limit)
        self._count_refetches(nxt, moved)
        self.prefetch_dropped += missing - len(moved)
        if self.window is not None:
            # After the enqueue: the host time it took is not time the GPU computes.
            self.window.started(nxt)

    def _copy_s(self) -> float | None:
        """Seconds the copy stream takes for one expert, at the rate it achieved so far."""
        gbps = self.cache.fetcher.achieved_gbps()
        return self.store.expert_bytes / (gbps * 1e9) if gbps else None

    def _score_guess(self, layer: int, needed: list[int]) -> None:
        guessed = self._guesses.pop(layer, None)
        if guessed is None:
            return
        used = set(needed)
        while len(self._rank_guessed) < len(guessed):
            self._rank_guessed.append(0)
            self._rank_used.append(0)
        for rank, e in enumerate(guessed):
            self._rank_guessed[rank] += 1
            self._rank_used[rank] += e in used
        self.prefetch_guessed += len(guessed)
        self.prefetch_used += len(used.intersection(guessed))

    def _rank_accuracy(self, rank: int) -> float:
        """How often a guess of this rank was right so far (Laplace's rule: 1/2 unseen)."""
        seen = self._rank_guessed[rank] if rank < len(self._rank_guessed) else 0
        return ((self._rank_used[rank] if seen else 0) + 1) / (seen + 2)

    def _to_host(self, *tensors):
        """Host copies of the given device tensors (None passes through), one sync for all."""
        if self.device.type != "cuda":
            return tensors
        out = [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
               .copy_(t, non_blocking=True) for t in tensors]
        torch.cuda.current_stream(self.device).synchronize()
        return out

    # -- startup --------------------------------------------------------------------------------
    def _resolve_hybrid_k(self) -> None:
        if self.cfg.hybrid_k is not None:
            self.hybrid_k = min(self.cfg.hybrid_k, self.top_k)
            self.hybrid_k_source = f"moe_hybrid_k={self.cfg.hybrid_k}"
            return
        self._measure_costs()
        costs = self.costs[self._staged(self.plan.cache_layers[0])]
        self.hybrid_k = hybrid_k(self.top_k, costs.fetch_s, costs.cpu_cost(1), costs.stage_s)
        self.hybrid_k_source = costs.words()

    def _refine_auto(self) -> None:
        """auto resolved to offload (the experts do not fit): price a miss fetched against a
        miss computed on the CPU and take hybrid when the CPU should share the misses."""
        self._measure_costs()
        costs = self.costs[self._staged(self.plan.cache_layers[0])]
        k = hybrid_k(self.top_k, costs.fetch_s, costs.cpu_cost(1), costs.stage_s)
        if k >= self.top_k:
            reason = f"{self.plan.reason}; offload: {costs.words()}, so every miss is fetched"
            self.plan = dataclasses.replace(self.plan, reason=reason)
            self.costs = {}
            return
        reason = (f"{self.plan.reason}; hybrid: {costs.words()}, so the CPU computes all but "
                  f"{k} of a decode step's misses per layer")
        self.plan = dataclasses.replace(self.plan, backend="hybrid", reason=reason)
        self.mode = {l: "hybrid" if m == "offload" else m for l, m in self.mode.items()}
        self.hybrid_k, self.hybrid_k_source = k, costs.words()

    def _staged(self, layer: int) -> bool:
        """Whether the layer's fetches go through the staging ring (its bank is not pinned)."""
        f = self.cache.fetcher
        return f.force_staging or (f.is_cuda and not self.store.pinned[layer])

    def _measure_costs(self) -> None:
        """self.costs[staged] for each kind of cache layer there is: pinned, staged or both."""
        kinds = {self._staged(l): l for l in reversed(self.plan.cache_layers)}
        self.costs = {staged: self.expert_costs(layer, staged) for staged, layer in kinds.items()}

    def expert_costs(self, layer: int, staged: bool) -> ExpertCosts:
        """What fetching one of layer's experts and computing it on the CPU cost: this
        device's saved profile (`ft bench bw`) when it was measured with the CPU thread count
        used here, else a short calibration now. staged: fetches go through the ring, whose
        host copy runs on the engine thread."""
        s = self.store
        threads = self.cfg.cpu_threads or torch.get_num_threads()
        key = device_key(self.device)
        profile = load_profile(key)
        if profile is not None and profile.get("cpu_threads") == threads:
            rates = dict(profile["experts"])
            if staged and "fetch_staged_gbps" in rates:
                rates["fetch_gbps"] = rates.pop("fetch_staged_gbps")
                rates.pop("overlap_fetch_gbps", None)     # measured from a pinned bank
            copies = profile.get("host_copy_gbps", {})
            host = (copies.get(str(threads)) or copies.get("1")) if staged else None
            return ExpertCosts.of(rates, s.expert_bytes, s.hidden, s.width,
                                  f"profile {profile['path']} of {profile.get('measured_at')}",
                                  host)
        why = ("no profile for " + key if profile is None else
               f"the profile was measured with {profile.get('cpu_threads')} CPU threads, not {threads}")
        # Slots 0..k-1 are scratch: nothing is mapped yet.
        bench = ExpertBench(s, layer, self.cache.pool, self.top_k,
                            self.cfg.cpu_threads, force_staging=staged)
        host = host_copy_gbps(64 * 2**20, threads, CALIBRATION_S) if staged else None
        return ExpertCosts.of(bench.measure(CALIBRATION_S), s.expert_bytes, s.hidden, s.width,
                              f"calibrated at startup ({why}; `ft bench bw` saves one)", host)

    # -- report ---------------------------------------------------------------------------------
    def report(self) -> dict:
        """The placement and live counters /v1/instrumentation serves (report.py)."""
        return runtime_report(self)

    def accuracy_by_rank(self) -> list[float]:
        """Per rank of a guess (0: most likely): how often the layer then used it."""
        return [round(u / g, 4) for u, g in zip(self._rank_used, self._rank_guessed)]
