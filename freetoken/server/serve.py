"""run_server: one process, one uvloop event loop, the HTTP server and the engine loop on it.

Order matters for gateways: bind first (so /health answers at once), then load the model
in a worker thread, then serve. SIGINT/SIGTERM stop accepting, let running requests finish
for up to shutdown_timeout_s, abort the rest, and exit 0. A model that cannot load is
logged as one paragraph, reported by /health for LOAD_ERROR_LINGER_S, and exits 1.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from freetoken.engine.config import EngineConfig
from freetoken.scheduler.config import SchedulerConfig
from freetoken.server.app import ServingApp
from freetoken.server.config import ServerConfig
from freetoken.server.http import HttpConfig, start_server

log = logging.getLogger("freetoken.server")
LOAD_ERROR_LINGER_S = 3.0   # /health reports a failed load this long before the process exits


def _loop_factory():
    try:
        import uvloop
        return uvloop.new_event_loop
    except ImportError:   # the design wants uvloop; the default loop still works
        return None


def run_server(server: ServerConfig, engine: EngineConfig, scheduler: SchedulerConfig) -> int:
    import os

    import torch

    threads = server.cpu_threads or max(1, (os.cpu_count() or 2) - 1)
    torch.set_num_threads(threads)
    log.info("torch CPU threads: %d", threads)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(_serve(server, engine, scheduler))


async def _serve(server: ServerConfig, engine: EngineConfig, scheduler: SchedulerConfig) -> int:
    app = ServingApp(server, engine, scheduler)
    try:
        http = await start_server(app.router, server.host, server.port,
                                  HttpConfig(max_body_bytes=server.max_body_bytes))
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", server.host, server.port, e)
        return 1
    log.info("listening on http://%s:%d (model %s)", server.host, http.port, server.served_model_name)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loader = asyncio.create_task(app.load(), name="load-model")
    stopping = asyncio.create_task(stop.wait(), name="wait-for-signal")
    await asyncio.wait((loader, stopping), return_when=asyncio.FIRST_COMPLETED)
    status = 0
    if loader.done() and not loader.result():
        # A supervisor must see the failure: linger so pollers read /health's error, then
        # exit non-zero (a signal meanwhile ends the wait early).
        status = 1
        try:
            await asyncio.wait_for(stop.wait(), LOAD_ERROR_LINGER_S)
        except asyncio.TimeoutError:
            pass
    else:
        await stopping
    stopping.cancel()
    log.info("shutting down: no new connections; finishing running requests")
    http.close()
    loader.cancel()
    await app.shutdown(server.shutdown_timeout_s)
    await http.shutdown(timeout=1.0)
    log.info("bye" if status == 0 else "exiting with status 1: the model could not be loaded")
    return status
