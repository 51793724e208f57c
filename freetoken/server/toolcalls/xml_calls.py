"""Tool calls written as XML-like elements, one element per parameter, values typed by the
tool's JSON schema (a string parameter is the text as written; others parse as JSON):

qwen3_coder   <tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n</tool_call>
glm45         <tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>
glm47         the same without the newlines: <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>
minimax_m2    <minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="K">V</parameter>\\n</invoke>\\n</minimax:tool_call>
deepseek_v32  <｜DSML｜function_calls> (DeepSeek-V4: <｜DSML｜tool_calls>) holding
              <｜DSML｜invoke name="NAME"><｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter></｜DSML｜invoke>,
              where string="true" means text as is and "false" a JSON value.
"""

from __future__ import annotations

import json
import re

from freetoken.server.toolcalls.base import (Block, Call, MarkupToolParser, could_be, skip_ws,
                                             typed_value, until)

_NAME = re.compile(r"[A-Za-z0-9_.\-:/]+\Z")
_GLM_NAME_END = re.compile(r"[^<\n]*")


class _Invokes(MarkupToolParser):
    """Shared by the formats whose calls are elements with parameter elements inside:
    [section open] (call open NAME call-head-end (param open KEY-HEAD > VALUE param close)*
    call close)* [section close]."""
    section: tuple[str, str] | None = None     # the block's own open/close markers, if any
    call_open = call_head_end = call_close = ""
    param_open = param_close = ""
    trim_newline = False                       # the template writes "\nV\n" inside parameters

    def parse_block(self, s: str, final: bool) -> Block:
        calls: list[Call] = []
        i = len(self._opener)
        while True:
            i = skip_ws(s, i)
            if self.section is not None and s.startswith(self.section[1], i):
                return Block(calls, end=i + len(self.section[1]))
            if self.section is None and calls:
                return Block(calls, end=i)
            if s.startswith(self.call_open, i):
                call, i, status = self._call(s, i, final)
                if call is not None:
                    calls.append(call)
                if status == "bad":
                    return Block(calls, bad_at=i)
                if status == "open":
                    return Block(calls)
                continue
            if i == len(s) or could_be(s, i, self.call_open, *(self.section or ())):
                return Block(calls)
            return Block(calls, bad_at=i)

    def _call(self, s: str, start: int, final: bool) -> tuple[Call | None, int, str]:
        """(the call so far or None, where parsing stopped, "done" | "open" | "bad")."""
        i = start + len(self.call_open)
        j = s.find(self.call_head_end, i)
        if j < 0:
            unfinished = not final and "<" not in s[i:] and "\n" not in s[i:]
            return None, start, "open" if unfinished else "bad"
        name = s[i:j].strip()
        if not _NAME.match(name):
            return None, start, "bad"
        call = Call(name, start=start, params=[])
        i = j + len(self.call_head_end)
        while True:
            i = skip_ws(s, i)
            if s.startswith(self.call_close, i):
                i += len(self.call_close)
                if self.section is None:       # the wrapper's own closing tag follows
                    i = skip_ws(s, i)
                    if s.startswith(self.closing, i):
                        i += len(self.closing)
                    elif could_be(s, i, self.closing) and not final:
                        return call, i, "open"
                call.done = True
                return call, i, "done"
            if s.startswith(self.param_open, i):
                head_end = s.find(">", i + len(self.param_open))
                if head_end < 0:
                    return call, i, "open"
                key, as_text = self.param_head(s[i + len(self.param_open):head_end])
                v0 = head_end + 1
                v1, found = until(s, v0, self.param_close, final)
                if not found and not final:
                    return call, i, "open"
                raw = s[v0:v1]
                if self.trim_newline:
                    raw = raw.removeprefix("\n").removesuffix("\n")
                call.params.append((key, self.value(call.name, key, raw, as_text)))
                i = v1 + len(self.param_close) if found else v1
                continue
            if i == len(s) or could_be(s, i, self.call_close, self.param_open):
                return call, i, "open"
            return call, i, "bad"     # stray text inside the call: it ends here

    closing = ""   # per-call formats: the wrapper's closing tag after the call's own

    def param_head(self, head: str) -> tuple[str, bool | None]:
        """The key (and, for DSML, whether the value is text) from a parameter's open tag."""
        return head.strip(), None

    def value(self, name: str, key: str, raw: str, as_text: bool | None):
        if as_text is True:
            return raw
        if as_text is False:
            try:
                return json.loads(raw)
            except ValueError:
                return raw
        return typed_value(raw, self.prop_schema(name, key))


class Qwen3CoderToolParser(_Invokes):
    openers = ("<tool_call>",)
    call_open, call_head_end, call_close = "<function=", ">", "</function>"
    param_open, param_close = "<parameter=", "</parameter>"
    closing = "</tool_call>"
    trim_newline = True
    markers = ("<tool_call>", "</tool_call>", "<function=", "<parameter=")

    def forced_prefix(self, name):
        return "<tool_call>\n<function=" + (name + ">\n" if name else "")


class MiniMaxM2ToolParser(_Invokes):
    openers = ("<minimax:tool_call>",)
    section = ("<minimax:tool_call>", "</minimax:tool_call>")
    call_open, call_head_end, call_close = '<invoke name="', '">', "</invoke>"
    param_open, param_close = '<parameter name="', "</parameter>"
    markers = ("<minimax:tool_call>", "</minimax:tool_call>")

    def param_head(self, head):
        return head.removesuffix('"').strip(), None

    def forced_prefix(self, name):
        return '<minimax:tool_call>\n<invoke name="' + (name + '">\n' if name else "")


class DeepSeekV32ToolParser(_Invokes):
    openers = ("<｜DSML｜function_calls>", "<｜DSML｜tool_calls>")
    call_open, call_head_end, call_close = '<｜DSML｜invoke name="', '">', "</｜DSML｜invoke>"
    param_open, param_close = '<｜DSML｜parameter name="', "</｜DSML｜parameter>"
    markers = ("<｜DSML｜",)

    @property
    def section(self):
        return self._opener, "</" + self._opener[1:]

    def param_head(self, head):
        m = re.match(r'\s*([^"]*)"(?:\s+string="(true|false)")?\s*\Z', head)
        if m is None:
            return head.split('"')[0].strip(), None
        return m.group(1), None if m.group(2) is None else m.group(2) == "true"

    def forced_prefix(self, name):
        return "<｜DSML｜function_calls>\n" + ('<｜DSML｜invoke name="' + name + '">\n' if name else "")


class Glm45ToolParser(MarkupToolParser):
    """<tool_call>NAME then <arg_key>K</arg_key> <arg_value>V</arg_value> pairs, then
    </tool_call>: one call per block, newlines between the elements optional (GLM-4.7 writes
    none). A value is text for a string parameter, else JSON (the template's tojson)."""
    openers = ("<tool_call>",)
    markers = ("<tool_call>", "</tool_call>", "<arg_key>", "<arg_value>")
    newline = "\n"

    def parse_block(self, s: str, final: bool) -> Block:
        i = len(self._opener)
        j = _GLM_NAME_END.match(s, i).end()
        if j == len(s):
            return Block([], bad_at=0 if final else None)
        name = s[i:j].strip()
        if not _NAME.match(name):
            return Block([], bad_at=0)
        call = Call(name, params=[])
        i = j
        while True:
            i = skip_ws(s, i)
            if s.startswith("</tool_call>", i):
                call.done = True
                return Block([call], end=i + len("</tool_call>"))
            if not s.startswith("<arg_key>", i):
                if i < len(s) and not could_be(s, i, "</tool_call>", "<arg_key>"):
                    return Block([call], bad_at=i)
                return Block([call])
            k1, found = until(s, i + 9, "</arg_key>", final)
            if not found:
                return Block([call])
            v = skip_ws(s, k1 + 10)
            if not s.startswith("<arg_value>", v):
                if v < len(s) and not could_be(s, v, "<arg_value>"):
                    return Block([call], bad_at=v)
                return Block([call])
            v1, found = until(s, v + 11, "</arg_value>", final)
            if not found and not final:
                return Block([call])
            key = s[i + 9:k1].strip()
            call.params.append((key, typed_value(s[v + 11:v1], self.prop_schema(name, key))))
            i = v1 + 12 if found else v1

    def forced_prefix(self, name):
        return "<tool_call>" + (name + self.newline if name else "")


class Glm47ToolParser(Glm45ToolParser):
    newline = ""
