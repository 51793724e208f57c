"""The RoPE table: cos and sin of position * inv_freq, per the checkpoint's rope type.

Built once per model as a [P, R] float32 tensor (first R/2 columns cos, last R/2 sin) that
triton_kernels.apply_rope indexes by position. The inverse frequencies follow Hugging Face's
definitions so positions rotate identically.
"""

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


def inverse_frequencies(rope: dict, head_dim: int) -> tuple[torch.Tensor, float, int]:
    """Returns (inv_freq [R/2] float32, attention scaling of cos/sin, rotary dim R)."""
    rtype = rope.get("rope_type", "default")
    base = float(rope["rope_theta"])
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (base ** exponents)
    scaling = 1.0
    if rtype == "default":
        pass
    elif rtype == "linear":
        inv_freq = inv_freq / float(rope["factor"])
    elif rtype == "yarn":
        inv_freq, scaling = _yarn(rope, dim, base)
    elif rtype == "llama3":
        inv_freq = _llama3(rope, inv_freq)
    else:
        raise ValueError(f"unsupported rope_type {rtype!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return inv_freq, scaling, dim


def _yarn(rope: dict, dim: int, base: float):
    factor = float(rope["factor"])
    orig = rope["original_max_position_embeddings"]

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = rope.get("attention_factor")
    if attn is None:
        if rope.get("mscale") and rope.get("mscale_all_dim"):
            attn = mscale(factor, rope["mscale"]) / mscale(factor, rope["mscale_all_dim"])
        else:
            attn = mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation_weight = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv, float(attn)


def softmax_mscale(rope: dict) -> float:
    """The factor on the attention softmax scale that DeepSeek's YaRN adds (mscale^2 with
    mscale = 0.1 * mscale_all_dim * ln(factor) + 1) when rope scaling sets mscale_all_dim; 1.0
    otherwise. It is separate from the cos/sin scaling above, which is mscale / mscale_all_dim
    of the same formula, and applies to any scaled rope type, as Hugging Face applies it."""
    m_all = rope.get("mscale_all_dim")
    if rope.get("rope_type", "default") == "default" or not m_all:
        return 1.0
    factor = float(rope["factor"])
    m = 1.0 if factor <= 1 else 0.1 * float(m_all) * math.log(factor) + 1.0
    return m * m


def _llama3(rope: dict, inv_freq: torch.Tensor) -> torch.Tensor:
    factor = rope["factor"]
    low_freq_wavelen = rope["original_max_position_embeddings"] / rope["low_freq_factor"]
    high_freq_wavelen = rope["original_max_position_embeddings"] / rope["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    out = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (rope["original_max_position_embeddings"] / wavelen - rope["low_freq_factor"]) / (
        rope["high_freq_factor"] - rope["low_freq_factor"])
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, out)


def build_cos_sin(rope: dict, head_dim: int, max_positions: int, device) -> torch.Tensor:
    inv_freq, scaling, _ = inverse_frequencies(rope, head_dim)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    table = torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)   # [P, R]
    return table.to(device)


class RopeTable:
    """A model's RoPE table: built once the engine knows the context length (`build`), then
    read by every attention layer that shares it (`cos_sin` [P, R])."""

    def __init__(self, rope: dict, head_dim: int):
        self.rope, self.head_dim = rope, head_dim
        self.cos_sin: torch.Tensor | None = None
        inverse_frequencies(rope, head_dim)       # an unsupported rope type fails at build time

    def build(self, max_positions: int, device) -> None:
        self.cos_sin = build_cos_sin(self.rope, self.head_dim, max_positions, device)
