"""The HTTP layer end to end: a real server on 127.0.0.1 (ephemeral port), driven by raw
sockets, http.client and urllib from a worker thread while the server's loop runs."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from freetoken.server.errors import HTTPError
from freetoken.server.http import SSE_DONE, HttpConfig, Router, sse_event, start_server

try:
    import uvloop
    LOOPS = {"uvloop": uvloop.new_event_loop, "asyncio": None}
except ImportError:   # pragma: no cover
    LOOPS = {"asyncio": None}


class App:
    """Routes the tests use, plus what the handlers saw (read after the client is done)."""

    def __init__(self):
        self.router = Router()
        self.disconnects: list[str] = []
        self.chunks_written: dict[str, int] = {}
        self.stream_gone = asyncio.Event()
        r = self.router
        r.add("GET", "/hello", self.hello)
        r.add("POST", "/echo", self.echo)
        r.add("GET", "/boom", self.boom)
        r.add("GET", "/stream", self.stream)
        r.add("GET", "/forever", self.forever)
        r.add("POST", "/v1/messages", self.hello, dialect="anthropic")
        r.set_guard("/v1/", self.guard)

    async def guard(self, request):
        if request.headers.get("x-api-key") != "k":
            raise HTTPError(401, "bad key")

    async def hello(self, request, response):
        response.send_json(200, {"hello": request.query.get("name", "world")})

    async def echo(self, request, response):
        response.send_bytes(200, request.body, "application/octet-stream")

    async def boom(self, request, response):
        raise ValueError("handler bug")

    async def stream(self, request, response):
        """n events of size bytes, `delay` s apart."""
        name = request.query.get("id", "s")
        n, size, delay = int(request.query.get("n", 5)), int(request.query.get("size", 10)), \
            float(request.query.get("delay", 0))
        response.on_disconnect(lambda: self.disconnects.append(name))
        response.start_stream()
        payload = "x" * size
        for i in range(n):
            await response.write(sse_event({"i": i, "p": payload}))
            self.chunks_written[name] = i + 1
            if response.disconnected:
                return
            if delay:
                await asyncio.sleep(delay)
        await response.write(SSE_DONE)
        response.end_stream()

    async def forever(self, request, response):
        response.on_disconnect(lambda: self.disconnects.append("forever"))
        response.start_stream()
        try:
            while not response.disconnected:
                await response.write(sse_event({"tick": 1}))
                await asyncio.sleep(0.01)
        finally:
            self.stream_gone.set()


def serve(client, loop: str = "uvloop", **config):
    """Start a server, run client(app, port) in a thread, shut down; return (app, result)."""
    async def main():
        app = App()
        server = await start_server(app.router, "127.0.0.1", 0, HttpConfig(**config))
        try:
            result = await asyncio.wait_for(asyncio.to_thread(client, app, server.port), 15)
        finally:
            await server.shutdown(timeout=0.5)
        return app, result

    with asyncio.Runner(loop_factory=LOOPS.get(loop)) as runner:
        return runner.run(main())


def send_raw(port: int, data: bytes) -> socket.socket:
    """A new connection to the server with `data` already sent on it."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(data)
    return s


def recv_all(sock: socket.socket, timeout: float = 5) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def wait_until(done, timeout: float = 3) -> bool:
    """Poll done() every 10 ms (from the client's thread) until it is true or `timeout` s pass;
    returns its last value."""
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)
    return done()


@pytest.mark.parametrize("loop", list(LOOPS))
def test_keep_alive_http_client_and_errors(loop):
    def client(app, port):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        out = []
        for method, path, body in [("GET", "/hello?name=ft", None), ("POST", "/echo", b"\x00bytes"),
                                   ("GET", "/boom", None), ("GET", "/nope", None), ("DELETE", "/echo", None),
                                   ("POST", "/v1/messages", b"{}"), ("GET", "/hello", None)]:
            c.request(method, path, body=body)
            r = c.getresponse()
            out.append((r.status, r.getheader("allow"), r.read()))
        sock_after = c.sock
        c.close()
        return out, sock_after is not None

    _, (out, same_socket) = serve(client, loop)
    assert out[0] == (200, None, b'{"hello":"ft"}')
    assert out[1] == (200, None, b"\x00bytes")
    assert out[2][0] == 500 and json.loads(out[2][2])["error"]["type"] == "server_error"
    assert out[3][0] == 404 and out[4][:2] == (405, "POST")
    assert json.loads(out[5][2]) == {"type": "error", "error": {"type": "authentication_error", "message": "bad key"}}
    assert out[6] == (200, None, b'{"hello":"world"}')
    assert same_socket        # http.client never had to reconnect: one keep-alive connection


def test_raw_pipelining_chunked_upload_and_connection_close():
    def client(app, port):
        s = send_raw(port, b"GET /hello?name=a HTTP/1.1\r\nHost: x\r\n\r\n"
                           b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                           b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
                           b"GET /stream?n=2 HTTP/1.1\r\nHost: x\r\n\r\n"
                           b"GET /hello?name=b HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return recv_all(s)

    _, data = serve(client)
    assert data.count(b"HTTP/1.1 200 OK") == 4
    i_a, i_echo, i_stream, i_b = (data.index(x) for x in (b'{"hello":"a"}', b"\r\n\r\nabcde", b"data: [DONE]",
                                                             b'{"hello":"b"}'))
    assert i_a < i_echo < i_stream < i_b      # answered in order
    assert b"connection: close" in data[data.rindex(b"HTTP/1.1"):]   # and then closed: recv hit EOF


def test_sse_stream_with_http_client():
    def client(app, port):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        c.request("GET", "/stream?n=3&delay=0.01")
        r = c.getresponse()
        return r.status, r.getheader("content-type"), r.getheader("transfer-encoding"), r.read()

    _, (status, ctype, te, body) = serve(client)
    events = body.split(b"\n\n")
    assert status == 200 and ctype == "text/event-stream" and te == "chunked"
    assert [json.loads(e[6:])["i"] for e in events[:3]] == [0, 1, 2] and events[3] == b"data: [DONE]"


def test_expect_100_continue_over_a_socket():
    def client(app, port):
        s = send_raw(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        interim = s.recv(100)
        s.sendall(b"hello")
        time.sleep(0.05)
        s.sendall(b"GET /hello HTTP/1.1\r\nConnection: close\r\n\r\n")
        return interim, recv_all(s)

    _, (interim, rest) = serve(client)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert rest.startswith(b"HTTP/1.1 200 OK") and b"\r\n\r\nhello" in rest


def test_body_over_limit_is_413_and_the_client_reads_it():
    big = b"x" * (8 * 2**20)          # far more than the socket buffers hold

    def client(app, port):
        req = urllib.request.Request(f"http://127.0.0.1:{port}/echo", data=big, method="POST")
        try:
            urllib.request.urlopen(req, timeout=10)
        except urllib.error.HTTPError as e:
            return e.code, e.headers.get("connection"), json.loads(e.read())
        return None

    _, (status, conn, body) = serve(client, max_body_bytes=64 * 1024)
    assert status == 413 and conn == "close" and body["error"]["code"] == "request_too_large"


def test_malformed_and_oversized_headers_close_the_connection():
    def client(app, port):
        out = []
        for raw in (b"GARBAGE\x00\x01 / HTTP/9\r\n\r\n",
                    b"GET /hello HTTP/1.1\r\nX-Big: " + b"v" * 5000 + b"\r\n\r\n"):
            s = send_raw(port, raw)
            out.append(recv_all(s))     # returns: the server closed
            s.close()
        return out

    _, (bad, big) = serve(client, max_header_bytes=4096)
    assert bad.startswith(b"HTTP/1.1 400") and b"connection: close" in bad
    assert big.startswith(b"HTTP/1.1 431")


def test_idle_keep_alive_connection_is_closed():
    def client(app, port):
        s = send_raw(port, b"GET /hello HTTP/1.1\r\n\r\n")
        t0 = time.monotonic()
        data = recv_all(s)
        return data, time.monotonic() - t0

    _, (data, waited) = serve(client, keep_alive_timeout_s=0.3)
    assert data.startswith(b"HTTP/1.1 200") and b"connection: close" not in data
    assert 0.25 < waited < 3


def test_slow_reader_does_not_stall_other_streams():
    def client(app, port):
        slow = socket.create_connection(("127.0.0.1", port))
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        # 2000 events of 64 KiB = 128 MiB: the server must stop at its write buffer, not queue it.
        slow.sendall(b"GET /stream?id=slow&n=2000&size=65536 HTTP/1.1\r\n\r\n")
        time.sleep(0.3)
        stalled_at = app.chunks_written.get("slow", 0)
        t0 = time.monotonic()
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        c.request("GET", "/stream?id=fast&n=50")
        body = c.getresponse().read()
        fast_s = time.monotonic() - t0
        time.sleep(0.1)
        written_while_stalled = (stalled_at, app.chunks_written.get("slow", 0))
        slow.close()
        wait_until(lambda: "slow" in app.disconnects)
        return body, fast_s, written_while_stalled

    app, (body, fast_s, written) = serve(client)
    assert body.endswith(b"data: [DONE]\n\n") and fast_s < 1.0
    # Blocked in write() by flow control: no progress while the client does not read, and
    # far from all 2000 events queued (the rest is the kernel's socket buffers).
    assert 0 < written[0] == written[1] < 500
    assert app.disconnects == ["slow"]       # only the slow one went away, and it was told


def test_client_disconnect_mid_stream_fires_callback():
    def client(app, port):
        s = send_raw(port, b"GET /forever HTTP/1.1\r\n\r\n")
        first = s.recv(4096)
        s.close()
        return first, wait_until(app.stream_gone.is_set)

    app, (first, ended) = serve(client)
    assert first.startswith(b"HTTP/1.1 200") and ended and app.disconnects == ["forever"]


@pytest.mark.parametrize("loop", list(LOOPS))
def test_graceful_shutdown(loop):
    async def main():
        app = App()
        server = await start_server(app.router, "127.0.0.1", 0, HttpConfig())
        port = server.port

        def finishing_stream():
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/stream?n=10&delay=0.03")
            r = c.getresponse()
            return r.read()

        def endless_stream():
            return recv_all(send_raw(port, b"GET /forever HTTP/1.1\r\n\r\n"))

        def idle_keep_alive():
            return recv_all(send_raw(port, b"GET /hello HTTP/1.1\r\n\r\n"))

        finishing = asyncio.create_task(asyncio.to_thread(finishing_stream))
        endless = asyncio.create_task(asyncio.to_thread(endless_stream))
        idle = asyncio.create_task(asyncio.to_thread(idle_keep_alive))
        await asyncio.sleep(0.15)
        t0 = time.monotonic()
        await server.shutdown(timeout=0.6)
        took = time.monotonic() - t0
        refused = False
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            refused = True
        return (await finishing, await endless, await idle, took, refused, app)

    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        body, endless, idle, took, refused, app = runner.run(main())
    assert body.endswith(b"data: [DONE]\n\n") and body.count(b'"i":') == 10   # finished in time
    assert endless.startswith(b"HTTP/1.1 200") and not endless.endswith(b"0\r\n\r\n")   # cut off
    assert idle.startswith(b"HTTP/1.1 200")    # the idle keep-alive connection was closed at once
    assert 0.5 < took < 2 and refused and app.stream_gone.is_set() and "forever" in app.disconnects
