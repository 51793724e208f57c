"""Expert prefetch: the window arithmetic (overlap.py) on hand-set timestamps, the ranking of
guesses by router probability, and the runtime honouring the window and the three modes
end to end on a tiny model (outputs never change: prefetch only moves copies earlier)."""

import time
from types import SimpleNamespace

import pytest
import torch

from freetoken import LLM, SamplingParams
from freetoken.demo.tiny_model import make_tiny_model
from freetoken.moe.config import MoeConfig
from freetoken.moe.overlap import PrefetchWindow
from freetoken.moe.runtime import MoeRuntime, expert_rows
from freetoken.moe.trace import RoutingTrace


class HandClock(PrefetchWindow):
    """A CPU window whose clock reads the given times, one per reading."""
    def __init__(self, times):
        super().__init__(torch.device("cpu"))
        self.times = list(times)

    def _now(self):
        return self.times.pop(0)


def test_the_window_is_compute_time_plus_the_host_gap_before_the_demand_fetch():
    # Layer 3's prefetch enqueued, compute from 0.0; layer 3 routed at 0.5, the host synced at
    # 0.625 and enqueues layer 3's misses at 0.875: a 0.75 s window, three copies of 0.25 s.
    w = HandClock([0.0, 0.5, 0.625, 0.875,    # decode step (1 row)
                   2.0, 2.25, 2.25, 2.25,     # next decode step: 0.25 s
                   5.0, 9.0, 9.0, 9.0])       # a 100-row prefill chunk: 4 s, its own average

    def one_window(rows):
        w.started(3)
        w.routed(3)
        w.synced(3)
        w.closed(3, rows)

    assert w.count(3, 1, 0.25) is None                # nothing measured: no limit
    one_window(1)
    assert w.window_s[(3, 1)] == 0.75 and w.count(3, 1, 0.25) == 3
    one_window(1)
    one_window(100)
    assert w.window_s[(3, 1)] == pytest.approx(0.75 + 0.3 * (0.25 - 0.75))    # the EMA
    assert w.window_s[(3, 7)] == 4.0 and w.count(3, 64, 0.25) == 16 and w.count(3, 1, None) is None
    assert w.latest_s[3] == 4.0
    # A 0.6 s window holds one whole 0.4 s copy and 0.2 s of a second: worth starting when a
    # guess of rank 1 is right often enough that its uncovered tail costs less, (1 - a) * 0.4 < 0.2.
    assert w.count(3, 1, 0.4, lambda rank: 0.7 if rank == 1 else 0.0) == 2
    assert w.count(3, 1, 0.4, lambda rank: 0.4 if rank == 1 else 1.0) == 1
    w.closed(4, 1)                                    # a layer nobody prefetched for
    assert not any(layer == 4 for layer, _ in w.window_s)


def test_moe_prefetch_is_validated_and_booleans_read_as_on_off():
    assert MoeConfig(prefetch=True).prefetch == "auto" and MoeConfig(prefetch=False).prefetch == "off"
    with pytest.raises(ValueError, match="moe_prefetch must be one of auto, all, off"):
        MoeConfig(prefetch="sometimes")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("pf"), hidden_size=64, num_layers=4,
                               num_experts=16, top_k=4, moe_intermediate_size=32))


def run(model, **kw):
    llm = LLM(model, skip_tokenizer_init=True, moe_backend="offload", moe_cache_size=24, **kw)
    outs = llm.generate([list(range(3, 30)), [5, 6, 7]],
                        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], llm.runner.moe


def test_guesses_are_ranked_by_summed_router_probability():
    runtime = SimpleNamespace(store=SimpleNamespace(num_experts=16))
    ids = torch.tensor([[3, 9], [9, 1], [7, 3]])
    probs = torch.tensor([[0.5, 0.1], [0.3, 0.2], [0.35, 0.05]])
    # 3: 0.55, 9: 0.4, 7: 0.35, 1: 0.2
    assert MoeRuntime._rank(runtime, ids, probs) == [3, 9, 7, 1]


@pytest.mark.parametrize("tokens", [1, 3, 32, 33, 500])       # both sides of SMALL_ROUTING (256 pairs)
def test_expert_rows_counts_and_sums_per_expert(tokens):
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(64, generator=g)[:8] for _ in range(tokens)])
    probs = torch.rand(tokens, 8, generator=g)
    rows, sums = expert_rows(ids, 64), expert_rows(ids, 64, probs)
    want_rows = torch.bincount(ids.reshape(-1), minlength=64)
    want_sums = torch.zeros(64, dtype=torch.float64).index_add_(0, ids.reshape(-1), probs.reshape(-1).double())
    assert rows == {e: int(n) for e, n in enumerate(want_rows.tolist()) if n}
    assert sums.keys() == rows.keys()
    assert all(abs(sums[e] - want_sums[e].item()) < 1e-6 for e in sums)


def test_modes_change_the_copies_not_the_tokens(model):
    tokens, moe = run(model, moe_prefetch="off")
    c = moe.report()["counters"]
    assert moe.report()["prefetch"] == "off" and c["prefetch_fetched"] == c["prefetch_guessed"] == 0

    all_tokens, moe = run(model, moe_prefetch="all")
    c = moe.report()["counters"]
    assert all_tokens == tokens
    assert c["prefetch_fetched"] > 0 and moe.window is None
    by_rank = c["prefetch_accuracy_by_rank"]          # 0: the most likely guess
    assert by_rank and all(0 <= a <= 1 for a in by_rank)
    assert (sum(moe._rank_used), sum(moe._rank_guessed)) == (c["prefetch_used"], c["prefetch_guessed"])

    auto_tokens, moe = run(model)                           # the default: auto
    r = moe.report()
    assert auto_tokens == tokens and r["prefetch"] == "auto"
    windows = [p["prefetch_window_us"] for p in r["counters"]["per_layer"]]
    assert windows[0] is None and all(w is not None and w >= 0 for w in windows[1:])


@pytest.mark.parametrize("fit", [0, 1])
def test_prefetch_stays_within_the_window(model, monkeypatch, fit):
    monkeypatch.setattr(PrefetchWindow, "count", lambda self, layer, rows, copy_s, accuracy: fit)
    tokens, moe = run(model)
    c = moe.report()["counters"]
    prefetching_layers = len(moe.next_cached)
    assert c["prefetch_guessed"] > 0 and c["prefetch_dropped"] > 0
    assert 0 < c["prefetch_fetched"] <= fit * c["steps"] * prefetching_layers if fit else \
        c["prefetch_fetched"] == 0
    assert tokens == run(model, moe_prefetch="off")[0]


@pytest.mark.parametrize("fit,limit", [(1, 1), (3, 2)])
def test_hybrid_prefetches_no_more_than_its_k_or_the_window(model, monkeypatch, fit, limit):
    monkeypatch.setattr(PrefetchWindow, "count", lambda self, layer, rows, copy_s, accuracy: fit)
    llm = LLM(model, skip_tokenizer_init=True, moe_backend="hybrid", moe_cache_size=24, moe_hybrid_k=2)
    cache = llm.runner.moe.cache
    limits, prefetch = [], cache.prefetch

    def recording_prefetch(layer, experts, protected, limit=None):
        limits.append(limit)
        return prefetch(layer, experts, protected, limit)

    cache.prefetch = recording_prefetch
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert limits and set(limits) == {limit}          # min(K = 2, what the window holds)


class CallLog(PrefetchWindow):
    """Records the order of the runtime's calls: (name, layer)."""
    calls: list = []

    def started(self, layer):
        self.calls.append(("started", layer))
        super().started(layer)

    def routed(self, layer):
        self.calls.append(("routed", layer))
        super().routed(layer)

    def synced(self, layer):
        self.calls.append(("synced", layer))
        super().synced(layer)

    def closed(self, layer, rows):
        self.calls.append(("closed", layer))
        super().closed(layer, rows)


def test_each_window_opens_in_the_layer_before_and_closes_before_the_demand_fetch(model, monkeypatch):
    import freetoken.moe.runtime as runtime_module
    monkeypatch.setattr(runtime_module, "PrefetchWindow", CallLog)
    CallLog.calls = []
    _, moe = run(model)
    layers = sorted(moe.mode)                                        # 0..3, each prefetching the next
    # Per step and layer: its routing, the sync, its demand fetch; then the next layer's
    # prefetch starts that layer's window.
    step = []
    for layer in layers:
        step += [("routed", layer), ("synced", layer), ("closed", layer)]
        if layer != layers[-1]:
            step.append(("started", moe.next_cached[layer]))
    assert CallLog.calls == step * moe.report()["counters"]["steps"]
    assert all(moe.window.latest_s.get(layer) is not None for layer in layers[1:])


def test_a_trace_is_written_at_its_cap_and_a_failed_write_fails_nothing(model, tmp_path, monkeypatch):
    import freetoken.moe.runtime as runtime_module
    monkeypatch.setattr(runtime_module, "TRACE_MAX_STEPS", 3)
    path = tmp_path / "t.json"
    _, moe = run(model, moe_trace=str(path))          # 12 tokens: the cap comes mid-run
    deadline = time.monotonic() + 10
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)                              # written on a thread of its own
    assert moe.trace is None and len(RoutingTrace.load(path).steps) == 3
    folder = tmp_path / "gone"
    folder.mkdir()
    llm = LLM(model, skip_tokenizer_init=True, moe_backend="offload", moe_cache_size=24,
              moe_trace=str(folder / "t.json"))
    folder.rmdir()                                    # the write at the cap will fail
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8 and llm.runner.moe.trace is None
    with pytest.raises(ValueError, match="cannot write"):
        LLM(model, skip_tokenizer_init=True, moe_backend="offload", moe_trace=str(folder / "t.json"))

