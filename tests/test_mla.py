"""Multi-head latent attention (layers/mla.py) and its latent cache (cache_spec.LatentSpec).

The parity against transformers (logits, greedy tokens, batch equals alone, chunked prefill)
runs in test_parity.py from the deepseek_v3 and glm4_moe_lite variants of hf_checkpoints.py.
Here: the absorbed form equals the decompressed one, the cache keeps only the latent (bytes
per token from the config, for the tiny and the real DeepSeek-V3 / GLM-4.7-Flash configs),
prefix caching over the latent pool, YaRN's softmax mscale, and the config errors.
"""

import json
import math

import pytest
import torch

from freetoken import LLM, SamplingParams
from freetoken.engine.cache_spec import LatentSpec, bytes_per_token
from freetoken.engine.prefix_cache import unsupported_reason
from freetoken.models import deepseek_v3, glm4_moe_lite
from freetoken.models.config import ModelConfigError
from freetoken.models.layers.mla import MlaAttention, MlaConfig
from freetoken.models.registry import family_for
from freetoken.models.rope import RopeTable, softmax_mscale
from hf_checkpoints import cached_checkpoint
from tiny_fixtures import tiny_model_dir  # noqa: F401 - a fixture

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")


def _layer(q_lora, seed=0, heads=3):
    cfg = MlaConfig(hidden_size=48, num_heads=heads, q_lora_rank=q_lora, kv_lora_rank=20,
                    qk_nope_head_dim=12, qk_rope_head_dim=6, v_head_dim=10, softmax_mscale=1.3)
    rope = RopeTable({"rope_type": "default", "rope_theta": 10000.0}, cfg.qk_rope_head_dim)
    rope.build(64, "cpu")
    layer = MlaAttention(cfg, 0, rope)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return layer, g


def _bf16_cpu_layer(q_lora, interleaved, heads, seed):
    """A layer as a bf16 CPU engine packs and binds it (linear.pack_for_cpu, bind_cpu), its
    cache pool of 16 blocks of 4 random latents: (layer, generator, kv cache)."""
    import dataclasses

    import triton_kernels as tk
    from freetoken.engine.kv_cache import KVCache
    if tk.native_kernels() is None:
        pytest.skip("no C compiler: no native kernels")
    layer, g = _layer(q_lora, seed=seed, heads=heads)
    layer.cfg = dataclasses.replace(layer.cfg, rope_interleaved=interleaved)
    layer = layer.bfloat16()
    for m in layer.modules():
        if hasattr(m, "pack_cpu"):
            m.pack_cpu()
    layer.bind_cpu()
    assert layer.cpu_decode is not None
    kv = KVCache({0: layer.cache_spec()}, 16, 4, torch.bfloat16, "cpu")
    kv.layer(0)[0].copy_(torch.randn(kv.layer(0)[0].shape, generator=g))
    return layer, g, kv


def _native_then_torch(layer, x, batch, pool):
    """layer(x, batch) with its native decode call, then with the torch path from the same
    cache pool: (native output, its pool, the rows of each native call, torch's output, the
    pool before both); the pool is left as the torch path wrote it."""
    start = pool.clone()
    native = layer.cpu_decode
    calls = []
    native_call = type(native).__call__
    type(native).__call__ = lambda self, q, *a: calls.append(q.shape[0]) or native_call(
        self, q, *a)
    try:
        got = layer(x, batch)
    finally:
        type(native).__call__ = native_call
    got_pool = pool.clone()
    pool.copy_(start)
    layer.cpu_decode = None
    return got, got_pool, calls, layer(x, batch), start


@pytest.mark.parametrize("q_lora", [16, None])
def test_absorbed_equals_decompressed(q_lora):
    """Over a cached prefix in scattered blocks: a decode, a short chunk and a whole prompt."""
    layer, g = _layer(q_lora)
    c, bs = layer.cfg, 4
    cache = torch.randn(12, bs, c.kv_lora_rank + c.qk_rope_head_dim, generator=g)
    table = torch.tensor([7, 2, 9, 0, 5, 11, 3], dtype=torch.int32)
    for ctx, n in ((23, 1), (23, 5), (17, 17)):
        q = torch.randn(n, c.num_heads, c.qk_head_dim, generator=g)
        cu = torch.tensor([0, n], dtype=torch.int32)
        absorbed = layer.attend_absorbed(q, cache, table[None], cu,
                                         torch.tensor([ctx], dtype=torch.int32), n)
        whole = layer.attend_decompressed(q, cache, table, ctx)
        assert absorbed.shape == whole.shape == (n, c.num_heads, c.v_head_dim)
        err = ((absorbed - whole).abs().max() / whole.abs().max()).item()
        assert err < 1e-5, f"ctx {ctx}, {n} queries: relative error {err:.2e}"


def _two_sequence_batch(layer, g):
    """A decode at position 9 and a 6-token chunk after a 5-token cached prefix, blocks of 4
    scattered over one latent pool (KVCache from the layer's spec)."""
    from freetoken.engine.batch import ForwardBatch
    from freetoken.engine.kv_cache import KVCache
    kv = KVCache({0: layer.cache_spec()}, 8, 4, torch.float32, "cpu")
    kv.layer(0)[0].copy_(torch.randn(kv.layer(0)[0].shape, generator=g))
    tables = torch.tensor([[6, 1, 3], [2, 7, 0]], dtype=torch.int32)
    positions = torch.tensor([9] + list(range(5, 11)))
    slots = torch.cat([tables[0, 9 // 4:9 // 4 + 1].long() * 4 + 9 % 4,
                       torch.tensor([tables[1, p // 4].item() * 4 + p % 4 for p in range(5, 11)])])
    return ForwardBatch(input_ids=torch.zeros(7, dtype=torch.long), positions=positions,
                        cu_seqlens_q=torch.tensor([0, 1, 7], dtype=torch.int32),
                        seq_lens=torch.tensor([10, 11], dtype=torch.int32), block_tables=tables,
                        slot_mapping=slots, logits_indices=torch.tensor([0, 6]), max_seqlen_q=6,
                        num_seqs=2, kv=kv)


def test_layer_through_the_triton_kernels_equals_the_references():
    """The layer's views (rope on q's and the latent's rope parts in place, the latent write,
    the absorbed query) reach the Triton launchers intact (the interpreter, float32)."""
    import triton_kernels as tk
    layer, g = _layer(16, seed=2)
    x = torch.randn(7, layer.cfg.hidden_size, generator=g)
    outs, pools = [], []
    for backend in ("reference", "triton"):
        batch = _two_sequence_batch(layer, torch.Generator().manual_seed(3))
        with tk.kernel_backend(backend):
            outs.append(layer(x, batch))
        pools.append(batch.kv.layer(0)[0])
    torch.testing.assert_close(pools[1], pools[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)


def test_decompression_chosen_by_cost():
    """DeepSeek-V3's dims: decode and a short chunk over a long context absorbed, a fresh
    prompt and a long chunk over a short prefix decompressed."""
    layer = MlaAttention.__new__(MlaAttention)
    layer.cfg = MlaConfig(7168, 128, 1536, 512, 128, 64, 128)
    assert not layer._decompress_pays(1, 4000)
    assert not layer._decompress_pays(16, 4000)
    assert layer._decompress_pays(300, 300)
    assert layer._decompress_pays(1024, 1500)
    assert not layer._decompress_pays(64, 8192)
    # The warmup's last chunk is absorbed at any budget, even where each full chunk of its
    # depth walk decompresses.
    from freetoken.scheduler.warmup import SHORT_TAIL
    for budget in (256, 2048, 8192):
        assert layer._decompress_pays(budget, 2 * budget)
        assert not layer._decompress_pays(SHORT_TAIL, budget + SHORT_TAIL)


def _spec_bytes(cfg, dtype=torch.bfloat16):
    with torch.device("meta"):
        model = family_for({"architectures": list(cfg.architectures),
                            "model_type": cfg.model_type}).MODEL_CLASS(cfg)
    specs = model.cache_specs()
    assert all(isinstance(s, LatentSpec) for s in specs.values())
    assert unsupported_reason(specs) is None            # prefix caching stays on
    return bytes_per_token(specs, dtype)


def _hf_default_config(name):
    import transformers as tf
    raw = getattr(tf, name)().to_dict()
    raw["architectures"] = [name.replace("Config", "ForCausalLM")]
    return raw


@pytest.mark.parametrize("family,hf_config,layers,per_token", [
    # DeepSeek-V3 (Kimi-K2 the same latent): 61 layers x (512 + 64) x 2 bytes.
    (deepseek_v3, "DeepseekV3Config", 61, 70272),
    # GLM-4.7-Flash: 47 layers x (512 + 64) x 2 bytes.
    (glm4_moe_lite, "Glm4MoeLiteConfig", 47, 54144),
])
def test_real_configs_cache_only_the_latent(tmp_path, family, hf_config, layers, per_token):
    """transformers' default configs are the released models' shapes."""
    raw = _hf_default_config(hf_config)
    cfg = family.parse(raw, tmp_path)
    assert cfg.num_hidden_layers == layers
    expect = layers * (raw["kv_lora_rank"] + raw["qk_rope_head_dim"]) * 2
    assert _spec_bytes(cfg) == expect == per_token
    full_kv = layers * raw["num_attention_heads"] * (
        raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"] + raw["v_head_dim"]) * 2
    print(f"{hf_config}: {per_token} KV bytes per token in bf16 "
          f"({full_kv / per_token:.0f}x less than full K/V)")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(cached_checkpoint(str(tmp_path_factory.mktemp("hf")), "deepseek_v3",
                                 "qlora_yarn_groups"))


def test_engine_cache_bytes_per_token_is_the_latent(tiny):
    import json
    raw = json.loads(open(f"{tiny}/config.json").read())
    llm = LLM(tiny, skip_tokenizer_init=True, enable_prefix_caching=True)
    kv = llm.runner.kv
    want = raw["num_hidden_layers"] * (raw["kv_lora_rank"] + raw["qk_rope_head_dim"]) * 4
    assert kv.bytes_per_token == want
    assert [d["kind"] for d in kv.describe()] == ["LatentSpec"] * raw["num_hidden_layers"]
    (pool,) = kv.layer(0)
    assert pool.shape[2] == raw["kv_lora_rank"] + raw["qk_rope_head_dim"]

    # Prefix caching over the latent pool: a second prompt sharing 40 tokens takes 2 blocks
    # of 16 and decodes the same tokens as a cold run.
    base = [(7 * i + 3) % 300 for i in range(64)]
    second = base[:40] + [5, 6, 7]
    assert llm.engine.scheduler.caching
    llm.generate([base], GREEDY)
    got = llm.generate([second], GREEDY)[0].token_ids
    assert llm.engine.scheduler.allocator.prefix.stats.hit_tokens == 32
    cold = LLM(tiny, skip_tokenizer_init=True, enable_prefix_caching=False)
    assert got == cold.generate([second], GREEDY)[0].token_ids


def test_mtp_layer_is_skipped_knowingly(tiny, tmp_path):
    """DeepSeek-V3 ships its MTP layer as model.layers.{num_hidden_layers}.* (config
    num_nextn_predict_layers): loaded from a second shard, it is skipped and changes nothing;
    the same tensors without that config field are refused by name."""
    import shutil

    from safetensors.torch import save_file
    raw = json.loads(open(f"{tiny}/config.json").read())
    n = raw["num_hidden_layers"]
    folder = tmp_path / "with_mtp"
    shutil.copytree(tiny, folder)
    mtp = {f"model.layers.{n}.eh_proj.weight": torch.randn(raw["hidden_size"], 2 * raw["hidden_size"]),
           f"model.layers.{n}.enorm.weight": torch.randn(raw["hidden_size"]),
           f"model.layers.{n}.self_attn.kv_a_layernorm.weight": torch.randn(raw["kv_lora_rank"])}
    save_file(mtp, str(folder / "mtp.safetensors"))
    ids = [5, 17, 99, 3, 200, 7, 8, 45, 11]
    want = LLM(tiny, skip_tokenizer_init=True).logits(ids)
    (folder / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 1}))
    assert torch.equal(LLM(str(folder), skip_tokenizer_init=True).logits(ids), want)
    (folder / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 0}))
    with pytest.raises(Exception, match=rf"model\.layers\.{n}\.eh_proj\.weight"):
        LLM(str(folder), skip_tokenizer_init=True)


def test_yarn_softmax_mscale():
    yarn = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    m = 0.1 * math.log(40.0) + 1.0
    assert softmax_mscale(yarn) == pytest.approx(m * m)
    assert softmax_mscale({**yarn, "mscale_all_dim": 0}) == 1.0
    assert softmax_mscale({"rope_type": "default"}) == 1.0
    assert softmax_mscale({**yarn, "factor": 1.0}) == 1.0


def test_kimi_k2_is_deepseek_v3_and_bad_configs_are_refused(tmp_path):
    assert family_for({"architectures": ["DeepseekV3ForCausalLM"],
                       "model_type": "kimi_k2"}) is deepseek_v3
    assert family_for({"model_type": "kimi_k2"}) is deepseek_v3
    raw = _hf_default_config("DeepseekV3Config")
    with pytest.raises(ModelConfigError, match="scoring_func 'softmax'"):
        deepseek_v3.parse({**raw, "scoring_func": "softmax"}, tmp_path)
    with pytest.raises(ModelConfigError, match="topk_method 'group_limited_greedy'"):
        deepseek_v3.parse({**raw, "topk_method": "group_limited_greedy"}, tmp_path)
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        MlaConfig(64, 4, None, 32, 16, 7, 16)
    dense = glm4_moe_lite.parse({**_hf_default_config("Glm4MoeLiteConfig"),
                                 "mlp_layer_types": ["dense", "dense"] + ["sparse"] * 45},
                                tmp_path)
    assert dense.sparse_layers == tuple(range(2, 47))


def test_glm_4_7_flash_reads_and_calls_tools_as_glm():
    from freetoken.server.model_meta import resolve
    template = ("{% if x %}<think></think>{% endif %}<tool_call>{{ name }}<arg_key>k</arg_key>"
                "<arg_value>v</arg_value></tool_call>")
    lite, glm = resolve("glm4_moe_lite", template), resolve("glm4_moe", template)
    assert lite == glm and lite.reasoning_parser == "glm45" and lite.tool_format == "glm47"


# -- the tiny hub-layout checkpoints (make_tiny_model), served ----------------------------------
SMALL = dict(hidden_size=64, num_layers=2, num_experts=8, n_group=4, topk_group=2, top_k=3,
             moe_intermediate_size=32, intermediate_size=64, max_position_embeddings=1024)


@pytest.mark.parametrize("family,shape", [
    ("deepseek_v3", dict(SMALL)),
    ("glm4_moe_lite", dict(SMALL, q_lora_rank=None, rope_yarn_factor=0)),
])
def test_tiny_checkpoint_served_through_the_openai_sdk_matches_transformers(
        tiny_model_dir, family, shape):  # noqa: F811
    import openai
    from tokenizers import Tokenizer

    from serving import ServerProcess
    from test_make_tiny_model import assert_clean_load, hf_load
    folder = tiny_model_dir(family, name=f"tiny-{family}", **shape)
    hf, info = hf_load(folder, dtype=torch.float32)
    assert_clean_load(info)
    prompt = [11, 250, 31, 64, 2, 99, 1000, 7, 45, 300, 1500]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12,
                           do_sample=False)[0, len(prompt):].tolist()
    llm = LLM(str(folder), skip_tokenizer_init=True)
    ours = llm.logits(prompt)
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4
    text = Tokenizer.from_file(str(folder / "tokenizer.json")).decode(want)
    assert text.strip()
    with ServerProcess(folder, "--max-prefill-length", "8") as server:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)
        r = client.completions.create(model=f"tiny-{family}", prompt=prompt, max_tokens=12,
                                      temperature=0, extra_body={"min_tokens": 12})
        assert r.choices[0].text == text
        chat = client.chat.completions.create(
            model=f"tiny-{family}", messages=[{"role": "user", "content": "Hello there"}],
            max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 6
        status, info = server.request("GET", "/v1/instrumentation")
    assert status == 200
    cfg = json.loads((folder / "config.json").read_text())
    kv = info["kv_cache"]
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    assert kv["bytes_per_token"] == cfg["num_hidden_layers"] * latent * 4
    assert {layer["kind"] for layer in kv["layers"]} == {"LatentSpec"}


def test_warmup_runs_both_forms_of_prefill(tiny, monkeypatch):
    """Fresh prompts decompress; the ladder's short chunk after a full one attends absorbed,
    so both prefill forms (and their kernels on a GPU) run before readiness."""
    from freetoken.scheduler.warmup import run_warmup
    seen = []
    absorbed, decompressed = MlaAttention.attend_absorbed, MlaAttention.attend_decompressed

    def spy_absorbed(self, q, *args):
        seen.append(("absorbed", args[-1]))
        return absorbed(self, q, *args)

    def spy_decompressed(self, q, *args):
        seen.append(("decompressed", q.shape[0]))
        return decompressed(self, q, *args)
    monkeypatch.setattr(MlaAttention, "attend_absorbed", spy_absorbed)
    monkeypatch.setattr(MlaAttention, "attend_decompressed", spy_decompressed)
    llm = LLM(tiny, skip_tokenizer_init=True, max_prefill_length=32, max_model_len=200)
    run_warmup(llm.engine, max_depth=150)
    assert ("absorbed", 1) in seen                                  # decode
    assert any(kind == "absorbed" and n > 1 for kind, n in seen)    # a short chunk's prefill
    assert any(kind == "decompressed" and n > 1 for kind, n in seen)


# 3 heads: one chunk of fewer than 8, the sums a latent at a time; 11: a chunk of 8 (the sums
# in registers across blocks of latents, L 20 their vector and scalar tails) and one of 3
@pytest.mark.parametrize("q_lora,interleaved,heads", [(16, True, 3), (None, False, 3),
                                                      (16, False, 11)])
def test_bf16_decode_step_on_the_native_call_is_the_torch_paths(q_lora, interleaved, heads):
    """A bf16 CPU engine's decode step (cpu_mla.c: the latent's norm, rope and write, W_UK,
    attention over the latents, W_UV) against the modules' torch path on the same input and
    cache: the output within a few bf16 steps of its norm (each rounds q_abs, the
    probabilities and o_lat, in another order of sums), the new latents' c_kv the same bits
    (ft_rms_norm's), k_pe within a bf16 step of its largest value (rope rounded once, not
    per op), and a
    sequence whose slot is -1 writes nothing. Three sequences over scattered blocks of 4."""
    from freetoken.engine.batch import ForwardBatch
    layer, g, kv = _bf16_cpu_layer(q_lora, interleaved, heads, seed=4)
    c = layer.cfg
    tables = torch.tensor([[6, 1, 3, -1], [2, 7, 0, 9], [4, -1, -1, -1]], dtype=torch.int32)
    lens = torch.tensor([10, 15, 3], dtype=torch.int32)
    positions = (lens - 1).long()
    slots = torch.tensor([int(tables[b, p // 4]) * 4 + p % 4 for b, p in enumerate(positions)])
    slots[2] = -1
    batch = ForwardBatch(input_ids=torch.zeros(3, dtype=torch.long), positions=positions,
                         cu_seqlens_q=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
                         seq_lens=lens, block_tables=tables, slot_mapping=slots,
                         logits_indices=torch.arange(3), max_seqlen_q=1, num_seqs=3, kv=kv)
    x = torch.randn(3, c.hidden_size, generator=g).bfloat16()
    pool = kv.layer(0)[0]
    got, got_pool, calls, want, start = _native_then_torch(layer, x, batch, pool)
    assert calls and got.shape == want.shape == (3, c.hidden_size)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 2 ** -6
    written = slots[:2]
    flat_got, flat_want = got_pool.view(-1, pool.shape[2]), pool.view(-1, pool.shape[2])
    assert torch.equal(flat_got[written, :c.kv_lora_rank], flat_want[written, :c.kv_lora_rank])
    # (torch's rope rounds each product to bf16, so near a cancellation its error is the
    # operands' bf16 step, not the result's)
    pe_got, pe_want = (f[written, c.kv_lora_rank:].float() for f in (flat_got, flat_want))
    bound = pe_want.abs().amax(dim=1, keepdim=True) * 2 ** -7
    assert ((pe_got - pe_want).abs() <= bound).all()
    rest = torch.ones(flat_got.shape[0], dtype=torch.bool)
    rest[written] = False
    assert torch.equal(flat_got[rest], start.view(-1, pool.shape[2])[rest])


@pytest.mark.parametrize("q_lora,interleaved", [(16, True), (None, False)])
def test_bf16_mixed_steps_decode_rows_on_the_native_call(q_lora, interleaved):
    """A bf16 CPU engine's step that carries a prefill chunk beside decode rows: the decode
    rows through the decode step's native call (their q_pe already rotated: RoPE by the
    identity, no latent written), the chunk as before, against the torch path for all the
    rows: within a few bf16 steps of the output's norm, each row's latent written once (the
    same pool both ways)."""
    from freetoken.engine.batch import ForwardBatch
    layer, g, kv = _bf16_cpu_layer(q_lora, interleaved, heads=11, seed=5)
    c = layer.cfg
    # a decode row, a 5-token chunk over a cached prefix of 5, another decode row
    tables = torch.tensor([[6, 1, 3, -1], [2, 7, 0, 9], [4, 8, -1, -1]], dtype=torch.int32)
    lens = torch.tensor([10, 10, 6], dtype=torch.int32)
    positions = torch.tensor([9, 5, 6, 7, 8, 9, 5])
    seq_of = [0, 1, 1, 1, 1, 1, 2]
    slots = torch.tensor([int(tables[b, p // 4]) * 4 + p % 4
                          for b, p in zip(seq_of, positions.tolist())])
    batch = ForwardBatch(input_ids=torch.zeros(7, dtype=torch.long), positions=positions,
                         cu_seqlens_q=torch.tensor([0, 1, 6, 7], dtype=torch.int32),
                         seq_lens=lens, block_tables=tables, slot_mapping=slots,
                         logits_indices=torch.arange(7), max_seqlen_q=5, num_seqs=3, kv=kv)
    x = torch.randn(7, c.hidden_size, generator=g).bfloat16()
    pool = kv.layer(0)[0]
    got, got_pool, rows, want, _ = _native_then_torch(layer, x, batch, pool)
    assert rows == [2]                          # the two decode rows, in one call
    for r in ([0, 6], [1, 2, 3, 4, 5]):
        assert ((got[r].float() - want[r].float()).norm()
                / want[r].float().norm()).item() < 2 ** -6
    assert torch.equal(got[1:6], want[1:6])     # the chunk's rows: the same path
    assert torch.equal(got_pool, pool)          # the latents written by the step, once
