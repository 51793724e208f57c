"""A CPU engine step's attention in one native call (triton_kernels/cpu_prefill_attention.py:
cpu_flash_attention.c in vector registers, and cpu_amx_attention.c on AMX tiles where this
CPU has them) against float64 attention on the same inputs and against its reference,
torch's path (paged_attention_reference): prefill from nothing and over a cached prefix,
decode rows in the same step, GQA groups of 1 to 16, key and value widths apart, windows,
sinks, cache blocks of 1 to 64 in shuffled tables, bf16, fp16 and float32 caches, stale nans
in the cache past a sequence's end; the same bits on 1 to 3 threads and in groups of
sequences; what each declines; the layers handing them their steps."""

import math
from types import SimpleNamespace

import pytest
import torch

import triton_kernels as tk
from tiny_fixtures import tiny_model_dir  # noqa: F401
from triton_kernels.paged_attention import paged_attention_reference

kernel = tk.native_kernels()


def _amx_runs() -> bool:
    if kernel is None or not tk.has_amx_bf16():
        return False
    c = case(seqs=((16, 16),), hq=2, hk=1, dk=32, dv=32)
    att = tk.CpuPrefillAttention(kernel, c["heads"], c["scale"], None, None, amx=True)
    att(c["q"], c["k"], c["v"], c["tables"], c["cu"], c["lens"])
    return att.amx                      # (False once the kernel said this CPU has no AMX)


def case(seqs, hq=16, hk=4, dk=64, dv=64, bs=16, window=None, sinks=False, seed=0,
         stale=0.0, dtype=torch.bfloat16):
    """Sequences (context, new tokens) in a shuffled cache of keys and values in dtype, a
    block table padded with -1; the cache's slots past each context hold `stale`."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // bs) for n, _ in seqs]
    nb = sum(blocks) + 2
    k = torch.randn(nb, bs, hk, dk, generator=g).to(dtype)
    v = torch.randn(nb, bs, hk, dv, generator=g).to(dtype)
    order = torch.randperm(nb, generator=g)
    tables = torch.full((len(seqs), max(blocks) + 1), -1, dtype=torch.int32)
    at = 0
    for b, ((n, _), m) in enumerate(zip(seqs, blocks)):
        tables[b, :m] = order[at:at + m]
        at += m
        last = int(tables[b, m - 1])
        k[last, n - (m - 1) * bs:] = stale
        v[last, n - (m - 1) * bs:] = stale
    cu = torch.tensor([0, *torch.tensor([q for _, q in seqs]).cumsum(0).tolist()],
                      dtype=torch.int32)
    q = (2 * torch.randn(int(cu[-1]), hq, dk, generator=g)).to(dtype)
    return dict(q=q, k=k, v=v, tables=tables, cu=cu,
                lens=torch.tensor([n for n, _ in seqs], dtype=torch.int32),
                heads=(hq, hk), scale=dk ** -0.5, window=window,
                sinks=torch.randn(hq, generator=g) if sinks else None)


# the vector kernel runs wherever the native kernels build; AMX's where the CPU has it
KINDS = ["vector"] + (["amx"] if _amx_runs() else [])


def attention(c, kind="vector", pack_bytes=None):
    extra = {} if pack_bytes is None else {"pack_bytes": pack_bytes}
    att = tk.CpuPrefillAttention(kernel, c["heads"], c["scale"], c["window"], c["sinks"],
                                 amx=kind == "amx", **extra)
    return att(c["q"], c["k"], c["v"], c["tables"], c["cu"], c["lens"])


def reference(c):
    return paged_attention_reference(c["q"], c["k"], c["v"], c["tables"], c["cu"], c["lens"],
                                     c["scale"], sliding_window=c["window"], sinks=c["sinks"])


def float64(c):
    """The step's attention in float64 from the same bf16 values, key by key."""
    q, kc, vc, cu, lens = c["q"], c["k"], c["v"], c["cu"].tolist(), c["lens"].tolist()
    hq, hk = c["heads"]
    bs, w = kc.shape[1], c["window"]
    out = torch.zeros(q.shape[0], hq, vc.shape[3], dtype=torch.float64)
    for b, n in enumerate(lens):
        table = c["tables"][b, :-(-n // bs)].long()
        keys = kc[table].flatten(0, 1)[:n].double().repeat_interleave(hq // hk, 1)
        vals = vc[table].flatten(0, 1)[:n].double().repeat_interleave(hq // hk, 1)
        qb = q[cu[b]:cu[b + 1]].double()
        s = torch.einsum("thd,jhd->htj", qb, keys) * c["scale"]
        pos = torch.arange(n - qb.shape[0], n)[:, None]
        j = torch.arange(n)[None]
        seen = (j <= pos) & ((j > pos - w) if w else True)
        s = s.masked_fill(~seen, -math.inf)
        if c["sinks"] is not None:
            sink = c["sinks"].double()[:, None, None].expand(-1, qb.shape[0], 1)
            p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
        else:
            p = torch.softmax(s, -1)
        out[cu[b]:cu[b + 1]] = torch.einsum("htj,jhd->thd", p, vals)
    return out


pytestmark = pytest.mark.skipif(kernel is None, reason="no native kernels (no C compiler)")

SHAPES = [
    # (seqs, heads and widths, window, sinks)
    (((512, 512),), dict(), None, False),                       # a prefill from nothing
    (((300, 45),), dict(), None, False),                        # a chunk over a cached prefix
    (((100, 37), (1, 1), (300, 1), (70, 70)), dict(), None, False),   # decode rows beside
    (((200, 200),), dict(hq=8, hk=8, dk=128, dv=128), None, False),   # no GQA (MHA)
    (((130, 130), (77, 3)), dict(hq=16, hk=1, dk=32, dv=32), None, False),  # 16 heads a group
    (((97, 97),), dict(hq=12, hk=4, dk=192, dv=128), None, False),  # keys wider than values
    (((64, 64), (33, 33)), dict(hq=6, hk=2, dk=256, dv=256, bs=64), None, False),
    (((600, 200),), dict(bs=32), 128, False),                   # a window, keys dropped before
    (((600, 200), (40, 1)), dict(), 100, True),                 # a window and sinks
    (((250, 250), (90, 1)), dict(hq=8, hk=2), None, True),      # sinks
    (((150, 150), (80, 20)), dict(hq=4, hk=2), 1, False),       # a window of one key
    (((300, 100),), dict(hq=8, hk=2, dk=32, dv=32), 20, True),  # a window inside a tile
]


# what only the vector kernel takes: other cache dtypes, blocks and head widths
VECTOR_SHAPES = [
    (((300, 300), (90, 1), (64, 20)), dict(dtype=torch.float16), None, False),
    (((200, 200), (50, 7)), dict(dtype=torch.float32, hq=8, hk=2), 64, True),
    (((130, 130),), dict(bs=1, hq=4, hk=1, dk=48, dv=40), None, False),    # widths apart
    (((77, 77), (40, 9)), dict(bs=8, hq=6, hk=3, dk=20, dv=8), 30, True),
    (((100, 100),), dict(bs=5, hq=2, hk=2, dk=256, dv=250), None, False),
]
CASES = ([(kind, *shape) for kind in KINDS for shape in SHAPES]
         + [("vector", *shape) for shape in VECTOR_SHAPES])


@pytest.mark.parametrize("kind, seqs, shape, window, sinks", CASES)
def test_attention_is_as_close_to_float64_as_torch(kind, seqs, shape, window, sinks):
    c = case(seqs, window=window, sinks=sinks, **shape)
    dtype = c["q"].dtype
    got, want, exact = attention(c, kind), reference(c), float64(c)
    assert got is not None and got.dtype == dtype and got.shape == want.shape
    err, ref_err = (got.double() - exact).abs(), (want.double() - exact).abs()
    if dtype == torch.float32:          # nothing rounded but float32's sums
        assert err.max() <= 1e-5 * exact.abs().max()
        return
    # the output's own rounding is most of both errors; the rest is the probabilities,
    # which the AMX kernel and torch's flash kernel round to the inputs' dtype (torch's path
    # keeps them in float32 where its flash kernel does not run: unequal key and value
    # widths, sinks), the vector kernel does not
    step = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
    assert err.max() <= step * exact.abs().max() + 1e-6
    assert err.mean() <= (1.3 if kind == "amx" else 1.05) * ref_err.mean() + 1e-6
    # against torch: a step or two where the probabilities' roundings differ
    diff = (got.float() - want.float()).abs()
    assert diff.max() <= 4 * step * want.float().abs().max()


@pytest.mark.parametrize("kind", KINDS)
def test_stale_nans_past_a_sequence_end_do_not_leak(kind):
    # the last block's slots past the context hold nans (an old sequence's, or never written)
    seqs = ((70, 70), (45, 1), (33, 10))
    got = attention(case(seqs, stale=float("nan")), kind)
    assert torch.isfinite(got.float()).all()
    assert torch.equal(got, attention(case(seqs, stale=0.0), kind))


@pytest.mark.parametrize("kind", KINDS)
def test_same_bits_on_any_thread_count_and_in_groups_of_sequences(kind):
    c = case(((300, 120), (1, 1), (64, 64), (500, 1), (129, 17)), hq=8, hk=2)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(attention(c, kind))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    # copies made a pair at a time (room for less than one pair's: each alone)
    assert torch.equal(outs[0], attention(c, kind, pack_bytes=1024))


@pytest.mark.skipif("amx" not in KINDS, reason="no AMX here")
@pytest.mark.parametrize("change", ["block 8", "dk 48", "dv 8", "fp16", "float32 cache"])
def test_what_amx_declines_goes_to_the_vector_kernel(change):
    shape = {"block 8": dict(bs=8), "dk 48": dict(dk=48), "dv 8": dict(dv=8),
             "fp16": dict(dtype=torch.float16), "float32 cache": dict(dtype=torch.float32)}
    c = case(((40, 40),), **shape[change])
    att = tk.CpuPrefillAttention(kernel, c["heads"], c["scale"], None, None, amx=True)
    got = att(c["q"], c["k"], c["v"], c["tables"], c["cu"], c["lens"])
    assert got is not None and torch.equal(got, attention(c, "vector"))
    assert att.amx                      # (asked again next time: only these shapes declined)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("change", ["dk 288", "dv 264", "float32 cache, bf16 q",
                                    "int8 cache"])
def test_declines_what_it_does_not_take(kind, change):
    shape = {"dk 288": dict(dk=288, dv=32), "dv 264": dict(dk=32, dv=264)}.get(change, {})
    c = case(((40, 40),), **shape)
    if change == "float32 cache, bf16 q":
        c.update(k=c["k"].float(), v=c["v"].float())
    if change == "int8 cache":
        c.update(q=c["q"].to(torch.int8), k=c["k"].to(torch.int8), v=c["v"].to(torch.int8))
    assert attention(c, kind) is None


@pytest.mark.parametrize("kind", KINDS)
def test_sequences_without_new_tokens_and_int64_lengths(kind):
    # a batch row with no new token (nothing to compute) beside a chunk and a decode row
    c = case(((60, 20), (30, 1)))
    want = attention(c, kind)
    padded = dict(c, tables=torch.cat([c["tables"][:1], c["tables"][:1], c["tables"][1:]]),
                  cu=torch.tensor([0, 20, 20, 21], dtype=torch.int32),
                  lens=torch.tensor([60, 60, 30]))                      # int64 lengths
    assert torch.equal(attention(padded, kind), want)
    # only empty and single-token sequences: a decode step's rows, the reference's bits
    only = dict(c, q=c["q"][20:], cu=torch.tensor([0, 0, 1], dtype=torch.int32))
    got = attention(only, kind)
    assert got is not None and torch.equal(got, reference(only))


@pytest.mark.parametrize("kind", KINDS)
def test_offsets_past_q_are_refused_and_table_rows_past_the_batch_unread(kind):
    c = case(((40, 40),))
    want = attention(c, kind)
    assert torch.equal(attention(dict(c, tables=torch.cat([c["tables"], -c["tables"]])), kind),
                       want)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        attention(dict(c, cu=torch.tensor([0, 41], dtype=torch.int32)), kind)


@pytest.mark.parametrize("kind", KINDS)
def test_a_table_naming_a_block_outside_the_cache_is_refused(kind):
    c = case(((40, 40),))
    c["tables"][0, 1] = c["k"].shape[0]
    with pytest.raises(ValueError, match="outside the cache"):
        attention(c, kind)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype, window, sinks", [(torch.bfloat16, None, False),
                                                  (torch.float32, None, False),
                                                  (torch.float32, 64, True)])
def test_decode_rows_get_the_decode_steps_bits(kind, dtype, window, sinks):
    # a step's decode rows beside prefill chunks: the bits of the decode step's kernel on
    # the same rows (CpuDecodeAttention given their rotated q, its RoPE the identity, no
    # slot written), near float64's; a pure decode step is not taken at all
    c = case(((100, 37), (1, 1), (300, 1), (70, 70)), window=window, sinks=sinks, dtype=dtype)
    got = attention(c, kind)
    (hq, hk), d, rows, seqs = c["heads"], 64, [37, 38], [1, 2]
    step = tk.CpuDecodeAttention(kernel, (hq, hk, d), None, None, 1e-6, c["scale"], window,
                                 c["sinks"], False)
    qkv = torch.zeros(len(rows), (hq + 2 * hk) * d, dtype=dtype)
    qkv[:, :hq * d] = c["q"][rows].reshape(len(rows), -1)
    identity = torch.cat([torch.ones(1, d // 2), torch.zeros(1, d // 2)], dim=1)
    want = step(qkv, torch.zeros(len(rows), dtype=torch.int64), identity, c["k"], c["v"],
                torch.full((len(rows),), -1), c["tables"][seqs], c["lens"][seqs])
    assert torch.equal(got[rows], want.view(len(rows), hq, d))
    exact = float64(c)[rows]
    assert (got[rows].double() - exact).abs().max() <= (
        1e-5 if dtype == torch.float32 else 2 ** -7) * exact.abs().max()
    assert attention(case(((100, 1), (7, 1))), kind) is None


def test_cpu_engine_layers_hand_prefill_steps_to_it(tiny_model_dir, monkeypatch):
    from freetoken import LLM, SamplingParams
    from freetoken.models.layers.attention import Attention
    llm = LLM(str(tiny_model_dir("qwen3_moe", seed=3)), skip_tokenizer_init=True,
              dtype="bfloat16", enforce_eager=True)
    attns = [m for m in llm.runner.model.modules() if isinstance(m, Attention)]
    assert attns and all(a.cpu_prefill is not None for a in attns)
    outs = []
    call = tk.CpuPrefillAttention.__call__

    def counted(*args, **kwargs):
        outs.append(call(*args, **kwargs))
        return outs[-1]
    monkeypatch.setattr(tk.CpuPrefillAttention, "__call__", counted)
    params = SamplingParams(max_tokens=3, temperature=0)
    got = llm.generate([[5, 17, 99, 3, 200, 7, 8, 9] * 5], params)
    taken = [o for o in outs if o is not None]
    assert len(taken) == len(attns)                 # the prefill, every layer; decode not
    for a in attns:
        a.cpu_prefill = None
    assert llm.generate([[5, 17, 99, 3, 200, 7, 8, 9] * 5], params)[0].token_ids[0] \
        == got[0].token_ids[0]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("length,new", [(300, 300), (300, 50), (256, 256)])
def test_dense_sequences_as_mla_decompresses_them(kind, length, new):
    # K 192 / V 128 wide (DeepSeek's decompressed prefill), V a strided view of [K nope | V],
    # L not a multiple of 16 (for AMX the keys padded to a whole tile) or one: against
    # float64.
    g = torch.Generator().manual_seed(7)
    h, dk, dv = 4, 192, 128
    q = torch.randn(new, h, dk, generator=g).bfloat16()
    k = torch.randn(length, h, dk, generator=g).bfloat16()
    kv = torch.randn(length, h, 128 + dv, generator=g).bfloat16()
    v = kv[..., 128:]
    att = tk.CpuPrefillAttention(kernel, (h, h), dk ** -0.5, None, None, amx=kind == "amx")
    got = att.dense(q, k, v)
    assert got is not None and got.shape == (new, h, dv)
    s = torch.einsum("nhd,lhd->hnl", q.double(), k.double()) * dk ** -0.5
    pos = torch.arange(length - new, length)[:, None]
    s = s.masked_fill(torch.arange(length)[None] > pos, float("-inf"))
    exact = torch.einsum("hnl,lhd->nhd", s.softmax(-1), v.double())
    # torch's SDPA in bf16: for unequal widths its math path, float32 probabilities, so
    # ~1.4x more exact than bf16 probabilities (this kernel's, torch's flash kernel's, HF's
    # eager DeepSeek attention's) in the mean
    mask = torch.arange(length)[None] <= pos
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, scale=dk ** -0.5)[0].transpose(0, 1)
    err, sdpa_err = (got.double() - exact).abs(), (sdpa.double() - exact).abs()
    assert err.max() <= 2 ** -7 * exact.abs().max() and err.mean() <= 1.6 * sdpa_err.mean()


def test_mla_decompressed_prefill_takes_the_native_kernel():
    from freetoken.models.layers.mla import MlaAttention, MlaConfig
    from freetoken.models.rope import RopeTable
    cfg = MlaConfig(hidden_size=64, num_heads=4, q_lora_rank=None, kv_lora_rank=32,
                    qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=32)
    rope = RopeTable({"rope_type": "default", "rope_theta": 10000.0}, cfg.qk_rope_head_dim)
    rope.build(128, "cpu")
    layer = MlaAttention(cfg, 0, rope).bfloat16()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    layer.bind_cpu()
    assert layer.cpu_prefill is not None
    cache = torch.randn(8, 16, cfg.kv_lora_rank + cfg.qk_rope_head_dim, generator=g).bfloat16()
    table = torch.tensor([5, 2, 7, 0, 6], dtype=torch.int32)
    native, outs = layer.cpu_prefill, []

    def counted(*args):
        outs.append(native.dense(*args))
        return outs[-1]
    for ctx, n in ((70, 70), (70, 20)):
        q = torch.randn(n, cfg.num_heads, cfg.qk_head_dim, generator=g).bfloat16()
        layer.cpu_prefill = SimpleNamespace(dense=counted)
        got = layer.attend_decompressed(q, cache, table, ctx)
        assert outs[-1] is not None and got is outs[-1]                 # the kernel's
        layer.cpu_prefill = None
        want = layer.attend_decompressed(q, cache, table, ctx)         # torch's SDPA
        diff = (got.float() - want.float()).abs()
        assert diff.max() <= 2 ** -6 * want.float().abs().max()
