"""A multi-head latent attention layer's decode step on a CPU engine in one native call
(cpu_mla.c): the new latent's norm, rope and cache write, the queries taken into latent
space through W_UK, attention over the sequence's latents, W_UV out of it: DeepSeek-V3,
Kimi-K2 and GLM-4.7-Flash's decode from their projections' outputs to o_proj's input, in
the absorbed form. Its reference is the modules' path it replaces (mla.py's _latent,
apply_rope, write_latent, attend_absorbed with mla_attention_reference), each step rounded
where that path rounds (cpu_mla.c lists them), to float32's order of sums.
"""

from __future__ import annotations

import torch

from triton_kernels.cpu_native import (_FORMATS, _IO_FORMATS, ATTN_RANGE, OP_MLA, NativeKernels,
                                       Op, _check_rc, _rows)


class CpuMlaDecode:
    """One layer's constants, checked and held once: dims (H, N, R, L, V), kv_a_layernorm's
    scale [L] and eps, kv_b_proj's weight [H (N + V), L] (16-bit, the model's dtype), the
    softmax scale, the rope's pairing. The call takes the batch's tensors and the cache."""

    def __init__(self, kernel: NativeKernels, dims: tuple[int, int, int, int, int],
                 kv_norm: torch.Tensor, eps: float, w_kvb: torch.Tensor, scale: float,
                 interleaved: bool):
        h, n, r, l, v = dims
        self.fn, self.dims, self.eps, self.scale = kernel.mla_decode_fn, dims, eps, scale
        self.kv_norm = kv_norm.detach().contiguous()
        self.w_kvb = w_kvb.detach().contiguous()
        self.interleaved = int(interleaved)
        self.dtype = self.w_kvb.dtype
        if not (min(dims) > 0 and r % 2 == 0 and self.dtype in _FORMATS
                and self.kv_norm.dtype == self.dtype and self.kv_norm.shape == (l,)
                and self.w_kvb.shape == (h * (n + v), l) and self.w_kvb.device.type == "cpu"):
            raise ValueError(f"native MLA decode: dims (H, N, R, L, V) = {dims} (R even), a "
                             f"16-bit kv_b weight [{h * (n + v)}, {l}] and norm [{l}] in its "
                             f"dtype expected, got {tuple(self.w_kvb.shape)} "
                             f"{self.w_kvb.dtype}, {tuple(self.kv_norm.shape)} "
                             f"{self.kv_norm.dtype}")
        self.cache = None                   # the last cache accepted

    def takes(self, cache: torch.Tensor) -> bool:
        """Whether the call reads and writes this latent cache: [NB, BS, L + R] in the model's
        dtype (the reference rounds another to it before its products), contiguous, on the
        CPU (the engine's is the same tensor every step)."""
        if cache is self.cache:
            return True
        _, _, r, l, _ = self.dims
        ok = (cache.dim() == 3 and cache.shape[2] == l + r and cache.dtype == self.dtype
              and cache.is_contiguous() and cache.device.type == "cpu")
        if ok:
            self.cache = cache
        return ok

    def op(self, q: torch.Tensor, kv: torch.Tensor, cos_sin: torch.Tensor,
           positions: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
           tables: torch.Tensor, lens: torch.Tensor, scratch: torch.Tensor,
           out: torch.Tensor) -> Op:
        """This call as a program's op over R sequences: q [R, H (N + R)] and kv [R, L + R]
        in the model's dtype -> out [R, H V]; positions, slots [R] int64, lens [R] int32,
        tables [R, M] int32 (each index checked in C), scratch [R, H (L + R)] float32."""
        h, n, r, l, v = self.dims
        rows = q.shape[0]
        if not self.takes(cache):
            raise ValueError(f"native MLA decode: a latent cache [NB, BS, {l + r}] expected, "
                             f"got {tuple(cache.shape)} {cache.dtype}")
        _rows("MLA q", q, rows, h * (n + r), (self.dtype,))
        _rows("MLA kv", kv, rows, l + r, (self.dtype,))
        _rows("MLA out", out, rows, h * v, (self.dtype,))
        _rows("MLA scratch", scratch, rows, h * (l + r), (torch.float32,))
        _rows("positions", positions, rows, None, (torch.int64,))
        _rows("slots", slots, rows, None, (torch.int64,))
        _rows("lens", lens, rows, None, (torch.int32,))
        _rows("block tables", tables, rows, tables.shape[1], (torch.int32,))
        if not (cos_sin.dtype == torch.float32 and cos_sin.is_contiguous()
                and cos_sin.dim() == 2 and cos_sin.shape[1] == r):
            raise ValueError(f"native MLA decode: a float32 rope table [P, {r}] expected, got "
                             f"{tuple(cos_sin.shape)} {cos_sin.dtype}")
        nb, bs = cache.shape[:2]
        return Op(OP_MLA, rows, (
            q.data_ptr(), kv.data_ptr(), _FORMATS[self.dtype], h, n, r, l, v,
            self.kv_norm.data_ptr(), cos_sin.data_ptr(), cos_sin.shape[0], self.interleaved,
            positions.data_ptr(), cache.data_ptr(), _IO_FORMATS[cache.dtype], nb, bs,
            slots.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(),
            self.w_kvb.data_ptr(), scratch.data_ptr(), out.data_ptr()), (self.eps, self.scale),
            (self, q, kv, cos_sin, positions, cache, slots, tables, lens, scratch, out))

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                 cos_sin: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """q [B, H (N + R)], kv [B, L + R] -> [B, H V] in the model's dtype; the new latents
        written into the cache."""
        h, n, r, l, v = self.dims
        b = q.shape[0]
        out = torch.empty(b, h * v, dtype=self.dtype)
        scratch = torch.empty(b, h * (l + r))
        op = self.op(q.contiguous(), kv.contiguous(), cos_sin, positions.contiguous(), cache,
                     slot_mapping.contiguous(), block_tables.contiguous(),
                     seq_lens.contiguous(), scratch, out)
        a = op.ints
        rc = self.fn(*a[:3], b, *a[3:8], a[8], op.floats[0], *a[9:21], a[21], op.floats[1],
                     torch.get_num_threads(), a[22], a[23])
        if rc == -2:
            raise ValueError(ATTN_RANGE)
        _check_rc(rc, "native MLA decode", "its scratch")
        return out
