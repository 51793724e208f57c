"""OLMoE (OlmoeForCausalLM): every layer sparse; q/k RMSNorm across all heads at once
(q_norm [Hq*Dh], k_norm [Hk*Dh]) before RoPE, optional clip_qkv; router softmax -> top-k,
renormalised when norm_topk_prob, weights cast to the model dtype.
"""

from __future__ import annotations

import dataclasses

from freetoken.models.config import ConfigReader, ModelConfig
from freetoken.models.layers import (Attention, AttentionConfig, DecoderLayer, ExpertBank,
                                     MoeForCausalLM, Router, RouterConfig, SparseMoeBlock)
from freetoken.moe.layout import ExpertLayout

ARCHITECTURES = ("OlmoeForCausalLM",)
MODEL_TYPES = ("olmoe",)


@dataclasses.dataclass(frozen=True)
class OlmoeConfig(ModelConfig):
    norm_topk_prob: bool = False
    attention_bias: bool = False
    clip_qkv: float | None = None


def parse(raw: dict, model_dir) -> OlmoeConfig:
    r = ConfigReader(raw, model_dir, {"rms_norm_eps": 1e-5})
    clip = raw.get("clip_qkv")
    return r.build(OlmoeConfig, norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                   attention_bias=bool(raw.get("attention_bias", False)),
                   clip_qkv=None if clip is None else float(clip))


def make_layer(cfg: OlmoeConfig, i: int, rope) -> DecoderLayer:
    attn = Attention(AttentionConfig(
        cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
        cfg.rms_norm_eps, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
        qk_norm="all", clip_qkv=cfg.clip_qkv), i, rope)
    gate = Router(cfg.hidden_size, RouterConfig(
        cfg.num_experts, cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob,
        weights_in_model_dtype=True))
    experts = ExpertBank(cfg.num_experts, ExpertLayout(cfg.hidden_size, cfg.moe_intermediate_size,
                                                       gate.weight.dtype))
    return DecoderLayer(attn, SparseMoeBlock(gate, experts), cfg.hidden_size, cfg.rms_norm_eps)


class OlmoeForCausalLM(MoeForCausalLM):
    def __init__(self, cfg: OlmoeConfig):
        super().__init__(cfg, make_layer)


MODEL_CLASS = OlmoeForCausalLM
