"""Mixture-of-experts FFN over routed tokens.

x: [T, D]; w13: [S, 2I, D] (gate rows then up rows, per expert slot); w2: [S, D, I];
topk_weights: [T, k] (any float dtype; applied in x's dtype); topk_ids: [T, k] expert ids.
slot_map: optional [E] int tensor mapping expert id -> slot in w13/w2 (the GPU expert cache's
pool); None means slot == expert id. b13: optional [S, 2I] (gate biases then up biases) and
b2: optional [S, D] expert biases (gpt-oss), indexed by slot like the weights, in x's dtype.
activation: SILU, act = silu(gate) * up; or SWIGLU_OAI (gpt-oss), g = min(gate, limit),
u = clamp(up, -limit, limit), act = (u + 1) * g * sigmoid(alpha * g). gate and up are not
interleaved: rows [0, I) of w13 are gate, [I, 2I) up. Returns [T, D] =
sum_j w_j * (act(x @ w13^T + b13) @ w2^T + b2), each linear output rounded to x's dtype.

The Triton path has two forms, picked by token count (_moe_path):
- GEMV, up to _GEMV_MAX_TOKENS tokens (decode), two launches and no sort: (1) per (token, k)
  pair and I tile, silu(x . gate) * (x . up) into act[pair]; (2) per token and D tile, the k
  weighted down projections summed in registers and stored once. At batch 1 the layer
  streams k experts' weights (~75 MB for Qwen3-30B-A3B, ~16 us at H200 HBM speed), so
  launches are a large part of the time, and a 16-row tl.dot tile would be 15/16 padding.
- Grouped, above that, six launches: (1) align (moe_align.py): sort the T*k (token, k) pairs by expert and
  pad each expert's list to a multiple of BLOCK_M (three small kernels, no host sync); (2)
  GEMM1 over (expert block, I tile): x @ w13[slot]^T with SiLU-and-multiply fused in the
  epilogue; (3) GEMM2: act @ w2[slot]^T times the routing weight, one row per pair; (4) sum
  each token's k rows.
"""

import dataclasses
import inspect

import torch
import torch.nn.functional as F

from triton_kernels._dispatch import fixed_configs, interpreting, tl, triton, use_triton
from triton_kernels.cpu_amx import moe_amx
from triton_kernels.cpu_matmul import Fp16Bank, linear, widens
from triton_kernels.cpu_linear import GEMM_ROWS
from triton_kernels.cpu_native import (NativeBank, NativeFp8Bank, NativeInt4Bank, has_amx_bf16,
                                       moe_native)
from triton_kernels.moe_align import moe_align


@dataclasses.dataclass(frozen=True)
class MoeActivation:
    """The experts' gated activation. "silu": silu(gate) * up (alpha and limit unused);
    "swiglu_oai" (gpt-oss): gate clamped above at limit, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self):
        if self.kind not in _ACTIVATIONS:
            raise ValueError(f"MoeActivation: kind must be one of {_ACTIVATIONS}, got "
                             f"{self.kind!r}")


_ACTIVATIONS = ("silu", "swiglu_oai")
SILU = MoeActivation("silu")
SWIGLU_OAI = MoeActivation("swiglu_oai")


def _activate(gate: torch.Tensor, up: torch.Tensor, activation: MoeActivation) -> torch.Tensor:
    """[n, I] gate and up (x's dtype) -> act [n, I], rounded as the kernels round."""
    if activation.kind == "silu":
        return F.silu(gate) * up
    # Clamp exactly in the dtype, compute in float32, round once (the kernels do the same).
    g = gate.clamp(max=activation.limit).float()
    u = up.clamp(min=-activation.limit, max=activation.limit).float()
    return ((u + 1) * g * torch.sigmoid(activation.alpha * g)).to(gate.dtype)


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        slot_map: torch.Tensor | None = None, *,
                        b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                        activation: MoeActivation = SILU) -> torch.Tensor:
    if not isinstance(activation, MoeActivation):
        raise ValueError(f"fused_moe: activation must be a MoeActivation, got {activation!r}")
    if isinstance(w13, NativeFp8Bank):  # fp8 experts only the CPU computes, from their bytes
        # a prefill chunk: their bf16 copy on AMX, or where RAM held none, the bytes on AMX
        copies = (w13.prefill is not None and isinstance(w2, NativeFp8Bank)
                  and w2.prefill is not None)
        prefill = (_amx_prefill(x, w13.prefill, w2.prefill, topk_weights, topk_ids, slot_map,
                                b13, b2, activation) if copies else
                   _fp8_amx_prefill(x, w13, w2, topk_weights, topk_ids, slot_map, b13, b2,
                                    activation))
        if prefill is not None:
            return prefill
        return moe_native(x, w13, w2, topk_weights, topk_ids, slot_map, b13, b2, activation)
    if isinstance(w13, NativeInt4Bank):  # int4 experts only the CPU computes, from their nibbles
        prefill = _int4_amx_prefill(x, w13, w2, topk_weights, topk_ids, slot_map, b13, b2,
                                    activation)
        if prefill is not None:
            return prefill
        return moe_native(x, w13, w2, topk_weights, topk_ids, slot_map, b13, b2, activation)
    if isinstance(w13, NativeBank):     # experts only the CPU computes, by the native kernel
        prefill = _amx_prefill(x, w13, w2, topk_weights, topk_ids, slot_map, b13, b2,
                               activation)
        if prefill is not None:
            return prefill
        return moe_native(x, w13, w2, topk_weights, topk_ids, slot_map, b13, b2, activation)
    if isinstance(w13, Fp16Bank):       # experts only the CPU computes, packed for its GEMM
        _check_packed(x, w13, w2)
        return moe_packed_banks(x, w13, w2, topk_weights, topk_ids, slot_map, b13, b2,
                                activation)
    # On the CPU (the CPU experts, the whole CPU engine), by rows per used expert:
    # - one token: the loop without its bookkeeping per expert (_moe_one_token_torch);
    # - a few (decode batches): one grouped call per projection; a Python loop over experts
    #   costs ~10 ops per expert (~1000 per decode step), more than the matmuls;
    # - WIDE_ROWS and more (prefill chunks): the loop, each expert's 16-bit weights widened
    #   to float32 (cpu_matmul.py: 16-bit CPU matmuls run row by row), one expert at a time
    #   (a layer's experts widened at once would be 4 bytes a weight of them).
    # Elsewhere the loop (grouped_mm wants bf16 and aligned strides on CUDA). The loop and
    # the grouped call give the same bits: the same matmuls per expert, summed in the same
    # order. grouped_mm also wants rows of a multiple of 16 bytes (real widths are; odd test
    # ones not).
    if x.device.type != "cpu" or not topk_ids.numel():
        return _moe_loop_torch(x, w13, w2, topk_weights, topk_ids, slot_map, b13, b2, activation)
    if x.shape[0] == 1:
        return _moe_one_token_torch(x, w13, w2, topk_weights, topk_ids, slot_map, b13, b2,
                                    activation)
    used = (topk_ids if slot_map is None else slot_map[topk_ids]).unique()
    if widens(x, rows=topk_ids.numel() / used.numel()):
        return _moe_loop_torch(x, w13, w2, topk_weights, topk_ids, slot_map, b13, b2,
                               activation, wide=True)
    # torch's CPU grouped_mm runs one mm (and one .item()) per group, empty ones too: over
    # the used slots' range it pays only where most of that range is used.
    # float32 gpt-oss activations stay per expert: torch's float32 sigmoid gives other last
    # bits on a [P, I] tensor than on the loop's [n, I] slices (16-bit outputs round them away).
    run = _moe_loop_torch
    if _grouped_exact(x, w2, activation) and 2 * used.numel() >= int(used[-1] - used[0]) + 1:
        run = _moe_grouped_torch
    return run(x, w13, w2, topk_weights, topk_ids, slot_map, b13, b2, activation)


def _amx_prefill(x, w13: NativeBank, w2, topk_weights, topk_ids, slot_map, b13, b2,
                 activation) -> torch.Tensor | None:
    """A prefill chunk on an AMX CPU (GEMM_ROWS (token, expert) pairs an expert and more, x
    in the bank's bf16): the native AMX kernel (cpu_amx.py: the whole layer in one call,
    HF's roundings), or where it does not take the shapes, torch's bf16 products (oneDNN's
    AMX kernels) an expert at a time, as one grouped call per projection (the loop's ~10 ops
    an expert cost a 512-token chunk ~5 ms a layer) where it gives the loop's bits, else
    HF's loop; the banks' float32 biases in x's dtype as HF keeps them. None where it does
    not apply."""
    if not (w13.gemm and isinstance(w2, NativeBank) and x.dtype == w13.dtype == w2.dtype
            and _rows_per_expert(topk_ids, slot_map) >= GEMM_ROWS):
        return None
    out = moe_amx(w13.kernel, x, w13.weight, w2.weight, topk_weights, topk_ids, slot_map, b13,
                  b2, activation)
    if out is not None:
        return out
    biases = [None if b is None else b.to(x.dtype) for b in (b13, b2)]
    run = _moe_grouped_torch if _grouped_exact(x, w2.weight, activation) else _moe_loop_torch
    return run(x, w13.weight, w2.weight, topk_weights, topk_ids, slot_map, *biases, activation)


def _fp8_amx_prefill(x, w13: NativeFp8Bank, w2, topk_weights, topk_ids, slot_map, b13, b2,
                     activation) -> torch.Tensor | None:
    """_amx_prefill for fp8 banks without a bf16 copy: the AMX kernel on their bytes (32 rows
    at a time decoded as the copy would hold them). None where it does not apply (no AMX, x
    not bf16, fewer than GEMM_ROWS pairs an expert, or the kernel declines)."""
    if not (has_amx_bf16() and x.dtype == torch.bfloat16
            and _rows_per_expert(topk_ids, slot_map) >= GEMM_ROWS):
        return None
    return moe_amx(w13.kernel, x, w13, w2, topk_weights, topk_ids, slot_map, b13, b2,
                   activation)


INT4_DECODE_BYTES = 512 << 20   # the most a prefill chunk's decoded int4 experts take


def _int4_amx_prefill(x, w13: NativeInt4Bank, w2, topk_weights, topk_ids, slot_map, b13, b2,
                      activation) -> torch.Tensor | None:
    """_amx_prefill for int4 banks: the AMX kernel on the nibbles (cpu_amx.py: each work
    item's 32 rows decoded to bf16 in L2 as the reference decodes them, exactly for 16-bit
    scales; the bf16 bank's speed at the bench layer, 0.56 bytes a weight read). Where the
    kernel declines (a build without AMX, the two banks' scales in two forms), the chunk's
    used experts decoded to bf16 whole (one layer of 64 experts of [512, 1024] and
    [1024, 256], ~5 ms on 2 cores, 100 MB), then torch's products on them. None where it
    does not apply (no AMX, x not bf16, fewer than GEMM_ROWS pairs an expert) or where the
    decoded experts would pass INT4_DECODE_BYTES (a large layer's, e.g. 128 experts of
    2048 x 768: 1.2 GB; INT4 is chosen to save RAM), which the native kernel runs from the
    nibbles."""
    if not (w13.gemm and isinstance(w2, NativeInt4Bank) and w2.gemm
            and x.dtype == torch.bfloat16
            and _rows_per_expert(topk_ids, slot_map) >= GEMM_ROWS):
        return None
    out = moe_amx(w13.kernel, x, w13, w2, topk_weights, topk_ids, slot_map, b13, b2,
                  activation)
    if out is not None:                 # from the nibbles, 32 rows decoded at a time
        return out
    slots = (topk_ids if slot_map is None else slot_map[topk_ids]).long()
    used = slots.unique()
    if used.numel() * 2 * (w13.n * w13.k + w2.n * w2.k) > INT4_DECODE_BYTES:
        return None
    remap = torch.zeros(w13.experts, dtype=torch.long)
    remap[used] = torch.arange(used.numel())
    # into the kernel's reused buffer (decode_buffer: fresh memory's page faults cost 7x the
    # decode); the products below read it before this thread's next decode
    n13, n2 = used.numel() * w13.n * w13.k, used.numel() * w2.n * w2.k
    buf = w13.kernel.decode_buffer(n13 + n2)
    up = w13.kernel.int4_decode(w13.q, w13.gs, w13.group, used, out=buf[:n13])
    down = w2.kernel.int4_decode(w2.q, w2.gs, w2.group, used, out=buf[n13:])
    biases = [None if b is None else b[used].to(x.dtype) for b in (b13, b2)]
    # each expert id to its decoded place (the kernel adds a token's experts in id order)
    places = remap if slot_map is None else remap[slot_map.long()]
    out = moe_amx(w13.kernel, x, up, down, topk_weights, topk_ids, places, *biases, activation)
    if out is not None:
        return out
    run = _moe_grouped_torch if _grouped_exact(x, down, activation) else _moe_loop_torch
    return run(x, up, down, topk_weights, remap[slots], None, *biases, activation)


def _grouped_exact(x, w2, activation) -> bool:
    """Whether _moe_grouped_torch gives the loop's bits here: grouped_mm wants rows of a
    multiple of 16 bytes (real widths are; odd test ones not), and a float32 gpt-oss
    activation stays per expert (torch's float32 sigmoid gives other last bits on a [P, I]
    tensor than on the loop's [n, I] slices; 16-bit outputs round them away)."""
    aligned = all(n * x.element_size() % 16 == 0 for n in (x.shape[1], w2.shape[2]))
    return aligned and not (activation.kind == "swiglu_oai" and x.dtype == torch.float32)


def _rows_per_expert(topk_ids, slot_map) -> float:
    """The mean (token, k) pairs of a used expert."""
    if topk_ids.shape[0] < GEMM_ROWS:          # fewer tokens: never that many
        return float(topk_ids.shape[0])
    used = (topk_ids if slot_map is None else slot_map[topk_ids]).unique()
    return topk_ids.numel() / max(1, used.numel())


def _moe_loop_torch(x, w13, w2, topk_weights, topk_ids, slot_map, b13, b2, activation,
                    wide: bool = False):
    """HF's loop over experts; wide: each expert's matmuls widened to float32 (CPU)."""
    out = torch.zeros_like(x)
    flat_ids = topk_ids.reshape(-1)
    # Group (token, k) pairs by expert so each expert runs one matmul, like HF's loop.
    for e in torch.unique(flat_ids).tolist():
        token_idx, pos = torch.where(topk_ids == e)
        slot = e if slot_map is None else int(slot_map[e])
        h = x[token_idx]
        # A separate bias add (HF's `x @ W + b`): the linear output rounds, then the sum.
        gate_up = linear(h, w13[slot], wide=wide)
        if b13 is not None:
            gate_up = gate_up + b13[slot]
        gate, up = gate_up.chunk(2, dim=-1)
        h = linear(_activate(gate, up, activation), w2[slot], wide=wide)
        if b2 is not None:
            h = h + b2[slot]
        h = h * topk_weights[token_idx, pos, None].to(h.dtype)
        out.index_add_(0, token_idx, h.to(out.dtype))
    return out


def _token_slots(topk_ids, slot_map) -> tuple[list[int], list[int]]:
    """One token's k routing positions in ascending expert id (the loop's order), and the
    slot each of those experts sits in."""
    ids = topk_ids[0].tolist()
    order = sorted(range(len(ids)), key=ids.__getitem__)
    table = None if slot_map is None else slot_map.tolist()
    return order, [ids[j] if table is None else table[ids[j]] for j in order]


def _moe_one_token_torch(x, w13, w2, topk_weights, topk_ids, slot_map, b13, b2, activation):
    """Batch-1 decode on the CPU: the loop's arithmetic (the same matmuls, experts added in id
    order) without its bookkeeping per expert (unique, where, index, index_add_: ~40% of a
    decode step's ops), the routing weights over the k experts at once."""
    order, slots = _token_slots(topk_ids, slot_map)
    gate_up = [F.linear(x, w13[s]) for s in slots]                # k x [1, 2I]
    if b13 is not None:
        gate_up = [g + b13[s] for g, s in zip(gate_up, slots)]
    # One activation per expert, on the loop's [1, I] views: torch's float32 sigmoid gives
    # other bits on other layouts (a stacked [k, 1, I] is vectorized differently).
    act = [_activate(*g.chunk(2, dim=-1), activation) for g in gate_up]
    h = torch.stack([F.linear(a, w2[s]) for a, s in zip(act, slots)])        # [k, 1, D]
    if b2 is not None:
        h = h + b2[slots][:, None]
    h = (h * topk_weights[0, order][:, None, None].to(h.dtype)).to(x.dtype)
    out = h[0].clone()
    for j in range(1, len(slots)):
        out += h[j]
    return out


def moe_one_token(x, up, down, topk_weights, topk_ids, slot_map, b13, b2,
                  activation: MoeActivation, float32: bool = False) -> torch.Tensor:
    """Batch-1 decode for experts whose products are not HF's bf16 matmuls (the CPU's packed
    GEMMs, the quantized formats' decode), so not held to the loop's bits: up(x, slot)
    [1, D] -> [1, 2I] and down(a, slot) [1, I] -> [1, D] per expert, the rest once for the
    k experts (one activation over [k, I]; the weighted sum as one [1, k] @ [k, D] float32
    product). ~1/4 less time for a packed INT4 layer than an expert at a time. float32: up
    and down take and give float32 (Fp16Bank), so x is widened once and nothing between the
    products is rounded."""
    order, slots = _token_slots(topk_ids, slot_map)
    h = x.float() if float32 else x
    gate_up = torch.cat([up(h, s) for s in slots])                           # [k, 2I]
    if b13 is not None:
        gate_up = gate_up + b13[slots]
    act = _activate(*gate_up.chunk(2, dim=-1), activation)                   # [k, I]
    h = torch.cat([down(act[j:j + 1], s) for j, s in enumerate(slots)])      # [k, D]
    if b2 is not None:
        h = h + b2[slots]
    weights = topk_weights[0, order].float()[None]                           # [1, k]
    return (weights @ h.float()).to(x.dtype)


def moe_packed_banks(x, w13, w2, topk_weights, topk_ids, slot_map, b13, b2,
                     activation: MoeActivation) -> torch.Tensor:
    """The CPU experts from two banks packed for a CPU GEMM (int4_cpu.Int4Packed,
    cpu_matmul.Fp16Bank: `.linear(x, slot)`, in float32 where the bank says `float32`),
    w13 [S, 2I, D] and w2 [S, D, I]: each used expert's tokens through its two products, the
    experts' outputs weighted and summed in float32 (batch 1: moe_one_token; more tokens:
    one index_add_). A bank with a `split` (cpu_split.CpuSplit) runs the experts of a call worth
    splitting (a prefill chunk) in two halves on two cores, the outputs in the same order,
    so the same bits."""
    f32 = getattr(w13, "float32", False)
    if not topk_ids.numel():
        return torch.zeros_like(x)
    if x.shape[0] == 1:
        return moe_one_token(x, w13.linear, w2.linear, topk_weights, topk_ids, slot_map,
                             b13, b2, activation, float32=f32)
    # The (token, k) pairs sorted by expert, gathered once: each used expert's rows are one
    # contiguous slice (no where/index/index_add per expert), summed back in one index_add_.
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique(flat, return_counts=True)
    slots = (experts if slot_map is None else slot_map[experts]).tolist()
    token = order // topk_ids.shape[1]
    counts = counts.tolist()
    rows = (x.float() if f32 else x).index_select(0, token).split(counts)

    def experts(part):                  # [(rows, slot)] -> their outputs, in order
        return [_packed_expert(r, w13, w2, slot, b13, b2, activation) for r, slot in part]

    pairs = list(zip(rows, slots))
    # A prefill chunk's experts over two cores, where both banks take a split.
    split = getattr(w13, "split", None) if getattr(w2, "split", None) is not None else None
    flops = 2 * flat.numel() * (w13.n * w13.k + w2.n * w2.k) if split is not None else 0
    if split is not None and split.worth(flops):
        h = torch.cat(split.map(experts, pairs, counts))
    else:
        h = torch.cat(experts(pairs))
    weights = topk_weights.reshape(-1)[order, None].float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return out.index_add_(0, token, h.float() * weights).to(x.dtype)


def _check_packed(x, w13, w2) -> None:
    if not (isinstance(w2, Fp16Bank) and x.dim() == 2 and x.device.type == "cpu"
            and w13.k == x.shape[1] == w2.n and w13.n == 2 * w2.k
            and w13.experts == w2.experts):
        raise ValueError(f"fused_moe: packed banks w13 [S, 2I, D], w2 [S, D, I] and x [T, D] "
                         f"on the CPU expected, got x {tuple(x.shape)} on {x.device}, w13 "
                         f"[{w13.experts}, {w13.n}, {w13.k}], w2 {_bank_shape(w2)}")


def _bank_shape(w) -> str:
    return (f"[{w.experts}, {w.n}, {w.k}]" if isinstance(w, Fp16Bank)
            else f"{type(w).__name__} {tuple(getattr(w, 'shape', ()))}")


def _packed_expert(x, w13, w2, slot, b13, b2, activation):
    gate_up = w13.linear(x, slot)
    if b13 is not None:
        gate_up = gate_up + b13[slot]
    h = w2.linear(_activate(*gate_up.chunk(2, dim=-1), activation), slot)
    return h if b2 is None else h + b2[slot]


def _moe_grouped_torch(x, w13, w2, topk_weights, topk_ids, slot_map, b13, b2, activation):
    """The loop's arithmetic as one F.grouped_mm per projection (P = T*k pairs, S slots)."""
    k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1)                                              # [P]
    slots = (ids if slot_map is None else slot_map[ids]).long()
    # grouped_mm takes each slot's rows together, in slot order; stable, so within a slot
    # in (token, k) order, as the loop's `where`.
    by_slot = torch.sort(slots, stable=True).indices                        # [P]
    slot_sorted = slots[by_slot]
    # Only the slots [lo, hi] the pairs use (a view): each group costs an mm, empty or not.
    lo, hi = int(slot_sorted[0]), int(slot_sorted[-1])
    offs = torch.bincount(slot_sorted - lo, minlength=hi - lo + 1).cumsum(0).to(torch.int32)
    h = x[by_slot // k]                                                     # [P, D]
    gate_up = F.grouped_mm(h, w13[lo:hi + 1].transpose(1, 2), offs=offs)    # [P, 2I]
    if b13 is not None:
        gate_up = gate_up + b13[slot_sorted]
    gate, up = gate_up.chunk(2, dim=-1)
    h = F.grouped_mm(_activate(gate, up, activation), w2[lo:hi + 1].transpose(1, 2), offs=offs)
    if b2 is not None:
        h = h + b2[slot_sorted]
    h = (h * topk_weights.reshape(-1)[by_slot, None].to(h.dtype)).to(x.dtype)
    # The loop adds each token's experts one at a time in id order, rounding to x's dtype
    # after each add (one index_add_ over repeated tokens would sum in float32 and round
    # once: other bits than HF's loop). So: back to pair order [T, k, D], each token's k rows
    # in id order, then k adds.
    # (One index_select of whole rows: take_along_dim broadcasts its index to [T, k, D] and
    # wraps it with a remainder, ~15 ms a layer for a 512-token chunk.)
    t = topk_ids.shape[0]
    by_id = topk_ids.argsort(dim=1, stable=True) + k * torch.arange(t, device=x.device)[:, None]
    rows = torch.empty_like(h).index_copy_(0, by_slot, h).index_select(0, by_id.reshape(-1))
    rows = rows.view(t, k, -1)
    out = rows[:, 0].clone()
    for j in range(1, k):
        out += rows[:, j]
    return out


# Autotune keys. Token counts map to a power-of-two bucket (capped), never the raw count, so
# the warmup ladder can visit every key. Up to _GEMV_MAX_TOKENS tokens the GEMV kernels run
# (BLOCK_M 0 in the key); a module global so a bench can move the crossover. Above it, up to
# _DECODE_MAX_TOKENS tokens, the grouped decode configs apply: BLOCK_M = 16 (tl.dot's
# minimum) and narrow, deep tiles that stream each active expert's weights once.
FUSED_MOE_TOKEN_BUCKETS = tuple(2 ** i for i in range(13))       # 1 .. 4096
_GEMV_MAX_TOKENS = 8
_DECODE_MAX_TOKENS = 64
_GROUP_M = 8              # M blocks (one expert's, mostly) walked together for L2 reuse
_PATHS = ("auto", "gemv", "grouped")


def _token_bucket(num_tokens: int) -> int:
    return min(1 << (max(1, num_tokens) - 1).bit_length(), FUSED_MOE_TOKEN_BUCKETS[-1])


def _moe_path(num_tokens: int) -> str:
    """The form fused_moe_triton runs for num_tokens tokens when not forced: "gemv" or "grouped"."""
    return "gemv" if num_tokens <= _GEMV_MAX_TOKENS else "grouped"


def _grouped_block_m(bucket: int, top_k: int, num_experts: int) -> int:
    if bucket <= _DECODE_MAX_TOKENS:
        return 16
    # Expected pairs per expert under uniform routing: keep most blocks full.
    per_expert = bucket * top_k / max(1, num_experts)
    return 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64


def fused_moe_autotune_keys(num_tokens: int, top_k: int, num_experts: int) -> tuple[int, int]:
    """The (token bucket, BLOCK_M) a call with num_tokens tokens autotunes under.

    BLOCK_M is 0 where the GEMV kernels run (their key is the bucket alone), else the grouped
    GEMMs' block height. With the model's hidden and expert widths and its dtype (the rest of
    the key, fixed per model), this is the whole autotune key of the kernels a call runs: a
    warmup that runs one forward per FUSED_MOE_TOKEN_BUCKETS entry, plus one of
    _GEMV_MAX_TOKENS tokens when that is not a power of two, covers every key a request can hit.
    """
    # Plain Python (no triton call), so the scheduler can plan its warmup anywhere.
    bucket = _token_bucket(num_tokens)
    if _moe_path(num_tokens) == "gemv":
        return bucket, 0
    return bucket, _grouped_block_m(bucket, top_k, num_experts)


@triton.jit
def _tile_ids(N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of this program; GROUP_M consecutive M blocks share each N tile's turn."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_m = tl.num_programs(0) // num_pid_n
    per_group = GROUP_M * num_pid_n
    first_m = pid // per_group * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    return pid_m, pid_n


@triton.jit
def _gated_act(gate, up, alpha, limit, ACTIVATION: tl.constexpr):
    """gate, up (x's dtype, any shape) -> act in x's dtype, rounded as _activate rounds."""
    if ACTIVATION == "swiglu_oai":
        g = tl.minimum(gate.to(tl.float32), limit)
        u = tl.minimum(tl.maximum(up.to(tl.float32), -limit), limit)
        act = ((u + 1.0) * g / (1.0 + tl.exp(-alpha * g))).to(gate.dtype)
    else:
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype) * up
    return act


@triton.jit(do_not_specialize=["num_pairs", "M_BUCKET"])
def _moe_gemm1_kernel(x_ptr, w13_ptr, b13_ptr, act_ptr, sorted_ids_ptr, block_slot_ptr,
                      num_padded_ptr, num_pairs, M_BUCKET, N, K, stride_xt, stride_ws, stride_wn,
                      stride_bs, stride_at, alpha, limit, TOP_K: tl.constexpr,
                      HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    # act[r, n] = act(x[tok(r)] . w13[slot, n] (+ b13[slot, n]), x[tok(r)] . w13[slot, N + n]
    # (+ b13[slot, N + n])) for the BLOCK_M padded rows r of one expert block and BLOCK_N of
    # the N = I columns. M_BUCKET only feeds the autotune key.
    pid_m, pid_n = _tile_ids(N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    slot = tl.load(block_slot_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    mask_m = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :]
    gate_ptrs = w13_ptr + slot * stride_ws + offs_n[None, :] * stride_wn + offs_k[:, None]
    up_ptrs = gate_ptrs + N * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w_mask = mask_k[:, None] & mask_n[None, :]
        acc_gate = tl.dot(a, tl.load(gate_ptrs, mask=w_mask, other=0.0), acc=acc_gate,
                          input_precision=DOT_PRECISION)
        acc_up = tl.dot(a, tl.load(up_ptrs, mask=w_mask, other=0.0), acc=acc_up,
                        input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    # Round as the reference does: linear outputs, then + bias, then the activation, in x's dtype.
    dtype = x_ptr.dtype.element_ty
    gate = acc_gate.to(dtype)
    up = acc_up.to(dtype)
    if HAS_BIAS:
        b_ptrs = b13_ptr + slot * stride_bs + offs_n
        gate = gate + tl.load(b_ptrs, mask=mask_n, other=0.0)[None, :]
        up = up + tl.load(b_ptrs + N, mask=mask_n, other=0.0)[None, :]
    act = _gated_act(gate, up, alpha, limit, ACTIVATION)
    tl.store(act_ptr + offs_m.to(tl.int64)[:, None] * stride_at + offs_n[None, :], act,
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["num_pairs", "M_BUCKET"])
def _moe_gemm2_kernel(act_ptr, w2_ptr, b2_ptr, out_ptr, sorted_ids_ptr, block_slot_ptr,
                      num_padded_ptr, topk_w_ptr, num_pairs, M_BUCKET, N, K, stride_at, stride_ws,
                      stride_wn, stride_bs, stride_ot, HAS_BIAS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # out[pair(r), n] = w(pair) * (act[r] . w2[slot, n] (+ b2[slot, n])) for N = D output
    # columns, K = I.
    pid_m, pid_n = _tile_ids(N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    slot = tl.load(block_slot_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    mask_m = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + offs_m.to(tl.int64)[:, None] * stride_at + offs_k[None, :]
    w_ptrs = w2_ptr + slot * stride_ws + offs_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, w, acc=acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    route_w = tl.load(topk_w_ptr + pair, mask=mask_m, other=0.0).to(dtype)
    y = acc.to(dtype)
    if HAS_BIAS:
        y = y + tl.load(b2_ptr + slot * stride_bs + offs_n, mask=mask_n, other=0.0)[None, :]
    y = y * route_w[:, None]
    tl.store(out_ptr + pair.to(tl.int64)[:, None] * stride_ot + offs_n[None, :], y,
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _moe_sum_kernel(pairs_ptr, out_ptr, D, stride_pt, stride_ot,
                    TOP_K: tl.constexpr, BLOCK_D: tl.constexpr):
    # Grid (T, cdiv(D, BLOCK_D)): out[t] = sum_j pairs[t * k + j], in float32.
    tok = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(pairs_ptr + (tok * TOP_K + j) * stride_pt + offs, mask=mask,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + tok * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _expert_slot(ids_ptr, slot_map_ptr, pair, HAS_SLOT_MAP: tl.constexpr):
    """The weight slot of pair's expert, int64 so that slot * stride_ws cannot overflow."""
    slot = tl.load(ids_ptr + pair)
    if HAS_SLOT_MAP:
        slot = tl.load(slot_map_ptr + slot)
    return slot.to(tl.int64)


@triton.jit(do_not_specialize=["M_BUCKET"])
def _moe_gemv1_kernel(x_ptr, w13_ptr, b13_ptr, act_ptr, ids_ptr, slot_map_ptr, M_BUCKET, N, K,
                      stride_xt, stride_ws, stride_wn, stride_bs, stride_at, alpha, limit,
                      TOP_K: tl.constexpr, HAS_SLOT_MAP: tl.constexpr, HAS_BIAS: tl.constexpr,
                      ACTIVATION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Grid (T*k pairs, cdiv(N, BLOCK_N)); N = I, K = D. act[p, n] = act(x[t] . w13[s, n]
    # (+ b13[s, n]), x[t] . w13[s, N + n] (+ b13[s, N + n])) for pair p = t*k + j, s the slot
    # of expert ids[p]. One row, so multiply-and-sum in float32 rather than tl.dot (which
    # pads to 16 rows).
    # M_BUCKET only feeds the autotune key.
    pair = tl.program_id(0)
    slot = _expert_slot(ids_ptr, slot_map_ptr, pair, HAS_SLOT_MAP)
    token = (pair // TOP_K).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token * stride_xt + offs_k
    gate_ptrs = w13_ptr + slot * stride_ws + offs_n[:, None] * stride_wn + offs_k[None, :]
    up_ptrs = gate_ptrs + N * stride_wn
    # [BLOCK_N, BLOCK_K] partial sums, reduced over K once after the loop.
    acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(x_ptrs, mask=mask_k, other=0.0).to(tl.float32)[None, :]
        w_mask = mask_n[:, None] & mask_k[None, :]
        acc_gate += a * tl.load(gate_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        acc_up += a * tl.load(up_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    # Round as the reference does: linear outputs, then + bias, then the activation, in x's dtype.
    dtype = x_ptr.dtype.element_ty
    gate = tl.sum(acc_gate, axis=1).to(dtype)
    up = tl.sum(acc_up, axis=1).to(dtype)
    if HAS_BIAS:
        b_ptrs = b13_ptr + slot * stride_bs + offs_n
        gate = gate + tl.load(b_ptrs, mask=mask_n, other=0.0)
        up = up + tl.load(b_ptrs + N, mask=mask_n, other=0.0)
    act = _gated_act(gate, up, alpha, limit, ACTIVATION)
    tl.store(act_ptr + pair.to(tl.int64) * stride_at + offs_n, act, mask=mask_n)


@triton.jit(do_not_specialize=["M_BUCKET"])
def _moe_gemv2_kernel(act_ptr, w2_ptr, b2_ptr, out_ptr, ids_ptr, slot_map_ptr, topk_w_ptr,
                      M_BUCKET, N, K, stride_at, stride_ws, stride_wn, stride_bs, stride_ot,
                      TOP_K: tl.constexpr, HAS_SLOT_MAP: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Grid (T, cdiv(N, BLOCK_N)); N = D, K = I. out[t, n] = sum_j w[t, j] * (act[t*k + j] .
    # w2[s_j, n] (+ b2[s_j, n])): the k terms are summed in float32 registers and stored
    # once, so the result is deterministic and needs no atomics, zeroed buffer or separate sum
    # kernel.
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    dtype = out_ptr.dtype.element_ty
    acc_out = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # A loop, not tl.static_range: unrolled over the k experts this needs 255 registers and
    # spills at BLOCK_N >= 16 (sm_90 ptxas, triton 3.9); as a loop every config below fits
    # in <= 160 registers without spills.
    for j in range(TOP_K):
        pair = token * TOP_K + j
        slot = _expert_slot(ids_ptr, slot_map_ptr, pair, HAS_SLOT_MAP)
        a_ptrs = act_ptr + pair.to(tl.int64) * stride_at + offs_k
        w_ptrs = w2_ptr + slot * stride_ws + offs_n[:, None] * stride_wn + offs_k[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask_k = offs_k < K - k0
            a = tl.load(a_ptrs, mask=mask_k, other=0.0).to(tl.float32)[None, :]
            w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            acc += a * w.to(tl.float32)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        # As _moe_gemm2_kernel: the linear output, then its weighted product, in dtype.
        route_w = tl.load(topk_w_ptr + pair).to(dtype)
        y = tl.sum(acc, axis=1).to(dtype)
        if HAS_BIAS:
            y = y + tl.load(b2_ptr + slot * stride_bs + offs_n, mask=mask_n, other=0.0)
        acc_out += (y * route_w).to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + offs_n, acc_out.to(dtype), mask=mask_n)


def _configs(block_n_k_warps_stages):
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
            for n, k, w, s in block_n_k_warps_stages]


# Decode: a few rows per expert, memory bound; narrow N tiles give enough programs to keep
# every SM streaming weights, deep K tiles and stages keep the loads in flight.
_DECODE_CONFIGS = _configs([(16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3),
                            (64, 128, 4, 4), (64, 64, 4, 5), (128, 64, 4, 4)])
# gemm1 holds two weight tiles per stage: stages * (BLOCK_M * BLOCK_K + 2 * BLOCK_K * BLOCK_N)
# * 2 bytes must fit sm_90's 227 KB of shared memory in bf16 at BLOCK_M 64.
_PREFILL_CONFIGS = _configs([(64, 64, 4, 4), (128, 64, 4, 4), (128, 64, 8, 3),
                             (64, 128, 4, 3), (128, 128, 8, 2)])
# GEMV: one row per program, memory bound. At batch 1 GEMV2 has only D / BLOCK_N programs
# (2048 / 16 = 128 < 132 SMs on an H200), hence N tiles down to 4; long K tiles put more
# contiguous bytes of each weight row in flight per load. num_stages matters only where
# triton's pipeliner takes loads that feed no tl.dot (triton 3.9 does not: no shared memory
# staging in the sm_90 build).
_GEMV_CONFIGS = _configs([(4, 256, 2, 2), (4, 512, 4, 2), (8, 256, 4, 2), (8, 512, 8, 2),
                          (16, 128, 4, 3), (16, 256, 8, 2), (32, 128, 8, 3), (32, 64, 4, 3)])
_INTERPRETER_CONFIG = dict(BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1)
_FIXED_GPU_CONFIG = dict(BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=3)   # valid for every form
_AUTOTUNE_KEY = ["M_BUCKET", "BLOCK_M", "N", "K"]     # + the tensors' dtypes, added by triton
_GEMV_AUTOTUNE_KEY = ["M_BUCKET", "N", "K"]
# Autotune results persist in triton's cache dir where triton supports it (>= 3.4).
_CACHE = ({"cache_results": True}
          if "cache_results" in inspect.signature(triton.autotune).parameters else {})
_GEMM1 = {decode: triton.autotune(configs=cfgs, key=_AUTOTUNE_KEY, **_CACHE)(_moe_gemm1_kernel)
          for decode, cfgs in ((True, _DECODE_CONFIGS), (False, _PREFILL_CONFIGS))}
_GEMM2 = {decode: triton.autotune(configs=cfgs, key=_AUTOTUNE_KEY, **_CACHE)(_moe_gemm2_kernel)
          for decode, cfgs in ((True, _DECODE_CONFIGS), (False, _PREFILL_CONFIGS))}
_GEMV1 = triton.autotune(configs=_GEMV_CONFIGS, key=_GEMV_AUTOTUNE_KEY, **_CACHE)(
    _moe_gemv1_kernel)
_GEMV2 = triton.autotune(configs=_GEMV_CONFIGS, key=_GEMV_AUTOTUNE_KEY, **_CACHE)(
    _moe_gemv2_kernel)


def _launch(kernel, tuned, grid, args: tuple, **kwargs):
    """grid(BLOCK_N) -> launch grid. Autotuned on a GPU; one fixed config under the
    interpreter, which cannot tune, and inside fixed_configs_scope()."""
    if fixed_configs():
        config = _INTERPRETER_CONFIG if interpreting() else _FIXED_GPU_CONFIG
        kernel[grid(config["BLOCK_N"])](*args, **kwargs, **config)
    else:
        tuned[lambda meta: grid(meta["BLOCK_N"])](*args, **kwargs)


def fused_moe_triton(x, w13, w2, topk_weights, topk_ids, slot_map=None, *, b13=None, b2=None,
                     activation: MoeActivation = SILU, path="auto"):
    """path: "auto" runs _moe_path(T)'s form; "gemv" or "grouped" forces one (benchmarks)."""
    _check_moe_args(x, w13, w2, topk_weights, topk_ids, slot_map, b13, b2, activation)
    if path not in _PATHS:
        raise ValueError(f"fused_moe: path must be one of {_PATHS}, got {path!r}")
    out = torch.empty_like(x)
    t = x.shape[0]
    if t == 0:
        return out
    if path == "auto":
        path = _moe_path(t)
    run = _fused_moe_gemv if path == "gemv" else _fused_moe_grouped
    run(x, w13, w2, topk_weights, topk_ids, slot_map, out, _Epilogue.of(x, b13, b2, activation))
    return out


@dataclasses.dataclass(frozen=True)
class _Epilogue:
    """The bias and activation arguments both forms pass their kernels. Without a bias the
    kernels never read the pointer (HAS_BIAS=False); x stands in for it."""
    b13: torch.Tensor
    b2: torch.Tensor
    stride_b13: int
    stride_b2: int
    has_b13: bool
    has_b2: bool
    activation: MoeActivation

    @staticmethod
    def of(x, b13, b2, activation):
        return _Epilogue(x if b13 is None else b13, x if b2 is None else b2,
                         0 if b13 is None else b13.stride(0), 0 if b2 is None else b2.stride(0),
                         b13 is not None, b2 is not None, activation)

    def act_args(self):
        return self.activation.alpha, self.activation.limit


def _fused_moe_gemv(x, w13, w2, topk_weights, topk_ids, slot_map, out, epi):
    t, d = x.shape
    inter = w2.shape[2]
    top_k = topk_ids.shape[1]
    num_pairs = t * top_k
    bucket = _token_bucket(t)
    ids = topk_ids.reshape(-1)                    # [T*k], pair p = t*k + j
    # Without a slot map the kernels never read slot_map_ptr; ids stands in for it.
    slots = ids if slot_map is None else slot_map
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _launch(_moe_gemv1_kernel, _GEMV1, lambda block_n: (num_pairs, triton.cdiv(inter, block_n)),
            (x, w13, epi.b13, act, ids, slots, bucket, inter, d, x.stride(0), w13.stride(0),
             w13.stride(1), epi.stride_b13, act.stride(0), *epi.act_args()),
            TOP_K=top_k, HAS_SLOT_MAP=slot_map is not None, HAS_BIAS=epi.has_b13,
            ACTIVATION=epi.activation.kind)
    _launch(_moe_gemv2_kernel, _GEMV2, lambda block_n: (t, triton.cdiv(d, block_n)),
            (act, w2, epi.b2, out, ids, slots, topk_weights.reshape(-1), bucket, d, inter,
             act.stride(0), w2.stride(0), w2.stride(1), epi.stride_b2, out.stride(0)),
            TOP_K=top_k, HAS_SLOT_MAP=slot_map is not None, HAS_BIAS=epi.has_b2)


def _fused_moe_grouped(x, w13, w2, topk_weights, topk_ids, slot_map, out, epi):
    t, d = x.shape
    inter = w2.shape[2]
    top_k = topk_ids.shape[1]
    num_experts = w13.shape[0] if slot_map is None else slot_map.shape[0]
    bucket = _token_bucket(t)
    block_m = _grouped_block_m(bucket, top_k, num_experts)
    decode = bucket <= _DECODE_MAX_TOKENS
    sorted_ids, block_slot, num_padded = moe_align(topk_ids, num_experts, block_m, slot_map)
    max_blocks = block_slot.shape[0]
    num_pairs = t * top_k
    # fp32 (tests) gets exact products; fp16/bf16 take the backend's default.
    precision = "ieee" if x.dtype == torch.float32 else None
    # act rows follow the sorted, padded order, so GEMM2 reads them without a gather.
    act = torch.empty(max_blocks * block_m, inter, dtype=x.dtype, device=x.device)
    _launch(_moe_gemm1_kernel, _GEMM1[decode],
            lambda block_n: (max_blocks * triton.cdiv(inter, block_n),),
            (x, w13, epi.b13, act, sorted_ids, block_slot, num_padded, num_pairs, bucket, inter,
             d, x.stride(0), w13.stride(0), w13.stride(1), epi.stride_b13, act.stride(0),
             *epi.act_args()),
            TOP_K=top_k, HAS_BIAS=epi.has_b13, ACTIVATION=epi.activation.kind, BLOCK_M=block_m,
            GROUP_M=_GROUP_M, DOT_PRECISION=precision)
    # Each pair's weighted output gets its own row, summed per token afterwards, rather than
    # atomically added into a float32 [T, D] buffer: the result is deterministic, nothing
    # needs zeroing (autotune reruns are harmless), and no extra float32 -> dtype pass runs;
    # the T*k*D round trip is small next to the expert weights streamed.
    pairs = out if top_k == 1 else torch.empty(num_pairs, d, dtype=x.dtype, device=x.device)
    _launch(_moe_gemm2_kernel, _GEMM2[decode],
            lambda block_n: (max_blocks * triton.cdiv(d, block_n),),
            (act, w2, epi.b2, pairs, sorted_ids, block_slot, num_padded,
             topk_weights.contiguous(), num_pairs, bucket, d, inter, act.stride(0), w2.stride(0),
             w2.stride(1), epi.stride_b2, pairs.stride(0)),
            HAS_BIAS=epi.has_b2, BLOCK_M=block_m, GROUP_M=_GROUP_M, DOT_PRECISION=precision)
    if top_k > 1:
        block_d = min(triton.next_power_of_2(d), 1024)
        _moe_sum_kernel[(t, triton.cdiv(d, block_d))](
            pairs, out, d, pairs.stride(0), out.stride(0), TOP_K=top_k, BLOCK_D=block_d,
            num_warps=4)


def _check_moe_args(x, w13, w2, topk_weights, topk_ids, slot_map, b13=None, b2=None,
                    activation=SILU):
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fused_moe: x [T, D], w13 [S, 2I, D], w2 [S, D, I] expected, got "
                         f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    t, d = x.shape
    s, two_i, _ = w13.shape
    if w13.shape[2] != d or two_i % 2 or tuple(w2.shape) != (s, d, two_i // 2):
        raise ValueError(f"fused_moe: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit "
                         f"hidden size {d} (w13 [S, 2I, {d}], w2 [S, {d}, I])")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"fused_moe: weights {w13.dtype}/{w2.dtype} must match x {x.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"fused_moe: topk_ids and topk_weights must be [{t}, k], got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64) or not topk_weights.is_floating_point():
        raise ValueError(f"fused_moe: topk_ids must be int32/int64 and topk_weights float, got "
                         f"{topk_ids.dtype} and {topk_weights.dtype}")
    if slot_map is not None and (slot_map.dim() != 1 or slot_map.dtype not in (torch.int32,
                                                                                 torch.int64)):
        raise ValueError(f"fused_moe: slot_map must be a 1-d int tensor, got "
                         f"{tuple(slot_map.shape)} {slot_map.dtype}")
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("fused_moe: x, w13 and w2 need a contiguous last dimension")
    for name, bias, shape in (("b13", b13, (s, two_i)), ("b2", b2, (s, d))):
        if bias is not None and (tuple(bias.shape) != shape or bias.dtype != x.dtype
                                 or bias.stride(1) != 1):
            raise ValueError(f"fused_moe: {name} must be {list(shape)} {x.dtype} with a contiguous "
                             f"last dimension, got {tuple(bias.shape)} {bias.dtype}")
    if not isinstance(activation, MoeActivation):
        raise ValueError(f"fused_moe: activation must be a MoeActivation, got {activation!r}")


def fused_moe(x, w13, w2, topk_weights, topk_ids, slot_map=None, *, b13=None, b2=None,
              activation: MoeActivation = SILU):
    op = (fused_moe_triton if use_triton(x)
          and not isinstance(w13, (Fp16Bank, NativeBank, NativeFp8Bank, NativeInt4Bank))
          else fused_moe_reference)
    return op(x, w13, w2, topk_weights, topk_ids, slot_map, b13=b13, b2=b2, activation=activation)
