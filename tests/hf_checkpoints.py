"""Tiny checkpoints written by transformers' own classes (save_pretrained), for parity tests.

transformers initialises weights with std 0.02, which at these sizes gives nearly uniform
logits and router probabilities: two correct implementations could then pick different
greedy tokens or experts on float noise. Weights are redrawn with fan-in scaling (routers
wider still) so decisions are well separated and a mismatch means a real bug.
"""

import functools
import math
from pathlib import Path

import torch

VARIANTS = {
    # family -> variant name -> config kwargs
    "qwen3_moe": {
        "gqa_norm_topk": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              norm_topk_prob=True, num_experts=8, num_experts_per_tok=2),
        "mha_odd_tied_dense": dict(num_attention_heads=3, num_key_value_heads=3, head_dim=24,
                                   norm_topk_prob=False, tie_word_embeddings=True,
                                   mlp_only_layers=[1], num_experts=6, num_experts_per_tok=3),
        "sparse_step_gqa3": dict(num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                                 decoder_sparse_step=2, num_hidden_layers=3, num_experts=16,
                                 num_experts_per_tok=4, norm_topk_prob=True),
    },
    "mixtral": {
        "gqa": dict(num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                    num_experts_per_tok=2),
        "odd_heads_tied": dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=1,
                               tie_word_embeddings=True, num_local_experts=5, num_experts_per_tok=2),
        "mha_top1": dict(num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
                         num_experts_per_tok=1),
    },
    "qwen2_moe": {
        "gqa_shared": dict(num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                           num_experts_per_tok=2, norm_topk_prob=False),
        "mha_odd_norm_tied": dict(hidden_size=80, num_attention_heads=5, num_key_value_heads=5,
                                  num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
                                  tie_word_embeddings=True),
        "dense_mixed": dict(num_attention_heads=4, num_key_value_heads=1, mlp_only_layers=[0],
                            decoder_sparse_step=2, num_hidden_layers=3, num_experts=4,
                            num_experts_per_tok=2),
    },
}

BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            max_position_embeddings=512, rms_norm_eps=1e-6)
FAMILY_BASE = {
    "qwen3_moe": dict(moe_intermediate_size=32),
    "mixtral": dict(),
    "qwen2_moe": dict(moe_intermediate_size=32, shared_expert_intermediate_size=48),
}


def hf_classes(family):
    import transformers as tf
    return {
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
        "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
    }[family]


def redraw_weights(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1]
                router = name.endswith("mlp.gate.weight") or name.endswith("block_sparse_moe.gate.weight")
                std = (4.0 if router else 1.0) / math.sqrt(fan_in)
                p.copy_(std * torch.randn(p.shape, generator=g))


def make_hf_checkpoint(out: Path, family: str, variant: str, seed: int = 0,
                       dtype=torch.float32) -> Path:
    cfg_cls, model_cls = hf_classes(family)
    kwargs = {**BASE, **FAMILY_BASE[family], **VARIANTS[family][variant]}
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kwargs))
    redraw_weights(model, seed)
    model.to(dtype).save_pretrained(out)
    return out


@functools.lru_cache(maxsize=None)
def cached_checkpoint(root: str, family: str, variant: str, dtype_name: str = "float32") -> Path:
    out = Path(root) / f"{family}-{variant}-{dtype_name}"
    if not out.exists():
        make_hf_checkpoint(out, family, variant, dtype=getattr(torch, dtype_name))
    return out
