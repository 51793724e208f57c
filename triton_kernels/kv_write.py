"""Write new keys and values into the paged KV cache.

k, v: [T, Hk, D]; k_cache, v_cache: [NB, BS, Hk, D] (NB blocks of BS token slots);
slot_mapping: [T] int64 flat slot index (block * BS + offset) per token; -1 skips a token.
"""

import torch

from triton_kernels._dispatch import use_triton


def write_kv_reference(k, v, k_cache, v_cache, slot_mapping):
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


def write_kv(k, v, k_cache, v_cache, slot_mapping):
    if use_triton(k):
        return write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    return write_kv_reference(k, v, k_cache, v_cache, slot_mapping)
