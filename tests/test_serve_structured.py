"""End to end through a real `ft serve` and the openai SDK: structured outputs (response_format,
vLLM's guided_json / structured_outputs, the Responses API's text.format, strict tools), n > 1,
batched prompts, echo with prompt logprobs, penalties and logit_bias. The weights are random,
so a valid JSON answer is the grammar's doing alone."""

from __future__ import annotations

import json
import os

import jsonschema
import openai
import pytest

from serving import ServerProcess
from tiny_fixtures import tiny_model_dir  # noqa: F401 - a fixture

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days", "sunny"],
          "properties": {"city": {"type": "string", "maxLength": 8},
                         "days": {"type": "integer", "minimum": 1, "maximum": 14},
                         "sunny": {"type": "boolean"}}}
RF = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
MSGS = [{"role": "user", "content": "Plan a trip as JSON."}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):  # noqa: F811
    model_dir = tiny_model_dir("qwen3_moe", seed=0, name="tiny-qwen3", max_position_embeddings=1024)
    with ServerProcess(model_dir) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)


def _valid(text: str, schema=SCHEMA):
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 7)])
def test_chat_json_schema_streamed_and_not(client, temperature, seed):
    kw = dict(model="tiny-qwen3", messages=MSGS, max_tokens=300, temperature=temperature, seed=seed,
              response_format=RF)
    full = client.chat.completions.create(**kw)
    assert full.choices[0].finish_reason == "stop", full.choices[0].message.content
    _valid(full.choices[0].message.content)
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
              if c.choices]
    assert "".join(pieces) == full.choices[0].message.content


def _closing_bias(model_dir) -> dict:
    """Random weights write a free-form JSON string forever; a small logit_bias on `"` and `}`
    (the grammar still decides where they may go) lets any JSON object end within max_tokens."""
    from freetoken.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(model_dir)
    return {str(tok.encode(c)[0]): 5 for c in ('"', "}")}


def test_chat_json_object(client, tiny_model_dir):  # noqa: F811
    bias = _closing_bias(tiny_model_dir("qwen3_moe", seed=0, name="tiny-qwen3", max_position_embeddings=1024))
    for seed in (1, 2):
        r = client.chat.completions.create(model="tiny-qwen3", messages=MSGS, max_tokens=300, temperature=1.0,
                                           seed=seed, logit_bias=bias, response_format={"type": "json_object"})
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_completions_constraint_fields(client):
    for extra in ({"response_format": RF}, {"guided_json": SCHEMA}, {"structured_outputs": {"json": SCHEMA}}):
        r = client.completions.create(model="tiny-qwen3", prompt="Trip:", max_tokens=300, temperature=0.8,
                                      seed=3, extra_body=extra)
        _valid(r.choices[0].text)
    r = client.completions.create(model="tiny-qwen3", prompt="Answer:", max_tokens=10, temperature=1.0,
                                  extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert r.choices[0].text in ("alpha", "beta")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny-qwen3", prompt="Trip:", max_tokens=300, temperature=0, stream=True,
        extra_body={"guided_json": SCHEMA}) if c.choices)
    _valid(streamed)


def test_responses_text_format(client):
    # Effort "none": with thinking on, the grammar would start after the think block, which
    # random weights may never close.
    r = client.responses.create(model="tiny-qwen3", input="Plan a trip.", max_output_tokens=300,
                                temperature=0, reasoning={"effort": "none"}, text={"format": {"type": "json_schema", "name": "trip",
                                                                "schema": SCHEMA, "strict": True}})
    assert r.status == "completed"
    _valid(r.output_text)
    assert r.text.format.type == "json_schema"
    events = list(client.responses.create(model="tiny-qwen3", input="Plan a trip.", max_output_tokens=300,
                                          temperature=1.0, stream=True, reasoning={"effort": "none"}, text={"format": {
                                              "type": "json_schema", "name": "trip", "schema": SCHEMA}}))
    done = [e for e in events if e.type == "response.completed"][0]
    _valid(done.response.output_text)


TOOLS = [{"type": "function", "function": {
    "name": "book", "strict": True,
    "parameters": {"type": "object", "additionalProperties": False, "required": ["nights", "room"],
                   "properties": {"nights": {"type": "integer", "minimum": 1, "maximum": 9},
                                  "room": {"enum": ["single", "double"]}}}}},
    {"type": "function", "function": {"name": "cancel", "strict": True,
                                      "parameters": {"type": "object", "additionalProperties": False,
                                                     "required": ["id"],
                                                     "properties": {"id": {"type": "integer"}}}}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "book"}}])
@pytest.mark.parametrize("stream", [False, True])
def test_strict_tool_arguments_follow_the_schema(client, choice, stream):
    kw = dict(model="tiny-qwen3", messages=[{"role": "user", "content": "Book a room"}], tools=TOOLS,
              tool_choice=choice, max_tokens=200, temperature=1.0, seed=11)
    if stream:
        calls: dict = {}
        finish = None
        for c in client.chat.completions.create(stream=True, **kw):
            if not c.choices:
                continue
            finish = c.choices[0].finish_reason or finish
            for tc in c.choices[0].delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": None, "arguments": ""})
                entry["name"] = tc.function.name or entry["name"]
                entry["arguments"] += tc.function.arguments or ""
        got = list(calls.values())
    else:
        r = client.chat.completions.create(**kw)
        finish = r.choices[0].finish_reason
        got = [{"name": t.function.name, "arguments": t.function.arguments} for t in r.choices[0].message.tool_calls]
    assert finish == "tool_calls" and len(got) == 1
    tool = {t["function"]["name"]: t["function"] for t in TOOLS}[got[0]["name"]]
    if isinstance(choice, dict):
        assert got[0]["name"] == "book"
    _valid(got[0]["arguments"], tool["parameters"])


def test_uncompilable_schema_is_a_400(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "strnig"}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-qwen3", messages=MSGS, response_format=bad)
    assert "strnig" in e.value.message and e.value.body["param"].startswith("response_format")
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model="tiny-qwen3", messages=MSGS, response_format={"type": "xml"})
    with pytest.raises(openai.BadRequestError, match="regex"):
        client.completions.create(model="tiny-qwen3", prompt="x", extra_body={"guided_regex": "(("})


def test_n_samples_chat_and_completions(client):
    r = client.chat.completions.create(model="tiny-qwen3", messages=MSGS, max_tokens=8, temperature=1.0,
                                       seed=5, n=3, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1
    assert r.usage.completion_tokens == 24
    seen: dict = {}
    for c in client.chat.completions.create(model="tiny-qwen3", messages=MSGS, max_tokens=8, temperature=1.0,
                                            seed=5, n=3, stream=True, extra_body={"ignore_eos": True}):
        for ch in c.choices:
            seen[ch.index] = seen.get(ch.index, "") + (ch.delta.content or "")
    assert [seen[i] for i in range(3)] == texts
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model="tiny-qwen3", prompt="x", n=1, best_of=3)


def test_batched_prompts(client):
    prompts = ["Once upon a time", "The sea"]
    singles = [client.completions.create(model="tiny-qwen3", prompt=p, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    r = client.completions.create(model="tiny-qwen3", prompt=prompts, max_tokens=6, temperature=0, n=2,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [singles[0], singles[0], singles[1], singles[1]]
    ids = client.completions.create(model="tiny-qwen3", prompt=[[11, 12, 13], [14, 15]], max_tokens=2,
                                    temperature=0)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5
    streamed: dict = {}
    for c in client.completions.create(model="tiny-qwen3", prompt=prompts, max_tokens=6, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True}):
        for ch in c.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + ch.text
    assert [streamed[0], streamed[1]] == singles


def test_echo_prompt_logprobs_for_loglikelihood(client, server):
    # What lm-eval's loglikelihood sends: echo, logprobs 1, max_tokens 1, temperature 0.
    prompt = "The lighthouse keeper"
    r = client.completions.create(model="tiny-qwen3", prompt=prompt, echo=True, logprobs=1, max_tokens=1,
                                  temperature=0)
    c = r.choices[0]
    assert c.text.startswith(prompt)
    n_prompt = r.usage.prompt_tokens
    lp = c.logprobs
    assert len(lp.tokens) == n_prompt + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens[:n_prompt]) == prompt
    assert lp.text_offset[:3] == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
    # vLLM's prompt_logprobs agree with echo's numbers.
    status, body = server.request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 1,
                                                               "temperature": 0, "prompt_logprobs": 2})
    entries = body["choices"][0]["prompt_logprobs"]
    assert status == 200 and entries[0] is None and len(entries) == n_prompt
    mine = [v for v in entries[1].values() if v["decoded_token"] == lp.tokens[1]]
    assert mine and abs(mine[0]["logprob"] - lp.token_logprobs[1]) < 1e-4
    assert all(len(e) >= 2 for e in entries[1:])      # the token itself and its top 2
    status, body = server.request("POST", "/v1/chat/completions", {"messages": MSGS, "max_tokens": 1,
                                                                    "prompt_logprobs": 0})
    assert status == 200 and body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) > 3


def test_penalties_and_logit_bias(client):
    base = dict(model="tiny-qwen3", prompt="a a a a", max_tokens=30, temperature=0,
                extra_body={"ignore_eos": True})
    lp = client.completions.create(logit_bias={"77": 100}, logprobs=0, **base)
    assert len(lp.choices[0].logprobs.tokens) == 30 and len(set(lp.choices[0].logprobs.tokens)) == 1

    def distinct(**kw):
        body = {**base, **kw, "extra_body": {**base["extra_body"], **kw.pop("extra_body", {})}}
        return len(set(client.completions.create(logprobs=0, **{k: v for k, v in body.items()})
                       .choices[0].logprobs.tokens))
    plain = distinct()
    assert distinct(frequency_penalty=2.0) > plain
    assert distinct(presence_penalty=2.0) > plain
    assert distinct(extra_body={"repetition_penalty": 5.0}) > plain
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        client.completions.create(model="tiny-qwen3", prompt="x", frequency_penalty=3)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model="tiny-qwen3", prompt="x", logit_bias={"77": 500})
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model="tiny-qwen3", prompt="x", logit_bias={"9999999": 5})


def test_server_without_llguidance_serves_and_refuses_constraints(tiny_model_dir, tmp_path):  # noqa: F811
    # An install that lacks the grammar engine (a machine whose image has no llguidance wheel)
    # still starts and serves; a request for a constraint gets a 400 that names the package.
    blocker = tmp_path / "blocked" / "llguidance"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('llguidance is blocked for this test')\n")
    model_dir = tiny_model_dir("qwen3_moe", seed=0, name="tiny-qwen3", max_position_embeddings=1024)
    path = os.pathsep.join([str(blocker.parent), os.environ.get("PYTHONPATH", "")])
    with ServerProcess(model_dir, env={"PYTHONPATH": path}) as s:
        assert "need the llguidance package" in s.logs() and "serving without them" in s.logs()
        c = openai.OpenAI(base_url=s.base + "/v1", api_key="none", max_retries=0)
        plain = c.chat.completions.create(model="tiny-qwen3", messages=MSGS, max_tokens=4)
        assert plain.choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny-qwen3", messages=MSGS, max_tokens=4,
                                      response_format=RF)
        assert "pip install 'llguidance" in e.value.message
        assert e.value.body["param"].startswith("response_format")
        with pytest.raises(openai.BadRequestError, match="llguidance"):
            c.completions.create(model="tiny-qwen3", prompt="x", max_tokens=4,
                                 extra_body={"guided_regex": "[a-z]+"})
        assert s.health()[0] == 200
