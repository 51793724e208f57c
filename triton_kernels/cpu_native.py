"""The CPU's native kernels (cpu_moe.c, cpu_linear.c, cpu_attention.c, cpu_norm.c,
cpu_route.c, cpu_gates.c, cpu_gated_delta.c, cpu_mla.c, the AMX ones, sharing cpu_dot.h): one
library built at first use, called through ctypes.

torch has no op that takes a list of experts: a decode step's routed experts are hundreds
of one-thread FBGEMM products with a few us of dispatch each (cpu_matmul.Fp16Bank).
cpu_moe.c runs a whole MoE layer's experts in one call on torch's OpenMP pool, each weight row
read once for the tokens routed to its expert. The others are a 16-bit CPU engine's decode
step without torch's per-op dispatch (a few us an op, ~40 ops a layer): a dense projection of
a few rows from the 16-bit weight as it is (cpu_linear.CpuLinear), an attention layer's step
after its q/k/v product (cpu_attention.CpuDecodeAttention), RMSNorm, the router's top-k, the
elementwise steps between products (SwiGLU, sigmoid gates, q/k norms across heads), a Gated
DeltaNet or MLA layer's decode step between its projections.
Each bound call also gives itself as an `Op` over fixed buffers, for a program that replays
a list of them in one call (cpu_program.py, cpu_program.c: a CPU engine's decode step).

Like Triton's launcher stubs, the kernel is compiled on the machine that runs it, by the C
compiler there (cc -O3 -march=native -fopenmp: this CPU's vector width, AVX2 or AVX-512),
into ~/.cache/freetoken/native (FREETOKEN_CACHE overrides the root), keyed by the sources,
the compiler, the CPU's flags and the OpenMP runtime it links to: torch's own, the file this
process loaded (_openmp_runtime), so the kernels' parallel regions run on torch's pool. Linked
by the soname libgomp.so.1 instead, next to a torch wheel whose libgomp has a hashed soname
(libgomp-<hash>.so.1) it would load the system's: two OpenMP runtimes in the process, each
one's team spinning after its regions on the cores the other needs (pytorch#98836). Where
there is no compiler or the build fails,
`native_kernels()` is None and the experts and projections keep their torch paths (a warning
says why, once).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from triton_kernels.cpu_matmul import FP16_MAX

log = logging.getLogger("freetoken.kernels")

_HERE = Path(__file__).parent
# compiled together into one library
_SOURCES = ("cpu_moe.c", "cpu_amx.c", "cpu_amx_attention.c", "cpu_flash_attention.c",
            "cpu_linear.c", "cpu_attention.c", "cpu_norm.c", "cpu_route.c", "cpu_program.c",
            "cpu_gated_delta.c", "cpu_gates.c", "cpu_mla.c")
_HEADERS = ("cpu_dot.h", "cpu_kernels.h", "cpu_amx.h", "cpu_heads.h", "cpu_prefill.h")
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-std=gnu11")  # in the key
_FORMATS = {torch.bfloat16: 0, torch.float16: 1}
E4M3 = getattr(torch, "float8_e4m3fn", None)
_WEIGHT_FORMATS = {**_FORMATS, E4M3: 3, torch.uint8: 4,   # cpu_dot.h's FT_E4M3, FT_INT4,
                   torch.int8: 6}                         # FT_INT8
INT4_BF16_SCALES = 5                                      # cpu_dot.h's FT_INT4S
E4M3_FORMAT = _WEIGHT_FORMATS[E4M3] if E4M3 is not None else None
_IO_FORMATS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
ACTIVATIONS = {"silu": 0, "swiglu_oai": 1}


class NativeKernels:
    """The loaded library: `moe` (ft_moe, cpu_moe.c), `linear` (ft_linear, cpu_linear.c),
    `attn_decode` (ft_attn_decode, cpu_attention.c), `rms_norm` (ft_rms_norm, cpu_norm.c) and
    `topk_softmax` (ft_topk_softmax, cpu_route.c)."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.path = path
        self._kept = threading.local()        # kept_buffer's, one set a thread
        p, i64, c_int, c_float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        fn = lib.ft_moe
        fn.argtypes = [p, c_int, p, p, i64, p, i64, i64, p, p, p, p, i64, i64, p, p, i64, i64,
                       i64, c_int, c_int, c_float, c_float, c_int, p, p, p, c_int]
        fn.restype = c_int
        self._moe = fn
        fn = lib.ft_moe_amx             # cpu_amx.c: a prefill chunk's experts on AMX tiles
        fn.argtypes = [p, p, p, i64, p, i64, i64, p, p, p, p, c_int, i64, i64, p, p, i64, i64,
                       i64, c_int, c_float, c_float, c_int, p, p]
        fn.restype = c_int
        self.moe_amx_fn = fn
        fn = lib.ft_moe_amx_scratch
        fn.argtypes = [i64] * 5
        fn.restype = i64
        self.moe_amx_scratch = fn
        fn = lib.ft_attn_amx            # cpu_amx_attention.c: a step's attention on AMX tiles
        fn.argtypes = [p, p, p, *[i64] * 7, p, i64, p, p, *[i64] * 7, c_float, i64, p, c_int, p,
                       i64, i64, p]
        fn.restype = c_int
        self.attn_amx_fn = fn
        fn = lib.ft_attn_amx_scratch
        fn.argtypes = [p, p, i64, i64, i64, i64, i64, i64, c_int, i64]
        fn.restype = i64
        self.attn_amx_scratch = fn
        fn = lib.ft_attn_flash          # cpu_flash_attention.c: the same in vector registers
        fn.argtypes = [p, p, p, c_int, *[i64] * 7, p, i64, p, p, *[i64] * 7, c_float, i64, p,
                       c_int, p, i64, i64, p]
        fn.restype = c_int
        self.attn_flash_fn = fn
        fn = lib.ft_attn_flash_scratch
        fn.argtypes = [p, p, i64, i64, i64, i64, i64, i64, c_int, i64]
        fn.restype = i64
        self.attn_flash_scratch = fn
        fn = lib.ft_int4_decode
        fn.argtypes = [p, p, c_int, p, i64, i64, i64, i64, p, c_int]
        fn.restype = None
        self._int4_decode = fn
        fn = lib.ft_linear
        fn.argtypes = [p, c_int, i64, p, c_int, p, i64, i64, p, i64, i64, p, c_int, c_int]
        fn.restype = c_int
        self._linear = fn
        fn = lib.ft_int4_activations
        fn.argtypes = []
        fn.restype = c_int
        # how int4 rows meet 16-bit activations: "float32" as they are, or "int16" (rounded
        # per group: AVX512-VNNI's byte products, AVX2's pairs; cpu_dot.h's i4v, i4w)
        self.int4_activations = ("float32", "bf16", "int16")[fn()]
        fn = lib.ft_e4m3_decode
        fn.argtypes = []
        fn.restype = c_int
        # how fp8 e4m3 rows widen: "float16" (a conversion), "tables" or "shifts" (AVX2's
        # two decodes to bf16 words, cpu_dot.h's FT_F8L), or "float16 products" (AVX512-FP16:
        # decode's rows meet x rounded to float16, cpu_dot.h's FT_F8H)
        self.e4m3_decode = ("float16", "tables", "shifts", "float16 products")[fn()]
        fn = lib.ft_attn_decode_tiles
        fn.argtypes = [c_int, c_int, i64, i64]
        fn.restype = c_int
        self._attn_decode_tiles = fn
        fn = lib.ft_attn_decode
        fn.argtypes = [p, c_int, i64, i64, i64, i64, p, p, c_float, p, i64, i64, c_int, c_int,
                       p, p, p, c_int, i64, i64, p, p, i64, p, i64, p, c_float, c_int, p, p]
        fn.restype = c_int
        self._attn_decode = fn
        fn = lib.ft_causal_conv1d      # cpu_gated_delta.c: Gated DeltaNet's sequence ops
        fn.argtypes = [p, c_int, i64, i64, i64, p, i64, p, i64, p, p, p, i64, c_int, c_int, p]
        fn.restype = c_int
        self.causal_conv1d_fn = fn
        fn = lib.ft_gated_delta
        fn.argtypes = [p, p, p, c_int, i64, i64, i64, i64, p, p, c_int, p, i64, p, p, p, i64,
                       i64, i64, i64, i64, c_float, c_int, c_int, p]
        fn.restype = c_int
        self.gated_delta_fn = fn
        fn = lib.ft_gdn_decode
        fn.argtypes = [p, c_int, i64, i64, p, p, i64, p, p, i64, p, p, p, p, p, c_float, i64,
                       i64, i64, i64, c_float, c_int, p]
        fn.restype = c_int
        self.gdn_decode_fn = fn
        fn = lib.ft_silu_mul            # cpu_gates.c: the elementwise steps between products
        fn.argtypes = [p, c_int, i64, i64, i64, p, c_int]
        fn.restype = None
        self._silu_mul = fn
        fn = lib.ft_sigmoid_gate
        fn.argtypes = [p, p, c_int, i64, i64, i64, i64, i64, c_int]
        fn.restype = None
        self._sigmoid_gate = fn
        fn = lib.ft_add_gated
        fn.argtypes = [p, p, p, i64, c_int, i64, i64, c_int]
        fn.restype = None
        self._add_gated = fn
        fn = lib.ft_qkv_whole
        fn.argtypes = [p, c_int, i64, i64, i64, i64, p, p, c_float, c_float, c_int]
        fn.restype = None
        self._qkv_whole = fn
        fn = lib.ft_mla_decode          # cpu_mla.c: a latent attention layer's decode step
        fn.argtypes = [p, p, c_int, i64, i64, i64, i64, i64, i64, p, c_float, p, i64, c_int, p,
                       p, c_int, i64, i64, p, p, i64, p, p, c_float, c_int, p, p]
        fn.restype = c_int
        self.mla_decode_fn = fn
        fn = lib.ft_rms_norm
        fn.argtypes = [p, p, p, c_float, i64, i64, c_int, p, p, c_int]
        fn.restype = None
        self._rms_norm = fn
        fn = lib.ft_topk_softmax
        fn.argtypes = [p, c_int, i64, i64, i64, c_int, p, p, c_int]
        fn.restype = None
        self._topk_softmax = fn
        fn = lib.ft_topk_biased
        fn.argtypes = [p, c_int, i64, i64, i64, c_int, p, i64, i64, c_int, c_float, p, p, c_int]
        fn.restype = None
        self._topk_biased = fn
        fn = lib.ft_run
        fn.argtypes = [p, i64, i64, c_int, p]
        fn.restype = c_int
        self.run = fn           # cpu_program.c: a list of the calls above in one call
        fn = lib.ft_run_timed   # the same, each call's wall time (ns) added to an array
        fn.argtypes = [p, i64, i64, c_int, p, p]
        fn.restype = c_int
        self.run_timed = fn

    def forms(self) -> str:
        """How this build's products meet quantized weights, which differs by CPU (a bench's
        figures name it): e4m3's decode, int4's activations, and whether the CPU has AMX."""
        return (f"e4m3 {self.e4m3_decode}, int4 against {self.int4_activations} x, AMX-BF16 "
                f"{'yes' if has_amx_bf16() else 'no'}")

    @staticmethod
    def handles(dtype: torch.dtype) -> bool:
        return dtype in _FORMATS

    def moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
            topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            slot_map: torch.Tensor | None = None, b13: torch.Tensor | None = None,
            b2: torch.Tensor | None = None, activation: str = "silu",
            alpha: float = 1.702, limit: float = 7.0,
            out_dtype: torch.dtype = torch.float32,
            scales: tuple[torch.Tensor, torch.Tensor] | None = None,
            block: tuple[int, int] = (128, 128)) -> torch.Tensor:
        """x [T, D] (any float dtype) through the routed experts of w13 [S, 2I, D] and
        w2 [S, D, I] (both bf16, both fp16, both fp8 e4m3 with their block scales, or both
        int4 nibbles [.., K/2] uint8 with their group scales; contiguous, on the CPU) ->
        [T, D] in out_dtype (bf16, fp16 or float32: summed in float32, rounded once), on
        torch's thread count. fp8: scales (s13 [S, ceil(2I/bn), ceil(D/bk)], s2 [S,
        ceil(D/bn), ceil(I/bk)]) float32, block (bn, bk) (or for (1, 0) row scales [S, 2I]
        and [S, D]: fp8_scales_shape). int4: scales (s13 [S, 2I, D/G, 2],
        s2 [S, D, I/G, 2]) float32, each group's (scale, -zero * scale) (NativeInt4Bank),
        block (1, G), G a power of two from 32 dividing D and I."""
        return self.bind_moe(w13, w2, scales, block, b13, b2)(
            x, topk_weights, topk_ids, slot_map, activation, alpha, limit, out_dtype)

    def bind_moe(self, w13: torch.Tensor, w2: torch.Tensor,
                 scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                 block: tuple[int, int] = (128, 128), b13: torch.Tensor | None = None,
                 b2: torch.Tensor | None = None) -> MoeCall:
        """moe's weights checked and held once (a layer's banks are the same every step):
        the returned call takes moe's per-call arguments."""
        if not (w13.dim() == w2.dim() == 3):
            raise ValueError(f"native MoE: w13 [S, 2I, D] and w2 [S, D, I] expected, got w13 "
                             f"{tuple(w13.shape)}, w2 {tuple(w2.shape)}")
        d = w2.shape[1]
        fp8, int4 = w13.dtype == E4M3, w13.dtype == torch.uint8
        slots, width = w2.shape[0], w2.shape[2] * (2 if int4 else 1)
        cols = 2 if int4 else 1                 # weights a stored element holds
        bn, bk = block
        s13 = s2 = None
        wfmt = _WEIGHT_FORMATS.get(w13.dtype)
        if fp8 or int4:
            s13, s2 = scales if scales is not None else (None, None)
            if fp8:
                if fp8_scales_shape(d, width, block) is None:
                    raise ValueError(f"native MoE: fp8 blocks (bn, bk) of positive sizes, or "
                                     f"(1, 0) for row scales, expected, got {block}")
                want13 = (slots, *fp8_scales_shape(2 * width, d, block))
                want2 = (slots, *fp8_scales_shape(d, width, block))
                ok = all(_scales_fit(t, want, torch.float32)
                         for t, want in ((s13, want13), (s2, want2)))
            else:
                want13 = (slots, 2 * width, d // max(bk, 1))
                want2 = (slots, d, width // max(bk, 1))
                if isinstance(s13, torch.Tensor) and isinstance(s2, torch.Tensor):
                    s13, s2 = int4_alike([s13, s2])     # (the call holds a made pair)
                wfmt, f2 = _int4_format(s13, want13), _int4_format(s2, want2)
                ok = (wfmt is not None and wfmt == f2 and bn == 1
                      and bk >= 32 and bk & (bk - 1) == 0 and d % bk == 0 and width % bk == 0)
            if not ok:
                kind = "float32 block" if fp8 else "group"
                forms = "" if fp8 else " (bf16, or float32 pairs [.., 2])"
                raise ValueError(f"native MoE: {'fp8' if fp8 else 'int4'} experts need {kind} "
                                 f"scales {list(want13)} and {list(want2)}{forms} for block "
                                 f"{block}, got "
                                 f"{None if s13 is None else tuple(s13.shape)} and "
                                 f"{None if s2 is None else tuple(s2.shape)}")
        if not (w13.dtype == w2.dtype and (self.handles(w13.dtype) or fp8 or int4)
                and w13.dim() == w2.dim() == 3 and w13.is_contiguous()
                and w2.is_contiguous() and w13.device.type == w2.device.type == "cpu"
                and tuple(w13.shape) == (slots, 2 * width, d // cols)):
            raise ValueError(f"native MoE: w13 [S, 2I, D] and w2 [S, D, I] in one 16-bit dtype "
                             f"(or fp8, or int4 pairs) on the CPU expected, got w13 "
                             f"{tuple(w13.shape)} {w13.dtype}, w2 {tuple(w2.shape)} {w2.dtype}")
        return MoeCall(self._moe, w13, w2, s13, s2, (bn, bk) if fp8 or int4 else (1, 1),
                       [None if b is None else b.float().contiguous() for b in (b13, b2)],
                       slots, d, width, wfmt)

    def decode_buffer(self, numel: int) -> torch.Tensor:
        """bf16 scratch of numel elements for decoded weights, this thread's, kept and
        reused: a prefill chunk's decoded experts (~100 MB a layer) in fresh memory cost
        their page faults and zeroing, 7x the decode (64 experts of [512, 1024] on 2 cores:
        18 ms against 2.9). It holds the largest decode asked of it for the thread's life
        (fused_moe caps it at INT4_DECODE_BYTES; the RAM a decode took for a moment
        before, not counted in the host RAM plans); each call's contents are gone at the
        next one."""
        return self.kept_buffer("decode", numel, torch.bfloat16)

    def kept_buffer(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """This thread's scratch `name` of numel elements, kept and grown, never shrunk:
        its contents are gone at the next call for the same name."""
        buf = getattr(self._kept, name, None)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            setattr(self._kept, name, None)         # the old one freed before the new one
            buf = torch.empty(numel, dtype=dtype)
            setattr(self._kept, name, buf)
        return buf[:numel]

    def int4_decode(self, q: torch.Tensor, gs: torch.Tensor, group: int,
                    experts: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Experts `experts` (int64 [n]) of an int4 bank (q [E, N, K/2] uint8, gs its
        int4_scales: [E, N, K/G] bf16, or [E, N, K/G, 2] float32 (scale, -zero * scale)
        pairs) decoded -> [n, N, K] bf16, the reference's values rounded once (nearest even),
        on torch's thread count; into out (n * N * K contiguous bf16) where given."""
        e, n, half = q.shape
        k = 2 * half
        idx = experts.contiguous().long()
        fmt = _int4_format(gs, (e, n, k // max(group, 1)))
        if not (q.dtype == torch.uint8 and q.is_contiguous() and fmt is not None
                and group >= 32 and group & (group - 1) == 0 and k % group == 0
                and idx.dim() == 1 and (not idx.numel() or (0 <= int(idx.min())
                                                          and int(idx.max()) < e))):
            raise ValueError(f"native int4 decode: q [E, N, K/2] uint8, scales [E, N, K/G] "
                             f"bf16 or pairs [E, N, K/G, 2] float32, and expert ids in range "
                             f"expected, got q {tuple(q.shape)} {q.dtype}, scales "
                             f"{tuple(gs.shape)} {gs.dtype}, group {group}")
        if out is None:
            out = torch.empty(idx.numel(), n, k, dtype=torch.bfloat16)
        elif not (out.dtype == torch.bfloat16 and out.is_contiguous()
                  and out.numel() == idx.numel() * n * k):
            raise ValueError(f"native int4 decode: out of {idx.numel() * n * k} contiguous bf16 "
                             f"elements expected, got {tuple(out.shape)} {out.dtype}")
        out = out.view(idx.numel(), n, k)
        self._int4_decode(q.data_ptr(), gs.data_ptr(), fmt, idx.data_ptr(), idx.numel(), n, k,
                          group, out.data_ptr(), torch.get_num_threads())
        return out

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None, scales: torch.Tensor | None = None,
               block: tuple[int, int] = (128, 128)) -> torch.Tensor:
        """x [T, K] (bf16, fp16 or float32) @ weight [N, K]^T + bias ([N] float32 or None)
        -> [T, N] in x's dtype, summed in float32 and rounded once, on torch's thread count.
        weight (contiguous): bf16 or fp16; fp8 e4m3 with its float32 block scales [ceil(N/bn),
        ceil(K/bk)] for block (bn, bk) (or for (1, 0) row scales [N]: fp8_scales_shape); int8
        with row scales [N] float32, block (1, 0); or int4 nibbles [N, K/2] uint8 (element 2j
        low) with scales [N, K/G, 2] float32, each group's (scale, -zero * scale), block (1, G),
        G a power of two from 32 dividing K."""
        return self.bind_linear(weight, bias, scales, block)(x)

    def bind_linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    scales: torch.Tensor | None = None,
                    block: tuple[int, int] = (128, 128)) -> LinearCall:
        """linear's weight checked and held once: the returned call takes x."""
        fp8, int4 = weight.dtype == E4M3, weight.dtype == torch.uint8
        int8 = weight.dtype == torch.int8
        n, k = weight.shape[0], weight.shape[-1] * (2 if int4 else 1)
        bn, bk = block
        wfmt = _WEIGHT_FORMATS.get(weight.dtype)
        if fp8 or int8:     # (int8: row scales only)
            want = fp8_scales_shape(n, k, block if fp8 else (1, 0))
            scaled = (want is not None and _scales_fit(scales, want, torch.float32)
                      and (fp8 or tuple(block) == (1, 0)))
        elif int4:
            wfmt = _int4_format(scales, (n, k // max(bk, 1)))
            scaled = wfmt is not None
        if not ((self.handles(weight.dtype) or fp8 or int4 or int8) and weight.is_contiguous()
                and weight.dim() == 2 and weight.device.type == "cpu"
                and (bias is None or (bias.dtype == torch.float32 and bias.shape == (n,)
                                      and bias.is_contiguous()))
                and (not (fp8 or int4 or int8) or scaled)
                and (not int4 or (bn == 1 and bk >= 32 and bk & (bk - 1) == 0 and k % bk == 0))):
            raise ValueError(f"native linear: a contiguous 16-bit weight [N, K] (or fp8 with "
                             f"float32 block scales [ceil(N/bn), ceil(K/bk)] or, block (1, 0), "
                             f"row scales [N], or int8 with row scales [N] for block "
                             f"(1, 0), or int4 with group "
                             f"scales [N, K/G] bf16 or [N, K/G, 2] float32) on the CPU (bias [N] "
                             f"float32) expected, got "
                             f"weight {tuple(weight.shape)} {weight.dtype}, scales "
                             f"{None if scales is None else tuple(scales.shape)}, block {block}")
        quant = fp8 or int4 or int8
        return LinearCall(self._linear, weight, wfmt, scales if quant else None,
                          block if quant else (1, 1), bias, n, k)

    def attn_decode_tiles(self, dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int,
                          block_size: int) -> bool:
        """Whether attn_decode's scores run on AMX tiles for this step (cpu_attention.c's
        ft_attn_decode_tiles: bf16 steps and caches, heads of a multiple of 32 up to 256,
        blocks of 16 tokens, on an AMX build and CPU)."""
        return bool(self._attn_decode_tiles(_IO_FORMATS.get(dtype, -1),
                                            _IO_FORMATS.get(cache_dtype, -1), head_dim,
                                            block_size))

    def attn_decode(self, qkv: torch.Tensor, heads: tuple[int, int, int], q_norm, k_norm,
                    eps: float, cos_sin: torch.Tensor, interleaved: bool,
                    positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                    window: int | None, sinks: torch.Tensor | None, scale: float) -> torch.Tensor:
        """One decode step of an attention layer (cpu_attention.c has the shapes): qkv
        [B, (Hq + 2Hk) Dh] -> [B, Hq Dh] in qkv's dtype; the new keys and values written into
        the caches. heads: (Hq, Hk, Dh); norms [Dh] / sinks [Hq] float32 or None."""
        return self.bind_attn(heads, q_norm, k_norm, eps, interleaved, window, sinks, scale)(
            qkv, cos_sin, positions, k_cache, v_cache, slots, tables, lens)

    def bind_attn(self, heads: tuple[int, int, int], q_norm, k_norm, eps: float,
                  interleaved: bool, window: int | None, sinks: torch.Tensor | None,
                  scale: float, gated: bool = False) -> AttnCall:
        """attn_decode's layer constants checked and held once: the returned call takes the
        batch's tensors and the caches. gated: each q head of qkv is followed by its output
        gate's Dh values (Qwen3-Next/3.5's q_proj), which the call skips (sigmoid_gate
        applies them)."""
        hq, hk, dh = heads
        f32 = torch.float32
        if not (hq >= hk > 0 and hq % hk == 0 and dh > 0 and all(
                t is None or (t.dtype == f32 and t.is_contiguous() and t.shape == (n,)
                              and t.device.type == "cpu")
                for t, n in ((q_norm, dh), (k_norm, dh), (sinks, hq)))):
            raise ValueError(f"native decode attention: heads (Hq, Hk, Dh) with Hk dividing Hq "
                             f"and float32 norms [Dh] / sinks [Hq] expected, got {heads}")
        return AttnCall(self._attn_decode, heads, q_norm, k_norm, eps, interleaved,
                        window or 0, sinks, scale, gated)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
        """rms_norm_reference's arithmetic for 16-bit rows x [T, D] (weight [D] and residual
        in x's dtype): weight * norm(x (+ residual)), and (with residual) the sum, the next
        residual."""
        return self.bind_rms_norm(weight, eps)(x, residual)

    def bind_rms_norm(self, weight: torch.Tensor, eps: float) -> RmsNormCall:
        """rms_norm's weight checked and held once: the returned call takes x (and residual)."""
        if not (weight.dtype in _FORMATS and weight.dim() == 1 and weight.device.type == "cpu"):
            raise ValueError(f"native rms_norm: a 16-bit weight [D] on the CPU expected, got "
                             f"{tuple(weight.shape)} {weight.dtype}")
        return RmsNormCall(self._rms_norm, weight.detach().contiguous(), eps)

    def topk_softmax(self, logits: torch.Tensor, top_k: int,
                     renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """topk_softmax_reference for CPU logits [T, E] (16-bit or float32): (weights [T, k]
        float32, ids [T, k] int64), largest first."""
        t, e = logits.shape
        if not (logits.dtype in _IO_FORMATS and 1 <= top_k <= e and logits.device.type == "cpu"):
            raise ValueError(f"native top-k softmax: logits [T, E] with 1 <= k <= E expected, "
                             f"got {tuple(logits.shape)} {logits.dtype}, k={top_k}")
        logits = logits.contiguous()
        weights = torch.empty(t, top_k)
        ids = torch.empty(t, top_k, dtype=torch.int64)
        self._topk_softmax(logits.data_ptr(), _IO_FORMATS[logits.dtype], t, e, top_k,
                           int(renormalize), weights.data_ptr(), ids.data_ptr(), 2)
        return weights, ids

    def topk_op(self, logits: torch.Tensor, top_k: int, renormalize: bool,
                weights: torch.Tensor, ids: torch.Tensor,
                round_to: torch.dtype | None = None) -> Op:
        """topk_softmax as a program's op (cpu_program.py) over its buffers: logits [R, E]
        -> weights [R, k] float32 (rounded to round_to, bf16 or fp16, where given), ids
        [R, k] int64."""
        r, e = logits.shape
        _rows("top-k logits", logits, r, e, tuple(_IO_FORMATS))
        _rows("top-k weights", weights, r, top_k, (torch.float32,))
        _rows("top-k ids", ids, r, top_k, (torch.int64,))
        if not 1 <= top_k <= e or round_to not in (None, *_FORMATS):
            raise ValueError(f"native top-k: 1 <= k <= {e} and a 16-bit rounding expected, "
                             f"got k={top_k}, {round_to}")
        return Op(OP_TOPK, r, (logits.data_ptr(), _IO_FORMATS[logits.dtype], e, top_k,
                            int(renormalize), weights.data_ptr(), ids.data_ptr(),
                            2 if round_to is None else _FORMATS[round_to]), (),
                  (logits, weights, ids))

    def topk_biased_op(self, logits: torch.Tensor, top_k: int, weights: torch.Tensor,
                       ids: torch.Tensor, *, bias: torch.Tensor | None, scoring: str,
                       n_group: int, topk_group: int, renormalize: bool, scale: float,
                       round_to: torch.dtype | None = None) -> Op:
        """biased_topk_reference's routing (cpu_route.c's ft_topk_biased) as a program's op:
        logits [R, E] -> weights [R, k] float32 (rounded to round_to where given), ids [R, k]
        int64; bias [E] float32 or None, scoring "sigmoid" or "softmax", n_group dividing E."""
        r, e = logits.shape
        _rows("top-k logits", logits, r, e, tuple(_IO_FORMATS))
        _rows("top-k weights", weights, r, top_k, (torch.float32,))
        _rows("top-k ids", ids, r, top_k, (torch.int64,))
        if not (1 <= top_k <= e and scoring in ("sigmoid", "softmax") and n_group >= 1
                and e % n_group == 0 and 1 <= topk_group <= n_group
                and round_to in (None, *_FORMATS)
                and (bias is None or (bias.dtype == torch.float32 and bias.shape == (e,)
                                      and bias.is_contiguous() and bias.device.type == "cpu"))):
            raise ValueError(f"native biased top-k: 1 <= k <= {e}, sigmoid or softmax scores, "
                             f"{n_group} groups dividing {e} keeping 1..{n_group}, a float32 "
                             f"bias [{e}] expected, got k={top_k}, {scoring}, keep {topk_group}, "
                             f"bias {None if bias is None else (tuple(bias.shape), bias.dtype)}")
        return Op(OP_TOPK_BIASED, r, (
            logits.data_ptr(), _IO_FORMATS[logits.dtype], e, top_k, int(scoring == "softmax"),
            0 if bias is None else bias.data_ptr(), n_group, topk_group, int(renormalize),
            weights.data_ptr(), ids.data_ptr(), 2 if round_to is None else _FORMATS[round_to]),
            (float(scale),), (logits, weights, ids, bias))

    def topk_biased(self, logits: torch.Tensor, top_k: int, **kw) -> tuple[torch.Tensor,
                                                                             torch.Tensor]:
        """topk_biased_op's routing now: (weights [T, k] float32, ids [T, k] int64)."""
        logits = logits.contiguous()
        t = logits.shape[0]
        weights = torch.empty(t, top_k)
        ids = torch.empty(t, top_k, dtype=torch.int64)
        op = self.topk_biased_op(logits, top_k, weights, ids, **kw)
        a = op.ints
        self._topk_biased(*a[:2], t, *a[2:9], op.floats[0], *a[9:])
        return weights, ids

    # ---- cpu_gates.c: the elementwise steps between products --------------------------------
    # Each takes its tensors (16-bit or float32, one dtype, contiguous rows) and, as an op,
    # a program's buffers of the same shapes.

    def qkv_whole_op(self, qkv: torch.Tensor, nq: int, nk: int, norms, eps: float,
                     clip: float | None) -> Op:
        """The whole-width steps before an attention layer's per-head ones, in place on a
        16-bit qkv [R, W]: q = [0, nq) and k = [nq, nq + nk) RMS-normed across their heads
        by norms = (wq [nq], wk [nk]) in qkv's dtype (None: not normed), then q, k and v
        clamped to +-clip (None: not)."""
        r, w = qkv.shape
        wq, wk = norms or (None, None)
        if not (qkv.dtype in _FORMATS and qkv.is_contiguous() and qkv.device.type == "cpu"
                and w >= nq + 2 * nk and (clip is None or clip > 0)
                and all(n is None or (n.dtype == qkv.dtype and n.shape == (d,)
                                      and n.is_contiguous()) for n, d in ((wq, nq), (wk, nk)))
                and (wq is None) == (wk is None)):
            raise ValueError(f"native whole-width steps: a 16-bit qkv [R, >= {nq + 2 * nk}] "
                             f"and norms [{nq}], [{nk}] in its dtype expected, got "
                             f"{tuple(qkv.shape)} {qkv.dtype}")
        return Op(OP_QKV_WHOLE, r, (qkv.data_ptr(), _FORMATS[qkv.dtype], w, nq, nk,
                                    0 if wq is None else wq.data_ptr(),
                                    0 if wk is None else wk.data_ptr()),
                  (eps, clip or 0.0), (qkv, wq, wk))

    def qkv_whole(self, qkv: torch.Tensor, nq: int, nk: int, norms, eps: float,
                  clip: float | None) -> torch.Tensor:
        op = self.qkv_whole_op(qkv, nq, nk, norms, eps, clip)   # qkv, fmt, w, nq, nk, wq, wk
        a = op.ints
        self._qkv_whole(*a[:2], op.rows, *a[2:], *op.floats, torch.get_num_threads())
        return qkv

    def _gate_args(self, what: str, *pairs) -> int:
        """The io format of (tensor, [rows, width]) pairs in one dtype, or ValueError."""
        dtypes = {t.dtype for t, _ in pairs}
        if not (len(dtypes) == 1 and pairs[0][0].dtype in _IO_FORMATS and all(
                t.dim() == 2 and tuple(t.shape) == tuple(shape) and t.is_contiguous()
                and t.device.type == "cpu" for t, shape in pairs)):
            raise ValueError(f"native {what}: " + ", ".join(
                f"{list(shape)}" for _, shape in pairs) + " contiguous on the CPU in one "
                "16-bit or float32 dtype expected, got " + ", ".join(
                f"{tuple(t.shape)} {t.dtype}" for t, _ in pairs))
        return _IO_FORMATS[pairs[0][0].dtype]

    def silu_mul_op(self, x: torch.Tensor, out: torch.Tensor) -> Op:
        """SwiGLU: x [T, 2N] (a gate/up product's output: g, then u) -> out [T, N] =
        round(round(silu(g)) u), HF's `act(gate) * up` on 16-bit tensors."""
        t, n = out.shape
        fmt = self._gate_args("silu_mul", (x, (t, 2 * n)), (out, (t, n)))
        return Op(OP_SILU_MUL, t, (x.data_ptr(), fmt, n, 2 * n, out.data_ptr()), (), (x, out))

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
        op = self.silu_mul_op(x.contiguous(), out)         # x, fmt, n, xs, out
        a = op.ints
        self._silu_mul(a[0], a[1], op.rows, *a[2:], torch.get_num_threads())
        return out

    def sigmoid_gate_op(self, o: torch.Tensor, qkv: torch.Tensor, heads: int,
                        dh: int) -> Op:
        """The attention output's gate, in place: o [T, H Dh] *= sigmoid(gate), head h's gate
        at qkv[:, h 2Dh + Dh:][:Dh] (q_proj's [q | gate] per head, first in qkv's rows)."""
        t, w = qkv.shape
        fmt = self._gate_args("sigmoid_gate", (o, (t, heads * dh)), (qkv, (t, w)))
        if w < heads * 2 * dh:
            raise ValueError(f"native sigmoid_gate: qkv rows of {w} cannot hold {heads} "
                             f"heads of q and gate of {dh}")
        gate = qkv.data_ptr() + dh * qkv.element_size()
        return Op(OP_SIGMOID_GATE, t, (o.data_ptr(), gate, fmt, heads, dh, w, 2 * dh), (),
                  (o, qkv))

    def sigmoid_gate(self, o: torch.Tensor, qkv: torch.Tensor, heads: int,
                     dh: int) -> torch.Tensor:
        op = self.sigmoid_gate_op(o, qkv.contiguous(), heads, dh)   # o, g, fmt, heads, ...
        a = op.ints
        self._sigmoid_gate(*a[:3], op.rows, *a[3:], torch.get_num_threads())
        return o

    def add_gated_op(self, h: torch.Tensor, y: torch.Tensor,
                     gate: torch.Tensor | None = None) -> Op:
        """h [T, D] += y [T, D], or += sigmoid(gate) y with gate [T, 1] (a shared expert's
        gate logit), in place, each step rounded as HF's ops on 16-bit tensors."""
        t, d = h.shape
        pairs = [(h, (t, d)), (y, (t, d))] + ([] if gate is None else [(gate, (t, 1))])
        fmt = self._gate_args("add_gated", *pairs)
        return Op(OP_ADD_GATED, t, (h.data_ptr(), y.data_ptr(),
                                    0 if gate is None else gate.data_ptr(), 1, fmt, d), (),
                  (h, y, gate))

    def add_gated(self, h: torch.Tensor, y: torch.Tensor,
                  gate: torch.Tensor | None = None) -> torch.Tensor:
        op = self.add_gated_op(h, y.contiguous(), None if gate is None else gate.contiguous())
        a = op.ints                                         # h, y, gl, gls, fmt, d
        self._add_gated(*a[:5], op.rows, a[5], torch.get_num_threads())
        return h

    def embed_op(self, table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> Op:
        """out [T, D] = table [V, D]'s rows ids [T] (int64), a program's first op: its
        run's token ids written into `ids` as data. An id outside [0, V) fails the run
        before it writes a row."""
        v, d = table.shape
        t = ids.shape[0]
        if not (table.dtype in (torch.bfloat16, torch.float16) and table.is_contiguous()
                and ids.dtype == torch.int64 and ids.is_contiguous() and ids.dim() == 1
                and out.dtype == table.dtype and out.is_contiguous()
                and tuple(out.shape) == (t, d)):
            raise ValueError(f"native embed: a contiguous 16-bit table [V, D], int64 ids [T] "
                             f"and out [T, D] in its dtype expected, got {tuple(table.shape)} "
                             f"{table.dtype}, {tuple(ids.shape)} {ids.dtype}, "
                             f"{tuple(out.shape)} {out.dtype}")
        return Op(OP_EMBED, t, (table.data_ptr(), v, d * table.element_size(), ids.data_ptr(),
                                out.data_ptr()), (), (table, ids, out))

    def widen_op(self, x: torch.Tensor, out: torch.Tensor) -> Op:
        """out [T, N] float32 = x [T, N] (16-bit) widened: x.float()'s values."""
        t, n = x.shape
        fmt = self._gate_args("widen", (x, (t, n)))
        if fmt == _IO_FORMATS[torch.float32] or not (
                out.dtype == torch.float32 and out.is_contiguous() and out.shape == x.shape):
            raise ValueError(f"native widen: 16-bit x and float32 out of its shape expected, "
                             f"got {tuple(x.shape)} {x.dtype}, {tuple(out.shape)} {out.dtype}")
        return Op(OP_WIDEN, t, (x.data_ptr(), fmt, n, out.data_ptr()), (), (x, out))


# cpu_program.c's op kinds
(OP_RMS_NORM, OP_LINEAR, OP_ATTN, OP_TOPK, OP_MOE, OP_GDN, OP_SILU_MUL, OP_SIGMOID_GATE,
 OP_ADD_GATED, OP_TOPK_BIASED, OP_QKV_WHOLE, OP_MLA, OP_EMBED, OP_WIDEN) = range(14)


@dataclasses.dataclass(frozen=True, eq=False)
class Op:
    """One kernel call of a program (cpu_program.c): its arguments in the kernel's order,
    less the row count and the threads the run gives; pointers as integers, into `keep`'s
    tensors (held as long as the op is) and the bound call's; rows: what its buffers hold
    (a run takes at most that many)."""
    kind: int
    rows: int
    ints: tuple[int, ...]
    floats: tuple[float, ...]
    keep: tuple = ()


def _rows(what: str, t: torch.Tensor, rows: int, width: int | None, dtypes) -> None:
    """A program's buffer: [rows, width] (a row of `width` for each of its rows; [rows]
    where width is None), one of dtypes, contiguous, on the CPU."""
    shape = (rows,) if width is None else (rows, width)
    if not (tuple(t.shape) == shape and t.dtype in dtypes and t.is_contiguous()
            and t.device.type == "cpu"):
        raise ValueError(f"native program: {what} must be {list(shape)} contiguous on the CPU "
                         f"in {', '.join(map(str, dtypes))}, got {tuple(t.shape)} {t.dtype}")


def _check_rc(rc: int, what: str, scratch: str) -> None:
    """A kernel's return code: -3 int4 groups it cannot take (the bind checks them first),
    any other nonzero a failed allocation."""
    if rc == -3:
        raise ValueError(f"{what}: int4 groups must be a power of two from 32")
    if rc != 0:
        raise MemoryError(f"{what}: out of host memory for {scratch}")


ATTN_RANGE = ("native decode attention: a block id, slot, position or length is outside "
              "the cache, its table or the rope table")


class LinearCall:
    """NativeKernels.bind_linear's: x [T, K] -> [T, N] in x's dtype (only x checked)."""

    def __init__(self, fn, weight, wfmt, scales, block, bias, n, k):
        self.fn, self.weight, self.scales, self.bias = fn, weight, scales, bias   # (held)
        self.n, self.k = n, k
        self.args = (weight.data_ptr(), wfmt, 0 if scales is None else scales.data_ptr(),
                     *block, 0 if bias is None else bias.data_ptr(), n, k)

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [T, K] -> [T, N] in out_dtype: x's, or float32 (the sums unrounded)."""
        if not (x.dim() == 2 and x.shape[1] == self.k and x.dtype in _IO_FORMATS
                and x.device.type == "cpu" and out_dtype in (None, x.dtype, torch.float32)):
            raise ValueError(f"native linear: x [T, {self.k}] (bf16, fp16 or float32) on the "
                             f"CPU for its 16-bit weight [{self.n}, {self.k}] expected, got "
                             f"{tuple(x.shape)} {x.dtype} (out {out_dtype})")
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.n, dtype=out_dtype or x.dtype)
        _check_rc(self.fn(x.data_ptr(), _IO_FORMATS[x.dtype], x.shape[0], *self.args,
                          out.data_ptr(), _IO_FORMATS[out.dtype], torch.get_num_threads()),
                  "native linear", "x's float32 copy")
        return out

    def op(self, x: torch.Tensor, out: torch.Tensor) -> Op:
        """This call as a program's op: x [R, K] -> out [R, N], in x's dtype or float32."""
        _rows("linear x", x, x.shape[0], self.k, tuple(_IO_FORMATS))
        _rows("linear out", out, x.shape[0], self.n, (x.dtype, torch.float32))
        return Op(OP_LINEAR, x.shape[0], (x.data_ptr(), _IO_FORMATS[x.dtype], *self.args,
                                          out.data_ptr(), _IO_FORMATS[out.dtype]),
                  (), (self, x, out))


class MoeCall:
    """NativeKernels.bind_moe's: (x [T, D], topk_weights, topk_ids, slot_map, activation,
    alpha, limit, out_dtype) -> [T, D] in out_dtype (only the call's own tensors checked)."""

    def __init__(self, fn, w13, w2, s13, s2, block, biases, slots, d, width, wfmt):
        self.fn, self.held = fn, (w13, w2, s13, s2, *biases)
        self.slots, self.d, self.width = slots, d, width
        self.weights = (w13.data_ptr(), w2.data_ptr(),
                        0 if s13 is None else s13.data_ptr(), 0 if s2 is None else s2.data_ptr(),
                        *block, *(0 if b is None else b.data_ptr() for b in biases),
                        slots, d, width, wfmt)

    def __call__(self, x, topk_weights, topk_ids, slot_map=None, activation: str = "silu",
                 alpha: float = 1.702, limit: float = 7.0,
                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t, d = x.shape
        if not (d == self.d and topk_ids.shape == topk_weights.shape and topk_ids.dim() == 2
                and topk_ids.shape[0] == t and out_dtype in _IO_FORMATS):
            raise ValueError(f"native MoE: x [T, D] for w13 [S, 2I, D] and w2 [S, D, I] with D "
                             f"{self.d}, and ids/weights [T, k] expected, got x "
                             f"{tuple(x.shape)}, ids {tuple(topk_ids.shape)}, weights "
                             f"{tuple(topk_weights.shape)}")
        out = torch.empty(t, d, dtype=out_dtype)
        if not topk_ids.numel():
            return out.zero_()
        xf = (x if x.dtype in _IO_FORMATS else x.float()).contiguous()
        ids = topk_ids.contiguous().long()
        weights = topk_weights.float().contiguous()
        smap = None if slot_map is None else slot_map.contiguous().long()
        scratch = torch.empty(ids.numel() * self.width + t * d)   # act [P, I], then acc [T, D]
        rc = self.fn(xf.data_ptr(), _IO_FORMATS[xf.dtype], ids.data_ptr(),
                     0 if smap is None else smap.data_ptr(), 0 if smap is None else smap.numel(),
                     weights.data_ptr(), t, ids.shape[1], *self.weights, ACTIVATIONS[activation],
                     alpha, limit, torch.get_num_threads(), scratch.data_ptr(),
                     scratch.data_ptr() + ids.numel() * self.width * 4, out.data_ptr(),
                     _IO_FORMATS[out_dtype])
        if rc == -2:
            raise ValueError(f"native MoE: an expert id is outside the slot map or maps outside "
                             f"the bank's {self.slots} slots")
        _check_rc(rc, "native MoE", "its routing tables or scratch")
        return out

    def op(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
           scratch: torch.Tensor, out: torch.Tensor, activation: str = "silu",
           alpha: float = 1.702, limit: float = 7.0) -> Op:
        """This call as a program's op (every expert id in the bank, no slot map): x [R, D],
        weights [R, k] float32 and ids [R, k] int64 -> out [R, D] in x's dtype; scratch
        float32, at least R k I + R D."""
        r, k = topk_ids.shape
        _rows("MoE x", x, r, self.d, tuple(_IO_FORMATS))
        _rows("MoE weights", topk_weights, r, k, (torch.float32,))
        _rows("MoE ids", topk_ids, r, k, (torch.int64,))
        _rows("MoE out", out, r, self.d, (x.dtype,))
        if not (scratch.dtype == torch.float32 and scratch.is_contiguous()
                and scratch.numel() >= r * (k * self.width + self.d)):
            raise ValueError(f"native program: MoE scratch of {r * (k * self.width + self.d)} "
                             f"float32 expected, got {scratch.numel()} {scratch.dtype}")
        fmt = _IO_FORMATS[x.dtype]
        return Op(OP_MOE, r, (x.data_ptr(), fmt, topk_ids.data_ptr(), 0, 0,
                           topk_weights.data_ptr(), k, *self.weights, ACTIVATIONS[activation],
                           scratch.data_ptr(), out.data_ptr(), fmt), (alpha, limit),
                  (self, x, topk_weights, topk_ids, scratch, out))


class AttnCall:
    """NativeKernels.bind_attn's: (qkv, cos_sin, positions, k_cache, v_cache, slots, tables,
    lens) -> [B, Hq Dh]. The caches are checked once each pair (the engine's are the same
    every step), the batch's tensors every call; every index is checked in C."""

    def __init__(self, fn, heads, q_norm, k_norm, eps, interleaved, window, sinks, scale, gated):
        self.fn, self.heads, self.held = fn, heads, (q_norm, k_norm, sinks)
        self.eps, self.interleaved, self.window, self.scale = eps, int(interleaved), window, scale
        hq, hk, dh = heads
        self.gated = int(gated)
        self.width = (hq * (2 if gated else 1) + 2 * hk) * dh      # qkv's row
        self.ptrs = [0 if t is None else t.data_ptr() for t in (q_norm, k_norm, sinks)]
        self.caches = None                  # the last pair that passed its checks

    def takes(self, k_cache, v_cache) -> bool:
        """Whether this call reads and writes these caches: [NB, BS, Hk, Dh] each, one dtype,
        16-bit or float32, contiguous, on the CPU (an fp8 cache keeps the torch path). The
        engine's are the same tensors every step: the last pair accepted is kept."""
        if self.caches is not None and self.caches[0] is k_cache and self.caches[1] is v_cache:
            return True
        _, hk, dh = self.heads
        ok = (k_cache.dtype in _IO_FORMATS and k_cache.dim() == 4
              and k_cache.shape == v_cache.shape and tuple(k_cache.shape[2:]) == (hk, dh)
              and k_cache.is_contiguous() and v_cache.is_contiguous()
              and v_cache.dtype == k_cache.dtype
              and k_cache.device.type == v_cache.device.type == "cpu")
        if ok:
            self.caches = (k_cache, v_cache)
        return ok

    def _check_caches(self, k_cache, v_cache) -> None:
        if not self.takes(k_cache, v_cache):
            _, hk, dh = self.heads
            raise ValueError(f"native decode attention: caches [NB, BS, {hk}, {dh}] expected, "
                             f"got {tuple(k_cache.shape)} {k_cache.dtype}")

    def __call__(self, qkv, cos_sin, positions, k_cache, v_cache, slots, tables,
                 lens) -> torch.Tensor:
        hq, hk, dh = self.heads
        b = qkv.shape[0]
        self._check_caches(k_cache, v_cache)
        i64, i32 = torch.int64, torch.int32
        if not (qkv.dim() == 2 and qkv.shape[1] == self.width and qkv.is_contiguous()
                and qkv.dtype in _IO_FORMATS and qkv.device.type == "cpu"
                and cos_sin.dtype == torch.float32 and cos_sin.is_contiguous()
                and cos_sin.dim() == 2 and cos_sin.shape[1] <= dh and cos_sin.shape[1] % 2 == 0
                and positions.shape == slots.shape == lens.shape == (b,)
                and positions.dtype == slots.dtype == i64 and lens.dtype == tables.dtype == i32
                and tables.dim() == 2 and tables.shape[0] == b and tables.is_contiguous()
                and positions.device.type == slots.device.type == lens.device.type
                == tables.device.type == cos_sin.device.type == "cpu"):
            raise ValueError(f"native decode attention: qkv [B, {self.width}] and caches "
                             f"[NB, BS, Hk, Dh] expected for heads {self.heads}, got qkv "
                             f"{tuple(qkv.shape)} {qkv.dtype}, caches {tuple(k_cache.shape)} "
                             f"{k_cache.dtype}")
        nb, bs = k_cache.shape[:2]
        out = torch.empty(b, hq * dh, dtype=qkv.dtype)
        scratch = torch.empty(b * hq * dh)
        positions, slots, lens = positions.contiguous(), slots.contiguous(), lens.contiguous()
        rc = self.fn(
            qkv.data_ptr(), _IO_FORMATS[qkv.dtype], b, hq, hk, dh, self.ptrs[0], self.ptrs[1],
            self.eps, cos_sin.data_ptr(), cos_sin.shape[0], cos_sin.shape[1], self.interleaved,
            self.gated, positions.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            _IO_FORMATS[k_cache.dtype], nb, bs, slots.data_ptr(), tables.data_ptr(),
            tables.shape[1], lens.data_ptr(), self.window, self.ptrs[2], self.scale,
            torch.get_num_threads(), scratch.data_ptr(), out.data_ptr())
        if rc == -2:
            raise ValueError(ATTN_RANGE)
        if rc != 0:
            raise MemoryError("native decode attention: out of host memory for its scratch")
        return out

    def op(self, qkv: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor,
           k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
           tables: torch.Tensor, lens: torch.Tensor, scratch: torch.Tensor,
           out: torch.Tensor) -> Op:
        """This call as a program's op over R sequences: qkv [R, width] -> out
        [R, Hq Dh] in its dtype; positions, slots [R] int64, lens [R] int32, tables [R, M]
        int32 (the run's indices: each checked in C), scratch [R, Hq Dh] float32."""
        hq, hk, dh = self.heads
        r = qkv.shape[0]
        self._check_caches(k_cache, v_cache)
        _rows("attention qkv", qkv, r, self.width, tuple(_IO_FORMATS))
        _rows("attention out", out, r, hq * dh, (qkv.dtype,))
        _rows("attention scratch", scratch, r, hq * dh, (torch.float32,))
        _rows("positions", positions, r, None, (torch.int64,))
        _rows("slots", slots, r, None, (torch.int64,))
        _rows("lens", lens, r, None, (torch.int32,))
        _rows("block tables", tables, r, tables.shape[1], (torch.int32,))
        if not (cos_sin.dtype == torch.float32 and cos_sin.is_contiguous() and cos_sin.dim() == 2
                and cos_sin.shape[1] <= dh and cos_sin.shape[1] % 2 == 0):
            raise ValueError(f"native program: a float32 rope table [P, <= {dh}] expected, "
                             f"got {tuple(cos_sin.shape)} {cos_sin.dtype}")
        nb, bs = k_cache.shape[:2]
        return Op(OP_ATTN, r, (
            qkv.data_ptr(), _IO_FORMATS[qkv.dtype], hq, hk, dh, self.ptrs[0], self.ptrs[1],
            cos_sin.data_ptr(), cos_sin.shape[0], cos_sin.shape[1], self.interleaved,
            self.gated, positions.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            _IO_FORMATS[k_cache.dtype], nb, bs, slots.data_ptr(), tables.data_ptr(),
            tables.shape[1], lens.data_ptr(), self.window, self.ptrs[2], scratch.data_ptr(),
            out.data_ptr()), (self.eps, self.scale),
            (self, qkv, cos_sin, positions, k_cache, v_cache, slots, tables, lens, scratch, out))


class RmsNormCall:
    """NativeKernels.bind_rms_norm's: (x [T, D], residual) -> out, or (out, the sum)."""

    def __init__(self, fn, weight, eps):
        self.fn, self.weight, self.eps = fn, weight, eps
        self.fmt, self.d = _FORMATS[weight.dtype], weight.shape[0]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if not (x.dim() == 2 and x.shape[1] == self.d and x.dtype == self.weight.dtype
                and x.device.type == "cpu"
                and (residual is None or (residual.shape == x.shape
                                          and residual.dtype == x.dtype))):
            raise ValueError(f"native rms_norm: 16-bit x [T, D] with weight [D] (and residual) "
                             f"in its dtype expected, got x {tuple(x.shape)} {x.dtype}, "
                             f"weight {tuple(self.weight.shape)} {self.weight.dtype}")
        x = x.contiguous()
        out = torch.empty_like(x)
        res_out = None if residual is None else torch.empty_like(x)
        residual = None if residual is None else residual.contiguous()
        self.fn(x.data_ptr(), 0 if residual is None else residual.data_ptr(),
                self.weight.data_ptr(), self.eps, x.shape[0], self.d, self.fmt, out.data_ptr(),
                0 if res_out is None else res_out.data_ptr(), torch.get_num_threads())
        return out if residual is None else (out, res_out)

    def op(self, x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor,
           res_out: torch.Tensor | None = None) -> Op:
        """This call as a program's op: x [R, D] (+ residual) -> out, and the sum into
        res_out (which may be residual itself: each element is read before it is written);
        all in the weight's dtype."""
        r = x.shape[0]
        for what, t in (("x", x), ("residual", residual), ("out", out), ("sum", res_out)):
            if t is not None:
                _rows(f"rms_norm {what}", t, r, self.d, (self.weight.dtype,))
        if (residual is None) != (res_out is None) or out.data_ptr() == x.data_ptr():
            raise ValueError("native program: rms_norm takes a residual with its sum's "
                             "buffer, and writes out apart from x")
        return Op(OP_RMS_NORM, r, (x.data_ptr(), 0 if residual is None else residual.data_ptr(),
                                self.weight.data_ptr(), self.d, self.fmt, out.data_ptr(),
                                0 if res_out is None else res_out.data_ptr()), (self.eps,),
                  (self, x, residual, out, res_out))


class NativeBank:
    """A bank of 16-bit experts [E, N, K] that the native kernel computes (only the CPU
    computes them): the weights as they are, in bf16 or fp16, nothing repacked (a
    checkpoint's bank is used in place). gemm: a bf16 bank on a CPU with AMX-BF16 (amx;
    default: this one's), where fused_moe hands a call of GEMM_ROWS rows an expert and more
    (a prefill chunk) to torch's bf16 products, an expert at a time: at 64 rows oneDNN's AMX
    kernels run 10x the native kernel's FLOP rate. One MoE layer (64 experts, top-8, D 1024, I 256;
    2-core EPYC, weights cold), native against the fp16-weight GEMM (cpu_matmul.Fp16Bank,
    with its prefill split), ms: 1 token 0.46-0.51 / 0.85-1.0, 8 tokens 2.8 / 4.4-4.6,
    64 tokens 11-13 / 15-26, 512 tokens 66-78 / 87-106 (bench/cpu_moe.py)."""

    float32 = True          # fused_moe hands it the float32 products' path (no rounding between)

    def __init__(self, weight: torch.Tensor, kernel: NativeKernels, amx: bool | None = None):
        if not (kernel.handles(weight.dtype) and weight.dim() == 3
                and weight.device.type == "cpu"):
            raise ValueError(f"NativeBank: a [E, N, K] bf16 or fp16 CPU bank expected, got "
                             f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")
        self.weight = weight.detach().contiguous()     # a parameter's tensor, not the parameter
        self.kernel = kernel
        self.experts, self.n, self.k = weight.shape
        self.dtype = weight.dtype
        self.nbytes = weight.numel() * 2
        self.gemm = (has_amx_bf16() if amx is None else amx) and self.dtype == torch.bfloat16

    @classmethod
    def decoded(cls, shape: tuple[int, int, int], decode, kernel: NativeKernels,
                amx: bool | None = None) -> NativeBank:
        """A bank [E, N, K] from each expert's weight decoded from a quantized format (decode(e)
        -> [N, K] float32, one expert at a time). On a CPU with AMX-BF16 (amx; default: this
        one's) bfloat16, the tile decode's rounding, so that prefill chunks take the AMX
        products (a 512-token FP8 chunk ran at 0.55x the bf16 model's in float16); elsewhere
        float16 (11 bits of a decoded value from 2^-14 up), or bfloat16 where an expert is
        beyond float16's range."""
        experts, n, k = shape
        if has_amx_bf16() if amx is None else amx:
            weight = torch.empty(experts, n, k, dtype=torch.bfloat16)
            for e in range(experts):
                weight[e].copy_(decode(e))
            return cls(weight, kernel, amx=True)
        weight = torch.empty(experts, n, k, dtype=torch.float16)
        for e in range(experts):
            w = decode(e)
            low, high = torch.aminmax(w)
            if not bool((low >= -FP16_MAX) & (high <= FP16_MAX)):
                weight = torch.empty(experts, n, k, dtype=torch.bfloat16)
                for j in range(experts):
                    weight[j].copy_(decode(j) if j != e else w)
                break
            weight[e].copy_(w)
        return cls(weight, kernel, amx=False)


class NativeFp8Bank:
    """A bank of fp8 experts [E, N, K] (e4m3, block scales [E, ceil(N/bn), ceil(K/bk)] float32,
    or for block (1, 0) channel scales [E, N]) that the native kernel computes from the
    checkpoint's bytes as they are: 1 byte a weight read. Each weight is widened in registers
    (cpu_dot.h's load_e4m3; on AVX2 load_e4m3_f8l's shifts on AMD, byte tables elsewhere; on
    AVX512-FP16 met by x rounded to float16 in float16 products, FT_F8H: e4m3_decode) and x is
    scaled per block (or a row's sums by its scale; on AVX2 rows that
    more than 4 tokens meet decoded once a call to bf16 words: a 512-token chunk of the bench
    layer 1.2x -> 1.0x bf16's time), so a batch-1 layer costs ~0.65x a bf16 bank's (2-core
    Xeon, 64 experts, D 1024, I 256, cold: 0.39 ms against 0.59; 2-core EPYC with the tables
    0.62-0.69x in three runs, 2 tokens 0.59-0.62x, 8 tokens 0.70-0.75x; with the shifts 0.29-0.31
    ms against 0.32-0.35 with the tables, 2 tokens 0.51-0.53 against 0.59-0.61) and 3-9x less
    than the tile decode. prefill: the same experts decoded to bf16 (NativeBank.decoded, gemm),
    which fused_moe hands prefill chunks to, on the AMX kernel (cpu_amx.py): 2 bytes a weight
    beside the checkpoint's, counted in nbytes; None: prefill chunks run the AMX kernel from the
    bytes (32 rows at a time decoded as the copy holds them, the same bits: a 512-token chunk of
    the bench layer in the copy's time, Qwen3-30B's 1.2-1.3x), where AMX runs and the scales are
    blocks, else the native kernel (row scales: its decode takes blocks only)."""

    float32 = True          # fused_moe hands it the float32 products' path (no rounding between)
    dtype = E4M3

    def __init__(self, q: torch.Tensor, s: torch.Tensor, block: tuple[int, int],
                 kernel: NativeKernels, prefill: NativeBank | None = None):
        experts, n, k = q.shape
        bn, bk = block
        if not (E4M3 is not None and q.dtype == E4M3 and q.device.type == "cpu"
                and s.dtype == torch.float32 and fp8_scales_shape(n, k, block) is not None
                and tuple(s.shape) == (experts, *fp8_scales_shape(n, k, block))):
            raise ValueError(f"NativeFp8Bank: e4m3 [E, N, K] and float32 scales [E, ceil(N/bn), "
                             f"ceil(K/bk)] (block (1, 0): a row's own, [E, N]) on the CPU "
                             f"expected, got {tuple(q.shape)} {q.dtype} "
                             f"and {tuple(s.shape)} {s.dtype} for block {block}")
        if prefill is not None and not (prefill.gemm and (prefill.experts, prefill.n,
                                                          prefill.k) == (experts, n, k)):
            raise ValueError(f"NativeFp8Bank: the prefill copy must be an AMX bf16 bank of the "
                             f"same shape {(experts, n, k)}, got {_describe(prefill)}")
        self.q, self.s = q.detach().contiguous(), s.detach().contiguous()
        self.block, self.kernel, self.prefill = (bn, bk), kernel, prefill
        self.experts, self.n, self.k = experts, n, k
        self.checkpoint_bytes = self.q.numel() + self.s.numel() * 4
        self.nbytes = self.checkpoint_bytes + (prefill.nbytes if prefill is not None else 0)


def fp8_scales_shape(n: int, k: int, block: tuple[int, int]) -> tuple[int, ...] | None:
    """The float32 scales the native kernels take for an fp8 weight [N, K] in blocks (bn, bk):
    [ceil(N/bn), ceil(K/bk)], each block's; for (1, 0), a checkpoint's channel scales, [N]:
    each row's own, applied to the row's sums (x is not rescaled at every row). None: no
    such block."""
    bn, bk = block
    if (bn, bk) == (1, 0):
        return (n,)
    return (-(-n // bn), -(-k // bk)) if bn > 0 and bk > 0 else None


def _scales_fit(t, shape, dtype) -> bool:
    return (isinstance(t, torch.Tensor) and t.dtype == dtype and t.is_contiguous()
            and tuple(t.shape) == tuple(shape))


def _int4_format(scales, groups_shape) -> int | None:
    """The kernels' int4 format code for group scales of `groups_shape` ([.., N, K/G]):
    FT_INT4 for float32 pairs [.., 2], FT_INT4S for bf16 scales (zero point 8); None if
    they are neither."""
    if _scales_fit(scales, (*groups_shape, 2), torch.float32):
        return _WEIGHT_FORMATS[torch.uint8]
    if _scales_fit(scales, groups_shape, torch.bfloat16):
        return INT4_BF16_SCALES
    return None


def int4_scales(s: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
    """int4 scales [.., G groups] and zero points (None: symmetric, 8) -> the group scales
    the native kernels read: a symmetric weight's bf16 scales as they are (2 bytes a group,
    no copy where they are contiguous: W = (q - 8) s), else int4_group_pairs'."""
    if z is None and s.dtype == torch.bfloat16:
        return s.detach().contiguous()
    return int4_group_pairs(s, z)


def int4_alike(scales: list[torch.Tensor]) -> list[torch.Tensor]:
    """int4_scales of weights meant to be read as one (a fused projection's, a layer's two
    banks) in one form: as they are where they share it, else pairs for all ((s, -8 s) for
    the symmetric ones' bf16 scales), as a weight with zero points beside them needs."""
    if len({(s.dtype, s.dim()) for s in scales}) <= 1:
        return list(scales)
    return [int4_group_pairs(s, None) if s.dtype == torch.bfloat16 else s for s in scales]


def int4_group_pairs(s: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
    """int4 scales [.., G groups] and zero points (None: symmetric, 8) -> the native kernels'
    float32 pairs [.., G, 2]: (s, -z * s), so a weight decodes as q * s + (-z * s), which is
    (q - z) * s exactly for 16-bit scales (z s needs 12 bits)."""
    scale = s.detach().float()
    zero = torch.full_like(scale, 8.0) if z is None else z.detach().float()
    return torch.stack([scale, -zero * scale], dim=-1).contiguous()


class NativeInt4Bank:
    """A bank of int4 experts [E, N, K] (the checkpoint's nibbles q [E, N, K/2] uint8 as they
    are, element 2j low; scales s [E, N, K/G] and zero points z uint8, or 8 where symmetric)
    that the native kernel computes: each group of G weights decoded in registers as
    q * s + m (m = -z * s: W = (q - z) * s, the reference's values; exactly, for 16-bit
    scales), half a byte a weight read. gs (int4_scales): a symmetric bank's bf16 scales as
    they are, [E, N, K/G] (2 bytes a group, read in place), else [E, N, K/G, 2] float32 pairs
    (s, m), 8 bytes a group (G 32: half the nibbles' bytes), the only bytes it adds. gemm: on a
    CPU with AMX-BF16 (amx; default: this one's), fused_moe decodes a prefill chunk's used
    experts to bf16 (int4_decode: the reference's values) for AMX's products."""

    float32 = True          # fused_moe hands it the float32 products' path (no rounding between)
    dtype = torch.uint8

    def __init__(self, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, group: int,
                 kernel: NativeKernels, amx: bool | None = None):
        experts, n, half = q.shape
        k = 2 * half
        if not (q.dtype == torch.uint8 and q.device.type == "cpu" and group >= 32
                and group & (group - 1) == 0 and k % group == 0
                and tuple(s.shape) == (experts, n, k // group) and s.is_floating_point()
                and (z is None or (z.dtype == torch.uint8 and z.shape == s.shape))):
            raise ValueError(f"NativeInt4Bank: nibbles [E, N, K/2] uint8 with scales (and zero "
                             f"points) [E, N, K/G], G a power of two from 32, expected, got q "
                             f"{tuple(q.shape)} {q.dtype}, s {tuple(s.shape)} {s.dtype}, "
                             f"group {group}")
        self.q = q.detach().contiguous()
        self.gs = int4_scales(s, z)
        self.group, self.kernel = group, kernel
        self.gemm = has_amx_bf16() if amx is None else amx
        self.experts, self.n, self.k = experts, n, k
        # the bytes read in place (the nibbles, and a symmetric bank's own scales)
        own = self.gs.data_ptr() != s.data_ptr()
        self.checkpoint_bytes = self.q.numel() + (0 if own else self.gs.nbytes)
        self.nbytes = self.q.numel() + self.gs.nbytes


def moe_native(x, w13, w2, topk_weights, topk_ids, slot_map, b13, b2,
               activation) -> torch.Tensor:
    """fused_moe for two native banks (NativeBank, NativeFp8Bank or NativeInt4Bank, of one
    kind, kernel and dtype): [T, D] in x's dtype (summed in float32, rounded once)."""
    y = bound_moe(w13, w2, b13, b2)(x, topk_weights, topk_ids, slot_map, activation.kind,
                                    activation.alpha, activation.limit,
                                    x.dtype if x.dtype in _IO_FORMATS else torch.float32)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def bound_moe(w13, w2, b13, b2) -> MoeCall:
    """The kernel call of two native banks (and their biases), bound once a (w2, b13, b2)
    and kept on w13: a layer calls it with the same ones every step (the packed banks'
    biases are float32)."""
    cached = getattr(w13, "_moe_call", None)
    # (only float32 biases are kept by identity: a 16-bit one's float32 copy would go stale)
    if (cached is None or cached[0] is not w2 or cached[1] is not b13 or cached[2] is not b2
            or any(b is not None and b.dtype != torch.float32 for b in (b13, b2))):
        if not (isinstance(w13, (NativeBank, NativeFp8Bank, NativeInt4Bank))
                and type(w2) is type(w13) and w2.kernel is w13.kernel and w2.dtype == w13.dtype
                and (not isinstance(w13, NativeFp8Bank) or w13.block == w2.block)
                and (not isinstance(w13, NativeInt4Bank) or w13.group == w2.group)):
            raise ValueError(f"fused_moe: w13 and w2 must both be native banks of one kernel "
                             f"and dtype, got {_describe(w13)} and {_describe(w2)}")
        fp8, int4 = isinstance(w13, NativeFp8Bank), isinstance(w13, NativeInt4Bank)
        scales, block = ((w13.s, w2.s), w13.block) if fp8 else (
            ((w13.gs, w2.gs), (1, w13.group)) if int4 else (None, (128, 128)))
        call = w13.kernel.bind_moe(w13.q if fp8 or int4 else w13.weight,
                                   w2.q if fp8 or int4 else w2.weight, scales, block, b13, b2)
        cached = w13._moe_call = (w2, b13, b2, call)
    return cached[3]


@functools.cache
def native_kernels() -> NativeKernels | None:
    """The built library, or None (no C compiler, a failed build, not Linux)."""
    try:
        path = _build()
        try:
            return NativeKernels(ctypes.CDLL(str(path)), path)
        except OSError:
            path.unlink(missing_ok=True)     # not left cached for the next process to fail on
            raise
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("CPU: the native kernels are not available (%s); the experts run on "
                    "torch's one-thread products, projections on torch's", exc)
        return None


def _compiler() -> str:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")


@functools.cache
def has_amx_bf16() -> bool:
    """Whether this CPU has AMX-BF16, which torch's bf16 matmul (oneDNN) runs on: from about
    8 rows a product there outruns every other CPU form (cpu_linear.py has the figures)."""
    return " amx_bf16" in cpu_flags()


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _openmp_runtime() -> Path | None:
    """The OpenMP runtime torch loaded (libgomp, libiomp5 or libomp), read off this
    process's mappings, torch's own folder first; None where there is none to read."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if line.rstrip().endswith(".so") or ".so." in line}
    except OSError:
        return None
    found = [Path(p) for p in paths if re.search(r"/lib(gomp|iomp5|omp)\b[-.\w]*\.so[.\d]*$", p)
             and "-plugin-" not in p]            # not libgomp-plugin-nvptx, an offload plugin
    # torch's own: in its lib folder, or in the torch.libs folder beside it (auditwheel's)
    torch_dir = Path(torch.__file__).resolve().parent
    own = (torch_dir, torch_dir.parent / "torch.libs")
    found.sort(key=lambda p: (not any(d in p.resolve().parents for d in own), str(p)))
    return found[0] if found else None


def _build() -> Path:
    if platform.system() != "Linux":
        raise RuntimeError(f"built on Linux only, not {platform.system()}")
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    sources = b"".join((_HERE / name).read_bytes() for name in _SOURCES + _HEADERS)
    runtime = _openmp_runtime()
    key = hashlib.sha256(sources + version.encode() + cpu_flags().encode()
                         + " ".join(_FLAGS).encode() + str(runtime).encode()).hexdigest()[:16]
    root = Path(os.environ.get("FREETOKEN_CACHE", Path.home() / ".cache" / "freetoken"))
    target = root / "native" / f"cpu_native-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its target, then renamed: two processes building at once never load a
    # half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        # Compiled with -fopenmp; linked without it where torch's runtime is known (-fopenmp
        # at the link would add the system's -lgomp), to that file by path: its soname is the
        # one already loaded, and the rpath finds it again in a process that has not.
        # --no-undefined: a runtime that lacks a symbol the compiler's OpenMP calls (clang's
        # __kmpc_* against libgomp) fails here, and the build links by -fopenmp instead.
        objects = [str(Path(tmp) / (Path(name).stem + ".o")) for name in _SOURCES]
        _run([[cc, *_FLAGS, "-c", str(_HERE / name), "-o", obj]       # at once, on every core
              for name, obj in zip(_SOURCES, objects)])
        link = [cc, "-shared", "-o", str(built), *objects]
        try:
            if runtime is None:
                raise RuntimeError("no OpenMP runtime of torch's to link to")
            _run([[*link, str(runtime), f"-Wl,-rpath,{runtime.parent}", "-Wl,--no-undefined",
                   "-lm"]])
        except RuntimeError:
            _run([[*link, "-fopenmp", "-lm"]])
        os.replace(built, target)
    return target


def _run(cmds: list[list[str]]) -> None:
    """Run the commands side by side; a failure raises with the first failed one's errors,
    and no command is left running behind it (a timeout included)."""
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for cmd in cmds]
    try:
        for cmd, proc in zip(cmds, procs):
            _, err = proc.communicate(timeout=120)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {err.strip()[-500:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _describe(w) -> str:
    if isinstance(w, (NativeBank, NativeFp8Bank, NativeInt4Bank)):
        return f"NativeBank [{w.experts}, {w.n}, {w.k}] {w.dtype}"
    return f"{type(w).__name__} {tuple(getattr(w, 'shape', ()))}"
