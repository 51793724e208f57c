"""config.json and tensor lists of tiny_model's hybrid linear-attention families, as their hub
checkpoints spell them (names and shapes read off transformers 5.x's save_pretrained and the
released checkpoints' layouts).

    qwen3_next    Qwen3NextForCausalLM, flat: every full_attention_interval-th layer gated full
                  attention, the others Gated DeltaNet with fused per-key-head in_proj_qkvz /
                  in_proj_ba; per-expert tensors and a shared expert; an MTP head (mtp.*)
    qwen3_5_moe   Qwen3_5MoeForConditionalGeneration, the released (VL-wrapper) layout: fields
                  in text_config, keys under model.language_model., split DeltaNet projections,
                  pre-fused experts (gate_up_proj [E, 2I, D], down_proj [E, D, I]), a one-block
                  vision tower (model.visual.*) and an MTP head (mtp.*)

Linear-attention heads follow the attention knobs: num_kv_heads key heads and num_heads value
heads, both of head_dim; partial_rotary_factor is the full attention's rotated share.
"""

from __future__ import annotations

FAMILIES = ("qwen3_next", "qwen3_5_moe")
FULL_ATTENTION_INTERVAL = 4
CONV_KERNEL = 4
# The vision tower's knobs (a text server never runs it; transformers loads it).
VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16,
              in_channels=3)

Shapes = list[tuple[str, tuple[int, ...]]]


def validate(family: str, s) -> None:
    if s.mlp_only_layers and family == "qwen3_5_moe":
        raise ValueError("qwen3_5_moe has every layer sparse (no mlp_only_layers)")
    if s.decoder_sparse_step != 1 and family == "qwen3_5_moe":
        raise ValueError("qwen3_5_moe has no decoder_sparse_step")
    if s.norm_topk_prob is False and family == "qwen3_5_moe":
        raise ValueError("qwen3_5_moe always renormalises its top-k weights")
    if s.mtp is False:
        raise ValueError(f"{family} checkpoints always carry their MTP head")
    rot = s.resolved_head_dim * s.partial_rotary_factor
    if not 0 < s.partial_rotary_factor <= 1 or rot != int(rot) or int(rot) % 2:
        raise ValueError("partial_rotary_factor must be in (0, 1] and give an even rotary dim")


def layer_types(s) -> list[str]:
    return ["full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
            for i in range(s.num_layers)]


def config_json(family: str, s, common: dict) -> dict:
    Hd = s.resolved_head_dim
    text = {
        **common, "head_dim": Hd, "attention_bias": False, "layer_types": layer_types(s),
        "full_attention_interval": FULL_ATTENTION_INTERVAL,
        "linear_conv_kernel_dim": CONV_KERNEL, "linear_key_head_dim": Hd,
        "linear_value_head_dim": Hd, "linear_num_key_heads": s.num_kv_heads,
        "linear_num_value_heads": s.num_heads, "moe_intermediate_size": s.moe_intermediate_size,
        "num_experts": s.num_experts, "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": s.shared_expert_intermediate_size,
        "partial_rotary_factor": s.partial_rotary_factor,
        "rope_parameters": {**common["rope_parameters"],
                            "partial_rotary_factor": s.partial_rotary_factor},
    }
    if family == "qwen3_next":
        return dict(sorted({**text, "architectures": ["Qwen3NextForCausalLM"],
                            "model_type": "qwen3_next", "decoder_sparse_step": s.decoder_sparse_step,
                            "intermediate_size": s.intermediate_size,
                            "mlp_only_layers": list(s.mlp_only_layers),
                            "norm_topk_prob": s.norm_topk_prob is not False}.items()))
    outer = {k: text.pop(k) for k in ("tie_word_embeddings", "torch_dtype")}
    text["model_type"] = "qwen3_5_moe_text"
    text["rope_parameters"].update(mrope_interleaved=True, mrope_section=_mrope_section(s))
    vision = {**VISION, "model_type": "qwen3_5_moe_vision", "hidden_act": "gelu_pytorch_tanh",
              "out_hidden_size": s.hidden_size, "initializer_range": 0.02}
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            **outer, "image_token_id": s.vocab_size - 4, "video_token_id": s.vocab_size - 3,
            "vision_start_token_id": s.vocab_size - 2, "vision_end_token_id": s.vocab_size - 1,
            "text_config": dict(sorted(text.items())), "vision_config": dict(sorted(vision.items()))}


def _mrope_section(s) -> list[int]:
    """The rotary pairs split over (time, height, width), as the hub's [11, 11, 10] for 64."""
    pairs = int(s.resolved_head_dim * s.partial_rotary_factor) // 2
    return [pairs - 2 * (pairs // 3), pairs // 3, pairs // 3]


def param_shapes(family: str, s) -> Shapes:
    """Every tensor's hub name and shape, text model first (so its draws do not depend on the
    vision tower or the MTP head), in module order."""
    D, V = s.hidden_size, s.vocab_size
    m = "model.language_model." if family == "qwen3_5_moe" else "model."
    out = [(m + "embed_tokens.weight", (V, D))]
    for i, kind in enumerate(layer_types(s)):
        out += _layer(family, s, f"{m}layers.{i}.", i, kind)
    out.append((m + "norm.weight", (D,)))
    if not s.resolved_tie(family):
        out.append(("lm_head.weight", (V, D)))
    if family == "qwen3_5_moe":
        out += _vision(s)
    return out + _mtp(family, s)


def _layer(family: str, s, p: str, i: int, kind: str) -> Shapes:
    D = s.hidden_size
    mixer = _full_attention(s, p) if kind == "full_attention" else _linear_attention(family, s, p)
    return mixer + _mlp(family, s, p, i) + [(p + "input_layernorm.weight", (D,)),
                                            (p + "post_attention_layernorm.weight", (D,))]


def _full_attention(s, p: str) -> Shapes:
    # q_proj yields [q | gate] per head, hence 2 * H * Hd rows.
    D, Hd, H, K = s.hidden_size, s.resolved_head_dim, s.num_heads, s.num_kv_heads
    a = p + "self_attn."
    return [(a + "q_proj.weight", (2 * H * Hd, D)), (a + "k_proj.weight", (K * Hd, D)),
            (a + "v_proj.weight", (K * Hd, D)), (a + "o_proj.weight", (D, H * Hd)),
            (a + "q_norm.weight", (Hd,)), (a + "k_norm.weight", (Hd,))]


def _linear_attention(family: str, s, p: str) -> Shapes:
    # Hk key heads and Hv value heads of Hd; C conv channels = q + k + v
    D, Hd, Hk, Hv = s.hidden_size, s.resolved_head_dim, s.num_kv_heads, s.num_heads
    C = (2 * Hk + Hv) * Hd
    a = p + "linear_attn."
    if family == "qwen3_next":
        proj = [(a + "in_proj_qkvz.weight", (C + Hv * Hd, D)), (a + "in_proj_ba.weight", (2 * Hv, D))]
    else:
        proj = [(a + "in_proj_qkv.weight", (C, D)), (a + "in_proj_z.weight", (Hv * Hd, D)),
                (a + "in_proj_b.weight", (Hv, D)), (a + "in_proj_a.weight", (Hv, D))]
    return proj + [(a + "conv1d.weight", (C, 1, CONV_KERNEL)), (a + "dt_bias", (Hv,)),
                   (a + "A_log", (Hv,)), (a + "norm.weight", (Hd,)),
                   (a + "out_proj.weight", (D, Hv * Hd))]


def _mlp(family: str, s, p: str, i: int) -> Shapes:
    # E experts, I one expert's width, S the shared expert's, F a dense layer's
    D, E, I, S = s.hidden_size, s.num_experts, s.moe_intermediate_size, s.shared_expert_intermediate_size
    m = p + "mlp."
    if family == "qwen3_next" and not s.is_moe_layer(i):
        F = s.intermediate_size
        return [(m + "gate_proj.weight", (F, D)), (m + "up_proj.weight", (F, D)),
                (m + "down_proj.weight", (D, F))]
    out = [(m + "gate.weight", (E, D))]
    if family == "qwen3_5_moe":
        out += [(m + "experts.gate_up_proj", (E, 2 * I, D)), (m + "experts.down_proj", (E, D, I))]
    else:
        for e in range(E):
            out += [(f"{m}experts.{e}.gate_proj.weight", (I, D)),
                    (f"{m}experts.{e}.up_proj.weight", (I, D)),
                    (f"{m}experts.{e}.down_proj.weight", (D, I))]
    return out + [(m + "shared_expert.gate_proj.weight", (S, D)),
                  (m + "shared_expert.up_proj.weight", (S, D)),
                  (m + "shared_expert.down_proj.weight", (D, S)),
                  (m + "shared_expert_gate.weight", (1, D))]


def _vision(s) -> Shapes:
    v = VISION
    W, F, P, T = v["hidden_size"], v["intermediate_size"], v["patch_size"], v["temporal_patch_size"]
    M = W * v["spatial_merge_size"] ** 2        # the merger's input: merge x merge patches
    b, g = "model.visual.blocks.0.", "model.visual.merger."
    return [("model.visual.patch_embed.proj.weight", (W, v["in_channels"], T, P, P)),
            ("model.visual.patch_embed.proj.bias", (W,)),
            ("model.visual.pos_embed.weight", (v["num_position_embeddings"], W)),
            (b + "norm1.weight", (W,)), (b + "norm1.bias", (W,)),
            (b + "norm2.weight", (W,)), (b + "norm2.bias", (W,)),
            (b + "attn.qkv.weight", (3 * W, W)), (b + "attn.qkv.bias", (3 * W,)),
            (b + "attn.proj.weight", (W, W)), (b + "attn.proj.bias", (W,)),
            (b + "mlp.linear_fc1.weight", (F, W)), (b + "mlp.linear_fc1.bias", (F,)),
            (b + "mlp.linear_fc2.weight", (W, F)), (b + "mlp.linear_fc2.bias", (W,)),
            (g + "norm.weight", (W,)), (g + "norm.bias", (W,)),
            (g + "linear_fc1.weight", (M, M)), (g + "linear_fc1.bias", (M,)),
            (g + "linear_fc2.weight", (s.hidden_size, M)), (g + "linear_fc2.bias", (s.hidden_size,))]


def _mtp(family: str, s) -> Shapes:
    """The MTP head: normed embedding and hidden state, concatenated [2D] -> fc -> D, one full
    attention decoder layer, a norm."""
    D = s.hidden_size
    return ([("mtp.fc.weight", (D, 2 * D)), ("mtp.pre_fc_norm_embedding.weight", (D,)),
             ("mtp.pre_fc_norm_hidden.weight", (D,))]
            + _layer(family, s, "mtp.layers.0.", 0, "full_attention") + [("mtp.norm.weight", (D,))])
