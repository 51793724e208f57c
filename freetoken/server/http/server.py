"""HttpConfig, start_server and HttpServer: listen, stop accepting, shut down gracefully.

    http = await start_server(router, "127.0.0.1", 0, HttpConfig())
    http.port                       # the bound port (port 0 picks a free one)
    http.close()                    # stop accepting; idle connections close now, busy ones
                                    # answer with `connection: close` and close after
    await http.shutdown(timeout=5)  # close(), wait up to timeout for in-flight responses,
                                    # then drop the remaining connections and cancel handlers
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket

from freetoken.server.http.protocol import HttpProtocol
from freetoken.server.http.router import Router

log = logging.getLogger("freetoken.server.http")


@dataclasses.dataclass(frozen=True)
class HttpConfig:
    max_body_bytes: int = 32 * 2**20        # larger bodies: 413, connection closed
    max_header_bytes: int = 64 * 2**10      # request line + headers; larger: 431
    keep_alive_timeout_s: float = 5.0       # idle connections (and slow header sections) close
    lingering_close_s: float = 2.0          # after a 400/413/431: how long to drop unread upload
    max_pipelined: int = 16                 # queued requests per connection before reading pauses
    write_buffer_bytes: int = 64 * 2**10    # transport high-water mark; Response.write waits above it
    backlog: int = 2048

    def __post_init__(self):
        for name in ("max_body_bytes", "max_header_bytes", "max_pipelined", "write_buffer_bytes", "backlog"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"HttpConfig.{name} must be a positive integer, got {value!r}")
        if self.max_header_bytes < 1024:
            raise ValueError(f"HttpConfig.max_header_bytes must be at least 1024, got {self.max_header_bytes}")
        for name in ("keep_alive_timeout_s", "lingering_close_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"HttpConfig.{name} must be a positive number, got {value!r}")


class HttpServer:
    def __init__(self, router: Router, config: HttpConfig):
        self.router = router
        self.config = config
        self.connections: set[HttpProtocol] = set()
        self.tasks: set[asyncio.Task] = set()       # running handlers, for shutdown
        self.draining = False
        self._server: asyncio.AbstractServer | None = None

    def _protocol(self) -> HttpProtocol:
        return HttpProtocol(self.router, self.config, self)

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return tuple(self._server.sockets)

    def close(self) -> None:
        """Stop accepting. Idle connections close now; busy ones after their current response."""
        if self.draining:
            return
        self.draining = True
        self._server.close()
        for conn in list(self.connections):
            conn.begin_drain()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """close(), let in-flight responses finish for up to `timeout` s, then drop the rest."""
        self.close()
        waits = [conn.closed for conn in self.connections]
        if waits:
            _, late = await asyncio.wait(waits, timeout=timeout)
            if late:
                log.info("shutdown: dropping %d connection(s) still busy after %.1fs", len(late), timeout)
        for conn in list(self.connections):
            conn.abort()
        await asyncio.sleep(0)             # connection_lost runs: disconnect callbacks fire
        tasks = [t for t in self.tasks if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        try:
            await asyncio.wait_for(self._server.wait_closed(), 1.0)
        except asyncio.TimeoutError:
            pass

    async def __aenter__(self) -> HttpServer:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown(timeout=0.1)


async def start_server(router: Router, host: str = "127.0.0.1", port: int = 0,
                       config: HttpConfig | None = None) -> HttpServer:
    """Bind and start accepting on the running loop (uvloop or asyncio's own)."""
    http = HttpServer(router, config or HttpConfig())
    loop = asyncio.get_running_loop()
    http._server = await loop.create_server(http._protocol, host, port, backlog=http.config.backlog,
                                            reuse_address=True)
    return http
