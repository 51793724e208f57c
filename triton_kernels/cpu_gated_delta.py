"""Gated DeltaNet's sequence ops on a CPU engine in native calls (cpu_gated_delta.c): the
causal conv1d and the gated delta rule over a step's flat varlen batch, each sequence's
state in its pool slot, for every step (decode and prefill chunks alike).

Their references are causal_conv1d_reference and gated_delta_rule_reference, to float32's
order of sums: the same math in float32, token by token, rounded once to the activations'
dtype. The references ran torch ops per token and layer: a bench-shaped Qwen3-Next (hidden
1024, 12 layers, 9 of them linear attention) prefilled 4096 tokens at ~880 tok/s and decoded
at 32 ms a token on 2 cores, against Qwen3-MoE's 2440 and 12.4 at the same shape.
A decode step (one new token a sequence) runs the whole layer between its projections in
one call instead (GdnDecodeCall, ft_gdn_decode: the conv's update, the gates, the rule and
the gated RMSNorm), which a CPU engine's decode program records (engine/cpu_graph.py).
Where a call does not take its tensors (any not on the CPU, a dtype the kernels do not read,
layouts other than the layer's, a conv wider than 16) it returns None and the caller keeps
the reference; slots outside the pool or named twice, and offsets outside the batch, raise.
"""

from __future__ import annotations

import torch

from triton_kernels.cpu_native import _IO_FORMATS, OP_GDN, NativeKernels, Op, _rows


def _seqs(state_slots, cu_seqlens, has_initial_state):
    """The step's sequences as the kernels read them (int32 slots and offsets, a byte a
    flag), or None where they are not [N], [N+1], [N] CPU tensors."""
    n = state_slots.shape[0] if state_slots.dim() == 1 else -1
    if not (n >= 0 and tuple(cu_seqlens.shape) == (n + 1,)
            and tuple(has_initial_state.shape) == (n,)
            and all(t.device.type == "cpu"
                    for t in (state_slots, cu_seqlens, has_initial_state))):
        return None
    return (state_slots.to(torch.int32).contiguous(), cu_seqlens.to(torch.int32).contiguous(),
            has_initial_state.to(torch.uint8).contiguous())


def _on_cpu(*tensors) -> bool:
    return all(t.device.type == "cpu" for t in tensors)


def _raise(rc: int, what: str):
    if rc == -2:
        raise ValueError(f"{what}: a state slot outside the pool, or token offsets outside "
                         f"the batch")
    if rc == -3:
        raise ValueError(f"{what}: two sequences name one state slot")
    if rc == -1:
        raise MemoryError(f"{what}: out of host memory for a thread's state")
    if rc == -4:
        raise ValueError(f"{what}: a conv width outside 2..16")


class CpuGatedDelta:
    """One layer's: the conv's weight [C, W] (float32, taken once) and the kernel."""

    def __init__(self, kernel: NativeKernels, conv_weight: torch.Tensor):
        self.kernel = kernel
        self.weight = conv_weight.detach().float().contiguous()

    def conv1d(self, x: torch.Tensor, conv_state: torch.Tensor, state_slots: torch.Tensor,
               cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor,
               silu: bool = True) -> torch.Tensor | None:
        """x [T, C] (rows may be strided) -> act(conv) [T, C] in x's dtype; conv_state
        [S, C, W-1] in x's dtype updated in place (causal_conv1d's meaning)."""
        c, w = self.weight.shape
        seqs = _seqs(state_slots, cu_seqlens, has_initial_state)
        if not (seqs is not None and _on_cpu(x, conv_state) and x.dim() == 2
                and x.shape[1] == c and x.stride(1) == 1 and x.dtype in _IO_FORMATS
                and conv_state.dtype == x.dtype and conv_state.is_contiguous()
                and tuple(conv_state.shape[1:]) == (c, w - 1) and 2 <= w <= 16):
            return None
        slots, cu, has = seqs
        y = torch.empty(x.shape, dtype=x.dtype)
        rc = self.kernel.causal_conv1d_fn(
            x.data_ptr(), _IO_FORMATS[x.dtype], x.shape[0], c, x.stride(0),
            self.weight.data_ptr(), w, conv_state.data_ptr(), conv_state.shape[0],
            slots.data_ptr(), cu.data_ptr(), has.data_ptr(), slots.numel(), int(silu),
            torch.get_num_threads(), y.data_ptr())
        _raise(rc, "causal conv1d")
        return y

    def rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, state: torch.Tensor, state_slots: torch.Tensor,
             cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor, scale: float,
             use_qk_l2norm: bool = True) -> torch.Tensor | None:
        """q, k [T, Hk, Dk], v [T, Hv, Dv] (rows may be strided, heads packed), g [T, Hv]
        float32, beta [T, Hv], state [S, Hv, Dk, Dv] float32 updated in place -> o
        [T, Hv, Dv] in v's dtype (gated_delta_rule's meaning)."""
        t, hk, dk = q.shape
        hv, dv = v.shape[1:]
        seqs = _seqs(state_slots, cu_seqlens, has_initial_state)
        if not (seqs is not None and _on_cpu(q, k, v, g, beta, state)
                and q.dtype == k.dtype == v.dtype
                and v.dtype in _IO_FORMATS and beta.dtype in _IO_FORMATS
                and k.shape == q.shape and v.shape[0] == t
                and all(x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in (q, k, v))
                and g.dtype == torch.float32 and g.is_contiguous() and g.shape == (t, hv)
                and beta.is_contiguous() and beta.shape == (t, hv)
                and state.dtype == torch.float32 and state.is_contiguous()
                and tuple(state.shape[1:]) == (hv, dk, dv) and hv % hk == 0):
            return None
        slots, cu, has = seqs
        out = torch.empty(v.shape, dtype=v.dtype)
        rc = self.kernel.gated_delta_fn(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), _IO_FORMATS[v.dtype], t, q.stride(0),
            k.stride(0), v.stride(0), g.data_ptr(), beta.data_ptr(), _IO_FORMATS[beta.dtype],
            state.data_ptr(), state.shape[0], slots.data_ptr(), cu.data_ptr(), has.data_ptr(),
            slots.numel(), hk, hv, dk, dv, scale, int(use_qk_l2norm), torch.get_num_threads(),
            out.data_ptr())
        _raise(rc, "gated delta rule")
        return out


class GdnDecodeCall:
    """A layer's decode step between its projections (ft_gdn_decode), its constants checked
    and held once: (proj [B, P], conv_state, state, slots [B] int32, has [B] uint8) -> out
    [B, Hv Dv] in proj's dtype. lay: where q, k, v, z, b and a lie in a projection row
    (cpu_gated_delta.c's twelve offsets and strides); heads (Hk, Hv, Dk, Dv)."""

    def __init__(self, kernel: NativeKernels, conv_weight: torch.Tensor, lay: tuple[int, ...],
                 width: int, heads: tuple[int, int, int, int], decay_a: torch.Tensor,
                 dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float, scale: float):
        hk, hv, dk, dv = heads
        self.fn, self.heads, self.width, self.eps, self.scale = (
            kernel.gdn_decode_fn, heads, width, eps, scale)
        self.conv_w = conv_weight.detach().float().contiguous()
        self.lay = torch.tensor(lay, dtype=torch.int64)
        self.decay_a, self.dt_bias = (t.detach().float().contiguous() for t in (decay_a, dt_bias))
        self.norm_w = norm_weight.detach().contiguous()
        r = hv // hk if hk > 0 and hv % hk == 0 else 0
        q0, qh, k0, kh, v0, vh, z0, zh, b0, bh, a0, ah = lay
        ends = (q0 + (hk - 1) * qh + dk, k0 + (hk - 1) * kh + dk, v0 + (hk - 1) * vh + r * dv,
                z0 + (hk - 1) * zh + r * dv, b0 + (hk - 1) * bh + r, a0 + (hk - 1) * ah + r)
        self.c = 2 * hk * dk + hv * dv
        if not (r and len(lay) == 12 and min(lay) >= 0 and max(ends) <= width
                and tuple(self.conv_w.shape[:1]) == (self.c,) and 2 <= self.conv_w.shape[1] <= 16
                and self.decay_a.shape == self.dt_bias.shape == (hv,)
                and self.norm_w.shape == (dv,) and self.norm_w.dtype in _IO_FORMATS):
            raise ValueError(f"native Gated DeltaNet decode: heads {heads} (Hv a multiple of "
                             f"Hk), a layout inside rows of {width} (got {lay}), a conv weight "
                             f"[{self.c}, 2..16], decay and dt_bias [{hv}], a norm weight [{dv}] "
                             f"expected")

    def takes(self, conv_state: torch.Tensor, state: torch.Tensor) -> bool:
        """Whether the call reads and writes these pools: conv [S, C, W-1] in the norm
        weight's dtype (the model's), state [S, Hv, Dk, Dv] float32, contiguous, on the CPU."""
        hk, hv, dk, dv = self.heads
        return (conv_state.dtype == self.norm_w.dtype and conv_state.is_contiguous()
                and conv_state.dim() == 3
                and tuple(conv_state.shape[1:]) == (self.c, self.conv_w.shape[1] - 1)
                and state.dtype == torch.float32 and state.is_contiguous() and state.dim() == 4
                and tuple(state.shape[1:]) == (hv, dk, dv)
                and state.shape[0] == conv_state.shape[0]
                and conv_state.device.type == state.device.type == "cpu")

    def _check(self, proj, conv_state, state, slots, has, rows: int) -> None:
        hk, hv, dk, dv = self.heads
        w = self.conv_w.shape[1]
        _rows("Gated DeltaNet projections", proj, rows, self.width, (self.norm_w.dtype,))
        _rows("state slots", slots, rows, None, (torch.int32,))
        _rows("has-state flags", has, rows, None, (torch.uint8,))
        if not self.takes(conv_state, state):
            raise ValueError(f"native Gated DeltaNet decode: pools [S, {self.c}, {w - 1}] in "
                             f"{proj.dtype} and [S, {hv}, {dk}, {dv}] float32 expected, got "
                             f"{tuple(conv_state.shape)} {conv_state.dtype} and "
                             f"{tuple(state.shape)} {state.dtype}")

    def op(self, proj: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor,
           slots: torch.Tensor, has: torch.Tensor, out: torch.Tensor) -> Op:
        """This call as a program's op over R sequences (buffers [R, ..])."""
        hk, hv, dk, dv = self.heads
        r = proj.shape[0]
        self._check(proj, conv_state, state, slots, has, r)
        _rows("Gated DeltaNet out", out, r, hv * dv, (proj.dtype,))
        return Op(OP_GDN, r, (
            proj.data_ptr(), _IO_FORMATS[proj.dtype], self.width, self.lay.data_ptr(),
            self.conv_w.data_ptr(), self.conv_w.shape[1], conv_state.data_ptr(),
            state.data_ptr(), state.shape[0], slots.data_ptr(), has.data_ptr(),
            self.decay_a.data_ptr(), self.dt_bias.data_ptr(), self.norm_w.data_ptr(), hk, hv,
            dk, dv, out.data_ptr()), (self.eps, self.scale),
            (self, proj, conv_state, state, slots, has, out))

    def __call__(self, proj: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor,
                 slots: torch.Tensor, has: torch.Tensor) -> torch.Tensor:
        hk, hv, dk, dv = self.heads
        proj = proj.contiguous()
        out = torch.empty(proj.shape[0], hv * dv, dtype=proj.dtype)
        op = self.op(proj, conv_state, state, slots.to(torch.int32).contiguous(),
                     has.to(torch.uint8).contiguous(), out)
        a = op.ints
        rc = self.fn(*a[:2], op.rows, *a[2:14], op.floats[0], *a[14:18], op.floats[1],
                     torch.get_num_threads(), a[18])
        _raise(rc, "Gated DeltaNet decode")
        return out
