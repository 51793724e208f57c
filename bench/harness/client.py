"""An OpenAI-compatible client over raw asyncio sockets, for timestamps a library cannot skew.

`stream()` POSTs one streaming request and stamps every read with time.perf_counter() as the
bytes arrive, before any parsing; the SSE events are then decoded (HTTP/1.1 chunked, length
framed or close framed) and each event that carries generated text keeps its read's stamp.
`get_json()` is the plain (urllib) request for the metadata routes, `ft ctl`'s http_get.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import ssl
import time
import urllib.error
import urllib.parse

from freetoken.ctl import http_get

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclasses.dataclass(frozen=True)
class Endpoint:
    scheme: str
    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> "Endpoint":
        """`http://host:port`, with or without a trailing /v1 (OpenAI clients' base_url)."""
        u = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) URL: {url}")
        if u.path.rstrip("/") not in ("", "/v1"):
            raise ValueError(f"give the server's base URL (http://host:port), not a route: {url}")
        return cls(u.scheme, u.hostname, u.port or (443 if u.scheme == "https" else 80))

    @property
    def base(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        return self.host in ("127.0.0.1", "localhost", "::1") or self.host.startswith("127.")


@dataclasses.dataclass
class StreamResult:
    t_start: float                  # perf_counter before connecting
    t_start_unix: float
    t_end: float = 0.0
    event_times: list = dataclasses.field(default_factory=list)   # perf_counter per text event
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None    # usage.prompt_tokens_details.cached_tokens (prefix cache)
    finish_reason: str | None = None
    http_status: int | None = None
    error: str | None = None


def get_json(base: str, path: str, api_key: str | None, timeout: float = 10.0) -> tuple[int | None, object]:
    """(status, parsed body) of a GET; status None and the reason when unreachable."""
    try:
        status, raw = http_get(base + path, api_key, timeout)
    except (urllib.error.URLError, OSError) as e:
        return None, str(getattr(e, "reason", e))
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


async def stream(ep: Endpoint, api: str, body: dict, api_key: str | None, timeout: float) -> StreamResult:
    result = StreamResult(t_start=time.perf_counter(), t_start_unix=time.time())
    try:
        if hasattr(asyncio, "timeout"):
            # 3.11+: wait_for there can swallow a cancellation that lands as the stream ends
            # (the task's result wins), so a Ctrl-C then never stopped the run.
            async with asyncio.timeout(timeout):
                await _stream(ep, PATHS[api], body, api_key, result)
        else:
            await asyncio.wait_for(_stream(ep, PATHS[api], body, api_key, result), timeout)
    except asyncio.TimeoutError:
        result.error = f"timed out after {timeout:g}s"
    except (OSError, ValueError, IndexError) as e:
        result.error = f"{type(e).__name__}: {e}"
    result.t_end = time.perf_counter()
    return result


async def _stream(ep: Endpoint, path: str, body: dict, api_key: str | None, result: StreamResult) -> None:
    raw = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {ep.host}:{ep.port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nConnection: close\r\nContent-Length: {len(raw)}\r\n")
    if api_key:
        head += f"Authorization: Bearer {api_key}\r\n"
    ctx = ssl.create_default_context() if ep.scheme == "https" else None
    reader, writer = await asyncio.open_connection(ep.host, ep.port, ssl=ctx)
    try:
        writer.write(head.encode() + b"\r\n" + raw)
        await writer.drain()
        await _read_response(reader, result)
    finally:
        writer.close()


async def _read_response(reader, result: StreamResult) -> None:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = await reader.read(65536)
        if not chunk:
            raise ValueError("the server closed the connection before its response headers")
        buf += chunk
    head, rest = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    result.http_status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    body = _Body(headers)
    events = _SSE(result)
    now = time.perf_counter()
    while True:
        data = body.feed(rest)
        if result.http_status != 200:
            events.error_text += data
        elif events.feed(data, now):
            return
        if body.done:
            break
        rest = await reader.read(65536)
        now = time.perf_counter()
        if not rest:
            break
    if result.http_status != 200:
        result.error = f"HTTP {result.http_status}: {events.error_text[:500].decode(errors='replace')}"
    elif result.error is None:
        result.error = "the stream ended without data: [DONE]"


class _Body:
    """HTTP/1.1 body framing: chunked, Content-Length, or until the server closes."""

    def __init__(self, headers: dict):
        self.chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        self.left = int(headers["content-length"]) if "content-length" in headers and not self.chunked else None
        self.done = self.left == 0
        self.buf = b""
        self.state, self.size = "size", 0

    def feed(self, data: bytes) -> bytes:
        if not self.chunked:
            if self.left is not None:
                data = data[:self.left]
                self.left -= len(data)
                self.done = self.left == 0
            return data
        self.buf += data
        out = []
        while not self.done:
            if self.state == "size":
                i = self.buf.find(b"\r\n")
                if i < 0:
                    break
                self.size = int(self.buf[:i].split(b";")[0], 16)
                self.buf = self.buf[i + 2:]
                self.state = "data" if self.size else "end"
                self.done = self.size == 0
            elif self.state == "data":
                take = self.buf[:self.size]
                out.append(take)
                self.buf, self.size = self.buf[len(take):], self.size - len(take)
                if self.size:
                    break
                self.state = "crlf"
            else:   # the CRLF after a chunk's data
                if len(self.buf) < 2:
                    break
                self.buf, self.state = self.buf[2:], "size"
        return b"".join(out)


class _SSE:
    """Server-sent events, line by line; fills the result, True once `data: [DONE]` arrives."""

    def __init__(self, result: StreamResult):
        self.result = result
        self.partial = b""
        self.data: list[bytes] = []
        self.error_text = b""

    def feed(self, data: bytes, now: float) -> bool:
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        for line in lines:
            line = line.rstrip(b"\r")
            if line.startswith(b"data:"):
                self.data.append(line[5:].removeprefix(b" "))
            elif not line and self.data:
                payload, self.data = b"\n".join(self.data), []
                if payload == b"[DONE]":
                    return True
                self._event(json.loads(payload), now)
        return False

    def _event(self, obj: dict, now: float) -> None:
        r = self.result
        if obj.get("error"):
            r.error = f"error event: {json.dumps(obj['error'])[:500]}"
        usage = obj.get("usage")
        if usage:
            r.prompt_tokens = usage.get("prompt_tokens")
            r.completion_tokens = usage.get("completion_tokens")
            r.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        for choice in obj.get("choices") or []:
            delta = choice.get("delta") or {}
            if choice.get("text") or delta.get("content") or delta.get("reasoning_content") \
                    or delta.get("reasoning") or delta.get("tool_calls"):
                r.event_times.append(now)
            r.finish_reason = choice.get("finish_reason") or r.finish_reason
