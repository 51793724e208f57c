"""JsonPrefix: checks JSON text as it streams in, and knows how to close what is still open.

A tool call's arguments are streamed while the model writes them, so they are checked one
character at a time: `feed` accepts the longest valid prefix, `safe_len` is how much of it
may go out now (never half a number, half an escape, or a comma whose next item has not
started), and `closers()` is the text that turns exactly that much into a complete JSON value.
So what a client has received, plus closers(), always parses, whether the model finished
the value, wrote something malformed, or ran out of tokens.
"""

from __future__ import annotations

import re

_WS = " \t\r\n"
_HEX = frozenset("0123456789abcdefABCDEF")
_SCALAR_CHARS = frozenset("0123456789+-.eEtrufalsn")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_LITERALS = ("true", "false", "null")


class JsonPrefix:
    def __init__(self):
        self.stack: list[str] = []     # open containers, "{" or "["
        self.expect = "value"          # value | value_or_close | key | key_or_close | colon | comma_or_close | done
        self.in_string = False
        self.is_key = False            # the open string is an object key
        self.escaped = False
        self.hex_left = 0              # \uXXXX digits still to come
        self.scalar = ""               # a number or literal being read
        self.after_comma = False       # held: the item after a comma has not started
        self.failed = False
        self.num_accepted = 0
        self.safe_len = 0
        self._safe_state = ((), "value", False, False)

    @property
    def done(self) -> bool:
        return self.expect == "done" and not self.scalar

    def feed(self, text: str) -> int:
        """Accept characters until the value is complete or one is invalid; returns how many
        of `text` were accepted (the rest is not part of the value)."""
        for i, c in enumerate(text):
            if self.failed:
                return i
            if self.scalar and c not in _SCALAR_CHARS:
                if not self._end_scalar():     # e.g. "1e" or "tru" followed by "}"
                    self.failed = True
                    return i
                self._mark_safe()
            if not self._step(c):
                self.failed = self.expect != "done"
                return i
            self.num_accepted += 1
            self._mark_safe()
        return len(text)

    def finish(self) -> None:
        """The text ended: a trailing top-level number is complete now."""
        if self.scalar and not self.stack and self._end_scalar():
            self._mark_safe()

    def closers(self) -> str:
        """What completes the safe prefix into valid JSON ("" once the value is whole)."""
        stack, expect, in_string, is_key = self._safe_state
        out = ""
        if in_string:
            out += '"' + (": null" if is_key else "")
        elif expect == "colon":
            out += ": null"
        elif expect == "value":
            out += "null"
        return out + "".join("}" if c == "{" else "]" for c in reversed(stack))

    # -- one character ------------------------------------------------------------------
    def _mark_safe(self) -> None:
        if not (self.scalar or self.escaped or self.hex_left or self.after_comma):
            self.safe_len = self.num_accepted
            self._safe_state = (tuple(self.stack), self.expect, self.in_string, self.is_key)

    def _step(self, c: str) -> bool:
        if self.in_string:
            return self._string_char(c)
        if self.scalar:     # feed() ended it if c cannot continue it
            self.scalar += c
            return self._scalar_may_continue()
        if c in _WS:
            return self.expect != "done" or not self.stack
        self.after_comma = False
        e = self.expect
        if e in ("value", "value_or_close"):
            if e == "value_or_close" and c == "]":
                return self._close()
            return self._start_value(c)
        if e in ("key", "key_or_close"):
            if e == "key_or_close" and c == "}":
                return self._close()
            if c != '"':
                return False
            self.in_string, self.is_key = True, True
            return True
        if e == "colon":
            if c != ":":
                return False
            self.expect = "value"
            return True
        if e == "comma_or_close":
            top = self.stack[-1]
            if c == ",":
                self.expect, self.after_comma = ("key" if top == "{" else "value"), True
                return True
            return c == ("}" if top == "{" else "]") and self._close()
        return False   # done: nothing may follow the value but whitespace

    def _string_char(self, c: str) -> bool:
        if self.hex_left:
            self.hex_left -= 1
            return c in _HEX
        if self.escaped:
            self.escaped = False
            if c == "u":
                self.hex_left = 4
                return True
            return c in '"\\/bfnrt'
        if c == "\\":
            self.escaped = True
        elif c == '"':
            self.in_string = False
            if self.is_key:
                self.is_key, self.expect = False, "colon"
            else:
                self._value_done()
        elif c < " ":
            return False   # control characters must be escaped inside strings
        return True

    def _start_value(self, c: str) -> bool:
        if c in "{[":
            self.stack.append(c)
            self.expect = "key_or_close" if c == "{" else "value_or_close"
        elif c == '"':
            self.in_string, self.is_key = True, False
        elif c in "-0123456789tfn":
            self.scalar = c
        else:
            return False
        return True

    def _scalar_may_continue(self) -> bool:
        s = self.scalar
        if s[0] in "tfn":
            return any(lit.startswith(s) for lit in _LITERALS)
        return all(ch in "0123456789+-.eE" for ch in s)

    def _end_scalar(self) -> bool:
        s, self.scalar = self.scalar, ""
        if s in _LITERALS or _NUMBER.fullmatch(s):
            self._value_done()
            return True
        return False

    def _close(self) -> bool:
        self.stack.pop()
        self._value_done()
        return True

    def _value_done(self) -> None:
        self.expect = "comma_or_close" if self.stack else "done"
