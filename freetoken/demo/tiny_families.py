"""config.json and tensor lists of tiny_model's newer families, each as its hub checkpoints spell them.

One pair per family: `_<family>_config(s, common)` adds the family's fields to the fields every
family shares, `_<family>_layer(s, i)` lists decoder layer i's tensors in module order (which fixes
the random draws). Names and shapes were read off transformers 5.x's save_pretrained of each
family (the hub layout: per-expert tensors, except gpt-oss whose hub checkpoints fuse them).

    gpt_oss       all layers MoE; even layers slide; q/k/v/o biases and per-head sinks; router with
                  bias; experts fused and transposed, gate/up interleaved (even columns gate, odd up)
    glm4_moe      first_k_dense_replace dense layers, then sigmoid grouped routing with a
                  correction bias and shared experts; partial rotary; optional MTP layer after the last
    minimax_m2    sigmoid routing with a correction bias; q/k norms across all heads; partial rotary
    olmoe         softmax routing; q/k norms across all heads
    ernie4_5_moe  dense layers outside moe_layer_start..end (every moe_layer_interval-th);
                  a [1, E] correction bias in mlp.moe_statics; shared experts; tied embeddings
"""

from __future__ import annotations

FAMILIES = ("gpt_oss", "glm4_moe", "minimax_m2", "olmoe", "ernie4_5_moe")
RMS_NORM_EPS = {"gpt_oss": 1e-5, "glm4_moe": 1e-5, "minimax_m2": 1e-6, "olmoe": 1e-5, "ernie4_5_moe": 1e-5}
TIED_BY_DEFAULT = ("ernie4_5_moe",)
# Router tensors kept in float32 whatever the checkpoint's dtype: the correction biases, and
# glm4_moe's and ernie's router weights (both as transformers' save_pretrained writes them).
FLOAT32_SUFFIXES = {"glm4_moe": ("e_score_correction_bias", "mlp.gate.weight"),
                    "minimax_m2": ("e_score_correction_bias",),
                    "ernie4_5_moe": ("e_score_correction_bias", "mlp.gate.weight")}

Shapes = list[tuple[str, tuple[int, ...]]]


def validate(family: str, s) -> None:
    """Refuse what the family cannot express (its config has no field for it)."""
    Hd = s.resolved_head_dim
    if s.mlp_only_layers:
        raise ValueError(f"{family} has no mlp_only_layers (glm4_moe: first_k_dense_replace)")
    if s.decoder_sparse_step != 1 and family != "ernie4_5_moe":
        raise ValueError(f"{family} has no decoder_sparse_step (ernie4_5_moe's moe_layer_interval)")
    if s.norm_topk_prob is False and family not in ("glm4_moe", "olmoe"):
        raise ValueError(f"{family} always renormalises its top-k weights")
    if s.mtp and family != "glm4_moe":
        raise ValueError("only glm4_moe writes an MTP layer")
    if family in ("olmoe",) and Hd * s.num_heads != s.hidden_size:
        raise ValueError("olmoe has no head_dim field: head_dim must be hidden_size // num_heads")
    if family in ("glm4_moe", "minimax_m2") and (int(Hd * s.partial_rotary_factor) % 2
                                                 or not 0 < s.partial_rotary_factor <= 1):
        raise ValueError("partial_rotary_factor must be in (0, 1] and give an even rotary dim")
    if family == "gpt_oss" and s.sliding_window < 1:
        raise ValueError("sliding_window must be >= 1")
    if family in ("glm4_moe", "ernie4_5_moe") and not 0 <= s.first_k_dense_replace <= s.num_layers:
        raise ValueError("first_k_dense_replace must be in 0..num_layers")
    if family == "glm4_moe":
        E, G = s.num_experts, s.n_group
        if E % G or E // G < 2 or not 1 <= s.topk_group <= G or s.top_k > s.topk_group * (E // G):
            raise ValueError("glm4_moe needs num_experts a multiple of n_group with >= 2 experts a "
                             "group, topk_group in 1..n_group, top_k <= topk_group * experts a group")


def config_json(family: str, s, common: dict) -> dict:
    cfg = {"gpt_oss": _gpt_oss_config, "glm4_moe": _glm4_moe_config, "minimax_m2": _minimax_m2_config,
           "olmoe": _olmoe_config, "ernie4_5_moe": _ernie4_5_moe_config}[family](s, common)
    return dict(sorted(cfg.items()))


def layer_shapes(family: str, s, i: int) -> Shapes:
    """Decoder layer i's tensors, norms last (the order of the hub's module definitions)."""
    return {"gpt_oss": _gpt_oss_layer, "glm4_moe": _glm4_moe_layer, "minimax_m2": _minimax_m2_layer,
            "olmoe": _olmoe_layer, "ernie4_5_moe": _ernie4_5_moe_layer}[family](s, i)


def extra_shapes(family: str, s) -> Shapes:
    """Tensors after lm_head: glm4_moe's MTP layer. Last, so mtp on or off draws the rest alike."""
    if family != "glm4_moe" or not s.resolved_mtp(family):
        return []
    # Real GLM checkpoints: a full MoE decoder layer at index num_hidden_layers, plus the MTP
    # head: enorm(embed) and hnorm(hidden) concatenated [2D] -> eh_proj -> D; its own embedding
    # and shared_head (norm, head) copies.
    D, V, i = s.hidden_size, s.vocab_size, s.num_layers
    p = f"model.layers.{i}."
    return _glm4_moe_layer(s, i) + [
        (p + "embed_tokens.weight", (V, D)), (p + "enorm.weight", (D,)), (p + "hnorm.weight", (D,)),
        (p + "eh_proj.weight", (D, 2 * D)), (p + "shared_head.norm.weight", (D,)),
        (p + "shared_head.head.weight", (V, D))]


# --- shared pieces ---------------------------------------------------------------------------

def _attention(s, p: str, *, qkv_bias: bool = False, o_bias: bool = False,
               qk_norm: str | None = None) -> Shapes:
    # q / kv: the query and key-value projections' widths; qk_norm "head" ([Hd], shared by the
    # heads) or "all" ([H * Hd], across all heads at once)
    D, Hd = s.hidden_size, s.resolved_head_dim
    q, kv = s.num_heads * Hd, s.num_kv_heads * Hd
    a = p + "self_attn."
    out = [(a + "q_proj.weight", (q, D)), (a + "k_proj.weight", (kv, D)),
           (a + "v_proj.weight", (kv, D)), (a + "o_proj.weight", (D, q))]
    if qkv_bias:
        out += [(a + "q_proj.bias", (q,)), (a + "k_proj.bias", (kv,)), (a + "v_proj.bias", (kv,))]
    if o_bias:
        out += [(a + "o_proj.bias", (D,))]
    if qk_norm == "head":
        out += [(a + "q_norm.weight", (Hd,)), (a + "k_norm.weight", (Hd,))]
    elif qk_norm == "all":
        out += [(a + "q_norm.weight", (q,)), (a + "k_norm.weight", (kv,))]
    return out


def _swiglu(m: str, D: int, F: int, names=("gate_proj", "up_proj", "down_proj")) -> Shapes:
    gate, up, down = names
    return [(f"{m}{gate}.weight", (F, D)), (f"{m}{up}.weight", (F, D)), (f"{m}{down}.weight", (D, F))]


def _experts(m: str, s, names=("gate_proj", "up_proj", "down_proj")) -> Shapes:
    out = []
    for e in range(s.num_experts):
        out += _swiglu(f"{m}experts.{e}.", s.hidden_size, s.moe_intermediate_size, names)
    return out


def _norms(p: str, D: int) -> Shapes:
    return [(p + "input_layernorm.weight", (D,)), (p + "post_attention_layernorm.weight", (D,))]


def _rope(s, **extra) -> dict:
    return {"rope_type": "default", "rope_theta": s.rope_theta, **extra}


# --- gpt_oss ---------------------------------------------------------------------------------

def _gpt_oss_config(s, common: dict) -> dict:
    # The hub's yarn (factor 32 over an original context of max_position / 32) in both spellings:
    # rope_scaling (hub, v4) and rope_parameters (v5); transformers reads rope_scaling first.
    original = max(1, s.max_position_embeddings // 32)
    yarn = {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
            "original_max_position_embeddings": original, "rope_type": "yarn", "truncate": False}
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", **common,
            "attention_bias": True, "experts_per_token": s.top_k, "head_dim": s.resolved_head_dim,
            "initial_context_length": original, "intermediate_size": s.moe_intermediate_size,
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                            for i in range(s.num_layers)],
            "num_local_experts": s.num_experts, "rope_scaling": yarn,
            "rope_parameters": {**yarn, "rope_theta": s.rope_theta}, "router_aux_loss_coef": 0.9,
            "sliding_window": s.sliding_window, "swiglu_limit": 7.0}


def _gpt_oss_layer(s, i: int) -> Shapes:
    # E experts, D hidden, I one expert's width. gate_up_proj is x @ W ([D, 2I], not nn.Linear's
    # [out, in]) with gate in the even columns and up in the odd ones.
    D, E, I = s.hidden_size, s.num_experts, s.moe_intermediate_size
    p = f"model.layers.{i}."
    m = p + "mlp."
    return (_attention(s, p, qkv_bias=True, o_bias=True) + [(p + "self_attn.sinks", (s.num_heads,))]
            + [(m + "router.weight", (E, D)), (m + "router.bias", (E,)),
               (m + "experts.gate_up_proj", (E, D, 2 * I)), (m + "experts.gate_up_proj_bias", (E, 2 * I)),
               (m + "experts.down_proj", (E, I, D)), (m + "experts.down_proj_bias", (E, D))]
            + _norms(p, D))


# --- glm4_moe --------------------------------------------------------------------------------

def _glm4_moe_config(s, common: dict) -> dict:
    return {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", **common,
            "attention_bias": s.resolved_attention_bias(), "first_k_dense_replace": s.first_k_dense_replace,
            "head_dim": s.resolved_head_dim, "intermediate_size": s.intermediate_size,
            "moe_intermediate_size": s.moe_intermediate_size, "n_group": s.n_group,
            "n_routed_experts": s.num_experts, "n_shared_experts": s.resolved_n_shared("glm4_moe"),
            "norm_topk_prob": s.norm_topk_prob is not False,
            "num_nextn_predict_layers": int(s.resolved_mtp("glm4_moe")),
            "partial_rotary_factor": s.partial_rotary_factor,
            "rope_parameters": _rope(s, partial_rotary_factor=s.partial_rotary_factor),
            "routed_scaling_factor": s.routed_scaling_factor, "topk_group": s.topk_group,
            "use_qk_norm": s.use_qk_norm}


def _glm4_moe_layer(s, i: int) -> Shapes:
    D = s.hidden_size
    p = f"model.layers.{i}."
    m = p + "mlp."
    out = _attention(s, p, qkv_bias=s.resolved_attention_bias(), qk_norm="head" if s.use_qk_norm else None)
    if i < s.first_k_dense_replace:
        out += _swiglu(m, D, s.intermediate_size)
    else:
        out += [(m + "gate.weight", (s.num_experts, D)),
                (m + "gate.e_score_correction_bias", (s.num_experts,))]
        out += _experts(m, s)
        out += _swiglu(m + "shared_experts.", D, s.moe_intermediate_size * s.resolved_n_shared("glm4_moe"))
    return out + _norms(p, D)


# --- minimax_m2 ------------------------------------------------------------------------------

def _minimax_m2_config(s, common: dict) -> dict:
    Hd = s.resolved_head_dim
    rotary_dim = int(Hd * s.partial_rotary_factor)
    return {"architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", **common,
            "attn_type_list": [1] * s.num_layers, "head_dim": Hd,
            "intermediate_size": s.moe_intermediate_size,
            "num_local_experts": s.num_experts, "qk_norm_type": "per_layer", "rotary_dim": rotary_dim,
            "rope_parameters": _rope(s, partial_rotary_factor=rotary_dim / Hd),
            "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0, "scoring_func": "sigmoid",
            "shared_intermediate_size": 0, "use_qk_norm": True, "use_routing_bias": True}


def _minimax_m2_layer(s, i: int) -> Shapes:
    D, E = s.hidden_size, s.num_experts
    p = f"model.layers.{i}."
    b = p + "block_sparse_moe."
    return (_attention(s, p, qk_norm="all")
            + [(b + "gate.weight", (E, D)), (b + "e_score_correction_bias", (E,))]
            + _experts(b, s, names=("w1", "w3", "w2")) + _norms(p, D))    # w1 gate, w3 up, w2 down


# --- olmoe -----------------------------------------------------------------------------------

def _olmoe_config(s, common: dict) -> dict:
    return {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", **common,
            "attention_bias": False, "clip_qkv": None, "intermediate_size": s.moe_intermediate_size,
            "norm_topk_prob": bool(s.norm_topk_prob), "num_experts": s.num_experts,
            "router_aux_loss_coef": 0.01}


def _olmoe_layer(s, i: int) -> Shapes:
    p = f"model.layers.{i}."
    m = p + "mlp."
    return (_attention(s, p, qk_norm="all") + [(m + "gate.weight", (s.num_experts, s.hidden_size))]
            + _experts(m, s) + _norms(p, s.hidden_size))


# --- ernie4_5_moe ----------------------------------------------------------------------------

def _ernie_is_moe_layer(s, i: int) -> bool:
    # HF's rule: every moe_layer_interval-th layer from moe_layer_start_index to the last
    return (i + 1) % s.decoder_sparse_step == 0 and i >= s.first_k_dense_replace


def _ernie4_5_moe_config(s, common: dict) -> dict:
    # ERNIE spells top-k moe_k (transformers maps num_experts_per_tok onto it)
    cfg = {k: v for k, v in common.items() if k != "num_experts_per_tok"}
    cfg = {"architectures": ["Ernie4_5_MoeForCausalLM"], "model_type": "ernie4_5_moe", **cfg,
           "intermediate_size": s.intermediate_size, "moe_intermediate_size": s.moe_intermediate_size,
           "moe_k": s.top_k, "moe_layer_end_index": s.num_layers - 1,
           "moe_layer_interval": s.decoder_sparse_step, "moe_layer_start_index": s.first_k_dense_replace,
           "moe_norm_min": 1e-12, "moe_num_experts": s.num_experts,
           "moe_num_shared_experts": s.resolved_n_shared("ernie4_5_moe"), "router_aux_loss_coef": 0.001,
           "use_bias": False}
    if s.resolved_head_dim * s.num_heads != s.hidden_size:
        cfg["head_dim"] = s.resolved_head_dim
    return cfg


def _ernie4_5_moe_layer(s, i: int) -> Shapes:
    D, E = s.hidden_size, s.num_experts
    p = f"model.layers.{i}."
    m = p + "mlp."
    out = _attention(s, p)
    if not _ernie_is_moe_layer(s, i):
        out += _swiglu(m, D, s.intermediate_size)
    else:
        out += [(m + "gate.weight", (E, D)), (m + "moe_statics.e_score_correction_bias", (1, E))]
        out += _experts(m, s)
        S = s.moe_intermediate_size * s.resolved_n_shared("ernie4_5_moe")    # the shared experts as one
        out += _swiglu(m + "shared_experts.", D, S)
    return out + _norms(p, D)
