"""A CPU engine step's attention over the paged KV cache in one native call: its prefill
chunks, over a cached prefix or none. On a CPU with AMX-BF16 and a bf16 cache on AMX tiles
(cpu_amx_attention.c, ft_attn_amx); elsewhere in vector registers (cpu_flash_attention.c,
ft_attn_flash: AVX2 or AVX-512; bf16, fp16 or float32 caches). A step's decode rows (one new
token each) go through the native decode step's attention (cpu_attention.c, the kernel of a
pure decode step), where it takes the caches, else the reference's decode batch; a pure decode
step is not taken at all (the layer's native decode step, cpu_attention.py, or the
reference).

Its reference is paged_attention_reference (torch's CPU flash attention on the gathered
keys), to a step of the output's dtype or two: scores and the online softmax in float32, the
output rounded once, with other block edges than torch's; the AMX kernel rounds the
probabilities to bf16 for the value product, as torch's flash attention does, the vector
kernel keeps them in float32. The AMX kernel declines (and the vector one takes) heads not
multiples of 32 (keys) and 16 (values), cache blocks not multiples of 16 tokens, other
caches than bf16; both decline head dims past 256 and q, keys and values of different
dtypes, where this returns None and the caller keeps the reference.
"""

from __future__ import annotations

import torch

from triton_kernels.cpu_native import NativeKernels, has_amx_bf16
from triton_kernels.paged_attention import paged_attention_reference

# The most room a call's copies of keys and values take (one per sequence and kv head, a
# thread's kept buffer: NativeKernels.kept_buffer, not in the host RAM plans): a step whose
# copies exceed it makes them a group of sequences at a time (one alone may exceed it: the
# AMX kernel's V^T, 2 bytes a value of its context; the vector kernel's float32 K and V, 8
# bytes a key and value element).
PACK_BYTES = 64 << 20
_FORMATS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_NO_ROPE = torch.empty(1, 0)        # cos_sin [positions, 0]: RoPE over no dims


class CpuPrefillAttention:
    """One layer's constants: heads (Hq, Hk), the softmax scale, the window (None: none) and
    the sinks ([Hq], any float dtype; None: none); pack_bytes: PACK_BYTES's room; amx: the
    AMX kernel where it takes a step (None: where this CPU has AMX-BF16; False: the vector
    kernel always)."""

    def __init__(self, kernel: NativeKernels, heads: tuple[int, int], scale: float,
                 window: int | None, sinks: torch.Tensor | None, pack_bytes: int = PACK_BYTES,
                 amx: bool | None = None):
        self.kernel, (self.hq, self.hk), self.scale = kernel, heads, scale
        self.pack_bytes = pack_bytes
        self.amx = has_amx_bf16() if amx is None else amx   # (False once the kernel says no)
        self.window = window or 0
        self.sinks = None if sinks is None else sinks.detach().float().contiguous()
        self._decode_calls = {}             # the decode rows' kernel call, by head dim

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 seq_lens: torch.Tensor) -> torch.Tensor | None:
        """q [T, Hq, Dk] after RoPE, caches [NB, BS, Hk, D] holding this step's keys,
        block_tables [B, M], cu_seqlens_q [B+1], seq_lens [B] (paged_attention's meaning)
        -> [T, Hq, Dv] in q's dtype, or None where the kernel does not take these."""
        if not (q.dtype == k_cache.dtype == v_cache.dtype and q.dtype in _FORMATS and q.dim() == 3
                and k_cache.dim() == v_cache.dim() == 4 and q.shape[1] == self.hq
                and k_cache.shape[2] == v_cache.shape[2] == self.hk
                and k_cache.shape[:2] == v_cache.shape[:2] and q.shape[2] == k_cache.shape[3]
                and k_cache.stride(3) == v_cache.stride(3) == 1):
            return None
        t = q.shape[0]
        q = q.contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        b = lens.numel()
        # (rows past the batch's, as the reference reads them: unused)
        tables = block_tables[:b].to(torch.int32).contiguous()
        cu = cu_seqlens_q[:b + 1].to(torch.int32).contiguous()
        if (cu.numel() != b + 1 or tables.dim() != 2 or tables.shape[0] != b
                or int(cu[0]) != 0 or int(cu[-1]) > t):
            raise ValueError(f"attention: cu_seqlens_q [B+1] from 0 to at most {t} tokens and "
                             f"block_tables [B, M] for {b} sequences expected, got "
                             f"{cu.tolist()} and {tuple(block_tables.shape)}")
        n_q = cu[1:] - cu[:-1]
        single = n_q == 1
        if bool(single.all()):
            return None             # a pure decode step: the caller's decode path
        out = self._run(q, k_cache, v_cache, tables, cu, lens, k_cache.shape[1], 2)
        if out is None:
            return None
        if bool(single.any()):
            # This step's decode rows: through the decode step's kernel where it takes the
            # caches, else the reference's decode batch, which gathers every row's keys and
            # values into float32 copies (the bench model's engine, 4 sequences decoding at
            # 8000 keys beside a 512-token prompt: the step's attention 0.25 -> 0.10 s, the
            # step 1.16 -> 0.99 s; a shuffled cache, 8 rows of 16k keys: 265 -> 20.5 ms a
            # layer).
            rows = cu[:-1][single].long()
            got = self._decode_rows(q[rows], k_cache, v_cache, tables[single], lens[single])
            out[rows] = got if got is not None else paged_attention_reference(
                q[rows], k_cache, v_cache, tables[single], torch.arange(
                    rows.numel() + 1, dtype=torch.int32), lens[single], self.scale,
                sliding_window=self.window or None, sinks=self.sinks)
        return out

    def _decode_rows(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor | None:
        """Decode rows q [n, Hq, D] (after RoPE; each one's key and value already in the
        caches) -> [n, Hq, D] through the native decode step's attention (NativeKernels'
        attn_decode, as the layer's pure decode steps run it, given q as its fused
        product's rows: no norms, RoPE over none of the dims, no slot written), or None
        where that call does not take these caches or keys and values of other widths."""
        n, _, d = q.shape
        if v_cache.shape[3] != d:
            return None
        call = self._decode_calls.get(d)
        if call is None:
            call = self._decode_calls[d] = self.kernel.bind_attn(
                (self.hq, self.hk, d), None, None, 0.0, False, self.window or None, self.sinks,
                self.scale)
        if not call.takes(k_cache, v_cache):
            return None
        qkv = q.new_zeros(n, (self.hq + 2 * self.hk) * d)     # (its k and v parts unread)
        qkv[:, :self.hq * d] = q.reshape(n, -1)
        nowhere = torch.full((n,), -1, dtype=torch.int64)
        return call(qkv, _NO_ROPE, torch.zeros(n, dtype=torch.int64), k_cache, v_cache,
                    nowhere, tables.contiguous(), lens).view(n, self.hq, d)

    def dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
        """One sequence's chunk q [n, Hq, Dk] at positions L-n..L-1, causal over its keys
        k [L, Hk, Dk] and values v [L, Hk, Dv] as dense tensors (MLA's decompressed
        prefill; the last dims contiguous, rows may be strided) -> [n, Hq, Dv], or None
        where the kernels do not take these. The keys are one cache block (for the AMX
        kernel padded to a whole 16-key tile: a copy where L is not a multiple of 16)."""
        n, length = q.shape[0], k.shape[0]
        if not (q.dtype == k.dtype == v.dtype and q.dtype in _FORMATS and q.dim() == k.dim()
                == v.dim() == 3 and q.shape[1] == self.hq and k.shape[1] == v.shape[1]
                == self.hk and q.shape[2] == k.shape[2] and v.shape[0] == length >= n >= 1
                and k.stride(2) == v.stride(2) == 1):
            return None
        # (AMX's K tiles are 16 keys of one block: the keys padded to a whole tile)
        tile = 16 if self.amx and q.dtype == torch.bfloat16 else 1
        rows = -(-length // tile) * tile
        if rows != length:
            k = torch.cat([k, k.new_zeros(rows - length, *k.shape[1:])])
        one = torch.tensor([[0]], dtype=torch.int32)
        return self._run(q.contiguous(), k[None], v[None], one,
                         torch.tensor([0, n], dtype=torch.int32),
                         torch.tensor([length], dtype=torch.int32), rows, 1)

    def _run(self, q, k_cache, v_cache, tables, cu, lens, block_size: int, min_q: int):
        """A kernel on int32 tables / offsets / lengths, sequences of min_q new tokens and
        more -> out [T, Hq, Dv] (the others' rows unwritten), or None where none takes
        these: the AMX kernel where it may, else (or where it declines) the vector one."""
        t, _, dk = q.shape
        dv, b = v_cache.shape[3], lens.numel()
        threads = torch.get_num_threads()
        out = q.new_empty(t, self.hq, dv)
        sinks = 0 if self.sinks is None else self.sinks.data_ptr()
        lay = (tables.data_ptr(), tables.shape[1], cu.data_ptr(), lens.data_ptr(), b, min_q,
               self.hq, self.hk, dk, dv, block_size, self.scale, self.window, sinks, threads)
        rc = -3
        if self.amx and q.dtype == torch.bfloat16:
            need = self.kernel.attn_amx_scratch(cu.data_ptr(), lens.data_ptr(), b, min_q,
                                                self.hk, dk, dv, self.window, threads,
                                                self.pack_bytes)
            scratch = self.kernel.kept_buffer("attn_prefill", need, torch.uint8)
            rc = self.kernel.attn_amx_fn(
                q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0],
                *k_cache.stride()[:3], *v_cache.stride()[:3], *lay, scratch.data_ptr(), need,
                self.pack_bytes, out.data_ptr())
            if rc == -1:
                self.amx = False        # (this build or CPU has no AMX: not asked again)
        if rc in (-1, -3):              # the vector kernel: any cache dtype, block, head dims
            need = self.kernel.attn_flash_scratch(cu.data_ptr(), lens.data_ptr(), b, min_q,
                                                  self.hk, dk, dv, self.window, threads,
                                                  self.pack_bytes)
            scratch = self.kernel.kept_buffer("attn_prefill", need, torch.uint8)
            rc = self.kernel.attn_flash_fn(
                q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), _FORMATS[q.dtype],
                k_cache.shape[0], *k_cache.stride()[:3], *v_cache.stride()[:3], *lay,
                scratch.data_ptr(), need, self.pack_bytes, out.data_ptr())
        if rc == -2:
            raise ValueError(f"attention: a block table names a block outside the cache's "
                             f"{k_cache.shape[0]}, or is shorter than a sequence")
        if rc == -4:
            raise MemoryError("attention: the kernel's scratch was too small or its tables "
                              "could not be allocated")
        return out if rc == 0 else None
