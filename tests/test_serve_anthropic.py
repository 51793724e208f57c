"""End to end, Anthropic Messages: /v1/messages and count_tokens on a real `ft serve`, driven
by the official anthropic SDK.

The checkpoint uses the "graded" template variant: the prompt opens the think block when
thinking is on (so the parser starts inside it) and closes it when thinking is off. Output is
scripted (FREETOKEN_DEBUG_SCRIPT) so thinking, tool use and stop reasons are deterministic.
"""

from __future__ import annotations

import json

import anthropic
import pytest
from pydantic import TypeAdapter

from serving import ServerProcess

KEY = "sk-ant-test"
MODEL = "tiny-graded"
THOUGHTS = "A title for a lighthouse story: short, and about light in the dark."
SCRIPT = {
    "TITLE_ME": f"<think>\n{THOUGHTS}\n</think>\n\nLighthouse Dreams",
    "WEATHER_PLEASE": ('<think>\nI should call get_weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
                       '"arguments": {"city": "Paris"}}\n</tool_call>'),
    "TOOL_SAYS_18C": "<think>\nThe tool answered.\n</think>\n\nIt is 18 °C in Paris.",
}
TOOLS = [{"name": "get_weather", "description": "Current weather for a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
ON = {"type": "enabled", "budget_tokens": 1024}
OFF = {"type": "disabled"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from freetoken.demo.tiny_model import make_tiny_model
    root = tmp_path_factory.mktemp("anthropic")
    model = make_tiny_model(root / MODEL, family="qwen3_moe", seed=0, chat_template="graded",
                            max_position_embeddings=2048)
    (root / "script.json").write_text(json.dumps(SCRIPT))
    with ServerProcess(model, env={"FREETOKEN_DEBUG_SCRIPT": str(root / "script.json")}, api_key=KEY) as s:
        yield s


@pytest.fixture
def client(server):
    return anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0)


def user(text):
    return [{"role": "user", "content": text}]


def test_thinking_on_and_off(client):
    on = client.messages.create(model=MODEL, max_tokens=200, messages=user("TITLE_ME"), thinking=ON)
    assert [b.type for b in on.content] == ["thinking", "text"]
    assert on.content[0].thinking == THOUGHTS and on.content[1].text == "Lighthouse Dreams"
    assert on.stop_reason == "end_turn" and on.usage.output_tokens > 10
    off = client.messages.create(model=MODEL, max_tokens=200, messages=user("TITLE_ME"), thinking=OFF)
    assert [b.type for b in off.content] == ["text"] and off.content[0].text == "Lighthouse Dreams"
    assert off.usage.output_tokens < on.usage.output_tokens
    for thinking, want in ((ON, on), (OFF, off)):
        with client.messages.stream(model=MODEL, max_tokens=200, messages=user("TITLE_ME"),
                                    thinking=thinking) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text == "Lighthouse Dreams"
        assert [b.model_dump() for b in final.content] == [b.model_dump() for b in want.content]
        assert final.stop_reason == "end_turn" and final.usage.output_tokens == want.usage.output_tokens


def test_raw_stream_events_validate(server):
    from anthropic.types import RawMessageStreamEvent
    adapter = TypeAdapter(RawMessageStreamEvent)
    events = server.sse("/v1/messages", {"model": MODEL, "max_tokens": 200, "messages": user("TITLE_ME"),
                                         "thinking": ON, "stream": True}, headers={"x-api-key": KEY})
    parsed = [adapter.validate_python(data) for _, data in events]
    assert [name for name, _ in events] == [e.type for e in parsed]
    types = [e.type for e in parsed]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    starts = [e.content_block.type for e in parsed if e.type == "content_block_start"]
    assert starts == ["thinking", "text"] and types.count("content_block_stop") == 2
    deltas = {e.delta.type for e in parsed if e.type == "content_block_delta"}
    assert deltas == {"thinking_delta", "text_delta"}


def test_tool_use_round_trip(client):
    kwargs = dict(model=MODEL, max_tokens=200, tools=TOOLS)
    first = client.messages.create(messages=user("WEATHER_PLEASE"), **kwargs)
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["thinking", "tool_use"]
    call = first.content[1]
    assert call.name == "get_weather" and call.input == {"city": "Paris"} and call.id.startswith("toolu_")
    with client.messages.stream(messages=user("WEATHER_PLEASE"), **kwargs) as stream:
        partial = [e.partial_json for e in stream if e.type == "input_json"]
        streamed = stream.get_final_message()
    assert len(partial) >= 3 and json.loads("".join(partial)) == {"city": "Paris"}
    assert streamed.stop_reason == "tool_use" and streamed.content[1].input == {"city": "Paris"}
    messages = user("WEATHER_PLEASE") + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": [{"type": "text", "text": "TOOL_SAYS_18C"}]}]}]
    final = client.messages.create(messages=messages, **kwargs)
    assert final.stop_reason == "end_turn" and final.content[-1].text == "It is 18 °C in Paris."
    forced = client.messages.create(messages=user("anything"), tool_choice={"type": "tool", "name": "get_weather"},
                                    extra_body={"temperature": 0},    # random weights: a sampled tail may add a block
                                    **{**kwargs, "max_tokens": 12})
    assert forced.stop_reason in ("tool_use", "max_tokens")
    assert [b.type for b in forced.content] == ["tool_use"] and isinstance(forced.content[0].input, dict)


def test_count_tokens_matches_usage(client):
    kwargs = dict(model=MODEL, messages=user("TITLE_ME"), system="Be brief.", tools=TOOLS, thinking=OFF)
    counted = client.messages.count_tokens(**kwargs).input_tokens
    u = client.messages.create(max_tokens=50, **kwargs).usage
    # With the prefix cache, the prompt splits into read + written + the rest (Anthropic's sum).
    assert counted == u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    assert counted > client.messages.count_tokens(model=MODEL, messages=user("TITLE_ME")).input_tokens


def test_stop_sequences_and_max_tokens(client):
    r = client.messages.create(model=MODEL, max_tokens=200, messages=user("TITLE_ME"), thinking=OFF,
                               stop_sequences=["Dreams"])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "Dreams"
    assert r.content[0].text == "Lighthouse "
    with client.messages.stream(model=MODEL, max_tokens=200, messages=user("TITLE_ME"), thinking=OFF,
                                stop_sequences=["Dreams"]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "Dreams")
    r = client.messages.create(model=MODEL, max_tokens=5, messages=user("TITLE_ME"), thinking=ON)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 5


def test_errors_in_anthropic_shape(server):
    bad = anthropic.Anthropic(base_url=server.base, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=MODEL, max_tokens=5, messages=user("hi"))
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": "Incorrect or missing API key"}}
    status, body = server.request("POST", "/v1/messages", {"model": MODEL, "messages": user("hi")},
                                  headers={"x-api-key": KEY})
    assert status == 400 and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error" and "max_tokens" in body["error"]["message"]
