"""config.json and tensor lists of tiny_model's multi-head latent attention families, as their hub
checkpoints spell them (per-expert tensors; router weight and correction bias in float32, as
transformers' save_pretrained keeps them).

    deepseek_v3    DeepSeek-V3's config.json (v4 field names: rope_scaling of type yarn,
                   scoring_func, topk_method); MLA with q_lora_rank (or one q_proj when None)
    glm4_moe_lite  GLM-4.7-Flash's: the same tensors, dense layers also named in mlp_layer_types

Both: the first first_k_dense_replace layers dense, the rest sigmoid grouped routing with a
correction bias and shared experts; YaRN with mscale = mscale_all_dim = 1 as DeepSeek ships
it (the softmax scale changes, the cos/sin do not), unless rope_yarn_factor is 0. MLA has no
separate kv heads: num_key_value_heads is written equal to num_heads.
"""

from __future__ import annotations

FAMILIES = ("deepseek_v3", "glm4_moe_lite")
RMS_NORM_EPS = {"deepseek_v3": 1e-6, "glm4_moe_lite": 1e-5}
ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe_lite": "Glm4MoeLiteForCausalLM"}
FLOAT32_SUFFIXES = ("e_score_correction_bias", "mlp.gate.weight")

Shapes = list[tuple[str, tuple[int, ...]]]


def validate(family: str, s) -> None:
    if s.mlp_only_layers or s.decoder_sparse_step != 1:
        raise ValueError(f"{family} has no mlp_only_layers or decoder_sparse_step "
                         f"(first_k_dense_replace)")
    if s.mtp:
        raise ValueError("only glm4_moe writes an MTP layer")
    if not 0 <= s.first_k_dense_replace <= s.num_layers:
        raise ValueError("first_k_dense_replace must be in 0..num_layers")
    E, G = s.num_experts, s.n_group
    if E % G or E // G < 2 or not 1 <= s.topk_group <= G or s.top_k > s.topk_group * (E // G):
        raise ValueError(f"{family} needs num_experts a multiple of n_group with >= 2 experts a "
                         f"group, topk_group in 1..n_group, top_k <= topk_group * experts a group")
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if getattr(s, name) <= 0:
            raise ValueError(f"{name} must be positive")
    if s.qk_rope_head_dim % 2:
        raise ValueError("qk_rope_head_dim must be even")
    if s.q_lora_rank is not None and s.q_lora_rank <= 0:
        raise ValueError("q_lora_rank must be positive or None (one q_proj)")
    if s.rope_yarn_factor and (s.rope_yarn_factor <= 1
                               or s.max_position_embeddings % s.rope_yarn_factor):
        raise ValueError("rope_yarn_factor must be 0 (plain RoPE) or > 1 and divide "
                         "max_position_embeddings")


def config_json(family: str, s, common: dict) -> dict:
    dense = s.first_k_dense_replace
    cfg = {**common, "architectures": [ARCHITECTURES[family]], "model_type": family,
           "num_key_value_heads": s.num_heads,
           "attention_bias": False, "first_k_dense_replace": dense,
           "intermediate_size": s.intermediate_size, "kv_lora_rank": s.kv_lora_rank,
           "moe_intermediate_size": s.moe_intermediate_size, "n_group": s.n_group,
           "n_routed_experts": s.num_experts, "n_shared_experts": s.resolved_n_shared(family),
           "norm_topk_prob": s.norm_topk_prob is not False, "num_nextn_predict_layers": 0,
           "q_lora_rank": s.q_lora_rank, "qk_nope_head_dim": s.qk_nope_head_dim,
           "qk_rope_head_dim": s.qk_rope_head_dim, "rope_interleave": True,
           "routed_scaling_factor": s.routed_scaling_factor, "topk_group": s.topk_group,
           "v_head_dim": s.v_head_dim}
    if family == "deepseek_v3":
        cfg.update(scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1)
    else:
        cfg["mlp_layer_types"] = ["dense" if i < dense else "sparse" for i in range(s.num_layers)]
    if s.rope_yarn_factor:
        yarn = {"beta_fast": 32, "beta_slow": 1, "factor": float(s.rope_yarn_factor),
                "mscale": 1.0, "mscale_all_dim": 1.0,
                "original_max_position_embeddings": int(s.max_position_embeddings
                                                        // s.rope_yarn_factor)}
        cfg["rope_scaling"] = {**yarn, "type": "yarn"}
        cfg["rope_parameters"] = {**yarn, "rope_type": "yarn", "rope_theta": s.rope_theta}
    return cfg


def layer_shapes(family: str, s, i: int) -> Shapes:
    # H heads, Q q_lora_rank, L kv_lora_rank, N/R/V the no-rope, rope and value head dims
    D, H, L = s.hidden_size, s.num_heads, s.kv_lora_rank
    N, R, V = s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim
    p = f"model.layers.{i}."
    a, m = p + "self_attn.", p + "mlp."
    if s.q_lora_rank is None:
        out = [(a + "q_proj.weight", (H * (N + R), D))]
    else:
        Q = s.q_lora_rank
        out = [(a + "q_a_proj.weight", (Q, D)), (a + "q_a_layernorm.weight", (Q,)),
               (a + "q_b_proj.weight", (H * (N + R), Q))]
    out += [(a + "kv_a_proj_with_mqa.weight", (L + R, D)), (a + "kv_a_layernorm.weight", (L,)),
            (a + "kv_b_proj.weight", (H * (N + V), L)), (a + "o_proj.weight", (D, H * V))]
    if i < s.first_k_dense_replace:
        out += _swiglu(m, D, s.intermediate_size)
    else:
        out += [(m + "gate.weight", (s.num_experts, D)),
                (m + "gate.e_score_correction_bias", (s.num_experts,))]
        for e in range(s.num_experts):
            out += _swiglu(f"{m}experts.{e}.", D, s.moe_intermediate_size)
        out += _swiglu(m + "shared_experts.", D,
                       s.moe_intermediate_size * s.resolved_n_shared(family))
    return out + [(p + "input_layernorm.weight", (D,)),
                  (p + "post_attention_layernorm.weight", (D,))]


def _swiglu(m: str, D: int, F: int) -> Shapes:
    return [(m + "gate_proj.weight", (F, D)), (m + "up_proj.weight", (F, D)),
            (m + "down_proj.weight", (D, F))]
