"""GLM-4.5 / 4.6 / 4.7 (Glm4MoeForCausalLM): attention with optional q/k/v bias and per-head
q/k norm, partial rotary (partial_rotary_factor, 0.5); the first `first_k_dense_replace`
layers dense; the others a sigmoid router with a selection bias, group-limited top-k,
renormalisation and routed_scaling_factor, computed in float32, plus ungated shared experts.
The checkpoint's MTP layers (`model.layers.{num_hidden_layers + j}`) are skipped knowingly.
"""

from __future__ import annotations

import dataclasses

from freetoken.models.config import ConfigReader, ModelConfig
from freetoken.models.key_map import KeyMap
from freetoken.models.layers import (Attention, AttentionConfig, DecoderLayer, DenseMLP,
                                     ExpertBank, MoeForCausalLM, Router, RouterConfig,
                                     SparseMoeBlock)
from freetoken.moe.layout import ExpertLayout

ARCHITECTURES = ("Glm4MoeForCausalLM",)
MODEL_TYPES = ("glm4_moe",)


@dataclasses.dataclass(frozen=True)
class Glm4MoeConfig(ModelConfig):
    first_k_dense_replace: int = 1
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    attention_bias: bool = False
    use_qk_norm: bool = False
    num_nextn_predict_layers: int = 0


def parse(raw: dict, model_dir) -> Glm4MoeConfig:
    r = ConfigReader(raw, model_dir, {"rms_norm_eps": 1e-5})
    return r.build(
        Glm4MoeConfig,
        first_k_dense_replace=int(raw.get("first_k_dense_replace", 1)),
        n_shared_experts=int(raw.get("n_shared_experts") or 0),
        n_group=int(raw.get("n_group") or 1), topk_group=int(raw.get("topk_group") or 1),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        attention_bias=bool(raw.get("attention_bias", False)),
        use_qk_norm=bool(raw.get("use_qk_norm", False)),
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0))


def make_layer(cfg: Glm4MoeConfig, i: int, rope) -> DecoderLayer:
    attn = Attention(AttentionConfig(
        cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
        cfg.rms_norm_eps, qkv_bias=cfg.attention_bias,
        qk_norm="head" if cfg.use_qk_norm else None), i, rope)
    mlp = (grouped_sigmoid_moe(cfg) if i >= cfg.first_k_dense_replace
           else DenseMLP(cfg.hidden_size, cfg.intermediate_size))
    return DecoderLayer(attn, mlp, cfg.hidden_size, cfg.rms_norm_eps)


def grouped_sigmoid_moe(cfg) -> SparseMoeBlock:
    """DeepSeek-V3's routed block, which GLM-4.5 shares (deepseek_v3.py uses it too): sigmoid
    scores with a selection bias, group-limited top-k, routed_scaling_factor, and
    n_shared_experts shared experts fused into one MLP."""
    gate = Router(cfg.hidden_size, RouterConfig(
        cfg.num_experts, cfg.num_experts_per_tok, scoring="sigmoid", selection_bias=True,
        renormalize=cfg.norm_topk_prob, n_group=cfg.n_group, topk_group=cfg.topk_group,
        scale=cfg.routed_scaling_factor, float32=True))
    experts = ExpertBank(cfg.num_experts, ExpertLayout(cfg.hidden_size, cfg.moe_intermediate_size,
                                                       gate.weight.dtype))
    width = cfg.moe_intermediate_size * cfg.n_shared_experts
    shared = DenseMLP(cfg.hidden_size, width) if width else None
    return SparseMoeBlock(gate, experts, shared)


def skip_mtp_layers(num_layers: int, num_mtp: int) -> KeyMap:
    """The multi-token-prediction layers stored after the last decoder layer
    (model.layers.{num_layers}..): weights for speculative decoding, skipped knowingly."""
    return KeyMap(skip=tuple(rf"^model\.layers\.{j}\." for j in range(num_layers, num_layers + num_mtp)))


def KEY_MAP(cfg: Glm4MoeConfig) -> KeyMap:
    return skip_mtp_layers(cfg.num_hidden_layers, cfg.num_nextn_predict_layers)


class Glm4MoeForCausalLM(MoeForCausalLM):
    def __init__(self, cfg: Glm4MoeConfig):
        super().__init__(cfg, make_layer)


MODEL_CLASS = Glm4MoeForCausalLM
