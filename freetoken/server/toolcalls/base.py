"""The engine every markup tool-call parser shares: text in, Events out, as the text streams.

A format subclass names the text that opens its markup (`openers`) and parses one block of
it, from its opener, into calls (`parse_block`), as far as the text goes. The block is
reparsed as text arrives (blocks are short; `str.find` does the scanning) and the engine
hands out the difference: a "tool_start" once a call's name is whole, "tool_args" fragments
as its arguments grow, "tool_end" when it closes. Arguments come in two shapes:

- JSON text (`Call.args`, as the model writes it): checked by JsonPrefix, so a client never
  receives invalid JSON; a call cut short is closed with the fewest characters that
  complete it;
- key-value pairs (`Call.params`, values already typed by the tool's schema): streamed as
  `{"k": v` then `, "k2": v2` ... then `}`, one parameter as it completes.

Markup that does not parse, or names an undeclared tool, before any call of its block went
out, is plain content, markup and all; after one went out, the calls so far are closed and
the rest is content. Text is held back only while it may still be the start of an opener.
"""

from __future__ import annotations

import dataclasses
import json

from freetoken.server.json_prefix import JsonPrefix
from freetoken.server.reasoning import partial_marker_len


@dataclasses.dataclass
class Event:
    kind: str            # reasoning | content | tool_start | tool_args | tool_end
    text: str = ""       # content, reasoning, or an arguments fragment
    index: int = 0       # the tool call's index
    name: str = ""       # tool_start: the function's name
    id: str = ""         # tool_start: the call's id (the format's own, or set by the Generation)


@dataclasses.dataclass
class Call:
    name: str
    start: int = 0                 # where the call's markup starts in the block
    args: str | None = None        # JSON formats: the argument text so far
    params: list | None = None     # key-value formats: [(key, typed value)] complete so far
    done: bool = False             # its closing marker was seen
    id: str = ""                   # the format's own call id (Kimi's functions.NAME:IDX)
    json_ends: bool = False        # no closing marker: the call ends with its JSON value
    args_at: int = 0               # json_ends: where `args` starts in the block


@dataclasses.dataclass
class Block:
    calls: list[Call]
    end: int | None = None         # the block closed: index just past its closing marker
    bad_at: int | None = None      # the markup stops being valid here


def content(out: list[Event], text: str) -> None:
    if not text:
        return
    if out and out[-1].kind == "content":
        out[-1].text += text
    else:
        out.append(Event("content", text))


class ArgStream:
    """One call's arguments on their way out (JSON text checked, or typed parameters)."""

    def __init__(self, index: int):
        self.index = index
        self.json = JsonPrefix()
        self.raw = ""          # JSON characters accepted
        self.skipped = 0       # whitespace dropped before the value
        self.fed = 0           # characters of Call.args consumed
        self.sent = 0
        self.num_params = 0

    def feed_json(self, out: list[Event], text: str) -> None:
        if not self.raw and not self.json.num_accepted:
            stripped = text.lstrip()
            self.skipped += len(text) - len(stripped)
            text = stripped
        j = self.json
        if text and not j.done and not j.failed:
            self.raw += text[:j.feed(text)]
            if j.done:       # whitespace after the value is not part of it
                self.raw = self.raw.rstrip()
        safe = min(j.safe_len, len(self.raw))
        if safe > self.sent:
            out.append(Event("tool_args", self.raw[self.sent:safe], index=self.index))
            self.sent = safe

    def feed_params(self, out: list[Event], params: list) -> None:
        for key, value in params[self.num_params:]:
            head = "{" if self.num_params == 0 else ", "
            out.append(Event("tool_args", head + json.dumps(key, ensure_ascii=False) + ": "
                             + json.dumps(value, ensure_ascii=False), index=self.index))
            self.num_params += 1

    def close(self, out: list[Event], kv: bool) -> None:
        if kv:
            tail = "}" if self.num_params else "{}"
        else:
            self.json.finish()
            self.feed_json(out, "")
            tail = self.json.closers() if self.raw else "{}"
        out.append(Event("tool_args", tail, index=self.index))
        out.append(Event("tool_end", index=self.index))


class MarkupToolParser:
    openers: tuple[str, ...] = ()
    at_start_only = False          # the markup counts only at the very start of the answer
    markers: tuple[str, ...] = ()  # every marker the format writes (special-token check)

    def __init__(self, tools=None):
        """tools: Chat Completions tool dicts (or bare names); None: any name is a call."""
        self.schemas: dict[str, dict] = {}
        names = None
        if tools is not None:
            names = set()
            for t in tools:
                fn = t.get("function", t) if isinstance(t, dict) else {"name": t}
                names.add(fn.get("name"))
                if isinstance(fn.get("parameters"), dict):
                    self.schemas[fn["name"]] = fn["parameters"]
        self.tool_names = names
        self.num_calls = 0
        self._state = "text"           # text | block
        self._buf = ""
        self._final = False
        self._segment_start = False    # drop layout whitespace right after a block
        self._fresh = True             # nothing handed out yet (at_start_only formats)
        self._opener = ""
        self._open: list[ArgStream] = []   # this block's calls handed out so far
        self._closed = 0                   # ... of which this many are closed

    # -- for subclasses -----------------------------------------------------------------
    def parse_block(self, buf: str, final: bool) -> Block:
        raise NotImplementedError

    def prop_schema(self, name: str, key: str) -> dict | None:
        props = self.schemas.get(name, {}).get("properties")
        prop = props.get(key) if isinstance(props, dict) else None
        return prop if isinstance(prop, dict) else None

    def forced_prefix(self, name: str | None) -> str:
        """The start of a call to `name` (None: any tool), put at the start of the answer for
        tool_choice required/named; "" where the format has no such prefix."""
        return ""

    # -- the stream ---------------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._buf += text
        self._run(out)
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        self._final = True
        self._run(out)
        if self._buf:   # held-back text is text after all; whitespace trailing a call is layout
            content(out, self._buf.rstrip() if self.num_calls else self._buf)
        self._buf = ""
        return out

    def _run(self, out: list[Event]) -> None:
        progress = True
        while progress and (self._buf or self._state == "block"):
            progress = self._in_text(out) if self._state == "text" else self._in_block(out)

    def _in_text(self, out: list[Event]) -> bool:
        if self._segment_start:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._segment_start = False
        if self.at_start_only:
            return self._at_start(out)
        i, opener = self._find_opener()
        if opener is None:
            if self._final:
                return False                     # finish() hands out the rest
            keep = partial_marker_len(self._buf, self.openers)
            rest = self._buf[:len(self._buf) - keep]
            keep += len(rest) - len(rest.rstrip())      # layout whitespace before a call
            content(out, self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        content(out, self._buf[:i].rstrip())
        self._buf, self._opener, self._state = self._buf[i:], opener, "block"
        return True

    def _at_start(self, out: list[Event]) -> bool:
        if not self._fresh:
            content(out, self._buf)
            self._buf = ""
            return False
        stripped = self._buf.lstrip()
        opener = next((o for o in self.openers if stripped.startswith(o)), None)
        if opener is not None:
            self._buf, self._opener, self._state = stripped, opener, "block"
            return True
        if not self._final and (not stripped or any(o.startswith(stripped) for o in self.openers)):
            return False
        self._fresh = False
        return True

    def _find_opener(self) -> tuple[int, str | None]:
        best, found = -1, None
        for o in self.openers:
            i = self._buf.find(o)
            if i >= 0 and (best < 0 or i < best):
                best, found = i, o
        return best, found

    def _in_block(self, out: list[Event]) -> bool:
        blk = self.parse_block(self._buf, self._final)
        calls, bad_at = blk.calls, blk.bad_at
        for k, c in enumerate(calls):
            if k >= len(self._open) and (not c.name or (self.tool_names is not None
                                                        and c.name not in self.tool_names)):
                calls, bad_at = calls[:k], c.start
                break
        if not self._open and not calls and (bad_at is not None or self._final or blk.end is not None):
            # Not a call after all: the opener is plain text, and what follows is scanned again.
            content(out, self._opener)
            self._buf, self._state = self._buf[len(self._opener):], "text"
            self._fresh = False
            return True
        self._fresh = False
        json_end = None
        for k, c in enumerate(calls):
            json_end = self._emit(out, k, c)
            if json_end is not None:
                break
        if json_end is not None:
            return self._end_block(json_end)
        if bad_at is not None or self._final:
            self._close_open(out, calls)
            self._buf = self._buf[bad_at:] if bad_at is not None else ""
            self._state, self._open, self._closed = "text", [], 0
            return bool(self._buf)
        if blk.end is not None:
            self._close_open(out, calls)
            return self._end_block(blk.end)
        return False

    def _end_block(self, end: int) -> bool:
        self._buf = self._buf[end:]
        self._state, self._segment_start, self._open, self._closed = "text", True, [], 0
        return True

    def _emit(self, out: list[Event], k: int, c: Call) -> int | None:
        """Hand out call k's news; for a call that ends with its JSON value, the block index
        where that value ended, once it has."""
        if k == len(self._open):
            self._open.append(ArgStream(self.num_calls))
            self.num_calls += 1
            out.append(Event("tool_start", index=self._open[k].index, name=c.name, id=c.id))
        a = self._open[k]
        if k < self._closed:
            return None
        if c.params is not None:
            a.feed_params(out, c.params)
        elif c.args is not None:
            a.feed_json(out, c.args[a.fed:])
            a.fed = len(c.args)
            if c.json_ends and a.json.done:
                a.close(out, kv=False)
                self._closed = k + 1
                return c.args_at + a.skipped + len(a.raw)
        if c.done:
            a.close(out, kv=c.params is not None)
            self._closed = k + 1
        return None

    def _close_open(self, out: list[Event], calls: list[Call]) -> None:
        for k in range(self._closed, len(self._open)):
            self._open[k].close(out, kv=k < len(calls) and calls[k].params is not None)
        self._closed = len(self._open)


# -- shared scanning helpers ----------------------------------------------------------------
_WS = " \t\r\n"


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def could_be(s: str, i: int, *markers: str) -> bool:
    """s[i:] is a (proper or whole) prefix of one of the markers: more text may complete it."""
    rest = s[i:]
    return any(m.startswith(rest) for m in markers)


def until(s: str, i: int, marker: str, final: bool) -> tuple[int, bool]:
    """(j, found): the marker starts at j; or, not found, s[i:j] is the text before what may
    be the start of it (at the end of the output, a cut-off marker is dropped)."""
    j = s.find(marker, i)
    if j >= 0:
        return j, True
    return len(s) - partial_marker_len(s[i:], (marker,)), False


def typed_value(raw: str, prop: dict | None):
    """A parameter's text as the type its JSON schema gives (text where it cannot be)."""
    kind = prop.get("type") if prop else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    text = raw.strip()
    if kind in (None, "string"):
        return raw
    if text == "null":
        return None
    try:
        if kind == "integer":
            return int(text)
        if kind == "number":
            value = float(text)
            return int(value) if value.is_integer() and "." not in text and "e" not in text.lower() else value
        if kind == "boolean":
            if text.lower() in ("true", "false"):
                return text.lower() == "true"
            return raw
        return json.loads(text)   # object, array
    except ValueError:
        return raw
