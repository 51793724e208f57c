#!/usr/bin/env python3
"""A CPU engine's MLA decode step: the native call (triton_kernels/cpu_mla.c) against the
modules' torch path it replaced (mla.py's absorbed form: the latent's norm and rope, the
cache write, W_UK and W_UV as batched products, mla_attention_reference), one layer, in one
run.

    python bench/cpu_mla.py                                  # DeepSeek-V3's dims, 16 heads
    python bench/cpu_mla.py --heads 128 --contexts 4096 --reps 3

One sequence at batch 1 decoding its next token after `context` cached latents (random bf16
weights and cache, 16-token blocks), from the layer's input x to o_proj's output. Per context
the median of --reps steps in ms each way and the speedup in the same run (the machine is
shared: compare ratios, not milliseconds across runs).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # this checkout's freetoken
from cpu_attention import median_ms  # noqa: E402 - bench/, the script's own folder


def layer_of(heads: int, hidden: int):
    """An MLA layer of DeepSeek-V3's head dims (N 128, R 64, L 512, V 128, q LoRA 1536),
    random bf16 weights, packed as a CPU engine packs it."""
    from freetoken.models.layers.mla import MlaAttention, MlaConfig
    from freetoken.models.rope import RopeTable
    cfg = MlaConfig(hidden_size=hidden, num_heads=heads, q_lora_rank=1536, kv_lora_rank=512,
                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    rope = RopeTable({"rope_type": "default", "rope_theta": 10000.0}, cfg.qk_rope_head_dim)
    rope.build(1 << 17, "cpu")
    layer = MlaAttention(cfg, 0, rope)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    layer = layer.bfloat16()
    for m in layer.modules():
        if hasattr(m, "pack_cpu"):
            m.pack_cpu()
    layer.bind_cpu()
    return layer


def batch_at(layer, context: int):
    from freetoken.engine.batch import ForwardBatch
    from freetoken.engine.kv_cache import KVCache
    bs = 16
    kv = KVCache({0: layer.cache_spec()}, -(-context // bs) + 1, bs, torch.bfloat16, "cpu")
    kv.layer(0)[0].normal_()
    return ForwardBatch(
        input_ids=torch.zeros(1, dtype=torch.long), positions=torch.tensor([context - 1]),
        cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([context], dtype=torch.int32),
        block_tables=torch.arange(-(-context // bs), dtype=torch.int32)[None],
        slot_mapping=torch.tensor([context - 1]), logits_indices=torch.arange(1),
        max_seqlen_q=1, num_seqs=1, kv=kv)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--contexts", default="256,4096,16384")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    layer = layer_of(args.heads, args.hidden)
    native = layer.cpu_decode
    if native is None:
        print("no native MLA decode here (no C compiler?): nothing to compare", file=sys.stderr)
        return 1
    x = torch.randn(1, args.hidden).bfloat16()
    print(f"MLA decode, {args.heads} heads (N 128, R 64, L 512, V 128), bf16, "
          f"{args.threads} threads; ms, median of {args.reps}")
    print(f"{'context':>8} {'native':>9} {'torch':>9} {'speedup':>8}")
    for context in (int(c) for c in args.contexts.split(",")):
        batch = batch_at(layer, context)
        res = {}
        for name, call in (("native", native), ("torch", None)):
            layer.cpu_decode = call
            res[name] = median_ms(lambda: layer(x, batch), args.reps)
        layer.cpu_decode = native
        print(f"{context:>8} {res['native']:>9.2f} {res['torch']:>9.2f} "
              f"{res['torch'] / res['native']:>7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
