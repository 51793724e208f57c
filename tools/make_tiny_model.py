#!/usr/bin/env python3
"""Write a tiny random-weight MoE checkpoint in Hugging Face's hub layout.

    python tools/make_tiny_model.py --family qwen3_moe --out /tmp/tiny
    python tools/make_tiny_model.py --family mixtral --out /tmp/tiny-mx --max-shard-mb 1
    python tools/make_tiny_model.py --family glm4_moe --out /tmp/tiny-glm --no-mtp
    python tools/make_tiny_model.py --family gpt_oss --out /tmp/tiny-oss --quant mxfp4

Families: qwen3_moe, qwen2_moe, mixtral, gpt_oss, glm4_moe, minimax_m2, olmoe, ernie4_5_moe,
qwen3_next, qwen3_5_moe (the released VL-wrapper layout), deepseek_v3, glm4_moe_lite.

The work is freetoken.demo.tiny_model.make_tiny_model (which `ft serve` uses for its demo
model); this only parses flags. The same flags always give byte-identical files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# This checkout's freetoken, even where another one is installed (a git worktree, say).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from freetoken.demo.tiny_model import FAMILIES, TinyShape, make_tiny_model  # noqa: E402
from freetoken.models.quant.encode import QUANTS, quantize_checkpoint  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    d = TinyShape()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=FAMILIES, default="qwen3_moe")
    p.add_argument("--out", required=True, type=Path, help="folder to write (created if absent)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat-template", default="qwen3",
                   help="template variant: qwen3 (thinking switch), thinking (always on, opened in "
                        "the prompt), graded (switch, opened in the prompt, reads reasoning_effort)")
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--num-layers", type=int, default=d.num_layers)
    p.add_argument("--num-heads", type=int, default=d.num_heads)
    p.add_argument("--num-kv-heads", type=int, default=d.num_kv_heads)
    p.add_argument("--head-dim", type=int, default=None, help="default: hidden-size / num-heads")
    p.add_argument("--num-experts", type=int, default=d.num_experts)
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--moe-intermediate-size", type=int, default=d.moe_intermediate_size,
                   help="one expert's width")
    p.add_argument("--intermediate-size", type=int, default=d.intermediate_size,
                   help="dense MLP width (qwen layers without experts)")
    p.add_argument("--shared-expert-intermediate-size", type=int,
                   default=d.shared_expert_intermediate_size,
                   help="qwen2_moe, qwen3_next, qwen3_5_moe")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size,
                   help="model vocab, at least the tokenizer's size")
    p.add_argument("--norm-topk-prob", action=argparse.BooleanOptionalAction, default=None,
                   help="renormalise the top-k router weights (default: the family's usual)")
    p.add_argument("--tie-word-embeddings", action=argparse.BooleanOptionalAction, default=None,
                   help="default: the family's usual (ernie4_5_moe tied, the others not)")
    p.add_argument("--mlp-only-layers", default="", help="comma list of dense layer indices")
    p.add_argument("--decoder-sparse-step", type=int, default=d.decoder_sparse_step)
    p.add_argument("--max-position-embeddings", type=int, default=d.max_position_embeddings)
    p.add_argument("--rms-norm-eps", type=float, default=None, help="default: the family's usual")
    p.add_argument("--rope-theta", type=float, default=d.rope_theta)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=d.dtype)
    p.add_argument("--max-shard-mb", type=float, default=None,
                   help="shard the weights into files of at most this many MB (1e6 bytes)")
    p.add_argument("--sliding-window", type=int, default=d.sliding_window, help="gpt_oss' even layers")
    p.add_argument("--first-k-dense-replace", type=int, default=d.first_k_dense_replace,
                   help="leading dense layers (glm4_moe; ernie4_5_moe's moe_layer_start_index)")
    p.add_argument("--n-group", type=int, default=d.n_group, help="glm4_moe expert groups")
    p.add_argument("--topk-group", type=int, default=d.topk_group, help="glm4_moe groups a token may use")
    p.add_argument("--n-shared-experts", type=int, default=None,
                   help="glm4_moe (default 1), ernie4_5_moe (default 2)")
    p.add_argument("--routed-scaling-factor", type=float, default=d.routed_scaling_factor, help="glm4_moe")
    p.add_argument("--partial-rotary-factor", type=float, default=d.partial_rotary_factor,
                   help="rotated share of head_dim (glm4_moe, minimax_m2)")
    p.add_argument("--attention-bias", action=argparse.BooleanOptionalAction, default=None,
                   help="glm4_moe q/k/v biases (default on)")
    p.add_argument("--use-qk-norm", action=argparse.BooleanOptionalAction, default=d.use_qk_norm,
                   help="glm4_moe per-head q/k norms")
    p.add_argument("--mtp", action=argparse.BooleanOptionalAction, default=None,
                   help="glm4_moe: write the MTP layer model.layers.{num_layers}.* (default on)")
    mla = "deepseek_v3, glm4_moe_lite"
    p.add_argument("--q-lora-rank", type=lambda v: None if v.lower() in ("none", "null") else int(v),
                   default=d.q_lora_rank, help=f"{mla}: q LoRA rank, or none for one q_proj")
    p.add_argument("--kv-lora-rank", type=int, default=d.kv_lora_rank, help=f"{mla}: latent width")
    p.add_argument("--qk-nope-head-dim", type=int, default=d.qk_nope_head_dim, help=mla)
    p.add_argument("--qk-rope-head-dim", type=int, default=d.qk_rope_head_dim, help=mla)
    p.add_argument("--v-head-dim", type=int, default=d.v_head_dim, help=mla)
    p.add_argument("--rope-yarn-factor", type=float, default=d.rope_yarn_factor,
                   help=f"{mla}: YaRN factor (DeepSeek's mscale), 0 for plain RoPE")
    p.add_argument("--quant", choices=QUANTS, default=None,
                   help="write the weights quantized, in that method's real on-disk layout "
                        "(freetoken/models/quant/encode.py; mxfp4 is gpt_oss' own)")
    p.add_argument("--quant-block", default="128,128", help="fp8 weight_block_size rows,cols")
    p.add_argument("--quant-group", type=int, default=32, help="int4 group size (32, 64, 128)")
    p.add_argument("--quant-skew", type=float, default=2.0,
                   help="scale blocks drawn up to 2^skew apart, so indexing mistakes show")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    shape = {k: v for k, v in vars(a).items() if k not in ("family", "out", "seed", "chat_template")
             and not k.startswith("quant")}
    shape["mlp_only_layers"] = tuple(int(i) for i in a.mlp_only_layers.split(",") if i.strip())
    if a.quant and (a.quant == "mxfp4") != (a.family == "gpt_oss"):
        print(f"make_tiny_model: --quant {a.quant} with --family {a.family}: mxfp4 is gpt-oss' "
              f"layout, and gpt-oss' experts are only released in it", file=sys.stderr)
        return 2
    try:
        out = make_tiny_model(a.out, family=a.family, seed=a.seed, chat_template=a.chat_template, **shape)
        if a.quant:
            block = tuple(int(b) for b in a.quant_block.split(","))
            quantize_checkpoint(out, a.quant, block=block, group=a.quant_group, skew=a.quant_skew,
                                seed=a.seed)
    except ValueError as e:
        print(f"make_tiny_model: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
