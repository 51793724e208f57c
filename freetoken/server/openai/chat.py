"""POST /v1/chat/completions: messages -> chat template -> engine -> message or SSE chunks."""

from __future__ import annotations

import time
import uuid

from freetoken.server.errors import HTTPError
from freetoken.server.http import SSE_DONE, sse_event
from freetoken.server.openai.params import bad, get_dict, parse_generation
from freetoken.server.openai.stream import collect, logprobs_chat, usage

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


async def chat_completions(ctx, request, response) -> None:
    body = request.json()
    model = ctx.check_model(body)
    messages = parse_messages(body)
    opts = parse_generation(body, chat=True)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad("tools", "'tools' must be a list")
    kwargs = get_dict(body, "chat_template_kwargs")
    prompt_ids = ctx.render_chat(messages, tools, kwargs)
    stream = ctx.submit(prompt_ids, opts.params)
    response.on_disconnect(stream.abort)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if not opts.stream:
        result = await collect(stream)
        choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                  "logprobs": logprobs_chat(ctx.tokenizer, result) if opts.params.logprobs is not None else None,
                  "finish_reason": result.finish_reason}
        response.send_json(200, {"id": rid, "object": "chat.completion", "created": created,
                                 "model": model, "choices": [choice],
                                 "usage": usage(stream.num_prompt_tokens, result.num_output_tokens, result.prefill)})
        return

    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    extra = {"usage": None} if opts.include_usage else {}

    def chunk(delta: dict, finish=None, logprobs=None) -> bytes:
        return sse_event({**base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                               "finish_reason": finish}], **extra})

    response.start_stream()
    await response.write(chunk({"role": "assistant", "content": ""}))
    n_out, prefill = 0, None
    try:
        async for d in stream:
            n_out = d.num_output_tokens
            prefill = d.prefill or prefill
            out = b""
            if d.text or (d.logprobs and not d.finished):
                lp = logprobs_chat(ctx.tokenizer, d) if opts.params.logprobs is not None else None
                out += chunk({"content": d.text}, logprobs=lp)
            if d.finished:
                out += chunk({}, finish=d.finish_reason)
            if out:
                await response.write(out)
            if response.disconnected:
                stream.abort()
                return
    except HTTPError:
        raise
    except Exception as e:   # the engine failed mid-stream: tell the client, end the stream
        await response.write(sse_event({"error": {"message": str(e), "type": "server_error",
                                                  "param": None, "code": None}}))
        response.end_stream()
        return
    tail = b""
    if opts.include_usage:
        tail += sse_event({**base, "choices": [], "usage": usage(stream.num_prompt_tokens, n_out, prefill)})
    await response.write(tail + SSE_DONE)
    response.end_stream()
