"""POST /v1/chat/completions: messages -> chat template -> engine -> message or SSE chunks.

Reasoning comes back as `reasoning_content` (message and delta), tool calls as `tool_calls`
(streamed as OpenAI does: a first delta with the call's id and name, then argument
fragments), with finish_reason "tool_calls" when the model stopped to call tools.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from freetoken.server.generation import ChatRequest, start_generations
from freetoken.server.http import SSE_DONE, SSE_PING, sse_event
from freetoken.server.model_meta import EFFORTS
from freetoken.server.openai.params import bad, get_dict, parse_generation
from freetoken.server.openai.stream import (is_shutdown, logprobs_chat, prompt_logprobs_vllm, stream_error,
                                            stream_many, usage)
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


def check_effort(meta, effort: str | None, param: str) -> None:
    """A reasoning model takes the efforts /v1/models lists for it; another (no thinking to
    switch) any known value, as a no-op."""
    if effort is not None and meta.reasoning and effort not in meta.efforts:
        raise bad(param, f"'{param}' must be one of {', '.join(meta.efforts)} for this model; got {effort!r}")


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
    check_effort(ctx.meta, req.effort, "reasoning_effort")
    gens, prompt = await start_generations(ctx, req, opts.n)
    response.on_disconnect(lambda: [g.stream.abort() for g in gens])
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if opts.stream:
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        await _stream(ctx, gens, opts, response, base)
        return
    try:
        await asyncio.gather(*(g.collect() for g in gens))
    finally:
        for g in gens:
            if not g.stream.finished:
                g.stream.abort()
    choices = [{"index": j, "message": _message(gen),
                "logprobs": logprobs_chat(ctx.tokenizer, gen) if opts.params.logprobs is not None else None,
                "finish_reason": gen.finish_reason} for j, gen in enumerate(gens)]
    out = {"id": rid, "object": "chat.completion", "created": created, "model": model,
           "choices": choices, "usage": _usage(gens)}
    if opts.params.prompt_logprobs is not None:   # vLLM's field
        out["prompt_logprobs"] = prompt_logprobs_vllm(ctx.tokenizer, prompt.token_ids, gens[0].prompt_logprobs)
    response.send_json(200, out)


def _usage(gens) -> dict:
    """The prompt counted once, every sample's completion tokens (as OpenAI counts n > 1)."""
    return usage(gens[0].num_prompt_tokens, sum(g.num_output_tokens for g in gens), gens[0].prefill,
                 gens[0].num_cached_tokens)


async def _stream(ctx, gens, opts, response, base: dict) -> None:
    extra = {"usage": None} if opts.include_usage else {}
    want_lp = opts.params.logprobs is not None

    def chunk(j: int, delta: dict, finish=None, logprobs=None) -> bytes:
        return sse_event({**base, "choices": [{"index": j, "delta": delta, "logprobs": logprobs,
                                               "finish_reason": finish}], **extra})

    def render(j, step) -> bytes:
        d = step.delta
        lp = logprobs_chat(ctx.tokenizer, d) if want_lp and d.logprobs else None
        deltas = [x for x in map(event_delta, step.events) if x is not None]
        if lp is not None and not deltas and not d.finished:
            deltas = [{"content": ""}]
        out = b"".join(chunk(j, x, logprobs=lp if i == 0 else None) for i, x in enumerate(deltas))
        return out + chunk(j, {}, finish=gens[j].finish_reason) if d.finished else out

    def error(e: Exception) -> bytes:   # cut by shutdown: the error event, then the terminator
        return stream_error(e) + (SSE_DONE if is_shutdown(e) else b"")

    response.start_stream()
    await response.write(b"".join(chunk(j, {"role": "assistant", "content": ""}) for j in range(len(gens))))
    if not await stream_many(gens, response, ctx.server_config.ping_interval_s, SSE_PING, render, error):
        return
    tail = b""
    if opts.include_usage:
        tail += sse_event({**base, "choices": [], "usage": _usage(gens)})
    await response.write(tail + SSE_DONE)
    response.end_stream()
