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
    "gpt_oss": {
        # The 13-token prompt and 24 decoded tokens run well past the windows.
        "gqa_window6": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_local_experts=8, num_experts_per_tok=2, sliding_window=6),
        "mqa_window3_top3": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                                 num_hidden_layers=3, num_local_experts=6,
                                 num_experts_per_tok=3, sliding_window=3, swiglu_limit=1.5),
    },
    "glm4_moe": {
        "groups_shared_qknorm": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     num_hidden_layers=3, n_routed_experts=8,
                                     num_experts_per_tok=3, n_group=4, topk_group=2,
                                     n_shared_experts=1, routed_scaling_factor=2.5,
                                     use_qk_norm=True, attention_bias=True),
        "one_group_no_norm": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                  n_routed_experts=6, num_experts_per_tok=2, n_group=1,
                                  topk_group=1, n_shared_experts=2, norm_topk_prob=False),
    },
    "minimax_m2": {
        "gqa_partial_rotary": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   rotary_dim=8, num_local_experts=8, num_experts_per_tok=2),
        "mha_top3": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                         num_local_experts=6, num_experts_per_tok=3),
    },
    "ernie4_5_moe": {
        "bias_shared": dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                            moe_num_experts=8, moe_k=2, moe_num_shared_experts=1, use_bias=True,
                            tie_word_embeddings=False),
        "tied_interval2": dict(num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=4,
                               moe_num_experts=6, moe_k=3, moe_num_shared_experts=0,
                               moe_layer_start_index=0, moe_layer_interval=2,
                               tie_word_embeddings=True),
    },
    "olmoe": {
        "gqa_norm_topk": dict(num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                              num_experts_per_tok=2, norm_topk_prob=True),
        "mha_clip": dict(num_attention_heads=4, num_key_value_heads=4, num_experts=6,
                         num_experts_per_tok=3, norm_topk_prob=False, clip_qkv=0.5),
    },
}
# MLA families: num_key_value_heads == num_attention_heads, v_head_dim != qk_nope_head_dim,
# n_group > 1 with topk_group < n_group, routed_scaling_factor != 1, layer 0 dense and YaRN
# with mscale (mscale != mscale_all_dim, so both the cos/sin and the softmax scale change).
_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.8, mscale_all_dim=1.2,
             original_max_position_embeddings=128, beta_fast=32, beta_slow=1)
_MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=24)
VARIANTS["deepseek_v3"] = {
    "qlora_yarn_groups": dict(_MLA, q_lora_rank=24, n_routed_experts=8,
                              num_experts_per_tok=3, n_group=4, topk_group=2,
                              routed_scaling_factor=2.5, rope_parameters=_YARN),
    "no_qlora_bias_neox": dict(_MLA, q_lora_rank=None, attention_bias=True, rope_interleave=False,
                               n_routed_experts=6, num_experts_per_tok=2, n_group=1,
                               topk_group=1, n_shared_experts=2, norm_topk_prob=False,
                               routed_scaling_factor=1.5),
}
VARIANTS["glm4_moe_lite"] = {
    "qlora_yarn_groups": dict(_MLA, q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2,
                              n_group=2, topk_group=1, routed_scaling_factor=1.8,
                              rope_parameters=_YARN),
}

# Hybrid linear attention (Gated DeltaNet) + gated full attention, apart from VARIANTS:
# tests/test_hybrid.py runs their parity (prompts across transformers' 64-token chunk, the
# state-slot cases), so test_parity.py's matrix does not repeat it at its cost. Every
# parameter random, A_log and dt_bias included, so the recurrent state carries real memory.
HYBRID_VARIANTS = {
    "qwen3_next": {
        "gqa_linear2x": dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention",
                                                               "linear_attention"],
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=16, linear_value_head_dim=8,
                             num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                             partial_rotary_factor=0.5, mlp_only_layers=[2]),
    },
    "qwen3_5_moe": {
        "split_proj": dict(num_hidden_layers=3, layer_types=["linear_attention", "linear_attention",
                                                             "full_attention"],
                           num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                           linear_num_key_heads=2, linear_num_value_heads=2,
                           linear_key_head_dim=8, linear_value_head_dim=16,
                           num_experts=6, num_experts_per_tok=3),
    },
}

BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            max_position_embeddings=512, rms_norm_eps=1e-6)
FAMILY_BASE = {
    "qwen3_moe": dict(moe_intermediate_size=32),
    "mixtral": dict(),
    "qwen2_moe": dict(moe_intermediate_size=32, shared_expert_intermediate_size=48),
    "olmoe": dict(intermediate_size=32),
    "gpt_oss": dict(intermediate_size=32),
    "glm4_moe": dict(moe_intermediate_size=32, first_k_dense_replace=1),
    "minimax_m2": dict(intermediate_size=32),
    "ernie4_5_moe": dict(moe_intermediate_size=32),
    "qwen3_next": dict(moe_intermediate_size=32, shared_expert_intermediate_size=48),
    "qwen3_5_moe": dict(moe_intermediate_size=32, shared_expert_intermediate_size=40),
    "deepseek_v3": dict(moe_intermediate_size=32, first_k_dense_replace=1, n_shared_experts=1),
    "glm4_moe_lite": dict(moe_intermediate_size=32, n_shared_experts=1),
}


def hf_classes(family):
    import transformers as tf
    return {
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
        "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
        "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM),
        "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM),
        "glm4_moe": (tf.Glm4MoeConfig, tf.Glm4MoeForCausalLM),
        "minimax_m2": (tf.MiniMaxM2Config, tf.MiniMaxM2ForCausalLM),
        "ernie4_5_moe": (tf.Ernie4_5_MoeConfig, tf.Ernie4_5_MoeForCausalLM),
        "qwen3_next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM),
        "qwen3_5_moe": (tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM),
        "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM),
        "glm4_moe_lite": (tf.Glm4MoeLiteConfig, tf.Glm4MoeLiteForCausalLM),
    }[family]


def redraw_weights(model, seed: int) -> None:
    """Every parameter and buffer (router selection biases too; not the RoPE tables)."""
    g = torch.Generator().manual_seed(seed)
    tensors = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers()
                                            if "inv_freq" not in n)]
    with torch.no_grad():
        for name, p in tensors:
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif leaf == "sinks":
                p.copy_(torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                # gpt-oss stores its experts transposed ([E, D, 2I], x @ W): fan-in is dim -2.
                transposed = leaf in ("gate_up_proj", "down_proj") and type(
                    model).__name__.startswith("GptOss")
                fan_in = p.shape[-2] if transposed else p.shape[-1]
                router = (name.endswith("mlp.gate.weight") or name.endswith("block_sparse_moe.gate.weight")
                          or name.endswith("mlp.router.weight"))
                std = (4.0 if router else 1.0) / math.sqrt(fan_in)
                p.copy_(std * torch.randn(p.shape, generator=g))


def make_hf_checkpoint(out: Path, family: str, variant: str, seed: int = 0,
                       dtype=torch.float32) -> Path:
    cfg_cls, model_cls = hf_classes(family)
    kwargs = {**BASE, **FAMILY_BASE[family], **{**VARIANTS, **HYBRID_VARIANTS}[family][variant]}
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
