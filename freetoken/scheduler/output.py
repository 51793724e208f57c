"""Text out of a request: incremental detokenization and stop strings.

Stop strings must never be emitted partially, so the longest tail of the text that could
still grow into a stop string is held back until it either completes one (the request
stops, the text ends before it) or cannot anymore.
"""

from __future__ import annotations

from freetoken.engine.sampling_params import SamplingParams


class TextStream:
    def __init__(self, tokenizer, params: SamplingParams):
        from freetoken.tokenizer.detokenizer import IncrementalDetokenizer

        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.stops = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.text = ""       # all text decoded so far
        self.emitted = 0     # how much of it was handed out

    def add(self, token_id: int) -> tuple[str, str | None]:
        """Feed one token; returns (new text safe to emit, the stop string hit or None)."""
        self.text += self.detok.add([token_id])
        return self._emit(final=False)

    def finish(self) -> str:
        """The request ended for another reason: flush held-back text."""
        self.text += self.detok.flush()
        delta, _ = self._emit(final=True)
        return delta

    def _emit(self, final: bool) -> tuple[str, str | None]:
        if self.stops:
            # Only text that arrived (or was held back) since the last emit can start a stop.
            longest = max(len(s) for s in self.stops)
            search_from = max(0, self.emitted - longest + 1)
            hit, hit_at = None, len(self.text)
            for s in self.stops:
                i = self.text.find(s, search_from)
                if i != -1 and i < hit_at:
                    hit, hit_at = s, i
            if hit is not None:
                end = hit_at + (len(hit) if self.include_stop else 0)
                delta = self.text[self.emitted:end] if end > self.emitted else ""
                self.text, self.emitted = self.text[:end], end
                return delta, hit
            if not final:
                end = len(self.text) - self._held_tail()
                delta = self.text[self.emitted:end] if end > self.emitted else ""
                self.emitted = max(self.emitted, end)
                return delta, None
        delta = self.text[self.emitted:]
        self.emitted = len(self.text)
        return delta, None

    def _held_tail(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
