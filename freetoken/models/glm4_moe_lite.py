"""GLM-4.7-Flash (Glm4MoeLiteForCausalLM): DeepSeek-V3's architecture under GLM's names (see
deepseek_v3.py): multi-head latent attention, sigmoid grouped routing with a selection bias
and shared experts; which layers are dense comes from `mlp_layer_types` (or
first_k_dense_replace). The MTP layer (`model.layers.{num_hidden_layers}`) is skipped knowingly.
"""

from freetoken.models import deepseek_v3
from freetoken.models.deepseek_v3 import KEY_MAP, DeepseekV3Config, make_layer
from freetoken.models.layers import MoeForCausalLM

ARCHITECTURES = ("Glm4MoeLiteForCausalLM",)
MODEL_TYPES = ("glm4_moe_lite",)


def parse(raw: dict, model_dir) -> DeepseekV3Config:
    if raw.get("mlp_layer_types") is None and raw.get("first_k_dense_replace") is None:
        raw = {**raw, "first_k_dense_replace": 1}       # GLM's default: layer 0 dense
    return deepseek_v3.parse(raw, model_dir)


class Glm4MoeLiteForCausalLM(MoeForCausalLM):
    def __init__(self, cfg: DeepseekV3Config):
        super().__init__(cfg, make_layer)


MODEL_CLASS = Glm4MoeLiteForCausalLM
__all__ = ["ARCHITECTURES", "MODEL_TYPES", "KEY_MAP", "MODEL_CLASS", "parse"]
