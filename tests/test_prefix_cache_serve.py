"""Prefix caching end to end: a real `ft serve` on a tiny checkpoint, driven by the openai and
anthropic SDKs. Turn 2 of a chat reports the cached prefix in every dialect's usage; /metrics
and /v1/instrumentation report the cache; --no-enable-prefix-caching turns it all off."""

from __future__ import annotations

import anthropic
import openai
import pytest

from serving import ServerProcess
from tiny_fixtures import tiny_model_dir  # noqa: F401 - a fixture

MODEL = "tiny-prefix"
BLOCK = 16
SYSTEM = "You keep the harbour lights. " * 30
TURN1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is the north lamp lit?"}]
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):  # noqa: F811 - the imported fixture
    return tiny_model_dir("qwen3_moe", seed=3, name=MODEL, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess(model_dir, "--max-prefill-length", "64") as s:
        yield s


def oai(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0)


def blocks_of(n: int) -> int:
    return n // BLOCK * BLOCK


def chat_turns(client, system_note: str = ""):
    msgs = [{"role": "system", "content": system_note + SYSTEM}, TURN1[1]]
    one = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                         extra_body=NO_EOS)
    msgs = msgs + [{"role": "assistant", "content": one.choices[0].message.content},
                   {"role": "user", "content": "And the south one?"}]
    two = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                         extra_body=NO_EOS)
    return one, two


def test_chat_turn_two_reports_cached_tokens(server):
    one, two = chat_turns(oai(server), "Chat. ")
    assert one.usage.prompt_tokens > 200
    assert one.usage.prompt_tokens_details.cached_tokens == 0
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert blocks_of(one.usage.prompt_tokens) <= cached < two.usage.prompt_tokens
    assert cached % BLOCK == 0


def test_streamed_usage_and_completions_report_cached_tokens(server):
    client = oai(server)
    prompt = "Stream. " + SYSTEM
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_body=NO_EOS)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_body=NO_EOS)
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // BLOCK * BLOCK
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}, extra_body=NO_EOS))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (n - 1) // BLOCK * BLOCK
    msgs = [{"role": "user", "content": prompt}]
    client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, extra_body=NO_EOS)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=NO_EOS))
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // BLOCK * BLOCK


def test_responses_report_cached_tokens(server):
    client = oai(server)
    kwargs = dict(model=MODEL, instructions="Responses. " + SYSTEM, input="Is it lit?", max_output_tokens=4)
    first = client.responses.create(**kwargs)
    again = client.responses.create(**kwargs)
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert again.usage.input_tokens_details.cached_tokens == (first.usage.input_tokens - 1) // BLOCK * BLOCK


def test_anthropic_reports_cache_read_and_creation(server):
    client = anthropic.Anthropic(base_url=server.base, api_key="x", max_retries=0)
    kwargs = dict(model=MODEL, max_tokens=4, system="Messages. " + SYSTEM,
                  messages=[{"role": "user", "content": "Is it lit?"}])
    counted = client.messages.count_tokens(**{k: v for k, v in kwargs.items() if k != "max_tokens"}).input_tokens
    first = client.messages.create(**kwargs).usage
    assert first.cache_read_input_tokens == 0 and first.cache_creation_input_tokens == blocks_of(counted)
    with client.messages.stream(**kwargs) as stream:
        again = stream.get_final_message().usage
    assert again.cache_read_input_tokens == (counted - 1) // BLOCK * BLOCK
    assert again.input_tokens + again.cache_read_input_tokens + again.cache_creation_input_tokens == counted


def test_metrics_and_instrumentation_report_the_cache(server):
    from test_operations import scrape
    before = scrape(server)
    chat_turns(oai(server), "Metrics. ")
    after = scrape(server)
    hits = after[("freetoken_prefix_cache_hits_total", ())] - before[("freetoken_prefix_cache_hits_total", ())]
    queried = (after[("freetoken_prefix_cache_queries_total", ())]
               - before[("freetoken_prefix_cache_queries_total", ())])
    assert 0 < hits < queried
    assert after[("freetoken_prefix_cache_blocks", ())] > 0
    _, inst = server.request("GET", "/v1/instrumentation")
    pc = inst["prefix_cache"]
    assert pc["enabled"] and pc["requested"] and pc["block_size"] == BLOCK
    assert pc["counters"]["cached_blocks"] <= inst["kv_cache"]["blocks"]
    assert pc["counters"]["cached_blocks"] > 0 and pc["counters"]["hit_tokens"] >= hits


def test_n_samples_share_one_prefill(server):
    """n = 3 samples of one new prompt: the first prefills it, the other two take its full
    blocks from the cache (the /metrics hits grow by two prompts' worth of blocks)."""
    from test_operations import scrape
    before = scrape(server)
    msgs = [{"role": "system", "content": "Samples. " + SYSTEM}, TURN1[1]]
    r = oai(server).chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, n=3,
                                            temperature=1, seed=5, extra_body=NO_EOS)
    after = scrape(server)
    assert len(r.choices) == 3
    hits = after[("freetoken_prefix_cache_hits_total", ())] - before[("freetoken_prefix_cache_hits_total", ())]
    assert hits >= 2 * blocks_of(r.usage.prompt_tokens - 1)


def test_no_enable_prefix_caching(model_dir):
    with ServerProcess(model_dir, "--no-enable-prefix-caching") as server:
        _, two = chat_turns(oai(server))
        assert two.usage.prompt_tokens_details.cached_tokens == 0
        _, inst = server.request("GET", "/v1/instrumentation")
        assert inst["prefix_cache"]["enabled"] is False and inst["prefix_cache"]["counters"]["cached_blocks"] == 0
