"""Operations against a real `ft serve`: /metrics, prefill instrumentation, `ft ctl`, and the
stall sentinel on a healthy and on a stalled server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving import ServerProcess

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from freetoken.demo.tiny_model import make_tiny_model
    out = tmp_path_factory.mktemp("ops") / "tiny"
    make_tiny_model(out, family="qwen3_moe", seed=2, max_position_embeddings=512)
    return out


def scrape(server) -> dict:
    status, raw = server.request("GET", "/metrics")
    assert status == 200
    values = {}
    families = list(text_string_to_metric_families(raw.decode() if isinstance(raw, bytes) else raw))
    # Prometheus' own parser attaches every sample to its family: none is left empty.
    empty = [f.name for f in families if not f.samples]
    assert not empty, empty
    types = {f.name: f.type for f in families}
    assert types["freetoken_preemptions"] == "counter" and types["freetoken_prompt_tokens"] == "counter"
    for family in families:
        for s in family.samples:
            values[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return values


def test_metrics_move_and_prefill_instrumented(model_dir, tmp_path):
    with ServerProcess(model_dir, "--max-prefill-length", "16",
                       env={"FREETOKEN_INSTRUMENT_PREFILL": "1"}) as server:
        before = scrape(server)
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0)
        r = client.completions.create(model="tiny", prompt="word " * 40, max_tokens=5,
                                      extra_body={"ignore_eos": True})
        after = scrape(server)
        assert after[("freetoken_generation_tokens_total", ())] - before[("freetoken_generation_tokens_total", ())] == 5
        assert after[("freetoken_time_to_first_token_seconds_count", ())] == 1
        assert after[("freetoken_requests_finished_total", (("reason", "length"),))] == 1
        assert after[("freetoken_step_seconds_count", ())] >= 5
        # Prefill ran in chunks of 16: it is timed across all of them, per request.
        prefill = r.usage.model_extra["prefill"]
        assert prefill["prefill_tokens"] == r.usage.prompt_tokens and prefill["prefill_s"] > 0
        _, stats = server.request("GET", "/v1/stats")
        assert stats["recent_requests"][-1]["prefill"]["prefill_tokens"] == r.usage.prompt_tokens


def test_no_prefill_report_without_flag(model_dir):
    with ServerProcess(model_dir) as server:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0)
        r = client.completions.create(model="tiny", prompt="hello there", max_tokens=2)
        assert "prefill" not in (r.usage.model_extra or {})
        _, stats = server.request("GET", "/v1/stats")
        assert "prefill" not in stats["recent_requests"][-1]
        _, inst = server.request("GET", "/v1/instrumentation")
        assert inst["model"]["max_model_len"] == 512 and inst["device"]["type"] == "cpu"
        assert inst["kv_cache"]["tokens"] == inst["kv_cache"]["blocks"] * inst["kv_cache"]["block_size"]
        # Bytes per token from the layers' specs, computed here from config.json.
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        per_layer = 2 * cfg["num_key_value_heads"] * head_dim * 4          # K and V, float32
        layers = inst["kv_cache"]["layers"]
        assert len(layers) == cfg["num_hidden_layers"]
        assert {entry["bytes_per_token"] for entry in layers} == {per_layer}
        assert inst["kv_cache"]["bytes_per_token"] == per_layer * cfg["num_hidden_layers"]
        # ft ctl against the same server
        for what in ("health", "stats", "models", "instrumentation"):
            out = subprocess.run([sys.executable, "-m", "freetoken.cli", "ctl", what, "--url", server.base],
                                 capture_output=True, text=True, timeout=30)
            assert out.returncode == 0, out.stderr
            body = json.loads(out.stdout)
            assert {"health": "status", "stats": "kv_blocks_total", "models": "data",
                    "instrumentation": "kv_cache"}[what] in body


def sentinel(server, *args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "stall_sentinel.py"), "--port",
                           str(server.port), "--pid", str(server.proc.pid), "--interval", "0.1", *args],
                          capture_output=True, text=True, timeout=120)


def test_sentinel_healthy_and_stalled(model_dir, tmp_path):
    with ServerProcess(model_dir) as server:
        out = sentinel(server, "--count", "3", "--threshold", "10", "--report", str(tmp_path / "ok.jsonl"))
        assert out.returncode == 0, out.stdout + out.stderr
        assert "0 stalls" in out.stdout
        assert not (tmp_path / "ok.jsonl").exists()
    with ServerProcess(model_dir, env={"FREETOKEN_DEBUG_STEP_DELAY_S": "0.4"}) as server:
        report = tmp_path / "stall.jsonl"
        out = sentinel(server, "--count", "1", "--threshold", "1.0", "--max-tokens", "4",
                       "--report", str(report))
        assert out.returncode == 1, out.stdout + out.stderr
        assert "1 stalls" in out.stdout
        snap = json.loads(report.read_text().splitlines()[0])
        assert snap["probe"]["total_s"] > 1.0
        assert snap["snapshot"]["threads"] and all("wchan" in t and "state" in t for t in snap["snapshot"]["threads"])
        assert "read_bytes" in snap["snapshot"]["io"]


def test_offload_flags_reach_the_engine(model_dir):
    """`ft serve --moe-backend offload` serves the same greedy text as the resident default,
    and /v1/instrumentation reads the placement back off the live engine."""
    body = {"model": "tiny", "prompt": "the lighthouse keeper", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    with ServerProcess(model_dir) as server:
        _, resident = server.request("POST", "/v1/completions", body)
    with ServerProcess(model_dir, "--moe-backend", "offload", "--moe-cache-size", "10",
                       "--moe-cache-policy", "lfu-decay", "--no-moe-prefetch") as server:
        _, offload = server.request("POST", "/v1/completions", body)
        _, inst = server.request("GET", "/v1/instrumentation")
        metrics = scrape(server)
    assert offload["choices"][0]["text"] == resident["choices"][0]["text"]
    assert metrics[("freetoken_expert_cache_misses_total", ())] > 0
    assert metrics[("freetoken_expert_bytes_fetched_total", ())] > 0
    moe = inst["moe"]
    assert moe["backend"] == "offload" and moe["policy"] == "lfu-decay"
    assert moe["prefetch"] == "off" and moe["counters"]["prefetch_guessed"] == 0
    assert moe["counters"]["fetch_gbps"] > 0
    assert moe["counters"]["lookups"] == moe["counters"]["hits"] + moe["counters"]["misses"] > 0


def test_moe_trace_records_the_routing_served(model_dir, tmp_path):
    """`ft serve --moe-trace PATH` writes the routing of the requests it served (not the
    warmup's) at shutdown, and bench/cache_policy.py's replay runs on it."""
    from freetoken.moe.replay import belady_fetches, replay
    from freetoken.moe.trace import RoutingTrace

    path = tmp_path / "routing.json"
    body = {"model": "tiny", "prompt": "the lighthouse keeper", "max_tokens": 10, "temperature": 0,
            "ignore_eos": True}
    # The warmup ladder runs (forced on the CPU, kept short): its steps must not be in the trace.
    with ServerProcess(model_dir, "--moe-backend", "offload", "--moe-cache-size", "10",
                       "--moe-prefetch", "all", "--moe-trace", str(path), "--max-prefill-length", "32",
                       env={"FREETOKEN_PREFILL_WARMUP": "1", "FREETOKEN_WARMUP_MAX_DEPTH": "64"}) as server:
        server.request("POST", "/v1/completions", body)
        _, inst = server.request("GET", "/v1/instrumentation")
        metrics = scrape(server)
        assert not path.exists()                 # written at shutdown
        assert server.stop() == 0
    trace = RoutingTrace.load(path)
    assert inst["warmup"]["extend_lengths"] and inst["warmup"]["depth"] > 0     # the ladder ran
    counters = inst["moe"]["counters"]
    assert len(trace.steps) == counters["steps"] >= 10 and "ft serve" in trace.source
    assert sum(len(r.experts) for s in trace.steps for r in s.routes) == counters["lookups"]
    # The cache was warm from the ladder, so a replay from empty can only hit less.
    got = replay(trace, 10, "lfu-decay")
    assert got.lookups == counters["lookups"] and got.hits <= counters["hits"]
    assert belady_fetches(trace, 10).fetched <= got.fetched
    prefetched = metrics[("freetoken_expert_prefetched_total", ())]
    assert 0 < metrics[("freetoken_expert_prefetch_used_total", ())] <= \
        metrics[("freetoken_expert_prefetch_guessed_total", ())]
    assert prefetched == counters["prefetch_fetched"] > 0

