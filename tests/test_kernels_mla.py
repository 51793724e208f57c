"""MLA attention over the paged latent cache (triton_kernels/mla_attention.py): the reference
against a naive float64 MLA written out here, the Triton kernels against the reference
(interpreter on CPU in float32 and float16 at tiny dims, L 32 / R 16, H 3-5 and 20; compiled
kernels on a GPU), and write_latent."""

import math

import pytest
import torch

from test_kernels import DTYPES, TOL_ACCUM, _kernel_device, _seed, assert_close  # noqa: F401
import importlib

import triton_kernels as tk
from triton_kernels.mla_attention import (mla_attention_reference, mla_attention_triton,
                                          write_latent_reference, write_latent_triton)

pytestmark = pytest.mark.usefixtures("kernel_device")

mla_module = importlib.import_module("triton_kernels.mla_attention")


def _mla_batch(q_lens, ctxs, h, l, r, dtype, bs=16):
    """q [T, H, L+R] and a latent cache whose blocks are handed out in shuffled order, tables
    -1 padded (as the engine's)."""
    blocks_needed = [math.ceil(c / bs) for c in ctxs]
    num_blocks = sum(blocks_needed) + 3
    cache = torch.randn(num_blocks, bs, l + r, dtype=dtype)
    pool = torch.randperm(num_blocks).tolist()
    table = torch.full((len(ctxs), max(blocks_needed) + 2), -1, dtype=torch.int32)
    for b, n in enumerate(blocks_needed):
        table[b, :n] = torch.tensor(pool[:n], dtype=torch.int32)
        pool = pool[n:]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), h, l + r, dtype=dtype)
    return q, cache, table, cu, torch.tensor(ctxs, dtype=torch.int32)


def naive_mla(q, cache, table, cu, seq_lens, scale, l):
    """Float64, one sequence and one query at a time: the score split into its latent and
    rope parts as the model writes it, softmax over keys 0..p, output in latent space."""
    bs = cache.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], l, dtype=torch.float64)
    for b, ctx in enumerate(seq_lens.tolist()):
        lo, hi = int(cu[b]), int(cu[b + 1])
        keys = torch.cat([cache[int(table[b, j // bs]), j % bs][None] for j in range(ctx)])
        c_kv, k_pe = keys[:, :l].double(), keys[:, l:].double()            # [ctx, L], [ctx, R]
        for i in range(lo, hi):
            p = ctx - (hi - lo) + (i - lo)
            qi = q[i].double()                                              # [H, L+R]
            s = (qi[:, :l] @ c_kv[:p + 1].T + qi[:, l:] @ k_pe[:p + 1].T) * scale
            out[i] = torch.softmax(s, dim=-1) @ c_kv[:p + 1]
    return out.to(q.dtype)


# (q_lens, ctxs, H, L, R, block size): block boundaries, odd lengths, a cached prefix under a
# prefill chunk, decodes and prefills mixed in one batch, an empty q span.
REFERENCE_CASES = [
    ([1], [1], 3, 32, 16, 16),                                   # first token, one key
    ([1, 1, 1], [16, 17, 33], 5, 32, 16, 16),                    # decodes at block edges
    ([7, 1, 12, 0, 1], [7, 40, 29, 5, 3], 4, 24, 8, 8),          # mixed prefill / decode
    ([16], [16], 20, 32, 16, 16),                                # a whole block, 20 heads
]


@pytest.mark.parametrize("q_lens,ctxs,h,l,r,bs", REFERENCE_CASES)
def test_reference_matches_naive_mla(q_lens, ctxs, h, l, r, bs):
    q, cache, table, cu, seq_lens = _mla_batch(q_lens, ctxs, h, l, r, torch.float32, bs)
    scale = 0.7 / math.sqrt(l + r)
    got = mla_attention_reference(q, cache, table, cu, seq_lens, scale, l)
    assert_close(got, naive_mla(q, cache, table, cu, seq_lens, scale, l), atol=1e-5, rtol=1e-5,
                 what="reference vs naive float64 MLA")


def test_reference_is_paged_mqa_over_the_latent():
    """The model helper's stand-in today: paged_attention_reference with one kv head, K the
    whole latent and V its first L values. The MLA reference must agree with it."""
    q, cache, table, cu, seq_lens = _mla_batch([5, 1, 9], [21, 13, 9], 4, 32, 16,
                                               torch.float32)
    scale = 0.2
    want = tk.paged_attention_reference(q, cache[:, :, None, :], cache[:, :, None, :32], table,
                                        cu, seq_lens, scale)
    got = mla_attention_reference(q, cache, table, cu, seq_lens, scale, 32)
    assert_close(got, want, atol=1e-5, rtol=1e-5, what="MLA vs paged MQA reference")


def test_public_op_on_cpu_is_the_reference():
    q, cache, table, cu, seq_lens = _mla_batch([3, 1], [10, 4], 3, 32, 16, torch.float32)
    got = tk.mla_attention(q, cache, table, cu, seq_lens, 0.3, 32, 3)
    assert got.shape == (4, 3, 32) and got.dtype == torch.float32
    assert_close(got, mla_attention_reference(q, cache, table, cu, seq_lens, 0.3, 32), atol=0,
                 rtol=0)


def test_write_latent_reference():
    cache = torch.zeros(4, 8, 48)
    latent = torch.randn(5, 48)
    slots = torch.tensor([3, -1, 17, 31, 8])
    write_latent_reference(latent, cache, slots)
    flat = cache.view(-1, 48)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s], latent[i])
    assert int((flat.abs().sum(-1) > 0).sum()) == 4           # the skipped token wrote nothing
    with pytest.raises(ValueError, match="write_latent"):
        write_latent_reference(latent[:, :40], cache, slots)    # not the cache's L + R


@pytest.mark.parametrize("bad", ["rank", "cache", "table"])
def test_bad_arguments_raise(bad):
    q, cache, table, cu, seq_lens = _mla_batch([2], [5], 3, 32, 16, torch.float32)
    rank = 48 if bad == "rank" else 32
    if bad == "cache":
        cache = cache[..., :40]
    if bad == "table":
        table = table[:, None]
    with pytest.raises(ValueError, match="mla_attention"):
        mla_attention_reference(q, cache, table, cu, seq_lens, 0.3, rank)


# ---- Triton kernels ---------------------------------------------------------------------------
# (q_lens, ctxs, H, L, R, block size). Interpreted tiles: 16 heads x 2 tokens a prefill
# program, 16 keys a step, so 20 heads take two head blocks (the second ragged).
TRITON_CASES = [
    ([7], [7], 3, 32, 16, 16),                                   # one fresh prompt
    ([5, 1, 0, 3], [37, 16, 9, 3], 5, 24, 8, 8),                 # mixed; L 24, R 8 padded
    ([1, 1, 1], [1, 33, 50], 20, 32, 16, 16),                    # decodes, two head blocks
    ([6, 1], [21, 12], 20, 32, 16, 16),                          # prefill, two head blocks
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_lens,ctxs,h,l,r,bs", TRITON_CASES)
def test_mla_triton_matches_reference(q_lens, ctxs, h, l, r, bs, dtype):
    q, cache, table, cu, seq_lens = _mla_batch(q_lens, ctxs, h, l, r, dtype, bs)
    scale = 0.5 / math.sqrt(l + r)
    want = mla_attention_reference(q, cache, table, cu, seq_lens, scale, l)
    got = mla_attention_triton(q, cache, table, cu, seq_lens, scale, l, max(q_lens))
    assert_close(got, want, **TOL_ACCUM[dtype], what="triton vs reference")


def test_mla_triton_split_kv_decode(monkeypatch):
    """Long decodes through split-KV + the reduce: a smaller minimum split makes this 300-key
    context split in the interpreter (the plan's split count is asserted, so the path runs)."""
    monkeypatch.setattr(mla_module, "_MIN_SPLIT_TOKENS", 64)
    assert mla_module.mla_split_plan(2, 1, 304, 132)[0] > 1
    q, cache, table, cu, seq_lens = _mla_batch([1, 1], [300, 70], 4, 32, 16, torch.float32, 16)
    want = mla_attention_reference(q, cache, table, cu, seq_lens, 0.1, 32)
    got = mla_attention_triton(q, cache, table, cu, seq_lens, 0.1, 32, 1)
    assert_close(got, want, **TOL_ACCUM[torch.float32], what="split decode vs reference")


def test_mla_split_plan():
    # Short contexts stay in one program; long ones split into aligned chunks covering it all.
    assert mla_module.mla_split_plan(1, 4, 200, 132) == (1, 256)
    splits, tokens = mla_module.mla_split_plan(1, 4, 32768, 132)
    assert 1 < splits <= mla_module._MAX_SPLITS and tokens % 64 == 0
    assert splits * tokens >= 32768 > (splits - 1) * tokens
    assert mla_module.mla_split_plan(64, 4, 32768, 132)[0] == 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_latent_triton(dtype):
    cache = torch.zeros(5, 8, 40, dtype=dtype)
    latent = torch.randn(6, 2, 40, dtype=dtype)[:, 1]             # strided rows
    slots = torch.tensor([3, -1, 17, 39, 8, 0])
    want = cache.clone()
    write_latent_reference(latent, want, slots)
    write_latent_triton(latent, cache, slots)
    assert torch.equal(cache, want)
