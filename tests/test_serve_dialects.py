"""End to end, OpenAI dialects: reasoning, effort, tool calls and /v1/responses on a real
`ft serve`, driven by the official openai SDK.

The model's output is scripted (FREETOKEN_DEBUG_SCRIPT): a trigger in the latest user or tool
message makes the engine produce exactly the scripted text through the normal sampler path,
so thinking, tool calls and stop reasons are deterministic on random weights.
"""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import TypeAdapter

from serving import ServerProcess

KEY = "sk-dialects"
MODEL = "tiny-qwen3"
THOUGHTS = ("The user wants a short title for a story about a lighthouse keeper who sees a ship in a "
            "storm. I should weigh tone, length and imagery, compare a few candidates such as "
            "Beacon, Keeper of the Light and Storm Signal, and then pick the one that is short, "
            "evocative and easy to remember for a reader browsing a long list of stories.")
SCRIPT = {
    "TITLE_ME": f"<think>\n{THOUGHTS}\n</think>\n\nLighthouse Dreams",
    "WEATHER_PLEASE": ('<think>\nI should call get_weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
                       '"arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'),
    "TOOL_SAYS_18C": "<think>\nThe tool answered.\n</think>\n\nIt is 18 °C in Paris.",
    "BROKEN_CALL": '<tool_call>\n{"name": get_weather}\n</tool_call>',
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                   "required": ["city"]}}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather for a city.",
                    "parameters": TOOLS[0]["function"]["parameters"], "strict": False}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from freetoken.demo.tiny_model import make_tiny_model
    root = tmp_path_factory.mktemp("dialects")
    model = make_tiny_model(root / MODEL, family="qwen3_moe", seed=0, max_position_embeddings=2048)
    (root / "script.json").write_text(json.dumps(SCRIPT))
    with ServerProcess(model, env={"FREETOKEN_DEBUG_SCRIPT": str(root / "script.json")}, api_key=KEY) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0)


def user(text):
    return [{"role": "user", "content": text}]


def stream_chat(client, **kwargs):
    reasoning, content, finish, calls = "", "", None, {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
        finish = chunk.choices[0].finish_reason or finish
        for tc in d.tool_calls or []:
            if tc.id:
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "args": [], "first": tc.function.arguments}
            else:
                calls[tc.index]["args"].append(tc.function.arguments)
    return reasoning, content, finish, calls


def test_effort_none_answers_within_a_small_budget(client):
    kwargs = dict(model=MODEL, messages=user("TITLE_ME please"), max_tokens=64)
    r = client.chat.completions.create(reasoning_effort="none", **kwargs)
    msg = r.choices[0].message
    assert getattr(msg, "reasoning_content", None) is None
    assert msg.content == "Lighthouse Dreams" and r.choices[0].finish_reason == "stop"
    assert stream_chat(client, reasoning_effort="none", **kwargs)[:3] == ("", "Lighthouse Dreams", "stop")
    # The failure "none" prevents: with thinking on, the budget goes to reasoning.
    r = client.chat.completions.create(reasoning_effort="high", **kwargs)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.reasoning_content
    assert "Lighthouse Dreams" not in (r.choices[0].message.content or "")


def test_reasoning_is_split_from_the_answer(client):
    kwargs = dict(model=MODEL, messages=user("TITLE_ME please"), max_tokens=300, reasoning_effort="high")
    r = client.chat.completions.create(**kwargs)
    msg = r.choices[0].message
    assert msg.reasoning_content == THOUGHTS and msg.content == "Lighthouse Dreams"
    assert r.choices[0].finish_reason == "stop"
    assert stream_chat(client, **kwargs)[:3] == (THOUGHTS, "Lighthouse Dreams", "stop")
    # No effort: the template's default (thinking on for Qwen3) is unchanged.
    assert client.chat.completions.create(**{**kwargs, "reasoning_effort": None}).choices[0].message.content \
        == "Lighthouse Dreams"


def test_explicit_template_kwargs_win_over_effort(client):
    r = client.chat.completions.create(model=MODEL, messages=user("TITLE_ME please"), max_tokens=300,
                                       reasoning_effort="none",
                                       extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert r.choices[0].message.reasoning_content == THOUGHTS


def test_efforts_listed_and_unknown_effort_is_400(client, server):
    assert client.models.list().data[0].reasoning_efforts == ["none", "low", "medium", "high"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=4,
                                       reasoning_effort="extreme")
    assert "none, minimal, low, medium, high" in str(e.value) and e.value.body["param"] == "reasoning_effort"


def test_tool_call_streams_and_round_trips(client):
    kwargs = dict(model=MODEL, messages=user("WEATHER_PLEASE in Paris?"), tools=TOOLS, max_tokens=200)
    r = client.chat.completions.create(**kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (tc,) = choice.message.tool_calls
    assert tc.id.startswith("call_") and tc.function.name == "get_weather"
    assert json.loads(tc.function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert choice.message.reasoning_content == "I should call get_weather."
    reasoning, content, finish, calls = stream_chat(client, **kwargs)
    assert (reasoning, content, finish) == ("I should call get_weather.", "", "tool_calls")
    (call,) = calls.values()
    assert call["name"] == "get_weather" and call["first"] == "" and len(call["args"]) >= 3
    assert "".join(call["args"]) == tc.function.arguments
    # The result goes back as a tool message; the model answers from it.
    messages = kwargs["messages"] + [choice.message.model_dump(exclude_none=True),
                                     {"role": "tool", "tool_call_id": tc.id, "content": "TOOL_SAYS_18C sunny"}]
    final = client.chat.completions.create(**{**kwargs, "messages": messages})
    assert final.choices[0].message.content == "It is 18 °C in Paris."
    assert final.choices[0].finish_reason == "stop" and not final.choices[0].message.tool_calls


def test_tool_choice_forces_or_forbids_calls(client):
    # No script: random weights, yet a named choice always yields a well-formed call.
    r = client.chat.completions.create(model=MODEL, messages=user("anything"), tools=TOOLS, max_tokens=12,
                                       temperature=0, tool_choice={"type": "function",
                                                                   "function": {"name": "get_weather"}})
    (tc,) = r.choices[0].message.tool_calls
    assert tc.function.name == "get_weather" and isinstance(json.loads(tc.function.arguments), dict)
    r = client.chat.completions.create(model=MODEL, messages=user("WEATHER_PLEASE"), tools=TOOLS,
                                       max_tokens=200, tool_choice="none")
    assert not r.choices[0].message.tool_calls and "<tool_call>" in r.choices[0].message.content


def test_malformed_tool_call_is_plain_content(client):
    kwargs = dict(model=MODEL, messages=user("BROKEN_CALL"), tools=TOOLS, max_tokens=100)
    r = client.chat.completions.create(**kwargs)
    assert r.choices[0].message.content == '<tool_call>\n{"name": get_weather}\n</tool_call>'
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"
    assert stream_chat(client, **kwargs)[1:] == (r.choices[0].message.content, "stop", {})


def test_responses_create_and_typed_stream(client, server):
    kwargs = dict(model=MODEL, input="TITLE_ME please", instructions="Be brief.",
                  reasoning={"effort": "high"}, max_output_tokens=300)
    r = client.responses.create(**kwargs)
    assert r.status == "completed" and r.output_text == "Lighthouse Dreams"
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == THOUGHTS
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    with client.responses.stream(**kwargs) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "Lighthouse Dreams"
    # Every raw event validates against the SDK's own event types, in order.
    from openai.types.responses import ResponseStreamEvent
    adapter = TypeAdapter(ResponseStreamEvent)
    events = server.sse("/v1/responses", {**kwargs, "stream": True})
    parsed = [adapter.validate_python(data) for _, data in events]
    assert [name for name, _ in events] == [e.type for e in parsed]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    types = [e.type for e in parsed]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert "response.reasoning_text.delta" in types and "response.output_text.done" in types
    assert "".join(e.delta for e in parsed if e.type == "response.reasoning_text.delta") == THOUGHTS
    short = client.responses.create(**{**kwargs, "max_output_tokens": 8})
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


def test_responses_tool_round_trip(client):
    kwargs = dict(model=MODEL, tools=RESPONSES_TOOLS, max_output_tokens=200)
    r = client.responses.create(input="WEATHER_PLEASE in Paris?", **kwargs)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris", "unit": "celsius"}
    with client.responses.stream(input="WEATHER_PLEASE in Paris?", **kwargs) as stream:
        args = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        streamed = stream.get_final_response()
    assert len(args) >= 3 and "".join(args) == calls[0].arguments
    assert [o.type for o in streamed.output] == [o.type for o in r.output]
    items = [{"role": "user", "content": "WEATHER_PLEASE in Paris?"},
             *[o.model_dump(exclude_none=True) for o in r.output],
             {"type": "function_call_output", "call_id": calls[0].call_id, "output": "TOOL_SAYS_18C"}]
    final = client.responses.create(input=items, **kwargs)
    assert final.output_text == "It is 18 °C in Paris."
