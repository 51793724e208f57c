"""The server never dies from a request: when an engine step fails mid-stream, every dialect
ends the stream with its own error event (OpenAI's SDK raises on it), the failed requests'
KV blocks are freed, and the next request is served as if nothing happened.

The server runs in this process (tests/serving.py InProcessServer: the real app, HTTP server
and engine on a uvloop thread) so the test can make one engine step raise.
"""

from __future__ import annotations

import openai
import pytest

from serving import InProcessServer

MODEL = "tiny-faults"
USER = [{"role": "user", "content": "Tell me about the lighthouse keeper."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from freetoken.demo.tiny_model import make_tiny_model
    model = make_tiny_model(tmp_path_factory.mktemp("faults") / MODEL, family="qwen3_moe", seed=0)
    with InProcessServer(model, name=MODEL) as s:
        yield s


class FailOnce:
    """Stands in for EngineCore.run_step (the forward and sampler, on the engine thread): the
    real one, except that call number `at` raises."""

    def __init__(self, core, at: int):
        self.core, self.real, self.at, self.calls = core, core.run_step, at, 0

    def __call__(self, plan):
        self.calls += 1
        if self.calls == self.at:
            self.core.run_step = self.real
            raise RuntimeError("injected fault")
        return self.real(plan)


def inject(server, at: int = 3) -> FailOnce:
    core = server.app.engine.core
    core.run_step = FailOnce(core, at)
    return core.run_step


def kv_in_use(server) -> int:
    alloc = server.app.engine.core.runner.allocator
    return alloc.num_blocks - alloc.num_free


def healthy(server) -> None:
    status, body = server.request("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": USER, "max_tokens": 4, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 4, body
    assert kv_in_use(server) == 0
    assert server.request("GET", "/health")[1]["status"] == "ok"


BODY = {"model": MODEL, "max_tokens": 32, "temperature": 0, "stream": True, "ignore_eos": True}


def test_chat_completions_stream_ends_with_an_error_event(server):
    inject(server)
    events = server.sse("/v1/chat/completions", {**BODY, "messages": USER})
    assert events[-1][1]["error"]["type"] == "server_error", events[-3:]
    assert "injected fault" in events[-1][1]["error"]["message"]
    assert "[DONE]" not in [d for _, d in events] and len(events) >= 2
    healthy(server)


def test_responses_stream_ends_with_an_error_event(server):
    inject(server)
    body = {k: v for k, v in BODY.items() if k != "max_tokens"}
    events = server.sse("/v1/responses", {**body, "input": "Tell me a story.", "max_output_tokens": 32})
    name, data = events[-1]
    assert name == "error" and data["code"] == "server_error" and "injected fault" in data["message"]
    assert events[0][0] == "response.created"
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    healthy(server)


def test_messages_stream_ends_with_an_error_event(server):
    inject(server)
    events = server.sse("/v1/messages", {**BODY, "messages": USER})
    name, data = events[-1]
    assert name == "error" and data["error"]["type"] == "api_error"
    assert events[0][0] == "message_start" and "message_stop" not in [n for n, _ in events]
    healthy(server)


def test_non_streaming_requests_get_a_500_with_the_engines_words_and_the_sdk_raises(server):
    inject(server, at=2)
    status, body = server.request("POST", "/v1/chat/completions",
                                  {"model": MODEL, "messages": USER, "max_tokens": 8})
    assert status == 500 and "injected fault" in body["error"]["message"], body
    inject(server, at=2)
    status, body = server.request("POST", "/v1/messages", {"model": MODEL, "messages": USER, "max_tokens": 8})
    assert status == 500 and body["error"]["type"] == "api_error", body
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)
    inject(server, at=3)
    with pytest.raises(openai.APIError, match="injected fault"):
        for _ in client.chat.completions.create(model=MODEL, messages=USER, max_tokens=32,
                                                stream=True, extra_body={"ignore_eos": True}):
            pass
    healthy(server)


def test_requests_still_running_at_shutdown_get_a_503(tmp_path, monkeypatch):
    """Shutdown lets running requests finish for its grace period, then fails the rest as
    unavailable (503), not as an engine fault."""
    import threading

    from freetoken.demo.tiny_model import make_tiny_model
    monkeypatch.setenv("FREETOKEN_DEBUG_STEP_DELAY_S", "0.05")     # about 20 tokens a second
    server = InProcessServer(make_tiny_model(tmp_path / MODEL, family="qwen3_moe", seed=0),
                             name=MODEL, shutdown_timeout_s=0.3)
    got = {}

    def slow():
        got["answer"] = server.request("POST", "/v1/chat/completions", {
            "model": MODEL, "messages": USER, "max_tokens": 200, "ignore_eos": True})
    client = threading.Thread(target=slow)
    client.start()
    while not server.app.engine.streams:
        threading.Event().wait(0.01)
    server.close()
    client.join(30)
    status, body = got["answer"]
    assert status == 503 and "shutting down" in body["error"]["message"], body
