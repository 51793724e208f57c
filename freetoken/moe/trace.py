"""Routing traces: which experts each MoE layer used, step by step, and what prefetch guessed.

    trace.steps[s].rows          tokens routed in forward step s (1 per sequence in decode)
    trace.steps[s].routes        one LayerRoute per MoE layer, in layer order:
        .experts                 the layer's distinct experts in that step, busiest first
                                 (the order the cache's `ensure` sees them)
        .guess                   the experts the previous MoE layer's prefetch guessed for this
                                 layer, most likely first (the order prefetch tries them), or
                                 None when nothing guessed (the first layer)

A live engine records one when `MoeRuntime.trace` is a RoutingTrace: `ft serve --moe-trace
PATH` (or `LLM(moe_trace=PATH)`) records the traffic it serves, and bench/cache_policy.py
records a model with skewed routers. `synthetic_trace` draws one from a stated
distribution. freetoken.moe.replay runs either through the real cache under any policy and
size, and computes the offline optimum, so policies are compared on the same routing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path


@dataclasses.dataclass
class LayerRoute:
    layer: int
    experts: list[int]
    guess: list[int] | None = None


@dataclasses.dataclass
class Step:
    rows: int
    routes: list[LayerRoute] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RoutingTrace:
    layers: tuple[int, ...]
    num_experts: int
    top_k: int
    steps: list[Step] = dataclasses.field(default_factory=list)
    source: str = ""
    _step_id: object = dataclasses.field(default=None, repr=False, compare=False)

    def record(self, step_id, layer: int, experts: list[int], guess, rows: int) -> None:
        """Append one layer's routing; a new step_id starts a new step."""
        if step_id != self._step_id or not self.steps:
            self.steps.append(Step(rows))
            self._step_id = step_id
        self.steps[-1].routes.append(LayerRoute(layer, list(experts),
                                                None if guess is None else list(guess)))

    @property
    def num_tokens(self) -> int:
        return sum(s.rows for s in self.steps)

    def save(self, path) -> None:
        """Write as JSON; the file appears whole (written aside, then renamed)."""
        tmp = Path(f"{path}.partial")
        tmp.write_text(json.dumps({
            "layers": list(self.layers), "num_experts": self.num_experts, "top_k": self.top_k,
            "source": self.source,
            "steps": [{"rows": s.rows, "routes": [[r.layer, r.experts, r.guess] for r in s.routes]}
                      for s in self.steps]}))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path) -> "RoutingTrace":
        """Read what `save` wrote; anything else is a ValueError that names the file."""
        try:
            d = json.loads(Path(path).read_text())
            steps = [Step(s["rows"], [LayerRoute(l, e, g) for l, e, g in s["routes"]])
                     for s in d["steps"]]
            return cls(tuple(d["layers"]), d["num_experts"], d["top_k"], steps, d.get("source", ""))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path} is not a routing trace (written by `ft serve --moe-trace` "
                             f"or RoutingTrace.save): {type(e).__name__}: {e}") from None


def synthetic_trace(num_layers: int, num_experts: int, top_k: int, steps: int, batch: int = 1,
                    zipf: float = 1.0, repeat: float = 0.25, topic_every: int = 100,
                    topic_swaps: int = 8, guess_accuracy: float = 0.7,
                    seed: int = 0) -> RoutingTrace:
    """A skewed, temporally correlated routing trace, stated in full:
    - per layer, expert popularity is Zipf: p(rank r) ~ 1 / r**zipf over a random expert order;
    - each of a token's k picks repeats that token's pick of the step before with
      probability `repeat` (consecutive tokens route alike), else is drawn from the Zipf law;
    - every `topic_every` steps, `topic_swaps` random swaps of each layer's order move which
      experts are hot (a change of topic);
    - a layer's guess (from the layer before) holds each of the true picks with probability
      `guess_accuracy`, else a Zipf draw in its place."""
    rng = random.Random(seed)
    order = [rng.sample(range(num_experts), num_experts) for _ in range(num_layers)]
    weights = [1 / (r + 1) ** zipf for r in range(num_experts)]
    ranks = range(num_experts)
    prev = [[rng.sample(range(num_experts), top_k) for _ in range(num_layers)] for _ in range(batch)]
    trace = RoutingTrace(tuple(range(num_layers)), num_experts, top_k,
                         source=f"synthetic zipf={zipf} repeat={repeat} topic_every={topic_every} "
                                f"swaps={topic_swaps} guess_accuracy={guess_accuracy} batch={batch}")

    def draw(layer: int) -> int:
        return order[layer][rng.choices(ranks, weights)[0]]

    for t in range(steps):
        if t and topic_every and t % topic_every == 0:
            for o in order:
                for _ in range(topic_swaps):
                    i, j = rng.randrange(num_experts), rng.randrange(num_experts)
                    o[i], o[j] = o[j], o[i]
        for layer in range(num_layers):
            rows, guess = [], set()
            for b in range(batch):
                picks = []
                for j in range(top_k):
                    e = prev[b][layer][j] if rng.random() < repeat else None
                    while e is None or e in picks:
                        e = draw(layer)
                    picks.append(e)
                prev[b][layer] = picks
                rows.extend(picks)
                guess.update(e if rng.random() < guess_accuracy else draw(layer) for e in picks)
            counts = {e: rows.count(e) for e in set(rows)}
            experts = sorted(counts, key=lambda e: (-counts[e], e))
            trace.record(t, layer, experts, sorted(guess) if layer else None, batch)
    return trace


def check_trace_path(path) -> None:
    """Refuse up front a path a recording could not be written to at the end."""
    folder = Path(path).resolve().parent
    if Path(path).is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
        raise ValueError(f"moe_trace: cannot write {path} (it needs a file in an existing, "
                         f"writable folder)")
