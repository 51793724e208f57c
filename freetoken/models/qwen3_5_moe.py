"""Qwen3.5-MoE and Qwen3.6-MoE (Qwen3_5MoeForConditionalGeneration, the released checkpoints;
also the text-only Qwen3_5MoeForCausalLM): Qwen3-Next's hybrid model (qwen3_next.py) with
split DeltaNet projections (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), every layer sparse,
top-k weights always renormalised.

The released checkpoints wrap the text model in a vision-language one: config.json nests its
fields in `text_config`, keys start `model.language_model.`, experts are pre-fused
(experts.gate_up_proj [E, 2I, D], experts.down_proj [E, D, I], transformers v5's layout), and
there are a vision tower (`model.visual.*`) and an MTP head (`mtp.*`), both skipped by this
text-only server. Text positions are plain 1-D RoPE (their 3-D mRoPE sections coincide).
"""

from __future__ import annotations

import logging

from freetoken.models.key_map import KeyMap
from freetoken.models.layers import MoeForCausalLM
from freetoken.models.qwen3_next import HybridConfig, make_layer, parse_hybrid

ARCHITECTURES = ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM")
MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")

log = logging.getLogger("freetoken.models")


def text_config(raw: dict) -> dict:
    """The text model's fields: `text_config` over the wrapper's own (architectures, dtype,
    token ids), or the config itself for a text-only checkpoint."""
    if "text_config" not in raw:
        return raw
    outer = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
    return {**outer, **raw["text_config"], "architectures": raw.get("architectures"),
            "model_type": raw.get("model_type")}


def parse(raw: dict, model_dir) -> HybridConfig:
    if raw.get("vision_config") is not None:
        log.info("%s: serving text only; the vision tower (model.visual.*) is not loaded",
                 model_dir)
    text = text_config(raw)
    return parse_hybrid(text, model_dir, fused=False, norm_topk_prob=True, mlp_only_layers=(),
                        decoder_sparse_step=1,
                        intermediate_size=int(text.get("intermediate_size")
                                              or text.get("moe_intermediate_size") or 0))


KEY_MAP = KeyMap(renames=((r"^model\.language_model\.", "model."),),
                 skip=(r"^mtp\.", r"^model\.visual\."))


class Qwen3_5MoeForCausalLM(MoeForCausalLM):
    def __init__(self, cfg: HybridConfig):
        super().__init__(cfg, make_layer, norm_offset=1.0)


MODEL_CLASS = Qwen3_5MoeForCausalLM
