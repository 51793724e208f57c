"""Helpers both OpenAI routes share: draining a request's deltas, usage and logprobs shapes."""

from __future__ import annotations

import asyncio
import dataclasses


@dataclasses.dataclass
class Collected:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_output_tokens: int
    logprobs: list
    prefill: dict | None = None
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0


async def collect(stream) -> Collected:
    """Run a request to the end (non-streaming responses)."""
    texts, ids, lps = [], [], []
    finish, n_out, prefill, prompt_lps, cached = None, 0, None, None, 0
    try:
        async for d in stream:
            prompt_lps = d.prompt_logprobs if d.prompt_logprobs is not None else prompt_lps
            texts.append(d.text)
            ids.extend(d.new_token_ids)
            lps.extend(d.logprobs or [])
            finish, n_out = d.finish_reason, d.num_output_tokens
            prefill = d.prefill or prefill
            cached = d.num_cached_tokens
    finally:
        if not stream.finished:
            stream.abort()
    return Collected("".join(texts), ids, finish, n_out, lps, prefill, prompt_lps, cached)


def prompt_logprobs_vllm(tokenizer, prompt_ids: list[int], entries: list | None) -> list | None:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {id: {logprob, rank,
    decoded_token}} for the token itself and its top alternatives."""
    if entries is None:
        return None
    out = []
    for tid, e in zip(prompt_ids, entries):
        if e is None:
            out.append(None)
            continue
        lp, top, rank = e
        item = {str(tid): {"logprob": lp, "rank": rank, "decoded_token": token_key(tokenizer, tid)}}
        for k, (t, v) in enumerate(top):
            item.setdefault(str(t), {"logprob": v, "rank": k + 1, "decoded_token": token_key(tokenizer, t)})
        out.append(item)
    return out


def usage(prompt_tokens: int, completion_tokens: int, prefill: dict | None = None,
          cached_tokens: int = 0) -> dict:
    """OpenAI's usage object (cached_tokens: prompt tokens served by the prefix cache); with
    FREETOKEN_INSTRUMENT_PREFILL the prefill timing rides along."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens,
           "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if prefill is not None:
        out["prefill"] = prefill
    return out


def _token(tokenizer, token_id: int) -> tuple[str, list[int]]:
    """(the token's text, its raw bytes): the bytes are the token's own, so a token holding
    part of a UTF-8 character reports those bytes, not U+FFFD's."""
    if tokenizer is None:
        return str(token_id), list(str(token_id).encode())
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    return text, list(tokenizer.token_bytes(token_id))


def token_key(tokenizer, token_id: int) -> str:
    """A token as a completions logprobs string: its text, or for a token that is not whole
    UTF-8 by itself "bytes:\\xNN..." (as OpenAI writes them), and one with no bytes (an id
    past the tokenizer) "token_id:N", so distinct tokens do not share a key in top_logprobs."""
    if tokenizer is None:
        return str(token_id)
    raw = tokenizer.token_bytes(token_id)
    if not raw:       # an id past the tokenizer (the model's vocabulary may be larger)
        return f"token_id:{token_id}"
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def logprobs_chat(tokenizer, result) -> dict:
    """OpenAI chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}"""
    ids = getattr(result, "token_ids", None) or result.new_token_ids
    content = []
    for tid, lp in zip(ids, result.logprobs or []):
        if lp is None:
            continue
        text, raw = _token(tokenizer, tid)
        top = []
        for t, v in lp[1]:
            tt, traw = _token(tokenizer, t)
            top.append({"token": tt, "logprob": v, "bytes": traw})
        content.append({"token": text, "logprob": lp[0], "bytes": raw, "top_logprobs": top})
    return {"content": content}


def _top_dict(tokenizer, top: list) -> dict:
    """{key: logprob} for the alternatives; two tokens with the same text (an added token and
    its spelling in pieces, say) keep apart as "token_id:N"."""
    out: dict = {}
    for t, v in top:
        key = token_key(tokenizer, t)
        out[f"token_id:{t}" if key in out else key] = v
    return out


def logprobs_completion(tokenizer, token_ids: list[int], logprobs: list, offset: int) -> dict:
    """Legacy completions shape: parallel lists of tokens, logprobs, top dicts, text offsets
    (characters into the choice's text). A None entry (the first prompt token with echo) has
    logprob and top_logprobs None."""
    tokens, token_lps, tops, offsets = [], [], [], []
    raw = b""    # the tokens' bytes so far: an offset counts the characters they complete
    for tid, lp in zip(token_ids, logprobs):
        text = token_key(tokenizer, tid)
        tokens.append(text)
        token_lps.append(lp[0] if lp else None)
        tops.append(_top_dict(tokenizer, lp[1]) if lp else None)
        offsets.append(offset + len(raw.decode("utf-8", errors="ignore")))
        raw += tokenizer.token_bytes(tid) if tokenizer else text.encode()
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def is_shutdown(e: Exception) -> bool:
    """The stream was cut because the server is shutting down (an EngineFailure marked
    unavailable, or the 503 the Generation turns it into), not because a step failed. Such a
    stream still ends with its dialect's terminator; a failed one does not, so no client takes
    it for a complete answer."""
    return getattr(e, "status", None) == 503 or getattr(e, "unavailable", False)


def stream_error(e: Exception) -> bytes:
    """The error event of a Chat Completions or Completions stream."""
    from freetoken.server.http import sse_event
    return sse_event({"error": {"message": str(e), "type": "service_unavailable" if is_shutdown(e) else "server_error",
                                "param": None, "code": None}})


async def stream_many(gens, response, ping_s: float | None, ping: bytes, render, error) -> bool:
    """Generation.stream_to for n samples at once: render(j, step) for each step of sample j, in
    the order they arrive; True when all ended, False when the client left or one failed (then
    error(exc) was written, the others aborted and the stream ended)."""
    if len(gens) == 1 and hasattr(gens[0], "stream_to"):
        return await gens[0].stream_to(response, ping_s, ping, lambda step: render(0, step), error)
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(j, gen):
        try:
            async for step in gen.steps():
                queue.put_nowait((j, step))
        except Exception as e:   # noqa: BLE001 - handed to the writer below
            queue.put_nowait((j, e))
        queue.put_nowait((j, None))

    tasks = [asyncio.ensure_future(pump(j, g)) for j, g in enumerate(gens)]
    running = len(gens)
    try:
        while running:
            try:
                async with asyncio.timeout(ping_s):
                    j, item = await queue.get()
            except TimeoutError:
                await response.write(ping)
                continue
            if item is None:
                running -= 1
                continue
            if isinstance(item, Exception):
                await response.write(error(item))
                response.end_stream()
                return False
            out = render(j, item)
            if out:
                await response.write(out)
            if response.disconnected:
                return False
        return True
    finally:
        for t in tasks:
            t.cancel()
        for g in gens:
            if not g.stream.finished:
                g.stream.abort()
