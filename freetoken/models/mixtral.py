"""Mixtral (MixtralForCausalLM): GQA attention without bias or q/k norm; every layer is
sparse under the name `block_sparse_moe` with experts w1 (gate), w3 (up), w2 (down); the
router always renormalises its top-k and keeps the weights in float32.
"""

from freetoken.models.config import ConfigReader, ModelConfig
from freetoken.models.layers import (Attention, AttentionConfig, DecoderLayer, ExpertBank,
                                     MoeForCausalLM, Router, RouterConfig, SparseMoeBlock)
from freetoken.moe.layout import ExpertLayout

ARCHITECTURES = ("MixtralForCausalLM",)
MODEL_TYPES = ("mixtral",)


def parse(raw: dict, model_dir) -> ModelConfig:
    return ConfigReader(raw, model_dir, {"rms_norm_eps": 1e-5}).build(ModelConfig)


def make_layer(cfg: ModelConfig, i: int, rope) -> DecoderLayer:
    attn = Attention(AttentionConfig(cfg.hidden_size, cfg.num_attention_heads,
                                     cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps),
                     i, rope)
    gate = Router(cfg.hidden_size, RouterConfig(cfg.num_experts, cfg.num_experts_per_tok,
                                                renormalize=True))
    experts = ExpertBank(cfg.num_experts, ExpertLayout(cfg.hidden_size, cfg.moe_intermediate_size,
                                                       gate.weight.dtype))
    return DecoderLayer(attn, SparseMoeBlock(gate, experts), cfg.hidden_size, cfg.rms_norm_eps,
                        mlp_name="block_sparse_moe")


class MixtralForCausalLM(MoeForCausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, make_layer)


MODEL_CLASS = MixtralForCausalLM
