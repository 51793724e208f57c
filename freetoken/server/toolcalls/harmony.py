"""gpt-oss's Harmony format: the whole answer is a run of messages, each a header and a body.

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>

(the prompt ends with `<|start|>assistant`; the recipient may also sit in the role part of the
header: `<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>`). The
analysis channel is reasoning, final (and commentary without a recipient, a preamble) is
content, and a message to `functions.NAME` is a tool call whose body is its JSON arguments.
<|call|> and <|return|> are stop tokens, so a stream usually ends inside the last message
without its closing marker: that message, a call included, is complete at the end of the
output. Text that is not Harmony at all is content. Every marker is a special token in
gpt-oss's tokenizer: the server decodes with special tokens kept so the parser sees them.
"""

from __future__ import annotations

import re

from freetoken.server.reasoning import partial_marker_len
from freetoken.server.toolcalls.base import ArgStream, Event, content

_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
_HEADER_TOKENS = ("<|start|>", "<|channel|>", "<|constrain|>", "<|message|>")
_MAX_HEADER = 400            # a "header" this long with no <|message|> is not one


class HarmonyParser:
    markers = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|call|>", "<|constrain|>")

    def __init__(self, tools=None, reasoning: bool = True, prompt: str = ""):
        self.tool_names = None if tools is None else {
            (t.get("function", t).get("name") if isinstance(t, dict) else t) for t in tools}
        self.calls_enabled = tools is not None
        self.reasoning = reasoning
        self.num_calls = 0
        self._buf = ""
        self._kind = None            # the open message's body: reasoning | content | tool | None (header)
        self._args: ArgStream | None = None
        self._lead = True            # drop whitespace at the start of a body
        tail = prompt[prompt.rfind("<|start|>"):] if "<|start|>" in prompt else ""
        if tail.endswith("<|message|>"):     # the prompt opened a message: its body comes first
            self._open_body([], tail[:-len("<|message|>")])

    @property
    def in_reasoning(self) -> bool:
        return self._kind == "reasoning"

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._buf += text
        while self._buf and (self._header(out, False) if self._kind is None else self._body(out, False)):
            pass
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        while self._buf and (self._header(out, True) if self._kind is None else self._body(out, True)):
            pass
        if self._kind is not None:
            self._close(out)
        elif not self._buf.lstrip().startswith("<|"):
            content(out, self._buf)          # plain text; a header cut short is dropped
        self._buf = ""
        return out

    def forced_prefix(self, name: str | None) -> str:
        return "<|channel|>commentary to=functions." + (name + " <|constrain|>json<|message|>" if name else "")

    # -- header: <|start|>assistant [to=R] <|channel|>C [to=R] [<|constrain|>json] <|message|>
    def _header(self, out: list[Event], final: bool) -> bool:
        s = self._buf
        lead = s.lstrip()
        if not lead.startswith("<|") and not (not final and "<|".startswith(lead)):
            self._kind, self._lead = "content", False     # not Harmony: plain content
            return True
        k = s.find("<|message|>")
        if k < 0:
            if len(s) > _MAX_HEADER:      # markup-looking text, but no header: content
                content(out, s)
                self._buf = ""
            return False
        self._buf = s[k + len("<|message|>"):]
        self._open_body(out, s[:k])
        return True

    def _open_body(self, out: list[Event], header: str) -> None:
        channel = re.search(r"<\|channel\|>\s*(\w+)", header)
        recipient = re.search(r"\bto=([^\s<]+)", header)
        channel = channel.group(1) if channel else "final"
        self._lead = True
        if recipient and recipient.group(1).startswith("functions."):
            name = recipient.group(1)[len("functions."):]
            if self.calls_enabled and (self.tool_names is None or name in self.tool_names):
                self._kind = "tool"
                self._args = ArgStream(self.num_calls)
                self.num_calls += 1
                out.append(Event("tool_start", index=self._args.index, name=name))
                return
        if channel == "analysis" and not recipient:
            self._kind = "reasoning" if self.reasoning else "content"
        else:
            self._kind = "content"

    # -- body, up to the marker that ends the message --------------------------------------
    def _body(self, out: list[Event], final: bool) -> bool:
        s = self._buf
        if self._lead:
            s = self._buf = s.lstrip()
            if not s:
                return False
            self._lead = False
        i = min((j for j in (s.find(m) for m in _ENDS) if j >= 0), default=-1)
        if i < 0:
            keep = 0 if final else partial_marker_len(s, _ENDS)
            self._text(out, s[:len(s) - keep])
            self._buf = s[len(s) - keep:]
            return final and bool(self._buf)
        self._text(out, s[:i])
        self._close(out)
        marker = next(m for m in _ENDS if s.startswith(m, i))
        self._buf = s[i + (0 if marker == "<|start|>" else len(marker)):]
        return True

    def _text(self, out: list[Event], text: str) -> None:
        if not text:
            return
        if self._kind == "tool":
            self._args.feed_json(out, text)
        elif self._kind == "reasoning":
            if out and out[-1].kind == "reasoning":
                out[-1].text += text
            else:
                out.append(Event("reasoning", text))
        else:
            content(out, text)

    def _close(self, out: list[Event]) -> None:
        if self._kind == "tool":
            self._args.close(out, kv=False)
            self._args = None
        self._kind = None
