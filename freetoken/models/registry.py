"""Which family serves a checkpoint: keyed by config.json's `architectures`, then `model_type`."""

from types import ModuleType

from freetoken.models import mixtral, qwen2_moe, qwen3_moe

FAMILIES: tuple[ModuleType, ...] = (qwen3_moe, qwen2_moe, mixtral)


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
