"""Qwen2-MoE (Qwen2MoeForCausalLM): attention with q/k/v bias, no q/k norm; sparse layers
chosen by mlp_only_layers / decoder_sparse_step; router softmax -> top-k -> optional
renormalisation (norm_topk_prob), weights cast to the model dtype; every sparse layer adds a
shared expert scaled by sigmoid(shared_expert_gate(x)).
"""

from __future__ import annotations

import dataclasses

from freetoken.models.config import ConfigReader, ModelConfig
from freetoken.models.layers import (Attention, AttentionConfig, DecoderLayer, DenseMLP,
                                     ExpertBank, MoeForCausalLM, Router, RouterConfig,
                                     SparseMoeBlock)
from freetoken.moe.layout import ExpertLayout

ARCHITECTURES = ("Qwen2MoeForCausalLM",)
MODEL_TYPES = ("qwen2_moe",)


@dataclasses.dataclass(frozen=True)
class QwenMoeConfig(ModelConfig):
    norm_topk_prob: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    shared_expert_intermediate_size: int = 0
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1

    def is_moe_layer(self, i: int) -> bool:
        # HF's qwen2_moe/qwen3_moe rule.
        return (i not in self.mlp_only_layers and self.num_experts > 0
                and (i + 1) % self.decoder_sparse_step == 0)


def parse_qwen(raw: dict, model_dir, qk_norm: bool, attention_bias: bool) -> QwenMoeConfig:
    r = ConfigReader(raw, model_dir)
    return r.build(
        QwenMoeConfig,
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        # Older Qwen2 configs carry no qkv_bias field: Qwen2 attention always had biases.
        attention_bias=bool(raw.get("attention_bias", raw.get("qkv_bias", attention_bias))),
        qk_norm=qk_norm,
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
        mlp_only_layers=tuple(int(i) for i in (raw.get("mlp_only_layers") or ())),
        decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1))


def parse(raw: dict, model_dir) -> QwenMoeConfig:
    return parse_qwen(raw, model_dir, qk_norm=False, attention_bias=True)


def qwen_mlp(cfg: QwenMoeConfig, i: int) -> DenseMLP | SparseMoeBlock:
    """Layer i's MLP: dense, or the sparse block with its sigmoid-gated shared expert (also
    Qwen3-Next's and Qwen3.5's)."""
    if not cfg.is_moe_layer(i):
        return DenseMLP(cfg.hidden_size, cfg.intermediate_size)
    gate = Router(cfg.hidden_size, RouterConfig(
        cfg.num_experts, cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob,
        weights_in_model_dtype=True))
    experts = ExpertBank(cfg.num_experts, ExpertLayout(cfg.hidden_size, cfg.moe_intermediate_size,
                                                       gate.weight.dtype))
    shared = cfg.shared_expert_intermediate_size
    return SparseMoeBlock(gate, experts, DenseMLP(cfg.hidden_size, shared) if shared else None,
                          shared_name="shared_expert", shared_gate=bool(shared))


def qwen_layer(cfg: QwenMoeConfig, i: int, rope) -> DecoderLayer:
    attn = Attention(AttentionConfig(
        cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
        cfg.rms_norm_eps, qkv_bias=cfg.attention_bias,
        qk_norm="head" if cfg.qk_norm else None), i, rope)
    return DecoderLayer(attn, qwen_mlp(cfg, i), cfg.hidden_size, cfg.rms_norm_eps)


class Qwen2MoeForCausalLM(MoeForCausalLM):
    def __init__(self, cfg: QwenMoeConfig):
        super().__init__(cfg, qwen_layer)


MODEL_CLASS = Qwen2MoeForCausalLM
