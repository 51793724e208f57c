"""make_tiny_model: deterministic hub-layout checkpoints that transformers loads as it loads real ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from freetoken.demo.tiny_model import make_tiny_model
from tiny_fixtures import tiny_model_dir  # noqa: F401 - a fixture

REPO = Path(__file__).resolve().parents[1]
# The newer families (freetoken/demo/tiny_families.py) are tested in test_make_tiny_families.py.
FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def hf_load(folder: Path, **kwargs):
    from transformers import AutoModelForCausalLM
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, **kwargs)
    return model.eval(), info


def assert_clean_load(info: dict) -> None:
    problems = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    assert set(problems) == {"missing_keys", "unexpected_keys", "mismatched_keys"}, info
    assert not any(problems.values()), problems


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = make_tiny_model(tmp_path / "a", family="qwen3_moe", seed=3, num_layers=2)
    b = make_tiny_model(tmp_path / "b", family="qwen3_moe", seed=3, num_layers=2)
    c = make_tiny_model(tmp_path / "c", family="qwen3_moe", seed=4, num_layers=2)
    names = sorted(p.name for p in a.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()
    ta, tc = read_tensors(a), read_tensors(c)
    assert ta.keys() == tc.keys()
    assert not torch.equal(ta["model.embed_tokens.weight"], tc["model.embed_tokens.weight"])


def test_tokenizer_training_is_deterministic_across_processes():
    # The BPE trainer runs in Rust with per-process hash seeds: a fresh process must agree.
    from freetoken.demo.tiny_tokenizer import tokenizer_json
    code = ("import sys; from freetoken.demo.tiny_tokenizer import tokenizer_json; "
            "sys.stdout.write(tokenizer_json())")
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=REPO, encoding="utf-8").stdout for _ in range(2)]
    assert outs[0] == outs[1] == tokenizer_json()
    vocab = json.loads(outs[0])["model"]["vocab"]
    assert 1500 <= len(vocab) <= 2000 and len(json.loads(outs[0])["model"]["merges"]) > 1000


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_every_family_cleanly(tiny_model_dir, family):  # noqa: F811
    folder = tiny_model_dir(family)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == family and config["architectures"][0].endswith("ForCausalLM")
    model, info = hf_load(folder)
    assert_clean_load(info)
    assert type(model).__name__ == config["architectures"][0]
    assert next(model.parameters()).dtype == torch.float32
    ours = read_tensors(folder)
    expected_keys = {
        "qwen3_moe": ["model.layers.0.self_attn.q_norm.weight",
                      "model.layers.3.mlp.experts.7.up_proj.weight"],
        "mixtral": ["model.layers.0.block_sparse_moe.gate.weight",
                    "model.layers.3.block_sparse_moe.experts.7.w3.weight"],
        "qwen2_moe": ["model.layers.0.self_attn.q_proj.bias", "model.layers.3.mlp.shared_expert_gate.weight"],
    }[family]
    assert set(expected_keys) <= ours.keys()
    # transformers v5 fuses the hub's per-expert tensors; expert 5's down projection must land
    # in slot 5 (a wrong mapping would load cleanly and still be wrong).
    layer = model.model.layers[1]
    moe = getattr(layer, "block_sparse_moe", None) or layer.mlp    # v5 renamed mixtral's to mlp
    down = "w2" if family == "mixtral" else "down_proj"
    prefix = "model.layers.1." + ("block_sparse_moe" if family == "mixtral" else "mlp")
    assert torch.equal(moe.experts.down_proj[5], ours[f"{prefix}.experts.5.{down}.weight"])
    assert torch.equal(moe.gate.weight, ours[f"{prefix}.gate.weight"])
    with torch.no_grad():
        logits = model(torch.tensor([[1, 50, 300, 1902, 7]])).logits
    assert logits.shape == (1, 5, config["vocab_size"]) and torch.isfinite(logits).all()
    # The routers are drawn wide so expert choices are decisive: the top-k weights of a layer's
    # router are well apart from the next expert's.
    h = model.model.embed_tokens(torch.tensor([1, 50, 300]))
    probs = torch.softmax(h @ moe.gate.weight.T, dim=-1).sort(dim=-1, descending=True).values
    k = config["num_experts_per_tok"]
    assert (probs[:, k - 1] - probs[:, k]).min() > 1e-3


def test_sharded_output_has_a_correct_index(tmp_path, tiny_model_dir):  # noqa: F811
    folder = make_tiny_model(tmp_path / "sharded", family="mixtral", seed=0, max_shard_mb=1)
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) >= 4 and not (folder / "model.safetensors").exists()
    assert [p.name for p in shards] == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                        for i in range(1, len(shards) + 1)]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    seen = {}
    for shard in shards:
        with safe_open(shard, "pt") as f:
            keys = list(f.keys())
            assert f.metadata() == {"format": "pt"}
        assert all(weight_map[k] == shard.name for k in keys)
        size = sum(t.numel() * t.element_size() for t in load_file(shard).values())
        assert size <= 1e6 or len(keys) == 1
        seen.update(dict.fromkeys(keys, shard.name))
    assert seen == weight_map
    whole = read_tensors(tiny_model_dir("mixtral"))
    parts = read_tensors(folder)
    assert parts.keys() == whole.keys() and all(torch.equal(parts[k], whole[k]) for k in whole)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in whole.values())
    _, info = hf_load(folder)
    assert_clean_load(info)
    # Rewriting the folder unsharded leaves no stale shards or index behind.
    make_tiny_model(folder, family="mixtral", seed=0)
    assert sorted(p.name for p in folder.glob("model*")) == ["model.safetensors"]


SHAPES = {
    "qwen3_moe": dict(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=1, head_dim=24,
                      num_experts=6, top_k=3, moe_intermediate_size=40, intermediate_size=96,
                      vocab_size=1920, tie_word_embeddings=True, mlp_only_layers=[1],
                      norm_topk_prob=False, max_position_embeddings=4096, rms_norm_eps=1e-5,
                      dtype="bfloat16"),
    "mixtral": dict(hidden_size=48, num_layers=2, num_heads=3, num_kv_heads=1, num_experts=5,
                    top_k=1, moe_intermediate_size=24, vocab_size=2000, dtype="float16",
                    rope_theta=10000.0),
    "qwen2_moe": dict(hidden_size=80, num_layers=4, num_heads=5, num_kv_heads=5, num_experts=4,
                      top_k=2, moe_intermediate_size=16, intermediate_size=64,
                      shared_expert_intermediate_size=48, decoder_sparse_step=2,
                      norm_topk_prob=True, max_position_embeddings=2048),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_shape_flags_reach_config_and_tensors(tmp_path, family):
    shape = SHAPES[family]
    folder = make_tiny_model(tmp_path / family, family=family, seed=1, **shape)
    cfg = json.loads((folder / "config.json").read_text())
    expert_width = "intermediate_size" if family == "mixtral" else "moe_intermediate_size"
    for flag, field in [("hidden_size", "hidden_size"), ("num_layers", "num_hidden_layers"),
                        ("num_heads", "num_attention_heads"), ("num_kv_heads", "num_key_value_heads"),
                        ("top_k", "num_experts_per_tok"), ("moe_intermediate_size", expert_width),
                        ("vocab_size", "vocab_size"), ("max_position_embeddings", "max_position_embeddings"),
                        ("tie_word_embeddings", "tie_word_embeddings"), ("head_dim", "head_dim"),
                        ("mlp_only_layers", "mlp_only_layers"), ("norm_topk_prob", "norm_topk_prob"),
                        ("decoder_sparse_step", "decoder_sparse_step"), ("rms_norm_eps", "rms_norm_eps"),
                        ("intermediate_size", "intermediate_size"), ("dtype", "torch_dtype"),
                        ("shared_expert_intermediate_size", "shared_expert_intermediate_size")]:
        if flag in shape:
            assert cfg[field] == shape[flag], flag
    assert cfg["num_local_experts" if family == "mixtral" else "num_experts"] == shape["num_experts"]
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == shape.get("rope_theta", 1e6)
    assert ("head_dim" in cfg) == (family == "qwen3_moe")    # mixtral/qwen2: hidden / heads
    assert cfg.get("qkv_bias", False) == (family == "qwen2_moe")
    tensors = read_tensors(folder)
    dtype = getattr(torch, shape.get("dtype", "float32"))
    assert all(t.dtype == dtype for t in tensors.values())
    D, V = shape["hidden_size"], shape.get("vocab_size", 2048)
    assert tensors["model.embed_tokens.weight"].shape == (V, D)
    assert ("lm_head.weight" in tensors) == (not shape.get("tie_word_embeddings", False))
    if family == "qwen3_moe":
        assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 24, D)
        assert tensors["model.layers.0.self_attn.k_norm.weight"].shape == (24,)
    dense = {"qwen3_moe": [1], "mixtral": [], "qwen2_moe": [0, 2]}[family]
    for i in range(shape["num_layers"]):
        has_dense = f"model.layers.{i}.mlp.down_proj.weight" in tensors
        assert has_dense == (i in dense), i
        if has_dense:
            assert tensors[f"model.layers.{i}.mlp.up_proj.weight"].shape == (shape["intermediate_size"], D)
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1902, 1900] and cfg["eos_token_id"] == 1902
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok_cfg["model_max_length"] == shape.get("max_position_embeddings", 32768)
    model, info = hf_load(folder, dtype="auto")
    assert_clean_load(info)
    assert next(model.parameters()).dtype == dtype
    assert model.config.num_hidden_layers == shape["num_layers"]


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown family"):
        make_tiny_model(tmp_path / "x", family="llama")
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        make_tiny_model(tmp_path / "x", vocab_size=512)
    with pytest.raises(ValueError, match="mixtral"):
        make_tiny_model(tmp_path / "x", family="mixtral", mlp_only_layers=[0])
    with pytest.raises(ValueError, match="head_dim"):
        make_tiny_model(tmp_path / "x", family="qwen2_moe", head_dim=16)
    with pytest.raises(TypeError):
        make_tiny_model(tmp_path / "x", hidden=64)
    assert not (tmp_path / "x").exists()


def test_cli_writes_what_the_library_writes(tmp_path):
    out = tmp_path / "cli"
    args = ["--family", "qwen2_moe", "--out", str(out), "--seed", "2", "--num-layers", "2",
            "--mlp-only-layers", "1", "--no-norm-topk-prob", "--dtype", "bfloat16", "--max-shard-mb", "0.5"]
    run = subprocess.run([sys.executable, str(REPO / "tools" / "make_tiny_model.py"), *args],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    ref = make_tiny_model(tmp_path / "lib", family="qwen2_moe", seed=2, num_layers=2, mlp_only_layers=[1],
                          norm_topk_prob=False, dtype="bfloat16", max_shard_mb=0.5)
    names = sorted(p.name for p in ref.iterdir())
    assert names == sorted(p.name for p in out.iterdir()) and len(names) > 6
    assert all((out / n).read_bytes() == (ref / n).read_bytes() for n in names)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["mlp_only_layers"] == [1] and cfg["norm_topk_prob"] is False
    bad = subprocess.run([sys.executable, str(REPO / "tools" / "make_tiny_model.py"), "--out",
                          str(tmp_path / "bad"), "--vocab-size", "10"], capture_output=True, text=True)
    assert bad.returncode == 2 and "smaller than the tokenizer" in bad.stderr
