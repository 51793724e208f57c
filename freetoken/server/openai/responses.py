"""POST /v1/responses (stateless): input items -> chat template -> engine -> output items.

Output items, in the order the model produced them: a `reasoning` item (its text as
`reasoning_text` content), a `message` with `output_text`, one `function_call` per tool call.
Streaming sends the typed events the official SDK accumulates, each with its
sequence_number: response.created, response.in_progress, then per item
output_item.added -> (content_part.added -> output_text.delta | reasoning_text.delta ...
-> *.done -> content_part.done | function_call_arguments.delta ... -> .done) ->
output_item.done, and last response.completed (or response.incomplete when
max_output_tokens cut the answer short).
"""

from __future__ import annotations

import copy
import time
import uuid

from freetoken.server.generation import start_generation
from freetoken.server.http import SSE_PING, sse_event
from freetoken.server.openai.chat import check_effort, parse_effort
from freetoken.server.openai.stream import is_shutdown
from freetoken.server.openai.responses_input import parse_responses_body

_TEXT = {"message": ("output_text", "response.output_text"),
         "reasoning": ("reasoning_text", "response.reasoning_text")}


class ResponseBuilder:
    """Turns the parser's Events into output items and the stream events that build them."""

    def __init__(self):
        self.output: list[dict] = []
        self._open: dict | None = None       # the item being written

    def feed(self, events) -> list[dict]:
        out: list[dict] = []
        for e in events:
            if e.kind in ("reasoning", "content"):
                out += self._text(e.text, "reasoning" if e.kind == "reasoning" else "message")
            elif e.kind == "tool_start":
                out += self.close()
                hexid = e.id.removeprefix("call_")
                out += self._add({"id": f"fc_{hexid}", "type": "function_call", "call_id": e.id,
                                  "name": e.name, "arguments": "", "status": "in_progress"})
            elif e.kind == "tool_args" and self._open is not None:
                self._open["arguments"] += e.text
                out.append({"type": "response.function_call_arguments.delta", **self._where(),
                            "delta": e.text})
            elif e.kind == "tool_end":
                out += self.close()
        return out

    def close(self, status: str = "completed") -> list[dict]:
        """Finish the open item (if any): its *.done events and output_item.done."""
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        if item["type"] == "function_call":
            done = [{"type": "response.function_call_arguments.done", **where, "name": item["name"],
                     "arguments": item["arguments"]}]
        else:
            part = item["content"][0]
            extra = {"logprobs": []} if item["type"] == "message" else {}
            done = [{"type": f"{_TEXT[item['type']][1]}.done", **where, "content_index": 0,
                     "text": part["text"], **extra},
                    {"type": "response.content_part.done", **where, "content_index": 0,
                     "part": copy.deepcopy(part)}]
        return done + [{"type": "response.output_item.done", "output_index": where["output_index"],
                        "item": copy.deepcopy(item)}]

    def _text(self, text: str, kind: str) -> list[dict]:
        out: list[dict] = []
        if self._open is None or self._open["type"] != kind:
            out += self.close()
            out += self._open_text_item(kind)
        self._open["content"][0]["text"] += text
        extra = {"logprobs": []} if kind == "message" else {}
        out.append({"type": f"{_TEXT[kind][1]}.delta", **self._where(), "content_index": 0,
                    "delta": text, **extra})
        return out

    def _open_text_item(self, kind: str) -> list[dict]:
        if kind == "message":
            item = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": f"rs_{uuid.uuid4().hex[:24]}", "type": "reasoning", "summary": [],
                    "status": "in_progress", "content": []}
            part = {"type": "reasoning_text", "text": ""}
        out = self._add(item)
        item["content"].append(part)
        out.append({"type": "response.content_part.added", **self._where(), "content_index": 0,
                    "part": copy.deepcopy(part)})
        return out

    def _add(self, item: dict) -> list[dict]:
        self.output.append(item)
        self._open = item
        return [{"type": "response.output_item.added", "output_index": len(self.output) - 1,
                 "item": copy.deepcopy(item)}]

    def _where(self) -> dict:
        return {"item_id": self._open["id"], "output_index": len(self.output) - 1}


def _response(body: dict, rid: str, model: str, created: float, status: str, output: list[dict],
              gen=None) -> dict:
    reasoning = body.get("reasoning") if isinstance(body.get("reasoning"), dict) else {}
    out = {
        "id": rid, "object": "response", "created_at": created, "model": model, "status": status,
        "output": output, "error": None, "incomplete_details": None,
        "instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
        "max_output_tokens": body.get("max_output_tokens"), "parallel_tool_calls": True,
        "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
        "reasoning": {"effort": reasoning.get("effort"), "summary": None},
        "text": {"format": _text_format(body)}, "truncation": "disabled", "store": False,
        "usage": None,
    }
    if status == "incomplete":
        out["incomplete_details"] = {"reason": "max_output_tokens"}
    if gen is not None:
        out["completed_at"] = time.time() if status == "completed" else None
        out["usage"] = {
            "input_tokens": gen.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": gen.num_cached_tokens,
                                     "cache_write_tokens": gen.num_cache_created_tokens},
            "output_tokens": gen.num_output_tokens,
            "output_tokens_details": {"reasoning_tokens": gen.num_reasoning_tokens},
            "total_tokens": gen.num_prompt_tokens + gen.num_output_tokens}
    return out


def _text_format(body: dict) -> dict:
    text = body.get("text") if isinstance(body.get("text"), dict) else {}
    fmt = text.get("format")
    return fmt if isinstance(fmt, dict) and fmt.get("type") else {"type": "text"}


async def responses(ctx, request, response) -> None:
    body = request.json()
    model = ctx.check_model(body)
    req, stream = parse_responses_body(body, parse_effort)
    check_effort(ctx.meta, req.effort, "reasoning.effort")
    gen, _ = await start_generation(ctx, req)
    response.on_disconnect(gen.stream.abort)
    rid, created = f"resp_{uuid.uuid4().hex}", time.time()
    builder = ResponseBuilder()
    if not stream:
        async for step in gen.steps():
            builder.feed(step.events)
        status = "incomplete" if gen.finish_reason == "length" else "completed"
        builder.close(status)
        response.send_json(200, _response(body, rid, model, created, status, builder.output, gen))
        return

    seq = iter(range(1 << 62))

    def events(items: list[dict]) -> bytes:
        return b"".join(sse_event({**ev, "sequence_number": next(seq)}, event=ev["type"]) for ev in items)

    response.start_stream()
    start = _response(body, rid, model, created, "in_progress", [])
    await response.write(events([{"type": "response.created", "response": start},
                                 {"type": "response.in_progress", "response": start}]))
    def error(e: Exception) -> bytes:
        out = [{"type": "error", "code": "server_error", "message": str(e), "param": None}]
        if is_shutdown(e):   # cut by shutdown: the stream still ends with its terminator
            failed = _response(body, rid, model, created, "failed", builder.output, gen)
            out.append({"type": "response.failed",
                        "response": {**failed, "error": {"code": "server_error", "message": str(e)}}})
        return events(out)

    if not await gen.stream_to(response, ctx.server_config.ping_interval_s, SSE_PING,
                               lambda step: events(builder.feed(step.events)), error):
        return
    status = "incomplete" if gen.finish_reason == "length" else "completed"
    tail = builder.close(status)
    final = _response(body, rid, model, created, status, builder.output, gen)
    await response.write(events(tail + [{"type": f"response.{status}", "response": final}]))
    response.end_stream()
