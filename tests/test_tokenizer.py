"""freetoken.tokenizer against the oracle: transformers' AutoTokenizer on the same tiny checkpoint.

Same ids, same text, same chat prompts (text and ids); and streaming detokenization that adds
up to one-shot decode whatever the split, never handing out half a character.
"""

from __future__ import annotations

import random
import shutil
import unicodedata

import pytest

from freetoken.tokenizer import IncrementalDetokenizer, Tokenizer
from tiny_fixtures import tiny_model_dir  # noqa: F401 - a fixture

TEXTS = [
    "",
    "Hello, world!",
    "The lighthouse keeper climbs 112 steps at 21:42 every evening.",
    "  leading spaces, trailing spaces   \n\n\ttabs\r\nCRLF\n",
    "def f(x: int) -> int:\n    return x ** 2  # square\n",
    '{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}',
    "3.14159 2,718 1e-6 0xDEADBEEF 12345678901234567890",
    "Crème brûlée, naïve façade, Ærø, ñandú, İstanbul, Łódź, Ελληνικά, Русский",
    "e\u0301 vs \u00e9 (NFD vs NFC), \ufb01 ligature, full-width ＡＢＣ",
    "中文测试：今天天气很好。日本語のテキスト。한국어 문장.",
    "Emoji 😀🚀🎉 family 👨\u200d👩\u200d👧 flags 🇫🇷🇯🇵 skin 👍🏽 rare 🫠 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nyes<|im_end|>",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call><|endoftext|>",
    "a<|im_end|>b<|im_start|>c <think>d</think> e",
    "isn't they're we've I'm you'll he'd IT'S",
    "\u00a0nbsp\u2009thin\u3000ideographic space",
]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "e.g. Zürich or 東京"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}},
]

CONVERSATIONS = {
    "plain": [{"role": "user", "content": "Hello!"}],
    "system_multi_turn": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3 + 3?"},
    ],
    "unicode": [
        {"role": "user", "content": "Traduis « bonjour » en 日本語 🙂"},
        {"role": "assistant", "content": "こんにちは 👋"},
        {"role": "user", "content": "Merci ! Ça va ? 谢谢"},
    ],
    "content_parts_and_nulls": [
        {"role": "user", "content": [{"type": "text", "text": "Part one. "},
                                     {"type": "text", "text": "Part two."}]},
        {"role": "assistant", "content": "ok", "tool_calls": None, "name": None},
        {"role": "user", "content": "again"},
    ],
    "tools": [
        {"role": "system", "content": "Use tools when helpful."},
        {"role": "user", "content": "Weather in Zürich and news about lighthouses?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "search", "arguments": {"query": "lighthouse 灯塔"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18, "sky": "☀️"}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "No news."},
        {"role": "assistant", "content": "It is 18 °C and sunny; no lighthouse news."},
        {"role": "user", "content": "Thanks"},
    ],
    "tools_no_system_content_and_call": [
        {"role": "user", "content": "Search for cats"},
        {"role": "assistant", "content": "Let me search.", "tool_calls": [
            {"type": "function", "function": {"name": "search", "arguments": {"query": "cats"}}}]},
        {"role": "tool", "content": "Cats are great."},
    ],
    "reasoning": [
        {"role": "user", "content": "First question"},
        {"role": "assistant", "content": "First answer", "reasoning_content": "old thoughts"},
        {"role": "user", "content": "Is 97 prime?"},
        {"role": "assistant", "content": "Yes.", "reasoning_content": "\nCheck 2, 3, 5, 7.\n"},
    ],
    "reasoning_inline_and_alias": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\ninline thoughts\n</think>\n\nHello!"},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "Sure.", "reasoning": "aliased field"},
    ],
}


@pytest.fixture(scope="module")
def ckpt(tiny_model_dir):  # noqa: F811 - the imported fixture
    return tiny_model_dir("qwen3_moe")


@pytest.fixture(scope="module")
def ours(ckpt):
    return Tokenizer.from_dir(ckpt)


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(ckpt)


def test_encode_decode_match_transformers(ours, hf):
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
        if "<|" not in text:  # byte-level BPE is lossless up to the NFC normaliser
            assert ours.decode(ids) == unicodedata.normalize("NFC", text)


def test_special_tokens_and_vocab_match_transformers(ours, hf):
    assert ours.eos_token_id == hf.eos_token_id == hf.convert_tokens_to_ids("<|im_end|>")
    assert ours.pad_token_id == hf.pad_token_id == hf.convert_tokens_to_ids("<|endoftext|>")
    assert ours.bos_token_id is None and hf.bos_token_id is None
    assert ours.all_special_ids == hf.all_special_ids
    assert ours.vocab_size == len(hf) == len(ours)
    sample = [0, 1, 97, 255, 256, 1000, ours.vocab_size - 1, *ours.all_special_ids]
    assert [ours.id_to_token(i) for i in sample] == hf.convert_ids_to_tokens(sample)
    assert all(ours.token_to_id(ours.id_to_token(i)) == i for i in sample)
    # Qwen3's <think>/<tool_call> are added but not special: decode keeps them.
    think = ours.token_to_id("<think>")
    assert think is not None and not ours.is_special(think)
    assert ours.decode([think], skip_special_tokens=True) == "<think>"
    assert ours.decode([ours.eos_token_id], skip_special_tokens=True) == ""
    # The model's vocab (2048) is larger than the tokenizer's: the extra ids decode to nothing.
    assert ours.decode([ours.vocab_size + 5, 72]) == hf.decode([ours.vocab_size + 5, 72]) == "i"


TEMPLATE_CASES = [(name, gen, thinking) for name in CONVERSATIONS for gen in (True, False)
                  for thinking in (None, True, False)]


@pytest.mark.parametrize("name,add_generation_prompt,enable_thinking", TEMPLATE_CASES)
def test_chat_template_matches_transformers(ours, hf, name, add_generation_prompt, enable_thinking):
    messages = CONVERSATIONS[name]
    tools = TOOLS if name.startswith("tools") else None
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    text = ours.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                    **kwargs)
    want = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                  tokenize=False, **kwargs)
    assert text == want
    ids = ours.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                   tokenize=True, **kwargs)
    assert ids == hf.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         tokenize=True, return_dict=False, **kwargs)
    # The format itself (so a template that renders nothing cannot pass by agreeing).
    assert text.startswith("<|im_start|>") and text.count("<|im_start|>") == text.count("<|im_end|>") + (
        1 if add_generation_prompt else 0)
    assert ids.count(ours.token_to_id("<|im_start|>")) == text.count("<|im_start|>")
    assert text.endswith("<think>\n\n</think>\n\n") == (add_generation_prompt and enable_thinking is False)


def test_chat_template_features_render(ours):
    tools_text = ours.apply_chat_template(CONVERSATIONS["tools"], tools=TOOLS)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in tools_text
    assert '"e.g. Zürich or 東京"' in tools_text    # tojson keeps non-ASCII
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "search", "arguments": {"query": "lighthouse 灯塔"}}\n</tool_call>'
            '<|im_end|>') in tools_text
    # Consecutive tool results share one user turn.
    assert ('<|im_start|>user\n<tool_response>\n{"temp_c": 18, "sky": "☀️"}\n</tool_response>\n'
            '<tool_response>\nNo news.\n</tool_response><|im_end|>\n') in tools_text
    reasoning = ours.apply_chat_template(CONVERSATIONS["reasoning"], add_generation_prompt=False)
    assert "old thoughts" not in reasoning    # earlier turns' reasoning is dropped
    assert reasoning.endswith("<|im_start|>assistant\n<think>\nCheck 2, 3, 5, 7.\n</think>\n\nYes.<|im_end|>\n")
    inline = ours.apply_chat_template(CONVERSATIONS["reasoning_inline_and_alias"], add_generation_prompt=False)
    assert "inline thoughts" not in inline and "<|im_start|>assistant\nHello!<|im_end|>" in inline
    assert inline.endswith("<think>\naliased field\n</think>\n\nSure.<|im_end|>\n")


def test_special_token_strings_and_kwargs_reach_the_template(ours, hf):
    source = "{{ eos_token }}|{{ pad_token }}|{{ bos_token }}|{{ custom }}|{{ messages[0].content }}"
    msgs = [{"role": "user", "content": "x"}]
    got = ours.apply_chat_template(msgs, chat_template=source, custom=7, add_generation_prompt=False)
    assert got == "<|im_end|>|<|endoftext|>||7|x"
    assert got == hf.apply_chat_template(msgs, chat_template=source, custom=7, tokenize=False)
    # Caller kwargs win over the special-token strings, as in transformers.
    assert ours.apply_chat_template(msgs, chat_template="{{ eos_token }}", eos_token="E") == "E"


def test_messages_reach_the_template_as_transformers_passes_them(ours, hf):
    # None-valued keys dropped (OpenAI clients send content: null), reasoning aliased under
    # reasoning_content and thinking, tools passed unchanged, non-ASCII kept by tojson.
    source = "{{ messages | tojson(indent=1, sort_keys=True) }}|{{ tools | tojson(separators=(',', ':')) }}"
    msgs = [{"role": "user", "content": "héllo", "name": None},
            {"role": "assistant", "content": None, "reasoning": "because 🤔", "tool_calls": None}]
    got = ours.apply_chat_template(msgs, tools=TOOLS[:1], chat_template=source)
    assert got == hf.apply_chat_template(msgs, tools=TOOLS[:1], chat_template=source,
                                         add_generation_prompt=True, tokenize=False)
    assert '"name"' not in got.split("|")[0] and "null" not in got and '"héllo"' in got
    assert '"reasoning_content": "because 🤔"' in got and '"thinking": "because 🤔"' in got


def test_chat_template_jinja_file_takes_precedence(tmp_path, ckpt, ours):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ckpt / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}] {{ m.content | upper }}\n{% endfor %}", encoding="utf-8")
    msgs = CONVERSATIONS["system_multi_turn"]
    got = Tokenizer.from_dir(tmp_path).apply_chat_template(msgs)
    from transformers import AutoTokenizer
    assert got == AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(msgs, tokenize=False)
    assert got.startswith("[system] YOU ARE A TERSE ASSISTANT.\n")
    assert got != ours.apply_chat_template(msgs)


def test_errors_are_clear(tmp_path, ours):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        Tokenizer.from_dir(tmp_path)
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(ValueError, match="no user allowed"):
        ours.apply_chat_template(msgs, chat_template="{{ raise_exception('no user allowed') }}")
    with pytest.raises(ValueError, match="does not parse"):
        ours.apply_chat_template(msgs, chat_template="{% for m in messages %}")
    with pytest.raises(ValueError, match="non-empty"):
        ours.apply_chat_template([])
    with pytest.raises(ValueError, match="tools"):
        ours.apply_chat_template(msgs, tools=["get_weather"])
    with pytest.raises(ValueError):   # the sandbox refuses Python internals
        ours.apply_chat_template(msgs, chat_template="{{ messages.__class__.__mro__ }}")


# -- streaming detokenization -----------------------------------------------------------------

def _byte_token_ids(tok: Tokenizer) -> list[int]:
    """The 256 single-byte tokens (GPT-2's byte-to-unicode mapping), which can split characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [tok.token_to_id(chars[b]) for b in range(256)]


def _stream(tok, ids, chunks, skip):
    d = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces, i = [], 0
    for n in chunks:
        pieces.append(d.add(ids[i:i + n] if n > 1 else ids[i]))
        i += n
    pieces.append(d.flush())
    return pieces, d


def _chunks(rng, total):
    out = []
    while sum(out) < total:
        out.append(min(rng.choice([1, 1, 1, 2, 3, 5]), total - sum(out)))
    return out


def test_streaming_equals_one_shot_decode(ours, hf):
    rng = random.Random(0)
    byte_ids = _byte_token_ids(ours)
    assert None not in byte_ids
    high_bytes = byte_ids[0x80:]           # lead and continuation bytes of multi-byte characters
    text_ids = [i for t in TEXTS for i in ours.encode(t)]
    specials = [*ours.all_special_ids, ours.token_to_id("<think>"), ours.token_to_id("</tool_call>")]
    for trial in range(300):
        n = rng.randint(1, 40)
        pools = [byte_ids, high_bytes, text_ids, specials, list(range(ours.vocab_size))]
        ids = [rng.choice(rng.choice(pools)) for _ in range(n)]
        skip = trial % 2 == 0
        pieces, _ = _stream(ours, ids, _chunks(rng, n), skip)
        want = ours.decode(ids, skip_special_tokens=skip)
        assert "".join(pieces) == want == hf.decode(ids, skip_special_tokens=skip), (ids, pieces)


def test_streaming_never_splits_a_character(ours):
    # Valid text fed one token at a time: no piece may show U+FFFD (half a character), and the
    # context window stays short however long the stream is (decoding is not quadratic).
    text = " ".join(TEXTS[7:11]) * 20
    ids = ours.encode(text)
    assert any("\ufffd" in ours.decode([i]) for i in ids)   # some tokens do split characters
    pieces, d = _stream(ours, ids, [1] * len(ids), True)
    assert "".join(pieces) == ours.decode(ids)
    assert not any("\ufffd" in p for p in pieces)
    assert len(ids) > 500
    # Mid-stream, the window spans only the held-back tail plus one emitted step.
    d2 = IncrementalDetokenizer(ours)
    longest = 0
    for i in ids:
        d2.add(i)
        longest = max(longest, len(d2.ids) - d2.prefix_offset)
    assert longest <= 8


def test_flush_emits_an_invalid_tail_like_one_shot_decode(ours):
    byte_ids = _byte_token_ids(ours)
    ids = ours.encode("ok ") + [byte_ids[0xE4], byte_ids[0xBD]]     # 2 of the 3 bytes of 你
    d = IncrementalDetokenizer(ours)
    streamed = d.add(ids)
    assert streamed == "ok "              # the unfinished character is held back...
    assert d.flush() == "\ufffd"          # ...and at the end shows as one-shot decode shows it
    assert streamed + "\ufffd" == ours.decode(ids)
    d = IncrementalDetokenizer(ours)
    assert d.add(ids[:-1]) == "ok " and d.add(ids[-1]) == "" and d.add(byte_ids[0xA0]) == "你"
