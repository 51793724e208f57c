"""Which family serves a checkpoint: keyed by config.json's `architectures`, then `model_type`."""

from types import ModuleType

from freetoken.models import (ernie4_5_moe, glm4_moe, gpt_oss, minimax_m2, mixtral, olmoe,
                              qwen2_moe, qwen3_moe)
from freetoken.models import deepseek_v3, glm4_moe_lite, qwen3_5_moe, qwen3_next

# One line a family: its module names ARCHITECTURES, MODEL_TYPES, parse, MODEL_CLASS and
# optionally KEY_MAP (how its checkpoint keys map, loader.KeyMap).
FAMILIES: tuple[ModuleType, ...] = (qwen3_moe, qwen2_moe, mixtral, olmoe, gpt_oss, glm4_moe,
                                    minimax_m2, ernie4_5_moe)
FAMILIES += (qwen3_next, qwen3_5_moe, deepseek_v3, glm4_moe_lite)


class UnsupportedModelError(ValueError):
    pass


def supported() -> list[str]:
    return [arch for fam in FAMILIES for arch in fam.ARCHITECTURES]


def family_for(raw_config: dict) -> ModuleType:
    archs = raw_config.get("architectures") or []
    for fam in FAMILIES:
        if any(a in fam.ARCHITECTURES for a in archs):
            return fam
    model_type = raw_config.get("model_type")
    for fam in FAMILIES:
        if model_type in fam.MODEL_TYPES:
            return fam
    raise UnsupportedModelError(
        f"unsupported model family (architectures={archs}, model_type={model_type!r}); "
        f"FreeToken supports: {', '.join(supported())} "
        f"(model_type {', '.join(t for f in FAMILIES for t in f.MODEL_TYPES)})")
