"""KeepResident: runs on its interval, advises every file, survives a vanished file, stops,
and never blocks the event loop."""

import asyncio
import os
import time

from freetoken.utils.prefetch import KeepResident, advise_willneed, prefetch_checkpoint, resident_pages


def _files(tmp_path, n=3, size=1 << 20):
    out = []
    for i in range(n):
        p = tmp_path / f"model-{i}.safetensors"
        p.write_bytes(os.urandom(size))
        out.append(p)
    return out


def test_passes_advise_every_file_and_survive_vanished_file(tmp_path):
    files = _files(tmp_path)
    seen = []

    def advise(path):
        seen.append(path.name)
        return advise_willneed(path)

    t = KeepResident(files, interval_s=0.05, advise=advise)
    t.start()
    deadline = time.monotonic() + 5
    while t.passes < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert t.passes >= 2
    assert {f.name for f in files} <= set(seen)
    files[1].unlink()
    before = t.passes
    while t.passes < before + 2 and time.monotonic() < deadline + 5:
        time.sleep(0.01)
    assert t.passes >= before + 2 and t.is_alive()
    resident, total = t.last_resident
    assert total == 2 * 256 and resident <= total      # 2 remaining files of 256 pages
    t.stop()
    assert not t.is_alive()


def test_willneed_makes_pages_resident(tmp_path):
    (f,) = _files(tmp_path, n=1)
    fd = os.open(f, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    advise_willneed(f)
    deadline = time.monotonic() + 5
    while resident_pages(f)[0] < resident_pages(f)[1] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert resident_pages(f)[0] == resident_pages(f)[1] == 256


def test_event_loop_not_blocked(tmp_path):
    files = _files(tmp_path, n=4, size=8 << 20)
    thread = prefetch_checkpoint(tmp_path, keep_resident_s=0.01)
    assert thread is not None

    async def max_lag():
        worst, last = 0.0, time.perf_counter()
        for _ in range(100):
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            worst, last = max(worst, now - last - 0.005), now
        return worst

    lag = asyncio.run(max_lag())
    passes = thread.passes
    thread.stop()
    assert passes >= 3 and len(files) == 4
    assert lag < 0.25, f"event loop stalled {lag:.3f}s"


def test_interval_zero_disables(tmp_path):
    _files(tmp_path, n=1)
    assert prefetch_checkpoint(tmp_path, keep_resident_s=0) is None
