"""The decoder stack every family builds: pre-norm layers, the model, the causal-LM head.

A family supplies `make_layer(cfg, i, rope) -> DecoderLayer`; everything else is shared. The
model reports what each layer keeps (`cache_specs()`) and which layers are sparse
(`moe_blocks()`), builds its RoPE tables once it knows the context (`init_rope`), and returns
float32 logits for the rows the batch asks for.
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken.engine.batch import ForwardBatch
from freetoken.engine.cache_spec import CacheSpec
from freetoken.models.config import ModelConfig
from freetoken.models.layers.attention import Attention
from freetoken.models.layers.linear import Linear
from freetoken.models.layers.moe import SparseMoeBlock
from freetoken.models.layers.norm import RMSNorm
from freetoken.models.rope import RopeTable


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)). `mlp_name` and `attn_name` keep HF's names for
    the MLP and the token mixer (`linear_attn` for a Gated DeltaNet layer); norm_offset 1.0
    makes both norms zero-centred (norm.py)."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, hidden: int, eps: float,
                 mlp_name: str = "mlp", attn_name: str = "self_attn", norm_offset: float = 0.0):
        super().__init__()
        self.attn_name = attn_name
        self.add_module(attn_name, attn)
        self.input_layernorm = RMSNorm(hidden, eps, norm_offset)
        self.post_attention_layernorm = RMSNorm(hidden, eps, norm_offset)
        self.mlp_name = mlp_name
        self.add_module(mlp_name, mlp)

    @property
    def mlp_module(self) -> nn.Module:
        return getattr(self, self.mlp_name)

    @property
    def attn_module(self) -> nn.Module:
        """The token mixer: Attention, or a layer with the same cache_spec()/forward(x, batch)."""
        return getattr(self, self.attn_name)

    def forward(self, x, residual, batch: ForwardBatch):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.attn_module(x, batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp_module(x), residual


class MoeModel(nn.Module):
    """`model.*` of a causal LM: embeddings, decoder layers, final norm."""

    def __init__(self, cfg: ModelConfig, make_layer, rope: RopeTable, norm_offset: float = 0.0):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(make_layer(cfg, i, rope) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, norm_offset)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x, residual = self.embed_tokens(batch.input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, batch)
        x, _ = self.norm(x, residual)
        return x


class MoeForCausalLM(nn.Module):
    """The top-level module every family builds: `model` + `lm_head` (tied or not)."""

    def __init__(self, cfg: ModelConfig, make_layer, lm_head_bias: bool = False,
                 norm_offset: float = 0.0):
        super().__init__()
        self.config = cfg
        # One table for every layer: the families here share one rope per model.
        self.rope = RopeTable(cfg.rope, cfg.head_dim)
        self.model = MoeModel(cfg, make_layer, self.rope, norm_offset)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=lm_head_bias)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Returns float32 logits [N, vocab] for the rows batch.logits_indices selects."""
        hidden = self.model(batch)
        return self.lm_head(hidden[batch.logits_indices]).float()

    def init_rope(self, max_positions: int, device) -> None:
        self.rope.build(max_positions, device)

    def cache_specs(self) -> dict[int, CacheSpec]:
        """Layer index -> what that layer keeps per token."""
        return {i: layer.attn_module.cache_spec() for i, layer in enumerate(self.model.layers)}

    def moe_blocks(self) -> dict[int, SparseMoeBlock]:
        """Decoder layer index -> its sparse MoE block, for the layers that have one."""
        return {i: layer.mlp_module for i, layer in enumerate(self.model.layers)
                if isinstance(layer.mlp_module, SparseMoeBlock)}
