"""Every family's tool-call markup (freetoken/server/toolcalls/), parsed as it streams, on
outputs written in each family's published format; the parser choice (`auto` from model type
and template markers); the reasoning formats through OutputParser. No server.

Each case is checked whole and over random splits (detokenization hands out arbitrary
pieces): the same content, the same calls, and arguments that always parse as JSON.
"""

from __future__ import annotations

import json
import random

import pytest

from freetoken.server import model_meta
from freetoken.server.generation import OutputParser
from freetoken.server.toolcalls import TOOL_PARSERS, HarmonyParser, make_tool_parser

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "ratio": {"type": "number"}, "opts": {"type": "object"}, "tags": {"type": "array"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "q": {"type": "string"}}}}},
]
NESTED = {"a": [1, {"b": None, "c": "x}y"}], "d": {"e": True}}


def splits(text: str, rng: random.Random):
    out, i = [], 0
    while i < len(text):
        n = rng.choice([1, 1, 2, 3, 5, 8, 40])
        out.append(text[i:i + n])
        i += n
    return out


def run(name: str, pieces, tools=TOOLS):
    p = HarmonyParser(tools) if name == "gpt_oss" else make_tool_parser(name, tools)
    events = [e for piece in pieces for e in p.feed(piece)] + p.finish()
    content, reasoning, calls = "", "", {}
    for e in events:
        if e.kind == "content":
            content += e.text
        elif e.kind == "reasoning":
            reasoning += e.text
        elif e.kind == "tool_start":
            calls[e.index] = {"name": e.name, "args": "", "id": e.id, "ended": False}
        elif e.kind == "tool_args":
            assert not calls[e.index]["ended"]
            calls[e.index]["args"] += e.text
        elif e.kind == "tool_end":
            calls[e.index]["ended"] = True
    assert all(c["ended"] for c in calls.values())
    return content, reasoning, [(c["name"], json.loads(c["args"])) for c in calls.values()], \
        [c["id"] for c in calls.values()]


def check(name, text, content, calls, reasoning="", ids=None):
    got = run(name, [text])
    assert got[:3] == (content, reasoning, calls)
    if ids is not None:
        assert got[3] == ids
    rng = random.Random(7)
    for _ in range(150):
        assert run(name, splits(text, rng))[:3] == (content, reasoning, calls)


W = ("get_weather", {"city": "Zürich", "days": 3})
S = ("search", {"q": 'a "quoted" <b> </x> [y] {z} | :'})

# name -> (two calls with text before them, the same cut off by max_tokens, malformed, undeclared)
CASES = {
    "hermes": (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": {"q": "a \\"quoted\\" <b> </x> [y] {z} | :"}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zür',
        "<tool_call>not json</tool_call>",
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'),
    "qwen3_coder": (
        "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=search>\n"
        '<parameter=q>\na "quoted" <b> </x> [y] {z} | :\n</parameter>\n</function>\n</tool_call>',
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nZür",
        "<tool_call>\n<function get_weather>\n</tool_call>",
        "<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>"),
    "glm45": (
        "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Zürich</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>search\n<arg_key>q</arg_key>\n"
        '<arg_value>a "quoted" <b> </x> [y] {z} | :</arg_value>\n</tool_call>',
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Zür",
        "<tool_call>get weather now\n<arg_key>x</tool_call>",
        "<tool_call>rm_rf\n</tool_call>"),
    "glm47": (
        "Let me check.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Zürich</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call><tool_call>search<arg_key>q</arg_key>"
        '<arg_value>a "quoted" <b> </x> [y] {z} | :</arg_value></tool_call>',
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Zür",
        '<tool_call>{"name": "get_weather"}</tool_call>',
        "<tool_call>rm_rf</tool_call>"),
    "minimax_m2": (
        'Let me check.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Zürich</parameter>\n'
        '<parameter name="days">3</parameter>\n</invoke>\n<invoke name="search">\n'
        '<parameter name="q">a "quoted" <b> </x> [y] {z} | :</parameter>\n</invoke>\n</minimax:tool_call>',
        '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Zür',
        "<minimax:tool_call>\nget_weather(city)\n</minimax:tool_call>",
        '<minimax:tool_call>\n<invoke name="rm_rf">\n</invoke>\n</minimax:tool_call>'),
    "deepseek_v32": (
        'Let me check.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Zürich</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="search">\n<｜DSML｜parameter name="q" string="true">a "quoted" <b> </x> [y] {z} | :'
        "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>",
        '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Zür',
        "<｜DSML｜function_calls>\nnonsense\n</｜DSML｜function_calls>",
        '<｜DSML｜function_calls>\n<｜DSML｜invoke name="rm_rf">\n</｜DSML｜invoke>\n</｜DSML｜function_calls>'),
    "deepseek_v3": (
        "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Zürich", "days": 3}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n'
        '```json\n{"q": "a \\"quoted\\" <b> </x> [y] {z} | :"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Zür',
        "<｜tool▁calls▁begin｜>garbage<｜tool▁calls▁end｜>",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>rm_rf\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    "deepseek_v31": (
        'Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Zürich", "days": 3}'
        '<｜tool▁call▁end｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{"q": "a \\"quoted\\" <b> </x> [y] {z} | :"}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Zür',
        "<｜tool▁calls▁begin｜>garbage<｜tool▁calls▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>rm_rf<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    "kimi_k2": (
        'Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
        '{"city": "Zürich", "days": 3}<|tool_call_end|><|tool_call_begin|>functions.search:1<|tool_call_argument_begin|>'
        '{"q": "a \\"quoted\\" <b> </x> [y] {z} | :"}<|tool_call_end|><|tool_calls_section_end|>',
        '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Zür',
        "<|tool_calls_section_begin|>garbage<|tool_calls_section_end|>",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.rm_rf:0<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_calls_section_end|>"),
    "mistral": (
        'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich", "days": 3}'
        '[TOOL_CALLS]search[ARGS]{"q": "a \\"quoted\\" <b> </x> [y] {z} | :"}',
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Zür',
        "[TOOL_CALLS]get weather please",
        '[TOOL_CALLS]rm_rf[ARGS]{}'),
    "llama4_pythonic": (
        '[get_weather(city="Zürich", days=3), search(q=\'a "quoted" <b> </x> [y] {z} | :\')]',
        '[get_weather(city="Zürich", days=3), search(q="a',
        "[see the docs] for more",
        "[rm_rf(path='/')]"),
    "gemma4": (
        'Let me check.<|tool_call>call:get_weather{city:<|"|>Zürich<|"|>,days:3}<tool_call|>'
        '<|tool_call>call:search{q:<|"|>a "quoted" <b> </x> [y] {z} | :<|"|>}<tool_call|>',
        '<|tool_call>call:get_weather{city:<|"|>Zürich<|"|>,days:3,metric:tr',
        "<|tool_call>get_weather(city=Paris)<tool_call|>",
        "<|tool_call>call:rm_rf{}<tool_call|>"),
    "gpt_oss": (
        "<|channel|>analysis<|message|>Two lookups.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
        '<|constrain|>json<|message|>{"city": "Zürich", "days": 3}<|call|><|start|>assistant to=functions.search'
        '<|channel|>commentary json<|message|>{"q": "a \\"quoted\\" <b> </x> [y] {z} | :"}',
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Zür',
        "Hello <| there",
        '<|channel|>commentary to=functions.rm_rf <|constrain|>json<|message|>{}'),
}


@pytest.mark.parametrize("name", list(CASES))
def test_several_calls_after_text(name):
    full = CASES[name][0]
    before = "" if name in ("llama4_pythonic", "gpt_oss") else "Let me check."
    reasoning = "Two lookups." if name == "gpt_oss" else ""
    ids = ["functions.get_weather:0", "functions.search:1"] if name == "kimi_k2" else None
    check(name, full, before, [W, S], reasoning, ids)


@pytest.mark.parametrize("name", list(CASES))
def test_call_cut_off_by_max_tokens_is_closed(name):
    got = run(name, [CASES[name][1]])
    assert got[2][0][0] == "get_weather"
    if name == "llama4_pythonic":      # complete calls go out; the unfinished one is text
        assert got[2] == [W] and got[0] == 'search(q="a'
        return
    assert got[0] == ""
    if name == "gemma4":
        assert got[2] == [("get_weather", {"city": "Zürich", "days": 3})]
    else:
        assert got[2] == [("get_weather", {"city": "Zür"})]


@pytest.mark.parametrize("name", list(CASES))
def test_malformed_and_undeclared_are_plain_content(name):
    for text in CASES[name][2:]:
        got = run(name, [text])
        assert got[2] == [], (text, got)
        assert got[0] == text or name == "gpt_oss", got      # Harmony content drops the markup
        rng = random.Random(3)
        for _ in range(50):
            assert run(name, splits(text, rng))[:3] == got[:3]


def test_every_registered_parser_is_covered():
    assert set(CASES) == set(TOOL_PARSERS)


def test_arguments_stream_before_the_call_ends():
    for name, text in [("deepseek_v31", CASES["deepseek_v31"][0]), ("kimi_k2", CASES["kimi_k2"][0]),
                       ("gpt_oss", CASES["gpt_oss"][0]), ("qwen3_coder", CASES["qwen3_coder"][0])]:
        p = HarmonyParser(TOOLS) if name == "gpt_oss" else make_tool_parser(name, TOOLS)
        fragments = [e for i in range(len(text)) for e in p.feed(text[i]) if e.kind == "tool_args"]
        assert len(fragments) >= 3, name      # JSON: character runs; key-value: one per parameter


def test_values_typed_by_schema_and_nested_json():
    nested = json.dumps(NESTED)
    cases = {
        "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=metric>\n"
                       f"true\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n<parameter=opts>\n{nested}\n</parameter>\n"
                       "<parameter=tags>\n[1, \"x\"]\n</parameter>\n</function>\n</tool_call>",
        "glm45": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>42</arg_value>\n<arg_key>metric</arg_key>\n"
                 f"<arg_value>true</arg_value>\n<arg_key>ratio</arg_key>\n<arg_value>0.5</arg_value>\n<arg_key>opts</arg_key>\n"
                 f"<arg_value>{nested}</arg_value>\n<arg_key>tags</arg_key>\n<arg_value>[1, \"x\"]</arg_value>\n</tool_call>",
        "minimax_m2": '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">42</parameter>\n'
                      '<parameter name="metric">true</parameter>\n<parameter name="ratio">0.5</parameter>\n'
                      f'<parameter name="opts">{nested}</parameter>\n<parameter name="tags">[1, "x"]</parameter>\n'
                      "</invoke>\n</minimax:tool_call>",
        "deepseek_v32": '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
                        '<｜DSML｜parameter name="city" string="true">42</｜DSML｜parameter>\n'
                        '<｜DSML｜parameter name="metric" string="false">true</｜DSML｜parameter>\n'
                        '<｜DSML｜parameter name="ratio" string="false">0.5</｜DSML｜parameter>\n'
                        f'<｜DSML｜parameter name="opts" string="false">{nested}</｜DSML｜parameter>\n'
                        '<｜DSML｜parameter name="tags" string="false">[1, "x"]</｜DSML｜parameter>\n'
                        "</｜DSML｜invoke>\n</｜DSML｜function_calls>",
        "gemma4": '<|tool_call>call:get_weather{city:<|"|>42<|"|>,metric:true,ratio:0.5,'
                  'opts:{a:[1,{b:null,c:<|"|>x}y<|"|>}],d:{e:true}},tags:[1,<|"|>x<|"|>]}<tool_call|>',
        "llama4_pythonic": f"[get_weather(city='42', metric=True, ratio=0.5, opts={NESTED!r}, tags=[1, 'x'])]",
    }
    want = [("get_weather", {"city": "42", "metric": True, "ratio": 0.5, "opts": NESTED, "tags": [1, "x"]})]
    for name, text in cases.items():
        check(name, text, "", want)


def test_harmony_call_ends_with_the_stop_token():
    # <|call|> stops generation and is not emitted: the stream just ends after the JSON.
    text = '<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant<|channel|>commentary to=functions.search <|constrain|>json<|message|>{"q": "x"}'
    check("gpt_oss", text, "", [("search", {"q": "x"})], "Look it up.")
    # A final answer ends with <|return|>, also a stop token.
    check("gpt_oss", "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Hi!",
          "Hi!", [], "Easy.")
    # Without tools, a message to a function is the answer's text, never a call.
    p = HarmonyParser(None)
    events = p.feed('<|channel|>commentary to=functions.search <|constrain|>json<|message|>{"q": 1}') + p.finish()
    assert [e.kind for e in events] == ["content"] and events[0].text == '{"q": 1}'
    # A prompt that opened the final channel: the output starts in the answer.
    p = HarmonyParser(TOOLS, prompt="<|start|>assistant<|channel|>final<|message|>")
    assert [(e.kind, e.text) for e in p.feed("Done.") + p.finish()] == [("content", "Done.")]


def test_mistral_old_json_list_form():
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Zürich", "days": 3}}, {"name": "search", "arguments": {"q": "a \\"quoted\\" <b> </x> [y] {z} | :"}}]'
    check("mistral", text, "", [W, S])
    check("mistral", '[TOOL_CALLS]search[CALL_ID]a1b2c3d4e[ARGS]{"q": "x"}', "", [("search", {"q": "x"})])


def test_text_after_calls_and_layout():
    check("qwen3_coder", "<tool_call>\n<function=search>\n<parameter=q>\nx\n</parameter>\n</function>\n</tool_call>\n\nDone.",
          "Done.", [("search", {"q": "x"})])
    # Whitespace around a call is layout, as for Hermes.
    check("mistral", 'Sure, [TOOLS] then [TOOL_CALLS]search[ARGS]{"q": "x"} trailing', "Sure, [TOOLS] thentrailing",
          [("search", {"q": "x"})])


# -- the parser choice --------------------------------------------------------------------------
def _tpl(*markers):
    return "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}" + " ".join(markers) + "{% endif %}"


AUTO = [
    ("qwen3_moe", _tpl("<tool_call>", "<think>", "</think>", "enable_thinking"), "qwen3", "hermes"),
    ("qwen3_moe", _tpl("<tool_call>", "<function=", "<parameter=", "</think>"), "qwen3", "qwen3_coder"),
    ("glm4_moe", _tpl("<tool_call>", "'\\n<arg_key>'", "</think>"), "glm45", "glm45"),
    ("glm4_moe", _tpl("<tool_call>", "'<arg_key>'", "</think>"), "glm45", "glm47"),
    ("gpt_oss", _tpl("<|channel|>", "to=functions.", "<|constrain|>", "reasoning_effort"), "gpt_oss", "gpt_oss"),
    ("deepseek_v3", _tpl("<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>", "```json", "</think>"), "deepseek_r1", "deepseek_v3"),
    ("deepseek_v3", _tpl("<｜tool▁sep｜>", "{% if thinking %}<think>{% else %}</think>{% endif %}"), "deepseek_v3", "deepseek_v31"),
    ("deepseek_v32", _tpl("<｜DSML｜function_calls>", "</think>", "thinking"), "deepseek_v3", "deepseek_v32"),
    ("kimi_k2", _tpl("<|tool_calls_section_begin|>", "</think>"), "kimi_k2", "kimi_k2"),
    ("minimax_m2", _tpl("<minimax:tool_call>", "<think>", "</think>"), "minimax_m2", "minimax_m2"),
    ("mistral", _tpl("[TOOL_CALLS]", "[THINK]", "[/THINK]"), "mistral", "mistral"),
    ("mixtral", _tpl("[TOOL_CALLS]"), None, "mistral"),
    ("llama4", _tpl("[func_name1(params_name1=params_value1)]"), None, "llama4_pythonic"),
    ("gemma4", _tpl("<|tool_call>", "<|channel>thought", "<channel|>", "enable_thinking"), "gemma4", "gemma4"),
    # The template decides: a GLM-style template on a Qwen architecture is read as GLM.
    ("qwen3_moe", _tpl("<tool_call>", "<arg_key>", "</think>"), "glm45", "glm47"),
]


@pytest.mark.parametrize("model_type,template,reasoner,tools", AUTO)
def test_auto_picks_from_model_type_and_template(model_type, template, reasoner, tools):
    meta = model_meta.resolve(model_type, template)
    assert (meta.reasoning_parser, meta.tool_format) == (reasoner, tools)
    assert meta.describe()["tool_call_parser"] == tools and meta.chosen_by == "auto"


def test_named_parsers_and_unknown_names():
    meta = model_meta.resolve("qwen3_moe", _tpl("<tool_call>", "</think>"), "glm", set(), "openai")
    assert (meta.reasoning_parser, meta.tool_format, meta.chosen_by) == ("glm45", "gpt_oss", "flags")
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'; choose from auto, hermes, qwen3_coder"):
        model_meta.resolve("qwen3_moe", "", "auto", (), "nope")
    from freetoken.server.config import ServerConfig
    with pytest.raises(ValueError, match="tool_call_parser must be one of .*kimi_k2"):
        ServerConfig(tool_call_parser="kimi")
    # Markers that are special tokens: decode keeping them, or the parser never sees them.
    harmony = model_meta.resolve("gpt_oss", _tpl("<|channel|>", "to=functions."), "auto", {"<|channel|>", "<|call|>"})
    assert harmony.markers_are_special
    assert not model_meta.resolve("qwen3_moe", _tpl("<tool_call>", "</think>"), "auto", {"<|im_end|>"}).markers_are_special


# -- reasoning formats, through the OutputParser -----------------------------------------------
REASONING = [
    ("mistral", "[THINK]Plan it.[/THINK]Answer.", False, "Plan it.", "Answer."),
    ("gemma4", "<|channel>thought\nPlan it.<channel|>Answer.", False, "Plan it.", "Answer."),
    ("minimax_m2", "Plan it.\n</think>\n\nAnswer.", True, "Plan it.", "Answer."),     # the template opened <think>
    ("deepseek_v3", "<think>Plan it.</think>Answer.", False, "Plan it.", "Answer."),
    ("kimi_k2", "<think>Plan it.</think>Answer.", False, "Plan it.", "Answer."),
    ("glm45", "\nPlan it.</think>Answer.", True, "Plan it.", "Answer."),
    ("gpt_oss", "<|channel|>analysis<|message|>Plan it.<|end|><|start|>assistant<|channel|>final<|message|>Answer.",
     False, "Plan it.", "Answer."),
]


@pytest.mark.parametrize("name,text,opened,reasoning,answer", REASONING)
def test_reasoning_formats(name, text, opened, reasoning, answer):
    meta = model_meta.resolve("x", "", name)
    rng = random.Random(5)
    for pieces in [[text]] + [splits(text, rng) for _ in range(50)]:
        p = OutputParser(meta, in_reasoning=opened)
        events = [e for piece in pieces for e in p.feed(piece)] + p.finish()
        got = {"reasoning": "", "content": ""}
        for e in events:
            got[e.kind] += e.text
        assert (got["reasoning"], got["content"]) == (reasoning, answer)


def test_reasoning_then_calls_in_each_format():
    for name, think, tool_fmt, call in [
        ("minimax_m2", "<think>\nhm\n</think>\n\n", "minimax_m2", CASES["minimax_m2"][0]),
        ("deepseek_v3", "<think>hm</think>", "deepseek_v31", CASES["deepseek_v31"][0]),
        ("kimi_k2", "<think>hm</think>", "kimi_k2", CASES["kimi_k2"][0]),
        ("glm45", "<think>hm</think>", "glm45", CASES["glm45"][0]),
        ("qwen3", "<think>\nhm\n</think>\n\n", "qwen3_coder", CASES["qwen3_coder"][0]),
        ("mistral", "[THINK]hm[/THINK]", "mistral", CASES["mistral"][0]),
        ("gemma4", "<|channel>thought\nhm<channel|>", "gemma4", CASES["gemma4"][0]),
    ]:
        meta = model_meta.resolve("x", "", name, (), tool_fmt)
        p = OutputParser(meta, tool_names=TOOLS)
        text = think + call
        events = [e for piece in splits(text, random.Random(1)) for e in p.feed(piece)] + p.finish()
        kinds = {}
        for e in events:
            kinds[e.kind] = kinds.get(e.kind, "") + e.text
        assert kinds["reasoning"] == "hm" and kinds["content"] == "Let me check.", name
        assert sum(e.kind == "tool_start" for e in events) == 2, name
