"""Paged attention's sliding window, attention sinks and V head dim != K head dim: the Triton
kernels against the torch reference, and the reference against a dense float64 attention
written out here (so the reference itself is checked). Interpreter on CPU (float32, float16),
compiled kernels on a GPU, as in test_kernels.py."""

import math

import pytest
import torch

from test_kernels import (DTYPES, TOL, TOL_ACCUM, _kernel_device, _paged_batch, _seed,  # noqa: F401
                          assert_close)
from triton_kernels.paged_attention import (decode_split_plan, paged_attention_reference,
                                            paged_attention_triton)


def _batch(q_lens, ctxs, hq, hk, d, dtype, dv=None, bs=16):
    q, k_cache, v_cache, table, cu, seq_lens = _paged_batch(q_lens, ctxs, hq, hk, d, dtype, bs)
    if dv is not None:
        v_cache = torch.randn(*k_cache.shape[:3], dv, dtype=dtype)
    return q, k_cache, v_cache, table, cu, seq_lens


def naive_attention(q, k_cache, v_cache, table, cu, seq_lens, scale, window=None, sinks=None):
    """Dense float64 attention, one sequence at a time, HF's rules spelled out: query p sees
    key j iff j <= p and p - j < window; the sink is one more logit per head, dropped after
    the softmax."""
    hq, hk, bs = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    out = torch.zeros(q.shape[0], hq, v_cache.shape[3], dtype=torch.float64)
    for b, ctx in enumerate(seq_lens.tolist()):
        lo, hi = int(cu[b]), int(cu[b + 1])
        if hi == lo:
            continue
        blocks = table[b, : math.ceil(ctx / bs)].long()
        k = k_cache[blocks].flatten(0, 1)[:ctx].double().repeat_interleave(hq // hk, dim=1)
        v = v_cache[blocks].flatten(0, 1)[:ctx].double().repeat_interleave(hq // hk, dim=1)
        q_pos = torch.arange(ctx - (hi - lo), ctx)[:, None]
        j = torch.arange(ctx)[None, :]
        visible = j <= q_pos
        if window is not None:
            visible &= q_pos - j < window
        s = torch.einsum("ihd,jhd->hij", q[lo:hi].double(), k) * scale     # [Hq, n_q, ctx]
        s = s.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.double()[:, None, None].expand(hq, hi - lo, 1)
            s = torch.cat([s, sink], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :ctx]
        out[lo:hi] = torch.einsum("hij,jhd->ihd", p, v)
    return out.to(q.dtype)


def _check(q_lens, ctxs, hq, hk, d, dtype, window=None, with_sinks=False, dv=None, bs=16):
    q, k_cache, v_cache, table, cu, seq_lens = _batch(q_lens, ctxs, hq, hk, d, dtype, dv, bs)
    sinks = 2 * torch.randn(hq) if with_sinks else None
    scale = d ** -0.5
    kw = dict(sliding_window=window, sinks=sinks)
    args = (q, k_cache, v_cache, table, cu, seq_lens, scale)
    want = paged_attention_reference(*args, **kw)
    assert_close(want, naive_attention(*args, window, sinks), **TOL_ACCUM[dtype],
                 what="reference vs dense")
    got = paged_attention_triton(*args, max(q_lens), **kw)
    assert_close(got, want, **TOL_ACCUM[dtype], what="triton vs reference")
    return got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_lens,ctxs,hq,hk,d,window", [
    ([7], [7], 4, 4, 64, 3),                               # window < block size, MHA
    ([30, 5], [30, 5], 6, 2, 80, 16),                      # window == block size, GQA 3
    ([20], [20], 8, 2, 64, 100),                           # window > context, GQA 4
    ([5, 20, 1, 0], [40, 60, 17, 9], 8, 2, 64, 7),         # chunked prefill over cached prefixes
    ([33], [150], 3, 3, 48, 40),                           # the window spans several tiles
    ([45], [45], 4, 1, 64, 1),                             # each query sees itself only
])
def test_prefill_sliding_window(q_lens, ctxs, hq, hk, d, window, dtype):
    _check(q_lens, ctxs, hq, hk, d, dtype, window=window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ctxs,hq,hk,d,window", [
    ([1, 17, 40], 8, 8, 64, 16),                           # window == block size, one split
    ([700, 3, 65], 8, 1, 80, 5),                           # long context, small window
    ([900, 1, 300], 12, 4, 64, 600),                       # long context, window split many ways
    ([50, 9], 6, 2, 64, 1000),                             # window > context
])
def test_decode_sliding_window(ctxs, hq, hk, d, window, dtype):
    _check([1] * len(ctxs), ctxs, hq, hk, d, dtype, window=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_lens,ctxs,window,with_sinks", [
    ([1], [80], None, False),                              # batch-1 decode: no mask at all
    ([1, 1, 1], [33, 33, 33], None, False),                # equal lengths: no mask
    ([1, 1, 1], [5, 70, 16], None, False),                 # unequal: padding masked
    ([1, 1], [40, 90], 24, True),                          # window and sinks
    ([1, 4, 1], [20, 9, 50], None, False),                 # decodes beside a prefill chunk
    ([1, 0, 1], [20, 9, 50], None, False),                 # a sequence with no query
    ([600, 1], [700, 40], 64, True),                       # prefill with sinks: 256-query passes
    ([300], [300], None, True),                            # (the last pass 44 queries)
])
def test_reference_decode_matches_dense(q_lens, ctxs, window, with_sinks, dtype):
    """The CPU's decode (float32 SDPA over gathered blocks) and its prefill with sinks (the
    math spelled out, 256 queries a pass over the keys they see) against the dense float64
    math, in bf16 too: the CPU serves bf16 models with it."""
    q, k_cache, v_cache, table, cu, seq_lens = _batch(q_lens, ctxs, 8, 2, 64, dtype)
    sinks = 2 * torch.randn(8) if with_sinks else None
    args = (q, k_cache, v_cache, table, cu, seq_lens, 0.125)
    got = paged_attention_reference(*args, sliding_window=window, sinks=sinks)
    assert got.dtype == dtype and got.shape == q.shape
    # float32 throughout, one rounding: within the elementwise tolerance of the dtype
    assert_close(got, naive_attention(*args, window, sinks), **TOL[dtype], what="reference vs dense")


def test_decode_window_split_plan_splits_the_window_only():
    # A 4096-key table but a 128-key window: as few splits as 128 keys need, not 4096.
    assert decode_split_plan(1, 8, min(4096, 128), block_n=64)[0] == 1
    splits, tokens = decode_split_plan(1, 1, 600, block_n=16)
    assert splits > 4 and splits * tokens >= 600


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_lens,ctxs,hq,hk,d,window", [
    ([7, 1], [7, 1], 4, 4, 64, None),                      # prefill, sinks alone
    ([5, 20, 0], [40, 60, 9], 6, 2, 64, None),             # chunked prefill
    ([1, 1, 1], [1, 40, 700], 8, 2, 64, None),             # decode: single split and split-KV
    ([9, 30], [9, 70], 8, 2, 64, 16),                      # sinks + window, prefill
    ([1, 1], [900, 33], 8, 4, 64, 300),                    # sinks + window, split decode
    ([1, 1], [500, 3], 4, 1, 64, 8),                       # sinks + small window, one split
])
def test_attention_sinks(q_lens, ctxs, hq, hk, d, window, dtype):
    _check(q_lens, ctxs, hq, hk, d, dtype, window=window, with_sinks=True)


def test_sinks_in_model_dtype_and_a_sink_that_dominates():
    q, k_cache, v_cache, table, cu, seq_lens = _batch([1, 6], [300, 6], 4, 2, 64, torch.float16)
    args = (q, k_cache, v_cache, table, cu, seq_lens, 0.125)
    sinks = torch.tensor([0.0, 30.0, -30.0, 3.0], dtype=torch.float16)   # head 1 ~ all sink
    want = paged_attention_reference(*args, sinks=sinks)
    assert_close(want, naive_attention(*args, None, sinks), **TOL_ACCUM[torch.float16],
                 what="reference vs dense")
    got = paged_attention_triton(*args, 6, sinks=sinks)
    assert_close(got, want, **TOL_ACCUM[torch.float16], what="triton vs reference")
    assert got[:, 1].abs().max() < 1e-3, "a sink far above every score leaves ~no mass"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_lens,ctxs,hq,hk,d,dv,window,with_sinks", [
    ([7, 20], [7, 50], 4, 2, 96, 64, None, False),         # prefill, DeepSeek-like Dk > Dv
    ([13], [13], 3, 1, 48, 80, None, False),               # Dv > Dk, both padded
    ([1, 1, 1], [1, 40, 700], 8, 2, 96, 64, None, False),  # decode, split-KV
    ([9, 1], [40, 500], 4, 4, 48, 32, 20, True),           # with window and sinks
])
def test_v_head_dim_differs(q_lens, ctxs, hq, hk, d, dv, window, with_sinks, dtype):
    got = _check(q_lens, ctxs, hq, hk, d, dtype, window=window, with_sinks=with_sinks, dv=dv)
    assert got.shape == (sum(q_lens), hq, dv)


@pytest.mark.parametrize("q_lens,ctxs", [([1, 1], [700, 130]), ([40, 5], [300, 200])])
def test_window_never_reads_tiles_before_it(q_lens, ctxs):
    # NaN in every key and value wholly before each sequence's window, at 64-key granularity
    # (the GPU's widest tile; the interpreter's 16-key tiles start no earlier). A kernel that
    # read and masked them would still turn p = 0 times v = NaN into NaN.
    window = 50
    q, k_cache, v_cache, table, cu, seq_lens = _batch(q_lens, ctxs, 4, 2, 64, torch.float32)
    bs = k_cache.shape[1]
    for b, (n_q, ctx) in enumerate(zip(q_lens, ctxs)):
        cut = max(0, ctx - n_q - window + 1) // 64 * 64
        for j in range(cut):
            blk = int(table[b, j // bs])
            k_cache[blk, j % bs] = float("nan")
            v_cache[blk, j % bs] = float("nan")
    args = (q, k_cache, v_cache, table, cu, seq_lens, 0.125)
    want = paged_attention_reference(*args, sliding_window=window)
    got = paged_attention_triton(*args, max(q_lens), sliding_window=window)
    assert not torch.isnan(want).any() and not torch.isnan(got).any()
    assert_close(got, want, **TOL_ACCUM[torch.float32])


def test_bad_window_and_sinks_are_rejected():
    q, k_cache, v_cache, table, cu, seq_lens = _batch([1], [5], 4, 2, 64, torch.float32)
    args = (q, k_cache, v_cache, table, cu, seq_lens, 0.125)
    for op in (paged_attention_reference, paged_attention_triton):
        with pytest.raises(ValueError, match="sliding_window"):
            op(*args, sliding_window=0)
        with pytest.raises(ValueError, match="sinks"):
            op(*args, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="caches"):
        paged_attention_triton(q, k_cache, v_cache[:, :8], table, cu, seq_lens, 0.125)


def test_cpu_references_take_an_empty_batch_and_8bit_caches():
    from triton_kernels.kv_write import write_kv_reference
    k_cache = torch.randn(4, 16, 2, 8)
    out = paged_attention_reference(torch.randn(0, 4, 8), k_cache, k_cache.clone(),
                                    torch.zeros(0, 3, dtype=torch.int32),
                                    torch.zeros(1, dtype=torch.int32),
                                    torch.zeros(0, dtype=torch.int32), 0.3)
    assert out.shape == (0, 4, 8)
    # index_copy_ has no 8-bit CPU kernel: such caches take the indexed write.
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    caches = [torch.zeros(4, 16, 2, 8, dtype=torch.float8_e4m3fn) for _ in range(2)]
    slots = torch.tensor([3, 0, 9], dtype=torch.int32)
    write_kv_reference(k, v, *caches, slots)
    for cache, want in zip(caches, (k, v)):
        assert torch.equal(cache.view(-1, 2, 8)[slots.long()].float(),
                           want.to(torch.float8_e4m3fn).float())
