"""Qwen3-MoE (Qwen3MoeForCausalLM): GQA attention with per-head q/k RMSNorm and no bias;
sparse layers chosen by mlp_only_layers / decoder_sparse_step; router softmax -> top-k ->
optional renormalisation (norm_topk_prob), weights cast to the model dtype.
"""

from freetoken.models.config import ModelConfig, parse_config
from freetoken.models.layers import MoeForCausalLM, qwen_layer

ARCHITECTURES = ("Qwen3MoeForCausalLM",)
MODEL_TYPES = ("qwen3_moe",)


def parse(raw: dict, model_dir) -> ModelConfig:
    return parse_config(raw, model_dir, family_defaults={
        "qk_norm": True, "attention_bias": False, "norm_topk_prob": False,
        "rms_norm_eps": 1e-6})


class Qwen3MoeForCausalLM(MoeForCausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, qwen_layer)


MODEL_CLASS = Qwen3MoeForCausalLM
