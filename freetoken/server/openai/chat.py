"""POST /v1/chat/completions: messages -> chat template -> engine -> message or SSE chunks.

Reasoning comes back as `reasoning_content` (message and delta), tool calls as `tool_calls`
(streamed as OpenAI does: a first delta with the call's id and name, then argument
fragments), with finish_reason "tool_calls" when the model stopped to call tools.
"""

from __future__ import annotations

import time
import uuid

from freetoken.server.generation import ChatRequest, start_generation
from freetoken.server.http import SSE_DONE, SSE_PING, sse_event
from freetoken.server.model_meta import EFFORTS
from freetoken.server.openai.params import bad, get_dict, parse_generation
from freetoken.server.openai.stream import logprobs_chat, usage
from freetoken.server.tools import check_tool_choice, check_tools

ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "each message must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role", f"role must be one of {', '.join(ROLES)}, got {role!r}")
        msg = dict(m)
        if role == "developer":
            msg["role"] = "system"
        msg["content"] = _content_text(m.get("content"), i, allow_none=role == "assistant")
        out.append(msg)
    return out


def _content_text(content, i: int, allow_none: bool) -> str:
    """String content as is; text parts joined; anything else is a clear 400."""
    if content is None:
        if allow_none:
            return ""
        raise bad(f"messages[{i}].content", "content is required")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f"messages[{i}].content", f"only text content parts are supported, got {kind!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"messages[{i}].content", "content must be a string or a list of text parts")


def parse_effort(value, param: str) -> str | None:
    """An effort value (None when absent); an unknown one is a 400 listing the accepted ones."""
    if value is None or value in EFFORTS:
        return value
    raise bad(param, f"'{param}' must be one of {', '.join(EFFORTS)}; got {value!r}")


def _tool_choice(body: dict, tools):
    choice = body.get("tool_choice", "auto")
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict):
            raise bad("tool_choice", 'a named tool_choice is {"type": "function", "function": {"name": ...}}')
        choice = {"name": fn.get("name")}
    return check_tool_choice(choice, tools)


def parse_chat_request(body: dict) -> tuple[ChatRequest, object]:
    messages = parse_messages(body)
    opts = parse_generation(body, chat=True)
    tools = check_tools(body.get("tools"))
    req = ChatRequest(messages, opts.params, tools, _tool_choice(body, tools),
                      parse_effort(body.get("reasoning_effort"), "reasoning_effort"),
                      get_dict(body, "chat_template_kwargs"))
    return req, opts


def _message(gen) -> dict:
    msg = {"role": "assistant", "content": gen.content or (None if gen.tool_calls else ""),
           "reasoning_content": gen.reasoning or None}
    if gen.tool_calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}}
                             for c in gen.tool_calls]
    return msg


def event_delta(e) -> dict | None:
    """One parser Event as a chat.completion.chunk delta (None: nothing to send)."""
    if e.kind == "content":
        return {"content": e.text}
    if e.kind == "reasoning":
        return {"reasoning_content": e.text}
    if e.kind == "tool_start":
        return {"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                "function": {"name": e.name, "arguments": ""}}]}
    if e.kind == "tool_args":
        return {"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]}
    return None


async def chat_completions(ctx, request, response) -> None:
    body = request.json()
    model = ctx.check_model(body)
    req, opts = parse_chat_request(body)
    gen, _ = start_generation(ctx, req)
    response.on_disconnect(gen.stream.abort)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if opts.stream:
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        await _stream(ctx, gen, opts, response, base)
        return
    await gen.collect()
    choice = {"index": 0, "message": _message(gen),
              "logprobs": logprobs_chat(ctx.tokenizer, gen) if opts.params.logprobs is not None else None,
              "finish_reason": gen.finish_reason}
    response.send_json(200, {"id": rid, "object": "chat.completion", "created": created, "model": model,
                             "choices": [choice],
                             "usage": usage(gen.num_prompt_tokens, gen.num_output_tokens, gen.prefill,
                                            gen.num_cached_tokens)})


async def _stream(ctx, gen, opts, response, base: dict) -> None:
    extra = {"usage": None} if opts.include_usage else {}
    want_lp = opts.params.logprobs is not None

    def chunk(delta: dict, finish=None, logprobs=None) -> bytes:
        return sse_event({**base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                               "finish_reason": finish}], **extra})

    def render(step) -> bytes:
        d = step.delta
        lp = logprobs_chat(ctx.tokenizer, d) if want_lp and d.logprobs else None
        deltas = [x for x in map(event_delta, step.events) if x is not None]
        if lp is not None and not deltas and not d.finished:
            deltas = [{"content": ""}]
        out = b"".join(chunk(x, logprobs=lp if i == 0 else None) for i, x in enumerate(deltas))
        return out + chunk({}, finish=gen.finish_reason) if d.finished else out

    def error(e: Exception) -> bytes:
        return sse_event({"error": {"message": str(e), "type": "server_error", "param": None,
                                    "code": None}})

    response.start_stream()
    await response.write(chunk({"role": "assistant", "content": ""}))
    if not await gen.stream_to(response, ctx.server_config.ping_interval_s, SSE_PING, render, error):
        return
    tail = b""
    if opts.include_usage:
        tail += sse_event({**base, "choices": [],
                           "usage": usage(gen.num_prompt_tokens, gen.num_output_tokens, gen.prefill,
                                          gen.num_cached_tokens)})
    await response.write(tail + SSE_DONE)
    response.end_stream()
