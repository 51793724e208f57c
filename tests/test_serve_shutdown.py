"""SIGTERM on a real `ft serve`: --shutdown-timeout bounds the drain, a stream cut by it ends with
its dialect's error event and terminator, and each aborted request is logged and listed."""

from __future__ import annotations

import json
import signal
import socket
import time

from serving import ServerProcess
from tiny_fixtures import tiny_model_dir  # noqa: F401 - a fixture


def _open_stream(server, path: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    got = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return got
        got += chunk


def test_shutdown_cuts_streams_with_error_and_terminator(tiny_model_dir):  # noqa: F811
    model = tiny_model_dir("qwen3_moe", seed=0, name="tiny-qwen3", max_position_embeddings=2048)
    server = ServerProcess(model, "--shutdown-timeout", "0.5")
    try:
        # A client that leaves is listed in /v1/stats as aborted.
        gone = _open_stream(server, "/v1/completions", {"prompt": "x", "max_tokens": 1000, "stream": True,
                                                        "ignore_eos": True})
        gone.recv(4096)
        gone.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            recent = server.request("GET", "/v1/stats")[1]["recent_requests"]
            if recent and recent[-1]["finish_reason"] == "abort":
                break
            time.sleep(0.05)
        assert recent[-1]["finish_reason"] == "abort", recent
        body = {"max_tokens": 1500, "stream": True, "ignore_eos": True}
        chat = _open_stream(server, "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "hi"}]})
        resp = _open_stream(server, "/v1/responses", {**{k: v for k, v in body.items() if k != "max_tokens"},
                                                      "input": "hi", "max_output_tokens": 1500})
        for s in (chat, resp):
            got = b""
            while b"data:" not in got:
                got += s.recv(4096)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        chat_raw, resp_raw = _read_all(chat), _read_all(resp)
        code = server.proc.wait(30)
        took = time.monotonic() - t0
    finally:
        server.stop()
    assert code == 0 and took < 8, took
    events = [line[6:] for line in chat_raw.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "shutting down" in json.loads(events[-2])["error"]["message"]
    names = [line[7:] for line in resp_raw.decode().split("\n") if line.startswith("event: ")]
    assert names[-2:] == ["error", "response.failed"], names[-4:]
    logs = server.logs()
    assert logs.count("finish=abort") >= 3, logs[-2000:]
