"""StepBudget: prefill chunks sized so a step stays under a time budget.

A running stream waits one step for each token, so a step that carries a long prefill chunk
is the gap every other stream sees. The cost of a step is modelled as

    t = a + b * tokens + c * pairs,      pairs = sum over chunks of n * (start + (n + 1) / 2)

`a` what the step pays whatever its length (a decode's worth of kernels; with experts off the
card, streaming every uncached expert over PCIe, which any prefill chunk needs), `b` the cost
per token (projections, experts), `c` per query-key pair attended (a chunk at position 12,000
costs several times one at 0 on a CPU). Fitted by non-negative least squares over the last
few steps that carried a prefill chunk; a plan then takes, chunk by chunk, the most tokens
whose predicted cost keeps the step under the budget.

Guards, each against a failure seen on a 2-core CPU:
- before any step is seen a chunk is MIN_CHUNK, and a step grows at most 2x the last one
  seen: a wrong fit costs one step of twice the budget, not a first chunk of 2048 tokens
  (2.8 s of silence for every stream on an AVX2 box);
- over steps of lengths less than 1.5x apart the intercept is noise: `a` is kept from the
  last wider spread (0 before any);
- when `a` alone exceeds the budget a shorter chunk saves nothing per step and multiplies
  the steps, so the chunks are the longest;
- a step's first prefill chunk gets at least MIN_CHUNK (progress), and when steps of only
  that length run over the budget the next one probes twice as long, which separates a
  fixed cost from a per-token one.
"""

from __future__ import annotations

import collections
import itertools
from typing import Iterable, Protocol

import numpy as np

MIN_CHUNK = 256      # below this a chunk's fixed costs dominate even on a CPU
WINDOW = 8           # steps the fit looks back on: enough to follow a context that grows
WIDE = 1.5           # lengths this far apart tell a fixed cost from a per-token one
PAIRS_UNIT = 1e6     # pairs are counted in millions, so the three columns are of one scale


class Chunk(Protocol):
    num_tokens: int
    start: int           # tokens of the request already in the cache when the chunk runs


def pairs(n: int, start: int) -> float:
    """Query-key pairs a chunk of n tokens at `start` attends (causal within the chunk)."""
    return n * (start + (n + 1) / 2) / PAIRS_UNIT


def nnls(x: np.ndarray, y: np.ndarray, columns: list[int]) -> np.ndarray:
    """Non-negative least squares over a few columns, by trying each subset of them: the
    fewest that fit best, with fewer columns than points, so a fit is a measurement and not
    an interpolation (two steps are fitted by one cost, not solved for two)."""
    most = max(1, min(len(columns), len(y) - 1))
    best, best_err = np.zeros(x.shape[1]), np.inf
    for k in range(1, most + 1):
        for cols in itertools.combinations(columns, k):
            coef, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if (coef < 0).any():
                continue
            err = float(((x[:, cols] @ coef - y) ** 2).sum())
            if err < best_err * (1 - 1e-6) - 1e-12:      # a column more must fit better
                best = np.zeros(x.shape[1])
                best[list(cols)] = coef
                best_err = err
    return best


class StepBudget:
    def __init__(self, budget_s: float, max_tokens: int):
        self.budget_s, self.max_tokens = budget_s, max_tokens
        self.floor = min(MIN_CHUNK, max_tokens)
        self._seen: collections.deque[tuple[int, float, float]] = collections.deque(maxlen=WINDOW)
        self._coef = (0.0, 0.0, 0.0)         # (a, b, c)
        self._a_wide: float | None = None    # `a` as the last wide spread of lengths gave it
        self._cap = self.floor               # the most tokens the next step may carry
        self._least = self.floor             # the least its first prefill chunk gets

    # -- what the steps cost ---------------------------------------------------------------
    def observe(self, chunks: Iterable[Chunk], seconds: float) -> None:
        """A step that computed `chunks` (a prefill chunk among them) took seconds."""
        chunks = list(chunks)
        n = sum(c.num_tokens for c in chunks)
        if n < 2:
            return
        self._seen.append((n, sum(pairs(c.num_tokens, c.start) for c in chunks), seconds))
        self._coef = self._fit()
        # At the floor and over the budget, with no wide spread ever seen: probe 2x.
        probe = self._a_wide is None and seconds > self.budget_s
        self._least = min(2 * self.floor, self.max_tokens) if probe else self.floor
        self._cap = min(self.max_tokens, max(2 * n, self._least))

    def _fit(self) -> tuple[float, float, float]:
        x = np.array([[1.0, n, p] for n, p, _ in self._seen])
        y = np.array([t for _, _, t in self._seen])
        ns = x[:, 1]
        if ns.max() >= WIDE * ns.min():
            a, b, c = (float(v) for v in nnls(x, y, [0, 1, 2]))
            self._a_wide = a
            return a, b, c
        # Over a narrow spread the intercept is noise: keep the one a wide spread gave (0
        # before any), and fit the rest on what is left of each step's time.
        a = self._a_wide or 0.0
        _, b, c = nnls(x, y - a, [1, 2])
        return a, float(b), float(c)

    def describe(self) -> dict:
        """The fitted step cost, for /v1/instrumentation."""
        a, b, c = self._coef
        return {"fixed_s": round(a, 6), "per_token_s": round(b, 9),
                "per_million_pairs_s": round(c, 6), "max_step_tokens": self._cap,
                "steps_fitted": len(self._seen)}

    # -- one step's plan -------------------------------------------------------------------
    def plan(self) -> "StepPlan":
        return StepPlan(self)


class StepPlan:
    """Takes tokens for one step's chunks, in scheduling order, against the budget."""

    def __init__(self, budget: StepBudget):
        self.budget = budget
        a, self.b, self.c = budget._coef
        self.unbounded = bool(budget._seen) and a >= budget.budget_s
        self.spent = a
        self.tokens = 0
        self.prefilled = False

    def take(self, want: int, start: int) -> int:
        """How many of `want` tokens at `start` this step computes (0: none fit). A decode
        (want == 1) always runs: the budget sizes prefill chunks, never drops a stream."""
        budget = self.budget
        if want == 1 or self.unbounded:
            n = want
        else:
            n = min(want, budget._cap - self.tokens, self._fits(start))
            if not self.prefilled:           # progress: the first chunk gets at least this
                n = max(n, min(want, budget._least))
            n = max(n, 0)
            self.prefilled = self.prefilled or n > 0
        self.spent += self.b * n + self.c * pairs(n, start)
        self.tokens += n
        return n

    def _fits(self, start: int) -> int:
        """The most tokens at `start` whose predicted cost fits what is left of the budget."""
        left = self.budget.budget_s - self.spent
        if left <= 0:
            return 0
        # b n + c (n start + n (n + 1) / 2) / U <= left: a quadratic in n.
        q = self.c / (2 * PAIRS_UNIT)
        lin = self.b + self.c * (start + 0.5) / PAIRS_UNIT
        if q <= 0:
            return int(left / lin) if lin > 0 else self.budget.max_tokens
        return int((-lin + (lin * lin + 4 * q * left) ** 0.5) / (2 * q))
