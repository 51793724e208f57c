"""Mixtral (MixtralForCausalLM): GQA attention without bias or q/k norm; every layer is
sparse under the name `block_sparse_moe` with experts w1 (gate), w3 (up), w2 (down); the
router always renormalises its top-k and keeps the weights in float32.
"""

from freetoken.models.config import ModelConfig, parse_config
from freetoken.models.layers import DecoderLayer, MoeForCausalLM, SparseMoeBlock

ARCHITECTURES = ("MixtralForCausalLM",)
MODEL_TYPES = ("mixtral",)


def parse(raw: dict, model_dir) -> ModelConfig:
    raw = {k: v for k, v in raw.items() if k not in ("mlp_only_layers", "decoder_sparse_step")}
    return parse_config(raw, model_dir, family_defaults={
        "qk_norm": False, "attention_bias": False, "norm_topk_prob": True,
        "rms_norm_eps": 1e-5, "shared_expert_intermediate_size": 0})


def make_layer(cfg: ModelConfig, i: int) -> DecoderLayer:
    moe = SparseMoeBlock(cfg, renormalize=True, weights_in_model_dtype=False)
    return DecoderLayer(cfg, i, moe, mlp_name="block_sparse_moe")


class MixtralForCausalLM(MoeForCausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, make_layer)


MODEL_CLASS = MixtralForCausalLM
