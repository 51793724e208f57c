"""POST /v1/completions: text or token-id prompts, no chat template.

`prompt` is a string, a list of token ids, or a batch (a list of either): one choice per prompt
and sample, at index prompt_index * n + j, as OpenAI numbers them. `echo` puts the prompt in
front of the text, and with `logprobs` its tokens' logprobs first (the first token's is None),
as lm-eval's loglikelihood tasks read them. vLLM's `prompt_logprobs` comes back per choice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

from freetoken.server.errors import HTTPError
from freetoken.server.generation import sample_params, off_loop
from freetoken.server.http import SSE_DONE, SSE_PING, sse_event
from freetoken.server.openai.params import bad, get_bool, parse_generation
from freetoken.server.openai.stream import (collect, logprobs_completion, prompt_logprobs_vllm,
                                            is_shutdown, stream_error, stream_many, usage)

MAX_PROMPTS = 256


def _is_ids(p) -> bool:
    return isinstance(p, list) and bool(p) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)


def parse_prompts(ctx, body: dict) -> list[list[int]]:
    """Each prompt's token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_ids(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad("prompt", "'prompt' must be a string, a list of token ids, or a list of either")
    if len(prompt) > MAX_PROMPTS:
        raise bad("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
    out = []
    for i, p in enumerate(prompt):
        where = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            if not p:
                raise bad("prompt", f"'{where}' is empty")
            out.append(ctx.tokenizer.encode(p))
        elif _is_ids(p):
            out.append(p)
        else:
            raise bad("prompt", f"'{where}' must be a string or a non-empty list of token ids")
    return out


@dataclasses.dataclass
class Choice:
    index: int
    prompt_ids: list[int]
    stream: object             # RequestStream
    offset: int = 0            # characters of text sent so far (text_offset)
    started: bool = False

    async def steps(self):     # what stream_many pumps
        async for d in self.stream:
            yield _Step(d)


@dataclasses.dataclass
class _Step:
    delta: object


def _submit_all(ctx, prompts: list[list[int]], params, n: int) -> list[Choice]:
    choices: list[Choice] = []
    try:
        for i, ids in enumerate(prompts):
            for j in range(n):
                p = params if len(prompts) * n == 1 else sample_params(params, j)
                try:
                    stream = ctx.submit(ids, p)
                except HTTPError as e:   # the engine's context check names the chat field
                    if e.param == "messages":
                        e.param = "prompt"
                    raise
                choices.append(Choice(i * n + j, ids, stream))
    except BaseException:
        for c in choices:
            c.stream.abort()
        raise
    return choices


async def completions(ctx, request, response) -> None:
    body = request.json()
    model = ctx.check_model(body)
    if body.get("suffix"):
        raise bad("suffix", "'suffix' is not supported")
    echo = get_bool(body, "echo", False)
    prompts = await off_loop(len(request.body), parse_prompts, ctx, body)
    opts = parse_generation(body, chat=False)
    params = opts.params
    want_lp = params.logprobs is not None
    if echo and want_lp and params.prompt_logprobs is None:
        params.prompt_logprobs = params.logprobs
    choices = _submit_all(ctx, prompts, params, opts.n)
    response.on_disconnect(lambda: [c.stream.abort() for c in choices])
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    tok = ctx.tokenizer
    vllm_prompt_lps = body.get("prompt_logprobs") is not None
    prompt_tokens = sum(len(p) for p in prompts)

    def echo_part(c: Choice, prompt_lps) -> tuple[str, dict | None]:
        text = tok.decode(c.prompt_ids, skip_special_tokens=False)
        lp = None
        if want_lp:
            entries = [None if e is None else e[:2] for e in (prompt_lps or [None] * len(c.prompt_ids))]
            lp = logprobs_completion(tok, c.prompt_ids, entries, 0)
        return text, lp

    if not opts.stream:
        results = await asyncio.gather(*(collect(c.stream) for c in choices))
        out = []
        for c, r in zip(choices, results):
            text, lp = "", None
            if echo:
                text, lp = echo_part(c, r.prompt_logprobs)
            if want_lp:
                gen_lp = logprobs_completion(tok, r.token_ids, r.logprobs, len(text))
                lp = gen_lp if lp is None else {k: lp[k] + gen_lp[k] for k in lp}
            choice = {"index": c.index, "text": text + r.text, "logprobs": lp, "finish_reason": r.finish_reason}
            if vllm_prompt_lps:
                choice["prompt_logprobs"] = prompt_logprobs_vllm(tok, c.prompt_ids, r.prompt_logprobs)
            out.append(choice)
        response.send_json(200, {
            "id": rid, "object": "text_completion", "created": created, "model": model, "choices": out,
            "usage": usage(prompt_tokens, sum(r.num_output_tokens for r in results), results[0].prefill,
                           sum(r.num_cached_tokens for c, r in zip(choices, results) if c.index % opts.n == 0))})
        return

    base = {"id": rid, "object": "text_completion", "created": created, "model": model}
    extra = {"usage": None} if opts.include_usage else {}
    totals = {"out": [0] * len(choices), "prefill": None, "cached": [0] * len(choices)}

    def render(k: int, step) -> bytes:
        c, d = choices[k], step.delta
        totals["out"][k] = d.num_output_tokens
        totals["prefill"] = d.prefill or totals["prefill"]
        if c.index % opts.n == 0:          # a prompt's cached tokens counted once, not per sample
            totals["cached"][k] = d.num_cached_tokens
        text, lp = "", None
        if echo and not c.started:
            text, lp = echo_part(c, d.prompt_logprobs)
        c.started = True
        if want_lp and d.logprobs:
            gen_lp = logprobs_completion(tok, d.new_token_ids, d.logprobs, c.offset + len(text))
            lp = gen_lp if lp is None else {key: lp[key] + gen_lp[key] for key in lp}
        text += d.text
        c.offset += len(text)
        if not (text or d.finished or lp):
            return b""
        choice = {"index": c.index, "text": text, "logprobs": lp,
                  "finish_reason": d.finish_reason if d.finished else None}
        if vllm_prompt_lps and d.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_vllm(tok, c.prompt_ids, d.prompt_logprobs)
        return sse_event({**base, "choices": [choice], **extra})

    def error(e: Exception) -> bytes:   # cut by shutdown: the error event, then the terminator
        return stream_error(e) + (SSE_DONE if is_shutdown(e) else b"")

    response.start_stream()
    if not await stream_many(choices, response, ctx.server_config.ping_interval_s, SSE_PING, render, error):
        return
    tail = sse_event({**base, "choices": [], "usage": usage(prompt_tokens, sum(totals["out"]), totals["prefill"],
                                                             sum(totals["cached"]))}) \
        if opts.include_usage else b""
    await response.write(tail + SSE_DONE)
    response.end_stream()
