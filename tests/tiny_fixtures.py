"""Tiny checkpoints from freetoken.demo.tiny_model, built once per test session.

Import the fixture into a test module (`from tiny_fixtures import tiny_model_dir`). The cache is
module-global, so test files that import it share one build per set of arguments.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from freetoken.demo.tiny_model import make_tiny_model

_BUILT: dict[tuple, Path] = {}


def _key(family: str, seed: int, name: str | None, shape: dict) -> tuple:
    return family, seed, name, tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                            for k, v in shape.items()))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(family="qwen3_moe", seed=0, name=None, **shape) -> the checkpoint folder
    (read-only: other tests share it). `name` is the folder's name, which `ft serve` serves the
    model as; None leaves it to pytest."""
    def build(family: str = "qwen3_moe", seed: int = 0, name: str | None = None, **shape) -> Path:
        key = _key(family, seed, name, shape)
        if key not in _BUILT:
            out = tmp_path_factory.mktemp(f"tiny-{family}-s{seed}")
            _BUILT[key] = make_tiny_model(out / name if name else out, family=family, seed=seed, **shape)
        return _BUILT[key]
    return build


def biased_experts(seed: int, t: int, d: int = 64, i: int = 32, e: int = 6, k: int = 2,
                   pool: int = 9) -> dict:
    """A routed MoE call on random bf16 experts, slots mapped and biased: x [t, d],
    w13 [pool, 2i, d], w2 [pool, d, i], b13, b2, top-k weights and ids over e experts, and
    the slot map of those e experts into the pool."""
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(pool, 2 * i, d, generator=g) * d ** -0.5).bfloat16()
    w2 = (torch.randn(pool, d, i, generator=g) * i ** -0.5).bfloat16()
    b13 = torch.randn(pool, 2 * i, generator=g).bfloat16()
    b2 = torch.randn(pool, d, generator=g).bfloat16()
    x = torch.randn(t, d, generator=g).bfloat16()
    weights, ids = torch.topk(torch.randn(t, e, generator=g).softmax(-1), k, dim=-1)
    slot_map = torch.randperm(pool, generator=g)[:e]
    return dict(x=x, w13=w13, w2=w2, b13=b13, b2=b2, weights=weights, ids=ids,
                slot_map=slot_map)


def amx_kernel_runs(kernel) -> bool:
    """Whether the native AMX MoE kernel (triton_kernels/cpu_amx.py) runs here: built with AMX,
    on a CPU and OS that grant the tiles."""
    import triton_kernels as tk
    from triton_kernels.cpu_amx import moe_amx
    if kernel is None or not tk.has_amx_bf16():
        return False
    c = biased_experts(seed=0, t=16, d=32, i=32, e=2, k=1, pool=2)
    return moe_amx(kernel, c["x"], c["w13"], c["w2"], c["weights"], c["ids"], c["slot_map"],
                   None, None, tk.SILU) is not None


def fp8_bank(w, bn, bk):
    """w [E, N, K] quantized to e4m3 with one float32 scale per (bn, bk) block (ragged at the
    edges), and its exact float32 decoding."""
    e, n, k = w.shape
    rb, cb = -(-n // bn), -(-k // bk)
    pad = torch.zeros(e, rb * bn, cb * bk)
    pad[:, :n, :k] = w.float()
    blocks = pad.view(e, rb, bn, cb, bk)
    s = blocks.abs().amax(dim=(2, 4)) / 448 + 1e-12                              # [E, rb, cb]
    q = (blocks / s[:, :, None, :, None]).view(e, rb * bn, cb * bk)[:, :n, :k]
    q = q.to(torch.float8_e4m3fn).contiguous()
    q.view(torch.uint8)[0, 0, :8] = torch.arange(8, dtype=torch.uint8)       # every subnormal
    q.view(torch.uint8)[0, 1, :8] = torch.arange(8, dtype=torch.uint8) | 0x80
    deq = q.float() * s.repeat_interleave(bn, 1)[:, :n].repeat_interleave(bk, 2)[:, :, :k]
    return q, s.contiguous(), deq


def float16_x_bound(kernel, x, deq_abs, s_max):
    """The most an fp8 product's sums move where this build meets e4m3 bytes with float16
    activations (kernel.e4m3_decode "float16 products", cpu_dot.h's FT_F8H), against the
    decoded weights' magnitudes deq_abs [N, K] (block scales at most s_max) -> [T, N] in
    float64: x rounded once to float16, then at most 16 product-adds and 3 chain sums a lane
    in float16, each within 2^-11 of its running sum (20 roundings of a term), and a float16
    subnormal's rounding, 2^-25 of sigma, at most 2^-27 max |x| s_max a term; zero where
    the bytes meet float32 x."""
    if kernel.e4m3_decode != "float16 products":
        return torch.zeros(x.shape[0], deq_abs.shape[0], dtype=torch.float64)
    k = x.shape[1]
    tiny = k * 2.0 ** -27 * x.double().abs().amax(1, keepdim=True) * s_max
    return (x.double().abs() @ deq_abs.double().T) * 20 * 2.0 ** -11 + tiny


def fp8_rel(kernel):
    """The relative error (norm of the difference over the reference's) an fp8 MoE's
    outputs keep to the float32 reference on the decoded weights: float32's sums' 1e-5, or
    2e-3 where x is rounded to float16 and summed there (FT_F8H; at most 2^-11 a rounding:
    its tests measure 2e-4 to 5e-4). A weight element missed or met twice moves K^-1/2 of it."""
    return 2e-3 if kernel.e4m3_decode == "float16 products" else 1e-5


def int16_x_bound(kernel, x, w_abs, group):
    """The most an int4 product's sums move where this build rounds 16-bit activations to
    int16 per group (kernel.int4_activations "int16", cpu_dot.h's i4w): |x - xq sx| <= max |x|
    / 65534 of each group of x [T, K], against the weights' magnitudes w_abs [N, K] -> [T, N]
    in float64; zero where the activations meet the nibbles as they are."""
    if kernel.int4_activations != "int16":
        return torch.zeros(x.shape[0], w_abs.shape[0], dtype=torch.float64)
    amax = x.double().abs().view(x.shape[0], -1, group).amax(-1)
    unit = (amax / 65534 * (1 + 2.0 ** -10)).repeat_interleave(group, 1)
    return unit @ w_abs.double().T
