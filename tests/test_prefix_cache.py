"""Prefix caching: the hash chain, the allocator's invariants under random traces, and greedy
tokens identical with and without the cache through LLM on tiny checkpoints (shared prefixes
ending inside a block and on a boundary, a strict prefix of a cached prompt, chunked prefill,
preemption, abort, identical prompts in one batch, every MoE backend, warmup)."""

import logging
import random

import pytest
import torch

from freetoken import LLM, SamplingParams
from freetoken.engine.kv_cache import BlockAllocator
from freetoken.engine.prefix_cache import extend_hashes, hash_block, unsupported_reason
from freetoken.engine.sampling_params import SamplingParams as SP
from freetoken.scheduler.config import SchedulerConfig
from freetoken.scheduler.core import EngineCore
from freetoken.scheduler.request import Request
from freetoken.scheduler.scheduler import Scheduler
from hf_checkpoints import cached_checkpoint

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
BASE = [(7 * i + 3) % 300 for i in range(64)]      # 4 blocks of 16


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(cached_checkpoint(str(tmp_path_factory.mktemp("hf")), "qwen3_moe", "gqa_norm_topk"))


@pytest.fixture(scope="module")
def cold(path):
    """Reference tokens without the cache, one fresh computation per prompt."""
    llm = LLM(path, skip_tokenizer_init=True, enable_prefix_caching=False)
    memo = {}

    def run(prompt, params=GREEDY):
        key = (tuple(prompt), params.max_tokens)
        if key not in memo:
            memo[key] = llm.generate([prompt], params)[0].token_ids
        return memo[key]
    return run


def test_hash_chain_names_the_whole_prefix():
    a = extend_hashes([], lambda s, e: BASE[s:e], 16, 64)
    assert len(a) == 4 and len(set(a)) == 4
    changed = BASE[:20] + [999] + BASE[21:]
    b = extend_hashes([], lambda s, e: changed[s:e], 16, 64)
    assert b[0] == a[0] and all(x != y for x, y in zip(a[1:], b[1:]))   # block 1 on differs
    assert extend_hashes([], lambda s, e: BASE[s:e], 16, 40) == a[:2]     # partial block unnamed
    assert hash_block(b"", BASE[:16], b"lora-1") != a[0]


def _prefix_run(llm, first, second, params=GREEDY):
    llm.generate([first], params)
    out = llm.generate([second], params)[0]
    stats = llm.engine.scheduler.allocator.prefix.stats
    return out.token_ids, stats


@pytest.mark.parametrize("second,hit", [
    (BASE[:40] + [5, 6, 7], 32),         # shares 40 tokens: ends inside block 2
    (BASE[:32] + [9, 9, 9, 9], 32),      # shares exactly 2 blocks
    (BASE[:48], 32),                     # a strict prefix, on a boundary: the last block recomputed
    (BASE[:37], 32),                     # a strict prefix ending inside a block
    (BASE[:10], 0),                      # shorter than one block
    (BASE, 48),                          # the same prompt: all but its last block
], ids=["inside-block", "on-boundary", "strict-prefix-boundary", "strict-prefix-inside", "short", "same"])
def test_greedy_tokens_identical_with_the_cache(path, cold, second, hit):
    llm = LLM(path, skip_tokenizer_init=True, max_prefill_length=16)
    got, stats = _prefix_run(llm, BASE, second)
    assert got == cold(second)
    assert stats.hit_tokens == hit and stats.queried_tokens == len(BASE) + len(second)
    alloc = llm.runner.allocator
    alloc.check()
    assert alloc.num_free == alloc.num_blocks and alloc.num_cached > 0


def test_chunked_prefill_after_a_hit_and_decode_blocks_cached(path, cold):
    # Chunks of 7 never align with blocks; the second prompt starts from turn 1's output too.
    llm = LLM(path, skip_tokenizer_init=True, max_prefill_length=7)
    first = llm.generate([BASE], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    turn2 = BASE + first.token_ids + [11, 12, 13]
    assert llm.generate([turn2], GREEDY)[0].token_ids == cold(turn2)
    # 64 + 30 tokens: 93 computed -> 5 full blocks, the output's first block among them.
    assert llm.engine.scheduler.allocator.prefix.stats.hit_tokens == 80


def test_identical_prompts_in_one_batch_and_after(path, cold):
    """n > 1 in miniature: the same prompt several times at once (the first is prefilled, the
    others wait for its blocks and share them), then again (all served from the cache)."""
    llm = LLM(path, skip_tokenizer_init=True, max_prefill_length=256)
    want = cold(BASE)
    stats = llm.engine.scheduler.allocator.prefix.stats
    assert [o.token_ids for o in llm.generate([BASE] * 3, GREEDY)] == [want] * 3
    assert stats.hit_tokens == 2 * 48            # the prompt's 3 full blocks, twice shared
    assert [o.token_ids for o in llm.generate([BASE] * 3, GREEDY)] == [want] * 3
    assert stats.hit_tokens == 5 * 48
    llm.runner.allocator.check()


def test_preemption_keeps_blocks_cached(path, cold):
    # 7 blocks for 4 requests of a shared 32-token prefix + 20 output: preemptions are forced.
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=112, kv_cache_tokens=112)
    prompts = [BASE[:32] + [i + 1] * 8 for i in range(4)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == [cold(p, params) for p in prompts]
    alloc = llm.runner.allocator
    alloc.check()
    assert alloc.num_free == alloc.num_blocks
    assert alloc.prefix.stats.hit_tokens > 0


def test_abort_mid_prefill_leaves_computed_blocks(path, cold):
    llm = LLM(path, skip_tokenizer_init=True, max_prefill_length=16)
    req = llm.engine.add_request(BASE, SP(max_tokens=4, temperature=0, ignore_eos=True))
    llm.engine.step()
    llm.engine.step()                      # 32 of 64 tokens computed
    llm.engine.abort(req.request_id)
    alloc = llm.runner.allocator
    alloc.check()
    assert alloc.num_cached == 2 and alloc.num_free == alloc.num_blocks
    assert llm.generate([BASE], GREEDY)[0].token_ids == cold(BASE)
    assert alloc.prefix.stats.hit_tokens == 32


def test_caching_off_keeps_nothing(path):
    llm = LLM(path, skip_tokenizer_init=True, enable_prefix_caching=False)
    llm.generate([BASE, BASE], GREEDY)
    llm.generate([BASE], GREEDY)
    alloc = llm.runner.allocator
    assert alloc.num_cached == 0 and alloc.prefix.stats.queried_tokens == 0
    assert alloc.num_empty == alloc.num_blocks


def test_warmup_leaves_no_hits(path):
    from freetoken.scheduler.warmup import run_warmup
    llm = LLM(path, skip_tokenizer_init=True, max_prefill_length=32, max_model_len=200)
    run_warmup(llm.engine, max_depth=150)
    alloc = llm.runner.allocator
    assert alloc.num_cached == 0 and alloc.prefix.num_hashed == 0
    assert alloc.prefix.stats.hit_tokens == 0 and alloc.prefix.stats.queried_tokens == 0


def test_a_non_attention_cache_turns_caching_off(caplog):
    class RecurrentState:       # the shape of a linear-attention layer's spec to come
        pass

    class Runner:
        cache_specs = {0: RecurrentState()}

    assert "RecurrentState" in unsupported_reason(Runner.cache_specs)
    with caplog.at_level(logging.INFO, logger="freetoken.engine"):
        config = EngineCore._resolve_prefix_caching(SchedulerConfig(), Runner())
    assert config.enable_prefix_caching is False
    assert [r.message for r in caplog.records if "prefix caching" in r.message] == [
        "prefix caching off: the model keeps RecurrentState state, which a cached prefix does not "
        "restore (caching covers per-token K/V and MLA latents only)"]


BACKENDS = [
    ("offload-min", dict(moe_backend="offload", moe_cache_size=8)),
    ("offload-all", dict(moe_backend="offload")),
    ("cpu", dict(moe_backend="cpu")),
    ("hybrid-k1", dict(moe_backend="hybrid", moe_cache_size=8, moe_hybrid_k=1)),
    ("offload-cpu-layers", dict(moe_backend="offload", moe_cache_size=8, moe_cpu_layers=1)),
]


@pytest.mark.parametrize("name,kwargs", BACKENDS, ids=[b[0] for b in BACKENDS])
def test_every_moe_backend_with_the_cache(path, cold, name, kwargs, monkeypatch, tmp_path):
    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(tmp_path))   # no saved bandwidth profile
    llm = LLM(path, skip_tokenizer_init=True, max_prefill_length=16, **kwargs)
    second = BASE[:40] + [1, 2, 3]
    got, stats = _prefix_run(llm, BASE, second)
    assert llm.runner.moe_report()["backend"] == kwargs["moe_backend"]
    assert got == cold(second) and stats.hit_tokens == 32


# -- the allocator under random traces ---------------------------------------------------------
def _trace(seed: int, steps: int = 400):
    """Admit / step / finish / abort at random over a small pool (preemption follows), with
    prompts drawn from a few shared prefixes. A fake KV store records which token each slot
    holds, so a block overwritten while shared, or reused while referenced, shows up."""
    rng = random.Random(seed)
    bs = 4
    alloc = BlockAllocator(num_blocks=14, block_size=bs)
    sched = Scheduler(SchedulerConfig(max_prefill_length=rng.choice([3, 8, 32]),
                                      max_running_requests=6), alloc)
    store: dict[tuple[int, int], int] = {}
    stems = [[rng.randrange(5) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    live: list[Request] = []
    ids = iter(range(10 ** 6))
    for _ in range(steps):
        op = rng.random()
        if op < 0.3 and len(live) < 10:
            prompt = rng.choice(stems)[:rng.randrange(1, 20)] + [rng.randrange(5) for _ in range(rng.randrange(3))]
            req = Request(f"r{next(ids)}", prompt or [1], SP(max_tokens=16), 16)
            live.append(req)
            sched.add(req)
        elif op < 0.4 and live:
            req = live.pop(rng.randrange(len(live)))      # abort, wherever it is
            sched.remove(req)
        for s in sched.schedule():
            r = s.request
            for p in range(r.num_computed_tokens, r.num_computed_tokens + s.num_tokens):
                block = r.block_ids[p // bs]
                assert alloc.refcount(block) == 1 and block not in alloc.prefix.hash_of, \
                    "a shared or cached block was written"
                store[(block, p % bs)] = r.token_ids(p, p + 1)[0]
            r.num_computed_tokens += s.num_tokens
            sched.cache_blocks(r)
            if s.samples:
                r.output_token_ids.append(rng.randrange(5))
                if r.num_output_tokens >= r.max_tokens or rng.random() < 0.05:
                    live.remove(r)
                    sched.remove(r)
        alloc.check()
        refs = {}
        for r in sched.running:
            for b in r.block_ids:
                refs[b] = refs.get(b, 0) + 1
            # every computed token is still in its slot: nothing it references was evicted
            for p in range(r.num_computed_tokens):
                assert store[(r.block_ids[p // bs], p % bs)] == r.token_ids(p, p + 1)[0]
        assert all(alloc.refcount(b) == n for b, n in refs.items())
        assert alloc.num_used == len(refs)
    return alloc, sched


@pytest.mark.parametrize("seed", range(12))
def test_allocator_invariants_under_random_traces(seed):
    alloc, sched = _trace(seed)
    assert alloc.prefix.stats.hit_tokens > 0      # the traces really share prefixes
    assert sched.num_preemptions > 0              # and really run out of blocks


def test_prompt_logprobs_bypass_a_cached_prefix(path):
    """The cache keeps KV, not logits: a request asking for its prompt's logprobs computes
    every prompt position even when the prompt is cached, and gets every logprob."""
    llm = LLM(path, skip_tokenizer_init=True)
    prompt = [(5 * i + 2) % 300 for i in range(40)]
    llm.generate([prompt], GREEDY)
    out = llm.generate([prompt], SP(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    assert all(e is not None for e in out.prompt_logprobs[1:])
