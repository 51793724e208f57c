"""A Responses API body as a ChatRequest: `input` items -> chat messages, flat function tools ->
Chat Completions tools, `reasoning.effort`, `max_output_tokens`, `instructions`.

The server is stateless: the whole conversation comes in `input` (previous_response_id is
refused). One model turn's items (reasoning, message, function_call) become one assistant
message: reasoning as `reasoning_content`, calls as `tool_calls`; function_call_output items
become `tool` messages, as a chat template expects them.
"""

from __future__ import annotations

from freetoken.server.generation import ChatRequest
from freetoken.server.openai.params import (bad, get_bool, get_dict, get_int, get_seed, map_list,
                                            sampling_fields, sampling_params)
from freetoken.server.structured import from_text_format
from freetoken.server.tools import check_tool_choice, check_tools

_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def parse_responses_body(body: dict, parse_effort) -> tuple[ChatRequest, bool]:
    """(the ChatRequest, stream?)"""
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            raise bad(name, f"'{name}' is not supported: this server keeps no state; "
                            f"send the whole conversation in 'input'")
    if get_bool(body, "background", False):
        raise bad("background", "'background' is not supported")
    text_cfg = get_dict(body, "text")
    fmt = get_dict(text_cfg, "format")
    messages = input_messages(body.get("input"), body.get("instructions"))
    tools = check_tools(_chat_tools(body.get("tools")))
    reasoning = get_dict(body, "reasoning")
    params = sampling_params(max_tokens=get_int(body, "max_output_tokens", None, 1),
                             **sampling_fields(body, max_temperature=2.0),
                             seed=get_seed(body),
                             # vLLM's extensions, as on the other routes (benches, tests)
                             ignore_eos=get_bool(body, "ignore_eos", False),
                             min_tokens=get_int(body, "min_tokens", 0, 0),
                             structured_outputs=from_text_format(fmt) if fmt else None)
    req = ChatRequest(messages, params, tools, _tool_choice(body.get("tool_choice", "auto"), tools),
                      parse_effort(reasoning.get("effort"), "reasoning.effort"),
                      get_dict(body, "chat_template_kwargs"))
    return req, get_bool(body, "stream", False)


def input_messages(items, instructions=None) -> list[dict]:
    """`input` (a string or a list of items) and `instructions` as chat messages."""
    out: list[dict] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("instructions", "'instructions' must be a string")
        out.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad("input", "'input' must be a string or a non-empty list of items")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise bad(f"input[{i}]", "each input item must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            _add_message(out, item, i)
        elif kind == "function_call":
            call = {"id": _str(item, "call_id", i), "type": "function",
                    "function": {"name": _str(item, "name", i), "arguments": _str(item, "arguments", i)}}
            _turn(out).setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _parts_text(output, f"input[{i}].output")
            out.append({"role": "tool", "tool_call_id": _str(item, "call_id", i), "content": text})
        elif kind == "reasoning":
            text = _parts_text(item.get("content") or item.get("summary") or [], f"input[{i}]")
            turn = _turn(out)
            turn["reasoning_content"] = turn.get("reasoning_content", "") + text
        else:
            raise bad(f"input[{i}].type", f"input items of type {kind!r} are not supported")
    if not any(m["role"] != "system" for m in out):
        raise bad("input", "'input' holds no message")
    return out


def _add_message(out: list[dict], item: dict, i: int) -> None:
    role = _ROLES.get(item.get("role"))
    if role is None:
        raise bad(f"input[{i}].role", f"role must be one of {', '.join(_ROLES)}, got {item.get('role')!r}")
    content = item.get("content")
    text = content if isinstance(content, str) else _parts_text(content, f"input[{i}].content")
    if role == "assistant":
        turn = _turn(out)
        turn["content"] = turn["content"] + text
    else:
        out.append({"role": role, "content": text})


def _turn(out: list[dict]) -> dict:
    """The assistant message this model turn's items gather into (a new one if needed)."""
    if out and out[-1]["role"] == "assistant":
        return out[-1]
    out.append({"role": "assistant", "content": ""})
    return out[-1]


def _parts_text(parts, param: str) -> str:
    if not isinstance(parts, list):
        raise bad(param, "content must be a string or a list of text parts")
    texts = []
    for p in parts:
        if not isinstance(p, dict) or p.get("type") not in _TEXT_PARTS or not isinstance(p.get("text"), str):
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            raise bad(param, f"only text content parts are supported, got {kind!r}")
        texts.append(p["text"])
    return "".join(texts)


def _str(item: dict, key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad(f"input[{i}].{key}", f"'{key}' must be a string")
    return value


def _chat_tools(tools):
    """Responses' flat function tools ({"type": "function", "name", "parameters"}) in Chat
    Completions' shape; built-in tools (web search, ...) are refused."""
    return map_list(tools, "tools", _chat_tool)


def _chat_tool(i: int, t) -> dict:
    if not isinstance(t, dict) or t.get("type") != "function":
        kind = t.get("type") if isinstance(t, dict) else type(t).__name__
        raise bad(f"tools[{i}]", f"only function tools are supported, got {kind!r}")
    fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
    return {"type": "function", "function": fn}


def _tool_choice(choice, tools):
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise bad("tool_choice", 'a named tool_choice is {"type": "function", "name": ...}')
        choice = {"name": choice.get("name")}
    return check_tool_choice(choice, tools)
