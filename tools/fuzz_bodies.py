#!/usr/bin/env python3
"""Seeded adversarial request bodies for every POST route of `ft serve`.

    python tools/fuzz_bodies.py --url http://127.0.0.1:1919 --count 10000 --seed 0

Each body is one of: a plausible request with fields of random types, a valid request cut
short, deep nesting, huge or non-finite numbers, odd Unicode (lone surrogates, zero-width and
bidi marks, NUL), bytes that are not UTF-8, an empty body, a JSON value that is not an object.
Generation is capped (max_tokens <= 4) so a body that happens to be valid costs little. A
reply in the 5xx range, a dropped connection or a server that stops answering /health is a
failure; the same seed gives the same bodies, so a failure reproduces. tests/test_serve_fuzz.py
runs a few hundred in CI; this CLI runs as many as asked.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import urllib.error
import urllib.request

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
          "/v1/messages/count_tokens", "/tokenize", "/detokenize")
FIELDS = ("model", "messages", "prompt", "input", "max_tokens", "max_output_tokens", "stream",
          "temperature", "top_p", "top_k", "n", "stop", "seed", "tools", "tool_choice", "logprobs",
          "top_logprobs", "response_format", "logit_bias", "presence_penalty", "system",
          "thinking", "reasoning_effort", "tokens", "echo", "stream_options", "text", "content",
          "role", "type", "name", "arguments", "input_schema", "parameters")
ODD = ["\ud800", "\udfff", "\u200b", "\u202e", "\x00", "\ufeff", "𝔘𝔫𝔦", "e\u0301" * 50,
       "\U0010ffff", "<think>", "<tool_call>{", "<|im_end|>", "\\", '"', "\u2028"]


def _scalar(rng: random.Random):
    return rng.choice([
        None, True, False, 0, -1, 1, 2**31, -2**63, 2**64 + 1, 10**30, 1e308, -1e-308, 0.5,
        float("nan"), "", "x" * rng.randint(1, 200), rng.choice(ODD) * rng.randint(1, 5),
        rng.randint(-10, 10), rng.random() * 1e6])


def _value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 4 or r < 0.45:
        return _scalar(rng)
    if r < 0.7:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(FIELDS + tuple(ODD)): _value(rng, depth + 1) for _ in range(rng.randint(0, 5))}


def _plausible(rng: random.Random, route: str) -> dict:
    body = {"max_tokens": rng.randint(0, 4), "temperature": 0}
    if route in ("/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens"):
        body["messages"] = [{"role": rng.choice(["user", "assistant", "system", "tool", "x"]),
                             "content": rng.choice([_value(rng), "hi " + rng.choice(ODD)])}
                            for _ in range(rng.randint(0, 3))]
    elif route == "/v1/responses":
        body["input"] = rng.choice([_value(rng), "hello", [{"role": "user", "content": "hi"}]])
        body["max_output_tokens"] = body.pop("max_tokens") + 16
    elif route == "/detokenize":
        body["tokens"] = rng.choice([_value(rng), [rng.randint(-5, 5000) for _ in range(5)]])
    else:
        body["prompt"] = rng.choice([_value(rng), "once upon", [1, 2, 3], [[1, 2], "x"]])
    for _ in range(rng.randint(0, 4)):        # some fields with random types
        body[rng.choice(FIELDS)] = _value(rng)
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 4:
        body["max_tokens"] = 4
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2
    if isinstance(body.get("max_output_tokens"), int) and body["max_output_tokens"] > 20:
        body["max_output_tokens"] = 20
    return body


def _dumps(rng: random.Random, obj) -> bytes:
    # json (not orjson) writes NaN and lone surrogates, which is the point; escaped or raw.
    return json.dumps(obj, ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")


def body_for(rng: random.Random, route: str) -> bytes:
    kind = rng.random()
    if kind < 0.45:
        return _dumps(rng, _plausible(rng, route))
    if kind < 0.6:                            # a valid body cut short
        raw = _dumps(rng, _plausible(rng, route))
        return raw[:rng.randint(0, max(0, len(raw) - 1))]
    if kind < 0.68:                           # deep nesting
        depth = rng.choice([100, 1000, 5000])
        return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"
    if kind < 0.76:                           # not UTF-8
        return bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    if kind < 0.82:
        return rng.choice([b"", b" ", b"null", b"[]", b'"x"', b"1e999", b"{", b"}"])
    return _dumps(rng, _value(rng))


def cases(seed: int, count: int):
    """(route, body bytes) pairs; the same seed, the same cases."""
    rng = random.Random(seed)
    for _ in range(count):
        route = rng.choice(ROUTES)
        yield route, body_for(rng, route)


def send(url: str, route: str, body: bytes, timeout: float = 60) -> int:
    """POST one body; its HTTP status (a failure to get one raises)."""
    req = urllib.request.Request(url + route, data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code


def run(url: str, seed: int, count: int) -> list[tuple[int, str, int, bytes]]:
    """The failures: (case number, route, status or -1, body)."""
    failures = []
    for i, (route, body) in enumerate(cases(seed, count)):
        try:
            status = send(url, route, body)
        except Exception:    # noqa: BLE001 - a dropped connection is a failure to report
            status = -1
        if status >= 500 or status < 0:
            failures.append((i, route, status, body[:200]))
    return failures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:1919")
    p.add_argument("--count", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    failures = run(args.url, args.seed, args.count)
    for f in failures[:20]:
        print("FAIL", *f)
    print(f"{args.count} bodies, {len(failures)} failures (seed {args.seed})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
