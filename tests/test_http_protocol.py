"""HttpProtocol without sockets: bytes in through data_received, a fake transport records
what goes out, pause/resume and connection_lost are called by hand."""

from __future__ import annotations

import asyncio
import json

import orjson
import pytest

from freetoken.server.errors import HTTPError, error_body
from freetoken.server.http import SSE_DONE, SSE_PING, HttpConfig, Router, sse_comment, sse_event
from freetoken.server.http.protocol import HttpProtocol

try:
    import uvloop
    LOOP = uvloop.new_event_loop
except ImportError:   # pragma: no cover
    LOOP = None


class FakeTransport:
    def __init__(self):
        self.writes: list[bytes] = []
        self.closing = False
        self.aborted = False
        self.eof = False
        self.reading = True
        self.protocol: HttpProtocol | None = None

    @property
    def data(self) -> bytes:
        return b"".join(self.writes)

    def write(self, data: bytes) -> None:
        assert not self.eof, "write after write_eof"
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def abort(self) -> None:
        self.aborted = True
        self.close()

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass

    def get_extra_info(self, name, default=None):
        return ("10.0.0.7", 4242) if name == "peername" else default


def run(coro):
    with asyncio.Runner(loop_factory=LOOP) as runner:
        return runner.run(coro)


def connect(router: Router, **config) -> tuple[HttpProtocol, FakeTransport]:
    proto = HttpProtocol(router, HttpConfig(**config))
    transport = FakeTransport()
    transport.protocol = proto
    proto.connection_made(transport)
    return proto, transport


def connect_to(handler, **config) -> tuple[HttpProtocol, FakeTransport]:
    """A connection to a router whose one route, GET /, is `handler`."""
    router = Router()
    router.add("GET", "/", handler)
    return connect(router, **config)


def gated_handler():
    """(handler, gate): the handler answers 200 {} once the gate (an asyncio.Event) is set."""
    gate = asyncio.Event()

    async def slow(request, response):
        await gate.wait()
        response.send_json(200, {})

    return slow, gate


async def settle(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def responses(data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Split a byte stream of (non-chunked or chunked) responses into (status, headers, body)."""
    out = []
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v for k, _, v in (line.partition(": ") for line in lines[1:])}
        if status == 100:
            out.append((100, headers, b""))
            continue
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while True:
                size_line, _, data = data.partition(b"\r\n")
                size = int(size_line, 16)
                chunk, data = data[:size], data[size + 2:]
                if size == 0:
                    break
                body += chunk
        else:
            n = int(headers.get("content-length", len(data)))
            body, data = data[:n], data[n:]
        out.append((status, headers, body))
    return out


def echo_router() -> Router:
    router = Router()

    async def echo(request, response):
        response.send_json(200, {"method": request.method, "path": request.path, "query": request.query,
                                 "headers": request.headers, "body": request.body.decode(),
                                 "client": list(request.client)})

    async def parse(request, response):
        response.send_json(200, request.json())

    router.add("GET", "/echo", echo)
    router.add("POST", "/echo", echo)
    router.add("POST", "/json", parse)
    return router


# -- requests and plain responses ---------------------------------------------------------
def test_get_keep_alive_and_request_fields():
    async def main():
        proto, t = connect(echo_router())
        proto.data_received(b"GET /echo?a=1&b=%20two&a=3 HTTP/1.1\r\nHost: x\r\nX-Tag: one\r\n"
                            b"x-tag: two\r\nCookie: a=1\r\nCookie: b=2\r\n\r\n")
        await settle()
        [(status, headers, body)] = responses(t.data)
        assert status == 200 and headers["content-type"] == "application/json"
        assert "connection" not in headers and "date" in headers
        assert int(headers["content-length"]) == len(body)
        got = orjson.loads(body)
        assert got["path"] == "/echo" and got["query"] == {"a": "3", "b": " two"}
        assert got["headers"]["x-tag"] == "one, two" and got["headers"]["cookie"] == "a=1; b=2"
        assert got["client"] == ["10.0.0.7", 4242]
        assert not t.closing
    run(main())


def test_content_length_and_chunked_bodies_split_across_reads():
    async def main():
        proto, t = connect(echo_router())
        for piece in (b"POST /echo HTTP/1.1\r\nContent-Le", b"ngth: 11\r\n\r\nhello", b" world"):
            proto.data_received(piece)
        await settle()
        proto.data_received(b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                            b"5\r\nchunk\r\n")
        proto.data_received(b"3\r\ned!\r\n0\r\n\r\n")
        await settle()
        bodies = [orjson.loads(b)["body"] for _, _, b in responses(t.data)]
        assert bodies == ["hello world", "chunked!"]
    run(main())


def test_json_parsing_errors_are_400_in_openai_shape():
    async def main():
        proto, t = connect(echo_router())
        for body in (b'{"a": [1, 2]}', b"{not json", b"[1, 2]", b""):
            proto.data_received(b"POST /json HTTP/1.1\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
            await settle()
        (s1, _, b1), (s2, _, b2), (s3, _, b3), (s4, _, b4) = responses(t.data)
        assert (s1, orjson.loads(b1)) == (200, {"a": [1, 2]})
        assert s2 == s3 == s4 == 400
        assert "malformed JSON" in orjson.loads(b2)["error"]["message"]
        assert "JSON object" in orjson.loads(b3)["error"]["message"]
        assert set(orjson.loads(b4)["error"]) == {"message", "type", "param", "code"}
        assert not t.closing      # a bad body is the handler's 400; the connection stays usable
    run(main())


@pytest.mark.parametrize("request_head,want_close,want_header", [
    (b"GET /echo HTTP/1.1\r\nConnection: close\r\n\r\n", True, "close"),
    (b"GET /echo HTTP/1.0\r\n\r\n", True, "close"),
    (b"GET /echo HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", False, "keep-alive"),
    (b"GET /echo HTTP/1.1\r\n\r\n", False, None),
    (b"GET /echo HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n", True, "close"),   # not offered
])
def test_connection_keep_alive_rules(request_head, want_close, want_header):
    async def main():
        proto, t = connect(echo_router())
        proto.data_received(request_head)
        await settle()
        [(status, headers, _)] = responses(t.data)
        assert status == 200 and headers.get("connection") == want_header
        assert t.closing == want_close
    run(main())


def test_pipelined_requests_answered_in_order_one_at_a_time():
    async def main():
        router = Router()
        gate = asyncio.Event()
        started = []

        async def slow(request, response):
            started.append("slow")
            await gate.wait()
            response.send_json(200, {"n": "slow"})

        async def fast(request, response):
            started.append(request.query["n"])
            response.send_json(200, {"n": request.query["n"]})

        router.add("GET", "/slow", slow)
        router.add("GET", "/fast", fast)
        proto, t = connect(router)
        proto.data_received(b"GET /slow HTTP/1.1\r\n\r\nGET /fast?n=1 HTTP/1.1\r\n\r\n"
                            b"POST /fast?n=2 HTTP/1.1\r\nContent-Length: 0\r\n\r\nGET /fast?n=3 HTTP/1.1\r\n\r\n")
        await settle()
        assert started == ["slow"] and t.writes == []     # the rest waits for the first answer
        gate.set()
        await settle(10)
        got = responses(t.data)
        assert [s for s, _, _ in got] == [200, 200, 405, 200]
        assert [orjson.loads(b).get("n") for _, _, b in got] == ["slow", "1", None, "3"]
        assert started == ["slow", "1", "3"]
    run(main())


def test_too_many_pipelined_requests_pause_reading():
    async def main():
        slow, gate = gated_handler()
        proto, t = connect_to(slow, max_pipelined=2)
        proto.data_received(b"GET / HTTP/1.1\r\n\r\n" * 4)
        await settle()
        assert not t.reading
        gate.set()
        await settle(20)
        assert t.reading and len(responses(t.data)) == 4
    run(main())


# -- protocol-level errors ----------------------------------------------------------------
def test_expect_100_continue():
    async def main():
        proto, t = connect(echo_router())
        proto.data_received(b"POST /echo HTTP/1.1\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
        assert t.data == b"HTTP/1.1 100 Continue\r\n\r\n"
        proto.data_received(b"abcd")
        await settle()
        (s100, _, _), (status, _, body) = responses(t.data)
        assert s100 == 100 and status == 200 and orjson.loads(body)["body"] == "abcd"
    run(main())


def test_content_length_over_limit_is_413_before_the_body_and_closes():
    async def main():
        called = []
        router = Router()
        router.add("POST", "/x", lambda req, resp: called.append(1))
        proto, t = connect(router, max_body_bytes=1000)
        proto.data_received(b"POST /x HTTP/1.1\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n" + b"a" * 100)
        await settle()
        [(status, headers, body)] = responses(t.data)
        assert status == 413 and headers["connection"] == "close"
        assert orjson.loads(body)["error"]["code"] == "request_too_large"
        assert t.eof and not t.closing          # lingering: FIN sent, still draining the upload
        proto.data_received(b"b" * 4900)        # dropped, not parsed or buffered
        assert len(t.writes) == 1 and not called and proto._body == []
        proto.eof_received()
    run(main())


def test_chunked_body_over_limit_is_413_without_buffering_it():
    async def main():
        proto, t = connect(echo_router(), max_body_bytes=1024)
        proto.data_received(b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
        proto.data_received(b"400\r\n" + b"x" * 1024 + b"\r\n")
        assert t.writes == []
        proto.data_received(b"400\r\n" + b"y" * 1024 + b"\r\n")
        await settle()
        [(status, _, _)] = responses(t.data)
        assert status == 413 and t.eof
    run(main())


def test_malformed_http_is_400_and_closes_after_earlier_answers():
    async def main():
        proto, t = connect(echo_router())
        proto.data_received(b"GET /echo HTTP/1.1\r\n\r\nGARBAGE\x00\x01 / HTTP/9\r\n\r\n")
        await settle()
        (s1, _, _), (s2, headers, body) = responses(t.data)
        assert s1 == 200 and s2 == 400 and headers["connection"] == "close"
        assert "malformed" in orjson.loads(body)["error"]["message"]
        assert t.eof
    run(main())


def test_lingering_close_ends_on_timer():
    async def main():
        proto, t = connect(echo_router(), lingering_close_s=0.05)
        proto.data_received(b"NOT HTTP\r\n\r\n")
        await settle()
        assert t.eof and not t.closing
        await asyncio.sleep(0.1)
        assert t.closing and proto.disconnected
    run(main())


@pytest.mark.parametrize("head", [
    b"GET /echo HTTP/1.1\r\nX-Big: " + b"v" * 3000 + b"\r\n\r\n",     # one complete section
    b"GET /echo HTTP/1.1\r\nX-Big: " + b"v" * 3000,                   # never ends
    b"GET /" + b"u" * 3000 + b" HTTP/1.1\r\n\r\n",
])
def test_header_section_too_large_is_431(head):
    async def main():
        proto, t = connect(echo_router(), max_header_bytes=2048)
        for i in range(0, len(head), 500):
            proto.data_received(head[i:i + 500])
        await settle()
        [(status, headers, _)] = responses(t.data)
        assert status == 431 and headers["connection"] == "close"
    run(main())


# -- handler failures ---------------------------------------------------------------------
def test_handler_errors():
    async def main():
        router = Router()

        async def boom(request, response):
            raise RuntimeError("bug")

        async def refuse(request, response):
            raise HTTPError(429, "slow down", type="rate_limit_error", headers={"Retry-After": "1"})

        async def silent(request, response):
            pass

        async def ok(request, response):
            response.send_json(200, {"ok": True})

        router.add("GET", "/boom", boom)
        router.add("GET", "/refuse", refuse, dialect="anthropic")
        router.add("GET", "/silent", silent)
        router.add("GET", "/ok", ok)
        proto, t = connect(router)
        proto.data_received(b"GET /boom HTTP/1.1\r\n\r\nGET /refuse HTTP/1.1\r\n\r\n"
                            b"GET /silent HTTP/1.1\r\n\r\nGET /ok HTTP/1.1\r\n\r\n")
        await settle(20)
        (s1, _, b1), (s2, h2, b2), (s3, _, _), (s4, _, b4) = responses(t.data)
        assert s1 == 500 and orjson.loads(b1)["error"]["type"] == "server_error"
        assert s2 == 429 and h2["retry-after"] == "1"
        assert orjson.loads(b2) == {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
        assert s3 == 500
        assert s4 == 200 and orjson.loads(b4) == {"ok": True} and not t.closing
    run(main())


def test_exception_mid_stream_cuts_the_connection():
    async def main():
        router = Router()

        aborted = []

        async def stream(request, response):
            response.on_disconnect(lambda: aborted.append("stream"))
            response.start_stream()
            await response.write(sse_event({"n": 1}))
            raise RuntimeError("engine failed")

        async def before_start(request, response):
            response.on_disconnect(lambda: aborted.append("before"))
            raise RuntimeError("tokenizer failed")

        router.add("GET", "/s", stream)
        router.add("GET", "/b", before_start)
        proto, t = connect(router)
        proto.data_received(b"GET /b HTTP/1.1\r\n\r\n")
        await settle()
        assert aborted == ["before"] and responses(t.data)[0][0] == 500
        t.writes.clear()
        proto.data_received(b"GET /s HTTP/1.1\r\n\r\nGET /s HTTP/1.1\r\n\r\n")
        await settle()
        assert aborted == ["before", "stream"]    # the engine request would be aborted, not leaked
        assert t.closing and not t.data.endswith(b"0\r\n\r\n")
        assert t.data.count(b"HTTP/1.1 200") == 1          # the pipelined second one is dropped
        assert b'data: {"n":1}\n\n' in t.data
    run(main())


# -- streaming, flow control, disconnects -------------------------------------------------
def test_stream_framing_and_sse_headers():
    async def main():
        async def stream(request, response):
            response.start_stream(headers={"X-Request-Id": "r1"})
            await response.write(sse_event({"n": 1}))
            await response.write(b"")                     # empty: skipped, would end the stream
            await response.write(SSE_DONE)
            response.end_stream()
            with pytest.raises(RuntimeError):
                await response.write(b"late")

        proto, t = connect_to(stream)
        proto.data_received(b"GET / HTTP/1.1\r\n\r\n")
        await settle()
        [(status, headers, body)] = responses(t.data)
        assert status == 200 and headers["transfer-encoding"] == "chunked"
        assert headers["content-type"] == "text/event-stream" and headers["cache-control"] == "no-cache"
        assert headers["x-accel-buffering"] == "no" and headers["x-request-id"] == "r1"
        assert body == b'data: {"n":1}\n\ndata: [DONE]\n\n'
        assert len(t.writes) == 4          # head, 2 chunks, terminator: one write per event
    run(main())


def test_http_10_stream_is_unframed_and_closes():
    async def main():
        async def stream(request, response):
            response.start_stream()
            await response.write(b"data: x\n\n")
            response.end_stream()

        proto, t = connect_to(stream)
        proto.data_received(b"GET / HTTP/1.0\r\n\r\n")
        await settle()
        assert t.data.endswith(b"\r\n\r\ndata: x\n\n") and b"chunked" not in t.data and t.closing
    run(main())


def test_write_waits_while_paused_and_resumes():
    async def main():
        progress = []

        async def stream(request, response):
            response.start_stream()
            for i in range(3):
                await response.write(b"data: %d\n\n" % i)
                progress.append(i)
            response.end_stream()

        proto, t = connect_to(stream)
        proto.pause_writing()
        assert not t.reading                 # no new requests read while the client is not reading
        proto.data_received(b"GET / HTTP/1.1\r\n\r\n")   # already in the socket buffer
        await settle()
        assert progress == [] and len(t.writes) == 1     # headers only; write() is waiting
        proto.resume_writing()
        await settle()
        assert progress == [0, 1, 2] and t.reading and t.data.endswith(b"0\r\n\r\n")
    run(main())


def test_disconnect_while_paused_wakes_writer_and_fires_callbacks():
    async def main():
        seen = {}

        async def stream(request, response):
            response.on_disconnect(lambda: seen.setdefault("callback", response.disconnected))
            watcher = asyncio.ensure_future(response.wait_disconnected())
            response.start_stream()
            await response.write(b"data: 1\n\n")      # waits: paused
            seen["after_write"] = response.disconnected
            await response.write(b"data: 2\n\n")      # no-op, no exception
            response.end_stream()
            seen["watcher"] = await watcher
            late = []
            response.on_disconnect(lambda: late.append(1))
            seen["late"] = late

        proto, t = connect_to(stream)
        proto.data_received(b"GET / HTTP/1.1\r\n\r\n")
        proto.pause_writing()
        await settle()
        n_writes = len(t.writes)
        proto.connection_lost(ConnectionResetError())
        await settle()
        # The late callback is not run: the response had finished, there is nothing to abort.
        assert seen == {"callback": True, "after_write": True, "watcher": True, "late": []}
        assert len(t.writes) == n_writes          # nothing written after the client left
    run(main())


def test_on_disconnect_not_fired_after_response_finished():
    async def main():
        fired = []

        async def ok(request, response):
            response.on_disconnect(lambda: fired.append(1))
            response.send_json(200, {})
            assert await response.wait_disconnected() is False

        proto, t = connect_to(ok)
        proto.data_received(b"GET / HTTP/1.1\r\n\r\n")
        await settle()
        proto.connection_lost(None)
        await settle()
        assert fired == [] and responses(t.data)[0][0] == 200
    run(main())


def test_idle_keep_alive_timeout_closes():
    async def main():
        proto, t = connect(echo_router(), keep_alive_timeout_s=0.05)
        proto.data_received(b"GET /echo HTTP/1.1\r\n\r\n")
        await asyncio.sleep(0.03)
        assert not t.closing and responses(t.data)[0][0] == 200
        await asyncio.sleep(0.06)
        assert t.closing
    run(main())


def test_timer_does_not_close_a_busy_connection():
    async def main():
        async def slow(request, response):
            await asyncio.sleep(0.15)
            response.send_json(200, {})

        proto, t = connect_to(slow, keep_alive_timeout_s=0.1)
        proto.data_received(b"GET / HTTP/1.1\r\n\r\n")
        await asyncio.sleep(0.18)      # past the 0.1 s timeout; the handler ran 0.15 s of it
        assert responses(t.data)[0][0] == 200 and not t.closing
        await asyncio.sleep(0.15)      # idle again since 0.15 s: now it closes
        assert t.closing
    run(main())


def test_begin_drain_closes_idle_and_busy_after_response():
    async def main():
        slow, gate = gated_handler()
        idle, t_idle = connect_to(slow)
        busy, t_busy = connect_to(slow)
        busy.data_received(b"GET / HTTP/1.1\r\n\r\n")
        await settle()
        idle.begin_drain()
        busy.begin_drain()
        assert t_idle.closing and not t_busy.closing
        gate.set()
        await settle()
        [(status, headers, _)] = responses(t_busy.data)
        assert status == 200 and headers["connection"] == "close" and t_busy.closing
    run(main())


# -- routing, guards, dialects ------------------------------------------------------------
def test_router_404_405_guard_and_dialects():
    async def main():
        router = Router()
        calls = []

        async def guard(request):
            calls.append(request.path)
            if request.headers.get("x-api-key") != "k":
                raise HTTPError(401, "bad key", type="invalid_request_error", code="invalid_api_key")

        async def ok(request, response):
            response.send_json(200, {"ok": request.path})

        router.add("GET", "/health", ok)
        router.add("POST", "/v1/chat/completions", ok)
        router.add("POST", "/v1/messages", ok, dialect="anthropic")
        router.set_guard("/v1/", guard)
        proto, t = connect(router)
        for line in (b"GET /health", b"POST /v1/chat/completions", b"POST /v1/messages",
                     b"GET /v1/messages", b"GET /v1/nothing"):
            proto.data_received(line + b" HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
            await settle()
        proto.data_received(b"POST /v1/messages HTTP/1.1\r\nx-api-key: k\r\nContent-Length: 0\r\n\r\n")
        await settle()
        got = responses(t.data)
        assert [s for s, _, _ in got] == [200, 401, 401, 405, 404, 200]
        assert orjson.loads(got[1][2])["error"]["code"] == "invalid_api_key"
        assert orjson.loads(got[2][2]) == {"type": "error", "error": {"type": "authentication_error",
                                                                      "message": "bad key"}}
        assert got[3][1]["allow"] == "POST" and orjson.loads(got[3][2])["type"] == "error"
        assert set(orjson.loads(got[4][2])["error"]) == {"message", "type", "param", "code"}
        assert calls == ["/v1/chat/completions", "/v1/messages", "/v1/messages"]
    run(main())


def test_router_rejects_duplicates_and_bad_dialects():
    router = Router()
    router.add("get", "/a", None)
    with pytest.raises(ValueError):
        router.add("GET", "/a", None)
    with pytest.raises(ValueError):
        router.add("GET", "/b", None, dialect="klingon")
    with pytest.raises(ValueError):
        router.add("GET", "b", None)
    assert router.resolve("GET", "/a").method == "GET" and len(router) == 1


# -- SSE, error bodies, config -----------------------------------------------------------
def test_sse_encoding():
    assert sse_event({"a": 1, "b": "x\ny"}) == b'data: {"a":1,"b":"x\\ny"}\n\n'
    assert sse_event([1, 2], event="list") == b"event: list\ndata: [1,2]\n\n"
    assert sse_event("one\ntwo\r\nthree") == b"data: one\ndata: two\ndata: three\n\n"
    assert sse_event(b"raw", event="message_stop") == b"event: message_stop\ndata: raw\n\n"
    assert SSE_DONE == b"data: [DONE]\n\n" and SSE_PING == sse_comment() == b": ping\n\n"
    with pytest.raises(ValueError):
        sse_event("x", event="bad\nname")


def test_error_bodies():
    assert json.loads(error_body(400, "m", param="p")) == {
        "error": {"message": "m", "type": "invalid_request_error", "param": "p", "code": None}}
    assert json.loads(error_body(503, "loading", code="model_loading"))["error"]["type"] == "service_unavailable"
    anth = json.loads(HTTPError(503, "loading", type="service_unavailable").body("anthropic"))
    assert anth == {"type": "error", "error": {"type": "overloaded_error", "message": "loading"}}
    assert json.loads(HTTPError(404, "x", dialect="anthropic").body("openai"))["error"]["type"] == "not_found_error"
    with pytest.raises(ValueError):
        HTTPError(200, "not an error")


@pytest.mark.parametrize("bad", [{"max_body_bytes": 0}, {"keep_alive_timeout_s": 0}, {"max_header_bytes": 10},
                                 {"max_pipelined": 1.5}, {"lingering_close_s": -1}])
def test_config_validation(bad):
    with pytest.raises(ValueError):
        HttpConfig(**bad)
    with pytest.raises(Exception):
        HttpConfig().max_body_bytes = 1    # frozen
