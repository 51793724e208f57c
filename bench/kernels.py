"""Time each Triton kernel against its torch reference on Qwen3-30B-A3B-like shapes.

    PYTHONPATH=. python bench/kernels.py [--ops fused_moe,paged_attention] [--dtype bf16]

Shapes: hidden 2048, 128 experts, top-8, expert width 768, 32 query / 4 kv heads of 128;
mla_attention at DeepSeek-V3's 128 heads and GLM-4.7-Flash's 20 over a 576-wide latent (L 512,
R 64), block size 16 as the engine's default.
gated_delta_rule and causal_conv1d at Qwen3.6-35B-A3B's Gated DeltaNet layers (16 key / 32
value heads of 128, conv kernel 4 over 8192 channels), the float32 state read and written once
counted in their bytes.
Each row reports the Triton time eagerly (what a Python loop of launches costs, launch
overhead included) and replayed from a CUDA graph (the kernels' own time), the reference's
eager time, the bytes the op must move (read + write) over the graph time as GB/s and as a
fraction of this GPU's memory-copy ceiling measured in the same run, and TFLOP/s where the
op is compute-heavy. MoE decode at batch 1 should reach >= 70% of the copy ceiling.

fused_moe counts only the expert weights streamed (unique experts touched x expert bytes),
and times both of its forms at decode sizes, T = 1..64: the GEMV pair ("gemv") and the
sorted, grouped GEMMs ("grouped"); a closing table says which is faster at each T, which is
where triton_kernels.fused_moe._GEMV_MAX_TOKENS belongs. Its rows also give the tuned
config's relative error against the reference on the same inputs (the kernel tests on CUDA
run one fixed config, so this is where the tuned ones are checked).

fused_moe_quant times the same MoE decode on quantized expert banks (triton_kernels.dequant's
formats), counting the quantized bytes streamed (q and its scales); a closing table gives each
format's GB/s as a fraction of the copy ceiling measured here and of /work/shared/GPU.md's
H200 reading, and its time against bf16 fused_moe at the same T (the bytes saved are the
point: at decode a quantized layer should take about its byte ratio of the bf16 time).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import Callable

import torch

# Qwen3-30B-A3B-like model.
HIDDEN, EXPERTS, TOP_K, WIDTH = 2048, 128, 8, 768
HEADS_Q, HEADS_KV, HEAD_DIM, BLOCK_SIZE = 32, 4, 128, 16
MOE_DECODE_TOKENS = (1, 2, 4, 8, 16, 32, 64)      # both fused_moe forms
MOE_PREFILL_TOKENS = (512, 4096)                  # grouped only
# Qwen3.6-35B-A3B's Gated DeltaNet layers (linear_num_key_heads, linear_num_value_heads,
# linear_key/value_head_dim, linear_conv_kernel_dim).
GDN_HK, GDN_HV, GDN_D, GDN_W = 16, 32, 128, 4
OPS = ("rms_norm", "rope", "silu_and_mul", "topk_softmax", "write_kv", "paged_attention",
       "fused_moe", "mla_attention", "fused_moe_quant", "gated_delta_rule", "causal_conv1d")
# MLA's absorbed attention over the latent: kv_lora_rank 512, qk_rope_head_dim 64 for both;
# (label, query heads, softmax scale = (qk_nope + qk_rope) ** -0.5).
MLA_L, MLA_R = 512, 64
MLA_MODELS = (("deepseek-v3", 128, (128 + 64) ** -0.5), ("glm-4.7-flash", 20, (192 + 64) ** -0.5))
MOE_QUANT_TOKENS = (1, 4, 8, 16, 64)              # GEMV up to 8, grouped above
H200_COPY_GBS = 4230                              # /work/shared/GPU.md: memory copy, 1 GB
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass
class Case:
    op: str
    shape: str
    triton: Callable[[], object]
    reference: Callable[[], object] | None
    bytes: float                  # read + written by the op, at least once each
    flops: float = 0.0            # reported as TFLOP/s when non-zero
    variant: str = ""             # one of several forms of the op timed on the same shape
    # () -> (output, reference output) on the same inputs: the autotuned config's answer
    # checked where it runs (the kernel tests on CUDA use one fixed config)
    check: Callable[[], tuple] | None = None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default=",".join(OPS),
                   help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--reps", type=int, default=50, help="calls per timing round")
    p.add_argument("--rounds", type=int, default=5, help="timing rounds (the median is kept)")
    p.add_argument("--no-reference", action="store_true", help="skip timing the references")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph replay timing")
    args = p.parse_args(argv)
    args.ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = sorted(set(args.ops) - set(OPS))
    if unknown:
        p.error(f"unknown ops {unknown}; choose from {', '.join(OPS)}")
    return args


# ---- timing ---------------------------------------------------------------------------------

def time_eager(fn, reps: int, rounds: int) -> float:
    """Median over rounds of the mean time per call, in seconds, measured with CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    return sorted(times)[len(times) // 2]


def time_graph(fn, reps: int, rounds: int) -> float | None:
    """Like time_eager, but replaying `reps` calls captured in one CUDA graph (no launch cost)."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()                                   # compile and autotune outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
    except Exception as e:                       # an op that syncs cannot be captured
        print(f"  (no CUDA graph: {type(e).__name__}: {e})", file=sys.stderr)
        return None
    return time_eager(graph.replay, 1, rounds) / reps


def copy_ceiling(reps: int, rounds: int) -> float:
    """Device-to-device copy of 1 GiB, read + write counted, in bytes/s."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = time_eager(lambda: dst.copy_(src), max(1, reps // 5), rounds)
    src = dst = None            # free the 2 GiB before the cases run
    torch.cuda.empty_cache()
    return 2 * 2**30 / seconds


# ---- cases ----------------------------------------------------------------------------------

def rms_norm_cases(dt):
    from triton_kernels.rms_norm import rms_norm_reference, rms_norm_triton
    w = torch.ones(HIDDEN, dtype=dt, device="cuda")
    for t in (1, 64, 4096):
        x, res = (torch.randn(t, HIDDEN, dtype=dt, device="cuda") for _ in range(2))
        yield Case("rms_norm+residual", f"T={t} D={HIDDEN}",
                   lambda x=x, res=res: rms_norm_triton(x, w, 1e-6, res),
                   lambda x=x, res=res: rms_norm_reference(x, w, 1e-6, res),
                   bytes=4 * x.numel() * x.element_size())


def rope_cases(dt):
    from triton_kernels.rope import apply_rope_reference, apply_rope_triton
    cos_sin = torch.randn(40960, HEAD_DIM, device="cuda")
    for t in (1, 64, 4096):
        q = torch.randn(t, HEADS_Q, HEAD_DIM, dtype=dt, device="cuda")
        k = torch.randn(t, HEADS_KV, HEAD_DIM, dtype=dt, device="cuda")
        pos = torch.randint(0, 40960, (t,), device="cuda")
        moved = 2 * (q.numel() + k.numel()) * q.element_size() + t * HEAD_DIM * 4
        yield Case("rope", f"T={t} Hq={HEADS_Q} Hk={HEADS_KV}",
                   lambda q=q, k=k, pos=pos: apply_rope_triton(q, k, pos, cos_sin),
                   lambda q=q, k=k, pos=pos: apply_rope_reference(q, k, pos, cos_sin), moved)


def silu_and_mul_cases(dt):
    from triton_kernels.silu_mul import silu_and_mul_reference, silu_and_mul_triton
    for t in (64, 4096):
        x = torch.randn(t, 2 * 4 * WIDTH, dtype=dt, device="cuda")
        yield Case("silu_and_mul", f"T={t} I={4 * WIDTH}", lambda x=x: silu_and_mul_triton(x),
                   lambda x=x: silu_and_mul_reference(x), 1.5 * x.numel() * x.element_size())


def topk_softmax_cases(dt):
    from triton_kernels.topk_softmax import topk_softmax_reference, topk_softmax_triton
    for t in (1, 64, 4096):
        logits = torch.randn(t, EXPERTS, dtype=dt, device="cuda")
        yield Case("topk_softmax", f"T={t} E={EXPERTS} k={TOP_K}",
                   lambda x=logits: topk_softmax_triton(x, TOP_K, True),
                   lambda x=logits: topk_softmax_reference(x, TOP_K, True),
                   logits.numel() * logits.element_size() + t * TOP_K * 12)


def write_kv_cases(dt):
    from triton_kernels.kv_write import write_kv_reference, write_kv_triton
    num_blocks = 4096
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, HEADS_KV, HEAD_DIM, dtype=dt, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    for t in (1, 64, 4096):
        k, v = (torch.randn(t, HEADS_KV, HEAD_DIM, dtype=dt, device="cuda") for _ in range(2))
        slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:t]
        yield Case("write_kv", f"T={t} Hk={HEADS_KV}",
                   lambda k=k, v=v, s=slots: write_kv_triton(k, v, k_cache, v_cache, s),
                   lambda k=k, v=v, s=slots: write_kv_reference(k, v, k_cache, v_cache, s),
                   4 * k.numel() * k.element_size() + t * 8)


def paged_attention_cases(dt):
    from triton_kernels.paged_attention import paged_attention_reference, paged_attention_triton
    scale = HEAD_DIM ** -0.5
    # (label, query lengths, context lengths)
    shapes = [("decode", [1], [4096]), ("decode", [1], [32768]), ("decode", [1] * 32, [4096] * 32),
              ("prefill", [4096], [4096]), ("chunked prefill", [512], [8192])]
    for label, q_lens, ctxs in shapes:
        blocks = [math.ceil(c / BLOCK_SIZE) for c in ctxs]
        num_blocks = sum(blocks)
        k_cache = torch.randn(num_blocks, BLOCK_SIZE, HEADS_KV, HEAD_DIM, dtype=dt, device="cuda")
        v_cache = torch.randn_like(k_cache)
        ids = torch.randperm(num_blocks, dtype=torch.int32, device="cuda")
        table = torch.full((len(ctxs), max(blocks)), -1, dtype=torch.int32, device="cuda")
        start = 0
        for b, n in enumerate(blocks):
            table[b, :n] = ids[start:start + n]
            start += n
        cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32,
                          device="cuda")
        seq_lens = torch.tensor(ctxs, dtype=torch.int32, device="cuda")
        q = torch.randn(sum(q_lens), HEADS_Q, HEAD_DIM, dtype=dt, device="cuda")
        elt = q.element_size()
        kv_bytes = sum(ctxs) * 2 * HEADS_KV * HEAD_DIM * elt
        # Causal: query i of a span of n over a context c sees c - n + i + 1 keys.
        pairs = sum(n * (c - n) + n * (n + 1) / 2 for n, c in zip(q_lens, ctxs))
        args = (q, k_cache, v_cache, table, cu, seq_lens, scale)
        yield Case("paged_attention", f"{label} B={len(ctxs)} q={q_lens[0]} ctx={ctxs[0]}",
                   lambda a=args, m=max(q_lens): paged_attention_triton(*a, m),
                   lambda a=args: paged_attention_reference(*a),
                   kv_bytes + 2 * q.numel() * elt, flops=4 * pairs * HEADS_Q * HEAD_DIM)


def fused_moe_cases(dt):
    from triton_kernels.fused_moe import fused_moe_reference, fused_moe_triton
    w13 = torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, dtype=dt, device="cuda") / HIDDEN ** 0.5
    w2 = torch.randn(EXPERTS, HIDDEN, WIDTH, dtype=dt, device="cuda") / WIDTH ** 0.5
    expert_bytes = 3 * WIDTH * HIDDEN * w13.element_size()
    for t in MOE_DECODE_TOKENS + MOE_PREFILL_TOKENS:
        x = torch.randn(t, HIDDEN, dtype=dt, device="cuda")
        # Several routings, cycled, so repeated calls stream their experts from HBM, not L2.
        routings = [torch.topk(torch.randn(t, EXPERTS, device="cuda").softmax(-1), TOP_K, -1)
                    for _ in range(8)]
        unique = sum(len(torch.unique(ids)) for _, ids in routings) / len(routings)
        turn = iter(range(10**12))

        def run(fn, x=x, routings=routings, turn=turn, **kwargs):
            w, ids = routings[next(turn) % len(routings)]
            return fn(x, w13, w2, w, ids, **kwargs)

        paths = ("gemv", "grouped") if t in MOE_DECODE_TOKENS else ("grouped",)
        w0, ids0 = routings[0]
        for path in paths:
            # The reference is timed once per shape, on the first form's row.
            yield Case("fused_moe", f"T={t} E={EXPERTS} k={TOP_K} I={WIDTH}",
                       lambda run=run, path=path: run(fused_moe_triton, path=path),
                       (lambda run=run: run(fused_moe_reference)) if path == paths[0] else None,
                       unique * expert_bytes, flops=2 * t * TOP_K * 3 * HIDDEN * WIDTH,
                       variant=path,
                       check=lambda x=x, w0=w0, ids0=ids0, path=path: (
                           fused_moe_triton(x, w13, w2, w0, ids0, path=path),
                           fused_moe_reference(x, w13, w2, w0, ids0)))


def mla_attention_cases(dt):
    from triton_kernels.mla_attention import mla_attention_reference, mla_attention_triton
    shapes = [("decode", [1], [4096]), ("decode", [1], [32768]), ("decode", [1] * 32, [4096] * 32),
              ("prefill", [2048], [2048]), ("chunked prefill", [512], [8192])]
    for model, heads, scale in MLA_MODELS:
        for label, q_lens, ctxs in shapes:
            blocks = [math.ceil(c / BLOCK_SIZE) for c in ctxs]
            cache = torch.randn(sum(blocks), BLOCK_SIZE, MLA_L + MLA_R, dtype=dt, device="cuda")
            ids = torch.randperm(sum(blocks), dtype=torch.int32, device="cuda")
            table = torch.full((len(ctxs), max(blocks)), -1, dtype=torch.int32, device="cuda")
            start = 0
            for b, n in enumerate(blocks):
                table[b, :n] = ids[start:start + n]
                start += n
            cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32,
                              device="cuda")
            seq_lens = torch.tensor(ctxs, dtype=torch.int32, device="cuda")
            q = torch.randn(sum(q_lens), heads, MLA_L + MLA_R, dtype=dt, device="cuda")
            elt = q.element_size()
            # The latent once, q in, o out; flops: the L + R score and the L-wide output.
            moved = (sum(ctxs) * (MLA_L + MLA_R) + sum(q_lens) * heads * (2 * MLA_L + MLA_R)) * elt
            pairs = sum(n * (c - n) + n * (n + 1) / 2 for n, c in zip(q_lens, ctxs))
            args = (q, cache, table, cu, seq_lens, scale, MLA_L)
            yield Case("mla_attention", f"{model} {label} B={len(ctxs)} q={q_lens[0]} "
                       f"ctx={ctxs[0]}",
                       lambda a=args, m=max(q_lens): mla_attention_triton(*a, m),
                       lambda a=args: mla_attention_reference(*a), moved,
                       flops=2 * pairs * heads * (2 * MLA_L + MLA_R),
                       check=lambda a=args, m=max(q_lens): (mla_attention_triton(*a, m),
                                                            mla_attention_reference(*a)))


def random_quant_bank(fmt, e: int, n: int, k: int, device="cuda") -> dict:
    """A random [e, n, k] bank in fmt's tensors, entries ~1 / sqrt(k) (for the error check)."""
    norm = k ** -0.5
    if fmt.kind.startswith("fp8"):
        bn, bk = fmt.block
        s_shape = {"fp8_block": (-(-n // bn), -(-k // bk)), "fp8_channel": (n,),
                   "fp8_tensor": (1,)}[fmt.kind]
        return {"q": torch.randn(e, n, k, device=device).to(torch.float8_e4m3fn),
                "s": norm * (0.5 + torch.rand((e,) + s_shape, device=device))}
    q = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=device)
    groups = (e, n, k // fmt.group_k)
    if fmt.kind == "mxfp4":
        return {"q": q, "s": torch.randint(118, 122, groups, dtype=torch.uint8, device=device)}
    if fmt.kind == "nvfp4":
        return {"q": q, "s": (0.5 + torch.rand(groups, device=device)).to(torch.float8_e4m3fn),
                "g": torch.full((e, 1), norm / 3, device=device)}
    w = {"q": q, "s": (norm / 7 * (0.5 + torch.rand(groups, device=device))).to(torch.bfloat16)}
    if not fmt.symmetric:
        w["z"] = torch.randint(0, 16, groups, dtype=torch.uint8, device=device)
    return w


def fused_moe_quant_cases(dt, device="cuda"):
    from triton_kernels.dequant import QuantFormat, fused_moe_quant_reference
    from triton_kernels.quant_moe import fused_moe_quant_triton
    formats = [QuantFormat("fp8_block"), QuantFormat("fp8_channel"), QuantFormat("mxfp4"),
               QuantFormat("nvfp4"), QuantFormat("int4", group=128)]
    for fmt in formats:
        w13 = random_quant_bank(fmt, EXPERTS, 2 * WIDTH, HIDDEN, device)
        w2 = random_quant_bank(fmt, EXPERTS, HIDDEN, WIDTH, device)
        expert_bytes = sum(t[0].numel() * t.element_size() for w in (w13, w2) for t in w.values())
        for t in MOE_QUANT_TOKENS:
            x = torch.randn(t, HIDDEN, dtype=dt, device=device)
            routings = [torch.topk(torch.randn(t, EXPERTS, device=device).softmax(-1), TOP_K, -1)
                        for _ in range(8)]
            unique = sum(len(torch.unique(ids)) for _, ids in routings) / len(routings)
            turn = iter(range(10**12))

            def run(fn, x=x, routings=routings, turn=turn, w13=w13, w2=w2, fmt=fmt):
                w, ids = routings[next(turn) % len(routings)]
                return fn(x, fmt, w13, w2, w, ids)

            w0, ids0 = routings[0]
            label = fmt.kind + (f"/g{fmt.group}" if fmt.kind == "int4" else "")
            yield Case("fused_moe_quant", f"{label} T={t} E={EXPERTS} k={TOP_K} I={WIDTH}",
                       lambda run=run: run(fused_moe_quant_triton),
                       (lambda run=run: run(fused_moe_quant_reference)) if t == 1 else None,
                       unique * expert_bytes, flops=2 * t * TOP_K * 3 * HIDDEN * WIDTH,
                       check=lambda x=x, w0=w0, ids0=ids0, w13=w13, w2=w2, fmt=fmt: (
                           fused_moe_quant_triton(x, fmt, w13, w2, w0, ids0),
                           fused_moe_quant_reference(x, fmt, w13, w2, w0, ids0)))


def print_quant_ratios(rows: list, dense: dict, ceiling: float) -> None:
    """fused_moe_quant rows: GB/s as fractions of the copy ceilings, and time vs bf16."""
    if not rows:
        return
    print(f"\nquantized MoE decode: GB/s of quantized bytes / copy ceiling here "
          f"({ceiling / 1e9:.0f} GB/s) and / GPU.md's H200 ({H200_COPY_GBS} GB/s); "
          f"time / fused_moe's at that T")
    for shape, seconds, gbs in rows:
        t = shape.split("T=")[1].split()[0]
        base = dense.get(t)
        vs = f"{seconds / base:.2f}x the dense time" if base else "(no fused_moe row at this T)"
        print(f"  {shape:<44} {gbs / 1e9:>6.0f} GB/s  {gbs / ceiling:>5.0%} here  "
              f"{gbs / 1e9 / H200_COPY_GBS:>5.0%} of GPU.md  {vs}")
def _varlen(lens):
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    return (torch.arange(len(lens), dtype=torch.int32, device="cuda"), cu,
            torch.ones(len(lens), dtype=torch.bool, device="cuda"))


def gated_delta_rule_cases(dt):
    from triton_kernels.gated_delta import gated_delta_rule_reference, gated_delta_rule_triton
    scale = GDN_D ** -0.5
    # (label, lengths): decode takes the recurrent kernel, prefill the chunked one (and the
    # recurrent one too, as a variant, to show what chunking buys)
    for label, lens in (("decode", [1]), ("decode", [1] * 32), ("prefill", [512]),
                        ("prefill", [4096]), ("prefill", [512] * 8)):
        t, n = sum(lens), len(lens)
        q, k = (torch.randn(t, GDN_HK, GDN_D, dtype=dt, device="cuda") for _ in range(2))
        v = torch.randn(t, GDN_HV, GDN_D, dtype=dt, device="cuda")
        g = -torch.rand(t, GDN_HV, device="cuda") * 0.5
        beta = torch.rand(t, GDN_HV, device="cuda").to(dt)
        pool = torch.randn(n, GDN_HV, GDN_D, GDN_D, device="cuda") * 0.1
        slots, cu, has = _varlen(lens)
        args = (q, k, v, g, beta, pool, slots, cu, has, scale)
        moved = (2 * pool.numel() * 4 + (q.numel() + k.numel() + 2 * v.numel()) * q.element_size()
                 + t * GDN_HV * 4 * 2)
        variants = ("recurrent",) if label == "decode" else ("chunked", "recurrent")
        for variant in variants:
            def check(args=args, chunked=variant == "chunked"):
                start = args[5].clone()
                ref_pool = start.clone()
                out = gated_delta_rule_triton(*args[:5], start, *args[6:], chunked=chunked)
                return out, gated_delta_rule_reference(*args[:5], ref_pool, *args[6:])
            yield Case("gated_delta", f"{label} N={n} L={lens[0]}",
                       lambda a=args, c=variant == "chunked": gated_delta_rule_triton(*a,
                                                                                      chunked=c),
                       ((lambda a=args: gated_delta_rule_reference(*a))
                        if t <= 32 and variant == variants[0] else None),
                       moved, variant=variant, check=check if t <= 512 else None)


def causal_conv1d_cases(dt):
    from triton_kernels.causal_conv1d import causal_conv1d_reference, causal_conv1d_triton
    c = 2 * GDN_HK * GDN_D + GDN_HV * GDN_D
    weight = torch.randn(c, GDN_W, dtype=dt, device="cuda") / 2
    for label, lens in (("decode", [1]), ("decode", [1] * 32), ("prefill", [4096]),
                        ("prefill", [512] * 8)):
        t, n = sum(lens), len(lens)
        x = torch.randn(t, c, dtype=dt, device="cuda")
        pool = torch.randn(n, c, GDN_W - 1, dtype=dt, device="cuda")
        slots, cu, has = _varlen(lens)
        args = (x, weight, None, pool, slots, cu, has)
        moved = (2 * x.numel() + 2 * pool.numel() + weight.numel()) * x.element_size()
        yield Case("causal_conv1d", f"{label} N={n} L={lens[0]} C={c}",
                   lambda a=args: causal_conv1d_triton(*a),
                   (lambda a=args: causal_conv1d_reference(*a)) if t <= 512 else None, moved)


CASES = {"rms_norm": rms_norm_cases, "rope": rope_cases, "silu_and_mul": silu_and_mul_cases,
         "topk_softmax": topk_softmax_cases, "write_kv": write_kv_cases,
         "paged_attention": paged_attention_cases, "fused_moe": fused_moe_cases,
         "mla_attention": mla_attention_cases,
         "fused_moe_quant": fused_moe_quant_cases,
         "gated_delta_rule": gated_delta_rule_cases, "causal_conv1d": causal_conv1d_cases}


# ---- report ---------------------------------------------------------------------------------

def print_fastest_forms(forms: dict) -> None:
    """Per shape timed in several forms, the forms fastest first, eagerly (what serving
    without CUDA graphs pays, launches included) and replayed from a graph (kernels alone)."""
    compared = {key: timed for key, timed in forms.items() if len(timed) > 1}
    if not compared:
        return
    print("\nforms compared, fastest first (us):")
    for (op, shape), timed in compared.items():
        eager = sorted(timed.items(), key=lambda item: item[1][0])
        line = "eager " + " < ".join(f"{v} {e * 1e6:.1f}" for v, (e, _) in eager)
        if all(g is not None for _, g in timed.values()):
            graph = sorted(timed.items(), key=lambda item: item[1][1])
            line += " | graph " + " < ".join(f"{v} {g * 1e6:.1f}" for v, (_, g) in graph)
        print(f"  {op:<10} {shape:<34} {line}")


def relative_error(case: Case) -> str:
    """max |out - ref| / max |ref| of the tuned kernel against its reference, or '-'."""
    if case.check is None:
        return "-"
    out, ref = case.check()
    return f"{((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)).item():.1e}"


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA device: the Triton kernels only run on a GPU "
              "(tests/test_kernels.py checks them in the interpreter instead).", file=sys.stderr)
        return 2
    dt = DTYPES[args.dtype]
    torch.manual_seed(0)
    ceiling = copy_ceiling(args.reps, args.rounds)
    print(f"{torch.cuda.get_device_name()}: memory copy ceiling {ceiling / 1e9:.0f} GB/s "
          f"(1 GiB device-to-device, read + write), dtype {args.dtype}\n")
    header = (f"{'op':<18} {'shape':<34} {'triton us':>10} {'graph us':>9} {'ref us':>10} "
              f"{'speedup':>8} {'GB/s':>7} {'of copy':>8} {'TFLOP/s':>8} {'rel err':>8}")
    print(header)
    print("-" * len(header))
    forms = {}          # (op, shape) -> {variant: (eager s, graph s or None)}
    dense, quant = {}, []   # fused_moe's best time per T; fused_moe_quant's (shape, s, B/s)
    for op in args.ops:
        for case in CASES[op](dt):
            eager = time_eager(case.triton, args.reps, args.rounds)
            graph = None if args.no_graph else time_graph(case.triton, args.reps, args.rounds)
            ref = (None if args.no_reference or case.reference is None
                   else time_eager(case.reference, max(1, args.reps // 5), args.rounds))
            kernel_time = graph or eager
            gbs = case.bytes / kernel_time
            name = f"{case.op} {case.variant}".strip()
            print(f"{name:<18} {case.shape:<34} {eager * 1e6:>10.1f} "
                  f"{'-' if graph is None else f'{graph * 1e6:.1f}':>9} "
                  f"{'-' if ref is None else f'{ref * 1e6:.1f}':>10} "
                  f"{'-' if ref is None else f'{ref / eager:.2f}x':>8} "
                  f"{gbs / 1e9:>7.0f} {gbs / ceiling:>8.0%} "
                  f"{f'{case.flops / kernel_time / 1e12:.1f}' if case.flops else '-':>8} "
                  f"{relative_error(case):>8}")
            if case.variant:
                forms.setdefault((case.op, case.shape), {})[case.variant] = (eager, graph)
            if case.op == "fused_moe":
                t = case.shape.split()[0][2:]
                dense[t] = min(dense.get(t, math.inf), kernel_time)
            elif case.op == "fused_moe_quant":
                quant.append((case.shape, kernel_time, gbs))
    print_fastest_forms(forms)
    print_quant_ratios(quant, dense, ceiling)
    return 0


if __name__ == "__main__":
    sys.exit(main())
