"""The GPU expert cache and its policies under seeded random routing traces (on the CPU, where
the pool is a separate host buffer and the logic is the same), and the startup arithmetic that
sizes it: backend choice, auto cache slots, the one-layer floor, CPU layers, hybrid K."""

import dataclasses
import random
from collections import OrderedDict

import pytest
import torch

from freetoken.moe.cache import ExpertCache
from freetoken.moe.config import MoeConfig, parse_cpu_layers
from freetoken.moe.plan import (DeviceMemory, MoePlanError, MoeShape, auto_cache_budget,
                                hybrid_k, plan_moe, resolve_cpu_layers)
from freetoken.moe.policy import LFUDecayPolicy, LRUPolicy, make_policy
from freetoken.moe.layout import ExpertLayout
from freetoken.moe.store import ExpertStore

MiB, GiB = 2 ** 20, 2 ** 30


def make_store(num_layers=4, num_experts=8, hidden=8, width=4, seed=0) -> ExpertStore:
    store = ExpertStore(tuple(range(num_layers)), num_experts,
                        ExpertLayout(hidden, width, torch.float32), available_bytes=GiB)
    g = torch.Generator().manual_seed(seed)
    for layer in store.layers:       # distinct random weights: a mixed-up slot cannot pass
        for t in store.bank(layer).values():
            t.copy_(torch.randn(t.shape, generator=g))
    return store


def assert_consistent(cache: ExpertCache, store: ExpertStore) -> None:
    """Every mapped slot holds its expert's weights; maps, owners and free slots agree."""
    for (layer, e), slot in cache.slot_of.items():
        assert cache.owner[slot] == (layer, e)
        for name, pool in cache.pool.items():
            assert torch.equal(pool[slot], store.bank(layer)[name][e]), f"slot {slot} != {layer}/{e} {name}"
    assert len(set(cache.slot_of.values())) == len(cache.slot_of)
    assert sum(o is not None for o in cache.owner) == len(cache.slot_of)
    for layer in cache.layers:
        want = torch.full((store.num_experts,), -1, dtype=torch.int32)
        for (l, e), slot in cache.slot_of.items():
            if l == layer:
                want[e] = slot
        assert torch.equal(cache.host_slot_map(layer), want)
        assert torch.equal(cache.slot_map(layer).cpu(), want)


@pytest.mark.parametrize("policy,slots,staging", [("lru", 8, False), ("lfu-decay", 8, True),
                                                  ("lru", 21, True), ("lfu-decay", 32, False)])
def test_random_traces_keep_the_cache_consistent(policy, slots, staging):
    store = make_store()
    cache = ExpertCache(store, store.layers, slots, make_policy(policy), "cpu",
                        force_staging=staging)
    rng = random.Random(slots)
    lookups = fetched = 0
    for _ in range(40):
        cache.begin_step()
        for layer in store.layers:
            needed = rng.sample(range(8), rng.randint(1, 8))
            in_use = {(layer, e) for e in needed}
            max_fetch = rng.choice([None, None, 0, 2])         # hybrid's cap now and then
            res = cache.ensure(layer, needed, max_fetch)
            lookups += len(needed)
            fetched += len(res.fetched)
            assert sorted(res.hits + res.fetched + res.skipped) == sorted(needed)
            assert max_fetch is None and not res.skipped or len(res.fetched) <= max_fetch
            assert not in_use & set(res.evicted), "evicted an expert the step uses"
            assert all((layer, e) in cache.slot_of for e in res.hits + res.fetched)
            assert all((layer, e) not in cache.slot_of for e in res.skipped)
            # The next layer's guess is fetched while this layer computes: it may evict
            # anything but this layer's experts.
            nxt = (layer + 1) % len(store.layers)
            cache.prefetch(nxt, rng.sample(range(8), rng.randint(1, 8)),
                           {(layer, e) for e in res.hits + res.fetched})
            assert all((layer, e) in cache.slot_of for e in res.hits + res.fetched)
            assert_consistent(cache, store)
    assert cache.num_lookups == lookups
    assert sum(cache.hits.values()) + sum(cache.misses.values()) == lookups
    assert cache.num_evictions > 0 or slots >= 32
    copied = fetched + cache.num_prefetched
    assert cache.fetcher.num_experts_copied == copied
    assert cache.fetcher.bytes_copied == copied * store.expert_bytes
    assert (cache.fetcher.num_staged == copied) == staging


def test_lru_evicts_the_least_recently_used():
    store = make_store(num_layers=3, num_experts=8)
    cache = ExpertCache(store, store.layers, 8, LRUPolicy(), "cpu")
    order: OrderedDict = OrderedDict()          # the reference: oldest use first
    rng = random.Random(1)
    for _ in range(50):
        cache.begin_step()
        for layer in store.layers:
            needed = rng.sample(range(8), rng.randint(1, 5))
            protected = {(layer, e) for e in needed}
            expected = []
            for e in needed:
                key = (layer, e)
                if key not in order and len(order) == 8:
                    victim = next(k for k in order if k not in protected)
                    del order[victim]
                    expected.append(victim)
                order[key] = None
                order.move_to_end(key)
            assert cache.ensure(layer, needed).evicted == expected
    assert cache.num_evictions > 50


@pytest.mark.parametrize("policy", ["lru", "lfu-decay"])
@pytest.mark.parametrize("used", [False, True])
def test_a_wrong_prefetch_is_evicted_first_and_a_used_one_is_kept(policy, used):
    """A prefetched expert enters cold: until a lookup uses it, it is the next victim, so a
    wrong guess does not push out an expert that was really used."""
    store = make_store(num_layers=2, num_experts=8)
    cache = ExpertCache(store, store.layers, 4, make_policy(policy), "cpu")
    cache.begin_step()
    cache.ensure(0, [0, 1])
    assert cache.prefetch(1, [5], protected={(0, 0), (0, 1)}) == [5]
    if used:
        assert cache.ensure(1, [5]).hits == [5]
    cache.ensure(0, [2])                          # the last free slot
    evicted = cache.ensure(0, [3]).evicted
    assert evicted == ([(0, 0)] if used else [(1, 5)])
    assert_consistent(cache, store)


def test_lfu_decay_evicts_the_lowest_decayed_count():
    """The reference keeps every key's count, cached or not: an evicted expert comes back
    with its decayed count, not from zero."""
    # decay 0.5 keeps both sides in exact binary arithmetic, so even ties must agree.
    decay = 0.5
    store = make_store(num_layers=3, num_experts=8)
    cache = ExpertCache(store, store.layers, 8, LFUDecayPolicy(decay), "cpu")
    score, stamp, cached, clock = {}, {}, set(), 0
    rng = random.Random(2)
    returned = 0
    for _ in range(40):
        cache.begin_step()
        score = {k: v * decay for k, v in score.items()}
        for layer in store.layers:
            needed = rng.sample(range(8), rng.randint(1, 5))
            protected = {(layer, e) for e in needed}
            expected = []
            for e in needed:
                key = (layer, e)
                if key not in cached:
                    returned += score.get(key, 0.0) > 0
                    if len(cached) == 8:
                        victim = min((k for k in cached if k not in protected),
                                     key=lambda k: (score[k], stamp[k]))
                        cached.discard(victim)
                        expected.append(victim)
                    cached.add(key)
                    stamp[key] = clock = clock + 1         # placed
                score[key] = score.get(key, 0.0) + 1.0
                stamp[key] = clock = clock + 1
            assert cache.ensure(layer, needed).evicted == expected
    assert returned > 20, "the trace should bring evicted experts back"
    for key, value in score.items():
        assert cache.policy.score(key) == value


def test_lfu_decay_ties_go_to_the_least_recent_and_counts_survive_rescaling():
    p = LFUDecayPolicy(0.5)
    for key in [(0, 0), (0, 1), (0, 2)]:
        p.insert(key)
        p.touch(key)
    assert p.victim(set()) == (0, 0)           # equal counts: the oldest use goes
    assert p.victim({(0, 0)}) == (0, 1)
    p.touch((0, 0))
    assert p.victim(set()) == (0, 1)
    for _ in range(600):                       # 2**600 would overflow without the rescale
        p.advance()
        p.touch((0, 2))
    assert p.score((0, 2)) == pytest.approx(2.0)
    assert p.victim(set()) in {(0, 0), (0, 1)}


def test_lfu_decay_counts_the_uses_hybrid_ran_on_the_cpu():
    """A miss left to the CPU is still a use: when it is fetched later it carries that count,
    so it outlives an expert that was cached but used less."""
    store = make_store(num_layers=1, num_experts=8)
    cache = ExpertCache(store, store.layers, 2, LFUDecayPolicy(0.9), "cpu")
    for _ in range(3):
        cache.begin_step()
        assert cache.ensure(0, [5], max_fetch=0).skipped == [5]
    assert cache.policy.score((0, 5)) == pytest.approx(1 + 0.9 + 0.81)
    for needed in ([0, 1], [1]):
        cache.begin_step()
        cache.ensure(0, needed)
    cache.begin_step()
    assert cache.ensure(0, [5]).evicted == [(0, 0)]     # fetched now, with its history
    cache.begin_step()
    # 1 (used twice, 1.54) goes, 5 (2.68) stays; counting only cached uses, 5 would be 0.9.
    assert cache.ensure(0, [2]).evicted == [(0, 1)]
    assert (0, 5) in cache.slot_of


# -- startup arithmetic --------------------------------------------------------------------------
SHAPE = MoeShape(moe_layers=(0, 1, 2, 3), num_experts=16, top_k=4, expert_bytes=64 * MiB,
                 dense_bytes=2 * GiB, kv_bytes_per_token=64 * 1024)   # experts: 4 GiB in all
KV = 8192                                                             # 512 MiB of KV


def test_auto_resolves_resident_when_everything_fits_else_offload():
    # dense 2 + experts 4 + KV 0.5 + reserve 1 = 7.5 GiB
    plan = plan_moe(MoeConfig(), SHAPE, DeviceMemory("cuda", 8 * GiB, 1 * GiB), 4096, KV)
    assert plan.backend == "resident" and plan.cache_slots == 0 and "7.50 GiB fit" in plan.reason
    plan = plan_moe(MoeConfig(), SHAPE, DeviceMemory("cuda", 6 * GiB, 1 * GiB), 4096, KV)
    assert plan.backend == "offload" and "exceed 6.00 GiB" in plan.reason
    # 6 - 1 - 2 - 0.5 = 2.5 GiB = 2560 MiB -> 40 slots of 64 MiB
    assert auto_cache_budget(SHAPE, DeviceMemory("cuda", 6 * GiB, 1 * GiB), KV) == 2560 * MiB
    assert plan.cache_slots == 40 and plan.cache_layers == (0, 1, 2, 3)
    assert plan.min_slots == 4 and plan.step_experts == 16 and plan.max_waves == 1
    # A CPU device: auto is resident; offload there caches every expert.
    assert plan_moe(MoeConfig(), SHAPE, DeviceMemory("cpu", GiB), 4096, KV).backend == "resident"
    plan = plan_moe(MoeConfig(backend="offload"), SHAPE, DeviceMemory("cpu", GiB), 4096, KV)
    assert plan.cache_slots == 64
    # Sizing the cache asks for one: auto then offloads even where everything fits.
    plan = plan_moe(MoeConfig(cache_size=16), SHAPE, DeviceMemory("cuda", 8 * GiB, GiB), 4096, KV)
    assert plan.backend == "offload" and plan.cache_slots == 16


def test_cache_below_top_k_is_a_clear_error_and_smaller_than_a_layer_runs_in_waves():
    # 4 - 1 - 2 - 0.5 = 0.5 GiB: 8 slots, fewer than the 16 experts one step can touch of a
    # layer: that step runs in waves of 4 misses (one resident, then ceil(15 / 4) more).
    plan = plan_moe(MoeConfig(), SHAPE, DeviceMemory("cuda", 4 * GiB, 1 * GiB), 4096, KV)
    assert (plan.cache_slots, plan.min_slots, plan.step_experts, plan.max_waves) == (8, 4, 16, 5)
    with pytest.raises(MoePlanError, match="gets 3 slots.*fewer than the 4 experts one token"):
        plan_moe(MoeConfig(backend="offload", cache_size=3), SHAPE, DeviceMemory("cpu", GiB), 4096, KV)
    # A single-token step needs only top_k slots, and one wave.
    plan = plan_moe(MoeConfig(backend="offload", cache_size=4), SHAPE, DeviceMemory("cpu", GiB), 1, KV)
    assert plan.cache_slots == 4 and plan.min_slots == 4 and plan.max_waves == 1
    # Explicit sizes are checked against the device: 6 - 1 - 2 = 3 GiB holds 48 slots, not 60.
    with pytest.raises(MoePlanError, match="60 slots need 3.75 GiB"):
        plan_moe(MoeConfig(backend="offload", cache_size=60), SHAPE,
                 DeviceMemory("cuda", 6 * GiB, 1 * GiB), 4096, KV)
    plan = plan_moe(MoeConfig(backend="hybrid", cache_rate=0.3), SHAPE,
                    DeviceMemory("cuda", 6 * GiB, 1 * GiB), 4096, KV)
    assert plan.cache_slots == 20                 # ceil(0.3 * 64)
    plan = plan_moe(MoeConfig(backend="offload", cache_size=1000), SHAPE,
                    DeviceMemory("cpu", GiB), 4096, KV)
    assert plan.cache_slots == 64                 # never more than there are experts


def test_cpu_layers_and_hybrid_k():
    layers = (1, 3, 5, 7)
    assert resolve_cpu_layers(2, layers) == (1, 3)
    assert resolve_cpu_layers(0.5, layers) == (1, 3)
    assert resolve_cpu_layers((7, 3), layers) == (3, 7)
    with pytest.raises(MoePlanError, match=r"\[2\] are not MoE layers"):
        resolve_cpu_layers((2,), layers)
    plan = plan_moe(MoeConfig(cpu_layers=(1, 3)), SHAPE, DeviceMemory("cuda", 6 * GiB, GiB), 4096, KV)
    assert plan.backend == "offload" and plan.cpu_layers == (1, 3) and plan.cache_layers == (0, 2)
    assert plan.cache_slots == 32                 # 2 layers' experts; 40 would fit
    assert parse_cpu_layers("0,3") == (0, 3) and parse_cpu_layers("2") == 2
    assert parse_cpu_layers("0.25") == 0.25
    # Fetch 1 ms, CPU 3 ms per expert: fetching 6 of 8 finishes with the CPU's 2.
    assert hybrid_k(8, 1e-3, 3e-3) == 6
    assert hybrid_k(8, 3e-3, 1e-3) == 2
    assert hybrid_k(8, 1e-3, 0.0) == 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(backend="gpu"), "moe_backend must be one of"),
    (dict(cache_size=4, cache_rate=0.5), "not both"),
    (dict(cache_rate=1.5), r"moe_cache_rate must be in \(0, 1\]"),
    (dict(cache_size=0), "positive number of slots"),
    (dict(cache_policy="fifo"), "moe_cache_policy"),
    (dict(backend="resident", cpu_layers=2), "moe_cpu_layers applies"),
    (dict(backend="cpu", cache_size=8), "has none"),
    (dict(backend="offload", hybrid_k=2), "moe_hybrid_k applies"),
    (dict(cpu_layers=1.5), "fraction"),
    (dict(pin_budget_gb=-1), "pin_budget_gb"),
])
def test_moe_config_is_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoeConfig(**kwargs)


def test_store_checks_host_memory_and_pins_only_with_cuda():
    with pytest.raises(MoePlanError, match="host RAM"):
        ExpertStore((0, 1), 8, ExpertLayout(64, 32, torch.float32), available_bytes=1000)
    store = make_store()
    assert store.pinned_bytes == 0 and store.pin_budget_bytes == 0
    assert store.expert_bytes == 3 * 8 * 4 * 4 and store.total_bytes == 4 * 8 * store.expert_bytes
    assert store.bank(0)["w13"].shape == (8, 8, 8) and store.bank(0)["w2"].shape == (8, 8, 4)


def test_auto_sizing_leaves_hybrid_models_their_state_slots():
    # A hybrid model's running requests each hold a state slot: auto sizing leaves them room
    # as it leaves the KV, so the cache cannot take the first request's state.
    hybrid = dataclasses.replace(SHAPE, state_bytes=1 * GiB)          # 16 slots of 64 MiB
    mem = DeviceMemory("cuda", 6 * GiB, 1 * GiB)
    assert auto_cache_budget(hybrid, mem, KV) == auto_cache_budget(SHAPE, mem, KV) - GiB
    plan = plan_moe(MoeConfig(), hybrid, mem, 4096, KV)
    assert plan.cache_slots == 24 and "state slots 1.00" in plan.sizing      # (2.5 - 1) GiB
    # and counts them in what `auto` must fit to keep every expert resident
    assert plan_moe(MoeConfig(), SHAPE, DeviceMemory("cuda", 7.6 * GiB, GiB), 4096, KV).backend == "resident"
    plan = plan_moe(MoeConfig(), hybrid, DeviceMemory("cuda", 7.6 * GiB, GiB), 4096, KV)
    assert plan.backend == "offload" and "state slots 1.00 GiB" in plan.reason
