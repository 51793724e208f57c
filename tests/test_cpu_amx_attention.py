"""A CPU engine step's attention on AMX tiles (triton_kernels/cpu_amx_attention.py, .c) against
float64 attention on the same bf16 inputs and against its reference, torch's path
(paged_attention_reference): prefill from nothing and over a cached prefix, decode rows in the
same step, GQA groups of 1 to 16, key and value widths apart, windows, sinks, cache blocks
of 16 to 64 in shuffled tables, stale nans in the cache past a sequence's end; the same bits
on 1 to 3 threads and in groups of sequences; what it declines; the layer handing it its
steps."""

import math

import pytest
import torch

import triton_kernels as tk
from tiny_fixtures import tiny_model_dir  # noqa: F401
from triton_kernels.paged_attention import paged_attention_reference

kernel = tk.native_kernels()


def _runs() -> bool:
    if kernel is None or not tk.has_amx_bf16():
        return False
    c = case(seqs=((16, 16),), hq=2, hk=1, dk=32, dv=32)
    return attention(c) is not None


def case(seqs, hq=16, hk=4, dk=64, dv=64, bs=16, window=None, sinks=False, seed=0,
         stale=0.0):
    """Sequences (context, new tokens) in a shuffled cache of bf16 keys and values, a block
    table padded with -1; the cache's slots past each context hold `stale`."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // bs) for n, _ in seqs]
    nb = sum(blocks) + 2
    k = torch.randn(nb, bs, hk, dk, generator=g).bfloat16()
    v = torch.randn(nb, bs, hk, dv, generator=g).bfloat16()
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
    q = (2 * torch.randn(int(cu[-1]), hq, dk, generator=g)).bfloat16()
    return dict(q=q, k=k, v=v, tables=tables, cu=cu,
                lens=torch.tensor([n for n, _ in seqs], dtype=torch.int32),
                heads=(hq, hk), scale=dk ** -0.5, window=window,
                sinks=torch.randn(hq, generator=g) if sinks else None)


def attention(c, pack_bytes=None, **kw):
    extra = {} if pack_bytes is None else {"pack_bytes": pack_bytes}
    att = tk.CpuPrefillAttention(kernel, c["heads"], c["scale"], c["window"], c["sinks"],
                                 **extra)
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


pytestmark = pytest.mark.skipif(not _runs(), reason="the AMX attention kernel does not run here")

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


@pytest.mark.parametrize("seqs, shape, window, sinks", SHAPES)
def test_amx_attention_is_as_close_to_float64_as_torch(seqs, shape, window, sinks):
    c = case(seqs, window=window, sinks=sinks, **shape)
    got, want, exact = attention(c), reference(c), float64(c)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == want.shape
    err, ref_err = (got.double() - exact).abs(), (want.double() - exact).abs()
    # bf16's own rounding of the output is most of both errors; the rest is the bf16
    # probabilities, which torch's path keeps in float32 where its flash kernel does not run
    # (unequal key and value widths, sinks)
    assert err.max() <= 2 ** -7 * exact.abs().max() + 1e-6
    assert err.mean() <= 1.3 * ref_err.mean() + 1e-6
    # against torch: a bf16 step or two where the bf16 probabilities' edges differ
    diff = (got.float() - want.float()).abs()
    assert diff.max() <= 2 ** -5 * want.float().abs().max()


def test_stale_nans_past_a_sequence_end_do_not_leak():
    # the last block's slots past the context hold nans (an old sequence's, or never written)
    seqs = ((70, 70), (45, 1), (33, 10))
    got = attention(case(seqs, stale=float("nan")))
    assert torch.isfinite(got.float()).all()
    assert torch.equal(got, attention(case(seqs, stale=0.0)))


def test_same_bits_on_any_thread_count_and_in_groups_of_sequences():
    c = case(((300, 120), (1, 1), (64, 64), (500, 1), (129, 17)), hq=8, hk=2)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(attention(c))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    # value copies made a pair at a time (room for less than one pair's: each alone)
    assert torch.equal(outs[0], attention(c, pack_bytes=1024))


@pytest.mark.parametrize("change", ["block 8", "dk 48", "dv 8", "fp16", "float32 cache",
                                    "dk 288"])
def test_declines_what_it_does_not_take(change):
    shape = {"block 8": dict(bs=8), "dk 48": dict(dk=48), "dv 8": dict(dv=8),
             "dk 288": dict(dk=288, dv=32)}.get(change, {})
    c = case(((40, 40),), **shape)
    if change == "fp16":
        c.update(q=c["q"].half(), k=c["k"].half(), v=c["v"].half())
    if change == "float32 cache":
        c.update(k=c["k"].float(), v=c["v"].float())
    assert attention(c) is None


def test_sequences_without_new_tokens_and_int64_lengths():
    # a batch row with no new token (nothing to compute) beside a chunk and a decode row
    c = case(((60, 20), (30, 1)))
    want = attention(c)
    padded = dict(c, tables=torch.cat([c["tables"][:1], c["tables"][:1], c["tables"][1:]]),
                  cu=torch.tensor([0, 20, 20, 21], dtype=torch.int32),
                  lens=torch.tensor([60, 60, 30]))                      # int64 lengths
    assert torch.equal(attention(padded), want)
    # only empty and single-token sequences: a decode step's rows, the reference's bits
    only = dict(c, q=c["q"][20:], cu=torch.tensor([0, 0, 1], dtype=torch.int32))
    got = attention(only)
    assert got is not None and torch.equal(got, reference(only))


def test_offsets_past_q_are_refused_and_table_rows_past_the_batch_unread():
    c = case(((40, 40),))
    want = attention(c)
    assert torch.equal(attention(dict(c, tables=torch.cat([c["tables"], -c["tables"]]))), want)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        attention(dict(c, cu=torch.tensor([0, 41], dtype=torch.int32)))


def test_a_table_naming_a_block_outside_the_cache_is_refused():
    c = case(((40, 40),))
    c["tables"][0, 1] = c["k"].shape[0]
    with pytest.raises(ValueError, match="outside the cache"):
        attention(c)


def test_decode_rows_keep_the_decode_path():
    # a step's decode rows: the bits of the reference's decode batch (float32
    # probabilities); a pure decode step is not taken at all
    c = case(((100, 37), (1, 1), (300, 1), (70, 70)))
    got, want = attention(c), reference(c)
    assert torch.equal(got[[37, 38]], want[[37, 38]])
    assert not torch.equal(got[:37], want[:37])              # the prefill rows: the kernel's
    assert attention(case(((100, 1), (7, 1)))) is None


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


@pytest.mark.parametrize("length,new", [(300, 300), (300, 50), (256, 256)])
def test_dense_sequences_as_mla_decompresses_them(length, new):
    # K 192 / V 128 wide (DeepSeek's decompressed prefill), V a strided view of [K nope | V],
    # L not a multiple of 16 (the keys padded to a whole tile) or one: against float64.
    g = torch.Generator().manual_seed(7)
    h, dk, dv = 4, 192, 128
    q = torch.randn(new, h, dk, generator=g).bfloat16()
    k = torch.randn(length, h, dk, generator=g).bfloat16()
    kv = torch.randn(length, h, 128 + dv, generator=g).bfloat16()
    v = kv[..., 128:]
    att = tk.CpuPrefillAttention(kernel, (h, h), dk ** -0.5, None, None)
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


def test_mla_decompressed_prefill_takes_the_tiles():
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
    for ctx, n in ((70, 70), (70, 20)):
        q = torch.randn(n, cfg.num_heads, cfg.qk_head_dim, generator=g).bfloat16()
        got = layer.attend_decompressed(q, cache, table, ctx)
        tiles, layer.cpu_prefill = layer.cpu_prefill, None
        want = layer.attend_decompressed(q, cache, table, ctx)         # torch's SDPA
        layer.cpu_prefill = tiles
        diff = (got.float() - want.float()).abs()
        assert diff.max() <= 2 ** -6 * want.float().abs().max()
        assert not torch.equal(got, want)                               # the tiles ran
