"""Helpers both OpenAI routes share: draining a request's deltas, usage and logprobs shapes."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Collected:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_output_tokens: int
    logprobs: list
    prefill: dict | None = None
    num_cached_tokens: int = 0


async def collect(stream) -> Collected:
    """Run a request to the end (non-streaming responses)."""
    texts, ids, lps = [], [], []
    finish, n_out, prefill, cached = None, 0, None, 0
    try:
        async for d in stream:
            texts.append(d.text)
            ids.extend(d.new_token_ids)
            lps.extend(d.logprobs or [])
            finish, n_out = d.finish_reason, d.num_output_tokens
            prefill = d.prefill or prefill
            cached = d.num_cached_tokens
    finally:
        if not stream.finished:
            stream.abort()
    return Collected("".join(texts), ids, finish, n_out, lps, prefill, cached)


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
    text = tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer else str(token_id)
    return text, list(text.encode("utf-8"))


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


def logprobs_completion(tokenizer, token_ids: list[int], logprobs: list, offset: int) -> dict:
    """Legacy completions shape: parallel lists of tokens, logprobs, top dicts, text offsets."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, lp in zip(token_ids, logprobs):
        text, _ = _token(tokenizer, tid)
        tokens.append(text)
        token_lps.append(lp[0] if lp else None)
        tops.append({_token(tokenizer, t)[0]: v for t, v in lp[1]} if lp else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
