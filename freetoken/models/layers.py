"""Building blocks the families share: norm, attention over the paged KV cache, dense MLP,
and the sparse MoE block. Parameter names follow Hugging Face so checkpoint keys map directly.

Every hot op goes through triton_kernels, which runs the Triton kernel on CUDA and the torch
reference elsewhere. Shapes: T tokens, D hidden, Hq/Hk query/kv heads of Dh, E experts, I width.
"""

import torch
import torch.nn.functional as F
from torch import nn

import triton_kernels as tk
from freetoken.engine.batch import ForwardBatch
from freetoken.models.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return tk.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    """Self-attention with GQA, optional qkv bias and per-head q/k RMSNorm (qwen3)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = self.head_dim ** -0.5
        d, hd = cfg.hidden_size, self.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # Bound by the KV cache at allocation: [NB, BS, Hk, Dh] each.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.cos_sin: torch.Tensor | None = None   # [P, R], shared with every layer

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view_as(q)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view_as(k)
        q, k = q.contiguous(), k.contiguous()
        tk.apply_rope(q, k, batch.positions, self.cos_sin)
        tk.write_kv(k, v, self.k_cache, self.v_cache, batch.slot_mapping)
        o = tk.paged_attention(q, self.k_cache, self.v_cache, batch.block_tables,
                               batch.cu_seqlens_q, batch.seq_lens, self.scale,
                               batch.max_seqlen_q)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class DenseMLP(nn.Module):
    """SwiGLU MLP with HF's gate_proj/up_proj/down_proj names."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ExpertBank(nn.Module):
    """All of one layer's experts as two stacked tensors, the layout the MoE kernel reads.

    w13: [E, 2I, D] (gate rows then up rows); w2: [E, D, I]. The checkpoint's per-expert keys
    (`experts.{e}.gate_proj.weight`, or mixtral's w1/w3/w2) load into slices of these.
    When the engine keeps experts off the device (freetoken.moe), w13/w2 are host tensors of
    the expert store and `runtime` (x, topk_weights, topk_ids) -> [T, D] runs the layer.
    """

    # checkpoint projection name -> (bank, which half of w13 or None for w2)
    PROJ = {"gate_proj": ("w13", 0), "w1": ("w13", 0),
            "up_proj": ("w13", 1), "w3": ("w13", 1),
            "down_proj": ("w2", None), "w2": ("w2", None)}

    def __init__(self, num_experts: int, hidden: int, width: int):
        super().__init__()
        self.num_experts, self.width = num_experts, width
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * width, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, width))
        self.runtime = None

    def load_expert(self, expert: int, proj: str, tensor: torch.Tensor) -> str:
        """Copy one checkpoint tensor in; returns the bank slice's name for bookkeeping."""
        bank, half = self.PROJ[proj]
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert index {expert} out of range 0..{self.num_experts - 1}")
        dst = getattr(self, bank).data[expert]
        if half is not None:
            dst = dst[half * self.width:(half + 1) * self.width]
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"expert {expert} {proj}: checkpoint shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dst.shape)}")
        dst.copy_(tensor)
        return f"{bank}[{expert}]{'' if half is None else ('.gate', '.up')[half]}"

    def forward(self, x, topk_weights, topk_ids):
        if self.runtime is not None:
            return self.runtime(x, topk_weights, topk_ids)
        return tk.fused_moe(x, self.w13, self.w2, topk_weights, topk_ids)


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ qwen2_moe's shared expert behind a sigmoid gate).

    `weights_in_model_dtype`: qwen routers cast the top-k weights to the model dtype before
    they scale expert outputs; mixtral's stay float32. Kept to match HF bit for bit.
    """

    def __init__(self, cfg: ModelConfig, renormalize: bool, weights_in_model_dtype: bool):
        super().__init__()
        d = cfg.hidden_size
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = renormalize
        self.weights_in_model_dtype = weights_in_model_dtype
        self.gate = nn.Linear(d, cfg.num_experts, bias=False)
        self.experts = ExpertBank(cfg.num_experts, d, cfg.moe_intermediate_size)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = DenseMLP(d, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(d, 1, bias=False)
        else:
            self.shared_expert = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)                                          # [T, E]
        weights, ids = tk.topk_softmax(logits, self.top_k, self.renormalize)  # [T, k]
        if self.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)). `mlp_name` keeps HF's name."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, mlp: nn.Module, mlp_name: str = "mlp"):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp_name = mlp_name
        self.add_module(mlp_name, mlp)

    def forward(self, x, residual, batch: ForwardBatch):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return getattr(self, self.mlp_name)(x), residual


def qwen_layer(cfg: ModelConfig, i: int) -> DecoderLayer:
    """The Qwen MoE layer rule: sparse where cfg.is_moe_layer(i), a dense MLP elsewhere; the
    router renormalises per norm_topk_prob and casts its weights to the model dtype."""
    if cfg.is_moe_layer(i):
        mlp = SparseMoeBlock(cfg, renormalize=cfg.norm_topk_prob, weights_in_model_dtype=True)
    else:
        mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size)
    return DecoderLayer(cfg, i, mlp)


class MoeModel(nn.Module):
    """`model.*` of a causal LM: embeddings, decoder layers, final norm."""

    def __init__(self, cfg: ModelConfig, make_layer):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(make_layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x, residual = self.embed_tokens(batch.input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, batch)
        x, _ = self.norm(x, residual)
        return x


class MoeForCausalLM(nn.Module):
    """The top-level module every family builds: `model` + `lm_head` (tied or not)."""

    def __init__(self, cfg: ModelConfig, make_layer):
        super().__init__()
        self.config = cfg
        self.model = MoeModel(cfg, make_layer)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Returns float32 logits [N, vocab] for the rows batch.logits_indices selects."""
        hidden = self.model(batch)
        return self.lm_head(hidden[batch.logits_indices]).float()

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]

    def moe_blocks(self) -> dict[int, SparseMoeBlock]:
        """Decoder layer index -> its sparse MoE block, for the layers that have one."""
        blocks = {}
        for i, layer in enumerate(self.model.layers):
            mlp = getattr(layer, layer.mlp_name)
            if isinstance(mlp, SparseMoeBlock):
                blocks[i] = mlp
        return blocks
