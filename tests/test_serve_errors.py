"""Every bad input gets its status and OpenAI's error shape; then normal requests still work.
Also: /health while loading, 503 before ready, auth, graceful shutdown."""

from __future__ import annotations

import socket
import time

import openai
import pytest

from serving import ServerProcess
from tiny_fixtures import tiny_model_dir  # noqa: F401 - a fixture

KEY = "sk-err-key"


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):  # noqa: F811 - the imported fixture
    return tiny_model_dir("qwen3_moe", seed=1, name="tiny", max_position_embeddings=256)


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess(model_dir, "--max-body-mb", "0.01", api_key=KEY) as s:
        yield s


def assert_error(status, body, want_status, param=None):
    assert status == want_status, body
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err


def chat(**over):
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **over}


@pytest.mark.parametrize("body,param", [
    (chat(temperature="hot"), "temperature"),
    (chat(temperature=5), "temperature"),
    (chat(top_p=1.5), "top_p"),
    (chat(max_tokens=0), "max_tokens"),
    (chat(max_tokens="many"), "max_tokens"),
    (chat(n=0), "n"),
    (chat(n=100), "n"),
    (chat(presence_penalty=-3), "presence_penalty"),
    (chat(logit_bias={"x": 1}), "logit_bias"),
    (chat(response_format={"type": "json_schema", "json_schema": {"schema": 5}}), "response_format.json_schema.schema"),
    (chat(stop=[1, 2]), "stop"),
    (chat(top_k=-7), "top_k"),
    (chat(seed="x"), "seed"),
    (chat(logprobs=True, top_logprobs=50), "top_logprobs"),
    (chat(stream="yes"), "stream"),
    (chat(max_tokens=300), "max_tokens"),                     # beyond the 256-token context
    ({"model": "tiny", "messages": []}, "messages"),
    ({"model": "tiny", "messages": "hello"}, "messages"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
])
def test_bad_chat_bodies(server, body, param):
    assert_error(*server.request("POST", "/v1/chat/completions", body), 400, param)


def test_bad_completion_bodies(server):
    assert_error(*server.request("POST", "/v1/completions", {"model": "tiny", "prompt": 5}), 400, "prompt")
    assert_error(*server.request("POST", "/v1/completions", {"model": "tiny", "prompt": [1, 10**9]}), 400)
    long = {"model": "tiny", "prompt": list(range(1, 300)), "max_tokens": 2}
    assert_error(*server.request("POST", "/v1/completions", long), 400, "prompt")
    batch = {"model": "tiny", "prompt": ["fine", list(range(1, 300))], "max_tokens": 2}
    assert_error(*server.request("POST", "/v1/completions", batch), 400, "prompt")
    assert_error(*server.request("POST", "/v1/completions", {"model": "tiny", "prompt": ["ok", 5]}), 400, "prompt")


def test_malformed_json_and_non_object(server):
    assert_error(*server.request("POST", "/v1/chat/completions", b"{not json"), 400)
    assert_error(*server.request("POST", "/v1/chat/completions", b"[1, 2]"), 400)


def test_auth(server):
    for headers in ({"Authorization": "Bearer wrong"}, {"x-api-key": "nope"}, {"Authorization": ""}):
        assert_error(*server.request("GET", "/v1/models", headers=headers), 401)
    status, _ = server.request("GET", "/v1/models", headers={"x-api-key": KEY})
    assert status == 200
    bad = openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert server.health()[0] == 200       # /health never needs the key


def test_unknown_model_path_method_and_big_body(server):
    assert_error(*server.request("POST", "/v1/chat/completions", chat(model="gpt-9")), 404, "model")
    assert_error(*server.request("GET", "/v1/nothing-here"), 404)
    assert_error(*server.request("GET", "/v1/chat/completions"), 405)
    huge = chat(messages=[{"role": "user", "content": "x" * 20000}])
    assert_error(*server.request("POST", "/v1/chat/completions", huge), 413)


def test_malformed_http_closes_connection(server):
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(b"GARBAGE\x00\x01 / HTTP/9\r\n\r\n")
    data = b""
    s.settimeout(5)
    while True:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    assert data.startswith(b"HTTP/1.1 400")
    s.close()


def test_still_serving_after_bad_input(server):
    c = openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0)
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                  max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_health_while_loading_then_ready_and_graceful_exit(model_dir):
    env = {"FREETOKEN_DEBUG_LOAD_DELAY_S": "2", "FREETOKEN_PREFILL_WARMUP": "1",
           "FREETOKEN_WARMUP_MAX_DEPTH": "100"}
    with ServerProcess(model_dir, "--max-prefill-length", "32", wait_ready=False, env=env) as s:
        status, body = s.health()
        assert status == 200 and body["status"] == "loading"
        assert set(body["progress"]) == {"done_bytes", "total_bytes"} and body["phase"]
        status, err = s.request("GET", "/v1/models")
        assert status == 503 and "loading" in err["error"]["message"]
        assert s.wait_ready(60)["status"] == "ok"
        assert s.request("GET", "/v1/models")[0] == 200
        assert s.stop() == 0
        assert "warmup: 19 extend lengths (1..32) and KV depth 100" in s.logs()
        assert "bye" in s.logs()


def test_failed_load_reports_error(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["Nope"], "model_type": "nope"}')
    with ServerProcess(tmp_path, wait_ready=False) as s:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status, body = s.health()
            if body["status"] == "error":
                break
            time.sleep(0.1)
        assert status == 503 and "supports" in body["detail"]
        assert s.request("GET", "/v1/models")[0] == 503
        # Not a zombie: the process exits non-zero by itself so a supervisor sees it.
        assert s.proc.wait(30) == 1
        assert "cannot serve model" in s.logs() and "Traceback" not in s.logs()


@pytest.mark.parametrize("model, hint", [("/nonexistent/model", "there is no folder"),
                                         ("nobody-org/not-cached-model", "hf download")])
def test_unloadable_model_exits_nonzero_with_one_paragraph(tmp_path, model, hint):
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    with ServerProcess(model, wait_ready=False, env=env) as s:
        assert s.proc.wait(30) == 1
        logs = s.logs()
    errors = [line for line in logs.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and hint in errors[0] and model in errors[0], logs
    assert "Traceback" not in logs
