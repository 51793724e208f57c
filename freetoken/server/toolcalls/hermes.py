"""Tool calls: the Hermes/Qwen `<tool_call>{json}</tool_call>` format parsed as it streams.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The parser is fed the answer text (reasoning already split off) in any pieces and returns
Events: "content" text, and for each call "tool_start" (its index and name), "tool_args"
fragments and "tool_end". A call starts once its header `{"name": "...", "arguments": {`
has parsed and the name is one of the declared tools; from then on the arguments stream as
the model writes them, checked by JsonPrefix so a client never receives invalid JSON: a
call cut short (max_tokens, malformed text, `</tool_call>` too early) is closed with the
fewest characters that complete it. A block whose header does not parse, or names an
undeclared tool, is plain content, tags and all: never an error.
"""

from __future__ import annotations

import json

from freetoken.server.json_prefix import JsonPrefix
from freetoken.server.reasoning import partial_marker_len
from freetoken.server.toolcalls.base import Event, content as _content

_WS = " \t\r\n"
# The header, token by token; None is the name string.
_HEADER = (("{",), ('"name"',), (":",), None, (",",), ('"arguments"', '"parameters"'), (":",), ("{",))


def match_header(s: str) -> tuple[str, str | None, int]:
    """("ok", name, end) when s starts with a whole header, ("partial", None, 0) while it may
    still become one, ("fail", None, 0) once it cannot."""
    i, name = 0, None
    for options in _HEADER:
        while i < len(s) and s[i] in _WS:
            i += 1
        if i == len(s):
            return "partial", None, 0
        if options is None:
            end = _string_end(s, i)
            if end == -2:
                return "fail", None, 0
            if end == -1:
                return "partial", None, 0
            try:
                name = json.loads(s[i:end])
            except ValueError:
                return "fail", None, 0
            i = end
            continue
        for opt in options:
            if s.startswith(opt, i):
                i += len(opt)
                break
        else:
            rest = s[i:]
            return ("partial", None, 0) if any(opt.startswith(rest) for opt in options) else ("fail", None, 0)
    return "ok", name, i


def _string_end(s: str, i: int) -> int:
    """Index after the JSON string starting at s[i]; -1 if it is unfinished, -2 if none starts."""
    if s[i] != '"':
        return -2
    j = i + 1
    while j < len(s):
        if s[j] == "\\":
            j += 2
            continue
        if s[j] == '"':
            return j + 1
        j += 1
    return -1


class HermesToolParser:
    start, end = "<tool_call>", "</tool_call>"
    markers = (start, end)

    def __init__(self, tools=None):
        """tools: Chat Completions tool dicts or bare names; None: any name is a call."""
        self.tool_names = None if tools is None else {
            (t.get("function", t).get("name") if isinstance(t, dict) else t) for t in tools}
        self.num_calls = 0
        self._state = "text"           # text | header | args
        self._buf = ""
        self._segment_start = False    # drop whitespace right after a call
        self._json: JsonPrefix | None = None   # the open call's arguments, checked
        self._args = ""                # ... the characters accepted so far
        self._sent = 0                 # ... how many of them were handed out

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._buf += text
        progress = True
        while progress and self._buf:
            progress = getattr(self, f"_in_{self._state}")(out)
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._state == "header":
            _content(out, self.start + self._buf)
        elif self._state == "args":
            self._in_args(out, final=True)
        else:   # held-back text is text after all; whitespace trailing a call is layout
            _content(out, self._buf.rstrip() if self.num_calls else self._buf)
        self._buf, self._state = "", "text"
        return out

    def forced_prefix(self, name: str | None) -> str:
        """The header up to the arguments' "{" for a named tool, else up to the name."""
        if name is None:
            return '<tool_call>\n{"name": "'
        return '<tool_call>\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": {'

    # -- states: each consumes what it can and says whether to go on ----------------------
    def _in_text(self, out: list[Event]) -> bool:
        if self._segment_start:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._segment_start = False
        i = self._buf.find(self.start)
        if i < 0:
            keep = partial_marker_len(self._buf, (self.start,))
            rest = self._buf[:len(self._buf) - keep]
            keep += len(rest) - len(rest.rstrip())      # layout whitespace before a call
            _content(out, self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        _content(out, self._buf[:i].rstrip())
        self._buf = self._buf[i + len(self.start):]
        self._state = "header"
        return True

    def _in_header(self, out: list[Event]) -> bool:
        end = self._buf.find(self.end)
        status, name, n = match_header(self._buf if end < 0 else self._buf[:end])
        if status == "ok" and (self.tool_names is None or name in self.tool_names) and name:
            self._open_call(out, name)
            self._buf = self._buf[n:]
            self._state = "args"
            return True
        if status == "partial" and end < 0:
            return False
        # Not a call after all: the block is plain text (its closing tag, if any, included).
        _content(out, self.start)
        self._state = "text"
        return True

    def _in_args(self, out: list[Event], final: bool = False) -> bool:
        end = self._buf.find(self.end)
        if end < 0 and not final:
            keep = partial_marker_len(self._buf, (self.end,))
            self._consume_args(out, self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._consume_args(out, self._buf if end < 0 else self._buf[:end])
        self._close_call(out)
        self._buf = "" if end < 0 else self._buf[end + len(self.end):]
        self._state, self._segment_start = "text", True
        return True

    # -- the open call's arguments ---------------------------------------------------------
    def _open_call(self, out: list[Event], name: str) -> None:
        out.append(Event("tool_start", index=self.num_calls, name=name))
        self._json, self._args, self._sent = JsonPrefix(), "", 0
        self._consume_args(out, "{")

    def _consume_args(self, out: list[Event], text: str) -> None:
        """Check argument text and hand out what became safe; text after the value (the
        header's closing "}") or after an invalid character is dropped."""
        j = self._json
        if text and not j.done and not j.failed:
            self._args += text[:j.feed(text)]
        if j.safe_len > self._sent:
            out.append(Event("tool_args", self._args[self._sent:j.safe_len], index=self.num_calls))
            self._sent = j.safe_len

    def _close_call(self, out: list[Event]) -> None:
        self._json.finish()
        self._consume_args(out, "")
        tail = self._json.closers()
        if tail:
            out.append(Event("tool_args", tail, index=self.num_calls))
        out.append(Event("tool_end", index=self.num_calls))
        self.num_calls += 1
        self._json, self._args, self._sent = None, "", 0
