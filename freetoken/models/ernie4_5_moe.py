"""ERNIE-4.5 MoE (Ernie4_5_MoeForCausalLM): `use_bias` gives attention, the dense and shared
MLPs and lm_head biases (not the routed experts); interleaved RoPE; layers moe_layer_start_index..moe_layer_end_index (every
moe_layer_interval-th) sparse, the rest dense; a float32 softmax router whose selection bias
(`moe_statics.e_score_correction_bias` [1, E]) picks the experts, weights renormalised and
cast to the model dtype (HF floors the sum at moe_norm_min, 1e-12; the routing kernel adds
1e-20: the same for any sum of top-k probabilities); ungated shared experts.
"""

from __future__ import annotations

import dataclasses

from freetoken.models.config import ConfigReader, ModelConfig
from freetoken.models.key_map import KeyMap
from freetoken.models.layers import (Attention, AttentionConfig, DecoderLayer, DenseMLP,
                                     ExpertBank, MoeForCausalLM, Router, RouterConfig,
                                     SparseMoeBlock)
from freetoken.moe.layout import ExpertLayout

ARCHITECTURES = ("Ernie4_5_MoeForCausalLM",)
MODEL_TYPES = ("ernie4_5_moe",)


@dataclasses.dataclass(frozen=True)
class Ernie45MoeConfig(ModelConfig):
    use_bias: bool = False
    moe_num_shared_experts: int = 0
    moe_layer_start_index: int = 1
    moe_layer_end_index: int = -1
    moe_layer_interval: int = 1

    def is_moe_layer(self, i: int) -> bool:
        end = self.moe_layer_end_index
        end = self.num_hidden_layers - 1 if end < 0 else end
        return (i + 1) % self.moe_layer_interval == 0 and self.moe_layer_start_index <= i <= end


def parse(raw: dict, model_dir) -> Ernie45MoeConfig:
    r = ConfigReader(raw, model_dir, {"rms_norm_eps": 1e-5, "tie_word_embeddings": True})
    return r.build(
        Ernie45MoeConfig,
        num_experts=int(r.get("moe_num_experts", "num_experts")),
        num_experts_per_tok=int(r.get("moe_k", "num_experts_per_tok")),
        use_bias=bool(raw.get("use_bias", False)),
        moe_num_shared_experts=int(raw.get("moe_num_shared_experts") or 0),
        moe_layer_start_index=int(raw.get("moe_layer_start_index", 1)),
        moe_layer_end_index=int(raw.get("moe_layer_end_index", -1)),
        moe_layer_interval=int(raw.get("moe_layer_interval") or 1))


def make_layer(cfg: Ernie45MoeConfig, i: int, rope) -> DecoderLayer:
    attn = Attention(AttentionConfig(
        cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
        cfg.rms_norm_eps, qkv_bias=cfg.use_bias, o_bias=cfg.use_bias, rope_interleaved=True),
        i, rope)
    if not cfg.is_moe_layer(i):
        return DecoderLayer(attn, DenseMLP(cfg.hidden_size, cfg.intermediate_size, cfg.use_bias),
                            cfg.hidden_size, cfg.rms_norm_eps)
    gate = Router(cfg.hidden_size, RouterConfig(
        cfg.num_experts, cfg.num_experts_per_tok, scoring="softmax", selection_bias=True,
        renormalize=True, weights_in_model_dtype=True, float32=True))
    experts = ExpertBank(cfg.num_experts, ExpertLayout(cfg.hidden_size, cfg.moe_intermediate_size,
                                                       gate.weight.dtype))
    width = cfg.moe_intermediate_size * cfg.moe_num_shared_experts
    shared = DenseMLP(cfg.hidden_size, width, cfg.use_bias) if width else None
    return DecoderLayer(attn, SparseMoeBlock(gate, experts, shared), cfg.hidden_size,
                        cfg.rms_norm_eps)


KEY_MAP = KeyMap(renames=((r"\.mlp\.moe_statics\.e_score_correction_bias$",
                           ".mlp.gate.e_score_correction_bias"),))


class Ernie45MoeForCausalLM(MoeForCausalLM):
    def __init__(self, cfg: Ernie45MoeConfig):
        super().__init__(cfg, make_layer, lm_head_bias=cfg.use_bias)


MODEL_CLASS = Ernie45MoeForCausalLM
