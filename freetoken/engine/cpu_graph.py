"""A CPU engine's decode step as one native program: what a CUDA graph is to a GPU engine.

The modules' decode step on a CPU engine is ~8 native calls a layer (cpu_native.py's bound
calls) with Python between them; each call costs 10-15 us beyond its work. Here the same
calls are recorded once (triton_kernels/cpu_program.py) over buffers of ROWS rows, and each
pure-decode batch of up to ROWS sequences replays them: the scheduler's chunks (token ids,
positions, slots, lengths, block tables) written into the int buffers, one library call per
run of native ops from the embedding's gather to the logits widened to float32, whose rows
the sampler reads where they are.
Same kernels, same arguments, same order: the same bits as the modules' step
(ROWS says why only up to it). Batch-1 steps on a 2-core Xeon (bench/cpu.py's 12-layer
model; timed alone over 64 tokens), modules -> program: bf16 12.9 -> 10.6 ms, FP8 10.9 ->
7.7, INT4 9.2 -> 8.1; the same depth with negligible weights 1.73 -> 0.48 ms.

Built where every layer is one the native calls cover (else `build` says why not, and the
modules run every step):
- DecoderLayer: native RMSNorms (16-bit);
- Attention with its native decode step (cpu_decode) after the fused q/k/v product, the
  KV cache 16-bit or float32; q/k norms across heads and clipping (OLMoE, MiniMax-M2)
  natively before it, an output gate (Qwen3-Next/3.5) natively after it;
- GatedDeltaNet (Qwen3-Next/3.5's linear attention) with its decode call (cpu_decode: the
  layer between its projections in one call) after the fused input projections;
- MlaAttention (DeepSeek-V3, Kimi-K2, GLM-4.7-Flash) with its decode call (cpu_mla.c: the
  absorbed form from q and the latent's projections to o_proj's input);
- SparseMoeBlock: a router on the native GEMV and top-k (softmax -> top-k, or biased,
  sigmoid, grouped: cpu_route.c), the
  experts in native banks (bf16, fp8 or int4) computed by the CPU; shared experts (a
  DenseMLP: gate/up product, native SwiGLU, down) added natively, gated or not;
- DenseMLP (dense layers) the same way;
- projections on the native GEMV (CpuLinear; Int4Linear's where it has one), or torch's
  int4 GEMM (Int4Linear) or FBGEMM's (a decoded weight without a GEMV form), which run as
  Python steps between the runs of native ops.
Families that fit: all of the registry's.
`enforce_eager` (vLLM's name) turns it off.

Buffers (R = ROWS, D hidden): ids, positions, slots, lengths [R] and block tables [R, M]
(the step's chunks); res [R, D] the residual stream (the embedding rows first), h
[R, D] each block's output, n [R, D] the normed input of the next block; per layer shape,
qkv [R, (Hq + 2Hk) Dh] (gated: (2Hq + 2Hk) Dh), o and its float32 scratch [R, Hq Dh], a
Gated DeltaNet layer's projections [R, P] and output [R, Hv Dv], router logits [R, E],
top-k weights and ids [R, k], the experts' scratch, a shared expert's gate/up [R, 2I],
activation [R, I], output [R, D] and gate logit [R, 1]; logits [R, V] in the model's dtype
and in float32; the sequences' state slots and has-state flags [R] (hybrid models).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import triton_kernels as tk
from freetoken.models.layers.attention import Attention
from freetoken.models.layers.decoder import DecoderLayer, MoeForCausalLM
from freetoken.models.layers.linear import Linear, QuantLinear
from freetoken.models.layers.linear_attention import GatedDeltaNet
from freetoken.models.layers.mla import MlaAttention
from freetoken.models.layers.mlp import DenseMLP
from freetoken.models.layers.moe import SparseMoeBlock
from triton_kernels.cpu_linear import GEMM_ROWS, NATIVE_ROWS

if TYPE_CHECKING:
    from freetoken.engine.model_runner import SeqChunk

# From NATIVE_ROWS rows the projections take the GEMMs, and from GEMM_ROWS rows an expert a
# MoE call's experts take AMX's products (fused_moe._amx_prefill): below both, the modules'
# step is the native calls alone, which is what the program records.
ROWS = min(NATIVE_ROWS, GEMM_ROWS) - 1


class NotCovered(Exception):
    """What in the model the native calls do not cover."""


def _need(ok, why: str) -> None:
    if not ok:
        raise NotCovered(why)


class CpuDecodeGraph:
    def __init__(self, model: MoeForCausalLM, kv, max_blocks: int):
        kernel = tk.native_kernels()
        _need(kernel is not None, "no native kernels")
        _need(isinstance(model, MoeForCausalLM), f"{type(model).__name__} is not a decoder stack")
        inner = model.model
        self.embed = inner.embed_tokens.weight
        dtype, d = self.embed.dtype, self.embed.shape[1]
        _need(dtype in (torch.bfloat16, torch.float16), f"a {dtype} model")
        self.dtype, r = dtype, ROWS
        self.res, self.h, self.n = (torch.zeros(r, d, dtype=dtype) for _ in range(3))
        self.ids = torch.zeros(r, dtype=torch.int64)
        self.positions = torch.zeros(r, dtype=torch.int64)
        self.slots = torch.zeros(r, dtype=torch.int64)
        self.lens = torch.ones(r, dtype=torch.int32)
        self.tables = torch.zeros(r, max_blocks, dtype=torch.int32)
        self.state_slots = torch.zeros(r, dtype=torch.int32)
        self.has_state = torch.ones(r, dtype=torch.uint8)
        self.recurrent = False                      # any Gated DeltaNet layer (run's copies)
        # numpy views of the step's int buffers, which decode() writes the step's chunks into
        self._np = {name: getattr(self, name).numpy() for name in
                    ("ids", "positions", "slots", "lens", "tables", "state_slots", "has_state")}
        self._kernel = kernel
        self._shared: dict = {}                     # buffers by (name, width, dtype)
        prog = self.program = tk.CpuProgram(kernel, r)
        prog.add(kernel.embed_op(self.embed, self.ids, self.res), "the embedding")
        for i, layer in enumerate(inner.layers):
            _need(type(layer) is DecoderLayer, f"layer {i} is a {type(layer).__name__}")
            norm_in, norm_post = (layer.input_layernorm.native,
                                  layer.post_attention_layernorm.native)
            _need(norm_in is not None and norm_post is not None, f"layer {i}'s norms")
            prog.add(norm_in.op(self.res, None, self.n) if i == 0
                     else norm_in.op(self.h, self.res, self.n, self.res),
                     f"layer {i}'s input norm")
            if isinstance(layer.attn_module, GatedDeltaNet):
                self._linear_attention(layer.attn_module, kv.layer(i), i)  # n -> h
            elif isinstance(layer.attn_module, MlaAttention):
                self._latent_attention(layer.attn_module, kv.layer(i), i)  # n -> h
            else:
                self._attention(layer.attn_module, kv.layer(i), i)          # n -> h
            prog.add(norm_post.op(self.h, self.res, self.n, self.res),
                     f"layer {i}'s post-attention norm")
            if isinstance(layer.mlp_module, DenseMLP):
                self._mlp(layer.mlp_module, self.h, f"layer {i}'s MLP")     # n -> h
            else:
                self._moe(layer.mlp_module, i)                              # n -> h
        _need(inner.norm.native is not None, "the final norm")
        prog.add(inner.norm.native.op(self.h, self.res, self.n, self.res), "the final norm")
        self.logits = torch.zeros(r, model.config.vocab_size, dtype=dtype)
        self._linear(model.lm_head, self.n, self.logits, "lm_head")
        # and the sampler's float32 input, a view of it for each row count made here
        logits32 = torch.zeros(r, model.config.vocab_size)
        prog.add(kernel.widen_op(self.logits, logits32), "the logits' widening")
        self._logit_rows = [logits32[:b] for b in range(r + 1)]
        prog.compile()
        self.runs = 0                               # steps replayed (instrumentation, tests)

    @classmethod
    def build(cls, model, kv, max_blocks: int) -> tuple[CpuDecodeGraph | None, str]:
        """The graph, or None and what the native calls do not cover (or which of their
        checks a layer failed: the modules run it as before)."""
        try:
            return cls(model, kv, max_blocks), ""
        except (NotCovered, ValueError) as exc:
            return None, str(exc)

    def _buf(self, name: str, width: int, dtype=None) -> torch.Tensor:
        """A buffer [ROWS, width] the layers share (they run one after another)."""
        key = (name, width, dtype or self.dtype)
        if key not in self._shared:
            self._shared[key] = torch.zeros(ROWS, width, dtype=key[2])
        return self._shared[key]

    def _linear(self, proj, x: torch.Tensor, out: torch.Tensor, what: str) -> None:
        """x [R, K] -> out [R, N] through a projection's CPU product for decode rows."""
        packed = proj.packed if isinstance(proj, (Linear, QuantLinear)) else proj
        if isinstance(packed, (tk.CpuLinear, tk.Int4Linear)) and packed.gemv is not None:
            self.program.add(packed.gemv.op(x, out), what)
        elif isinstance(packed, (tk.Int4Linear, tk.CpuLinear)):
            # torch's int4 GEMM (where the native GEMV does not beat it at one row: AVX-512),
            # or a decoded weight only FBGEMM holds (no AMX: a fused q/k/v whose fp8 blocks
            # straddle two projections, fp4): a Python step, as the modules run it
            self.program.python(lambda t: out[:t].copy_(packed(x[:t])), what)
        else:
            raise NotCovered(f"{what} has no packed CPU product")

    def _attention(self, attn, caches, i: int) -> None:
        """n -> h: the fused q/k/v product, the native decode step, o_proj."""
        _need(isinstance(attn, Attention) and attn.cpu_decode is not None
              and attn.qkv_packed is not None, f"layer {i}'s attention has no native decode step")
        k_cache, v_cache = caches
        _need(attn.cpu_decode.takes(k_cache, v_cache), f"layer {i}'s KV cache is "
              f"{k_cache.dtype}")
        hq, dh = attn.num_heads, attn.head_dim
        qkv = self._buf("qkv", sum(attn.qkv_widths))
        o, scratch = self._buf("o", hq * dh), self._buf("o32", hq * dh, torch.float32)
        self._linear(attn.qkv_packed, self.n, qkv, f"layer {i}'s q/k/v")
        if attn.cpu_decode.whole:
            self.program.add(attn.cpu_decode.whole_op(qkv),
                             f"layer {i}'s q/k norms across heads and clipping")
        self.program.add(attn.cpu_decode.call.op(qkv, attn.rope.cos_sin, self.positions,
                                                 k_cache, v_cache, self.slots, self.tables,
                                                 self.lens, scratch, o),
                         f"layer {i}'s attention")
        if attn.cpu_decode.gated:
            self.program.add(self._kernel.sigmoid_gate_op(o, qkv, hq, dh),
                             f"layer {i}'s output gate")
        self._linear(attn.o_proj, o, self.h, f"layer {i}'s o_proj")

    def _linear_attention(self, gdn, pools, i: int) -> None:
        """n -> h: the fused input projections, the decode call, out_proj."""
        _need(gdn.cpu_decode is not None and gdn.proj_packed is not None,
              f"layer {i}'s linear attention has no native decode call")
        state, conv_state = pools
        _need(gdn.cpu_decode.takes(conv_state, state), f"layer {i}'s state pools are "
              f"{conv_state.dtype} / {state.dtype}")
        c = gdn.cfg
        proj = self._buf("gdn_proj", sum(gdn.proj_widths))
        o = self._buf("gdn_o", c.value_dim)
        self._linear(gdn.proj_packed, self.n, proj, f"layer {i}'s linear attention projections")
        self.program.add(gdn.cpu_decode.op(proj, conv_state, state, self.state_slots,
                                           self.has_state, o), f"layer {i}'s linear attention")
        self._linear(gdn.out_proj, o, self.h, f"layer {i}'s out_proj")
        self.recurrent = True

    def _latent_attention(self, mla, caches, i: int) -> None:
        """n -> h: q (q_a, its norm, q_b; or q_proj), kv_a, the decode call, o_proj."""
        _need(mla.cpu_decode is not None, f"layer {i}'s latent attention has no native "
              f"decode step")
        (cache,) = caches
        _need(mla.cpu_decode.takes(cache), f"layer {i}'s latent cache is {cache.dtype}")
        c, h = mla.cfg, mla.num_heads
        q = self._buf("mla_q", h * c.qk_head_dim)
        if c.q_lora_rank is None:
            self._linear(mla.q_proj, self.n, q, f"layer {i}'s q_proj")
        else:
            norm = mla.q_a_layernorm.native
            _need(norm is not None, f"layer {i}'s q_a_layernorm")
            qa, qa_n = self._buf("mla_qa", c.q_lora_rank), self._buf("mla_qa_n", c.q_lora_rank)
            self._linear(mla.q_a_proj, self.n, qa, f"layer {i}'s q_a_proj")
            self.program.add(norm.op(qa, None, qa_n), f"layer {i}'s q_a_layernorm")
            self._linear(mla.q_b_proj, qa_n, q, f"layer {i}'s q_b_proj")
        kv = self._buf("mla_kv", c.kv_lora_rank + c.qk_rope_head_dim)
        self._linear(mla.kv_a_proj_with_mqa, self.n, kv, f"layer {i}'s kv_a_proj")
        o = self._buf("mla_o", h * c.v_head_dim)
        scratch = self._buf("mla_scratch", h * (c.kv_lora_rank + c.qk_rope_head_dim),
                            torch.float32)
        self.program.add(mla.cpu_decode.op(q, kv, mla.rope.cos_sin, self.positions, cache,
                                           self.slots, self.tables, self.lens, scratch, o),
                         f"layer {i}'s latent attention")
        self._linear(mla.o_proj, o, self.h, f"layer {i}'s o_proj")

    def _mlp(self, mlp, out: torch.Tensor, what: str) -> None:
        """n -> out: a SwiGLU MLP's gate/up product, the native SwiGLU, down."""
        _need(isinstance(mlp, DenseMLP) and mlp.gate_up is not None and mlp.native is not None,
              f"{what} has no fused gate/up product and native SwiGLU")
        width = mlp.down_proj.in_features
        gate_up, act = self._buf("mlp_gu", 2 * width), self._buf("mlp_act", width)
        self._linear(mlp.gate_up, self.n, gate_up, f"{what}'s gate/up")
        self.program.add(self._kernel.silu_mul_op(gate_up, act), f"{what}'s SwiGLU")
        self._linear(mlp.down_proj, act, out, f"{what}'s down_proj")

    def _moe(self, mlp, i: int) -> None:
        """n -> h: router GEMV, top-k, the routed experts; the shared experts added."""
        _need(isinstance(mlp, SparseMoeBlock), f"layer {i}'s MLP is a {type(mlp).__name__}")
        _need(mlp.shared_name is None or mlp.native is not None,
              f"layer {i}'s shared experts have no native add")
        gate, c, experts = mlp.gate, mlp.gate.cfg, mlp.experts
        _need(gate.native is not None, f"layer {i}'s router is not a native top-k")
        bank = experts.packed
        _need(experts.runtime is None and bank is not None
              and isinstance(bank.get("w13"), (tk.NativeBank, tk.NativeFp8Bank,
                                               tk.NativeInt4Bank)),
              f"layer {i}'s experts are not in native banks the CPU computes")
        kwargs = experts.layout.kernel_kwargs(bank)
        act = kwargs.get("activation", tk.SILU)
        call = tk.bound_moe(bank["w13"], bank["w2"], kwargs.get("b13"), kwargs.get("b2"))
        logits = self._buf("router", c.num_experts, torch.float32 if c.float32 else None)
        weights = self._buf("topk_w", c.top_k, torch.float32)
        ids = self._buf("topk_ids", c.top_k, torch.int64)
        scratch = self._buf("moe32", c.top_k * call.width + call.d, torch.float32)
        if c.float32:                   # HF's float32 router: the native GEMV's unrounded sums
            _need(gate.exact is not None, f"layer {i}'s float32 router has no native product")
            self.program.add(gate.exact.op(self.n, logits), f"layer {i}'s router")
        else:
            self._linear(gate.packed, self.n, logits, f"layer {i}'s router")
        round_to = self.dtype if c.weights_in_model_dtype else None
        self.program.add(gate.native.topk_op(logits, c.top_k, c.renormalize, weights, ids,
                                             round_to) if c.plain
                         else gate.native.topk_biased_op(logits, c.top_k, weights, ids,
                                                         round_to=round_to, **gate.biased_args()),
                         f"layer {i}'s top-k")
        self.program.add(call.op(self.n, weights, ids, scratch, self.h, act.kind, act.alpha,
                                 act.limit), f"layer {i}'s experts")
        if mlp.shared_name is None:
            return
        shared = self._buf("shared_out", self.h.shape[1])
        self._mlp(getattr(mlp, mlp.shared_name), shared, f"layer {i}'s shared experts")
        logit = None
        if mlp.shared_expert_gate is not None:
            logit = self._buf("shared_gate", 1)
            self._linear(mlp.shared_expert_gate, self.n, logit, f"layer {i}'s shared gate")
        self.program.add(self._kernel.add_gated_op(self.h, shared, logit),
                         f"layer {i}'s shared experts' add")

    def decode(self, chunks: list[SeqChunk], block_size: int) -> torch.Tensor | None:
        """float32 logits [B, V], a row for each chunk (the program's buffer: read them before
        the next step), or None where the step is not a decode of at most ROWS sequences that
        all sample (the modules run it).

        No torch op runs here: the chunks go straight into the program's buffers (no
        ForwardBatch), the embedding's gather and the logits' widening are the program's.
        The program streams 0.1-0.3 GB of weights a step, which leaves the host's code and
        data in DRAM, and each torch op after it cost 20-170 us. FP8 bench model, batch 1,
        the old host path and this one alternated in one process (12 pairs of 200 steps):
        the host's share of a step 1.24 -> 0.90 ms, the step 10.17 -> 9.96 ms (the program
        itself ran 0.14 ms slower after the shorter host part; 10 of 12 pairs won)."""
        b = len(chunks)
        if not 1 <= b <= ROWS or any(len(c.token_ids) != 1 or not c.want_logits for c in chunks):
            return None
        m = max(len(c.block_ids) for c in chunks)
        if m > self.tables.shape[1]:
            return None
        buf = self._np
        buf["ids"][:b] = [c.token_ids[0] for c in chunks]
        buf["positions"][:b] = [c.start for c in chunks]
        buf["lens"][:b] = [c.start + 1 for c in chunks]
        buf["slots"][:b] = [c.block_ids[c.start // block_size] * block_size
                            + c.start % block_size for c in chunks]
        tables = buf["tables"]
        for r, c in enumerate(chunks):
            n = len(c.block_ids)
            tables[r, :n] = c.block_ids
            tables[r, n:] = -1  # no block of an earlier step: the C checks refuse -1
        if self.recurrent:
            buf["state_slots"][:b] = [c.state_slot for c in chunks]
            buf["has_state"][:b] = [c.start > 0 for c in chunks]
        self.program.run(b)
        self.runs += 1
        return self._logit_rows[b]
