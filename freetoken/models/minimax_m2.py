"""MiniMax-M2 / M2.5 (MiniMaxM2ForCausalLM): every layer sparse under `block_sparse_moe`
(experts w1 gate, w3 up, w2 down); q/k RMSNorm across all heads at once (q_norm [Hq*Dh]);
partial rotary (the released configs' `rotary_dim`); a sigmoid router whose selection bias
sits beside it (`block_sparse_moe.e_score_correction_bias`), renormalised top-k.
"""

from __future__ import annotations

from freetoken.models.config import ConfigReader, ModelConfig
from freetoken.models.key_map import KeyMap
from freetoken.models.layers import (Attention, AttentionConfig, DecoderLayer, ExpertBank,
                                     MoeForCausalLM, Router, RouterConfig, SparseMoeBlock)
from freetoken.moe.layout import ExpertLayout

ARCHITECTURES = ("MiniMaxM2ForCausalLM",)
MODEL_TYPES = ("minimax_m2",)


def parse(raw: dict, model_dir) -> ModelConfig:
    r = ConfigReader(raw, model_dir)
    common = r.common()
    rotary_dim = raw.get("rotary_dim")
    if rotary_dim is not None:          # the released configs' spelling of partial rotary
        common["rope"] = {**common["rope"], "partial_rotary_factor":
                          int(rotary_dim) / common["head_dim"]}
    return r.build(ModelConfig, rope=common["rope"])


def make_layer(cfg: ModelConfig, i: int, rope) -> DecoderLayer:
    attn = Attention(AttentionConfig(
        cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
        cfg.rms_norm_eps, qk_norm="all"), i, rope)
    gate = Router(cfg.hidden_size, RouterConfig(
        cfg.num_experts, cfg.num_experts_per_tok, scoring="sigmoid", selection_bias=True,
        renormalize=True))
    experts = ExpertBank(cfg.num_experts, ExpertLayout(cfg.hidden_size, cfg.moe_intermediate_size,
                                                       gate.weight.dtype))
    return DecoderLayer(attn, SparseMoeBlock(gate, experts), cfg.hidden_size, cfg.rms_norm_eps,
                        mlp_name="block_sparse_moe")


KEY_MAP = KeyMap(renames=((r"\.block_sparse_moe\.e_score_correction_bias$",
                           ".block_sparse_moe.gate.e_score_correction_bias"),))


class MiniMaxM2ForCausalLM(MoeForCausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, make_layer)


MODEL_CLASS = MiniMaxM2ForCausalLM
