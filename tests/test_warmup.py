"""The warmup ladder covers every shape class a step can produce, through the real path."""

import pytest

from freetoken import LLM, SamplingParams
from freetoken.scheduler.warmup import depth_walk, extend_lengths, run_warmup
from hf_checkpoints import cached_checkpoint


def test_extend_lengths_shape():
    lengths = extend_lengths(100)
    assert lengths[:16] == list(range(1, 17))
    for n in (31, 32, 33, 63, 64, 65, 100):
        assert n in lengths
    assert max(lengths) == 100 and 127 not in lengths
    assert depth_walk(64, 200) == [64, 128, 192]


@pytest.mark.parametrize("budget", [1, 7, 64, 100, 2048, 8192])
@pytest.mark.parametrize("top_k,experts", [(2, 8), (8, 128)])
def test_ladder_covers_every_moe_autotune_key(budget, top_k, experts):
    from triton_kernels import fused_moe_autotune_keys

    def keys_fn(tokens):
        return fused_moe_autotune_keys(tokens, top_k, experts)

    ladder = {keys_fn(n) for n in extend_lengths(budget)}
    # A step carries any total token count from 1 (one decode) up to the budget.
    for t in range(1, budget + 1):
        assert keys_fn(t) in ladder, f"{t} tokens map to autotune key {keys_fn(t)} not in the ladder"


def test_warmup_runs_through_the_engine_and_frees_everything(tmp_path):
    path = cached_checkpoint(str(tmp_path), "qwen3_moe", "gqa_norm_topk")
    llm = LLM(str(path), skip_tokenizer_init=True, max_prefill_length=32, max_model_len=200)
    phases = []
    report = run_warmup(llm.engine, max_depth=150, on_phase=phases.append)
    assert report["extend_lengths"] == extend_lengths(32) and report["depth"] == 150
    # the ladder, the depth walk, and the short chunk after a full one
    assert len(phases) == len(report["extend_lengths"]) + 2
    # Every request finished and its blocks came back.
    alloc = llm.runner.allocator
    assert alloc.num_free == alloc.num_blocks and not llm.engine.has_work
    # Each ladder request prefilled (in chunks of 32) and decoded once.
    assert llm.engine.stats.tokens_generated == 2 * (len(report["extend_lengths"]) + 2)


def test_warmup_runs_each_length_whole_under_a_step_time_budget(tmp_path):
    # ft serve's default budget starts its chunks at 256 tokens: the ladder must still run
    # every extend length (up to the prefill budget) as one forward, and leave the budget's
    # fit untouched by its compiling steps.
    from freetoken.scheduler.step_budget import StepBudget
    path = cached_checkpoint(str(tmp_path), "qwen3_moe", "gqa_norm_topk")
    llm = LLM(str(path), skip_tokenizer_init=True, max_prefill_length=600, max_model_len=700)
    sched = llm.engine.scheduler
    budget = sched.step_budget = StepBudget(0.001, 600)
    chunks, schedule = [], sched.schedule
    sched.schedule = lambda: [chunks.append(c.num_tokens) or c for c in schedule()]
    run_warmup(llm.engine, max_depth=600)
    assert 600 in chunks and 513 in chunks
    assert sched.step_budget is budget and budget.describe()["steps_fitted"] == 0
    del sched.schedule                                   # the instance attribute: back to the method
    req = llm.engine.add_request([i % 300 for i in range(600)], SamplingParams(max_tokens=1))
    assert [c.num_tokens for c in sched.schedule()] == [256]      # real traffic: budgeted again
    llm.engine.abort(req.request_id)
