"""Keep freed host memory in the process's heap instead of handing it back to the kernel.

A CPU forward allocates and frees tensors of megabytes every layer (a prefill chunk of 512
tokens: the experts' [T*k, D] float32 gather, their outputs, the weighted sum; 16 MB each).
glibc serves allocations above its mmap threshold (128 KB, raised on the fly to the largest
freed chunk, at most 32 MB) with fresh mmaps and trims freed heap tops past 2x that: every
such tensor is then new pages, faulted in one at a time. Measured on the 2-core EPYC, one
prefill of 512 tokens through the bench model: 150k page faults, ~0.4 s of kernel time,
330-405 tok/s; with the threshold pinned at glibc's ceiling and trimming off: ~70 faults,
460-495 tok/s. The cost is that the heap keeps its high-water mark (the transient tensors'
peak, which the next forward allocates again).

mallopt is process-wide, like torch's thread count; a CPU engine's runner sets it when it
starts.

The weights a CPU forward streams go on 2 MB pages (huge_pages, after loading): every decode
step reads the active experts and the dense part, hundreds of MB over 4 KB pages, a TLB miss
every page. Measured on a 2-core Xeon (bench model, bf16), two A/Bs an hour apart: a batch-1
step 16.9 -> 15.2 and 15.5 -> 15.0 ms, batch 8 58 -> 52.5 and 54.4 -> 52.7, prefill +5-10%;
loading 1.5 -> 3.8 s (the kernel's huge-page faults: ~2 s a GB more). torch allocates without MADV_HUGEPAGE, and where THP is
"madvise" (a common default) nothing gets huge pages unless asked. A GPU engine leaves it: host expert banks under 32 MB would then share heap pages,
and page-locking one in place (cudaHostRegister) can refuse a page already registered.
Elsewhere than glibc (musl, macOS) it is left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3     # glibc's malloc.h
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25             # linux/mman.h (MADV_COLLAPSE: Linux 6.1)
HUGE_PAGE = 2 << 20
MMAP_THRESHOLD = 32 << 20                       # glibc's ceiling on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = (1 << 31) - 1                  # an int: trim only past 2 GB of free heap top


def keep_freed_heap() -> bool:
    """Pin glibc's mmap threshold at its ceiling and its trim threshold out of reach; True
    where that took (glibc), False where there is no glibc mallopt."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if not hasattr(libc, "gnu_get_libc_version"):
            return False
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    except (OSError, AttributeError):
        return False
    if not ok:
        log.debug("mallopt refused the heap thresholds; freed tensors go back to the kernel")
    return bool(ok)


def huge_pages(tensors, collapse: bool = False) -> int:
    """Back the CPU tensors' memory with 2 MB pages: each storage's whole 2 MB pages, storages
    of 4 MB and more, each once. MADV_HUGEPAGE alone serves pages not yet touched (weights
    before they are loaded: their first write faults in huge pages, nothing copied);
    collapse: also MADV_COLLAPSE, which moves pages already written there now (a copy,
    ~0.4 GB/s on a 2-core Xeon; next to nothing where they are huge already). Returns the
    bytes advised (collapse: the bytes now on huge pages); 0 where the kernel has no THP,
    is older than 6.1 (collapse), or refuses: the tensors stay as they were, same values."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    seen, done = set(), 0
    for t in tensors:
        if t.device.type != "cpu":
            continue
        storage = t.untyped_storage()
        ptr, size = storage.data_ptr(), storage.nbytes()
        if ptr in seen or size < 2 * HUGE_PAGE:
            continue
        seen.add(ptr)
        start = (ptr + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
        length = ((ptr + size) & ~(HUGE_PAGE - 1)) - start
        if (length > 0 and madvise(start, length, MADV_HUGEPAGE) == 0
                and (not collapse or madvise(start, length, MADV_COLLAPSE) == 0)):
            done += length
    return done
