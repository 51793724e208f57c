"""Server-sent event encoding: one event in, the bytes of one `Response.write` out.

An event is `event: NAME\\n` (optional) then `data: ...\\n` lines and a blank line. JSON
payloads go through orjson, which never emits a newline, so the common case is a single
`%` format with no scanning; str/bytes with line breaks are split into several data lines.
"""

from __future__ import annotations

import orjson

SSE_DONE = b"data: [DONE]\n\n"     # OpenAI's end-of-stream marker
SSE_PING = b": ping\n\n"           # a comment line: keeps proxies and idle timers from closing


def sse_event(data: bytes | str | dict | list, event: str | None = None) -> bytes:
    if isinstance(data, (dict, list)):
        payload = orjson.dumps(data)
    else:
        payload = data.encode() if isinstance(data, str) else bytes(data)
        if b"\n" in payload or b"\r" in payload:
            # Every SSE line terminator (CRLF, LF, CR) starts a new data line.
            lines = payload.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
            payload = b"\ndata: ".join(lines)
    if event is None:
        return b"data: %b\n\n" % payload
    if "\n" in event or "\r" in event:
        raise ValueError(f"SSE event name must be a single line, got {event!r}")
    return b"event: %b\ndata: %b\n\n" % (event.encode(), payload)


def sse_comment(text: str = "ping") -> bytes:
    """A comment event (ignored by clients), e.g. a keep-alive ping: b": ping\\n\\n"."""
    if "\n" in text or "\r" in text:
        raise ValueError("SSE comment must be a single line")
    return b": %b\n\n" % text.encode()
