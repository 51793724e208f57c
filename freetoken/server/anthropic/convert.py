"""An Anthropic Messages body as a ChatRequest.

- `system` (a string or text blocks, joined with blank lines) -> the first system message.
- user content blocks: `text` -> the user message; `tool_result` -> a `tool` message (in the
  order given, before the user's text), its content a string or text blocks.
- assistant content blocks: `thinking` -> reasoning_content, `text` -> content, `tool_use`
  -> tool_calls (arguments as the input dict, which templates render with tojson);
  `redacted_thinking` is dropped.
- `tools` ({name, description, input_schema}) -> Chat Completions function tools;
  `tool_choice` auto | any (-> required) | tool (-> named) | none.
- `thinking` {type: disabled} -> effort "none"; enabled / adaptive -> thinking on, with
  `output_config.effort` as the effort, else one derived from budget_tokens.
"""

from __future__ import annotations

from freetoken.engine.sampling_params import SamplingParams
from freetoken.server.generation import ChatRequest
from freetoken.server.model_meta import EFFORTS
from freetoken.server.openai.params import (bad, get_dict, get_int, map_list, sampling_fields,
                                            sampling_params)
from freetoken.server.tools import check_tool_choice, check_tools


def parse_messages_body(body: dict, *, count_only: bool = False) -> ChatRequest:
    """The ChatRequest for /v1/messages (count_only: /v1/messages/count_tokens, which takes
    no max_tokens and no sampling fields)."""
    messages = chat_messages(body.get("messages"), body.get("system"))
    tools = check_tools(_chat_tools(body.get("tools")))
    choice = check_tool_choice(_tool_choice(body.get("tool_choice")), tools)
    effort = _effort(body)
    if count_only:
        return ChatRequest(messages, SamplingParams(max_tokens=None), tools, choice, effort)
    if body.get("max_tokens") is None:
        raise bad("max_tokens", "'max_tokens' is required")
    stop = body.get("stop_sequences")
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise bad("stop_sequences", "'stop_sequences' must be a list of non-empty strings")
    params = sampling_params(max_tokens=get_int(body, "max_tokens", None, 1),
                             **sampling_fields(body, max_temperature=1.0), stop=stop)
    return ChatRequest(messages, params, tools, choice, effort)


def chat_messages(messages, system=None) -> list[dict]:
    out: list[dict] = []
    if system is not None:
        out.append({"role": "system", "content": _blocks_text(system, "system")})
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad(f"messages.{i}.role", "each message needs role 'user' or 'assistant'")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise bad(f"messages.{i}.content", "content must be a string or a list of blocks")
        if m["role"] == "user":
            out += _user_messages(blocks, f"messages.{i}.content")
        else:
            out.append(_assistant_message(blocks, f"messages.{i}.content"))
    return out


def _user_messages(blocks: list, param: str) -> list[dict]:
    tools, texts = [], []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            texts.append(_text(b, f"{param}.{j}"))
        elif kind == "tool_result":
            content = b.get("content", "")
            text = _blocks_text(content, f"{param}.{j}.content")
            tools.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": text})
        else:
            raise bad(f"{param}.{j}", f"user content blocks of type {kind!r} are not supported")
    return tools + ([{"role": "user", "content": "".join(texts)}] if texts or not tools else [])


def _assistant_message(blocks: list, param: str) -> dict:
    msg: dict = {"role": "assistant", "content": ""}
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            msg["content"] += _text(b, f"{param}.{j}")
        elif kind == "thinking":
            msg["reasoning_content"] = msg.get("reasoning_content", "") + str(b.get("thinking", ""))
        elif kind == "tool_use":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                raise bad(f"{param}.{j}", "a tool_use block needs a 'name' and an object 'input'")
            msg.setdefault("tool_calls", []).append(
                {"id": b.get("id"), "type": "function",
                 "function": {"name": b["name"], "arguments": b.get("input", {})}})
        elif kind != "redacted_thinking":
            raise bad(f"{param}.{j}", f"assistant content blocks of type {kind!r} are not supported")
    return msg


def _text(block: dict, param: str) -> str:
    if not isinstance(block.get("text"), str):
        raise bad(param, "a text block needs a string 'text'")
    return block["text"]


def _blocks_text(value, param: str) -> str:
    """A string, or text blocks joined with blank lines."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, b in enumerate(value):
            if not isinstance(b, dict) or b.get("type") != "text":
                kind = b.get("type") if isinstance(b, dict) else type(b).__name__
                raise bad(f"{param}.{j}", f"only text blocks are supported here, got {kind!r}")
            texts.append(_text(b, f"{param}.{j}"))
        return "\n\n".join(texts)
    raise bad(param, f"'{param}' must be a string or a list of text blocks")


def _chat_tools(tools):
    return map_list(tools, "tools", _chat_tool)


def _chat_tool(i: int, t) -> dict:
    if not isinstance(t, dict) or t.get("type", "custom") != "custom" or "input_schema" not in t:
        raise bad(f"tools.{i}", "only custom tools ({name, description, input_schema}) are supported")
    fn = {"name": t.get("name")}
    if t.get("description"):
        fn["description"] = t["description"]
    fn["parameters"] = t["input_schema"]
    return {"type": "function", "function": fn}


def _tool_choice(choice):
    if choice is None:
        return "auto"
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"name": choice.get("name")}
    raise bad("tool_choice", "'tool_choice' must be {type: auto | any | tool | none}")


def _effort(body: dict) -> str | None:
    thinking = get_dict(body, "thinking")
    effort = get_dict(body, "output_config").get("effort")
    if effort is not None and effort not in EFFORTS:
        raise bad("output_config.effort", f"'effort' must be one of {', '.join(EFFORTS[1:])}")
    kind = thinking.get("type")
    if kind is None:
        return effort
    if kind == "disabled":
        return "none"
    if kind == "adaptive":
        return effort or "medium"
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise bad("thinking.budget_tokens", "'budget_tokens' must be a positive integer")
        return effort or ("low" if budget < 4096 else "medium" if budget < 16384 else "high")
    raise bad("thinking.type", "'thinking.type' must be enabled, adaptive or disabled")
