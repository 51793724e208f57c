"""Tool calls whose arguments are one JSON object between markers, streamed as written:

deepseek_v3   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
deepseek_v31  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
kimi_k2       <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>
              (the call's id is functions.NAME:IDX, which Kimi's template writes back)
mistral       [TOOL_CALLS]NAME[ARGS]{...} (optionally [CALL_ID]id before [ARGS]), once per call,
              with no closing marker: the call ends with its JSON value; and the older
              [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] list, taken whole.
"""

from __future__ import annotations

import json
import re

from freetoken.server.toolcalls.base import Block, Call, MarkupToolParser, could_be, skip_ws, until

_NAME = re.compile(r"[A-Za-z0-9_.\-:/]+\Z")


class _Sectioned(MarkupToolParser):
    """[section open] (call open HEAD sep ARGS call close)* section close."""
    section_close = ""
    call_open = call_sep = call_close = ""

    def parse_block(self, s: str, final: bool) -> Block:
        calls: list[Call] = []
        i = len(self._opener)
        while True:
            i = skip_ws(s, i)
            if s.startswith(self.section_close, i):
                return Block(calls, end=i + len(self.section_close))
            if not s.startswith(self.call_open, i):
                if i == len(s) or could_be(s, i, self.section_close, self.call_open):
                    return Block(calls)
                return Block(calls, bad_at=i)
            start, h = i, i + len(self.call_open)
            sep, found = until(s, h, self.call_sep, final)
            if not found:
                return Block(calls, bad_at=None if not final and "<" not in s[h:sep] else start)
            head = self.head(s, h, sep)
            if head is None:
                if not final and self.head_unfinished(s, h, sep):
                    return Block(calls)
                return Block(calls, bad_at=start)
            name, call_id, a0 = head
            if not _NAME.match(name):
                return Block(calls, bad_at=start)
            a1, found = until(s, a0, self.call_close, final)
            calls.append(Call(name, start=start, args=s[a0:a1], done=found, id=call_id))
            if not found:
                return Block(calls)
            i = a1 + len(self.call_close)

    def head(self, s: str, h: int, sep: int) -> tuple[str, str, int] | None:
        """(name, the format's call id or "", where the arguments start) from the text
        between the call's open marker and its separator (at sep)."""
        return s[h:sep].strip(), "", sep + len(self.call_sep)

    def head_unfinished(self, s: str, h: int, sep: int) -> bool:
        return False


class DeepSeekV31ToolParser(_Sectioned):
    openers = ("<｜tool▁calls▁begin｜>",)
    section_close = "<｜tool▁calls▁end｜>"
    call_open, call_sep, call_close = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    markers = (*openers, section_close, call_open, call_sep, call_close)

    def forced_prefix(self, name):
        return self.openers[0] + self.call_open + (name + self.call_sep if name else "")


class DeepSeekV3ToolParser(DeepSeekV31ToolParser):
    """The type ("function") comes before the separator; the name after it, on its own line,
    then the arguments in a ```json fence."""
    _FENCE = re.compile(r"[^\n<]*\n\s*```(?:json)?[ \t]*(?:\n|(?=[{\[]))")

    def head(self, s, h, sep):
        n0 = sep + len(self.call_sep)
        m = self._FENCE.match(s, n0)
        if m is None:
            return None
        return s[n0:m.end()].split("\n", 1)[0].strip(), "", m.end()

    def head_unfinished(self, s, h, sep):
        rest = s[sep + len(self.call_sep):]
        line, nl, after = rest.partition("\n")
        return "<" not in line and (not nl or "```json\n".startswith(after.lstrip(" \t")[:8]))

    def forced_prefix(self, name):
        return self.openers[0] + self.call_open + "function" + self.call_sep + \
            (name + "\n```json\n" if name else "")


class KimiK2ToolParser(_Sectioned):
    openers = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
    call_open, call_sep, call_close = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
    markers = (*openers, call_open, call_sep, call_close)

    @property
    def section_close(self):
        return self._opener.replace("_begin|>", "_end|>")

    def head(self, s, h, sep):
        call_id = s[h:sep].strip()
        m = re.match(r"(?:functions\.)?(.+?)(?::\d+)?\Z", call_id)
        return (m.group(1), call_id, sep + len(self.call_sep)) if m else None

    def forced_prefix(self, name):
        return self.openers[0] + self.call_open + ("functions." + name + ":" if name else "functions.")


class MistralToolParser(MarkupToolParser):
    openers = ("[TOOL_CALLS]",)
    markers = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")

    def parse_block(self, s: str, final: bool) -> Block:
        i = skip_ws(s, len(self._opener))
        if i == len(s):
            return Block([], bad_at=0 if final else None)
        if s[i] == "[" and not could_be(s, i, "[ARGS]", "[CALL_ID]"):
            return self._json_list(s, i, final)
        a = s.find("[ARGS]", i)
        c = s.find("[CALL_ID]", i)
        head_end = min(x for x in (a, c, len(s)) if x >= 0)
        name = s[i:head_end].strip()
        if head_end == len(s):
            ok = not final and ("[" not in name or could_be(name, name.index("["), "[ARGS]", "[CALL_ID]"))
            return Block([], bad_at=None if ok else 0)
        if not _NAME.match(name):
            return Block([], bad_at=0)
        call_id = ""
        if head_end == c:
            if a < 0:
                return Block([], bad_at=0 if final else None)
            call_id = s[c + len("[CALL_ID]"):a].strip()
        a0 = a + len("[ARGS]")
        nxt = s.find("[TOOL_CALLS]", a0)
        a1 = nxt if nxt >= 0 else len(s)
        return Block([Call(name, args=s[a0:a1], id=call_id, json_ends=True, args_at=a0,
                           done=nxt >= 0)], end=a1 if nxt >= 0 else None)

    def _json_list(self, s: str, i: int, final: bool) -> Block:
        """The older form, taken whole once the list parses."""
        try:
            value, end = json.JSONDecoder().raw_decode(s, i)
        except ValueError:
            return Block([], bad_at=0 if final else None)
        if not isinstance(value, list) or not value or not all(
                isinstance(v, dict) and isinstance(v.get("name"), str) for v in value):
            return Block([], bad_at=0)
        calls = []
        for v in value:
            args = v.get("arguments", v.get("parameters", {}))
            text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            calls.append(Call(v["name"], args=text, done=True, id=str(v.get("id") or "")))
        return Block(calls, end=end)

    def forced_prefix(self, name):
        return "[TOOL_CALLS]" + (name + "[ARGS]" if name else "")
