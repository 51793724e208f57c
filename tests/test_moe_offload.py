"""Every MoE backend against the resident run, end to end through LLM on tiny checkpoints of
every family (written by transformers): the same greedy tokens (a batch mixing chunked
prefill and decodes) and logits within 1e-5 relative, for cache sizes from the top_k floor
(prefill chunks then run in waves) to every expert; plus the report /v1/instrumentation serves, and the startup errors.
"""

import json

import pytest
import torch

from freetoken import LLM, SamplingParams
from freetoken.engine.config import EngineConfig
from freetoken.engine.model_runner import ModelRunner, SeqChunk
from freetoken.moe.config import MoeConfig
from freetoken.moe.plan import MoePlanError
from hf_checkpoints import cached_checkpoint

CASES = [
    ("qwen3_moe", "gqa_norm_topk"),        # 2 MoE layers x 8 experts, top-2
    ("qwen3_moe", "mha_odd_tied_dense"),   # a dense layer, 6 experts top-3, tied embeddings
    ("mixtral", "gqa"),                    # float32 router weights
    ("mixtral", "mha_top1"),               # top-1
    ("qwen2_moe", "gqa_shared"),           # shared expert behind a sigmoid gate
    ("qwen2_moe", "dense_mixed"),          # dense and sparse layers mixed, shared expert
    ("olmoe", "gqa_norm_topk"),            # q/k norm across heads
    ("gpt_oss", "gqa_window6"),            # expert biases, clamped SwiGLU, router bias
    ("glm4_moe", "groups_shared_qknorm"),  # grouped sigmoid router, scaling, shared experts
    ("minimax_m2", "gqa_partial_rotary"),  # sigmoid router with its bias beside it
    ("ernie4_5_moe", "bias_shared"),       # softmax router with a selection bias
]
CASES += [("deepseek_v3", "qlora_yarn_groups"),    # MLA; grouped sigmoid router, a dense layer 0
          ("glm4_moe_lite", "qlora_yarn_groups"),  # MLA at GLM-4.7-Flash's layout
          ("qwen3_next", "gqa_linear2x"),          # Gated DeltaNet layers: state slots beside
          ("qwen3_5_moe", "split_proj")]           # the experts (tests/test_hybrid.py: parity)
# (name, LLM kwargs); moe_cache_size "min" = top_k (the floor: a prefill chunk's layers run in
# waves), "mid" = halfway to every expert. Without a size, offload on a CPU device caches every expert.
BACKENDS = [
    ("offload-min", dict(moe_backend="offload", moe_cache_size="min")),
    ("offload-mid", dict(moe_backend="offload", moe_cache_size="mid")),
    ("offload-all", dict(moe_backend="offload")),
    ("offload-lfu-min", dict(moe_backend="offload", moe_cache_size="min",
                             moe_cache_policy="lfu-decay")),
    ("cpu", dict(moe_backend="cpu")),
    ("hybrid-measured-k", dict(moe_backend="hybrid", moe_cache_size="min")),
    ("hybrid-k1", dict(moe_backend="hybrid", moe_cache_size="min", moe_hybrid_k=1)),
    ("offload-cpu-layers", dict(moe_backend="offload", moe_cache_size="min", moe_cpu_layers=1)),
]
PROMPTS = [[5, 17, 99, 3, 200, 7, 8, 45, 11, 250, 31, 64, 2], [1, 2, 3],
           [(7 * i + 3) % 300 for i in range(30)]]
PARAMS = SamplingParams(max_tokens=16, min_tokens=16, temperature=0)


pytestmark = pytest.mark.usefixtures("one_thread", "no_saved_profiles")


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf"))


_RESIDENT: dict = {}


def resident(path):
    """The reference run, once per checkpoint: (llm, batch tokens, logits of PROMPTS[0])."""
    if path not in _RESIDENT:
        llm = LLM(path, skip_tokenizer_init=True, max_prefill_length=16)
        tokens = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
        _RESIDENT[path] = llm, tokens, llm.logits(PROMPTS[0])
    return _RESIDENT[path]


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def str_keys_only(obj) -> bool:
    if isinstance(obj, dict):
        return all(isinstance(k, str) and str_keys_only(v) for k, v in obj.items())
    if isinstance(obj, list):
        return all(str_keys_only(v) for v in obj)
    return True


@pytest.mark.parametrize("name,kwargs", BACKENDS, ids=[b[0] for b in BACKENDS])
@pytest.mark.parametrize("family,variant", CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_backend_matches_resident(ckpt_root, family, variant, name, kwargs):
    path = str(cached_checkpoint(ckpt_root, family, variant))
    ref, want_tokens, want_logits = resident(path)
    mc = ref.model_config
    moe_layers = list(ref.runner.model.moe_blocks())
    n_experts = len(moe_layers) * mc.num_experts
    sizes = {"min": mc.num_experts_per_tok, "mid": (mc.num_experts + n_experts) // 2}
    kwargs = {k: sizes.get(v, v) if k == "moe_cache_size" else v for k, v in kwargs.items()}

    llm = LLM(path, skip_tokenizer_init=True, max_prefill_length=16, **kwargs)
    got = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert got == want_tokens
    err = rel_err(llm.logits(PROMPTS[0]), want_logits)
    assert err < 1e-5, f"{name}: relative logit error {err:.2e}"

    report = llm.runner.moe_report()
    assert report["backend"] == kwargs["moe_backend"]
    assert str_keys_only(report) and json.loads(json.dumps(report)) == report
    c = report["counters"]
    per_layer = c["per_layer"]
    assert [p["layer"] for p in per_layer] == moe_layers
    assert c["hits"] + c["misses"] == c["lookups"] == sum(p["hits"] + p["misses"] for p in per_layer)
    cpu_layers = moe_layers[:1] if "moe_cpu_layers" in kwargs else moe_layers if name == "cpu" else []
    assert report["cpu_layers"] == cpu_layers
    cached = [i for i in moe_layers if i not in cpu_layers]
    if not cached:
        assert report["cache"] is None and c["lookups"] == 0 and c["cpu_experts"] > 0
    else:
        slots = min(kwargs.get("moe_cache_size", n_experts), len(cached) * mc.num_experts)
        assert report["cache"]["slots"] == slots and report["cache"]["min_slots"] == mc.num_experts_per_tok
        # One expert's bytes, counted here from the config: w13 + w2 (+ gpt-oss's biases).
        expert_bytes = 3 * mc.hidden_size * mc.moe_intermediate_size * 4
        if family == "gpt_oss":
            expert_bytes += (2 * mc.moe_intermediate_size + mc.hidden_size) * 4
        assert c["lookups"] > 0 and c["bytes_fetched"] == c["experts_fetched"] * expert_bytes
        assert c["bytes_fetched"] == 0 or c["fetch_gbps"] > 0
        if slots < len(cached) * mc.num_experts and not name.startswith("hybrid"):
            assert c["evictions"] > 0          # the small caches really were exercised
        if slots == mc.num_experts_per_tok and not name.startswith("hybrid"):
            assert c["wave_steps"] > 0         # a 16-token chunk needs more than top_k experts
    if name == "hybrid-k1" and mc.num_experts_per_tok > 1:
        assert report["hybrid_k"] == 1 and c["cpu_experts"] > 0
    if name == "hybrid-measured-k":
        assert 0 <= report["hybrid_k"] <= mc.num_experts_per_tok
        assert "ms/expert" in report["hybrid_k_source"]
        assert "calibrated at startup (no profile for cpu-" in report["hybrid_k_source"]
    if len(moe_layers) > 1 and cached and cached != moe_layers[:1]:
        assert c["prefetch_guessed"] > 0 and 0 <= c["prefetch_accuracy"] <= 1


def test_offloaded_banks_are_the_store_filled_by_the_loader(ckpt_root):
    path = str(cached_checkpoint(ckpt_root, "qwen2_moe", "gqa_shared"))
    ref = resident(path)[0]
    seen = []
    runner = ModelRunner(EngineConfig(path, moe=MoeConfig(backend="offload", cache_size=8)),
                         progress=lambda done, total: seen.append((done, total)))
    store = runner.expert_store
    assert seen and seen[-1][0] == seen[-1][1] >= store.total_bytes
    ref_blocks, blocks = ref.runner.model.moe_blocks(), runner.model.moe_blocks()
    for i, block in blocks.items():
        # The model's bank parameters are the store's host tensors, not copies of them.
        for name, host in store.bank(i).items():
            assert getattr(block.experts, name).data_ptr() == host.data_ptr()
            assert torch.equal(host, getattr(ref_blocks[i].experts, name))
        assert block.experts.runtime is not None and ref_blocks[i].experts.runtime is None
    runner.run([SeqChunk([1, 2, 3], 0, runner.allocator.allocate(1), True)])
    assert runner.moe_report()["counters"]["lookups"] > 0
    runner.moe.reset_counters()
    counters = runner.moe_report()["counters"]
    assert counters["lookups"] == counters["bytes_fetched"] == counters["steps"] == 0
    assert counters["fetch_gbps"] is None


def test_default_is_resident_and_says_why(ckpt_root):
    llm = resident(str(cached_checkpoint(ckpt_root, "mixtral", "gqa")))[0]
    report = llm.runner.moe_report()
    assert report["backend"] == "resident" and report["requested"] == "auto"
    assert "CPU device" in report["reason"] and report["cache"] is None
    assert llm.runner.moe is None and llm.runner.expert_store is None


def test_too_small_a_cache_is_refused(ckpt_root):
    path = str(cached_checkpoint(ckpt_root, "mixtral", "gqa"))
    with pytest.raises(MoePlanError, match="gets 1 slots.*fewer than the 2 experts one token"):
        LLM(path, skip_tokenizer_init=True, moe_backend="offload", moe_cache_size=1)
    with pytest.raises(MoePlanError, match=r"moe_cpu_layers \[5\] are not MoE layers"):
        LLM(path, skip_tokenizer_init=True, moe_backend="offload", moe_cpu_layers=[5])
    with pytest.raises(ValueError, match="not both"):
        LLM(path, skip_tokenizer_init=True, moe_cache_size=8, moe_cache_rate=0.5)
