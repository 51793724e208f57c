"""Each dialect's request renders the prompt transformers renders for the equivalent messages.

Responses input items and Anthropic messages are converted into chat messages, checked against
the conversation written out by hand, and the prompt the server builds (template kwargs from
the effort, the text forced at the start of the answer) is compared with transformers'
apply_chat_template (the oracle, test-only) on the tiny checkpoint's templates.
"""

from __future__ import annotations

import types

import pytest

from freetoken.server import model_meta
from freetoken.server.anthropic.convert import parse_messages_body
from freetoken.server.errors import HTTPError
from freetoken.server.generation import build_prompt
from freetoken.server.openai.chat import parse_chat_request, parse_effort
from freetoken.server.openai.responses_input import parse_responses_body
from freetoken.tokenizer import Tokenizer
from tiny_fixtures import tiny_model_dir  # noqa: F401 - a fixture

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
                                                "parameters": SCHEMA}}]


def call(cid, city, as_dict=False):
    args = {"city": city} if as_dict else f'{{"city": "{city}"}}'
    return {"id": cid, "type": "function", "function": {"name": "get_weather", "arguments": args}}


RESPONSES_BODY = {
    "instructions": "You are terse.",
    "input": [
        {"role": "developer", "content": "Prefer metric units."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Zürich "},
                                     {"type": "input_text", "text": "and Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Two cities: two calls."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking both.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Zürich"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 °C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "21 °C"}]},
    ],
    "tools": [{"type": "function", "name": "get_weather", "description": "Weather now.", "parameters": SCHEMA}],
}
RESPONSES_MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "system", "content": "Prefer metric units."},
    {"role": "user", "content": "Weather in Zürich and Paris?"},
    {"role": "assistant", "content": "Checking both.", "reasoning_content": "Two cities: two calls.",
     "tool_calls": [call("call_1", "Zürich"), call("call_2", "Paris")]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 °C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "21 °C"},
]

ANTHROPIC_BODY = {
    "max_tokens": 64,
    "system": [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Use tools."}],
    "messages": [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Call the tool.", "signature": "sig"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Zürich"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "18 °C"}]}]},
    ],
    "tools": [{"name": "get_weather", "description": "Weather now.", "input_schema": SCHEMA}],
}
ANTHROPIC_MESSAGES = [
    {"role": "system", "content": "You are terse.\n\nUse tools."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "Call the tool.",
     "tool_calls": [call("toolu_1", "Zürich", as_dict=True)]},
    {"role": "tool", "tool_call_id": "toolu_1", "content": "18 °C"},
]

CHAT_BODY = {"messages": [{"role": "developer", "content": "You are terse."},
                          {"role": "user", "content": [{"type": "text", "text": "Weather in Zürich?"}]}],
             "tools": CHAT_TOOLS}
CHAT_MESSAGES = [{"role": "system", "content": "You are terse."},
                 {"role": "user", "content": "Weather in Zürich?"}]


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir):  # noqa: F811 - the imported fixture
    from transformers import AutoTokenizer
    out = {}
    for variant in ("qwen3", "graded", "thinking"):
        path = tiny_model_dir("qwen3_moe", chat_template=variant)
        ours = Tokenizer.from_dir(path)
        meta = model_meta.resolve("qwen3_moe", ours.get_chat_template(), "auto", set(ours.all_special_tokens))
        out[variant] = (types.SimpleNamespace(meta=meta, tokenizer=ours), AutoTokenizer.from_pretrained(path))
    return out


def parse(dialect: str, body: dict):
    if dialect == "chat":
        return parse_chat_request(body)[0]
    if dialect == "responses":
        return parse_responses_body(body, parse_effort)[0]
    return parse_messages_body(body)


def with_effort(dialect: str, body: dict, effort: str | None) -> dict:
    if effort is None:
        return body
    if dialect == "chat":
        return {**body, "reasoning_effort": effort}
    if dialect == "responses":
        return {**body, "reasoning": {"effort": effort}}
    thinking = {"type": "disabled"} if effort == "none" else {"type": "enabled", "budget_tokens": 2048}
    return {**body, "thinking": thinking}


DIALECTS = {"chat": (CHAT_BODY, CHAT_MESSAGES), "responses": (RESPONSES_BODY, RESPONSES_MESSAGES),
            "anthropic": (ANTHROPIC_BODY, ANTHROPIC_MESSAGES)}
# (template variant, effort) -> what transformers must be given, and the forced answer start.
EFFORT_CASES = [
    ("qwen3", None, {}, ""),
    ("qwen3", "none", {"enable_thinking": False}, ""),
    ("qwen3", "low", {"enable_thinking": True}, ""),                   # not graded: no effort kwarg
    ("graded", "low", {"enable_thinking": True, "reasoning_effort": "low"}, ""),
    ("graded", "none", {"enable_thinking": False}, ""),
    ("thinking", "none", {}, "\n</think>\n\n"),                        # no switch: closed in the answer
]


@pytest.mark.parametrize("dialect", list(DIALECTS))
@pytest.mark.parametrize("variant,effort,hf_kwargs,prefix", EFFORT_CASES)
def test_prompt_equals_transformers(checkpoints, dialect, variant, effort, hf_kwargs, prefix):
    ctx, hf = checkpoints[variant]
    body, messages = DIALECTS[dialect]
    req = parse(dialect, with_effort(dialect, body, effort))
    assert req.messages == messages
    assert req.tools == CHAT_TOOLS
    prompt = build_prompt(ctx, req)
    want = hf.apply_chat_template(messages, tools=CHAT_TOOLS, add_generation_prompt=True, tokenize=False,
                                  **hf_kwargs)
    assert prompt.text == want
    assert prompt.prefix == prefix
    if prefix:
        assert prompt.token_ids == hf.encode(want + prefix, add_special_tokens=False)
    else:
        assert prompt.token_ids == hf.apply_chat_template(messages, tools=CHAT_TOOLS, add_generation_prompt=True,
                                                          tokenize=True, return_dict=False, **hf_kwargs)
    if dialect != "chat":
        assert "Two cities" in want or "Call the tool." in want      # the turn's reasoning is rendered
    if hf_kwargs.get("reasoning_effort"):
        assert "Reasoning effort: low" in want


def test_explicit_template_kwargs_win(checkpoints):
    ctx, hf = checkpoints["qwen3"]
    req = parse("chat", {**CHAT_BODY, "reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}})
    prompt = build_prompt(ctx, req)
    assert prompt.text == hf.apply_chat_template(CHAT_MESSAGES, tools=CHAT_TOOLS, add_generation_prompt=True,
                                                 tokenize=False, enable_thinking=True)
    assert not prompt.text.endswith("</think>\n\n") and prompt.prefix == ""


def test_forced_tool_calls_and_tool_choice_none(checkpoints):
    ctx, hf = checkpoints["qwen3"]
    named = build_prompt(ctx, parse("chat", {**CHAT_BODY, "tool_choice": {"type": "function",
                                                                         "function": {"name": "get_weather"}}}))
    assert named.prefix == '<tool_call>\n{"name": "get_weather", "arguments": {'
    # "required" (Anthropic's "any") with one tool names it; with several, the model picks.
    required = build_prompt(ctx, parse("anthropic", {**ANTHROPIC_BODY, "tool_choice": {"type": "any"}}))
    assert required.prefix == named.prefix
    two = [*ANTHROPIC_BODY["tools"], {"name": "search", "input_schema": {"type": "object"}}]
    required = build_prompt(ctx, parse("anthropic", {**ANTHROPIC_BODY, "tools": two, "tool_choice": {"type": "any"}}))
    assert required.prefix == '<tool_call>\n{"name": "'
    none = build_prompt(ctx, parse("responses", {**RESPONSES_BODY, "tool_choice": "none"}))
    assert "<tools>" not in none.text and none.prefix == ""
    assert none.text == hf.apply_chat_template(RESPONSES_MESSAGES, add_generation_prompt=True, tokenize=False)
    # A forced call on a template that opened the think block closes it first.
    ctx, _ = checkpoints["thinking"]
    forced = build_prompt(ctx, parse("chat", {**CHAT_BODY, "tool_choice": "required"}))
    assert forced.prefix == '\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {'


@pytest.mark.parametrize("dialect,body,param", [
    ("chat", {**CHAT_BODY, "reasoning_effort": "extreme"}, "reasoning_effort"),
    ("responses", {**RESPONSES_BODY, "reasoning": {"effort": "ultra"}}, "reasoning.effort"),
    ("anthropic", {**ANTHROPIC_BODY, "thinking": {"type": "sometimes"}}, "thinking.type"),
    ("anthropic", {k: v for k, v in ANTHROPIC_BODY.items() if k != "max_tokens"}, "max_tokens"),
    ("chat", {**CHAT_BODY, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("responses", {**RESPONSES_BODY, "previous_response_id": "resp_1"}, "previous_response_id"),
    ("responses", {**RESPONSES_BODY, "tools": [{"type": "web_search"}]}, "tools[0]"),
    ("anthropic", {**ANTHROPIC_BODY, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
     "messages.0.content.0"),
])
def test_bad_dialect_bodies(dialect, body, param):
    with pytest.raises(HTTPError) as e:
        parse(dialect, body)
    assert e.value.status == 400 and e.value.param == param, e.value
    if "effort" in param:
        assert "none, minimal, low, medium, high" in e.value.message
