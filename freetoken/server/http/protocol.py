"""HttpProtocol: one client connection, HTTP/1.1 on httptools, as an asyncio.Protocol.

Bytes go into the parser; each complete request is queued, and requests are answered one
at a time in arrival order (pipelining): the next handler starts when the previous response
has finished. A handler runs as its own task (`router.dispatch`), so a slow handler or a
slow reader never holds up the loop or other connections.

Errors the protocol answers itself, in the router's default dialect, and then closes:
400 malformed HTTP, 413 body over max_body_bytes (as soon as Content-Length or the
running chunked total says so; the rest is never buffered), 431 header section over
max_header_bytes. Those closes linger: FIN after the answer, the client's unread upload
read and dropped for up to lingering_close_s, so the client's kernel does not turn it into
a reset that destroys the answer before the client reads it.

Flow control: pause_writing/resume_writing set `write_paused`; Response.write awaits
`drain()`; while writes are paused reading pauses too, so a client that pipelines without
reading cannot grow our buffers. connection_lost wakes waiting writers and fires the
current response's disconnect callbacks.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING
from urllib.parse import unquote_to_bytes

import httptools

from freetoken.server.errors import HTTPError
from freetoken.server.http.request import Request, Response

if TYPE_CHECKING:
    from freetoken.server.http.router import Router
    from freetoken.server.http.server import HttpConfig

log = logging.getLogger("freetoken.server.http")

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class _Reject(Exception):
    """Raised inside a parser callback to stop parsing; the HTTPError is in `_reject`."""


class HttpProtocol(asyncio.Protocol):
    def __init__(self, router: Router, config: HttpConfig, owner=None):
        # owner: the HttpServer (its `connections`, `tasks`, `draining`), or None in tests.
        self.router = router
        self.config = config
        self.owner = owner
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.client: tuple[str, int] | None = None
        self.parser = httptools.HttpRequestParser(self)
        # The message being parsed.
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._header_dict: dict[str, str] = {}
        self._body: list[bytes] = []
        self._body_size = 0
        self._head_size = 0       # exact size of URL + headers, counted in the callbacks
        self._head_bytes = 0      # raw bytes fed since the last header section ended
        self._in_message = False
        self._in_body = False     # headers complete, body (if any) still coming
        self._expect_continue = False
        self._reject: HTTPError | None = None
        # Requests parsed but not answered, in order; an HTTPError item ends the connection.
        self._pending: deque[Request | HTTPError] = deque()
        self._response: Response | None = None
        self._tasks: set[asyncio.Task] = owner.tasks if owner is not None else set()
        self._done_reading = False     # no more requests on this connection
        self._read_paused = False
        self._linger = False
        # Flow control and lifetime.
        self.write_paused = False
        self._drain_waiter: asyncio.Future | None = None
        self.disconnected = False
        self.draining = False
        self._timer: asyncio.TimerHandle | None = None
        self.closed: asyncio.Future = self.loop.create_future()

    # -- protocol interface ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=self.config.write_buffer_bytes)
        peer = transport.get_extra_info("peername")
        self.client = (peer[0], peer[1]) if isinstance(peer, tuple) else None
        if self.owner is not None:
            self.owner.connections.add(self)
            if self.owner.draining:
                self.draining = True
        self._arm_timer(self.config.keep_alive_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self.disconnected = True
        self._done_reading = True
        self._cancel_timer()
        self._pending.clear()
        if self.owner is not None:
            self.owner.connections.discard(self)
        self._wake_writers()
        if self._response is not None:
            self._response._connection_lost()
        if not self.closed.done():
            self.closed.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self._done_reading:
            return   # after an error answer or the connection's last request: dropped
        if not self._in_body:
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # Upgrade (h2c, websocket) is not offered: answer the request as plain HTTP/1.1, then close.
            if self._pending and isinstance(self._pending[-1], Request):
                self._pending[-1].keep_alive = False
            self._done_reading = True
        except httptools.HttpParserError as e:
            if self._reject is not None:
                self._fail_connection(self._reject)
            elif not self._done_reading:   # else: bytes after a `connection: close` request
                self._fail_connection(HTTPError(400, f"malformed HTTP request: {e}",
                                                type="invalid_request_error"))
        else:
            if self._in_message and not self._in_body and self._head_bytes > self.config.max_header_bytes:
                self._fail_connection(HTTPError(431, "request header section too large",
                                                type="invalid_request_error"))
        self._dispatch()

    def eof_received(self) -> None:
        # The client closed its side: it is gone (returning None closes the transport).
        return None

    def pause_writing(self) -> None:
        self.write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_writers()
        self._update_reading()

    # -- parser callbacks -----------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._body = []
        self._body_size = 0
        self._head_size = 0
        self._in_message = True
        self._in_body = False

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_size += len(url)
        if self._head_size > self.config.max_header_bytes:
            self._stop(HTTPError(431, "request URL too long", type="invalid_request_error"))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value) + 4
        if self._head_size > self.config.max_header_bytes:
            self._stop(HTTPError(431, "request header section too large", type="invalid_request_error"))
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_body = True
        self._head_bytes = 0
        self._cancel_timer()     # the header section arrived in time; bodies may be slow
        headers: dict[str, str] = {}
        for raw_name, raw_value in self._headers:
            name, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1")
            if name in headers:   # RFC 9110 5.3: repeated fields combine as a comma list
                value = headers[name] + ("; " if name == "cookie" else ", ") + value
            headers[name] = value
        self._header_dict = headers
        length = headers.get("content-length")
        if length is not None and _int_or_zero(length) > self.config.max_body_bytes:
            self._stop(self._too_large())
        expect = headers.get("expect")
        if expect is not None and expect.lower() == "100-continue" and self.parser.get_http_version() == "1.1":
            if self._response is None and not self._pending:
                self.transport.write(_CONTINUE)
            else:   # an earlier response is still being written: 100 goes out after it
                self._expect_continue = True

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        if self._body_size > self.config.max_body_bytes:
            self._stop(self._too_large())
        self._body.append(body)

    def on_message_complete(self) -> None:
        parser = self.parser
        keep_alive = parser.should_keep_alive()
        path, query = _split_target(self._url)
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._pending.append(Request(parser.get_method().decode("ascii"), path, query, self._header_dict,
                                     body, self.client, parser.get_http_version(), keep_alive))
        self._body = []
        self._in_message = self._in_body = self._expect_continue = False
        self._head_bytes = 0
        if not keep_alive:
            self._done_reading = True

    # -- request cycles -------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Start the next queued request if none is being answered; else arm the idle timer."""
        if self._response is not None or self.disconnected:
            return
        if self._pending:
            item = self._pending.popleft()
            if isinstance(item, HTTPError):
                self._linger = True
                self._response = Response(self, None, self.router.default_dialect)
                self._response.send_error(item)
            else:
                self._response = response = Response(self, item, self.router.default_dialect)
                task = self.loop.create_task(self._run(item, response))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            self._update_reading()
            return
        if self._in_body:
            if self._expect_continue:
                self._expect_continue = False
                self.transport.write(_CONTINUE)
        elif self._done_reading or self.draining:
            self._close()
        else:
            self._arm_timer(self.config.keep_alive_timeout_s)

    async def _run(self, request: Request, response: Response) -> None:
        try:
            await self.router.dispatch(request, response)
        except HTTPError as e:
            self._handler_failed(response, e)
        except Exception as e:   # noqa: BLE001 - a handler bug answers 500; the server stays up
            log.exception("%s %s failed", request.method, request.path)
            self._handler_failed(response, HTTPError(500, f"internal server error ({type(e).__name__})",
                                                     type="server_error"))
        except asyncio.CancelledError:
            response.abort()
            raise
        else:
            if not response.started:
                log.error("%s %s: the handler returned without a response", request.method, request.path)
                response.send_error(HTTPError(500, "the handler sent no response", type="server_error"))
            elif not response.finished:
                response.end_stream()

    @staticmethod
    def _handler_failed(response: Response, error: HTTPError) -> None:
        if not response.finished:
            response._stop_work(True)   # the request failed: its on_disconnect work stops too
        if not response.started:
            response.send_error(error)
        else:   # headers (maybe part of a stream) are out: only cutting the connection says "failed"
            response.abort()

    def response_done(self, response: Response, abort: bool = False) -> None:
        """Called by the Response once it has been sent in full (or aborted)."""
        if response is not self._response:
            return
        self._response = None
        if abort or not response.keep_alive or self.disconnected:
            self._close()
        else:
            self._dispatch()

    # -- writing and flow control ---------------------------------------------------------
    def write(self, data: bytes) -> None:
        if not self.disconnected:
            self.transport.write(data)

    async def drain(self) -> None:
        """Return once the transport accepts writes again or the client is gone."""
        while self.write_paused and not self.disconnected:
            if self._drain_waiter is None or self._drain_waiter.done():
                self._drain_waiter = self.loop.create_future()
            await asyncio.shield(self._drain_waiter)

    def _wake_writers(self) -> None:
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _update_reading(self) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        pause = not self._linger and (self.write_paused or len(self._pending) >= self.config.max_pipelined)
        if pause != self._read_paused:
            self._read_paused = pause
            transport.pause_reading() if pause else transport.resume_reading()

    # -- closing --------------------------------------------------------------------------
    def begin_drain(self) -> None:
        """Server shutdown: answer what is in progress with `connection: close`, then close."""
        self.draining = True
        if self._response is None and not self._pending and not self._in_body:
            self._close()

    def _close(self) -> None:
        self._done_reading = True
        self._cancel_timer()
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self._linger and transport.can_write_eof():
            # FIN now; keep reading (and dropping) so unread upload bytes do not make our
            # kernel answer with a reset that wipes the error response at the client.
            transport.write_eof()
            self._update_reading()
            self._arm_timer(self.config.lingering_close_s)
        else:
            transport.close()

    def abort(self) -> None:
        """Drop the connection now, without flushing (shutdown timeout)."""
        self._done_reading = True
        if self.transport is not None:
            self.transport.abort()

    def _stop(self, error: HTTPError):
        self._reject = error
        raise _Reject

    def _too_large(self) -> HTTPError:
        return HTTPError(413, f"request body exceeds the limit of {self.config.max_body_bytes} bytes",
                         type="invalid_request_error", code="request_too_large")

    def _fail_connection(self, error: HTTPError) -> None:
        self._done_reading = True
        self._in_message = self._in_body = False
        self._pending.append(error)

    def _arm_timer(self, delay: float) -> None:
        self._cancel_timer()
        self._timer = self.loop.call_later(delay, self._on_timer)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        # Idle keep-alive (or header section too slow), or the end of a lingering close.
        self._timer = None
        if self._response is None and not self._pending and not self._in_body and self.transport is not None:
            self._done_reading = True
            self.transport.close()


def _int_or_zero(value: str) -> int:
    try:
        return int(value)
    except ValueError:   # llhttp rejects a bad Content-Length itself, with a 400
        return 0


def _split_target(url: bytes) -> tuple[str, str]:
    """(path, query string) of the request target; absolute-form targets keep only the path."""
    if url[:1] != b"/":
        try:
            parsed = httptools.parse_url(url)
            url = (parsed.path or b"/") + (b"?" + parsed.query if parsed.query else b"")
        except httptools.HttpParserInvalidURLError:
            pass
    path, _, query = url.partition(b"?")
    path, _, _ = path.partition(b"#")
    if b"%" in path:
        return unquote_to_bytes(path).decode("utf-8", "replace"), query.decode("latin-1")
    return path.decode("latin-1"), query.decode("latin-1")
