"""Copy experts from the host store into slots of the device pool.

On CUDA every copy runs on one dedicated copy stream, so fetches overlap the compute stream's
kernels: each layer's misses are enqueued as one batch (behind a wait on the compute stream,
so a slot is never overwritten while an earlier kernel still reads it) and closed by one event
that the compute stream waits on before the layer's MoE kernel. Pinned banks are copied by DMA
straight into their slots; experts of unpinned layers first go through a small ring of pinned
staging buffers (host memcpy, then DMA), each buffer reused only once its last copy is done.
On the CPU the same calls are plain copies and there are no streams or events.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import torch

from freetoken.moe.store import ExpertStore

STAGING_BYTES = 64 * 2 ** 20     # the ring holds about this much, and 2..16 experts


@dataclasses.dataclass
class _StagingBuffer:
    parts: dict[str, torch.Tensor]  # one expert: {name: [*shape]} per the layout
    done: object = None             # torch.cuda.Event of the last copy out of it, or None


class ExpertFetcher:
    def __init__(self, store: ExpertStore, pool: dict[str, torch.Tensor],
                 force_staging: bool = False):
        """pool: the device slot pool {name: [S, *shape]}; force_staging: route every layer
        through the ring (tests run it on the CPU)."""
        self.store, self.pool = store, pool
        self.device = next(iter(pool.values())).device
        self.is_cuda = self.device.type == "cuda"
        self.force_staging = force_staging
        self.stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self.event = None            # recorded after the latest batch
        self._ring: list[_StagingBuffer] = []
        self._next = 0
        self.num_experts_copied = 0
        self.bytes_copied = 0
        self.num_staged = 0
        # Achieved rate: bytes of finished batches / the copy stream's busy time for them.
        self._timed = collections.deque()     # (start event, end event, bytes), CUDA only
        self.busy_s = 0.0
        self.timed_bytes = 0

    def fetch(self, layer: int, moves: list[tuple[int, int]]) -> None:
        """Enqueue copies of layer's experts into slots: moves = [(expert, slot)]."""
        if not moves:
            return
        bank = self.store.bank(layer)
        staged = self.force_staging or (self.is_cuda and not self.store.pinned[layer])
        nbytes = len(moves) * self.store.expert_bytes
        if self.is_cuda:
            self._drain_timed()         # keeps the deque to the few batches in flight
            compute = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self.stream):
                self.stream.wait_stream(compute)
                start = torch.cuda.Event(enable_timing=True)
                start.record(self.stream)
                self._copy(bank, moves, staged)
                self.event = torch.cuda.Event(enable_timing=True)
                self.event.record(self.stream)
            self._timed.append((start, self.event, nbytes))
        else:
            t0 = time.perf_counter()
            self._copy(bank, moves, staged)
            self.busy_s += time.perf_counter() - t0
            self.timed_bytes += nbytes
        self.num_experts_copied += len(moves)
        self.bytes_copied += nbytes

    def _copy(self, bank, moves, staged: bool) -> None:
        nb = self.is_cuda
        for expert, slot in moves:
            if staged:
                buf = self._staging_buffer()
                for name, part in buf.parts.items():
                    part.copy_(bank[name][expert])
                    self.pool[name][slot].copy_(part, non_blocking=nb)
                if nb:
                    buf.done = torch.cuda.Event()
                    buf.done.record(self.stream)
                self.num_staged += 1
            else:
                for name, dst in self.pool.items():
                    dst[slot].copy_(bank[name][expert], non_blocking=nb)

    def _staging_buffer(self) -> _StagingBuffer:
        if not self._ring:
            s = self.store
            n = max(2, min(16, STAGING_BYTES // s.expert_bytes))
            pin = self.is_cuda
            self._ring = [_StagingBuffer({name: t[0] for name, t in
                                          s.layout.empty(1, pin_memory=pin).items()})
                          for _ in range(n)]
        buf = self._ring[self._next]
        self._next = (self._next + 1) % len(self._ring)
        if buf.done is not None:
            buf.done.synchronize()     # its previous DMA must finish before it is overwritten
            buf.done = None
        return buf

    def _drain_timed(self) -> None:
        """Fold the finished batches (in order: one stream) into busy_s and timed_bytes."""
        while self._timed and self._timed[0][1].query():
            start, end, nbytes = self._timed.popleft()
            self.busy_s += start.elapsed_time(end) / 1e3
            self.timed_bytes += nbytes

    def achieved_gbps(self) -> float | None:
        """GB/s over the batches finished so far (None before any): what the copies reached."""
        self._drain_timed()
        return self.timed_bytes / self.busy_s / 1e9 if self.busy_s > 0 else None

    def reset_counters(self) -> None:
        self.num_experts_copied = self.bytes_copied = self.num_staged = self.timed_bytes = 0
        self.busy_s = 0.0
        self._timed.clear()

    @property
    def staging_bytes(self) -> int:
        return sum(t.nbytes for b in self._ring for t in b.parts.values())

    def wait(self) -> None:
        """Make the compute stream wait for every copy enqueued so far."""
        self.wait_for(self.event)
        self.event = None

    def wait_for(self, event) -> None:
        """Make the compute stream wait for the copies up to `event` (a batch's, from
        `self.event` right after its fetch; None: nothing to wait for). The waves of one layer
        wait each for their own batch, not for the next wave's copies behind it."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
