"""gpt-oss (GptOssForCausalLM): every layer sparse; attention with q/k/v and o biases, a
learned sink logit per head, and a 128-token sliding window on the layers `layer_types`
marks "sliding_attention" (the others attend to everything); YaRN RoPE. The router has a
bias and takes softmax over its top-k logits; experts have biases and the clamped SwiGLU
(gate clamped above at `swiglu_limit`, up to +-limit, (up + 1) * gate * sigmoid(1.702 gate)).

The checkpoint stores each layer's experts fused and transposed, gate and up interleaved:
gate_up_proj [E, D, 2I] (even columns gate, odd up), down_proj [E, I, D], biases beside;
KEY_MAP turns them into the bank's [E, 2I, D] / [E, D, I] at load. The released checkpoints
keep the experts in MXFP4 (`_blocks` [E, R, K/32, 16] / `_scales`, rows interleaved the same
way): freetoken.models.quant keeps them so, de-interleaved into the bank's w13.
"""

from __future__ import annotations

import dataclasses

import torch

from freetoken.models.config import ConfigReader, ModelConfig
from freetoken.models.layers import (Attention, AttentionConfig, DecoderLayer, ExpertBank,
                                     MoeForCausalLM, Router, RouterConfig, SparseMoeBlock)
from freetoken.models.key_map import KeyMap
from freetoken.moe.layout import ExpertLayout

ARCHITECTURES = ("GptOssForCausalLM",)
MODEL_TYPES = ("gpt_oss",)


@dataclasses.dataclass(frozen=True)
class GptOssConfig(ModelConfig):
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 128
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


def parse(raw: dict, model_dir) -> GptOssConfig:
    r = ConfigReader(raw, model_dir, {"rms_norm_eps": 1e-5})
    layers = int(r.get("num_hidden_layers"))
    types = tuple(raw.get("layer_types") or ("sliding_attention" if i % 2 == 0 else
                                             "full_attention" for i in range(layers)))
    return r.build(GptOssConfig, layer_types=types,
                   sliding_window=int(r.get("sliding_window", default=128)),
                   swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
                   swiglu_limit=float(raw.get("swiglu_limit", 7.0)))


def make_layer(cfg: GptOssConfig, i: int, rope) -> DecoderLayer:
    window = cfg.sliding_window if cfg.layer_types[i] == "sliding_attention" else None
    attn = Attention(AttentionConfig(
        cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
        cfg.rms_norm_eps, qkv_bias=True, o_bias=True, sliding_window=window, sinks=True), i, rope)
    # Softmax over the top-k logits = the renormalised top-k of the softmax.
    gate = Router(cfg.hidden_size, RouterConfig(
        cfg.num_experts, cfg.num_experts_per_tok, renormalize=True, logit_bias=True,
        weights_in_model_dtype=True))
    experts = ExpertBank(cfg.num_experts, ExpertLayout(
        cfg.hidden_size, cfg.moe_intermediate_size, gate.weight.dtype, bias=True,
        activation="swiglu_oai", alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit))
    return DecoderLayer(attn, SparseMoeBlock(gate, experts), cfg.hidden_size, cfg.rms_norm_eps)


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Even entries (gate) then odd ones (up) along dim."""
    idx = torch.arange(t.shape[dim])
    return torch.cat([t.index_select(dim, idx[0::2]), t.index_select(dim, idx[1::2])], dim)


def fused_experts(leaf: str, t: torch.Tensor) -> dict[str, torch.Tensor] | None:
    if leaf == "gate_up_proj":          # [E, D, 2I] interleaved -> [E, 2I, D] gate rows, up rows
        return {"w13": _deinterleave(t.transpose(1, 2), 1).contiguous()}
    if leaf == "gate_up_proj_bias":     # [E, 2I] interleaved
        return {"b13": _deinterleave(t, 1)}
    if leaf == "down_proj":             # [E, I, D] -> [E, D, I]
        return {"w2": t.transpose(1, 2).contiguous()}
    if leaf == "down_proj_bias":
        return {"b2": t}
    return None


KEY_MAP = KeyMap(renames=((r"\.mlp\.router\.", ".mlp.gate."),), fused_experts=fused_experts)


class GptOssForCausalLM(MoeForCausalLM):
    def __init__(self, cfg: GptOssConfig):
        super().__init__(cfg, make_layer)


MODEL_CLASS = GptOssForCausalLM
