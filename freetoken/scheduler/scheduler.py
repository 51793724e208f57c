"""Continuous batching: each step admits work under a token budget.

Running requests go first: decodes (one token each), then requests still in prefill (their
next chunk), oldest first, so every step that carries a prefill chunk carries the running
decodes too. The token budget is max_prefill_length, or the chunk a step time budget allows
(step_budget.py). Then waiting requests are admitted in arrival order while the
budget, the running-request cap and free KV blocks allow. When a running request needs a KV
block and none is free, the newest running request is preempted: its blocks are freed and it
goes back to the front of the queue, to be recomputed (prompt + output so far) later.
"""

from __future__ import annotations

import collections
import dataclasses

from freetoken.engine.kv_cache import BlockAllocator
from freetoken.scheduler.config import SchedulerConfig
from freetoken.scheduler.request import Request, RequestStatus
from freetoken.scheduler.step_budget import StepBudget


@dataclasses.dataclass
class ScheduledChunk:
    request: Request
    num_tokens: int              # tokens of this request computed this step

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the request's newest token, so a new one is sampled."""
        r = self.request
        return r.num_computed_tokens + self.num_tokens == r.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator):
        self.config = config
        self.allocator = allocator
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.step_budget = (StepBudget(config.max_step_time_s, config.max_prefill_length)
                            if config.max_step_time_s else None)

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

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step's plan ------------------------------------------------------------------
    def schedule(self) -> list[ScheduledChunk]:
        budget = (self.config.max_prefill_length if self.step_budget is None
                  else self.step_budget.chunk)
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
            if not self._reserve(req, req.num_computed_tokens + n):
                preempted = True
                continue
            scheduled.append(ScheduledChunk(req, n))
            budget -= n
        # Admit new work only when nothing had to be preempted for lack of blocks.
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.config.max_running_requests):
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            need = self.allocator.blocks_for(req.num_computed_tokens + n) - len(req.block_ids)
            if not self.allocator.can_allocate(need):
                break
            req.block_ids += self.allocator.allocate(need)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(ScheduledChunk(req, n))
            budget -= n
        return scheduled

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
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _free_blocks(self, req: Request) -> None:
        if req.block_ids:
            self.allocator.free(req.block_ids)
            req.block_ids = []
