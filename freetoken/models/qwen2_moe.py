"""Qwen2-MoE (Qwen2MoeForCausalLM): attention with q/k/v bias, no q/k norm; every sparse
layer adds a shared expert scaled by sigmoid(shared_expert_gate(x)); router as qwen3.
"""

from freetoken.models.config import ModelConfig, parse_config
from freetoken.models.layers import MoeForCausalLM, qwen_layer

ARCHITECTURES = ("Qwen2MoeForCausalLM",)
MODEL_TYPES = ("qwen2_moe",)


def parse(raw: dict, model_dir) -> ModelConfig:
    # Older configs carry no qkv_bias field: Qwen2 attention always had biases.
    return parse_config(raw, model_dir, family_defaults={
        "qk_norm": False, "attention_bias": True, "norm_topk_prob": False,
        "rms_norm_eps": 1e-6})


class Qwen2MoeForCausalLM(MoeForCausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, qwen_layer)


MODEL_CLASS = Qwen2MoeForCausalLM
