"""POST /v1/completions: a text or token-id prompt, no chat template."""

from __future__ import annotations

import time
import uuid

from freetoken.server.http import SSE_DONE, sse_event
from freetoken.server.openai.params import bad, get_bool, parse_generation
from freetoken.server.openai.stream import collect, logprobs_completion, usage


def parse_prompt(ctx, body: dict) -> list[int]:
    prompt = body.get("prompt")
    # A batch of one is accepted in either spelling: ["text"] or [[ids]].
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt", "'prompt' is empty")
        return ctx.tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("prompt", "one prompt per request: send several requests to batch")
    raise bad("prompt", "'prompt' must be a string or a list of token ids")


async def completions(ctx, request, response) -> None:
    body = request.json()
    model = ctx.check_model(body)
    if get_bool(body, "echo", False):
        raise bad("echo", "'echo' is not supported")
    if body.get("suffix"):
        raise bad("suffix", "'suffix' is not supported")
    prompt_ids = parse_prompt(ctx, body)
    opts = parse_generation(body, chat=False)
    stream = ctx.submit(prompt_ids, opts.params)
    response.on_disconnect(stream.abort)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    want_lp = opts.params.logprobs is not None
    if not opts.stream:
        r = await collect(stream)
        lp = logprobs_completion(ctx.tokenizer, r.token_ids, r.logprobs, 0) if want_lp else None
        response.send_json(200, {
            "id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": r.text, "logprobs": lp, "finish_reason": r.finish_reason}],
            "usage": usage(stream.num_prompt_tokens, r.num_output_tokens, r.prefill, r.num_cached_tokens)})
        return

    base = {"id": rid, "object": "text_completion", "created": created, "model": model}
    extra = {"usage": None} if opts.include_usage else {}
    response.start_stream()
    n_out, offset, prefill, cached = 0, 0, None, 0
    try:
        async for d in stream:
            n_out = d.num_output_tokens
            prefill = d.prefill or prefill
            cached = d.num_cached_tokens
            lp = None
            if want_lp and d.logprobs:
                lp = logprobs_completion(ctx.tokenizer, d.new_token_ids, d.logprobs, offset)
            offset += len(d.text)
            if d.text or d.finished or lp:
                await response.write(sse_event({**base, "choices": [{
                    "index": 0, "text": d.text, "logprobs": lp,
                    "finish_reason": d.finish_reason if d.finished else None}], **extra}))
            if response.disconnected:
                stream.abort()
                return
    except Exception as e:   # the engine failed mid-stream: say so and end the stream
        await response.write(sse_event({"error": {"message": str(e), "type": "server_error",
                                                  "param": None, "code": None}}))
        response.end_stream()
        return
    tail = sse_event({**base, "choices": [], "usage": usage(stream.num_prompt_tokens, n_out, prefill, cached)}) \
        if opts.include_usage else b""
    await response.write(tail + SSE_DONE)
    response.end_stream()
