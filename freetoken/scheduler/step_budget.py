"""StepBudget: prefill chunks sized so a step stays under a time budget.

A running stream waits one step for each token, so a step that carries a long prefill chunk
is the gap every other stream sees. The cost of a step is about a + b * tokens: `a` what
the step pays whatever its length (a decode's worth of kernels; with experts off the card,
streaming every uncached expert over PCIe, which any prefill chunk needs), `b` the cost per
token (which grows with the context a chunk attends to). Fitted by least squares over the
last few steps that carried a prefill chunk, the chunk is the most tokens with a + b * n <=
budget, within [MIN_CHUNK, max_prefill_length]. When `a` alone exceeds the budget a shorter
chunk would save nothing per step and multiply the steps, so the chunk is the longest.
"""

from __future__ import annotations

import collections

MIN_CHUNK = 256      # below this a chunk's fixed costs dominate even on a CPU
WINDOW = 8           # steps the fit looks back on: enough to follow a context that grows


class StepBudget:
    def __init__(self, budget_s: float, max_tokens: int):
        self.budget_s, self.max_tokens = budget_s, max_tokens
        self._seen: collections.deque[tuple[int, float]] = collections.deque(maxlen=WINDOW)
        self.chunk = max_tokens          # what the next step may compute

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step that computed num_tokens (a prefill chunk among them) took seconds."""
        if num_tokens < 2:
            return
        self._seen.append((num_tokens, seconds))
        self.chunk = self._size()

    def _size(self) -> int:
        a, b = self._fit()
        if a >= self.budget_s:
            n = self.max_tokens
        else:
            n = int((self.budget_s - a) / b)
        # Grow at most 2x a step: a wrong fit costs one step of twice the budget, not ten.
        n = min(n, 2 * self.chunk, self.max_tokens)
        return max(n, min(MIN_CHUNK, self.max_tokens))

    def _fit(self) -> tuple[float, float]:
        """(a, b) of t = a + b * n by least squares over steps of lengths at least 2x apart;
        over a narrower spread the intercept is noise, and the cost is taken as per token."""
        xs = [n for n, _ in self._seen]
        ys = [t for _, t in self._seen]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        if max(xs) >= 2 * min(xs):
            var = sum((x - mx) ** 2 for x in xs)
            b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
            if b > 0:
                return max(my - b * mx, 0.0), b
        return 0.0, my / mx
