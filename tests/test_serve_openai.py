"""End to end: a real listening `ft serve` on a tiny checkpoint, driven by the openai SDK."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import openai
import pytest

from serving import ServerProcess
from tiny_fixtures import tiny_model_dir  # noqa: F401 - a fixture

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def server(tiny_model_dir):  # noqa: F811 - the imported fixture
    model_dir = tiny_model_dir("qwen3_moe", seed=0, name="tiny-qwen3", max_position_embeddings=1024)
    with ServerProcess(model_dir, "--max-prefill-length", "64", api_key=KEY) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0)


MSGS = [{"role": "user", "content": "Write a short story about a lighthouse."}]


def test_models_list(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-qwen3"]
    status, body = server.request("GET", "/v1/models")
    assert body["data"][0]["max_model_len"] == 1024


def test_chat_stream_equals_non_stream(client):
    full = client.chat.completions.create(model="tiny-qwen3", messages=MSGS, max_tokens=24,
                                          temperature=0)
    choice = full.choices[0]
    assert choice.message.role == "assistant"
    assert full.usage.completion_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    pieces, finish = [], None
    for chunk in client.chat.completions.create(model="tiny-qwen3", messages=MSGS, max_tokens=24,
                                                temperature=0, stream=True):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == choice.message.content
    assert finish == choice.finish_reason


def test_parts_content_equals_string_content(client):
    a = client.chat.completions.create(model="tiny-qwen3", messages=MSGS, max_tokens=8, temperature=0)
    parts = [{"role": "user", "content": [{"type": "text", "text": MSGS[0]["content"][:10]},
                                          {"type": "text", "text": MSGS[0]["content"][10:]}]}]
    b = client.chat.completions.create(model="tiny-qwen3", messages=parts, max_tokens=8, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_usage_chunk(client):
    chunks = list(client.chat.completions.create(
        model="tiny-qwen3", messages=MSGS, max_completion_tokens=5, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_text_and_ids(client):
    r = client.completions.create(model="tiny-qwen3", prompt="Once upon a time", max_tokens=10,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.usage.completion_tokens == 10
    assert r.choices[0].finish_reason == "length"
    ids = client.completions.create(model="tiny-qwen3", prompt=[11, 12, 13, 14], max_tokens=4,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert ids.usage.prompt_tokens == 4
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny-qwen3", prompt="Once upon a time", max_tokens=10, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == r.choices[0].text


def test_logprobs(client):
    r = client.chat.completions.create(model="tiny-qwen3", messages=MSGS, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for item in content:
        assert len(item.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert abs(item.logprob - item.top_logprobs[0].logprob) < 1e-4
        assert item.logprob <= 0
    c = client.completions.create(model="tiny-qwen3", prompt="Hello", max_tokens=4, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    assert len(c.choices[0].logprobs.tokens) == 4
    assert len(c.choices[0].logprobs.top_logprobs[0]) == 2


def test_stop_strings(client):
    free = client.completions.create(model="tiny-qwen3", prompt="The sea", max_tokens=40,
                                     temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    assert len(free) > 12
    stop = free[6:9]
    cut = free.index(stop)
    for stream in (False, True):
        kwargs = dict(model="tiny-qwen3", prompt="The sea", max_tokens=40, temperature=0, stop=[stop],
                      extra_body={"ignore_eos": True})
        if stream:
            chunks = list(client.completions.create(stream=True, **kwargs))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            r = client.completions.create(**kwargs)
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert text == free[:cut], (stop, text, free)
        assert finish == "stop"


def test_seed_reproducible(client):
    def go(seed):
        return client.chat.completions.create(model="tiny-qwen3", messages=MSGS, max_tokens=16,
                                              temperature=1.0, seed=seed,
                                              extra_body={"ignore_eos": True}).choices[0].message.content
    assert go(42) == go(42)
    assert go(42) != go(43)


def test_concurrent_streams_batch(server):
    """32 SDK streams complete correctly and the engine batches them; throughput is measured
    with raw sockets, since 32 openai-SDK parsers on 2 cores would measure the client."""
    async def sdk_stream(client, i):
        n, finish = 0, None
        stream = await client.chat.completions.create(
            model="tiny-qwen3", messages=[{"role": "user", "content": f"Story number {i}"}],
            max_tokens=16, temperature=0, stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices:
                n += 1
                finish = chunk.choices[0].finish_reason or finish
        return n, finish

    async def raw_stream(i, n=32):
        r, w = await asyncio.open_connection("127.0.0.1", server.port)
        body = json.dumps({"prompt": f"Story number {i}", "max_tokens": n, "temperature": 0,
                           "stream": True, "ignore_eos": True}).encode()
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        data = b""
        while b"[DONE]" not in data:
            chunk = await r.read(65536)
            if not chunk:
                break
            data += chunk
        w.close()
        return data.count(b'"finish_reason":"length"')

    async def main():
        client = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0)
        results = await asyncio.gather(*(sdk_stream(client, i) for i in range(32)))
        await client.close()
        await raw_stream(0)
        t0 = time.perf_counter()
        await raw_stream(1)
        single = 32 / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        finished = await asyncio.gather(*(raw_stream(i) for i in range(32)))
        aggregate = 32 * 32 / (time.perf_counter() - t0)
        return results, finished, single, aggregate

    results, finished, single, aggregate = asyncio.run(main())
    assert all(n >= 2 and finish == "length" for n, finish in results), results
    assert finished == [1] * 32
    _, stats = server.request("GET", "/v1/stats")
    assert stats["max_batch_seqs"] > 8, stats
    print(f"single stream {single:.0f} tok/s, 32 streams {aggregate:.0f} tok/s")
    assert aggregate > 2 * single


def _stats_settle(server, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, stats = server.request("GET", "/v1/stats")
        if stats["running"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]:
            return stats
        time.sleep(0.05)
    return stats


def test_disconnect_frees_kv_blocks(server):
    body = json.dumps({"model": "tiny-qwen3", "prompt": "A long tale", "max_tokens": 900,
                       "stream": True, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = b""
    while got.count(b"data:") < 3:
        got += sock.recv(4096)
    _, mid = server.request("GET", "/v1/stats")
    assert mid["running"] == 1 and mid["kv_blocks_free"] < mid["kv_blocks_total"]
    sock.close()
    stats = _stats_settle(server)
    assert stats["running"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"], stats


def test_health_while_generating(server):
    body = json.dumps({"model": "tiny-qwen3", "prompt": "x", "max_tokens": 600, "stream": True,
                       "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                 + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    sock.recv(4096)
    t0 = time.perf_counter()
    status, health = server.health()
    assert status == 200 and health["status"] == "ok"
    assert time.perf_counter() - t0 < 2.0
    sock.close()
    _stats_settle(server)
