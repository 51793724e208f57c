"""Request (what the client sent) and Response (the per-request cycle a handler answers on).

A handler is `async def handler(request: Request, response: Response) -> None` and answers
exactly once: `send_json` / `send_bytes` / `send_error`, or a stream:

    response.start_stream()                       # 200 text/event-stream, chunked
    response.on_disconnect(stream.abort)          # abort the request in the scheduler
    async for delta in stream:
        await response.write(sse_event(chunk))    # one transport.write; waits while paused
        if response.disconnected:
            return
    await response.write(SSE_DONE)
    response.end_stream()

After the client goes away `disconnected` is True, the on_disconnect callbacks have run,
`wait_disconnected()` has returned True, and every later send/write is a silent no-op.
"""

from __future__ import annotations

import asyncio
import logging
import time
from email.utils import formatdate
from http import HTTPStatus
from typing import TYPE_CHECKING, Callable
from urllib.parse import parse_qsl

import orjson

from freetoken.server.errors import HTTPError

if TYPE_CHECKING:
    from freetoken.server.http.protocol import HttpProtocol

log = logging.getLogger("freetoken.server.http")

STATUS_LINES = {s.value: b"HTTP/1.1 %d %b\r\n" % (s.value, s.phrase.encode()) for s in HTTPStatus}
_SSE_HEADERS = b"cache-control: no-cache\r\nx-accel-buffering: no\r\n"
_CHUNKED = b"transfer-encoding: chunked\r\n"
_CLOSE = b"connection: close\r\n"
_KEEP_ALIVE = b"connection: keep-alive\r\n"
_CHUNK_END = b"0\r\n\r\n"
_content_type_lines: dict[str, bytes] = {}
_date = [0, b""]          # [second, b"date: ...\r\n"], refreshed at most once a second
_UNSET = object()


def status_line(status: int) -> bytes:
    line = STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d Unknown\r\n" % status


def _date_line() -> bytes:
    now = int(time.time())
    if now != _date[0]:
        _date[0], _date[1] = now, b"date: %b\r\n" % formatdate(now, usegmt=True).encode()
    return _date[1]


def _content_type_line(content_type: str) -> bytes:
    line = _content_type_lines.get(content_type)
    if line is None:
        line = _header_line("content-type", content_type)
        if len(_content_type_lines) < 64:
            _content_type_lines[content_type] = line
    return line


def _header_line(name: str, value: str) -> bytes:
    line = f"{name}: {value}\r\n"
    if line.count("\n") != 1 or "\r" in line[:-2]:      # no header injection through CR/LF
        raise ValueError(f"header {name!r} contains a line break")
    return line.encode("latin-1")


class Request:
    """One parsed request. `headers` keys are lowercase; repeated fields are joined with ", "."""

    __slots__ = ("method", "path", "query_string", "headers", "body", "client", "http_version",
                 "keep_alive", "path_rest", "_query", "_json")

    def __init__(self, method: str, path: str, query_string: str, headers: dict[str, str],
                 body: bytes, client: tuple[str, int] | None, http_version: str = "1.1",
                 keep_alive: bool = True):
        self.method = method
        self.path = path
        self.query_string = query_string
        self.headers = headers
        self.body = body
        self.client = client
        self.http_version = http_version
        self.keep_alive = keep_alive
        self.path_rest = ""                    # what a {name:path} route matched
        self._query: dict[str, str] | None = None
        self._json = _UNSET

    @property
    def query(self) -> dict[str, str]:
        """Query parameters, decoded; the last of a repeated name wins."""
        if self._query is None:
            self._query = dict(parse_qsl(self.query_string, keep_blank_values=True))
        return self._query

    def json(self) -> dict:
        """The body as a JSON object; HTTPError 400 for an empty, malformed or non-object body."""
        if self._json is _UNSET:
            encoding = self.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):
                raise HTTPError(415, f"Content-Encoding {encoding!r} is not supported: send the JSON "
                                     f"body uncompressed", type="invalid_request_error")
            if not self.body.strip():
                raise HTTPError(400, "request body is empty; expected a JSON object",
                                type="invalid_request_error")
            try:
                obj = orjson.loads(self.body)
            except orjson.JSONDecodeError as e:
                raise HTTPError(400, f"malformed JSON in request body: {e}",
                                type="invalid_request_error") from None
            if not isinstance(obj, dict):
                raise HTTPError(400, f"request body must be a JSON object, got {type(obj).__name__}",
                                type="invalid_request_error")
            self._json = obj
        return self._json

    def __repr__(self) -> str:
        return f"<Request {self.method} {self.path} from {self.client}>"


class Response:
    """The answer to one request; created by the protocol, one per request cycle."""

    __slots__ = ("_conn", "dialect", "keep_alive", "status", "started", "streaming", "finished",
                 "head_only", "extra_headers", "_http_11", "_chunked", "_callbacks", "_waiter")

    def __init__(self, conn: HttpProtocol, request: Request | None, dialect: str = "openai"):
        # request=None: a protocol-level error answer (400/413/431) that closes the connection.
        self._conn = conn
        self.dialect = dialect                 # error shape; the router sets the route's
        self.head_only = False                 # HEAD: headers (with the GET's length), no body
        self.extra_headers: dict[str, str] | None = None   # on every answer (CORS)
        self.keep_alive = request is not None and request.keep_alive   # False: send `connection: close`
        self.status: int | None = None
        self.started = False                   # headers written (or would have been)
        self.streaming = False
        self.finished = False
        self._http_11 = request is None or request.http_version != "1.0"
        self._chunked = False
        self._callbacks: list[Callable[[], object]] | None = None
        self._waiter: asyncio.Future | None = None

    # -- client state ---------------------------------------------------------------------
    @property
    def disconnected(self) -> bool:
        return self._conn.disconnected

    def on_disconnect(self, callback: Callable[[], object]) -> None:
        """Call `callback()` once if the client goes away before this response finishes
        (at once if it already has). Also called if the handler raises or the server drops
        the request at shutdown, so `on_disconnect(engine_request.abort)` never leaks work."""
        if self.finished:
            return
        if self._conn.disconnected:
            callback()
            return
        if self._callbacks is None:
            self._callbacks = []
        self._callbacks.append(callback)

    async def wait_disconnected(self) -> bool:
        """True once the client has gone away (or the request was dropped, as for
        on_disconnect); False once the response finished first."""
        if self._conn.disconnected:
            return True
        if self.finished:
            return False
        if self._waiter is None:
            self._waiter = self._conn.loop.create_future()
        return await asyncio.shield(self._waiter)

    # -- whole responses ------------------------------------------------------------------
    def send_json(self, status: int, obj, headers: dict[str, str] | None = None) -> None:
        self.send_bytes(status, orjson.dumps(obj), "application/json", headers)

    def send_error(self, error: HTTPError) -> None:
        self.send_bytes(error.status, error.body(self.dialect), "application/json", error.headers)

    def send_bytes(self, status: int, body: bytes, content_type: str = "application/octet-stream",
                   headers: dict[str, str] | None = None) -> None:
        self._start(status)
        if not self._conn.disconnected:
            if status == 204 or status == 304:       # no body and no Content-Length allowed
                body = b""
                parts = self._head(status, content_type, headers)
            else:
                parts = self._head(status, content_type, headers)
                parts.append(b"content-length: %d\r\n" % len(body))
            parts.append(b"\r\n")
            if not self.head_only:
                parts.append(body)
            self._conn.write(b"".join(parts))
        self._finish()

    # -- streams --------------------------------------------------------------------------
    def start_stream(self, status: int = 200, content_type: str = "text/event-stream",
                     headers: dict[str, str] | None = None) -> None:
        """Send the headers of a chunked response (HTTP/1.0: unframed, then close)."""
        self._start(status)
        self.streaming = True
        self._chunked = self._http_11
        if not self._http_11:
            self.keep_alive = False
        if self._conn.disconnected:
            return
        parts = self._head(status, content_type, headers)
        if self._chunked:
            parts.append(_CHUNKED)
        if content_type.startswith("text/event-stream"):
            parts.append(_SSE_HEADERS)
        parts.append(b"\r\n")
        self._conn.write(b"".join(parts))

    async def write(self, chunk: bytes) -> None:
        """Send one chunk with one transport.write; first wait while the client is not
        reading (the transport is paused). A no-op once the client has gone away."""
        if not self.streaming:
            raise RuntimeError("write() needs start_stream() first")
        conn = self._conn
        if conn.write_paused:
            await conn.drain()
        if conn.disconnected or not chunk:
            return
        if self.finished:
            raise RuntimeError("write() after end_stream()")
        conn.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if self._chunked else chunk)

    def end_stream(self) -> None:
        """Finish the stream (the terminating chunk); the connection moves to the next request."""
        if self.finished:
            return
        if not self.streaming:
            raise RuntimeError("end_stream() needs start_stream() first")
        if self._chunked and not self._conn.disconnected:
            self._conn.write(_CHUNK_END)
        self._finish()

    def abort(self) -> None:
        """Cut the response short: close the connection so the client sees it incomplete.
        The on_disconnect callbacks run: for this request the client is gone."""
        if not self.finished:
            self.keep_alive = False
            self.finished = True
            self._stop_work(True)
            self._conn.response_done(self, abort=True)

    # -- internals (called by the protocol) -----------------------------------------------
    def _start(self, status: int) -> None:
        if self.started:
            raise RuntimeError(f"response already started (status {self.status})")
        self.started = True
        self.status = status

    def _head(self, status: int, content_type: str, headers: dict[str, str] | None) -> list[bytes]:
        if self._conn.draining:
            self.keep_alive = False
        parts = [status_line(status), _date_line(), _content_type_line(content_type)]
        if not self.keep_alive:
            parts.append(_CLOSE)
        elif not self._http_11:
            parts.append(_KEEP_ALIVE)
        for extra in (self.extra_headers, headers):
            for name, value in (extra or {}).items():
                parts.append(_header_line(name, value))
        return parts

    def _finish(self) -> None:
        self.finished = True
        self._callbacks = None
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(False)
        self._conn.response_done(self)

    def _connection_lost(self) -> None:
        if not self.finished:
            self._stop_work(True)

    def _stop_work(self, gone: bool) -> None:
        """Run the on_disconnect callbacks once (the request's work should stop) and wake
        wait_disconnected() with `gone`; also used when the handler fails or is cancelled."""
        callbacks, self._callbacks = self._callbacks, None
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(gone)
        for callback in callbacks or ():
            try:
                callback()
            except Exception:   # noqa: BLE001 - one bad callback must not skip the others
                log.exception("on_disconnect callback %r failed", callback)
