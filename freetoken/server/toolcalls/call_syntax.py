"""Tool calls written as function-call syntax rather than markup around JSON:

llama4_pythonic  [get_weather(city="Paris", days=3), search(q='x')] as the whole answer
                 (optionally inside <|python_start|>...<|python_end|>): Python literals, keyword
                 arguments only
gemma4           <|tool_call>call:NAME{key:<|"|>text<|"|>,n:3,flag:true,xs:[1,2],o:{k:v}}<tool_call|>:
                 bare keys, strings quoted by the <|"|> token, JSON-like scalars otherwise

Arguments go out one parameter at a time, as each value completes.
"""

from __future__ import annotations

import ast
import json
import re

from freetoken.server.toolcalls.base import Block, Call, MarkupToolParser, could_be, skip_ws

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")


class _Partial(Exception):
    """The text ends inside the value."""


class _Bad(Exception):
    """The text is not this syntax."""


class Llama4PythonicToolParser(MarkupToolParser):
    openers = ("[", "<|python_start|>")
    at_start_only = True
    markers = ("<|python_start|>", "<|python_end|>")

    _memo: tuple[str, Block] | None = None

    def parse_block(self, s: str, final: bool) -> Block:
        # A call can only complete at a ")" or "]": until one arrives, the last parse stands
        # (the paren scan is Python, and a long argument is reparsed on every token otherwise).
        memo = self._memo
        if memo is not None and not final and s.startswith(memo[0]) and \
                not any(c in s[len(memo[0]):] for c in ")]"):
            return memo[1]
        self._in_call = False
        blk = self._parse(s, final)
        self._memo = (s, blk) if self._in_call else None
        return blk

    def _parse(self, s: str, final: bool) -> Block:
        i = len(self._opener)
        if self._opener != "[":
            i = skip_ws(s, i)
            if i == len(s):
                return Block([], bad_at=0 if final else None)
            if s[i] != "[":
                return Block([], bad_at=0)
            i += 1
        calls: list[Call] = []
        while True:
            i = skip_ws(s, i)
            if i == len(s):
                return Block(calls, bad_at=0 if final and not calls else None)
            if s[i] == "]" and (calls or True):
                end = skip_ws(s, i + 1)
                if self._opener != "[":
                    if s.startswith("<|python_end|>", end):
                        end += len("<|python_end|>")
                    elif could_be(s, end, "<|python_end|>") and not final:
                        return Block(calls)
                return Block(calls, end=end) if calls else Block([], bad_at=0)
            if calls:
                if s[i] != ",":
                    return Block(calls, bad_at=i)
                i = skip_ws(s, i + 1)
                if i == len(s):
                    return Block(calls)
            m = _IDENT.match(s, i)
            if m is None or m.end() == len(s):
                return Block(calls, bad_at=i if m is None or final else None)
            j = skip_ws(s, m.end())
            if j == len(s):
                return Block(calls, bad_at=i if final else None)
            if s[j] != "(":
                return Block(calls, bad_at=i)
            close = _matching_paren(s, j)
            if close < 0:
                self._in_call = close == -1 and not final
                return Block(calls, bad_at=i if final or close == -2 else None)
            params = _keywords(s[i:close + 1])
            if params is None:
                return Block(calls, bad_at=i)
            calls.append(Call(m.group(), start=i, params=params, done=True))
            i = close + 1


def _matching_paren(s: str, i: int) -> int:
    """Index of the ")" closing the "(" at s[i]; -1 if the text ends first, -2 if unbalanced."""
    depth, quote, j = 0, "", i
    while j < len(s):
        c = s[j]
        if quote:
            if c == "\\":
                j += 1
            elif s.startswith(quote, j):
                j += len(quote) - 1
                quote = ""
        elif c in "\"'":
            quote = s[j:j + 3] if s[j:j + 3] in ('"""', "'''") else c
            j += len(quote) - 1
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return j if c == ")" else -2
        j += 1
    return -1


def _keywords(text: str) -> list | None:
    try:
        node = ast.parse(text, mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            return None
        return [(kw.arg, _literal(kw.value)) for kw in node.keywords if kw.arg]
    except (SyntaxError, ValueError, TypeError):
        return None


def _literal(node):
    value = ast.literal_eval(node)
    json.dumps(value)    # sets, bytes, complex: not JSON (TypeError)
    return value


# -- Gemma 4 -------------------------------------------------------------------------------
_Q = '<|"|>'


class Gemma4ToolParser(MarkupToolParser):
    openers = ("<|tool_call>",)
    markers = ("<|tool_call>", "<tool_call|>", _Q)

    def parse_block(self, s: str, final: bool) -> Block:
        i = len(self._opener)
        if not s.startswith("call:", i):
            return Block([], bad_at=None if could_be(s, i, "call:") and not final else 0)
        i += 5
        b = s.find("{", i)
        if b < 0:
            pending = _IDENT.fullmatch(s[i:]) is not None or i == len(s)
            return Block([], bad_at=None if pending and not final else 0)
        name = s[i:b].strip()
        if not _IDENT.fullmatch(name):
            return Block([], bad_at=0)
        call = Call(name, params=[])
        i = b + 1
        try:
            while True:
                i = skip_ws(s, i)
                if i == len(s):
                    raise _Partial
                if s[i] == "}":
                    i = skip_ws(s, i + 1)
                    call.done = True
                    if s.startswith("<tool_call|>", i):
                        return Block([call], end=i + len("<tool_call|>"))
                    if could_be(s, i, "<tool_call|>") and not final:
                        call.done = False
                        return Block([call])
                    return Block([call], end=i)
                if call.params:
                    if s[i] != ",":
                        raise _Bad
                    i = skip_ws(s, i + 1)
                key, i = _gkey(s, i)
                i = skip_ws(s, i)
                if i == len(s):
                    raise _Partial
                if s[i] != ":":
                    raise _Bad
                value, i = _gvalue(s, skip_ws(s, i + 1))
                if i == len(s) and not isinstance(value, (str, dict, list)):
                    raise _Partial      # a number may go on
                call.params.append((key, value))
        except _Partial:
            return Block([call])
        except _Bad:
            return Block([call], bad_at=i)


def _gkey(s: str, i: int) -> tuple[str, int]:
    if s.startswith(_Q, i):
        j = s.find(_Q, i + len(_Q))
        if j < 0:
            raise _Partial
        return s[i + len(_Q):j], j + len(_Q)
    m = re.compile(r"[A-Za-z0-9_\-.$]+").match(s, i)
    if m is None:
        if could_be(s, i, _Q):
            raise _Partial
        raise _Bad
    if m.end() == len(s):
        raise _Partial
    return m.group(), m.end()


_SCALAR = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")


def _gvalue(s: str, i: int):
    if i >= len(s):
        raise _Partial
    if s.startswith(_Q, i):
        j = s.find(_Q, i + len(_Q))
        if j < 0:
            raise _Partial
        return s[i + len(_Q):j], j + len(_Q)
    if could_be(s, i, _Q):
        raise _Partial
    c = s[i]
    if c == '"':
        try:
            return json.JSONDecoder().raw_decode(s, i)
        except ValueError:
            raise _Partial if '"' not in s[i + 1:] else _Bad from None
    if c in "{[":
        close = "}" if c == "{" else "]"
        out = {} if c == "{" else []
        i = skip_ws(s, i + 1)
        while True:
            if i >= len(s):
                raise _Partial
            if s[i] == close:
                return out, i + 1
            if out:
                if s[i] != ",":
                    raise _Bad
                i = skip_ws(s, i + 1)
            if c == "{":
                key, i = _gkey(s, i)
                i = skip_ws(s, i)
                if i >= len(s):
                    raise _Partial
                if s[i] != ":":
                    raise _Bad
                value, i = _gvalue(s, skip_ws(s, i + 1))
                out[key] = value
            else:
                value, i = _gvalue(s, i)
                out.append(value)
            i = skip_ws(s, i)
    m = _SCALAR.match(s, i)
    if m is not None and re.fullmatch(r"[\d.eE+\-a-z]*", s[m.end():]):
        raise _Partial        # the text ends where the scalar may still go on
    if m is None:
        if re.fullmatch(r"-?[\d.eE+-]*|t(r(ue?)?)?|f(a(l(se?)?)?)?|n(u(ll?)?)?", s[i:]):
            raise _Partial
        raise _Bad
    return json.loads(m.group()), m.end()
