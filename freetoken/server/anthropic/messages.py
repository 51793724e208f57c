"""POST /v1/messages and /v1/messages/count_tokens, in Anthropic's shapes.

A message's content blocks come in the order the model wrote them: `thinking` (with an
empty signature: there is nothing to sign), `text`, `tool_use` (input parsed from the
streamed arguments, which the tool parser keeps valid JSON). stop_reason: end_turn,
max_tokens, stop_sequence (with the sequence), tool_use. A stream is message_start, per
block content_block_start -> content_block_delta (thinking_delta | text_delta |
input_json_delta) ... -> content_block_stop, then message_delta (stop_reason, usage) and
message_stop; a `ping` event goes out whenever the model is silent for ping_interval_s.
Usage follows Anthropic's caching: input_tokens + cache_read_input_tokens (the prefix cache's
hit) + cache_creation_input_tokens (prompt tokens this request left cached) = the prompt. A
stream's message_start goes out before the prefill, so it counts the whole prompt as input;
message_delta then carries the final counts (cumulative, which the SDK overwrites with).
"""

from __future__ import annotations

import json
import uuid

from freetoken.server.anthropic.convert import parse_messages_body
from freetoken.server.generation import prepare_prompt, start_generation
from freetoken.server.http import sse_event
from freetoken.server.openai.params import get_bool

_PING = sse_event({"type": "ping"}, event="ping")


class BlockWriter:
    """Turns the parser's Events into content blocks and the stream events that build them."""

    def __init__(self):
        self.content: list[dict] = []
        self._open: dict | None = None
        self._json = ""                      # the open tool_use block's input, as streamed

    def feed(self, events) -> list[dict]:
        out: list[dict] = []
        for e in events:
            if e.kind == "reasoning":
                out += self._delta("thinking", {"type": "thinking_delta", "thinking": e.text})
            elif e.kind == "content":
                out += self._delta("text", {"type": "text_delta", "text": e.text})
            elif e.kind == "tool_start":
                out += self.close()
                out += self._start({"type": "tool_use", "id": "toolu_" + e.id.removeprefix("call_"),
                                    "name": e.name, "input": {}})
            elif e.kind == "tool_args" and self._open is not None:
                self._json += e.text
                out.append({"type": "content_block_delta", "index": len(self.content) - 1,
                            "delta": {"type": "input_json_delta", "partial_json": e.text}})
            elif e.kind == "tool_end":
                out += self.close()
        return out

    def close(self) -> list[dict]:
        block, self._open = self._open, None
        if block is None:
            return []
        if block["type"] == "tool_use":
            block["input"] = _input(self._json)
            self._json = ""
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]

    def _delta(self, kind: str, delta: dict) -> list[dict]:
        out: list[dict] = []
        if self._open is None or self._open["type"] != kind:
            out += self.close()
            out += self._start({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                               else {"type": "text", "text": ""})
        self._open[kind] += delta[kind]
        out.append({"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta})
        return out

    def _start(self, block: dict) -> list[dict]:
        self.content.append(block)
        self._open = block
        return [{"type": "content_block_start", "index": len(self.content) - 1, "content_block": dict(block)}]


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:   # cannot happen for parser output (kept valid); stay safe regardless
        return {}
    return value if isinstance(value, dict) else {"value": value}


def usage(gen) -> dict:
    read, created = gen.num_cached_tokens, gen.num_cache_created_tokens
    return {"input_tokens": gen.num_prompt_tokens - read - created,
            "cache_creation_input_tokens": created, "cache_read_input_tokens": read,
            "output_tokens": gen.num_output_tokens}


def stop_reason(gen) -> tuple[str, str | None]:
    if gen.finish_reason == "tool_calls":
        return "tool_use", None
    if gen.finish_reason == "length":
        return "max_tokens", None
    if isinstance(gen.stop_reason, str):
        return "stop_sequence", gen.stop_reason
    return "end_turn", None


async def messages(ctx, request, response) -> None:
    body = request.json()
    model = ctx.check_model(body)
    req = parse_messages_body(body)
    gen, _ = await start_generation(ctx, req)
    response.on_disconnect(gen.stream.abort)
    mid = f"msg_{uuid.uuid4().hex[:24]}"
    blocks = BlockWriter()
    message = {"id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
               "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": gen.num_prompt_tokens, "cache_creation_input_tokens": 0,
                         "cache_read_input_tokens": 0, "output_tokens": 0}}
    if not get_bool(body, "stream", False):
        async for step in gen.steps():
            blocks.feed(step.events)
        blocks.close()
        reason, sequence = stop_reason(gen)
        response.send_json(200, {**message, "content": blocks.content, "stop_reason": reason,
                                 "stop_sequence": sequence,
                                 "usage": usage(gen)})
        return

    def events(items: list[dict]) -> bytes:
        return b"".join(sse_event(ev, event=ev["type"]) for ev in items)

    response.start_stream()
    await response.write(events([{"type": "message_start", "message": message}]))
    if not await gen.stream_to(
            response, ctx.server_config.ping_interval_s, _PING,
            lambda step: events(blocks.feed(step.events)),
            lambda e: events([{"type": "error", "error": {"type": "api_error", "message": str(e)}}])):
        return
    reason, sequence = stop_reason(gen)
    await response.write(events(blocks.close() + [
        {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
         "usage": usage(gen)},
        {"type": "message_stop"}]))
    response.end_stream()


async def count_tokens(ctx, request, response) -> None:
    body = request.json()
    ctx.check_model(body)
    prompt = await prepare_prompt(ctx, parse_messages_body(body, count_only=True))
    response.send_json(200, {"input_tokens": len(prompt.token_ids)})
