"""Expert prefetch: the window arithmetic (overlap.py) on hand-set timestamps, the ranking of
guesses by router probability, and the runtime honouring the window and the three modes
end to end on a tiny model (outputs never change: prefetch only moves copies earlier)."""

import pytest
import torch

from freetoken import LLM, SamplingParams
from freetoken.demo.tiny_model import make_tiny_model
from freetoken.moe.config import MoeConfig
from freetoken.moe.overlap import PrefetchWindow


class HandClock(PrefetchWindow):
    """A CPU window whose stamps are the given times."""
    def __init__(self, times):
        super().__init__(torch.device("cpu"))
        self.times = list(times)

    def stamp(self):
        return self.times.pop(0)


def test_the_window_is_the_idle_link_time_before_the_demand_fetch():
    # Prefetch enqueued at 0.0 behind copies busy until 0.25; the next layer's misses go out
    # at 1.0: the link was free for 0.75 s, three copies of 0.25 s.
    w = HandClock([0.0, 1.0, 5.0, 5.25, 9.0, 9.5])
    assert w.count(3, 0.25) is None                  # nothing measured: no limit
    w.opened(3, copies_done=0.25)
    w.closed(3)
    assert w.window_s[3] == 0.75
    assert w.count(3, 0.25) == 3 and w.count(3, None) is None
    w.opened(3, copies_done=None)                    # copy stream idle: 0.25 s free
    w.closed(3)
    assert w.window_s[3] == pytest.approx(0.75 + 0.3 * (0.25 - 0.75))    # the EMA
    w.opened(3, copies_done=9.8)                     # copies outlast the demand: no window
    w.closed(3)
    assert w.window_s[3] == pytest.approx(0.6 + 0.3 * (0.0 - 0.6))
    w.closed(4)                                      # a layer nobody prefetched for
    assert 4 not in w.window_s


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


def test_guesses_are_ranked_by_summed_router_probability(model):
    _, moe = run(model, moe_prefetch="all")
    ids = torch.tensor([[3, 9], [9, 1], [7, 3]])
    probs = torch.tensor([[0.5, 0.1], [0.3, 0.2], [0.35, 0.05]])
    # 3: 0.55, 9: 0.4, 7: 0.35, 1: 0.2
    assert moe._rank(ids, probs) == [3, 9, 7, 1]


def test_modes_change_the_copies_not_the_tokens(model):
    tokens, moe = run(model, moe_prefetch="off")
    c = moe.report()["counters"]
    assert moe.report()["prefetch"] == "off" and c["prefetch_fetched"] == c["prefetch_guessed"] == 0

    all_tokens, moe = run(model, moe_prefetch="all")
    c = moe.report()["counters"]
    assert all_tokens == tokens
    assert c["prefetch_fetched"] > 0 and moe.window is None

    auto_tokens, moe = run(model)                           # the default: auto
    r = moe.report()
    assert auto_tokens == tokens and r["prefetch"] == "auto"
    windows = [p["prefetch_window_us"] for p in r["counters"]["per_layer"]]
    assert windows[0] is None and all(w is not None and w >= 0 for w in windows[1:])


def test_a_window_too_short_for_one_copy_prefetches_nothing(model, monkeypatch):
    monkeypatch.setattr(PrefetchWindow, "count", lambda self, layer, copy_s: 0)
    tokens, moe = run(model)
    c = moe.report()["counters"]
    assert c["prefetch_guessed"] > 0 and c["prefetch_fetched"] == 0 and c["prefetch_dropped"] > 0
    assert tokens == run(model, moe_prefetch="off")[0]
