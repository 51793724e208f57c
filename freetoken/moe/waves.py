"""Waves: a MoE layer whose routed experts outnumber the cache's slots runs in groups.

A prefill chunk can route to every expert of a layer (T * k pairs >= E), while the slot pool
may hold far fewer (one DeepSeek-V3 layer's experts are 22 GB in bf16). Such a layer runs in
waves over the one pool:

  wave 0     the needed experts already resident (no copy: they compute while wave 1 copies);
  wave 1..   the misses, busiest first, in groups of at most half the slots (wave_size).

Wave i+1 is fetched into slots wave i does not use *before* wave i's kernel is enqueued, so on
CUDA its copies run on the copy stream while wave i computes (double buffering); its victims can
be experts of wave i-1 or older because the fetcher's copy stream first waits for every kernel
the compute stream had been given (wave i-1's included). Where two neighbouring waves do not
fit together (wave 0 fills the cache), wave i+1 is fetched after wave i's kernel instead.
Each wave computes only its own (token, expert) pairs: the fused MoE over P one-expert rows
(x[token] [P, D], ids and weights [P, 1]) through the slot map, added into a float32 [T, D]
sum, so the layer equals the one-kernel run up to the order of float32 additions (the kernel
also sums a token's k rows in float32). On the CPU the same code runs with plain copies.

The cache policy still decides every victim; the slots of the wave being computed and of the
one being fetched are protected, and the caller's next-layer prefetch runs before the last
wave's kernel, protecting that wave only (the earlier ones are already enqueued).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:       # plan.py imports this file; the cache imports the store, which imports plan
    from freetoken.moe.cache import ExpertCache
    from freetoken.moe.layout import ExpertLayout


def wave_size(slots: int) -> int:
    """Misses per wave: half the slots, so one wave computes while the next one copies."""
    return max(1, slots // 2)


def max_waves(step_experts: int, slots: int) -> int:
    """The most waves a layer step that needs step_experts experts runs in: with one of them
    resident (a wave of its own) and the rest missing; none resident: ceil(n / wave_size)."""
    if step_experts <= slots:
        return 1
    return 1 + math.ceil((step_experts - 1) / wave_size(slots))


def split_waves(resident: list[int], missing: list[int], slots: int) -> list[list[int]]:
    """The waves of one layer step: the resident experts first, then the misses (busiest
    first) in balanced groups of at most wave_size(slots)."""
    waves = [list(resident)] if resident else []
    n = math.ceil(len(missing) / wave_size(slots))
    start = 0
    for i in range(n):          # sizes differ by at most one: a last wave of 1 is a launch wasted
        size = len(missing) // n + (i < len(missing) % n)
        waves.append(missing[start:start + size])
        start += size
    return waves


@dataclasses.dataclass
class WaveStats:
    waves: int = 0                  # waves run
    fetched: list[int] = dataclasses.field(default_factory=list)    # misses copied in
    self_evicted: list[int] = dataclasses.field(default_factory=list)
    # ^ this layer's experts that its own later waves pushed out (each a miss when reused)


def wave_pairs(ids_h: torch.Tensor, wave: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, k position) [P] of the pairs of ids [T, k] (host) routed to the wave's experts."""
    return torch.where(torch.isin(ids_h, torch.tensor(wave, dtype=ids_h.dtype)))


def run_waves(cache: ExpertCache, layout: ExpertLayout, layer: int, x: torch.Tensor,
              weights: torch.Tensor, ids: torch.Tensor, ids_h: torch.Tensor,
              waves: list[list[int]], before_last: Callable[[set], None]) -> tuple:
    """x [T, D], weights and ids [T, k] on the device (ids_h: ids on the host) -> (the layer's
    output as a float32 [T, D] sum over the waves, WaveStats). before_last(keys) runs once
    the last wave is resident (the next layer's prefetch), keys being what it must not evict."""
    stats = WaveStats(waves=len(waves))
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    keys = [{(layer, e) for e in w} for w in waves]
    res = cache.ensure(layer, waves[0])
    done: set = set()               # keys of the waves whose kernels are enqueued
    for i, wave in enumerate(waves):
        stats.fetched += res.fetched
        stats.self_evicted += [key[1] for key in res.evicted if key in done]
        nxt = waves[i + 1] if i + 1 < len(waves) else None
        early = nxt is not None and len(wave) + len(nxt) <= cache.num_slots
        res_next = cache.ensure(layer, nxt, keep=keys[i]) if early else None
        if nxt is None:
            before_last(keys[i])
        cache.wait_for(res.event)
        _add_wave(out, cache, layout, layer, x, weights, ids, ids_h, wave)
        done |= keys[i]
        if nxt is not None:
            res = res_next if early else cache.ensure(layer, nxt)
    return out, stats


def _add_wave(out, cache, layout, layer, x, weights, ids, ids_h, wave) -> None:
    """out [T, D] float32 += the wave's pairs through the fused MoE over the slot pool."""
    token, pos = wave_pairs(ids_h, wave)
    if x.device.type == "cuda":     # one pinned copy for both index vectors
        both = torch.stack([token, pos]).pin_memory().to(x.device, non_blocking=True)
        token, pos = both[0], both[1]
    rows = layout.run(x[token], cache.pool, weights[token, pos, None], ids[token, pos, None],
                      cache.slot_map(layer))
    out.index_add_(0, token, rows.float())
