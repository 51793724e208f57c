"""Validate an OpenAI request body's generation fields into SamplingParams.

Every wrong type or out-of-range value is an HTTPError 400 that names the parameter, in
OpenAI's error shape; nothing here lets a bad body reach the engine.
"""

from __future__ import annotations

import dataclasses

from freetoken.engine.sampling_params import SamplingParams
from freetoken.server import structured
from freetoken.server.errors import HTTPError

MAX_N = 16      # samples per prompt: each is its own engine request

_MISSING = object()


def bad(param: str, message: str) -> HTTPError:
    return HTTPError(400, message, type="invalid_request_error", param=param)


def get_number(body: dict, name: str, default, lo: float, hi: float):
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(name, f"'{name}' must be a number, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise bad(name, f"'{name}' must be between {lo} and {hi}, got {value}")
    return value


def get_int(body: dict, name: str, default, lo: int, hi: int | None = None):
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"'{name}' must be an integer, got {type(value).__name__}")
    if value < lo or (hi is not None and value > hi):
        raise bad(name, f"'{name}' must be {'>= ' + str(lo) if hi is None else f'between {lo} and {hi}'}, got {value}")
    return value


def get_seed(body: dict) -> int | None:
    """seed: a 64-bit integer; a number outside that range (1e23, 2**64) says so."""
    value = body.get("seed")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
        raise bad("seed", f"'seed' is out of range: it must be an integer in [-2**63, 2**63 - 1], got {value}")
    return get_int(body, "seed", None, -(2**63), 2**63 - 1)


def get_bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"'{name}' must be a boolean, got {type(value).__name__}")
    return value


def get_dict(body: dict, name: str) -> dict:
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad(name, f"'{name}' must be an object")
    return value


def map_list(value, param: str, convert) -> list | None:
    """None, or [convert(i, item)] over a list (each dialect's tools to Chat Completions'
    shape); anything but a list is a 400 naming param."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad(param, f"'{param}' must be a list")
    return [convert(i, item) for i, item in enumerate(value)]


def sampling_fields(body: dict, max_temperature: float) -> dict:
    """temperature, top_p and top_k, which every dialect takes (temperature up to 2 in OpenAI's
    APIs, up to 1 in Anthropic's), validated in that order."""
    return {"temperature": get_number(body, "temperature", 1.0, 0.0, max_temperature),
            # top_p 0 (the top token only) is allowed here; SamplingParams wants it above 0
            "top_p": get_number(body, "top_p", 1.0, 0.0, 1.0) or 1e-9,
            "top_k": get_int(body, "top_k", -1, -1)}


def sampling_params(**fields) -> SamplingParams:
    """SamplingParams(**fields); a value it refuses is a 400 naming the parameter."""
    try:
        return SamplingParams(**fields)
    except ValueError as e:
        raise bad(getattr(e, "param", None), str(e)) from None


@dataclasses.dataclass
class GenerationOptions:
    params: SamplingParams
    stream: bool
    include_usage: bool
    n: int = 1


def parse_generation(body: dict, *, chat: bool) -> GenerationOptions:
    """The fields chat and completions share (plus vLLM's extra sampling parameters)."""
    n = get_int(body, "n", 1, 1, MAX_N)
    best_of = get_int(body, "best_of", None, 1)
    if best_of is not None and best_of not in (1, n):
        raise bad("best_of", f"'best_of' ({best_of}) other than n is not supported: every sample is "
                             f"returned; ask for n={best_of} and rank them yourself")
    penalties = {name: get_number(body, name, 0.0, -2.0, 2.0)
                 for name in ("presence_penalty", "frequency_penalty")}
    penalties["repetition_penalty"] = get_number(body, "repetition_penalty", 1.0, 0.0, 10.0)
    if penalties["repetition_penalty"] <= 0:
        raise bad("repetition_penalty", "'repetition_penalty' must be above 0 (1: off)")
    max_tokens = get_int(body, "max_completion_tokens", None, 1) if chat else None
    if max_tokens is None:
        max_tokens = get_int(body, "max_tokens", None, 1)
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise bad("stop", "'stop' must be a non-empty string or a list of them")
        if len(stop) > 16:
            raise bad("stop", "at most 16 stop sequences")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and (not isinstance(stop_ids, list)
                                 or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids)):
        raise bad("stop_token_ids", "'stop_token_ids' must be a list of integers")
    if chat:
        logprobs = None
        if get_bool(body, "logprobs", False):
            logprobs = get_int(body, "top_logprobs", 0, 0, 20)
        elif body.get("top_logprobs") is not None:
            raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    else:
        logprobs = get_int(body, "logprobs", None, 0, 20)
    stream = get_bool(body, "stream", False)
    stream_options = get_dict(body, "stream_options")
    include_usage = get_bool(stream_options, "include_usage", False)
    if stream_options and not stream:
        raise bad("stream_options", "'stream_options' is only allowed with 'stream': true")
    params = sampling_params(
        max_tokens=max_tokens, **penalties, logit_bias=logit_bias(body),
        prompt_logprobs=get_int(body, "prompt_logprobs", None, 0, 20),
        structured_outputs=structured.from_body(body),
        **sampling_fields(body, max_temperature=2.0),
        min_p=get_number(body, "min_p", 0.0, 0.0, 1.0),
        seed=get_seed(body),
        stop=stop, stop_token_ids=stop_ids,
        ignore_eos=get_bool(body, "ignore_eos", False),
        min_tokens=get_int(body, "min_tokens", 0, 0),
        logprobs=logprobs,
        skip_special_tokens=get_bool(body, "skip_special_tokens", True),
        include_stop_str_in_output=get_bool(body, "include_stop_str_in_output", False),
    )
    return GenerationOptions(params, stream, include_usage, n)


def logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]} (JSON keys are strings)."""
    value = body.get("logit_bias")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad("logit_bias", "'logit_bias' must map token ids to biases")
    out = {}
    for k, v in value.items():
        try:
            token = int(k)
        except (TypeError, ValueError):
            raise bad("logit_bias", f"'logit_bias' keys must be token ids, got {k!r}") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise bad("logit_bias", f"'logit_bias' values must be numbers in [-100, 100], got {v!r} for {k}")
        out[token] = float(v)
    return out or None
