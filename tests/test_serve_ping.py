"""Keep-alive pings on a real `ft serve`: while a long prompt is prefilled in chunks the stream
is silent, so each dialect sends its ping (Anthropic a `ping` event, OpenAI an SSE comment),
and the official SDKs read through them.

Slow steps (FREETOKEN_DEBUG_STEP_DELAY_S) and a short --ping-interval make the silence longer
than the interval on any machine; the prompt spans several --max-prefill-length chunks.
"""

from __future__ import annotations

import anthropic
import openai
import pytest

from serving import ServerProcess

MODEL = "tiny-ping"
LONG = "The keeper climbs the stairs and trims the wick before the storm. " * 6


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from freetoken.demo.tiny_model import make_tiny_model
    model = make_tiny_model(tmp_path_factory.mktemp("ping") / MODEL, family="qwen3_moe", seed=0,
                            max_position_embeddings=1024)
    with ServerProcess(model, "--max-prefill-length", "16", "--ping-interval", "0.01",
                       env={"FREETOKEN_DEBUG_STEP_DELAY_S": "0.02"}) as s:
        yield s


def test_pings_while_prefilling(server):
    events = server.sse("/v1/messages", {"model": MODEL, "max_tokens": 2, "stream": True,
                                         "messages": [{"role": "user", "content": LONG}]})
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert "ping" in names and "content_block_start" in names, events
    assert names.index("ping") < names.index("content_block_start"), names
    assert all(data == {"type": "ping"} for name, data in events if name == "ping")
    status, raw = server.request("POST", "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 2, "stream": True, "messages": [{"role": "user", "content": LONG}]})
    assert status == 200 and b"\n: ping\n\n" in raw and raw.endswith(b"data: [DONE]\n\n")


def test_sdks_read_through_pings(server):
    a = anthropic.Anthropic(base_url=server.base, api_key="unused", max_retries=0)
    with a.messages.stream(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": LONG}]) as s:
        final = s.get_final_message()
    assert final.stop_reason in ("max_tokens", "end_turn") and final.usage.output_tokens <= 3
    o = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)
    with o.responses.stream(model=MODEL, input=LONG, max_output_tokens=3) as s:
        types = [e.type for e in s]
    assert types[0] == "response.created" and types[-1] in ("response.completed", "response.incomplete")
