"""Qwen3-Next (Qwen3NextForCausalLM): hybrid layers, `layer_types` (or every
full_attention_interval-th layer) full attention, the rest Gated DeltaNet linear attention
(layers/linear_attention.py) with Qwen3-Next's fused per-key-head projections. The full
attention is gated (q_proj also yields a sigmoid output gate), with zero-centred per-head q/k
norms and partial rotary (partial_rotary_factor, 0.25 by default); every norm outside the
DeltaNet's gated one is zero-centred (scale 1 + w). The MLP is Qwen2-MoE's: softmax top-k,
experts and a sigmoid-gated shared expert. Qwen3.5/3.6-MoE (qwen3_5_moe.py) is this model with
split projections and always-renormalised routing.
"""

from __future__ import annotations

import dataclasses

from freetoken.models.config import ConfigReader, _rope
from freetoken.models.key_map import KeyMap
from freetoken.models.layers import (Attention, AttentionConfig, DecoderLayer, GatedDeltaNet,
                                     LinearAttentionConfig, MoeForCausalLM)
from freetoken.models.qwen2_moe import QwenMoeConfig, qwen_mlp

ARCHITECTURES = ("Qwen3NextForCausalLM",)
MODEL_TYPES = ("qwen3_next",)
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class HybridConfig(QwenMoeConfig):
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    fused_projections: bool = True      # Qwen3-Next: in_proj_qkvz / in_proj_ba

    def __post_init__(self):
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - set(LAYER_TYPES):
            raise ValueError(f"layer_types must name {self.num_hidden_layers} layers, each one of "
                             f"{', '.join(LAYER_TYPES)}; got {list(self.layer_types)}")


def parse_hybrid(raw: dict, model_dir, fused: bool, **overrides) -> HybridConfig:
    r = ConfigReader(raw, model_dir)
    n = int(r.get("num_hidden_layers"))
    every = int(raw.get("full_attention_interval") or 4)
    types = tuple(raw.get("layer_types") or ("full_attention" if (i + 1) % every == 0
                                             else "linear_attention" for i in range(n)))
    rope = _rope(raw)
    rope.setdefault("partial_rotary_factor", 0.25)     # HF's default for these families
    fields = dict(
        rope=rope, layer_types=types,
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        attention_bias=bool(raw.get("attention_bias", False)), qk_norm=True,
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
        mlp_only_layers=tuple(int(i) for i in (raw.get("mlp_only_layers") or ())),
        decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
        linear_num_key_heads=int(r.get("linear_num_key_heads", default=16)),
        linear_num_value_heads=int(r.get("linear_num_value_heads", default=32)),
        linear_key_head_dim=int(r.get("linear_key_head_dim", default=128)),
        linear_value_head_dim=int(r.get("linear_value_head_dim", default=128)),
        linear_conv_kernel_dim=int(r.get("linear_conv_kernel_dim", default=4)),
        fused_projections=fused)
    return r.build(HybridConfig, **{**fields, **overrides})


def parse(raw: dict, model_dir) -> HybridConfig:
    return parse_hybrid(raw, model_dir, fused=True)


def make_layer(cfg: HybridConfig, i: int, rope) -> DecoderLayer:
    if cfg.layer_types[i] == "linear_attention":
        mixer, name = GatedDeltaNet(LinearAttentionConfig(
            cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
            cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim,
            cfg.rms_norm_eps, fused_projections=cfg.fused_projections), i), "linear_attn"
    else:
        mixer, name = Attention(AttentionConfig(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.rms_norm_eps, qkv_bias=cfg.attention_bias, qk_norm="head", output_gate=True,
            qk_norm_offset=1.0), i, rope), "self_attn"
    return DecoderLayer(mixer, qwen_mlp(cfg, i), cfg.hidden_size, cfg.rms_norm_eps,
                        attn_name=name, norm_offset=1.0)


# The hub's checkpoints carry an MTP head (mtp.*), which a plain decode does not use.
KEY_MAP = KeyMap(skip=(r"^mtp\.",))


class Qwen3NextForCausalLM(MoeForCausalLM):
    def __init__(self, cfg: HybridConfig):
        super().__init__(cfg, make_layer, norm_offset=1.0)


MODEL_CLASS = Qwen3NextForCausalLM
