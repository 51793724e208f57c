"""ModelConfig: the fields of a Hugging Face config.json that every family has and the engine
reads. Each family extends it with a frozen dataclass of its own fields (in its own file) and
parses config.json with a ConfigReader.

Hugging Face renamed fields across versions (rope_theta -> rope_parameters, num_experts vs
num_local_experts), so reading accepts several spellings and validates the result once.
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
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: dict                      # rope_type, rope_theta and the type's parameters
    torch_dtype: str                # the checkpoint's dtype name, e.g. "bfloat16"
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None


class ConfigReader:
    """Typed reads of config.json with a family's defaults; errors name the folder and field."""

    def __init__(self, raw: dict, model_dir: Path, defaults: dict | None = None):
        self.raw, self.model_dir, self.defaults = raw, Path(model_dir), defaults or {}

    def get(self, name: str, *aliases: str, default=None):
        for key in (name, *aliases):
            if self.raw.get(key) is not None:
                return self.raw[key]
        if name in self.defaults:
            return self.defaults[name]
        if default is not None:
            return default
        raise ModelConfigError(f"config.json in {self.model_dir} lacks {name!r}")

    def common(self, **overrides) -> dict:
        """The ModelConfig fields, as keyword arguments; overrides win and are not read."""
        raw = self.raw
        heads = lambda: int(self.get("num_attention_heads"))        # noqa: E731
        fields = dict(
            model_type=lambda: raw.get("model_type", ""),
            architectures=lambda: tuple(raw.get("architectures") or ()),
            vocab_size=lambda: int(self.get("vocab_size")),
            hidden_size=lambda: int(self.get("hidden_size")),
            num_hidden_layers=lambda: int(self.get("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=lambda: int(self.get("num_key_value_heads", default=heads())),
            head_dim=lambda: int(raw.get("head_dim") or int(self.get("hidden_size")) // heads()),
            intermediate_size=lambda: int(self.get("intermediate_size")),
            moe_intermediate_size=lambda: int(self.get("moe_intermediate_size", "intermediate_size")),
            num_experts=lambda: int(self.get("num_experts", "num_local_experts", "n_routed_experts")),
            num_experts_per_tok=lambda: int(self.get("num_experts_per_tok")),
            rms_norm_eps=lambda: float(self.get("rms_norm_eps", default=1e-6)),
            max_position_embeddings=lambda: int(self.get("max_position_embeddings", default=32768)),
            tie_word_embeddings=lambda: bool(raw.get("tie_word_embeddings", self.defaults.get(
                "tie_word_embeddings", False))),
            rope=lambda: _rope(raw),
            torch_dtype=lambda: str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            eos_token_ids=lambda: _eos_ids(raw, self.model_dir),
            bos_token_id=lambda: raw.get("bos_token_id"),
        )
        return {name: overrides[name] if name in overrides else read()
                for name, read in fields.items()}

    def build(self, cls, **family_fields):
        """cls(**common, **family_fields), validated; bad values become ModelConfigError."""
        try:
            cfg = cls(**self.common(**{k: v for k, v in family_fields.items()
                                       if k in _COMMON}),
                      **{k: v for k, v in family_fields.items() if k not in _COMMON})
        except ModelConfigError:
            raise
        except (TypeError, ValueError) as e:
            raise ModelConfigError(f"bad value in {self.model_dir}/config.json: {e}") from e
        validate(cfg, self.model_dir)
        return cfg


_COMMON = {f.name for f in dataclasses.fields(ModelConfig)}


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


def validate(cfg: ModelConfig, model_dir: Path) -> None:
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
