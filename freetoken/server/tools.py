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

import dataclasses
import json

from freetoken.server.errors import HTTPError
from freetoken.server.json_prefix import JsonPrefix
from freetoken.server.reasoning import partial_marker_len

_WS = " \t\r\n"
# The header, token by token; None is the name string.
_HEADER = (("{",), ('"name"',), (":",), None, (",",), ('"arguments"', '"parameters"'), (":",), ("{",))


@dataclasses.dataclass
class Event:
    kind: str            # reasoning | content | tool_start | tool_args | tool_end
    text: str = ""       # content, reasoning, or an arguments fragment
    index: int = 0       # the tool call's index
    name: str = ""       # tool_start: the function's name
    id: str = ""         # tool_start: the call's id (set by the Generation)


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

    def __init__(self, tool_names=None):
        self.tool_names = set(tool_names) if tool_names is not None else None
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


def _content(out: list[Event], text: str) -> None:
    if not text:
        return
    if out and out[-1].kind == "content":
        out[-1].text += text
    else:
        out.append(Event("content", text))


# -- tool definitions and tool_choice, as every dialect hands them over ---------------------
def check_tools(tools, param: str = "tools") -> list[dict] | None:
    """Chat Completions' tool list, checked: [{"type": "function", "function": {"name", ...}}]."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad(param, f"'{param}' must be a list of tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise _bad(f"{param}[{i}]", 'each tool must be {"type": "function", "function": {...}}')
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"{param}[{i}].function.name", "each function needs a non-empty 'name'")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise _bad(f"{param}[{i}].function.parameters", "'parameters' must be a JSON schema object")
    return tools or None


def check_tool_choice(choice, tools: list[dict] | None, param: str = "tool_choice"):
    """"auto" | "none" | "required" | {"name": fn}; a named or required choice needs tools."""
    names = [t["function"]["name"] for t in tools or ()]
    if choice in ("auto", "none"):
        return choice
    if choice == "required" or isinstance(choice, dict):
        if not names:
            raise _bad(param, f"'{param}' requires tools; none were given")
        if isinstance(choice, dict) and choice.get("name") not in names:
            raise _bad(param, f"'{param}' names {choice.get('name')!r}, which is not one of the tools "
                              f"({', '.join(names)})")
        return choice
    raise _bad(param, f"'{param}' must be auto, none, required or a named function")


def _bad(param: str, message: str) -> HTTPError:
    return HTTPError(400, message, type="invalid_request_error", param=param)
