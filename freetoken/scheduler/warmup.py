"""The warmup ladder: compile and tune every kernel shape class before /health says ready.

Triton compiles (and autotunes) per shape class on first use; in the field that stalled
first requests for minutes. So before readiness every extend length class a step can have
is run through the real request path (admission, KV allocation, one decode, freeing):
1..16, then 2^k-1, 2^k, 2^k+1 up to the prefill budget, and the budget itself; then one
request walks the KV depth in budget-sized chunks up to the serving depth, so attention's
long-context classes (split-KV decode) are compiled too, and a last one ends in a short chunk
over its prefix (MLA's absorbed prefill).

The step time budget is set aside while the ladder runs: it would cut every length to its
first chunk (256 tokens, nothing seen yet) and leave the longer classes uncompiled, and the
ladder's compiling steps are no measure of what a step costs.

With prefix caching the cache is emptied before each ladder request (so each really prefills
its length, never a cached part of it) and after the last, so no ladder block is ever counted
as a hit for real traffic.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Callable

from freetoken.engine.sampling_params import SamplingParams

log = logging.getLogger("freetoken.warmup")
SHORT_TAIL = 3      # the last request's final chunk: a few queries over a budget-deep prefix


def extend_lengths(max_prefill: int) -> list[int]:
    """Every token count class one forward can carry, smallest first."""
    lengths = set(range(1, min(16, max_prefill) + 1))
    k = 4
    while 2 ** k - 1 <= max_prefill:
        lengths.update(n for n in (2 ** k - 1, 2 ** k, 2 ** k + 1) if n <= max_prefill)
        k += 1
    lengths.add(max_prefill)
    return sorted(lengths)


def depth_walk(max_prefill: int, depth: int) -> list[int]:
    """Context depths the long-context request reaches, one chunk of prefill at a time."""
    return list(range(max_prefill, depth + 1, max_prefill)) or [depth]


def run_warmup(core, max_depth: int | None = None,
               on_phase: Callable[[str], None] = lambda phase: None) -> dict:
    """Run the ladder on an idle EngineCore. Returns what ran and how long it took."""
    budget = core.scheduler.config.max_prefill_length
    # The depth request needs room for its 2 generated tokens.
    depth = min(max_depth or core.max_model_len, core.max_model_len - 2,
                core.runner.allocator.num_blocks * core.runner.allocator.block_size - 2)
    rng = random.Random(0)
    vocab = core.vocab_size
    step_budget, core.scheduler.step_budget = core.scheduler.step_budget, None
    try:
        return _ladder(core, budget, depth, rng, vocab, on_phase)
    finally:
        core.scheduler.step_budget = step_budget


def _ladder(core, budget: int, depth: int, rng: random.Random, vocab: int,
            on_phase: Callable[[str], None]) -> dict:
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    lengths = [n for n in extend_lengths(budget) if n <= core.max_model_len - 2]
    t0 = time.perf_counter()
    for i, n in enumerate(lengths):
        on_phase(f"warmup: extend length {n} ({i + 1}/{len(lengths)})")
        _run_to_end(core, [rng.randrange(vocab) for _ in range(n)], params)
    if depth > budget:
        on_phase(f"warmup: KV depth walk to {depth} tokens")
        _run_to_end(core, [rng.randrange(vocab) for _ in range(depth)], params)
        if depth >= budget + SHORT_TAIL:
            # A short chunk over a prefix is a shape class of its own where attention changes
            # form with the chunk (MLA attends short chunks absorbed, decompresses long ones).
            on_phase(f"warmup: a {SHORT_TAIL}-token chunk after {budget}")
            _run_to_end(core, [rng.randrange(vocab) for _ in range(budget + SHORT_TAIL)], params)
    seconds = time.perf_counter() - t0
    log.info("warmup: %d extend lengths (1..%d) and KV depth %d in %.1fs", len(lengths), budget,
             depth, seconds)
    return {"extend_lengths": lengths, "depth": depth, "seconds": seconds}


def _run_to_end(core, prompt: list[int], params: SamplingParams) -> None:
    core.scheduler.reset_prefix_cache()
    req = core.add_request(prompt, params)
    try:
        while not req.is_finished:
            core.step()
    finally:
        core.abort(req.request_id)   # no-op when finished; frees blocks if a step raised
        core.scheduler.reset_prefix_cache()
