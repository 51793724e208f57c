"""Cache policies compared on routing traces: the offline optimum (Belady) on a hand-checked
trace and as a floor no policy goes under, lfu-decay against LRU where a step's experts
overflow the cache and on skewed routing, and a trace recorded from the live engine that
replays to the very counters the engine reported (so bench/cache_policy.py's replays are the
cache's real behaviour, not a model of it)."""

import dataclasses
import gc

import pytest

from freetoken import LLM, SamplingParams
from freetoken.demo.tiny_model import make_tiny_model, skew_routers
from freetoken.moe.replay import belady_fetches, replay
from freetoken.moe.trace import LayerRoute, RoutingTrace, Step, synthetic_trace


def one_layer_trace(experts_per_step: list[list[int]]) -> RoutingTrace:
    return RoutingTrace((0,), 8, 1, [Step(1, [LayerRoute(0, list(e))]) for e in experts_per_step])


def test_belady_evicts_the_furthest_next_use():
    # a b c a b with 2 slots: at c, a is next used at step 3 and b at step 4, so b goes;
    # a then hits and b misses: 4 fetches. LRU evicts a at c, then misses a and b: 5.
    trace = one_layer_trace([[0], [1], [2], [0], [1]])
    best = belady_fetches(trace, 2)
    assert (best.fetched, best.hits, best.lookups) == (4, 1, 5)
    assert replay(trace, 2, "lru", prefetch=False).fetched == 5
    # The current step's experts are never evicted, even when they are next used last.
    trace = one_layer_trace([[0, 1], [2, 0], [1], [0]])
    assert belady_fetches(trace, 2).fetched == 4      # 0 1 | 2 (evicts 1) 0 hit | 1 (evicts 2) | 0 hit
    with pytest.raises(ValueError, match="needs 2 experts, the cache has 1 slots"):
        belady_fetches(one_layer_trace([[0, 1]]), 1)


@pytest.mark.parametrize("batch,rate", [(1, 0.1), (1, 0.3), (4, 0.5)])
def test_no_policy_fetches_fewer_than_the_optimum(batch, rate):
    trace = synthetic_trace(4, 16, 2, 60, batch=batch, zipf=0.8, repeat=0.3, seed=batch)
    slots = max(int(rate * 4 * 16), 2 * batch)
    best = belady_fetches(trace, slots)
    for policy in ("lru", "lfu-decay"):
        for prefetch in (False, True):
            r = replay(trace, slots, policy, prefetch=prefetch)
            assert r.fetched >= best.fetched, r.name
            assert r.lookups == best.lookups == sum(len(x.experts) for s in trace.steps for x in s.routes)
    distinct = {(r.layer, e) for s in trace.steps for r in s.routes for e in r.experts}
    assert belady_fetches(trace, 64).fetched == len(distinct)    # room for all: each once


def test_lfu_decay_keeps_hits_where_a_step_overflows_the_cache():
    """Batch 8 with top-8 of 128 experts needs ~40% of each layer per step; at a 25% cache
    LRU evicts each expert just before its next use (a cyclic scan) and hits nothing.
    lfu-decay keeps the most used experts, as the optimum does."""
    trace = synthetic_trace(8, 128, 8, 40, batch=8, zipf=0.6, repeat=0.1)
    lru = replay(trace, 256, "lru", prefetch=False)
    lfu = replay(trace, 256, "lfu-decay", prefetch=False)
    best = belady_fetches(trace, 256)
    print(f"fetched/token: lru {lru.fetched_per_token:.1f}, lfu-decay {lfu.fetched_per_token:.1f}, "
          f"optimum {best.fetched_per_token:.1f}")
    assert lru.hit_rate < 0.02
    assert lfu.hit_rate > 0.2 and lfu.fetched < 0.8 * lru.fetched


def test_lfu_decay_beats_lru_on_skewed_routing():
    """Batch 1, Qwen3-30B-A3B's routing shape, Zipf popularity with topic changes every 100
    steps, 25% cache."""
    trace = synthetic_trace(8, 128, 8, 200, zipf=1.0, repeat=0.25, seed=0)
    lru = replay(trace, 256, "lru", prefetch=False)
    lfu = replay(trace, 256, "lfu-decay", prefetch=False)
    no_decay = replay(trace, 256, "lfu-decay", decay=1.0, prefetch=False)  # stuck on old topics
    print(f"fetched/token: lru {lru.fetched_per_token:.2f}, lfu-decay {lfu.fetched_per_token:.2f}, "
          f"lfu {no_decay.fetched_per_token:.2f}")
    assert lfu.fetched < 0.95 * lru.fetched
    assert no_decay.fetched > lfu.fetched


def test_prefetch_depth_takes_the_likeliest_guesses_first():
    trace = synthetic_trace(4, 16, 4, 50, seed=5)
    none, everything = replay(trace, 24, "lfu-decay", prefetch=False), replay(trace, 24, "lfu-decay")
    assert replay(trace, 24, "lfu-decay", depth=0).fetched == none.fetched
    assert replay(trace, 24, "lfu-decay", depth=64) == dataclasses.replace(everything, name=everything.name + " 64")
    one = replay(trace, 24, "lfu-decay", depth=1)
    assert none.fetched < one.fetched < everything.fetched and 0 < one.prefetched < everything.prefetched


def test_a_trace_saved_and_loaded_replays_the_same(tmp_path):
    trace = synthetic_trace(3, 8, 2, 20, batch=2, seed=3)
    trace.save(tmp_path / "t.json")
    back = RoutingTrace.load(tmp_path / "t.json")
    assert back.steps == trace.steps and back.layers == trace.layers and back.source == trace.source
    assert replay(back, 6, "lfu-decay") == replay(trace, 6, "lfu-decay")
    (tmp_path / "bad.json").write_text('{"layers": [0]}')
    with pytest.raises(ValueError, match="bad.json is not a routing trace"):
        RoutingTrace.load(tmp_path / "bad.json")


@pytest.mark.parametrize("policy", ["lru", "lfu-decay"])
def test_a_recorded_trace_replays_to_the_engines_counters(tmp_path, policy):
    model = make_tiny_model(tmp_path / "m", hidden_size=64, num_layers=3, num_experts=16, top_k=4,
                            moe_intermediate_size=32)
    skew_routers(model)
    llm = LLM(str(model), skip_tokenizer_init=True, moe_backend="offload", moe_cache_size=20,
              moe_cache_policy=policy, max_prefill_length=16, moe_prefetch="all")
    moe = llm.runner.moe
    moe.trace = RoutingTrace(tuple(sorted(moe.mode)), 16, 4)
    # Chunked prefill and decode steps of two sequences, sampled (greedy random models loop).
    llm.generate([list(range(3, 40)), [7, 8, 9]],
                 [SamplingParams(max_tokens=24, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2)])
    live = moe.report()["counters"]
    got = replay(moe.trace, 20, policy, decay=moe.cfg.lfu_decay)
    assert len(moe.trace.steps) == live["steps"] > 25     # 3 chunks of prefill
    assert (got.lookups, got.hits) == (live["lookups"], live["hits"])
    assert got.fetched == live["experts_fetched"] and got.prefetched == live["prefetch_fetched"] > 0
    assert (got.guessed, got.guessed_used) == (live["prefetch_guessed"], live["prefetch_used"])


def test_llm_moe_trace_is_written_when_the_llm_goes(tmp_path):
    model = make_tiny_model(tmp_path / "m", hidden_size=64, num_layers=2, num_experts=8, top_k=2,
                            moe_intermediate_size=16)
    path = tmp_path / "trace.json"
    llm = LLM(str(model), skip_tokenizer_init=True, moe_backend="offload", moe_trace=str(path))
    llm.generate([[4, 5, 6]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    steps = llm.runner.moe.num_steps
    assert not path.exists()
    del llm
    gc.collect()
    trace = RoutingTrace.load(path)
    assert len(trace.steps) == steps == 5 and trace.layers == (0, 1) and trace.top_k == 2

