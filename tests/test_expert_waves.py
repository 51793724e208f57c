"""An expert cache smaller than one layer (moe/waves.py): every backend and every cache size
from top_k up gives the resident run's greedy tokens and logits on CPU, with prefill chunks
that route to every expert of a layer (asserted from a routing trace); the waves' order keeps a
wave's slots from being overwritten before its kernel reads them, and the next wave's copies go
out before the current wave's kernel (double buffering); the counters /v1/instrumentation
serves; and LLM's keywords in their flags' string forms.
"""

import pytest
import torch

import freetoken.moe.waves as waves_mod
from freetoken import LLM, SamplingParams
from freetoken.llm import from_flag_text
from freetoken.moe.cache import ExpertCache
from freetoken.moe.layout import ExpertLayout
from freetoken.moe.policy import make_policy
from freetoken.moe.runtime import MoeRuntime
from freetoken.moe.store import ExpertStore
from freetoken.moe.trace import RoutingTrace
from freetoken.moe.waves import max_waves, run_waves, split_waves, wave_size
from hf_checkpoints import cached_checkpoint

# mixtral "gqa": 2 MoE layers x 8 experts, top-2. A 40-token prompt prefilled in chunks of 24
# routes 48 pairs per layer in its first chunk: with random weights, all 8 experts.
PROMPTS = [[(11 * i + 5) % 300 for i in range(40)], [5, 17, 99, 3], [(7 * i + 3) % 300 for i in range(13)]]
PARAMS = SamplingParams(max_tokens=6, min_tokens=6, temperature=0)
CHUNK = 24


pytestmark = pytest.mark.usefixtures("one_thread", "no_saved_profiles")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(cached_checkpoint(str(tmp_path_factory.mktemp("hf")), "mixtral", "gqa"))
    ref = LLM(path, skip_tokenizer_init=True, max_prefill_length=CHUNK)
    tokens = [o.token_ids for o in ref.generate(PROMPTS, PARAMS)]
    return path, ref.model_config, tokens, ref.logits(PROMPTS[0])


def test_waves_are_the_resident_experts_then_balanced_groups_of_half_the_slots():
    assert [wave_size(s) for s in (1, 2, 3, 8, 9)] == [1, 1, 1, 4, 4]
    assert split_waves([3, 1], [7, 0, 5, 2, 6], 4) == [[3, 1], [7, 0], [5, 2], [6]]
    # 7 misses in groups of at most 3: three groups, balanced (not 3, 3, 1).
    assert split_waves([], [9, 8, 7, 6, 5, 4, 3], 6) == [[9, 8, 7], [6, 5], [4, 3]]
    assert split_waves([], [4, 5, 6, 7, 8], 8) == [[4, 5, 6], [7, 8]]
    assert split_waves([2], [], 2) == [[2]]
    assert max_waves(8, 8) == 1 and max_waves(8, 2) == 8 and max_waves(16, 8) == 5


@pytest.mark.parametrize("slots,policy", [(2, "lru"), (3, "lfu-decay"), (5, "lru")])
def test_run_waves_equals_the_layer_in_one_kernel_and_keeps_the_last_wave_from_a_prefetch(
        slots, policy):
    """One layer of 8 experts (routed to all of them) on 2..5 slots, against the reference over
    the whole bank; before its last wave the next layer's prefetch asks for all 8 of its
    experts, which only the last wave's protection keeps out of that wave's slots."""
    g = torch.Generator().manual_seed(slots)
    store = ExpertStore((0, 1), 8, ExpertLayout(16, 8, torch.float32), available_bytes=2 ** 30)
    for layer in store.layers:
        for t in store.bank(layer).values():
            t.copy_(torch.randn(t.shape, generator=g))
    cache = ExpertCache(store, store.layers, slots, make_policy(policy), "cpu")
    cache.ensure(0, [5])                 # one resident expert: wave 0
    x = torch.randn(12, 16, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(12)])
    weights = torch.rand(12, 2, generator=g)
    assert set(ids.reshape(-1).tolist()) == set(range(8))
    needed = sorted(set(ids.reshape(-1).tolist()) - {5})
    waves = split_waves([5], needed, slots)
    moved = []
    out, st = run_waves(cache, store.layout, 0, x, weights, ids, ids, waves,
                        lambda keep: moved.extend(cache.prefetch(1, list(range(8)), keep)))
    want = store.layout.run_reference(x, store.bank(0), weights, ids)
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-5)
    assert st.waves == len(waves) == max_waves(8, slots) and sorted(st.fetched) == needed
    # The prefetch took every slot but the last wave's.
    assert len(moved) == slots - len(waves[-1]) and all((0, e) in cache.slot_of for e in waves[-1])
    earlier = [e for w in waves[:-1] for e in w]
    assert st.self_evicted and len(set(st.self_evicted)) == len(st.self_evicted)
    assert set(st.self_evicted) <= set(earlier)


def test_ensure_keeps_the_keys_it_is_told_to_keep_even_the_policys_first_victims():
    store = ExpertStore((0,), 8, ExpertLayout(8, 4, torch.float32), available_bytes=2 ** 30)
    cache = ExpertCache(store, store.layers, 4, make_policy("lru"), "cpu")
    cache.ensure(0, [0, 1, 2, 3])        # 0 and 1 are the least recently used
    res = cache.ensure(0, [6, 7], keep={(0, 0), (0, 1)})
    assert sorted(res.evicted) == [(0, 2), (0, 3)]
    with pytest.raises(RuntimeError, match="cannot hold"):
        cache.ensure(0, [4, 5], keep={(0, 0), (0, 1), (0, 6)})


def _run(path, **kw):
    llm = LLM(path, skip_tokenizer_init=True, max_prefill_length=CHUNK, **kw)
    rt = llm.runner.moe
    rt.trace = RoutingTrace(tuple(llm.runner.model.moe_blocks()), rt.store.num_experts, rt.top_k)
    tokens = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    return llm, tokens


# Every size from top_k (2) to all 16 experts with the default policy; the other backends at
# the sizes where waves start, run deep, or stop.
SIZES = [dict(moe_backend="offload", moe_cache_size=s) for s in range(2, 17)]
OTHERS = ([dict(moe_backend="offload", moe_cache_size=s, moe_cache_policy="lru") for s in (2, 5)]
          + [dict(moe_backend="offload", moe_cache_size=s, moe_prefetch="off") for s in (3,)]
          + [dict(moe_backend="hybrid", moe_cache_size=s) for s in (2, 7)]
          + [dict(moe_backend="hybrid", moe_cache_size=2, moe_hybrid_k=2)]
          + [dict(moe_backend="offload", moe_cache_size=2, moe_cpu_layers="1")])


@pytest.mark.parametrize("kw", SIZES + OTHERS,
                         ids=[",".join(f"{k.removeprefix('moe_')}={v}" for k, v in kw.items())
                              for kw in SIZES + OTHERS])
def test_every_backend_and_cache_size_from_top_k_matches_resident(model, kw):
    path, mc, want_tokens, want_logits = model
    llm, got = _run(path, **kw)
    assert got == want_tokens
    err = ((llm.logits(PROMPTS[0]) - want_logits).abs().max() / want_logits.abs().max()).item()
    assert err < 1e-5, f"relative logit error {err:.2e}"
    rt = llm.runner.moe
    # The first prefill chunk needed every expert of every MoE layer.
    full = {r.layer for step in rt.trace.steps for r in step.routes
            if len(r.experts) == mc.num_experts}
    assert full == set(llm.runner.model.moe_blocks())
    report = llm.runner.moe_report()
    c, slots = report["counters"], report["cache"]["slots"]
    assert report["cache"]["min_slots"] == mc.num_experts_per_tok
    cached = report["cache"]["layers"]
    assert [w["layer"] for w in report["cache"]["waves"]] == cached
    assert all(w["slots"] == slots and w["step_experts"] == mc.num_experts
               and w["max_waves"] == max_waves(mc.num_experts, slots) for w in report["cache"]["waves"])
    assert c["hits"] + c["misses"] == c["lookups"]
    if slots < mc.num_experts and kw["moe_backend"] == "offload":
        # A layer that needs 8 experts cannot run in one go on fewer slots.
        assert c["wave_steps"] > 0 and c["waves"] >= 2 * c["wave_steps"]
        assert sum(p["waves"] for p in report["counters"]["per_layer"]) == c["waves"]
    if slots >= mc.num_experts or len(cached) * mc.num_experts == slots:
        assert c["wave_steps"] == c["waves"] == c["wave_evictions"] == 0
    assert 0 <= c["wave_refetches"] <= c["wave_evictions"]


def test_hybrid_runs_waves_and_a_cpu_share_in_one_layer_step(model, monkeypatch):
    """Hybrid fetching more misses than there are slots (3 on 2 slots) and leaving the rest to
    the CPU: the CPU share adds into the waves' sum. On this CPU the measured costs fetch every
    prefill miss, so the split is fixed here."""
    path, mc, want_tokens, want_logits = model
    monkeypatch.setattr(MoeRuntime, "_fetch_budget", lambda self, layer, needed, counts: 3)
    llm, got = _run(path, moe_backend="hybrid", moe_cache_size=2)
    assert got == want_tokens
    err = ((llm.logits(PROMPTS[0]) - want_logits).abs().max() / want_logits.abs().max()).item()
    assert err < 1e-5, f"relative logit error {err:.2e}"
    c = llm.runner.moe_report()["counters"]
    assert c["wave_steps"] > 0 and c["cpu_experts"] > 0
    assert c["hits"] + c["misses"] == c["lookups"]


def test_a_waves_slots_hold_its_experts_until_its_kernel_and_the_next_wave_copies_first(
        model, monkeypatch):
    """The order a GPU would see: every copy and kernel in the order they are enqueued. Each
    wave's kernel must find, in each slot it reads, the expert the slot's latest copy wrote
    (no copy of the next wave or of the next layer's prefetch overwrote it in between), and
    with 6 slots (waves of 3) the next wave's copies are enqueued before the current kernel."""
    path = model[0]
    log = []
    real_add = waves_mod._add_wave

    def add_wave(out, cache, layout, layer, x, weights, ids, ids_h, wave):
        log.append(("kernel", layer, {e: cache.slot_of[(layer, e)] for e in wave}))
        return real_add(out, cache, layout, layer, x, weights, ids, ids_h, wave)

    monkeypatch.setattr(waves_mod, "_add_wave", add_wave)
    llm = LLM(path, skip_tokenizer_init=True, max_prefill_length=CHUNK, moe_backend="offload",
              moe_cache_size=6, moe_prefetch="all")
    fetcher = llm.runner.moe.cache.fetcher
    real_fetch = fetcher.fetch

    def fetch(layer, moves):
        log.append(("copy", layer, dict(moves)))
        return real_fetch(layer, moves)

    monkeypatch.setattr(fetcher, "fetch", fetch)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == model[2]
    written = {}        # slot -> (layer, expert) its latest copy wrote
    early = 0
    for i, (kind, layer, m) in enumerate(log):
        if kind == "copy":
            written.update({slot: (layer, e) for e, slot in m.items()})
            continue
        for e, slot in m.items():
            assert written.get(slot) == (layer, e), f"event {i}: slot {slot} of layer {layer}'s wave"
        # Double buffering: a copy of this layer's next wave right before this kernel.
        early += log[i - 1][0] == "copy" and log[i - 1][1] == layer and i + 1 < len(log) \
            and log[i + 1][0] == "kernel" and log[i + 1][1] == layer
    assert sum(kind == "kernel" for kind, _, _ in log) > 4 and early > 0


def test_llm_keywords_take_the_flags_string_forms(model):
    llm = LLM(model[0], skip_tokenizer_init=True, moe_backend="offload", moe_cache_size="3",
              moe_cpu_layers="1,", max_prefill_length="24", max_running_requests="4",
              kv_reserve_tokens="64", moe_lfu_decay="0.5", pin_budget_gb="0",
              max_model_len="128", enable_prefix_caching="false")
    m = llm.engine_config.moe
    assert (m.cache_size, m.cpu_layers, m.kv_reserve_tokens, m.lfu_decay, m.pin_budget_gb) == \
        (3, (1,), 64, 0.5, 0.0)
    assert llm.engine_config.max_model_len == 128 and llm.runner.moe_report()["cpu_layers"] == [1]
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == model[2]
    sched = llm.engine.scheduler.config
    assert (sched.max_prefill_length, sched.max_running_requests, sched.enable_prefix_caching) == \
        (24, 4, False)
    # The flag's spellings of moe_cpu_layers: ids, a count, a fraction.
    assert [from_flag_text("moe_cpu_layers", t) for t in ("1,3", "2", "0.5")] == [(1, 3), 2, 0.5]
    assert from_flag_text("moe_cache_rate", " 0.25 ") == 0.25
    assert from_flag_text("moe_backend", "cpu") == "cpu" and from_flag_text("moe_cache_size", 4) == 4
    with pytest.raises(ValueError, match="moe_cache_size must be an integer, got '2.5'"):
        LLM(model[0], moe_cache_size="2.5")
    with pytest.raises(ValueError, match="moe_cpu_layers must be layer ids"):
        LLM(model[0], moe_cpu_layers="one")
    with pytest.raises(ValueError, match="enable_prefix_caching must be true or false"):
        from_flag_text("enable_prefix_caching", "maybe")
