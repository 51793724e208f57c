"""The streaming parsers (reasoning, Hermes tool calls, JSON arguments), the model-family
table's resolution and effort semantics, and the Generation's keep-alive pings: no server.

Every streaming parser must give the same result however its input is split, since
detokenization hands out text in arbitrary pieces.
"""

from __future__ import annotations

import asyncio
import json
import random
import types

import pytest

from freetoken.demo.tiny_tokenizer import chat_template
from freetoken.server import model_meta
from freetoken.server.debug_script import follow_prompt
from freetoken.server.generation import Generation, OutputParser
from freetoken.server.json_prefix import JsonPrefix
from freetoken.server.reasoning import ReasoningParser
from freetoken.server.tools import HermesToolParser, match_header


def splits(text: str, rng: random.Random):
    """Random piece boundaries, from one character at a time to the whole text."""
    out, i = [], 0
    while i < len(text):
        n = rng.choice([1, 1, 2, 3, 5, 8, 40])
        out.append(text[i:i + n])
        i += n
    return out


def run_reasoning(pieces, in_reasoning=False):
    p = ReasoningParser("<think>", "</think>", in_reasoning)
    got = {"reasoning": "", "content": ""}
    for piece in pieces:
        for kind, text in p.feed(piece):
            got[kind] += text
    for kind, text in p.finish():
        got[kind] += text
    return got["reasoning"], got["content"]


REASONING_CASES = [
    ("<think>\nLet me think.\n</think>\n\nThe answer.", False, ("Let me think.", "The answer.")),
    ("Let me think.\n</think>\n\nThe answer.", True, ("Let me think.", "The answer.")),      # opened in the prompt
    ("\n\n</think>\n\nNo thoughts.", True, ("", "No thoughts.")),
    ("Just an answer.\n", False, ("", "Just an answer.\n")),
    ("</think>A stray end marker.", False, ("", "A stray end marker.")),
    ("<think>a<think>b</think>c", False, ("ab", "c")),
    ("<think>\nunfinished thoughts", False, ("unfinished thoughts", "")),
    ("a < b, <th and </thinker <think", False, ("", "a < b, <th and </thinker <think")),
    ("<think>x</think>y<think>z</think>w", False, ("xz", "yw")),
]


@pytest.mark.parametrize("text,in_reasoning,want", REASONING_CASES)
def test_reasoning_parser_any_split(text, in_reasoning, want):
    assert run_reasoning([text], in_reasoning) == want
    rng = random.Random(0)
    for _ in range(200):
        assert run_reasoning(splits(text, rng), in_reasoning) == want


def test_reasoning_parser_holds_back_only_what_may_be_a_marker():
    p = ReasoningParser("<think>", "</think>")
    assert p.feed("The answer <thi") == [("content", "The answer ")]
    assert p.feed("s is") == [("content", "<this is")]
    p = ReasoningParser("<think>", "</think>", in_reasoning=True)
    assert p.feed("step one\n</th") == [("reasoning", "step one")]   # "\n</th" might end it
    assert p.feed("ink>\n\nDone") == [("content", "Done")]
    assert not p.in_reasoning


def parse_tools(pieces, names=("get_weather", "search")):
    p = HermesToolParser(names)
    events = [e for piece in pieces for e in p.feed(piece)] + p.finish()
    content = "".join(e.text for e in events if e.kind == "content")
    calls = {}
    for e in events:
        if e.kind == "tool_start":
            calls[e.index] = [e.name, ""]
        elif e.kind == "tool_args":
            calls[e.index][1] += e.text
    assert sum(e.kind == "tool_end" for e in events) == len(calls)
    return content, [tuple(c) for c in calls.values()]


TWO_CALLS = ('Checking both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", '
             '"days": [1, 2], "metric": true}}\n</tool_call>\n<tool_call>\n{"name": "search", '
             '"arguments": {"q": "a \\"quoted\\" </tool"}}\n</tool_call>')
TOOL_CASES = [
    (TWO_CALLS, ("Checking both.", [("get_weather", '{"city": "Zürich", "days": [1, 2], "metric": true}'),
                                    ("search", '{"q": "a \\"quoted\\" </tool"}')])),
    ("No tools needed.\n", ("No tools needed.\n", [])),
    # Malformed or undeclared: plain content, tags and all.
    ("<tool_call>not json</tool_call> then text", ("<tool_call>not json</tool_call> then text", [])),
    ('<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
     ('<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', [])),
    ('<tool_call>\n{"name": "search", "argu', ('<tool_call>\n{"name": "search", "argu', [])),
    # Arguments the model botched or did not finish are closed into valid JSON.
    ('<tool_call>\n{"name": "search", "arguments": {"q": oops}}\n</tool_call>', ("", [("search", '{"q": null}')])),
    ('<tool_call>\n{"name": "search", "arguments": {"q": "cut sh', ("", [("search", '{"q": "cut sh"}')])),
    ('<tool_call>{"name":"search","parameters":{"n":12,"x":[1.5e3,', ("", [("search", '{"n":12,"x":[1.5e3]}')])),
]


@pytest.mark.parametrize("text,want", TOOL_CASES)
def test_tool_parser_any_split(text, want):
    assert parse_tools([text]) == want
    rng = random.Random(1)
    for _ in range(200):
        got = parse_tools(splits(text, rng))
        assert got == want
        for _, args in got[1]:
            json.loads(args)


def test_tool_arguments_stream_incrementally():
    p = HermesToolParser(["search"])
    events = []
    text = '<tool_call>\n{"name": "search", "arguments": {"query": "lighthouses of Brittany"}}\n</tool_call>'
    for i in range(0, len(text), 3):
        events += p.feed(text[i:i + 3])
    args = [e.text for e in events if e.kind == "tool_args"]
    assert len(args) > 5 and "".join(args) == '{"query": "lighthouses of Brittany"}'


def test_match_header():
    assert match_header('{"name": "f", "arguments": {') == ("ok", "f", 28)
    assert match_header(' \n{"na')[0] == "partial"
    assert match_header('{"name": "f\\"g", "arg')[0] == "partial"
    assert match_header('{"x": 1}')[0] == "fail"
    assert match_header('{"name": 5')[0] == "fail"


def test_json_prefix_closes_every_prefix():
    value = {"city": "Zürich", "n": -1.5e-3, "ok": [True, False, None], "s": "a\"b\\c\u00e9\n", "o": {}}
    text = json.dumps(value)
    for k in range(1, len(text) + 1):
        j = JsonPrefix()
        assert j.feed(text[:k]) == k
        j.finish()
        closed = text[:j.safe_len] + j.closers()
        json.loads(closed)
    assert json.loads(closed) == value and j.done
    j = JsonPrefix()
    assert j.feed('{"a": [1, 2} ') == 11 and j.failed       # "}" cannot close "["
    assert j.feed('more') == 0
    assert '{"a": [1, 2'[:j.safe_len] + j.closers() == '{"a": [1, 2]}'


def test_output_parser_keeps_tool_markup_inside_reasoning():
    meta = model_meta.resolve("qwen3_moe", chat_template())
    p = OutputParser(meta, in_reasoning=False, tool_names=["search"])
    text = ('<think>\nMaybe <tool_call> search?\n</think>\n\nSure.\n<tool_call>\n{"name": "search", '
            '"arguments": {"q": "x"}}\n</tool_call>')
    events = [e for piece in splits(text, random.Random(3)) for e in p.feed(piece)] + p.finish()
    kinds = {}
    for e in events:
        kinds[e.kind] = kinds.get(e.kind, "") + e.text
    assert kinds["reasoning"] == "Maybe <tool_call> search?"
    assert kinds["content"] == "Sure."
    assert kinds["tool_args"] == '{"q": "x"}'


# -- the family table ---------------------------------------------------------------------------

def test_resolve_demo_templates():
    qwen3 = model_meta.resolve("qwen3_moe", chat_template("qwen3"))
    assert (qwen3.family, qwen3.think_start, qwen3.toggle, qwen3.grades_effort, qwen3.tool_format) == \
        ("qwen3", "<think>", "enable_thinking", False, "hermes")
    thinking = model_meta.resolve("qwen3_moe", chat_template("thinking"))
    assert thinking.reasoning and thinking.toggle is None
    graded = model_meta.resolve("qwen3_moe", chat_template("graded"))
    assert graded.toggle == "enable_thinking" and graded.grades_effort
    assert graded.efforts == list(model_meta.EFFORTS) and qwen3.efforts == ["none", "low", "medium", "high"]
    # The template decides: a Qwen3-style template on another architecture reasons like Qwen3.
    assert model_meta.resolve("mixtral", chat_template()).family == "qwen3"
    plain = model_meta.resolve("mixtral", "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not plain.reasoning and plain.efforts == [] and plain.tool_format is None
    assert not model_meta.resolve("qwen3_moe", chat_template(), "off").reasoning
    r1 = model_meta.resolve("llama", "{{ messages }}", "deepseek_r1")
    assert r1.reasoning and r1.toggle is None
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        model_meta.resolve("qwen3_moe", "", "nope")
    m3 = model_meta.resolve("minimax_m3", "{{ thinking_mode }} </mm:think> {{ reasoning_effort }}")
    assert m3.template_kwargs("none", {}) == {"thinking_mode": "disabled"}
    assert m3.template_kwargs("high", {}) == {"thinking_mode": "enabled", "reasoning_effort": "high"}


def test_effort_semantics():
    qwen3 = model_meta.resolve("qwen3_moe", chat_template("qwen3"))
    assert qwen3.template_kwargs(None, {}) == {}
    assert qwen3.template_kwargs("none", {}) == {"enable_thinking": False}
    assert qwen3.template_kwargs("high", {}) == {"enable_thinking": True}       # not graded: no effort
    assert qwen3.template_kwargs("none", {"enable_thinking": True}) == {"enable_thinking": True}
    graded = model_meta.resolve("qwen3_moe", chat_template("graded"))
    assert graded.template_kwargs("low", {}) == {"enable_thinking": True, "reasoning_effort": "low"}
    assert graded.template_kwargs("low", {"reasoning_effort": "max"})["reasoning_effort"] == "max"
    plain = model_meta.resolve("mixtral", "{{ messages }}")
    assert plain.template_kwargs("none", {}) == {}
    # Where the template cannot turn thinking off, an empty think block starts the answer.
    thinking = model_meta.resolve("qwen3_moe", chat_template("thinking"))
    assert thinking.thinking_off_prefix("<|im_start|>assistant\n<think>\n") == "\n</think>\n\n"
    r1 = model_meta.resolve("x", "{{ messages }}", "deepseek_r1")
    assert r1.thinking_off_prefix("<|Assistant|>") == "<think>\n\n</think>\n\n"
    assert qwen3.thinking_off_prefix("assistant\n<think>\n\n</think>\n\n") == ""


def test_script_follows_the_prompt():
    meta = model_meta.resolve("qwen3_moe", chat_template("graded"))
    text = "<think>\nplan\n</think>\n\nanswer"
    assert follow_prompt(text, meta, "assistant\n", "") == text
    assert follow_prompt(text, meta, "assistant\n<think>\n", "") == "\nplan\n</think>\n\nanswer"
    assert follow_prompt(text, meta, "assistant\n<think>\n\n</think>\n\n", "") == "answer"
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    prefix = '\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {'
    assert follow_prompt("<think>\nx\n</think>\n\n" + call, meta, "<think>\n", prefix) == '"a": 1}}\n</tool_call>'


# -- keep-alive pings -------------------------------------------------------------------------

class FakeStream:
    """A RequestStream whose deltas arrive every delay_s seconds from a producer task."""

    def __init__(self, deltas, delay_s):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.num_prompt_tokens, self.finished, self.aborted = 3, False, False
        self.producer = asyncio.get_running_loop().create_task(self._produce(deltas, delay_s))

    async def _produce(self, deltas, delay_s):
        for d in deltas:
            await asyncio.sleep(delay_s)
            self.queue.put_nowait(d)

    async def __anext__(self):
        d = await self.queue.get()
        self.finished = d.finished
        return d

    def abort(self):
        self.aborted = True


def _delta(text, finished=False):
    return types.SimpleNamespace(text=text, finished=finished, finish_reason="stop" if finished else None,
                                 stop_reason=None, new_token_ids=[1], logprobs=None, num_output_tokens=1,
                                 prefill=None, num_cached_tokens=0, num_cache_created_tokens=0)


def test_generation_pings_while_the_model_is_silent():
    meta = model_meta.resolve("qwen3_moe", chat_template())

    async def run(delay_s):
        gen = Generation(FakeStream([_delta("<think>hm</think>Hi"), _delta("!", True)], delay_s),
                         OutputParser(meta))
        return [s if s is None else [(e.kind, e.text) for e in s.events] async for s in gen.steps(0.05)], gen

    steps, gen = asyncio.run(run(0.18))
    assert steps.count(None) >= 4, steps       # about 3 pings before each delta
    assert [s for s in steps if s is not None] == [[("reasoning", "hm"), ("content", "Hi")], [("content", "!")]]
    assert (gen.content, gen.reasoning, gen.finish_reason) == ("Hi!", "hm", "stop")
    steps, _ = asyncio.run(run(0.0))
    assert None not in steps
