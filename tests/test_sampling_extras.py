"""Structured outputs, penalties, logit_bias and prompt logprobs through the real engine (LLM,
the same EngineCore `ft serve` runs) on the random-weight demo checkpoint."""

import json

import jsonschema
import pytest
import torch

from freetoken import LLM, SamplingParams
from freetoken.engine.sampler import SampleRow, apply_penalties
from freetoken.engine.sampling_params import StructuredOutputs
from freetoken.scheduler.core import RequestError
from tiny_fixtures import tiny_model_dir  # noqa: F401 - a fixture

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "maxItems": 2,
                                  "items": {"enum": ["red", "green", "blue"]}}}}


@pytest.fixture(scope="module")
def llm(tiny_model_dir):  # noqa: F811
    return LLM(str(tiny_model_dir("qwen3_moe", seed=0, max_position_embeddings=512)))


def test_json_schema_output_validates_in_a_mixed_batch(llm):
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = llm.generate(["Tell me"], free)[0]
    constrained = [SamplingParams(max_tokens=200, temperature=t, seed=s,
                                  structured_outputs=StructuredOutputs(json=SCHEMA))
                   for t, s in ((0.0, None), (1.0, 1), (1.0, 2), (1.5, 3))]
    outs = llm.generate(["Tell me"] + ["Describe a person"] * 4, [free] + constrained)
    # The free row is untouched by its neighbours' masks.
    assert outs[0].token_ids == alone.token_ids
    for o in outs[1:]:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)


def test_grammar_survives_preemption(tiny_model_dir):  # noqa: F811
    # 8 blocks of 16 tokens cannot hold 4 requests growing to ~60 tokens: some are preempted
    # and recomputed, and their grammar state must still match their output.
    small = LLM(str(tiny_model_dir("qwen3_moe", seed=0, max_position_embeddings=512)),
                max_model_len=128, kv_cache_tokens=128)
    p = [SamplingParams(max_tokens=100, temperature=1.0, seed=i,
                        structured_outputs=StructuredOutputs(json=SCHEMA)) for i in range(4)]
    outs = small.generate(["Describe a person"] * 4, p)
    assert small.engine.scheduler.num_preemptions > 0
    for o in outs:
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), SCHEMA)
    assert any(o.finish_reason == "stop" for o in outs)


def test_choice_regex_and_json_object(llm):
    out = llm.generate(["Pick"], SamplingParams(max_tokens=20, temperature=1.0, seed=5,
                       structured_outputs=StructuredOutputs(choice=["yes", "no", "maybe"])))[0]
    assert out.text in ("yes", "no", "maybe") and out.finish_reason == "stop"
    out = llm.generate(["Digits"], SamplingParams(max_tokens=20, temperature=1.0, seed=5,
                       structured_outputs=StructuredOutputs(regex=r"[0-9]{3}-[a-c]{2}")))[0]
    assert len(out.text) == 6 and out.text[3] == "-" and out.text[:3].isdigit(), out.text


def test_uncompilable_schema_is_a_request_error(llm):
    with pytest.raises(RequestError) as e:
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputs(
            json={"type": "object", "properties": {"a": {"type": "intger"}}}, param="response_format")))
    assert e.value.param == "response_format" and "intger" in str(e.value)
    assert not llm.engine.has_work


def test_logit_bias(llm):
    greedy = llm.generate(["The"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    forced = llm.generate(["The"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                 logit_bias={77: 100}))[0]
    assert forced.token_ids == [77] * 6
    banned = llm.generate(["The"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                 logit_bias={greedy.token_ids[0]: -100}))[0]
    assert banned.token_ids[0] != greedy.token_ids[0]
    with pytest.raises(RequestError, match="logit_bias"):
        llm.generate(["The"], SamplingParams(logit_bias={10**7: 1}))
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101})


def test_penalties_reduce_repetition(llm):
    def repeats(**kw):
        ids = llm.generate(["a a a a"], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                       **kw))[0].token_ids
        return len(ids) - len(set(ids))
    base = repeats()
    assert base > 0
    assert repeats(frequency_penalty=2.0) < base
    assert repeats(presence_penalty=2.0) < base
    assert repeats(repetition_penalty=5.0) < base
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=2.5)
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0)


def test_penalty_formulas():
    x = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    row = SampleRow(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0),
                    None, prompt_ids=[1], output_ids=[0, 0, 2])
    got = apply_penalties(x, [row])
    # token 0: 2/2 - 0.25*2 - 0.5; token 1 (prompt only): -2*2; token 2: 1/2 - 0.25 - 0.5; token 3 unseen
    assert torch.allclose(got, torch.tensor([[0.0, -4.0, -0.25, 0.5]]))


def test_prompt_logprobs_match_the_forward(llm):
    ids = llm.tokenizer.encode("Once upon a time there was a lighthouse")
    out = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))[0]
    lps = out.prompt_logprobs
    assert len(lps) == len(ids) and lps[0] is None
    ref = llm.logits(ids).log_softmax(dim=-1)
    for p in range(1, len(ids)):
        lp, top, rank = lps[p]
        assert rank == 1 + int((ref[p - 1] > ref[p - 1, ids[p]]).sum())
        assert abs(lp - float(ref[p - 1, ids[p]])) < 1e-4
        assert len(top) == 3 and top[0][0] == int(ref[p - 1].argmax())
    # Chunked prefill scores the same.
    chunked = LLM(str(llm.runner.model_dir), max_prefill_length=4)
    again = chunked.generate([ids], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))[0]
    assert [x if x is None else round(x[0], 4) for x in again.prompt_logprobs] == \
        [x if x is None else round(x[0], 4) for x in lps]


def _run(llm, prompt_ids, params, forced):
    req = llm.engine.add_request(prompt_ids, params, forced_token_ids=forced)
    while llm.engine.has_work:
        llm.engine.step()
    return llm.tokenizer.decode(req.output_token_ids, skip_special_tokens=False), req


def test_grammar_after_a_marker_and_after_a_think_block(llm):
    from freetoken.server.structured import tool_call_grammar
    tok = llm.tokenizer
    tools = [{"type": "function", "function": {"name": "get", "strict": True, "parameters": {
        "type": "object", "required": ["n"], "additionalProperties": False,
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}}}]
    # Free text, then the model opens a call: from there the grammar writes a valid call.
    spec = tool_call_grammar(tools, "auto", tok, forced=False)
    forced = tok.encode("Sure <tool_call>")
    text, req = _run(llm, tok.encode("Call it"), SamplingParams(max_tokens=60, temperature=1.0, seed=1,
                                                                structured_outputs=spec), forced)
    call = text.split("<tool_call>", 1)[1].split("</tool_call>")[0]
    body = json.loads(call)
    assert body["name"] == "get" and 0 <= body["arguments"]["n"] <= 9
    assert req.grammar is None          # dropped when the request finished
    # The first token opens a think block: the constraint starts after it closes.
    spec = StructuredOutputs(json=SCHEMA, think_block=("<think>", "</think>"))
    forced = tok.encode("<think>hmm</think>")
    text, _ = _run(llm, tok.encode("Describe"), SamplingParams(max_tokens=200, temperature=0,
                                                               structured_outputs=spec), forced)
    assert text.startswith("<think>hmm</think>")
    jsonschema.validate(json.loads(text.removeprefix("<think>hmm</think>")), SCHEMA)
