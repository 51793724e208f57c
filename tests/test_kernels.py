"""Each Triton kernel against its torch reference, on odd shapes: float32 and float16 in the
interpreter, float16 and bfloat16 on a GPU.

Without a GPU the launchers run in Triton's interpreter on CPU tensors (conftest.py sets
TRITON_INTERPRET=1 before triton_kernels imports), so shapes stay small where the point is the
tiling logic. bfloat16 runs only on a GPU: the interpreter's bf16 loads return garbage. On a
GPU the autotuned kernels run one fixed config here (tuning every shape tried would take
minutes); bench/kernels.py checks the tuned configs' outputs.
"""

import importlib
import math

import pytest
import torch

import triton_kernels as tk
from triton_kernels.fused_moe import (_GEMV_MAX_TOKENS, FUSED_MOE_TOKEN_BUCKETS,
                                      fused_moe_autotune_keys, fused_moe_reference,
                                      fused_moe_triton, moe_align)
from triton_kernels.kv_write import write_kv_reference, write_kv_triton
from triton_kernels.paged_attention import (decode_split_plan, paged_attention_reference,
                                            paged_attention_triton)
from triton_kernels.rms_norm import rms_norm_reference, rms_norm_triton
from triton_kernels.rope import apply_rope_reference, apply_rope_triton
from triton_kernels.silu_mul import silu_and_mul_reference, silu_and_mul_triton
from triton_kernels.topk_softmax import topk_softmax_reference, topk_softmax_triton

# The module itself (the package's `fused_moe` attribute is the op), to patch its globals.
fused_moe_module = importlib.import_module("triton_kernels.fused_moe")

# On a GPU the serving dtypes, fast to compile (float32's "ieee" dots spill and take seconds
# each); the interpreter checks float32 and float16.
DTYPES = ([torch.float16, torch.bfloat16] if torch.cuda.is_available()
          else [torch.float32, torch.float16])


@pytest.fixture(autouse=True)
def _kernel_device():
    """On a GPU machine the same tests run the compiled kernels on CUDA tensors, autotuned
    kernels with one fixed config; without one, CPU tensors go through Triton's interpreter
    (conftest sets TRITON_INTERPRET)."""
    if torch.cuda.is_available():
        torch.set_default_device("cuda")
        with tk.fixed_configs_scope():
            yield
        torch.set_default_device("cpu")
    else:
        yield

# Elementwise and row-wise ops round the same way as their references: a few ulps at most.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
# Reductions over hundreds of terms in a different order (the MoE reference even accumulates
# its index_add in float16): a few float16 ulps of outputs around 1.
TOL_ACCUM = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=6e-3, rtol=6e-3),
             torch.bfloat16: dict(atol=5e-2, rtol=5e-2)}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float,
                 what: str = "output") -> None:
    """Like torch.testing.assert_close, but says how many elements differ and the worst one."""
    assert actual.shape == expected.shape, \
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a, e = actual.double(), expected.double()
    excess = (a - e).abs() - (atol + rtol * e.abs())
    excess = torch.where(torch.isnan(a) != torch.isnan(e), math.inf, excess.nan_to_num(nan=0.0))
    bad = excess > 0
    if bad.any():
        worst = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {a.numel()} elements differ beyond atol={atol} "
            f"rtol={rtol}; worst at {worst}: got {a[worst].item():.6g}, "
            f"expected {e[worst].item():.6g}")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---- rms_norm -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("t,d", [(1, 64), (7, 80), (127, 2048), (1000, 96)])
def test_rms_norm(t, d, with_residual, dtype):
    x = torch.randn(t, d, dtype=dtype)
    weight = 1 + 0.1 * torch.randn(d, dtype=dtype)
    residual = torch.randn(t, d, dtype=dtype) if with_residual else None
    got = rms_norm_triton(x, weight, 1e-6, residual)
    want = rms_norm_reference(x, weight, 1e-6, residual)
    if with_residual:
        assert_close(got[0], want[0], **TOL[dtype])
        assert_close(got[1], want[1], atol=0, rtol=0, what="new residual")
    else:
        assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rms_norm_reference_is_hf_norm_bit_for_bit(dtype):
    # The reference is torch's fused rms_norm; HF's Qwen/Mixtral norm spelled out is the
    # oracle (float32 statistics, rounded to x's dtype, then the weight; a float32 weight
    # promotes), at decode rows, prefill rows and per-head rows.
    g = torch.Generator(device="cpu").manual_seed(5)      # drawn on the CPU on a GPU machine too
    for shape, wdtype in [((1, 1024), dtype), ((300, 1024), dtype), ((16, 64), dtype),
                          ((5, 96), torch.float32)]:
        x = (3 * torch.randn(*shape, generator=g, device="cpu")).to(dtype)
        w = torch.randn(shape[-1], generator=g, device="cpu").to(wdtype)
        h = x.float()
        want = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        got = rms_norm_reference(x, w, 1e-6)
        assert got.dtype == want.dtype and torch.equal(got, want), (shape, wdtype)


def test_rms_norm_float32_weight_promotes_and_strided_rows():
    x = torch.randn(7, 2, 96, dtype=torch.float16)[:, 1]           # row stride 192
    weight = torch.randn(96)
    got = rms_norm_triton(x, weight, 1e-5)
    assert got.dtype == torch.float32
    assert_close(got, rms_norm_reference(x, weight, 1e-5), **TOL[torch.float16])


# ---- rope -----------------------------------------------------------------------------------

@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 7, 127])
@pytest.mark.parametrize("hq,hk,d,rot", [(8, 2, 64, 64), (4, 4, 80, 80), (16, 2, 128, 64)])
def test_rope(t, hq, hk, d, rot, dtype, interleaved):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    angles = torch.arange(4096).float()[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    positions = torch.randint(0, 4096, (t,))
    q, k = torch.randn(t, hq, d, dtype=dtype), torch.randn(t, hk, d, dtype=dtype)
    q_ref, k_ref = apply_rope_reference(q.clone(), k.clone(), positions, cos_sin, interleaved)
    q_out, k_out = apply_rope_triton(q, k, positions, cos_sin, interleaved)
    assert q_out is q and k_out is k, "rope must rotate in place"
    assert_close(q, q_ref, **TOL[dtype], what="q")
    assert_close(k, k_ref, **TOL[dtype], what="k")


def test_rope_reference_layouts_match_a_naive_rotation():
    # Pair i rotated by angle position * inv_freq[i]: NeoX pairs (i, R/2 + i), interleaved (2i, 2i+1).
    rot, d = 8, 12
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    positions = torch.tensor([0, 3, 17])
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    table = torch.zeros(32, rot)
    table[positions] = cos_sin
    for interleaved in (False, True):
        q = torch.randn(3, 2, d)
        want = q.clone()
        for t in range(3):
            for i in range(rot // 2):
                a, b = (2 * i, 2 * i + 1) if interleaved else (i, rot // 2 + i)
                c, s = angles[t, i].cos(), angles[t, i].sin()
                want[t, :, a] = q[t, :, a] * c - q[t, :, b] * s
                want[t, :, b] = q[t, :, b] * c + q[t, :, a] * s
        got, _ = apply_rope_reference(q.clone(), torch.randn(3, 1, d), positions, table, interleaved)
        assert_close(got, want, atol=1e-6, rtol=1e-6, what=f"interleaved={interleaved}")


# ---- silu_and_mul ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,i", [(1, 48), (7, 768), (127, 80), (1000, 64)])
def test_silu_and_mul(t, i, dtype):
    x = 3 * torch.randn(t, 2 * i, dtype=dtype)
    assert_close(silu_and_mul_triton(x), silu_and_mul_reference(x), **TOL[dtype])


# ---- topk_softmax ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("t,e,k", [(1, 6, 1), (7, 60, 4), (127, 128, 8), (1000, 256, 8)])
def test_topk_softmax(t, e, k, renormalize, dtype):
    # Distinct logits per row (multiples of 1/32, exact in float16): no ties to break.
    logits = torch.stack([torch.randperm(e) for _ in range(t)]).float() * (8.0 / e) - 4.0
    logits = (torch.round(logits * 32) / 32).to(dtype)
    w, ids = topk_softmax_triton(logits, k, renormalize)
    w_ref, ids_ref = topk_softmax_reference(logits, k, renormalize)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    mismatched = (ids != ids_ref).sum().item()
    assert mismatched == 0, f"{mismatched} of {ids.numel()} expert ids differ"
    assert_close(w, w_ref, atol=1e-6, rtol=1e-5)


# ---- write_kv -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,hk,d", [(1, 2, 64), (7, 4, 80), (127, 1, 128), (1000, 2, 64)])
def test_write_kv(t, hk, d, dtype):
    num_blocks, bs = (t + 40) // 16 + 2, 16
    k_cache = torch.randn(num_blocks, bs, hk, d, dtype=dtype)
    v_cache = torch.randn(num_blocks, bs, hk, d, dtype=dtype)
    k, v = torch.randn(t, hk, d, dtype=dtype), torch.randn(t, hk, d, dtype=dtype)
    slots = torch.randperm(num_blocks * bs)[:t]
    slots[torch.rand(t) < 0.2] = -1
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_reference(k, v, k_ref, v_ref, slots)
    write_kv_triton(k, v, k_cache, v_cache, slots)
    assert_close(k_cache, k_ref, atol=0, rtol=0, what="k_cache")
    assert_close(v_cache, v_ref, atol=0, rtol=0, what="v_cache")


def test_write_kv_casts_into_a_float16_cache_from_strided_inputs():
    kv = torch.randn(7, 2, 4, 64)                      # k and v as views of a fused [T, 2, Hk, D]
    k, v = kv[:, 0], kv[:, 1]
    k_cache = torch.zeros(4, 8, 4, 64, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 9, -1, 31, 0, 17, 8], dtype=torch.int32)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_reference(k, v, k_ref, v_ref, slots.long())
    write_kv_triton(k, v, k_cache, v_cache, slots)
    assert_close(k_cache, k_ref, atol=0, rtol=0, what="k_cache")
    assert_close(v_cache, v_ref, atol=0, rtol=0, what="v_cache")


# ---- paged_attention ------------------------------------------------------------------------

def _paged_batch(q_lens, ctxs, hq, hk, d, dtype, bs=16):
    """A batch over a cache whose blocks are handed out in shuffled order, tables -1 padded."""
    blocks_needed = [math.ceil(c / bs) for c in ctxs]
    num_blocks = sum(blocks_needed) + 5
    k_cache = torch.randn(num_blocks, bs, hk, d, dtype=dtype)
    v_cache = torch.randn(num_blocks, bs, hk, d, dtype=dtype)
    pool = torch.randperm(num_blocks).tolist()
    table = torch.full((len(ctxs), max(blocks_needed) + 2), -1, dtype=torch.int32)
    for b, n in enumerate(blocks_needed):
        table[b, :n] = torch.tensor(pool[:n], dtype=torch.int32)
        pool = pool[n:]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, dtype=dtype)
    return q, k_cache, v_cache, table, cu, torch.tensor(ctxs, dtype=torch.int32)


def _check_attention(q_lens, ctxs, hq, hk, d, dtype, bs=16, hint=True):
    q, k_cache, v_cache, table, cu, seq_lens = _paged_batch(q_lens, ctxs, hq, hk, d, dtype, bs)
    scale = d ** -0.5
    got = paged_attention_triton(q, k_cache, v_cache, table, cu, seq_lens, scale,
                                 max(q_lens) if hint else None)
    want = paged_attention_reference(q, k_cache, v_cache, table, cu, seq_lens, scale)
    assert_close(got, want, **TOL_ACCUM[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_lens,ctxs,hq,hk,d", [
    ([7], [7], 4, 4, 64),                                  # one fresh prompt, MHA
    ([1, 30, 5], [1, 30, 5], 8, 4, 80),                    # fresh prompts, GQA 2, D 80 padded
    ([127], [127], 8, 1, 64),                              # GQA 8 over 127 tokens
    ([5, 20, 1, 0], [40, 60, 17, 9], 8, 2, 128),           # chunked prefill over cached prefixes
])
def test_paged_attention_prefill(q_lens, ctxs, hq, hk, d, dtype):
    _check_attention(q_lens, ctxs, hq, hk, d, dtype)


@pytest.mark.parametrize("bs", [8, 32])
def test_paged_attention_prefill_block_sizes_and_no_hint(bs):
    _check_attention([9, 3], [50, 3], 4, 2, 64, torch.float32, bs=bs, hint=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ctxs,hq,hk,d", [
    ([1, 17, 40], 8, 8, 64),                               # short: one split, no reduce
    ([700, 3, 65], 8, 1, 80),                              # long: split-KV + reduce, GQA 8
    ([900, 1, 300], 16, 4, 128),                           # long, GQA 4
])
def test_paged_attention_decode(ctxs, hq, hk, d, dtype):
    _check_attention([1] * len(ctxs), ctxs, hq, hk, d, dtype)


def test_decode_split_plan_splits_long_contexts_only():
    splits, tokens = decode_split_plan(3, 1, 46 * 16, block_n=16)
    assert splits > 1 and splits * tokens >= 46 * 16 and tokens % 16 == 0
    assert decode_split_plan(3, 8, 3 * 16, block_n=16)[0] == 1
    # Many sequences already fill the GPU: no split even for long contexts.
    assert decode_split_plan(512, 8, 4096, block_n=64)[0] == 1


# ---- fused_moe ------------------------------------------------------------------------------

def _moe_inputs(t, d, inter, e, k, pool, dtype):
    slots = pool or e
    x = torch.randn(t, d, dtype=dtype)
    w13 = (torch.randn(slots, 2 * inter, d) / d ** 0.5).to(dtype)
    w2 = (torch.randn(slots, d, inter) / inter ** 0.5).to(dtype)
    weights, ids = torch.topk(torch.randn(t, e).softmax(-1), k, dim=-1)
    # A permutation of the experts into a larger pool, as the GPU expert cache hands out.
    slot_map = torch.randperm(slots)[:e] if pool else None
    return x, w13, w2, weights, ids, slot_map


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,d,inter,e,k,pool", [
    (1, 64, 32, 8, 2, None),          # decode, identity slots
    (7, 64, 48, 6, 1, 11),            # top-1 writes the output directly; I not a tile multiple
    (7, 64, 32, 128, 8, 160),         # decode, 128 experts into a 160-slot pool
    (100, 64, 32, 16, 4, None),       # BLOCK_M 32
    (127, 96, 48, 6, 2, None),        # BLOCK_M 64, D not a tile multiple
    (127, 64, 32, 128, 8, 200),       # many experts, padding-heavy blocks
])
def test_fused_moe(t, d, inter, e, k, pool, dtype):
    x, w13, w2, weights, ids, slot_map = _moe_inputs(t, d, inter, e, k, pool, dtype)
    got = fused_moe_triton(x, w13, w2, weights, ids, slot_map)
    assert_close(got, fused_moe_reference(x, w13, w2, weights, ids, slot_map), **TOL_ACCUM[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,d,inter,e,k,pool", [
    (1, 64, 48, 8, 2, None),          # batch 1, I not a tile multiple
    (2, 80, 40, 6, 1, 11),            # top-1; D not a tile multiple (GEMV1's K, GEMV2's N)
    (3, 96, 24, 6, 6, None),          # every token on every expert: experts repeat
    (7, 80, 56, 128, 8, 160),         # 128 experts into a 160-slot pool
    (8, 64, 40, 16, 5, 40),           # the threshold itself, odd top_k
])
def test_fused_moe_gemv(t, d, inter, e, k, pool, dtype):
    x, w13, w2, weights, ids, slot_map = _moe_inputs(t, d, inter, e, k, pool, dtype)
    got = fused_moe_triton(x, w13, w2, weights, ids, slot_map, path="gemv")
    assert_close(got, fused_moe_reference(x, w13, w2, weights, ids, slot_map), **TOL_ACCUM[dtype])


@pytest.mark.parametrize("t,pool,dtype", [
    (4, None, torch.float16),
    (12, 24, torch.float32),          # forced GEMV above the threshold, as the bench runs it
])
def test_fused_moe_gemv_and_grouped_agree(t, pool, dtype):
    # Even tokens route to experts 0-4, odd ones to 5-9, each in its own order: every expert
    # serves several tokens.
    x, w13, w2, weights, _, slot_map = _moe_inputs(t, 80, 40, 10, 5, pool, dtype)
    ids = torch.stack([torch.randperm(5) + (i % 2) * 5 for i in range(t)])
    gemv = fused_moe_triton(x, w13, w2, weights, ids, slot_map, path="gemv")
    grouped = fused_moe_triton(x, w13, w2, weights, ids, slot_map, path="grouped")
    assert_close(gemv, grouped, **TOL_ACCUM[dtype], what="gemv vs grouped")
    assert_close(gemv, fused_moe_reference(x, w13, w2, weights, ids, slot_map),
                 **TOL_ACCUM[dtype])


def test_fused_moe_auto_path_follows_the_threshold(monkeypatch):
    ran = []
    monkeypatch.setattr(fused_moe_module, "_fused_moe_gemv", lambda *a: ran.append("gemv"))
    monkeypatch.setattr(fused_moe_module, "_fused_moe_grouped", lambda *a: ran.append("grouped"))
    for threshold in (_GEMV_MAX_TOKENS, 3):       # the default, and a bench moving it
        monkeypatch.setattr(fused_moe_module, "_GEMV_MAX_TOKENS", threshold)
        for t in (1, threshold, threshold + 1, 64):
            ran.clear()
            fused_moe_triton(*_moe_inputs(t, 64, 32, 8, 2, None, torch.float32))
            want = "gemv" if t <= threshold else "grouped"
            assert ran == [want] == [fused_moe_module._moe_path(t)], f"{t} tokens ran {ran}"
            # The autotune keys say which kernels run: BLOCK_M 0 for the GEMV pair.
            assert (fused_moe_autotune_keys(t, 2, 8)[1] == 0) == (want == "gemv")
    with pytest.raises(ValueError, match="path"):
        fused_moe_triton(*_moe_inputs(1, 64, 32, 8, 2, None, torch.float32), path="dense")


def test_fused_moe_weights_in_model_dtype_and_int32_ids():
    x, w13, w2, weights, ids, slot_map = _moe_inputs(5, 64, 32, 8, 2, 12, torch.float16)
    weights, ids = weights.half(), ids.int()
    got = fused_moe_triton(x, w13, w2, weights, ids, slot_map)
    want = fused_moe_reference(x, w13, w2, weights, ids.long(), slot_map)
    assert_close(got, want, **TOL_ACCUM[torch.float16])


def test_moe_align_groups_pairs_by_expert_in_token_order():
    t, k, e, block_m = 300, 4, 40, 16                        # 1200 pairs: several chunks
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    slot_map = torch.randperm(64)[:e]
    sorted_ids, block_slot, num_padded = moe_align(ids, e, block_m, slot_map)
    n, flat = t * k, ids.reshape(-1)
    counts = torch.bincount(flat, minlength=e)
    assert int(num_padded) == int(((counts + block_m - 1) // block_m * block_m).sum())
    used = sorted_ids[: int(num_padded)].view(-1, block_m).long()
    real = used < n
    assert sorted(used[real].tolist()) == list(range(n)), "every pair exactly once"
    for j, row in enumerate(used):
        pairs = row[real[j]]
        assert len(pairs) > 0, f"block {j} holds only padding"
        assert (flat[pairs] == flat[pairs[0]]).all(), f"block {j} mixes experts"
        assert int(block_slot[j]) == int(slot_map[flat[pairs[0]]]), f"block {j} has the wrong slot"
        assert (pairs[1:] > pairs[:-1]).all(), f"block {j} is not in token order"
        assert real[j, : len(pairs)].all(), f"block {j} pads before its last pair"


def test_fused_moe_autotune_keys_are_bucketed():
    keys = {fused_moe_autotune_keys(n, 8, 128) for n in range(1, 20000)}
    assert len(keys) <= len(FUSED_MOE_TOKEN_BUCKETS)
    assert {bucket for bucket, _ in keys} == set(FUSED_MOE_TOKEN_BUCKETS)
    # One forward per bucket (what the warmup ladder runs at least) reaches every key.
    assert keys == {fused_moe_autotune_keys(b, 8, 128) for b in FUSED_MOE_TOKEN_BUCKETS}
    for n in (1, 3, _GEMV_MAX_TOKENS, _GEMV_MAX_TOKENS + 1, 64, 65, 1000, 4096, 4097, 100000):
        bucket, block_m = fused_moe_autotune_keys(n, 8, 128)
        assert bucket >= min(n, FUSED_MOE_TOKEN_BUCKETS[-1]) and bucket in FUSED_MOE_TOKEN_BUCKETS
        assert block_m in (0, 16, 32, 64)
        if n <= _GEMV_MAX_TOKENS:
            assert block_m == 0, "the GEMV kernels have no BLOCK_M"
        elif n <= 64:
            assert block_m == 16, "grouped decode uses GEMV-like 16-row blocks"
    # Few experts, many tokens per expert: bigger blocks.
    assert fused_moe_autotune_keys(2048, 2, 8)[1] == 64


def test_fused_moe_autotune_key_has_no_raw_token_count():
    from triton_kernels.fused_moe import _GEMM1, _GEMM2, _GEMV1, _GEMV2
    tuned_kernels = (*_GEMM1.values(), *_GEMM2.values(), _GEMV1, _GEMV2)
    for tuned in tuned_kernels:
        assert "M_BUCKET" in tuned.keys and not {"num_pairs", "num_tokens"} & set(tuned.keys)
        assert len(tuned.configs) > 1
    for tuned in (_GEMV1, _GEMV2):
        assert "BLOCK_M" not in tuned.keys
        # Batch 1 needs narrow tiles to give every SM a program: D / 8 = 256 for GEMV2.
        assert min(c.kwargs["BLOCK_N"] for c in tuned.configs) <= 8


# ---- the public ops reach their launchers ---------------------------------------------------

def test_public_ops_dispatch_to_triton_when_forced():
    x = torch.randn(3, 64)
    with tk.kernel_backend("triton"):
        w = torch.ones(64)
        assert_close(tk.rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), **TOL[torch.float32])
        assert_close(tk.silu_and_mul(x), silu_and_mul_reference(x), **TOL[torch.float32])
        w, ids = tk.topk_softmax(x, 2, True)
        assert_close(w, topk_softmax_reference(x, 2, True)[0], atol=1e-6, rtol=1e-5)
        q, k = torch.randn(3, 2, 64), torch.randn(3, 1, 64)
        cos_sin = torch.randn(8, 64)
        q_ref, k_ref = apply_rope_reference(q.clone(), k.clone(), torch.arange(3), cos_sin)
        tk.apply_rope(q, k, torch.arange(3), cos_sin)
        assert_close(q, q_ref, **TOL[torch.float32])
        q, k_cache, v_cache, table, cu, seq_lens = _paged_batch([1, 1], [5, 9], 2, 1, 64,
                                                                torch.float32)
        tk.write_kv(torch.randn(2, 1, 64), torch.randn(2, 1, 64), k_cache, v_cache,
                    torch.tensor([0, 1]))
        assert_close(tk.paged_attention(q, k_cache, v_cache, table, cu, seq_lens, 0.125, 1),
                     paged_attention_reference(q, k_cache, v_cache, table, cu, seq_lens, 0.125),
                     **TOL_ACCUM[torch.float32])
        moe = _moe_inputs(2, 64, 32, 4, 2, None, torch.float32)
        assert_close(tk.fused_moe(*moe), fused_moe_reference(*moe), **TOL_ACCUM[torch.float32])

