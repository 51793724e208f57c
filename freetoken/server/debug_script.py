"""DebugScript (tests only, FREETOKEN_DEBUG_SCRIPT): scripted model output for random weights.

The file is a JSON object {trigger: output text}. When the latest user-side turn of a chat
request (its trailing user or tool messages) contains a trigger, the engine is made to
produce that text, then EOS: its tokens are forced through the normal sampler path (every
other logit masked), so detokenization, stop strings, max_tokens, the reasoning and
tool-call parsers and every dialect's SSE run exactly as for a real model's output.

The text is written as the model would answer with thinking on, e.g.
"<think>\\nplan\\n</think>\\n\\nanswer". Like a real model, the script follows the prompt:
when the template (or the server) has already closed the think block, the thinking is left
out; when the prompt opened it, the opening marker is; text the server put at the start of
the answer (a forced tool call's header) is not repeated.
"""

from __future__ import annotations

import json
from pathlib import Path


class DebugScript:
    def __init__(self, entries: dict[str, str]):
        self.entries = entries

    @classmethod
    def load(cls, path: Path) -> "DebugScript":
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not all(isinstance(k, str) and k and isinstance(v, str)
                                                 for k, v in data.items()):
            raise ValueError(f"{path}: FREETOKEN_DEBUG_SCRIPT must hold a JSON object of "
                             f"non-empty trigger strings to output strings")
        return cls(data)

    def lookup(self, messages: list[dict]) -> str | None:
        """The scripted output for this conversation, or None (the model answers freely)."""
        latest = _latest_turn_text(messages)
        return next((out for trigger, out in self.entries.items() if trigger in latest), None)


def follow_prompt(text: str, meta, prompt: str, prefix: str) -> str:
    """The part of a scripted answer the model still has to write after `prompt` (the
    template's render) and `prefix` (what the server put at the start of the answer)."""
    if meta.harmony:     # the prefix is a message header: the script goes on after it
        head = prefix.strip()
        return text.split(head, 1)[1] if head and head in text else text
    if meta.reasoning:
        start, end = meta.think_start, meta.think_end
        body = text.lstrip()
        closed = meta.closes_reasoning(prompt) or end in prefix
        if (closed or meta.opens_reasoning(prompt)) and body.startswith(start):
            body = body[len(start):]
        if closed and end in body:
            body = body.split(end, 1)[1].lstrip()
        text = body
        prefix = prefix.split(end, 1)[1] if end in prefix else prefix
    prefix = prefix.lstrip()
    if prefix and text.lstrip().startswith(prefix):
        text = text.lstrip()[len(prefix):]
    return text


def _latest_turn_text(messages: list[dict]) -> str:
    texts = []
    for m in reversed(messages):
        if m.get("role") not in ("user", "tool"):
            break
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        texts.append(content if isinstance(content, str) else "")
    return "\n".join(reversed(texts))
