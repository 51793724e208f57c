"""FreeToken against the oracle: transformers' own implementation of each family, same weights.

On CPU in float32 through the engine's real paged-KV forward: logits within 1e-4 relative
error, 24 greedy tokens identical, batching and chunked prefill changing nothing.
"""

import pytest
import torch

from freetoken import LLM, SamplingParams
from hf_checkpoints import VARIANTS, cached_checkpoint

CASES = [(f, v) for f, vs in VARIANTS.items() for v in vs]
PROMPT = [5, 17, 99, 3, 200, 7, 8, 45, 11, 250, 31, 64, 2]


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf"))


def hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("family,variant", CASES)
def test_logits_and_greedy_match_transformers(ckpt_root, family, variant):
    path = cached_checkpoint(ckpt_root, family, variant)
    llm = LLM(str(path), skip_tokenizer_init=True)
    hf = hf_model(path)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    ours = llm.logits(PROMPT)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    err = rel_err(ours, ref)
    print(f"{family}/{variant}: max relative logit error {err:.2e}")
    assert err < 1e-4

    want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=24, min_new_tokens=24,
                       do_sample=False)[0, len(PROMPT):].tolist()
    # min_tokens bans EOS until 24 tokens, as min_new_tokens does in transformers.
    got = llm.generate([PROMPT], SamplingParams(max_tokens=24, min_tokens=24, temperature=0))[0]
    assert got.token_ids == want
    assert got.finish_reason == "length"


@pytest.mark.parametrize("family,variant", [(f, next(iter(v))) for f, v in VARIANTS.items()])
def test_batch_equals_alone_and_chunked_prefill(ckpt_root, family, variant):
    path = cached_checkpoint(ckpt_root, family, variant)
    # A small prefill budget forces chunking and mixes prefill chunks with decodes.
    llm = LLM(str(path), skip_tokenizer_init=True, max_prefill_length=16)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (1, 3, 9, 17, 30, 5, 41, 12)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    together = llm.generate(prompts, params)
    assert llm.engine.stats.max_batch_seqs > 1
    for p, t in zip(prompts, together):
        alone = llm.generate([p], params)[0]
        assert t.token_ids == alone.token_ids, f"prompt of {len(p)} tokens differs in a batch"

    long = prompts[6]
    whole = llm.logits(long)
    for chunk in (1, 7, 16):
        assert rel_err(llm.logits(long, chunk_size=chunk), whole) < 1e-5


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoints(ckpt_root, dtype):
    path = cached_checkpoint(ckpt_root, "qwen3_moe", "gqa_norm_topk", dtype)
    native = LLM(str(path), skip_tokenizer_init=True)      # auto: the checkpoint's dtype
    assert next(native.runner.model.parameters()).dtype == getattr(torch, dtype)
    upcast = LLM(str(path), skip_tokenizer_init=True, dtype="float32")
    hf = hf_model(path)        # loads the half weights, computes in float32
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    assert rel_err(upcast.logits(PROMPT), ref) < 1e-4
    # Computing in half precision stays close to float32 (loose: bf16 has 8 mantissa bits).
    assert rel_err(native.logits(PROMPT), ref) < 0.1


@pytest.mark.parametrize("family", ["gpt_oss", "glm4_moe", "minimax_m2", "olmoe", "ernie4_5_moe"])
def test_hub_layout_checkpoints_match_transformers(tmp_path_factory, family):
    """tools/make_tiny_model.py's hub layout (gpt-oss's fused interleaved experts, GLM's MTP
    layer, MiniMax's and ERNIE's selection biases where the hub puts them) loads into both."""
    from freetoken.demo.tiny_model import make_tiny_model
    path = make_tiny_model(tmp_path_factory.mktemp(family), family=family, seed=3)
    llm = LLM(str(path), skip_tokenizer_init=True)
    hf = hf_model(path)
    prompt = [(37 * i + 11) % 1900 for i in range(21)]      # past gpt_oss's 16-token window
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    err = rel_err(llm.logits(prompt), ref)
    print(f"{family} (hub layout): max relative logit error {err:.2e}")
    assert err < 1e-4
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8,
                       do_sample=False)[0, len(prompt):].tolist()
    got = llm.generate([prompt], SamplingParams(max_tokens=8, min_tokens=8, temperature=0))[0]
    assert got.token_ids == want
