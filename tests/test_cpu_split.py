"""The CPU engine's second core (triton_kernels/cpu_split.py): a call's work halved by rows,
one half on a helper thread whose OpenMP team is one thread, the results in order, the
caller's thread count back; the experts of a prefill chunk through it give the same bits."""

import threading

import pytest
import torch

import triton_kernels as tk
from triton_kernels.cpu_split import _halfway
from tiny_fixtures import biased_experts
from triton_kernels.fused_moe import SILU, SWIGLU_OAI, fused_moe_reference


@pytest.fixture
def two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


def test_halfway_cuts_by_weight():
    assert _halfway([1, 1, 1, 1]) == 2
    assert _halfway([10, 1, 1, 1]) == 1
    assert _halfway([1, 1, 1, 10]) == 3
    assert _halfway([5]) in (0, 1) and _halfway([]) == 0


def test_map_runs_half_on_the_helper_in_order(two_threads):
    split = tk.CpuSplit()
    try:
        assert torch.get_num_threads() == 2                 # the helper's setup set it back
        seen = []

        def work(part):
            seen.append((threading.current_thread().name, torch.get_num_threads(), list(part)))
            return [v * 10 for v in part]

        assert split.map(work, list(range(6)), [1, 1, 1, 1, 1, 5]) == [0, 10, 20, 30, 40, 50]
        assert torch.get_num_threads() == 2
        by_thread = {name.startswith("ft-cpu-split"): (n, part) for name, n, part in seen}
        assert by_thread == {False: (1, [0, 1, 2, 3, 4]), True: (1, [5])}
        # One item, or a caller on one thread: no split.
        seen.clear()
        assert split.map(work, [7], [3]) == [70] and len(seen) == 1
        torch.set_num_threads(1)
        seen.clear()
        assert split.map(work, [1, 2], [1, 1]) == [10, 20]
        assert [name for name, _, _ in seen] == [threading.current_thread().name]
        # An error in either half reaches the caller, its thread count restored.
        torch.set_num_threads(2)

        def fails(part):
            if 9 in part:
                raise ValueError("bad half")
            return part
        with pytest.raises(ValueError, match="bad half"):
            split.map(fails, [1, 9], [1, 1])
        assert torch.get_num_threads() == 2
    finally:
        split.close()


@pytest.mark.parametrize("act", [SILU, SWIGLU_OAI], ids=lambda a: a.kind)
@pytest.mark.parametrize("t", [1, 15, 40])
def test_split_experts_give_the_same_bits(two_threads, act, t):
    # Packed banks with and without a split, slots mapped and biased: equal outputs, and
    # the split taken from its min_flops (here 32 pairs' work) on, never at batch 1.
    c = biased_experts(5, t)
    x, w13, w2, weights, ids, slot_map = (c[n] for n in ("x", "w13", "w2", "weights", "ids", "slot_map"))
    b13, b2 = c["b13"], c["b2"]
    (_, d), i, k = x.shape, w2.shape[2], ids.shape[1]
    pair_flops = 2 * (2 * i * d + d * i)
    split = tk.CpuSplit(min_flops=32 * pair_flops)
    calls = []
    real_map = split.map
    split.map = lambda *a: calls.append(1) or real_map(*a)
    try:
        kw = dict(b13=b13, b2=b2, activation=act)
        one = fused_moe_reference(x, tk.Fp16Bank(w13), tk.Fp16Bank(w2), weights, ids, slot_map, **kw)
        two = fused_moe_reference(x, tk.Fp16Bank(w13, split), tk.Fp16Bank(w2, split), weights,
                                  ids, slot_map, **kw)
        assert torch.equal(one, two)
        assert bool(calls) == (t * k >= 32)
    finally:
        split.close()


def test_freed_host_memory_keeps_its_pages():
    # After keep_freed_heap (what every engine sets when it starts), blocks of a CPU
    # forward's sizes (24 MB, 24 MB, 4 MB: torch's CPU allocator is glibc's malloc) freed and
    # allocated again reuse the heap's pages. Without it glibc maps and trims them each time
    # (~130k page faults over these 10 rounds).
    import ctypes
    import resource

    from freetoken.utils.heap import keep_freed_heap
    if not keep_freed_heap():
        pytest.skip("no glibc mallopt here")
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    sizes = (24 << 20, 24 << 20, 4 << 20)

    def one_forward():
        blocks = [libc.malloc(n) for n in sizes]
        for p, n in zip(blocks, sizes):
            libc.memset(p, 1, n)
        for p in blocks:
            libc.free(p)
    one_forward()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        one_forward()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before < 1000


def _huge_kb() -> int:
    """This process's anonymous memory on huge pages, kB (0: no smaps_rollup)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            return sum(int(line.split()[1]) for line in f if line.startswith("AnonHugePages"))
    except OSError:
        return 0


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read()
    except OSError:
        return "[never]"


def test_weights_go_on_huge_pages():
    # A tensor advised before it is written (as the runner advises the weights before
    # loading) and one written first: after the collapse (as the runner runs it over every
    # weight once packing is done) both sit on 2 MB pages where the kernel has THP, with
    # their values; small ones are left alone. (An advised tensor whose pages the heap had
    # touched before gets its huge pages only from the collapse.)
    from freetoken.utils.heap import huge_pages
    if "[never]" in _thp_mode():
        pytest.skip("transparent huge pages are off here")
    before = _huge_kb()
    fresh = torch.empty(16 << 20, dtype=torch.uint8)
    assert huge_pages([fresh, fresh[:100]]) >= 12 << 20        # its whole 2 MB pages, once
    fresh.fill_(3)
    written = torch.arange(4 << 20, dtype=torch.float32)       # 16 MB, touched 4 KB at a time
    want = written.clone()
    got = huge_pages([fresh, written], collapse=True)
    if got == 0:
        pytest.skip("no MADV_COLLAPSE (Linux < 6.1) or the kernel refused")
    assert got >= 24 << 20 and torch.equal(written, want) and bool((fresh == 3).all())
    assert _huge_kb() - before >= 24 << 10                     # both tensors' pages, kB
    assert huge_pages([torch.empty(1 << 19)]) == 0              # 2 MB, under 4: left alone


def test_banks_of_threaded_experts_are_not_split(two_threads):
    # Experts of 1M weights and more take FBGEMM's threaded entry point, on every core
    # already: the split leaves them alone (on a many-core box it would cap them at two).
    g = torch.Generator().manual_seed(6)
    d, i, pool = 1024, 512, 2
    w13 = (torch.randn(pool, 2 * i, d, generator=g) * d ** -0.5).bfloat16()
    w2 = (torch.randn(pool, d, i, generator=g) * i ** -0.5).bfloat16()
    split = tk.CpuSplit(min_flops=0)
    calls = []
    real_map = split.map
    split.map = lambda *a: calls.append(1) or real_map(*a)
    try:
        b13, b2 = tk.Fp16Bank(w13, split), tk.Fp16Bank(w2, split)
        assert b13.threaded and not b2.threaded
        assert b13.split is None and b2.split is split
        x = torch.randn(8, d, generator=g).bfloat16()
        ids = torch.tensor([[0, 1]] * 8)
        weights = torch.full((8, 2), 0.5)
        out = fused_moe_reference(x, b13, b2, weights, ids)
        assert not calls
        assert torch.equal(out, fused_moe_reference(x, tk.Fp16Bank(w13), tk.Fp16Bank(w2),
                                                    weights, ids))
    finally:
        split.close()
