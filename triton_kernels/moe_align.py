"""Sort a MoE layer's (token, k) pairs by expert, padded per expert to the GEMM block height.

topk_ids [T, k] -> sorted_ids (pair indices grouped by expert, each expert's list padded to a
multiple of BLOCK_M with the sentinel T*k), block_slot (the weight slot each M block reads)
and num_padded, in three small kernels and without a host sync: the grouped path of
fused_moe.py tiles its GEMMs over these blocks.
"""

import torch

from triton_kernels._dispatch import tl, triton

_ALIGN_CHUNK = 128        # pairs per program in the align kernels


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_count_kernel(ids_ptr, chunk_counts_ptr, num_pairs,
                      BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    # Grid (num_chunks,): histogram of the experts of CHUNK pairs -> chunk_counts[chunk, :].
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    expert = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
    offs_e = tl.arange(0, BLOCK_E)
    hist = tl.sum((expert[:, None] == offs_e[None, :]).to(tl.int32), axis=0)
    tl.store(chunk_counts_ptr + chunk * BLOCK_E + offs_e, hist)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "max_blocks"])
def _moe_offsets_kernel(chunk_counts_ptr, chunk_base_ptr, expert_start_ptr, sorted_ids_ptr,
                        block_slot_ptr, num_padded_ptr, slot_map_ptr,
                        num_pairs, num_chunks, max_blocks, HAS_SLOT_MAP: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
                        BLOCK_B: tl.constexpr):
    # One program. chunk_base[c, e] = pairs of expert e in chunks before c; each expert's
    # padded list starts at expert_start[e]; its tail is filled with the sentinel num_pairs;
    # block_slot[j] = the weight slot of the expert owning M block j.
    offs_e = tl.arange(0, BLOCK_E)
    total = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        ptrs = offs_c[:, None] * BLOCK_E + offs_e[None, :]
        mask = (offs_c < num_chunks)[:, None]
        counts = tl.load(chunk_counts_ptr + ptrs, mask=mask, other=0)
        tl.store(chunk_base_ptr + ptrs, total[None, :] + tl.cumsum(counts, axis=0) - counts,
                 mask=mask)
        total += tl.sum(counts, axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    num_padded = tl.sum(padded, axis=0)
    tl.store(expert_start_ptr + offs_e, start)
    tl.store(num_padded_ptr, num_padded)
    pos = (start + total)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_ids_ptr + pos, tl.zeros_like(pos) + num_pairs, mask=pos < end[:, None])
    for b0 in range(0, max_blocks, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        # The owner of block j is the first expert whose padded list ends after j * BLOCK_M.
        expert = tl.sum((end[None, :] <= offs_b[:, None] * BLOCK_M).to(tl.int32), axis=1)
        valid = offs_b * BLOCK_M < num_padded
        if HAS_SLOT_MAP:
            slot = tl.load(slot_map_ptr + expert, mask=valid, other=0).to(tl.int32)
        else:
            slot = expert
        tl.store(block_slot_ptr + offs_b, tl.where(valid, slot, 0), mask=offs_b < max_blocks)


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_scatter_kernel(ids_ptr, chunk_base_ptr, expert_start_ptr, sorted_ids_ptr, num_pairs,
                        BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    # Grid (num_chunks,): pair p goes to expert_start[e] + chunk_base[chunk, e] + its rank
    # among the chunk's earlier pairs of e, so each expert's list keeps token order (stable).
    chunk = tl.program_id(0)
    offs_i = tl.arange(0, CHUNK)
    offs = chunk * CHUNK + offs_i
    mask = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=mask, other=-1).to(tl.int32)
    earlier = (expert[:, None] == expert[None, :]) & (offs_i[None, :] < offs_i[:, None])
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    base = tl.load(chunk_base_ptr + chunk * BLOCK_E + expert, mask=mask, other=0)
    start = tl.load(expert_start_ptr + expert, mask=mask, other=0)
    tl.store(sorted_ids_ptr + start + base + rank, offs, mask=mask)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
              slot_map: torch.Tensor | None):
    """Sort pairs by expert, padded per expert to BLOCK_M, without a host sync.

    Returns (sorted_ids [max_blocks * BLOCK_M] int32: pair index or the sentinel T*k,
    block_slot [max_blocks] int32: weight slot per M block, num_padded [1] int32: blocks in
    use times BLOCK_M). max_blocks bounds the padded length from host-side sizes: every
    active expert (at most min(E, T*k)) wastes at most BLOCK_M - 1 rows.
    """
    ids = topk_ids.reshape(-1)
    num_pairs = ids.numel()
    dev = ids.device
    block_e = triton.next_power_of_2(num_experts)
    num_chunks = triton.cdiv(num_pairs, _ALIGN_CHUNK)
    max_blocks = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    chunk_counts = torch.empty(num_chunks, block_e, dtype=torch.int32, device=dev)
    chunk_base = torch.empty_like(chunk_counts)
    expert_start = torch.empty(block_e, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    block_slot = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    _moe_count_kernel[(num_chunks,)](ids, chunk_counts, num_pairs,
                                     BLOCK_E=block_e, CHUNK=_ALIGN_CHUNK, num_warps=4)
    _moe_offsets_kernel[(1,)](
        chunk_counts, chunk_base, expert_start, sorted_ids, block_slot, num_padded,
        block_slot if slot_map is None else slot_map, num_pairs, num_chunks, max_blocks,
        HAS_SLOT_MAP=slot_map is not None, BLOCK_M=block_m, BLOCK_E=block_e,
        BLOCK_C=max(1, 4096 // block_e), BLOCK_B=max(1, 4096 // block_e), num_warps=4)
    _moe_scatter_kernel[(num_chunks,)](ids, chunk_base, expert_start, sorted_ids, num_pairs,
                                       BLOCK_E=block_e, CHUNK=_ALIGN_CHUNK, num_warps=4)
    return sorted_ids, block_slot, num_padded
