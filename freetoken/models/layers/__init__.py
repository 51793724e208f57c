"""Building blocks the families share, one idea a file: norm, attention over the paged KV
cache, multi-head latent attention over a paged latent cache, Gated DeltaNet linear attention
over per-request state slots, the dense MLP, the router, the sparse MoE block with its expert
bank, and the decoder stack. Parameter names follow Hugging Face so checkpoint keys map directly.

Every hot op goes through triton_kernels, which runs the Triton kernel on CUDA and the torch
reference elsewhere. Shapes: T tokens, D hidden, Hq/Hk query/kv heads of Dh, E experts, I width.
"""

from freetoken.models.layers.attention import Attention, AttentionConfig
from freetoken.models.layers.decoder import DecoderLayer, MoeForCausalLM, MoeModel
from freetoken.models.layers.linear_attention import GatedDeltaNet, LinearAttentionConfig
from freetoken.models.layers.mla import MlaAttention, MlaConfig
from freetoken.models.layers.mlp import DenseMLP
from freetoken.models.layers.moe import ExpertBank, SparseMoeBlock
from freetoken.models.layers.norm import RMSNorm
from freetoken.models.layers.router import Router, RouterConfig

__all__ = ["Attention", "AttentionConfig", "DecoderLayer", "MoeForCausalLM", "MoeModel",
           "GatedDeltaNet", "LinearAttentionConfig", "MlaAttention", "MlaConfig",
           "DenseMLP", "ExpertBank", "SparseMoeBlock", "RMSNorm", "Router", "RouterConfig"]
