"""End to end through a real `ft serve`: GET /v1/models/{id}, HEAD probes, CORS, and the smaller
request checks (Content-Encoding, over-long prompts, seed range, reasoning effort values)."""

from __future__ import annotations

import gzip
import http.client
import json

import openai
import pytest

from serving import ServerProcess
from tiny_fixtures import tiny_model_dir  # noqa: F401 - a fixture

ORIGIN = "http://localhost:5173"


@pytest.fixture(scope="module")
def server(tiny_model_dir):  # noqa: F811
    model_dir = tiny_model_dir("qwen3_moe", seed=0, name="tiny-qwen3", max_position_embeddings=256)
    with ServerProcess(model_dir, "--allowed-origins", json.dumps([ORIGIN])) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)


def _raw(server, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request(method, path, body=body, headers=headers or {})
    r = conn.getresponse()
    data = r.read()
    out = r.status, {k.lower(): v for k, v in r.getheaders()}, data
    # The connection must still be usable (a HEAD answer with a body would break it).
    conn.request("GET", "/health")
    again = conn.getresponse()
    assert again.status == 200 and json.loads(again.read())["status"] == "ok"
    conn.close()
    return out


def test_model_retrieve(client):
    m = client.models.retrieve("tiny-qwen3")
    assert m.id == "tiny-qwen3" and m.object == "model"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("org/other-model")


@pytest.mark.parametrize("path", ["/health", "/", "/v1/models"])
def test_head_probes(server, path):
    status, headers, body = _raw(server, "HEAD", path)
    get_status, get_headers, get_body = _raw(server, "GET", path)
    assert status == get_status == 200 and body == b""
    assert int(headers["content-length"]) == len(get_body) > 0
    status, _, body = _raw(server, "HEAD", "/nope")
    assert status == 404 and body == b""


def test_cors(server):
    status, headers, _ = _raw(server, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})
    assert status == 204
    assert headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in headers["access-control-allow-methods"]
    assert "x-stainless-os" in headers["access-control-allow-headers"]
    status, headers, _ = _raw(server, "GET", "/v1/models", headers={"Origin": ORIGIN})
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    status, headers, _ = _raw(server, "GET", "/v1/models", headers={"Origin": "http://evil.example"})
    assert status == 200 and "access-control-allow-origin" not in headers
    status, headers, _ = _raw(server, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert status == 405 and "access-control-allow-origin" not in headers


def test_content_encoding_is_415(server):
    body = gzip.compress(json.dumps({"prompt": "x", "max_tokens": 1}).encode())
    status, _, raw = _raw(server, "POST", "/v1/completions", body=body,
                          headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert status == 415 and "gzip" in json.loads(raw)["error"]["message"]


def test_request_checks_name_the_right_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-qwen3", prompt="word " * 400, max_tokens=1)
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError, match="out of range"):
        client.completions.create(model="tiny-qwen3", prompt="x", max_tokens=1, seed=1e23)
    with pytest.raises(openai.BadRequestError, match="out of range"):
        client.chat.completions.create(model="tiny-qwen3", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=1, seed=2**64)
    listed = client.models.list().data[0].model_extra["reasoning_efforts"]
    assert "max" not in listed and "high" in listed
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-qwen3", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=1, reasoning_effort="max")
    assert all(v in e.value.message for v in listed)
    r = client.chat.completions.create(model="tiny-qwen3", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=1, reasoning_effort="high")
    assert r.choices[0].finish_reason == "length"


def test_no_cors_without_the_flag(tiny_model_dir):  # noqa: F811
    with ServerProcess(tiny_model_dir("qwen3_moe", seed=0, name="tiny-qwen3", max_position_embeddings=256)) as s:
        status, headers, _ = _raw(s, "GET", "/health", headers={"Origin": ORIGIN})
        assert status == 200 and "access-control-allow-origin" not in headers


def test_logprob_bytes_are_the_tokens_own(client, tiny_model_dir):  # noqa: F811
    from freetoken.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(tiny_model_dir("qwen3_moe", seed=0, name="tiny-qwen3", max_position_embeddings=256))
    # A token holding the middle of a UTF-8 character (an emoji is several byte-level tokens).
    partial = next(i for i in tok.encode("🙂🎉") if tok.token_bytes(i) and tok.token_bytes(i)[0] >= 0x80
                   and not tok.token_bytes(i).decode("utf-8", "ignore"))
    r = client.chat.completions.create(model="tiny-qwen3", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=1, logprobs=True, top_logprobs=2,
                                       logit_bias={str(partial): 100}, reasoning_effort="none")
    item = r.choices[0].logprobs.content[0]
    assert bytes(item.bytes) == tok.token_bytes(partial) and b"\xef\xbf\xbd" not in bytes(item.bytes)
    # Completions: 20 alternatives give 20 distinct keys, partial tokens included.
    c = client.completions.create(model="tiny-qwen3", prompt="🙂🎉 ok", max_tokens=4, logprobs=20, echo=True,
                                  temperature=0)
    tops = [t for t in c.choices[0].logprobs.top_logprobs if t is not None]
    assert tops and all(len(t) == 20 for t in tops)
    assert any(k.startswith("bytes:") for k in c.choices[0].logprobs.tokens)
