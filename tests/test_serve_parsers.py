"""End to end: each family's tool-call and reasoning markup through a real `ft serve`, in all
three dialects (openai SDK: Chat Completions and Responses; anthropic SDK: Messages), and
its chat template rendered by /tokenize token for token as transformers renders it.

Each family gets a tiny checkpoint whose chat template is written in that family's style
(tests/family_templates/, our own jinja) and, for gpt-oss and DeepSeek, whose tokenizer has
the family's markers as special tokens, so the server must keep them when decoding; gpt-oss
stops on <|call|> (a stop token the parser never sees). The model's output is scripted
(FREETOKEN_DEBUG_SCRIPT) in the family's published format.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import anthropic
import openai
import pytest
from tokenizers import AddedToken, Tokenizer

from serving import ServerProcess

HERE = Path(__file__).parent
KEY = "sk-parsers"
W = {"city": "Zürich", "days": 3}
S = {"q": 'a <b> & "c" [d] {e}'}
THOUGHT = "Need two lookups."
HARMONY = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
DEEPSEEK = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
            "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>")


def _kv(name, args, fmt):
    return "".join(fmt.format(k=k, v=v if isinstance(v, str) else json.dumps(v)) for k, v in args.items())


FAMILIES = {
    # family: (special tokens, eos, bos, reasoning parser, tool parser, scripted output, calls)
    "qwen3_coder": ((), None, None, "qwen3", "qwen3_coder",
                    f"<think>\n{THOUGHT}\n</think>\n\nChecking.\n<tool_call>\n<function=get_weather>\n"
                    + _kv("", W, "<parameter={k}>\n{v}\n</parameter>\n") + "</function>\n</tool_call>\n"
                    "<tool_call>\n<function=search>\n" + _kv("", S, "<parameter={k}>\n{v}\n</parameter>\n")
                    + "</function>\n</tool_call>", [W, S]),
    "glm45": ((), None, None, "glm45", "glm45",
              f"<think>{THOUGHT}</think>\nChecking.\n<tool_call>get_weather\n"
              + _kv("", W, "<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n") + "</tool_call>\n<tool_call>search\n"
              + _kv("", S, "<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n") + "</tool_call>", [W, S]),
    "gpt_oss": (HARMONY, "<|return|>", None, "gpt_oss", "gpt_oss",
                f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>commentary<|message|>"
                "Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                f"<|message|>{json.dumps(W, ensure_ascii=False)}<|call|>", [W]),
    "deepseek_v31": (DEEPSEEK, "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>", "deepseek_v3", "deepseek_v31",
                     f"<think>{THOUGHT}</think>Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                     f"{json.dumps(W, ensure_ascii=False)}<｜tool▁call▁end｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>"
                     f"{json.dumps(S)}<｜tool▁call▁end｜><｜tool▁calls▁end｜>", [W, S]),
    "minimax_m2": ((), None, None, "minimax_m2", "minimax_m2",
                   f"<think>\n{THOUGHT}\n</think>\n\nChecking.\n<minimax:tool_call>\n<invoke name=\"get_weather\">\n"
                   + _kv("", W, '<parameter name="{k}">{v}</parameter>\n') + '</invoke>\n<invoke name="search">\n'
                   + _kv("", S, '<parameter name="{k}">{v}</parameter>\n') + "</invoke>\n</minimax:tool_call>", [W, S]),
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web.", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}},
]
NAMES = ("get_weather", "search")


def make_variant(base: Path, out: Path, family: str) -> Path:
    special, eos, bos = FAMILIES[family][:3]
    shutil.copytree(base, out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.save(str(out / "tokenizer.json"))
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    for t in special:
        cfg["added_tokens_decoder"][str(tok.token_to_id(t))] = {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    cfg["chat_template"] = (HERE / "family_templates" / f"{family}.jinja").read_text()
    if eos:
        cfg["eos_token"] = eos
        stops = [tok.token_to_id(t) for t in (eos, "<|call|>") if tok.token_to_id(t) is not None]
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    if bos:
        cfg["bos_token"] = bos
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False, indent=1))
    return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, tmp_path_factory):
    from freetoken.demo.tiny_model import make_tiny_model
    family = request.param
    root = tmp_path_factory.mktemp(f"parsers-{family}")
    base = make_tiny_model(root / "base", family="qwen3_moe", seed=0, max_position_embeddings=4096)
    model = make_variant(base, root / family, family)
    (root / "script.json").write_text(json.dumps({"CALL_TOOLS": FAMILIES[family][5], "CUT_SHORT": FAMILIES[family][5]},
                                                 ensure_ascii=False))
    with ServerProcess(model, env={"FREETOKEN_DEBUG_SCRIPT": str(root / "script.json")}, api_key=KEY) as s:
        s.family, s.model = family, model
        yield s


def ask(text="CALL_TOOLS please"):
    return [{"role": "user", "content": text}]


def test_parsers_reported(served):
    _, _, _, reasoner, tool_parser, _, _ = FAMILIES[served.family]
    status, models = served.request("GET", "/v1/models")
    assert status == 200
    m = models["data"][0]
    assert (m["reasoning_parser"], m["tool_call_parser"]) == (reasoner, tool_parser)
    status, inst = served.request("GET", "/v1/instrumentation")
    assert inst["chat"]["tool_call_parser"] == tool_parser and inst["chat"]["parsers_chosen_by"] == "auto"
    assert inst["chat"]["special_tokens_kept"] == bool(FAMILIES[served.family][0])
    assert f"tool calls {tool_parser}" in served.logs()


def test_chat_completions(served):
    want = FAMILIES[served.family][6]
    client = openai.OpenAI(base_url=served.base + "/v1", api_key=KEY, max_retries=0)
    kwargs = dict(model=served.model.name, messages=ask(), tools=TOOLS, max_tokens=400, reasoning_effort="high")
    r = client.chat.completions.create(**kwargs)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.reasoning_content == THOUGHT and msg.content == "Checking."
    assert [tc.function.name for tc in msg.tool_calls] == list(NAMES[:len(want)])
    assert [json.loads(tc.function.arguments) for tc in msg.tool_calls] == want
    # Streamed: the same calls, as id+name first, then argument fragments.
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        d = chunk.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
        finish = chunk.choices[0].finish_reason or finish
        for tc in d.tool_calls or []:
            if tc.id:
                calls[tc.index] = [tc.function.name, tc.function.arguments or ""]
            else:
                calls[tc.index][1] += tc.function.arguments
    assert (reasoning, content, finish) == (THOUGHT, "Checking.", "tool_calls")
    assert [(n, json.loads(a)) for n, a in calls.values()] == list(zip(NAMES, want))
    # The call goes back into the conversation (arguments as a JSON string) and renders.
    history = kwargs["messages"] + [msg.model_dump(exclude_none=True),
                                    {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "18 C"}]
    again = client.chat.completions.create(**{**kwargs, "messages": history, "max_tokens": 2})
    assert again.usage.prompt_tokens > r.usage.prompt_tokens


def test_call_cut_off_by_max_tokens(served):
    if served.family == "gpt_oss":
        pytest.skip("one call per Harmony turn; covered by the parser tests")
    client = openai.OpenAI(base_url=served.base + "/v1", api_key=KEY, max_retries=0)
    script = FAMILIES[served.family][5]
    head = script[:script.index("Zürich") + 3]     # inside the first call's first argument
    _, tok = served.request("POST", "/tokenize", {"prompt": head, "add_special_tokens": False})
    thinking_prompt = served.family in ("minimax_m2",)      # the prompt already opened <think>
    n = tok["count"] - (1 if thinking_prompt else 0)
    r = client.chat.completions.create(model=served.model.name, messages=ask("CUT_SHORT"), tools=TOOLS,
                                       max_tokens=n, reasoning_effort="high")
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    (tc,) = choice.message.tool_calls
    assert tc.function.name == "get_weather" and json.loads(tc.function.arguments)["city"].startswith("Z")


def test_responses(served):
    want = FAMILIES[served.family][6]
    client = openai.OpenAI(base_url=served.base + "/v1", api_key=KEY, max_retries=0)
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    kwargs = dict(model=served.model.name, input="CALL_TOOLS please", tools=tools, max_output_tokens=400,
                  reasoning={"effort": "high"})
    r = client.responses.create(**kwargs)
    assert [o.type for o in r.output] == ["reasoning", "message"] + ["function_call"] * len(want)
    calls = [o for o in r.output if o.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == list(zip(NAMES, want))
    with client.responses.stream(**kwargs) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    assert [(o.name, json.loads(o.arguments)) for o in final.output if o.type == "function_call"] == \
        list(zip(NAMES, want))
    assert "".join(deltas) == "".join(c.arguments for c in calls)


def test_anthropic_messages(served):
    want = FAMILIES[served.family][6]
    client = anthropic.Anthropic(base_url=served.base, api_key=KEY, max_retries=0)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    kwargs = dict(model=served.model.name, max_tokens=400, messages=ask(), tools=tools,
                  thinking={"type": "enabled", "budget_tokens": 2048})
    r = client.messages.create(**kwargs)
    assert [b.type for b in r.content] == ["thinking", "text"] + ["tool_use"] * len(want)
    assert r.content[0].thinking == THOUGHT and r.content[1].text == "Checking."
    assert [(b.name, b.input) for b in r.content[2:]] == list(zip(NAMES, want)) and r.stop_reason == "tool_use"
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == list(zip(NAMES, want))
    assert final.stop_reason == "tool_use"


# -- the chat template: /tokenize against transformers ----------------------------------------
CALL_ARGS = {"city": "Zürich", "days": 3}
CONVERSATIONS = {
    "tools": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}],
    "tool_calls": [{"role": "user", "content": "Weather?"},
                   {"role": "assistant", "content": "Checking.", "tool_calls": [
                       {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": CALL_ARGS}}]}],
    "tool_results": [{"role": "user", "content": "Weather?"},
                     {"role": "assistant", "content": "", "tool_calls": [
                         {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": CALL_ARGS}},
                         {"id": "call_2", "type": "function", "function": {"name": "search", "arguments": {"q": "x"}}}]},
                     {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C"},
                     {"role": "tool", "tool_call_id": "call_2", "name": "search", "content": "no results"}],
    "reasoning": [{"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
                  {"role": "user", "content": "Weather?"},
                  {"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": [
                      {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": CALL_ARGS}}]},
                  {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C"}],
}


def _as_strings(messages):
    """The same conversation with arguments as JSON strings, as OpenAI clients send them."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                                     for c in m["tool_calls"]]}
        out.append(m)
    return out


@pytest.mark.parametrize("shape", list(CONVERSATIONS))
def test_tokenize_matches_transformers(served, shape):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(served.model)
    messages = CONVERSATIONS[shape]
    for gen_prompt in (True, False):
        want = hf.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=gen_prompt, tokenize=True,
                                      return_dict=False)
        for sent in (messages, _as_strings(messages)):
            status, got = served.request("POST", "/tokenize", {"model": served.model.name, "messages": sent,
                                                               "tools": TOOLS, "add_generation_prompt": gen_prompt})
            assert status == 200, got
            assert got["tokens"] == want and got["count"] == len(want) and got["max_model_len"] == 4096
    text = hf.decode(want)
    assert "get_weather" in text and (shape == "tools" or "Zürich" in text)
    status, back = served.request("POST", "/detokenize", {"model": served.model.name, "tokens": want})
    assert status == 200 and back["prompt"] == text
    special = FAMILIES[served.family][0]
    if special:     # the family's markers are single special tokens in the rendered prompt
        assert hf.convert_tokens_to_ids(special[0]) in want or shape == "tools"


def test_tokenize_errors_and_guard(served):
    status, body = served.request("POST", "/tokenize", {"model": served.model.name, "messages": "hi"})
    assert status == 400 and body["error"]["param"] == "messages"
    status, body = served.request("POST", "/detokenize", {"tokens": [1, 10 ** 9]})
    assert status == 400 and "outside the vocabulary" in body["error"]["message"]
    status, body = served.request("POST", "/tokenize", {"prompt": "x"}, headers={"Authorization": "Bearer wrong"})
    assert status == 401
    status, body = served.request("POST", "/tokenize", {"model": "other", "prompt": "x"})
    assert status == 404


def test_named_tool_choice_forces_a_call_in_the_family_format(served):
    # No script: random weights, yet the call's start is put in the answer in the family's
    # markup, so a well-formed call to the named tool always comes back.
    client = openai.OpenAI(base_url=served.base + "/v1", api_key=KEY, max_retries=0)
    r = client.chat.completions.create(model=served.model.name, messages=ask("anything"), tools=TOOLS,
                                       max_tokens=12, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "search"}})
    tc = r.choices[0].message.tool_calls[0]
    assert tc.function.name == "search" and isinstance(json.loads(tc.function.arguments), dict)
