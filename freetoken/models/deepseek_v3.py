"""DeepSeek-V3 / R1 / V3.1 and Kimi-K2 (DeepseekV3ForCausalLM; Kimi's config says model_type
kimi_k2): multi-head latent attention (layers/mla.py: q through a LoRA pair or one q_proj, K/V
through the kv_lora_rank latent, the only thing the cache keeps; YaRN whose mscale_all_dim also
scales the softmax); the first `first_k_dense_replace` layers dense, the others a sigmoid
router with a selection bias, group-limited top-k, renormalisation and routed_scaling_factor,
in float32, plus ungated shared experts. The MTP layer (`model.layers.{num_hidden_layers}`)
is skipped knowingly. GLM-4.7-Flash (glm4_moe_lite.py) is this architecture too.
"""

from __future__ import annotations

import dataclasses

from freetoken.models.config import ConfigReader, ModelConfig, ModelConfigError
from freetoken.models.key_map import KeyMap
from freetoken.models.glm4_moe import grouped_sigmoid_moe, skip_mtp_layers
from freetoken.models.layers import DecoderLayer, DenseMLP, MlaAttention, MlaConfig, MoeForCausalLM
from freetoken.models.rope import softmax_mscale

ARCHITECTURES = ("DeepseekV3ForCausalLM",)
MODEL_TYPES = ("deepseek_v3", "kimi_k2")


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config(ModelConfig):
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    sparse_layers: tuple[int, ...] = ()     # decoder layers with routed experts
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    attention_bias: bool = False
    rope_interleave: bool = True
    num_mtp_layers: int = 0                 # num_nextn_predict_layers: the skipped MTP layers


def parse(raw: dict, model_dir) -> DeepseekV3Config:
    r = ConfigReader(raw, model_dir, {"rms_norm_eps": 1e-6})
    for field, ours in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if raw.get(field, ours) != ours:
            raise ModelConfigError(f"config.json in {model_dir}: {field} {raw[field]!r} is not "
                                   f"supported (DeepSeek-V3 routing is {ours})")
    n_layers = int(r.get("num_hidden_layers"))
    if raw.get("mlp_layer_types") is not None:           # GLM-4.7-Flash spells it per layer
        sparse = tuple(i for i, kind in enumerate(raw["mlp_layer_types"]) if kind == "sparse")
    else:
        sparse = tuple(range(int(raw.get("first_k_dense_replace", 3) or 0), n_layers))
    q_lora = raw.get("q_lora_rank")
    return r.build(
        DeepseekV3Config,
        head_dim=int(r.get("qk_rope_head_dim")),        # the rope table's width
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(r.get("kv_lora_rank")),
        qk_nope_head_dim=int(r.get("qk_nope_head_dim")),
        qk_rope_head_dim=int(r.get("qk_rope_head_dim")),
        v_head_dim=int(r.get("v_head_dim")),
        sparse_layers=sparse,
        n_shared_experts=int(raw.get("n_shared_experts") or 0),
        n_group=int(raw.get("n_group") or 1), topk_group=int(raw.get("topk_group") or 1),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        attention_bias=bool(raw.get("attention_bias", False)),
        rope_interleave=bool(raw.get("rope_interleave", True)),
        num_mtp_layers=max(int(raw.get("num_nextn_predict_layers") or 0),
                           int(raw.get("num_mtp_layers") or 0)))


def make_layer(cfg: DeepseekV3Config, i: int, rope) -> DecoderLayer:
    attn = MlaAttention(MlaConfig(
        cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank,
        cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, bias=cfg.attention_bias,
        rope_interleaved=cfg.rope_interleave, softmax_mscale=softmax_mscale(cfg.rope)), i, rope)
    mlp = (grouped_sigmoid_moe(cfg) if i in cfg.sparse_layers
           else DenseMLP(cfg.hidden_size, cfg.intermediate_size))
    return DecoderLayer(attn, mlp, cfg.hidden_size, cfg.rms_norm_eps)


def KEY_MAP(cfg: DeepseekV3Config) -> KeyMap:
    return skip_mtp_layers(cfg.num_hidden_layers, cfg.num_mtp_layers)


class DeepseekV3ForCausalLM(MoeForCausalLM):
    def __init__(self, cfg: DeepseekV3Config):
        super().__init__(cfg, make_layer)


MODEL_CLASS = DeepseekV3ForCausalLM
