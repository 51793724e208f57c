"""Continuous batching: each step admits work under a token budget.

Running requests go first: decodes (one token each), then requests still in prefill (their
next chunk), oldest first, so every step that carries a prefill chunk carries the running
decodes too. The token budget is max_prefill_length; with a step time budget each prefill
chunk is also cut to what the step's predicted time allows at its position (step_budget.py).
Then waiting requests are admitted in arrival order while the
budget, the running-request cap and free KV blocks allow. When a running request needs a KV
block and none is free, the newest running request is preempted: its blocks are freed and it
goes back to the front of the queue, to be recomputed (prompt + output so far) later.

Hybrid linear-attention models also keep one state slot per running request
(engine/state_slots.py): a request is admitted only when a slot and its blocks are both
free, and gives its slot back when it finishes, is aborted or is preempted (it then recomputes
its state with its tokens). The slot count bounds the running requests.

With prefix caching, a request admitted without blocks first takes the cached blocks of its
longest cached prefix (prefix_cache.py) and is prefilled from the first token they lack; at
least its last token is always computed, so there are logits to sample from. After each step
the blocks a request has completed are registered, so a preempted, finished or aborted
request leaves them cached, not lost. A waiting request whose next blocks a running request
is still prefilling waits for them (n > 1 samples of one prompt share a single prefill).
"""

from __future__ import annotations

import collections
import dataclasses

from freetoken.engine.kv_cache import BlockAllocator
from freetoken.engine.prefix_cache import extend_hashes
from freetoken.engine.state_slots import SlotAllocator
from freetoken.scheduler.config import SchedulerConfig
from freetoken.scheduler.request import Request, RequestStatus
from freetoken.scheduler.step_budget import StepBudget


@dataclasses.dataclass
class ScheduledChunk:
    request: Request
    num_tokens: int              # tokens of this request computed this step
    start: int = dataclasses.field(init=False)   # its tokens already in the cache

    def __post_init__(self):
        self.start = self.request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the request's newest token, so a new one is sampled."""
        r = self.request
        return r.num_computed_tokens + self.num_tokens == r.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator,
                 slots: SlotAllocator | None = None):
        self.config = config
        self.allocator = allocator
        self.slots = slots          # None: the model keeps no per-request state
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.step_budget = (StepBudget(config.max_step_time_s, config.max_prefill_length)
                            if config.max_step_time_s else None)
        self.caching = config.enable_prefix_caching

    # -- queue ---------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out of the queues and free its blocks (finished or aborted)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._free_blocks(request)
        self._free_slot(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step's plan ------------------------------------------------------------------
    def schedule(self) -> list[ScheduledChunk]:
        budget = self.config.max_prefill_length
        timed = self.step_budget.plan() if self.step_budget is not None else None
        scheduled: list[ScheduledChunk] = []
        preempted = False
        # Decodes first (one token each), so a long prefill never takes their place.
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens != 1]
        for req in decodes + prefills:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue   # preempted earlier in this loop
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if timed is not None and (n := timed.take(n, req.num_computed_tokens)) == 0:
                continue
            if not self._reserve(req, req.num_computed_tokens + n):
                preempted = True
                continue
            scheduled.append(ScheduledChunk(req, n))
            budget -= n
        # Admit new work only when nothing had to be preempted for lack of blocks.
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.config.max_running_requests):
            req = self.waiting[0]
            cached = self._cached_prefix(req)
            if self._prefix_in_flight(req, len(cached)):
                break      # its next blocks are being computed: take them from the cache soon
            start = req.num_computed_tokens + len(cached) * self.allocator.block_size
            n = min(req.num_tokens - start, budget)
            if timed is not None and (n := timed.take(n, start)) == 0:
                break
            need = self.allocator.blocks_for(start + n) - len(req.block_ids) - len(cached)
            if not self.allocator.can_allocate(need, reuse=cached):
                break
            if self.slots is not None and not self.slots.can_allocate():
                break
            self._take_prefix(req, cached)
            req.block_ids += self.allocator.allocate(need)
            if self.slots is not None:
                req.state_slot = self.slots.allocate()
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(ScheduledChunk(req, n))
            budget -= n
        # A request scheduled above and then preempted for a later one's blocks runs nothing.
        return [s for s in scheduled if s.request.status is RequestStatus.RUNNING]

    def _reserve(self, req: Request, num_tokens: int) -> bool:
        """Give `req` blocks for num_tokens, preempting newer requests; False if req itself
        was preempted."""
        need = self.allocator.blocks_for(num_tokens) - len(req.block_ids)
        while not self.allocator.can_allocate(need):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        if need > 0:
            req.block_ids += self.allocator.allocate(need)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._free_blocks(req)
        self._free_slot(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _free_slot(self, req: Request) -> None:
        if req.state_slot is not None:
            self.slots.free(req.state_slot)
            req.state_slot = None

    def _free_blocks(self, req: Request) -> None:
        if req.block_ids:
            self.cache_blocks(req)
            self.allocator.free(req.block_ids)
            req.block_ids = []
            req.num_registered_blocks = 0

    # -- prefix caching -------------------------------------------------------------------
    def _cached_prefix(self, req: Request) -> list[int]:
        """The cached blocks a request without blocks can start from (check only). At most
        (num_tokens - 1) // BS blocks: the last token is always computed, and a partial
        block is never shared. A request that wants its prompt's logprobs computes every
        prompt position (the cache keeps KV, not logits)."""
        if not self.caching or req.block_ids or req.params.prompt_logprobs is not None:
            return []
        bs = self.allocator.block_size
        limit = (req.num_tokens - 1) // bs
        extend_hashes(req.block_hashes, req.token_ids, bs, limit * bs)
        return self.allocator.match(req.block_hashes[:limit])

    def _prefix_in_flight(self, req: Request, num_cached: int) -> bool:
        """True when the first block `req` would compute itself is a block a running request
        is still prefilling (n > 1 samples of one prompt, or the same prompt sent twice): it
        waits for that prefill and then shares the blocks instead of computing them again."""
        if not self.caching or req.block_ids or num_cached >= len(req.block_hashes):
            return False
        wanted = req.block_hashes[num_cached]
        return any(r.num_computed_tokens < r.num_prompt_tokens and wanted in r.block_hashes
                   for r in self.running)

    def _take_prefix(self, req: Request, cached: list[int]) -> None:
        if not self.caching:
            return
        self.allocator.take(cached)
        hit = len(cached) * self.allocator.block_size
        req.block_ids = list(cached)
        req.num_registered_blocks = len(cached)
        req.num_computed_tokens = hit
        stats = self.allocator.prefix.stats
        stats.queried_tokens += req.num_tokens
        stats.hit_tokens += hit
        if req.num_preemptions == 0:
            req.num_cached_tokens = hit

    def cache_blocks(self, req: Request) -> None:
        """Register the request's blocks whose every token's KV is now computed."""
        bs = self.allocator.block_size
        full = min(req.num_computed_tokens // bs, len(req.block_ids))
        if not self.caching or full <= req.num_registered_blocks:
            return
        extend_hashes(req.block_hashes, req.token_ids, bs, full * bs)
        prompt_blocks = req.num_prompt_tokens // bs
        for i in range(req.num_registered_blocks, full):
            if self.allocator.register(req.block_ids[i], req.block_hashes[i]) and i < prompt_blocks \
                    and req.num_preemptions == 0:
                req.num_cache_created_tokens += bs
        req.num_registered_blocks = full

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix and zero the hit counters (after warmup)."""
        self.allocator.prefix.stats = type(self.allocator.prefix.stats)()
        return self.allocator.reset_prefix_cache()
