"""Scheduler and sampler behaviour through the real engine on a tiny checkpoint."""

import pytest
import torch

from freetoken import LLM, SamplingParams
from freetoken.engine.sampler import SampleRow, sample
from hf_checkpoints import cached_checkpoint


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(cached_checkpoint(str(tmp_path_factory.mktemp("hf")), "qwen3_moe", "gqa_norm_topk"))


def test_kv_exhaustion_preempts_and_recomputes(path):
    # 6 blocks of 16 tokens cannot hold 4 requests of 20 + 30 tokens at once.
    small = LLM(path, skip_tokenizer_init=True, max_model_len=96, kv_cache_tokens=96)
    big = LLM(path, skip_tokenizer_init=True, max_model_len=96)
    prompts = [[i + 1] * 20 for i in range(4)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    got = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    want = big.generate(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    alloc = small.runner.allocator
    assert alloc.num_free == alloc.num_blocks


def test_stop_token_ids_and_min_tokens(path):
    llm = LLM(path, skip_tokenizer_init=True)
    free = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    stop_id = free.token_ids[4]
    first = free.token_ids.index(stop_id)
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=12, temperature=0,
                                                    stop_token_ids=[stop_id]))[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # Before min_tokens the stop id is banned, so generation runs past it.
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=12, temperature=0, min_tokens=first + 2,
                                                    stop_token_ids=[stop_id]))[0]
    assert stop_id not in out.token_ids[: first + 2]
    assert len(out.token_ids) > first + 1


def test_seeded_sampling_is_reproducible_and_batch_independent(path):
    llm = LLM(path, skip_tokenizer_init=True)
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    a = llm.generate([[7, 8, 9]], p)[0].token_ids
    b = llm.generate([[1, 2], [7, 8, 9], [5]], [SamplingParams(max_tokens=9, temperature=0.7), p,
                                                 SamplingParams(max_tokens=3, seed=9)])[1].token_ids
    assert a == b
    c = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=16, temperature=1.0, seed=99,
                                                 ignore_eos=True))[0].token_ids
    assert c != a


def _rows(n, **kw):
    return [SampleRow(SamplingParams(**kw), None) for _ in range(n)]


def test_sampler_filters():
    torch.manual_seed(0)
    logits = torch.randn(64, 50)
    greedy = logits.argmax(-1).tolist()
    assert sample(logits, _rows(64, temperature=0)).token_ids == greedy
    assert sample(logits, _rows(64, top_k=1)).token_ids == greedy
    assert sample(logits, _rows(64, top_p=1e-6)).token_ids == greedy
    assert sample(logits, _rows(64, min_p=1.0)).token_ids == greedy
    # top_k=3 only ever yields one of the three best tokens.
    top3 = logits.topk(3, -1).indices
    for _ in range(5):
        got = torch.tensor(sample(logits, _rows(64, top_k=3)).token_ids)
        assert (top3 == got[:, None]).any(-1).all()
    # Greedy and sampled rows in one call: the greedy ones still take the argmax.
    mixed = [SampleRow(SamplingParams(temperature=0 if i % 2 else 1.0, top_p=0.9), None)
             for i in range(64)]
    got = sample(logits, mixed).token_ids
    assert got[1::2] == greedy[1::2] and got[::2] != greedy[::2]
    # Banned ids are never drawn, not even greedily.
    rows = [SampleRow(SamplingParams(temperature=0), None, banned_ids=(g,)) for g in greedy]
    assert all(t != g for t, g in zip(sample(logits, rows).token_ids, greedy))


def test_candidate_filters_equal_the_full_sort():
    """top-k, top-p (with and without top-k; nuclei inside and wider than the candidates)
    and min-p on candidates give the full-vocabulary probabilities."""
    from freetoken.engine import sampler
    torch.manual_seed(0)
    vocab = 3000
    peaked = torch.randn(4, vocab) * 8           # nucleus of a few tokens
    flat = torch.randn(4, vocab) * 0.1           # nucleus wider than NUCLEUS_CANDIDATES
    logits = torch.cat([peaked, flat])
    params = [dict(top_k=5), dict(top_p=0.9), dict(top_k=50, top_p=0.8), dict(top_p=0.5, min_p=0.1),
              dict(top_p=0.95), dict(top_k=2000, top_p=0.99), dict(top_p=0.3), dict(top_k=7, min_p=0.05)]
    rows = [SampleRow(SamplingParams(temperature=1.0, **p), None) for p in params]
    probs, ids, caps = sampler.filtered_candidates(logits, rows)
    got = torch.zeros_like(logits).scatter(1, ids, probs)
    want = sampler.filtered_probs_reference(logits, rows)
    assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()
    assert caps[1] == sampler.NUCLEUS_CANDIDATES and caps[4] == vocab   # wide nucleus: full sort
    assert (want > 0).sum(-1).tolist()[4] > sampler.NUCLEUS_CANDIDATES


def test_sampler_distribution_and_logprobs():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).repeat(4000, 1)
    toks = torch.tensor(sample(logits, _rows(4000)).token_ids)
    freq = torch.bincount(toks, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)
    res = sample(logits[:1], _rows(1, temperature=0, logprobs=2))
    lp, top = res.logprobs[0]
    assert abs(lp - torch.log(torch.tensor(0.5)).item()) < 1e-5
    assert [t for t, _ in top] == [0, 1]


def test_kernel_backend_is_per_runner_not_process_wide(tmp_path):
    # Two engines in one process keep their own kernel backend: each forward runs inside its
    # runner's `kernel_backend` block, and nothing leaks outside it.
    import triton_kernels as tk
    from freetoken import LLM
    from hf_checkpoints import cached_checkpoint
    path = str(cached_checkpoint(str(tmp_path), "qwen3_moe", "gqa_norm_topk"))
    seen = {}
    ref = LLM(path, skip_tokenizer_init=True, kernel_backend="reference")
    auto = LLM(path, skip_tokenizer_init=True)
    for name, llm in (("reference", ref), ("auto", auto)):
        hook = llm.runner.model.register_forward_pre_hook(     # (returns None: inputs kept)
            lambda m, a, name=name: seen.update({name: tk.get_backend()}))
        llm.logits([1, 2, 3])
        hook.remove()
    assert seen == {"reference": "reference", "auto": "auto"} and tk.get_backend() == "auto"
    with pytest.raises(ValueError, match="kernel backend must be one of"):
        LLM(path, skip_tokenizer_init=True, kernel_backend="cuda")
