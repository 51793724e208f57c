"""AsyncEngine: the continuous-batching loop as a task on the server's event loop.

Requests are submitted from HTTP handlers and get a RequestStream to iterate. While there is
work the loop plans a step (EngineCore.plan_step: schedule, chunks, sampling rows), awaits its
forward and sampler on the engine thread (run_step), and finishes it (finish_step: tokens,
stop checks, text), then hands each request its deltas. The event loop keeps accepting,
parsing, answering /health and writing SSE while a forward computes (torch releases the GIL
in its kernels); only the loop's thread touches request state: an abort that arrives during
a forward is applied once it returns. When idle it sleeps on an event that submit() sets. A
failing step fails the requests it carried, not the server.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time

from freetoken.engine.sampling_params import SamplingParams
from freetoken.scheduler.core import EngineCore, RequestDelta
from freetoken.scheduler.metrics import EngineMetrics

log = logging.getLogger("freetoken.scheduler")


class EngineFailure(RuntimeError):
    """The engine failed while running this request (or stopped: `unavailable`, a 503)."""

    def __init__(self, message: str, unavailable: bool = False):
        super().__init__(message)
        self.unavailable = unavailable


class RequestStream:
    """The deltas of one request, in order; iterate with `async for`."""

    def __init__(self, engine: "AsyncEngine", request_id: str, num_prompt_tokens: int):
        self.engine = engine
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.num_output_tokens = 0

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestDelta:
        if self.finished and self.queue.empty():
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """The client went away: drop the request and free its KV blocks now (between steps)."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


def engine_thread() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread every forward runs on: CUDA's current device and streams are per thread,
    and so are torch's CPU thread teams (OpenMP). Load the model on it too: while a second
    live thread holds a team (the loader), each parallel CPU op of the engine's pays to form
    its own (a CPU engine's 512-token prefill ran 25% slower, batch-8 decode 45%)."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ft-engine")


class AsyncEngine:
    def __init__(self, core: EngineCore, step_delay_s: float = 0.0,
                 thread: concurrent.futures.ThreadPoolExecutor | None = None):
        self.core = core
        self.step_delay_s = step_delay_s
        self.streams: dict[str, RequestStream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.metrics = EngineMetrics(core)
        self.recent: collections.deque = collections.deque(maxlen=32)  # finished, for /v1/stats
        # One thread runs every forward (engine_thread; the loader's, where it loaded).
        self._engine_thread = thread or engine_thread()
        self._engine_thread.submit(self._init_engine_thread)
        self._in_step = False
        self._deferred_aborts: list[tuple[str, RequestStream]] = []

    def _init_engine_thread(self) -> None:
        device = self.core.runner.device
        if device.type == "cuda":
            import torch
            torch.cuda.set_device(device)

    def _run_step(self, plan):
        result = self.core.run_step(plan)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)   # debug: a slow forward
        return result

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")

    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               request_id: str | None = None, forced_token_ids: list[int] | None = None) -> RequestStream:
        """Queue a request; raises RequestError (a 400) when it cannot run. forced_token_ids:
        output the sampler must produce first (scripted output for tests)."""
        req = self.core.add_request(prompt_token_ids, params, request_id, forced_token_ids)
        stream = RequestStream(self, req.request_id, req.num_prompt_tokens)
        self.streams[req.request_id] = stream
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        stream = self.streams.pop(request_id, None)
        if self._in_step:        # its forward may be running: drop it once the step is done
            self._deferred_aborts.append((request_id, stream))
        elif self.core.abort(request_id) and stream is not None:
            self._aborted(stream)

    def _apply_deferred_aborts(self) -> None:
        aborts, self._deferred_aborts = self._deferred_aborts, []
        for request_id, stream in aborts:
            if self.core.abort(request_id) and stream is not None:
                self._aborted(stream)

    def _aborted(self, stream: RequestStream) -> None:
        """An aborted request is counted, logged and listed in /v1/stats like a finished one."""
        self.metrics.on_finish(stream, "abort", stream.num_output_tokens)
        ttft = stream.first_token_at - stream.arrival if stream.first_token_at else None
        self.recent.append({"id": stream.request_id, "prompt_tokens": stream.num_prompt_tokens,
                            "output_tokens": stream.num_output_tokens, "finish_reason": "abort",
                            "ttft_s": round(ttft, 6) if ttft is not None else None})

    @property
    def num_running(self) -> int:
        return len(self.core.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.core.scheduler.waiting)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            if not self.core.has_work:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                t0 = time.perf_counter()
                plan = self.core.plan_step()
                deltas = []
                if plan is not None:
                    self._in_step = True
                    try:
                        result = await loop.run_in_executor(self._engine_thread, self._run_step, plan)
                    finally:
                        self._in_step = False
                    deltas = self.core.finish_step(plan, result)
                    budget = self.core.scheduler.step_budget
                    if budget is not None and any(c.num_tokens > 1 for c in plan.scheduled):
                        # Only steps that carried a prefill chunk: what a chunk costs.
                        budget.observe(plan.scheduled, time.perf_counter() - t0)
                        log.debug("step: %d tokens of %d requests in %.3f s",
                                  sum(c.num_tokens for c in plan.scheduled),
                                  len(plan.scheduled), time.perf_counter() - t0)
                self.metrics.on_step(time.perf_counter() - t0)
            except Exception as e:   # noqa: BLE001 - one bad step must not kill the server
                log.exception("engine step failed; failing the requests it carried")
                self._apply_deferred_aborts()
                self._fail_all(EngineFailure(f"engine step failed: {type(e).__name__}: {e}"))
                await asyncio.sleep(0)
                continue
            self._apply_deferred_aborts()
            now = time.monotonic()
            for d in deltas:
                stream = self.streams.get(d.request_id)
                if stream is not None:
                    stream.num_output_tokens = d.num_output_tokens
                    self.metrics.on_delta(stream, d, now)
                    stream.queue.put_nowait(d)
                    if d.finished:
                        self.streams.pop(d.request_id, None)
                        self.recent.append(self._summary(stream, d))
            await asyncio.sleep(0)   # serve sockets between steps

    @staticmethod
    def _summary(stream: RequestStream, d: RequestDelta) -> dict:
        ttft = stream.first_token_at - stream.arrival if stream.first_token_at else None
        out = {"id": d.request_id, "prompt_tokens": d.num_prompt_tokens,
               "output_tokens": d.num_output_tokens, "finish_reason": d.finish_reason,
               "ttft_s": round(ttft, 6) if ttft is not None else None}
        if d.prefill is not None:
            out["prefill"] = d.prefill
        return out

    def _fail_all(self, error: Exception) -> None:
        for rid, stream in list(self.streams.items()):
            if self._in_step:
                self._deferred_aborts.append((rid, stream))
            elif self.core.abort(rid):
                self._aborted(stream)
            stream.queue.put_nowait(error)
        self.streams.clear()

    async def shutdown(self, timeout_s: float) -> None:
        """Let running requests finish for up to timeout_s, then abort the rest."""
        deadline = time.monotonic() + timeout_s
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._fail_all(EngineFailure("the server is shutting down", unavailable=True))
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await asyncio.wait([self._task], timeout=1.0)
        self._engine_thread.shutdown(wait=False, cancel_futures=True)
