"""Validate an OpenAI request body's generation fields into SamplingParams.

Every wrong type or out-of-range value is an HTTPError 400 that names the parameter, in
OpenAI's error shape; nothing here lets a bad body reach the engine.
"""

from __future__ import annotations

import dataclasses

from freetoken.engine.sampling_params import SamplingParams
from freetoken.server.errors import HTTPError

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


def parse_generation(body: dict, *, chat: bool) -> GenerationOptions:
    """The fields chat and completions share (plus vLLM's extra sampling parameters)."""
    n = get_int(body, "n", 1, 1)
    if n != 1:
        raise bad("n", "only n=1 is supported")
    if get_int(body, "best_of", 1, 1) != 1:
        raise bad("best_of", "only best_of=1 is supported")
    for name in ("presence_penalty", "frequency_penalty"):
        if get_number(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise bad(name, f"'{name}' is not supported; leave it at 0")
    if get_number(body, "repetition_penalty", 1.0, 0.0, 10.0) != 1.0:
        raise bad("repetition_penalty", "'repetition_penalty' is not supported; leave it at 1")
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
        max_tokens=max_tokens,
        **sampling_fields(body, max_temperature=2.0),
        min_p=get_number(body, "min_p", 0.0, 0.0, 1.0),
        seed=get_int(body, "seed", None, -(2**63), 2**63 - 1),
        stop=stop, stop_token_ids=stop_ids,
        ignore_eos=get_bool(body, "ignore_eos", False),
        min_tokens=get_int(body, "min_tokens", 0, 0),
        logprobs=logprobs,
        skip_special_tokens=get_bool(body, "skip_special_tokens", True),
        include_stop_str_in_output=get_bool(body, "include_stop_str_in_output", False),
    )
    return GenerationOptions(params, stream, include_usage)
