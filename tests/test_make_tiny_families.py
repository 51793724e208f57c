"""make_tiny_model's newer families (freetoken/demo/tiny_families.py): the hub layout, as transformers
loads it and as its own save_pretrained writes it, with every tensor random; byte-stable output."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from freetoken.demo.tiny_families import FAMILIES
from freetoken.demo.tiny_model import make_tiny_model
from test_make_tiny_model import hf_load, read_tensors
from tiny_fixtures import tiny_model_dir  # noqa: F401 - a fixture

REPO = Path(__file__).resolve().parents[1]
ARCH = {"gpt_oss": "GptOssForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
        "minimax_m2": "MiniMaxM2ForCausalLM", "olmoe": "OlmoeForCausalLM",
        "ernie4_5_moe": "Ernie4_5_MoeForCausalLM"}
SMALL = dict(hidden_size=64, num_layers=2, num_experts=4, moe_intermediate_size=16, intermediate_size=32)


def assert_loads(info: dict, allowed_unexpected: str | None = None) -> None:
    """No missing or mismatched keys; unexpected ones only under allowed_unexpected (a prefix)."""
    assert {"missing_keys", "unexpected_keys", "mismatched_keys"} <= set(info), info
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert all(allowed_unexpected and k.startswith(allowed_unexpected) for k in info["unexpected_keys"]), info


def mtp_prefix(cfg: dict) -> str:
    return f"model.layers.{cfg['num_hidden_layers']}."


def transformers_view(family: str, hub: dict) -> dict:
    """The hub tensors under transformers v5's names: per-expert tensors fused into
    gate_up_proj [E, 2I, D] (gate rows, then up) and down_proj [E, D, I]; a few renames."""
    gate, up, down = ("w1", "w3", "w2") if family == "minimax_m2" else ("gate_proj", "up_proj", "down_proj")
    out, experts = {}, defaultdict(dict)
    for k, v in hub.items():
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)\.weight", k)
        if m:
            experts[m[1]][int(m[2]), m[3]] = v
        else:
            out[k] = v
    for prefix, d in experts.items():
        n = 1 + max(e for e, _ in d)
        out[prefix + ".gate_up_proj"] = torch.stack([torch.cat([d[e, gate], d[e, up]]) for e in range(n)])
        out[prefix + ".down_proj"] = torch.stack([d[e, down] for e in range(n)])
    renames = {"minimax_m2": (".block_sparse_moe.", ".mlp."),
               "ernie4_5_moe": (".mlp.moe_statics.", ".mlp.gate.moe_statics.")}.get(family)
    return {k.replace(*renames) if renames else k: v for k, v in out.items()}


def choice_scores(family: str, sd: dict, h: torch.Tensor) -> torch.Tensor:
    """Layer 1's expert-choice scores for hidden states h [T, D] (before any group masking)."""
    p = "model.layers.1.mlp."
    if family == "gpt_oss":
        return h @ sd[p + "router.weight"].T + sd[p + "router.bias"]
    logits = h @ sd[p + "gate.weight"].float().T
    if family == "glm4_moe":
        return logits.sigmoid() + sd[p + "gate.e_score_correction_bias"]
    if family == "minimax_m2":
        return logits.sigmoid() + sd[p + "e_score_correction_bias"]
    if family == "ernie4_5_moe":
        return logits.softmax(-1) + sd[p + "gate.moe_statics.e_score_correction_bias"][0]
    return logits    # olmoe: softmax, which ranks as the logits do


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_every_tensor_and_saves_the_same_layout(tiny_model_dir, tmp_path,  # noqa: F811
                                                                   family):
    from transformers import AutoConfig, AutoModelForCausalLM
    folder = tiny_model_dir(family)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == family and cfg["architectures"] == [ARCH[family]]
    hub = read_tensors(folder)
    mtp = {k for k in hub if k.startswith(mtp_prefix(cfg))}
    assert bool(mtp) == (family == "glm4_moe")
    model, info = hf_load(folder)
    # transformers drops GLM's MTP layer (its ignore list names only GLM-4.5's indices 46 and 92)
    assert_loads(info, allowed_unexpected=mtp_prefix(cfg) if mtp else None)
    assert type(model).__name__ == ARCH[family] and next(model.parameters()).dtype == torch.float32
    # Every parameter and persistent buffer is one of ours, unpermuted, and random (no zero
    # router biases or unit norms that would let two implementations agree by accident).
    sd = model.state_dict()
    ours = transformers_view(family, {k: v for k, v in hub.items() if k not in mtp})
    if cfg["tie_word_embeddings"]:
        ours["lm_head.weight"] = ours["model.embed_tokens.weight"]
    assert sd.keys() == ours.keys()
    for k, v in ours.items():
        assert torch.equal(sd[k], v.float()), k
        assert v.numel() == 1 or v.float().std() > 0.01, k
    # transformers' own save_pretrained of this config writes exactly our names and shapes.
    ref = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    ref.save_pretrained(tmp_path / "ref")
    theirs = read_tensors(tmp_path / "ref")
    assert {k: v.shape for k, v in theirs.items()} == {k: v.shape for k, v in hub.items() if k not in mtp}
    with torch.no_grad():
        ids = torch.tensor([[1, 50, 300, 1902, 7]])
        logits = model(ids).logits
        assert logits.shape == (1, 5, cfg["vocab_size"]) and torch.isfinite(logits).all()
        # Expert choices are decisive: the k-th best score is well apart from the next.
        scores = choice_scores(family, sd, model.model.embed_tokens(ids[0])).sort(-1, descending=True).values
    k = cfg.get("num_experts_per_tok", cfg.get("moe_k"))
    assert (scores[:, k - 1] - scores[:, k]).min() > 1e-3


def test_exact_hub_keys_and_shapes(tiny_model_dir):  # noqa: F811
    # Defaults: D 128, 4 layers, 4 q / 2 kv heads of 32, 8 experts of width 64, dense width 256.
    expected = {
        "gpt_oss": {"model.layers.0.self_attn.sinks": (4,), "model.layers.0.self_attn.o_proj.bias": (128,),
                    "model.layers.0.self_attn.k_proj.bias": (64,),
                    "model.layers.3.mlp.router.weight": (8, 128), "model.layers.3.mlp.router.bias": (8,),
                    "model.layers.3.mlp.experts.gate_up_proj": (8, 128, 128),
                    "model.layers.3.mlp.experts.gate_up_proj_bias": (8, 128),
                    "model.layers.3.mlp.experts.down_proj": (8, 64, 128),
                    "model.layers.3.mlp.experts.down_proj_bias": (8, 128)},
        "glm4_moe": {"model.layers.0.mlp.up_proj.weight": (256, 128),
                     "model.layers.0.self_attn.q_proj.bias": (128,),
                     "model.layers.0.self_attn.q_norm.weight": (32,),
                     "model.layers.1.mlp.gate.e_score_correction_bias": (8,),
                     "model.layers.1.mlp.experts.7.down_proj.weight": (128, 64),
                     "model.layers.3.mlp.shared_experts.gate_proj.weight": (64, 128),
                     "model.layers.4.eh_proj.weight": (128, 256), "model.layers.4.enorm.weight": (128,),
                     "model.layers.4.hnorm.weight": (128,), "model.layers.4.shared_head.norm.weight": (128,),
                     "model.layers.4.shared_head.head.weight": (2048, 128),
                     "model.layers.4.embed_tokens.weight": (2048, 128),
                     "model.layers.4.mlp.experts.0.gate_proj.weight": (64, 128)},
        "minimax_m2": {"model.layers.0.self_attn.q_norm.weight": (128,),
                       "model.layers.0.self_attn.k_norm.weight": (64,),
                       "model.layers.0.block_sparse_moe.gate.weight": (8, 128),
                       "model.layers.0.block_sparse_moe.e_score_correction_bias": (8,),
                       "model.layers.3.block_sparse_moe.experts.7.w2.weight": (128, 64)},
        "olmoe": {"model.layers.0.self_attn.q_norm.weight": (128,),
                  "model.layers.0.self_attn.k_norm.weight": (64,),
                  "model.layers.0.mlp.gate.weight": (8, 128),
                  "model.layers.3.mlp.experts.7.up_proj.weight": (64, 128)},
        "ernie4_5_moe": {"model.layers.0.mlp.gate_proj.weight": (256, 128),
                         "model.layers.1.mlp.moe_statics.e_score_correction_bias": (1, 8),
                         "model.layers.1.mlp.experts.7.gate_proj.weight": (64, 128),
                         "model.layers.1.mlp.shared_experts.down_proj.weight": (128, 128)},
    }
    absent = {"gpt_oss": ["lm_head.bias", "model.layers.0.self_attn.q_norm.weight"],
              "glm4_moe": ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.down_proj.weight",
                           "model.layers.5.input_layernorm.weight", "model.layers.0.self_attn.o_proj.bias"],
              "minimax_m2": ["model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.gate.weight"],
              "olmoe": ["model.layers.0.self_attn.q_proj.bias"],
              "ernie4_5_moe": ["lm_head.weight", "model.layers.0.mlp.gate.weight",
                               "model.layers.0.self_attn.q_proj.bias"]}
    for family in FAMILIES:
        hub = read_tensors(tiny_model_dir(family))
        assert {k: tuple(hub[k].shape) for k in expected[family] if k in hub} == expected[family], family
        assert not set(absent[family]) & hub.keys(), family


def test_gpt_oss_experts_are_transposed_and_interleaved(tiny_model_dir):  # noqa: F811
    # gate_up_proj[e] is x @ W ([D, 2I]) with gate in the even columns and up in the odd ones:
    # computing that by hand from the file's tensors gives transformers' expert output.
    folder = tiny_model_dir("gpt_oss")
    hub = read_tensors(folder)
    model, _ = hf_load(folder)
    cfg = json.loads((folder / "config.json").read_text())
    p, e = "model.layers.2.mlp.experts.", 5
    x = torch.randn(3, cfg["hidden_size"], generator=torch.Generator().manual_seed(0))
    gu = x @ hub[p + "gate_up_proj"][e] + hub[p + "gate_up_proj_bias"][e]
    limit = cfg["swiglu_limit"]
    gate, up = gu[:, ::2].clamp(max=limit), gu[:, 1::2].clamp(-limit, limit)
    glu = (up + 1) * gate * torch.sigmoid(1.702 * gate)
    by_hand = glu @ hub[p + "down_proj"][e] + hub[p + "down_proj_bias"][e]
    with torch.no_grad():
        theirs = model.model.layers[2].mlp.experts(x, torch.full((3, 1), e), torch.ones(3, 1))
    torch.testing.assert_close(theirs, by_hand)


@pytest.mark.parametrize("family", FAMILIES)
def test_same_arguments_same_bytes_and_the_shared_tokenizer(tmp_path, family):
    a = make_tiny_model(tmp_path / "a", family=family, seed=5, **SMALL)
    b = make_tiny_model(tmp_path / "b", family=family, seed=5, **SMALL)
    q = make_tiny_model(tmp_path / "q", family="qwen3_moe", seed=5, **SMALL)
    names = sorted(p.name for p in a.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"] == sorted(p.name for p in b.iterdir())
    assert all((a / n).read_bytes() == (b / n).read_bytes() for n in names)
    # the tokenizer, chat template and generation config are the other families'
    for n in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (a / n).read_bytes() == (q / n).read_bytes(), n
    assert "chat_template" in json.loads((a / "tokenizer_config.json").read_text())
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["eos_token_id"] == 1902 and cfg["bos_token_id"] == 1900


def test_shape_knobs_reach_config_and_transformers(tmp_path):
    from transformers import AutoConfig
    gpt = make_tiny_model(tmp_path / "gpt", family="gpt_oss", num_layers=3, sliding_window=8,
                          head_dim=24, max_position_embeddings=4096, rms_norm_eps=1e-6)
    cfg = json.loads((gpt / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert cfg["sliding_window"] == 8 and cfg["head_dim"] == 24 and cfg["attention_bias"] is True
    assert cfg["rope_scaling"]["rope_type"] == "yarn" and cfg["rope_scaling"]["truncate"] is False
    assert cfg["rope_scaling"]["original_max_position_embeddings"] == 128 and cfg["rms_norm_eps"] == 1e-6
    hf = AutoConfig.from_pretrained(gpt)
    assert hf.rope_parameters["factor"] == 32.0 and hf.rope_parameters["rope_theta"] == cfg["rope_theta"]
    assert hf.sliding_window == 8 and hf.layer_types == cfg["layer_types"]

    glm = make_tiny_model(tmp_path / "glm", family="glm4_moe", num_experts=12, n_group=3, topk_group=2,
                          top_k=3, first_k_dense_replace=2, n_shared_experts=2, partial_rotary_factor=0.25,
                          routed_scaling_factor=1.5, attention_bias=False, use_qk_norm=False,
                          norm_topk_prob=False, dtype="bfloat16")
    cfg = json.loads((glm / "config.json").read_text())
    assert {k: cfg[k] for k in ("n_routed_experts", "n_group", "topk_group", "num_experts_per_tok",
                                "first_k_dense_replace", "n_shared_experts", "partial_rotary_factor",
                                "routed_scaling_factor", "attention_bias", "use_qk_norm", "norm_topk_prob",
                                "num_nextn_predict_layers")} == {
        "n_routed_experts": 12, "n_group": 3, "topk_group": 2, "num_experts_per_tok": 3,
        "first_k_dense_replace": 2, "n_shared_experts": 2, "partial_rotary_factor": 0.25,
        "routed_scaling_factor": 1.5, "attention_bias": False, "use_qk_norm": False, "norm_topk_prob": False,
        "num_nextn_predict_layers": 1}
    hub = read_tensors(glm)
    assert [i for i in range(4) if f"model.layers.{i}.mlp.down_proj.weight" in hub] == [0, 1]
    assert hub["model.layers.2.mlp.shared_experts.up_proj.weight"].shape == (128, 128)
    assert not {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.q_norm.weight"} & hub.keys()
    # bfloat16, but the router tensors float32, as transformers' save_pretrained writes them
    fp32 = sorted({k.split(".", 3)[3] for k, v in hub.items() if v.dtype == torch.float32})
    assert fp32 == ["mlp.gate.e_score_correction_bias", "mlp.gate.weight"]
    assert all(v.dtype == torch.bfloat16 for k, v in hub.items() if "mlp.gate." not in k)
    model, info = hf_load(glm, dtype="auto")
    assert_loads(info, allowed_unexpected="model.layers.4.")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.rotary_emb.inv_freq.numel() == 32 * 0.25 / 2

    mm = make_tiny_model(tmp_path / "mm", family="minimax_m2", head_dim=64, partial_rotary_factor=0.25)
    cfg = json.loads((mm / "config.json").read_text())
    assert cfg["head_dim"] == 64 and cfg["rotary_dim"] == 16 and cfg["use_qk_norm"] is True
    model, info = hf_load(mm)
    assert_loads(info)
    assert model.model.rotary_emb.inv_freq.numel() == 8
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (4 * 64,)

    ern = make_tiny_model(tmp_path / "ern", family="ernie4_5_moe", num_layers=5, first_k_dense_replace=1,
                          decoder_sparse_step=2, n_shared_experts=1, tie_word_embeddings=False)
    cfg = json.loads((ern / "config.json").read_text())
    assert (cfg["moe_layer_start_index"], cfg["moe_layer_end_index"], cfg["moe_layer_interval"]) == (1, 4, 2)
    assert cfg["moe_num_shared_experts"] == 1 and cfg["tie_word_embeddings"] is False
    assert "head_dim" not in cfg
    hub = read_tensors(ern)
    assert [i for i in range(5) if f"model.layers.{i}.mlp.gate.weight" in hub] == [1, 3]
    assert hub["model.layers.1.mlp.shared_experts.gate_proj.weight"].shape == (64, 128)
    assert "lm_head.weight" in hub
    model, info = hf_load(ern)
    assert_loads(info)
    assert [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in model.model.layers] == [
        False, True, False, True, False]


def test_glm_without_mtp_is_the_same_model_and_loads_cleanly(tmp_path, tiny_model_dir):  # noqa: F811
    with_mtp = read_tensors(tiny_model_dir("glm4_moe"))
    folder = make_tiny_model(tmp_path / "nomtp", family="glm4_moe", mtp=False)
    without = read_tensors(folder)
    assert json.loads((folder / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert without.keys() == {k for k in with_mtp if not k.startswith("model.layers.4.")}
    assert all(torch.equal(without[k], with_mtp[k]) for k in without)
    _, info = hf_load(folder)
    assert_loads(info)


def test_bad_arguments_are_refused(tmp_path):
    bad = [("gpt_oss", dict(mlp_only_layers=[0]), "mlp_only_layers"),
           ("olmoe", dict(decoder_sparse_step=2), "decoder_sparse_step"),
           ("gpt_oss", dict(norm_topk_prob=False), "renormalises"),
           ("ernie4_5_moe", dict(norm_topk_prob=False), "renormalises"),
           ("olmoe", dict(mtp=True), "MTP"), ("qwen3_moe", dict(mtp=True), "MTP"),
           ("olmoe", dict(head_dim=16), "head_dim"),
           ("glm4_moe", dict(n_group=3), "n_group"), ("glm4_moe", dict(topk_group=3), "topk_group"),
           ("glm4_moe", dict(n_group=4, topk_group=1, top_k=3), "top_k"),
           ("minimax_m2", dict(partial_rotary_factor=0.3), "rotary"),
           ("glm4_moe", dict(first_k_dense_replace=5), "first_k_dense_replace")]
    for family, shape, match in bad:
        with pytest.raises(ValueError, match=match):
            make_tiny_model(tmp_path / "x", family=family, **shape)
    assert not (tmp_path / "x").exists()


def test_cli_writes_what_the_library_writes(tmp_path):
    args = ["--family", "glm4_moe", "--out", str(tmp_path / "cli"), "--seed", "3", "--num-layers", "2",
            "--n-group", "4", "--topk-group", "2", "--n-shared-experts", "2",
            "--partial-rotary-factor", "0.25",
            "--no-attention-bias", "--no-mtp", "--first-k-dense-replace", "0", "--dtype", "bfloat16"]
    run = subprocess.run([sys.executable, str(REPO / "tools" / "make_tiny_model.py"), *args],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    ref = make_tiny_model(tmp_path / "lib", family="glm4_moe", seed=3, num_layers=2, n_group=4, topk_group=2,
                          n_shared_experts=2, partial_rotary_factor=0.25, attention_bias=False, mtp=False,
                          first_k_dense_replace=0, dtype="bfloat16")
    names = sorted(p.name for p in ref.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "cli").iterdir())
    assert all((tmp_path / "cli" / n).read_bytes() == (ref / n).read_bytes() for n in names)
    for family, flags in [("gpt_oss", ["--sliding-window", "4"]),
                          ("ernie4_5_moe", ["--no-tie-word-embeddings"])]:
        run = subprocess.run([sys.executable, str(REPO / "tools" / "make_tiny_model.py"), "--family", family,
                              "--out", str(tmp_path / family), "--num-layers", "2", *flags],
                             capture_output=True, text=True, cwd=tmp_path)
        assert run.returncode == 0, run.stderr
    assert json.loads((tmp_path / "gpt_oss" / "config.json").read_text())["sliding_window"] == 4
    assert "lm_head.weight" in read_tensors(tmp_path / "ernie4_5_moe")
