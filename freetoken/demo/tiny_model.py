"""Tiny random-weight MoE checkpoints in Hugging Face's exact hub layout.

`ft serve` builds its demo model with this, tools/make_tiny_model.py is its CLI, and the tests
use it for checkpoints that transformers (the test oracle) loads as it loads real ones. So the
files copy the hub's: config.json with the family's field names, generation_config.json,
per-expert safetensors keys (the hub's, not transformers v5's fused 3D experts; gpt-oss's hub
checkpoints fuse them, and so does its tiny one), optionally sharded with an index, and the
tokenizer of tiny_tokenizer.py. No transformers import here. The qwen and mixtral families are
written here; the newer ones' fields and tensors are in tiny_families.py.

Weights are drawn so that greedy decoding is robust when two implementations are compared:
fan-in scaled linears (logits of order 1, well apart) and routers 4x wider still, so top-k
expert choices are decisive rather than near-ties that float noise could flip. The same
arguments give byte-identical files.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from freetoken.demo import tiny_families, tiny_hybrid, tiny_mla
from freetoken.demo.tiny_tokenizer import (CHAT_TEMPLATES, EOS_TOKEN, PAD_TOKEN, build_tokenizer,
                                           write_tokenizer)

FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe", *tiny_families.FAMILIES, *tiny_hybrid.FAMILIES,
            *tiny_mla.FAMILIES)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ROUTER_STD_SCALE = 4.0


@dataclasses.dataclass(frozen=True)
class TinyShape:
    """The knobs; defaults keep a CPU forward pass in milliseconds."""
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None             # None: hidden_size // num_heads (32 by default)
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: int = 64         # one expert's width (mixtral's, gpt_oss', minimax_m2's
                                            # and olmoe's intermediate_size)
    intermediate_size: int = 256            # dense MLP width (qwen, glm4_moe, ernie dense layers)
    shared_expert_intermediate_size: int = 128   # qwen2_moe, qwen3_next, qwen3_5_moe
    vocab_size: int = 2048                  # model vocab; >= the tokenizer's 1909 tokens
    norm_topk_prob: bool | None = None      # None: the family's usual (qwen3/glm4 True, qwen2/olmoe False)
    tie_word_embeddings: bool | None = None     # None: the family's usual (ernie4_5_moe tied)
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1            # also ernie4_5_moe's moe_layer_interval
    max_position_embeddings: int = 32768
    rms_norm_eps: float | None = None       # None: the family's (qwen, minimax_m2 1e-6; others 1e-5)
    rope_theta: float = 1_000_000.0
    dtype: str = "float32"
    max_shard_mb: float | None = None       # shard the safetensors at this size (MB = 1e6 bytes)
    # The newer families' knobs (tiny_families.py)
    sliding_window: int = 16                # gpt_oss: the even layers' window
    first_k_dense_replace: int = 1          # glm4_moe; ernie4_5_moe's moe_layer_start_index
    n_group: int = 2                        # glm4_moe: expert groups ...
    topk_group: int = 1                     # ... of which each token's top-k may use this many
    n_shared_experts: int | None = None     # glm4_moe (default 1), ernie4_5_moe (default 2)
    routed_scaling_factor: float = 2.5      # glm4_moe (GLM-4.5's)
    partial_rotary_factor: float = 0.5      # glm4_moe; minimax_m2's rotary_dim = head_dim * this
    attention_bias: bool | None = None      # glm4_moe q/k/v biases (default True, as GLM-4.5)
    use_qk_norm: bool = True                # glm4_moe per-head q/k norms (GLM-4.5 yes, Air no)
    mtp: bool | None = None                 # glm4_moe: the MTP layer model.layers.{num_layers}.*
                                            # (default on, as the hub's checkpoints)
    # The multi-head latent attention families' knobs (tiny_mla.py)
    q_lora_rank: int | None = 48            # None: one q_proj, no q LoRA pair
    kv_lora_rank: int = 64                  # the cached latent c_kv's width
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16              # the shared rope key's width, also cached
    v_head_dim: int = 24
    rope_yarn_factor: float = 4.0           # YaRN with DeepSeek's mscale; 0: plain RoPE

    def __post_init__(self):
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    def resolved_tie(self, family: str) -> bool:
        if self.tie_word_embeddings is not None:
            return self.tie_word_embeddings
        return family in tiny_families.TIED_BY_DEFAULT

    def resolved_n_shared(self, family: str) -> int:
        return self.n_shared_experts if self.n_shared_experts is not None else (
            2 if family == "ernie4_5_moe" else 1)

    def resolved_attention_bias(self) -> bool:
        return self.attention_bias is not False

    def resolved_mtp(self, family: str) -> bool:
        return self.mtp if self.mtp is not None else family == "glm4_moe"

    def is_moe_layer(self, i: int) -> bool:
        # The rule of HF's qwen2_moe/qwen3_moe; mixtral never sets these, so every layer is MoE.
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0


def make_tiny_model(out_dir, family: str = "qwen3_moe", seed: int = 0, chat_template: str = "qwen3",
                    **shape) -> Path:
    """Write a random-weight checkpoint of `family` into out_dir (created if absent).

    `chat_template` picks the template variant (tiny_tokenizer.CHAT_TEMPLATES: qwen3, thinking,
    graded); `shape` takes TinyShape's fields (e.g. hidden_size=64, max_shard_mb=1). Returns out_dir.
    """
    s = TinyShape(**shape)
    _validate(family, s)
    if chat_template not in CHAT_TEMPLATES:
        raise ValueError(f"unknown chat template {chat_template!r}; choose from {', '.join(CHAT_TEMPLATES)}")
    tok = build_tokenizer()
    if tok.get_vocab_size(with_added_tokens=True) > s.vocab_size:
        raise ValueError(f"vocab_size {s.vocab_size} is smaller than the tokenizer's "
                         f"{tok.get_vocab_size(with_added_tokens=True)} tokens")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out, model_max_length=s.max_position_embeddings, template=chat_template)
    eos, pad = tok.token_to_id(EOS_TOKEN), tok.token_to_id(PAD_TOKEN)
    _write_json(out / "config.json", config_json(family, s, eos_id=eos, bos_id=pad))
    _write_json(out / "generation_config.json",
                {"bos_token_id": pad, "eos_token_id": [eos, pad], "pad_token_id": pad})
    tensors = init_weights(param_shapes(family, s), seed, DTYPES[s.dtype],
                           float32_suffixes=tiny_families.FLOAT32_SUFFIXES.get(family, ())
                           or (tiny_mla.FLOAT32_SUFFIXES if family in tiny_mla.FAMILIES else ()))
    write_safetensors(out, tensors, s.max_shard_mb)
    return out


def _validate(family: str, s: TinyShape) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    if s.max_shard_mb is not None and not s.max_shard_mb > 0:
        raise ValueError(f"max_shard_mb must be positive, got {s.max_shard_mb}")
    if s.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {s.dtype!r}")
    if s.num_heads % s.num_kv_heads:
        raise ValueError("num_heads must be a multiple of num_kv_heads")
    if not 1 <= s.top_k <= s.num_experts:
        raise ValueError("top_k must be in 1..num_experts")
    if s.decoder_sparse_step < 1 or any(not 0 <= i < s.num_layers for i in s.mlp_only_layers):
        raise ValueError("decoder_sparse_step must be >= 1 and mlp_only_layers in 0..num_layers-1")
    if family in tiny_families.FAMILIES:
        tiny_families.validate(family, s)
    elif family in tiny_hybrid.FAMILIES:
        tiny_hybrid.validate(family, s)
    elif family in tiny_mla.FAMILIES:
        tiny_mla.validate(family, s)
    elif s.mtp:
        raise ValueError("only glm4_moe writes an MTP layer")
    if family == "mixtral" and (s.mlp_only_layers or s.decoder_sparse_step != 1
                                or s.norm_topk_prob is False):
        raise ValueError("mixtral has every layer MoE and always renormalises its top-k weights")
    if family == "qwen2_moe" and s.resolved_head_dim * s.num_heads != s.hidden_size:
        raise ValueError("qwen2_moe has no head_dim field: head_dim must be hidden_size // num_heads")


def config_json(family: str, s: TinyShape, *, eos_id: int, bos_id: int) -> dict:
    """config.json with the field names the family's hub checkpoints use."""
    common = {
        "attention_dropout": 0.0, "bos_token_id": bos_id, "eos_token_id": eos_id,
        "hidden_act": "silu", "hidden_size": s.hidden_size, "initializer_range": 0.02,
        "max_position_embeddings": s.max_position_embeddings,
        "num_attention_heads": s.num_heads, "num_experts_per_tok": s.top_k,
        "num_hidden_layers": s.num_layers, "num_key_value_heads": s.num_kv_heads,
        "output_router_logits": False,
        "rms_norm_eps": s.rms_norm_eps if s.rms_norm_eps is not None else
        {"mixtral": 1e-5, **tiny_families.RMS_NORM_EPS, **tiny_mla.RMS_NORM_EPS}.get(family, 1e-6),
        # Hub checkpoints (transformers v4) spell rope_theta; v5 writes rope_parameters.
        "rope_theta": s.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": s.rope_theta},
        "tie_word_embeddings": s.resolved_tie(family), "torch_dtype": s.dtype, "use_cache": True,
        "vocab_size": s.vocab_size,
    }
    if family in tiny_families.FAMILIES:
        return tiny_families.config_json(family, s, common)
    if family in tiny_hybrid.FAMILIES:
        return tiny_hybrid.config_json(family, s, common)
    if family in tiny_mla.FAMILIES:
        return dict(sorted(tiny_mla.config_json(family, s, common).items()))
    if family == "mixtral":
        cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **common,
               "intermediate_size": s.moe_intermediate_size, "num_local_experts": s.num_experts,
               "router_aux_loss_coef": 0.02, "router_jitter_noise": 0.0, "sliding_window": None}
        if s.resolved_head_dim * s.num_heads != s.hidden_size:
            cfg["head_dim"] = s.resolved_head_dim
        return dict(sorted(cfg.items()))
    qwen = {
        **common, "decoder_sparse_step": s.decoder_sparse_step,
        "intermediate_size": s.intermediate_size, "max_window_layers": s.num_layers,
        "mlp_only_layers": list(s.mlp_only_layers), "moe_intermediate_size": s.moe_intermediate_size,
        "norm_topk_prob": s.norm_topk_prob if s.norm_topk_prob is not None else family == "qwen3_moe",
        "num_experts": s.num_experts, "router_aux_loss_coef": 0.001, "sliding_window": None,
        "use_sliding_window": False,
    }
    if family == "qwen3_moe":
        cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **qwen,
               "attention_bias": False, "head_dim": s.resolved_head_dim}
    else:
        cfg = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", **qwen,
               "qkv_bias": True, "shared_expert_intermediate_size": s.shared_expert_intermediate_size}
    return dict(sorted(cfg.items()))


def param_shapes(family: str, s: TinyShape) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor's hub name and shape, in module order (which fixes the random draws)."""
    # D hidden, Hd head dim, V vocab; q / kv: the query and key-value projections' widths
    D, Hd, V = s.hidden_size, s.resolved_head_dim, s.vocab_size
    q, kv = s.num_heads * Hd, s.num_kv_heads * Hd
    if family in tiny_hybrid.FAMILIES:
        return tiny_hybrid.param_shapes(family, s)
    out = [("model.embed_tokens.weight", (V, D))]
    if family in tiny_families.FAMILIES or family in tiny_mla.FAMILIES:
        newer = tiny_families if family in tiny_families.FAMILIES else tiny_mla
        for i in range(s.num_layers):
            out += newer.layer_shapes(family, s, i)
        out.append(("model.norm.weight", (D,)))
        if not s.resolved_tie(family):
            out.append(("lm_head.weight", (V, D)))
        return out + (tiny_families.extra_shapes(family, s) if newer is tiny_families else [])
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (q, D)), (p + "self_attn.k_proj.weight", (kv, D)),
                (p + "self_attn.v_proj.weight", (kv, D)), (p + "self_attn.o_proj.weight", (D, q))]
        if family == "qwen2_moe":
            out += [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,)),
                    (p + "self_attn.v_proj.bias", (kv,))]
        if family == "qwen3_moe":
            out += [(p + "self_attn.q_norm.weight", (Hd,)), (p + "self_attn.k_norm.weight", (Hd,))]
        out += _mlp_shapes(family, s, i)
        out += [(p + "input_layernorm.weight", (D,)), (p + "post_attention_layernorm.weight", (D,))]
    out.append(("model.norm.weight", (D,)))
    if not s.resolved_tie(family):
        out.append(("lm_head.weight", (V, D)))
    return out


def _mlp_shapes(family: str, s: TinyShape, i: int) -> list[tuple[str, tuple[int, ...]]]:
    # E experts, I one expert's width, F dense MLP width, S shared expert's width
    D, E, I = s.hidden_size, s.num_experts, s.moe_intermediate_size
    p = f"model.layers.{i}."
    if family == "mixtral":
        b = p + "block_sparse_moe."
        out = [(b + "gate.weight", (E, D))]
        for e in range(E):    # w1 gate, w3 up, w2 down
            out += [(f"{b}experts.{e}.w1.weight", (I, D)), (f"{b}experts.{e}.w2.weight", (D, I)),
                    (f"{b}experts.{e}.w3.weight", (I, D))]
        return out
    m = p + "mlp."
    if not s.is_moe_layer(i):
        F = s.intermediate_size
        return [(m + "gate_proj.weight", (F, D)), (m + "up_proj.weight", (F, D)),
                (m + "down_proj.weight", (D, F))]
    out = [(m + "gate.weight", (E, D))]
    for e in range(E):
        out += [(f"{m}experts.{e}.gate_proj.weight", (I, D)), (f"{m}experts.{e}.up_proj.weight", (I, D)),
                (f"{m}experts.{e}.down_proj.weight", (D, I))]
    if family == "qwen2_moe":
        S = s.shared_expert_intermediate_size
        out += [(m + "shared_expert.gate_proj.weight", (S, D)), (m + "shared_expert.up_proj.weight", (S, D)),
                (m + "shared_expert.down_proj.weight", (D, S)), (m + "shared_expert_gate.weight", (1, D))]
    return out


def init_weights(shapes: list[tuple[str, tuple[int, ...]]], seed: int, dtype: torch.dtype,
                 float32_suffixes: tuple[str, ...] = ()) -> dict:
    """Draw every tensor from one seeded generator, in float32, then cast to dtype, except the
    names ending in float32_suffixes (router tensors some hubs keep in float32).

    Biases (linear, router, correction: every name ending in "bias") 0.1 N(0, 1); embeddings and
    attention sinks N(0, 1); weights fan-in scaled, where gpt-oss' fused experts, stored as
    x @ W ([E, in, out]), have their fan-in on dim -2."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes:
        x = torch.randn(shape, generator=g, dtype=torch.float32)
        if "norm" in name:
            x = 1 + 0.1 * x
        elif name.endswith("bias"):
            x = 0.1 * x
        elif name.endswith(("embed_tokens.weight", ".sinks")):
            pass
        else:
            is_router = name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight",
                                       ".mlp.router.weight"))
            fan_in = shape[-2] if name.endswith(("experts.gate_up_proj", "experts.down_proj")) else shape[-1]
            x = x * ((ROUTER_STD_SCALE if is_router else 1.0) / math.sqrt(fan_in))
        tensors[name] = x.to(torch.float32 if name.endswith(float32_suffixes) else dtype).contiguous()
    return tensors


def write_safetensors(out: Path, tensors: dict, max_shard_mb: float | None) -> None:
    """model.safetensors, or model-0000k-of-0000n.safetensors + index when max_shard_mb is set.

    Shards fill in module order; a tensor larger than the limit gets a shard of its own.
    """
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)   # a rewrite must not leave an old layout's shards behind
    meta = {"format": "pt"}
    if max_shard_mb is None:
        save_file(tensors, out / "model.safetensors", metadata=meta)
        return
    limit = max_shard_mb * 1e6
    shards, size = [[]], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map = {}
    for k, names in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, out / fname, metadata=meta)
        weight_map.update({n: fname for n in names})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(out / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})


def skew_routers(model_dir, seed: int = 0) -> None:
    """Rewrite every router (mlp.gate.weight) of a checkpoint in place so expert popularity is
    skewed: row e scaled by 1 + 2 / rank(e)**0.8 over a random expert order per layer (a
    Zipf-like law). Random weights otherwise route almost uniformly, where no cache policy
    can beat another; the benches use this for their "skewed" routing."""
    from safetensors.torch import load_file
    g = torch.Generator().manual_seed(seed)
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors = load_file(f)
        for k, t in tensors.items():
            if k.endswith("mlp.gate.weight"):
                order = torch.randperm(t.shape[0], generator=g)
                ranks = torch.empty(t.shape[0])
                ranks[order] = torch.arange(1, t.shape[0] + 1, dtype=torch.float32)
                tensors[k] = (t.float() * (1 + 2 / ranks.pow(0.8))[:, None]).to(t.dtype)
        save_file(tensors, f, metadata={"format": "pt"})


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
