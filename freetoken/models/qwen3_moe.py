"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen2-MoE's layers with per-head q/k RMSNorm, no
attention bias and no shared expert.
"""

from freetoken.models.layers import MoeForCausalLM
from freetoken.models.qwen2_moe import QwenMoeConfig, parse_qwen, qwen_layer

ARCHITECTURES = ("Qwen3MoeForCausalLM",)
MODEL_TYPES = ("qwen3_moe",)


def parse(raw: dict, model_dir) -> QwenMoeConfig:
    return parse_qwen(raw, model_dir, qk_norm=True, attention_bias=False)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    def __init__(self, cfg: QwenMoeConfig):
        super().__init__(cfg, qwen_layer)


MODEL_CLASS = Qwen3MoeForCausalLM
