"""ReasoningParser: split a model's thinking from its answer as the text streams out.

The thinking sits between a start and an end marker (`<think>` ... `</think>` for Qwen3).
The parser is fed text in whatever pieces detokenization produces and hands back
("reasoning", text) and ("content", text) pieces as soon as they are certain:

- a marker split across pieces still parses: a tail that might be the start of a marker is
  held back until it is one or cannot become one;
- a prompt that opened the think block (`<think>\\n` at the end of the generation prompt)
  starts the parser inside the reasoning;
- whitespace right after a marker and right before an end marker is layout, not text
  (`<think>\\nthoughts\\n</think>\\n\\nanswer` gives "thoughts" and "answer");
- a stray marker (an end with no start, a start inside the reasoning) is dropped, so the
  content never contains the markers.
"""

from __future__ import annotations


def partial_marker_len(text: str, markers) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


def append_piece(out: list[tuple[str, str]], kind: str, text: str) -> None:
    """Add (kind, text) to out, merged into the last piece when it is of the same kind."""
    if not text:
        return
    if out and out[-1][0] == kind:
        out[-1] = (kind, out[-1][1] + text)
    else:
        out.append((kind, text))


class ReasoningParser:
    def __init__(self, start: str, end: str, in_reasoning: bool = False):
        if not start or not end:
            raise ValueError("reasoning markers must be non-empty strings")
        self.start, self.end = start, end
        self.in_reasoning = in_reasoning
        self._buf = ""
        self._segment_start = True     # leading whitespace of this segment is still dropped

    @property
    def kind(self) -> str:
        return "reasoning" if self.in_reasoning else "content"

    def feed(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self._buf += text
        while self._buf:
            if self._segment_start:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                self._segment_start = False
            i, marker = self._next_marker()
            if marker is None:
                keep = self._held_len()
                append_piece(out, self.kind, self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            before = self._buf[:i]
            switches = marker == (self.end if self.in_reasoning else self.start)
            append_piece(out, self.kind, before.rstrip() if switches and self.in_reasoning else before)
            self._buf = self._buf[i + len(marker):]
            if switches:
                self.in_reasoning = not self.in_reasoning
                self._segment_start = True
        return out

    def finish(self) -> list[tuple[str, str]]:
        """The output ended: what was held back is text after all."""
        out: list[tuple[str, str]] = []
        append_piece(out, self.kind, self._buf)
        self._buf = ""
        return out

    def _next_marker(self) -> tuple[int, str | None]:
        i, j = self._buf.find(self.start), self._buf.find(self.end)
        if i < 0 and j < 0:
            return -1, None
        if j < 0 or 0 <= i < j:
            return i, self.start
        return j, self.end

    def _held_len(self) -> int:
        keep = partial_marker_len(self._buf, (self.start, self.end))
        if self.in_reasoning:   # whitespace that may turn out to precede the end marker
            rest = self._buf[:len(self._buf) - keep]
            keep += len(rest) - len(rest.rstrip())
        return keep
