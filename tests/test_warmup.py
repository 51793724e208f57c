"""The warmup ladder covers every shape class a step can produce, through the real path."""

import pytest

from freetoken import LLM
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
