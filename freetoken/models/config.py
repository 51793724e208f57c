"""ModelConfig: the fields of a Hugging Face config.json that FreeToken's families read.

Hugging Face renamed fields across versions (rope_theta -> rope_parameters, num_experts vs
num_local_experts), so parsing accepts both spellings and validates the result once.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


class ModelConfigError(ValueError):
    """config.json is missing, unreadable or inconsistent."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    architectures: tuple[str, ...]
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int          # dense MLP width (layers without experts)
    moe_intermediate_size: int      # one expert's width
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool            # q/k/v biases (qwen2_moe)
    qk_norm: bool                   # per-head RMSNorm on q and k (qwen3_moe)
    shared_expert_intermediate_size: int  # 0: no shared expert
    mlp_only_layers: tuple[int, ...]
    decoder_sparse_step: int
    rope: dict                      # rope_type, rope_theta and the type's parameters
    torch_dtype: str                # the checkpoint's dtype name, e.g. "bfloat16"
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    def is_moe_layer(self, layer_idx: int) -> bool:
        # The rule HF's qwen2_moe/qwen3_moe use; mixtral has every layer sparse.
        return (layer_idx not in self.mlp_only_layers and self.num_experts > 0
                and (layer_idx + 1) % self.decoder_sparse_step == 0)


def read_config_json(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"no config.json in {model_dir}: not a Hugging Face checkpoint folder")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelConfigError(f"cannot parse {path}: {e}") from e


def _eos_ids(raw: dict, model_dir: Path) -> tuple[int, ...]:
    ids: list[int] = []
    sources = [raw.get("eos_token_id")]
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        try:
            sources.insert(0, json.loads(gen.read_text()).get("eos_token_id"))
        except ValueError as e:
            raise ModelConfigError(f"cannot parse {gen}: {e}") from e
    for src in sources:
        for i in (src if isinstance(src, list) else [src]):
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)


def _rope(raw: dict) -> dict:
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params.update({k: v for k, v in scaling.items() if k not in params})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in raw:
        params.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
    return params


def parse_config(raw: dict, model_dir: Path, *, family_defaults: dict) -> ModelConfig:
    """Build a ModelConfig from config.json, with the family's defaults for absent fields."""
    def get(name, *aliases, default=None):
        for key in (name, *aliases):
            if raw.get(key) is not None:
                return raw[key]
        if name in family_defaults:
            return family_defaults[name]
        if default is not None:
            return default
        raise ModelConfigError(f"config.json in {model_dir} lacks {name!r}")

    try:
        hidden = int(get("hidden_size"))
        heads = int(get("num_attention_heads"))
        head_dim = raw.get("head_dim") or hidden // heads
        cfg = ModelConfig(
            model_type=raw.get("model_type", ""),
            architectures=tuple(raw.get("architectures") or ()),
            vocab_size=int(get("vocab_size")),
            hidden_size=hidden,
            num_hidden_layers=int(get("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(get("num_key_value_heads", default=heads)),
            head_dim=int(head_dim),
            intermediate_size=int(get("intermediate_size")),
            moe_intermediate_size=int(get("moe_intermediate_size", "intermediate_size")),
            num_experts=int(get("num_experts", "num_local_experts")),
            num_experts_per_tok=int(get("num_experts_per_tok")),
            norm_topk_prob=bool(get("norm_topk_prob", default=False)),
            rms_norm_eps=float(get("rms_norm_eps", default=1e-6)),
            max_position_embeddings=int(get("max_position_embeddings", default=32768)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(get("attention_bias", "qkv_bias", default=False)),
            qk_norm=bool(family_defaults.get("qk_norm", False)),
            shared_expert_intermediate_size=int(get("shared_expert_intermediate_size", default=0) or 0),
            mlp_only_layers=tuple(int(i) for i in (raw.get("mlp_only_layers") or ())),
            decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
            rope=_rope(raw),
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            eos_token_ids=_eos_ids(raw, model_dir),
            bos_token_id=raw.get("bos_token_id"),
        )
    except (TypeError, ValueError) as e:
        if isinstance(e, ModelConfigError):
            raise
        raise ModelConfigError(f"bad value in {model_dir}/config.json: {e}") from e
    _validate(cfg, model_dir)
    return cfg


def _validate(cfg: ModelConfig, model_dir: Path) -> None:
    problems = []
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        problems.append("num_attention_heads must be a multiple of num_key_value_heads")
    if not 0 < cfg.num_experts_per_tok <= max(cfg.num_experts, 1):
        problems.append("num_experts_per_tok must be in 1..num_experts")
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "head_dim"):
        if getattr(cfg, name) <= 0:
            problems.append(f"{name} must be positive")
    if problems:
        raise ModelConfigError(f"inconsistent config.json in {model_dir}: " + "; ".join(problems))
