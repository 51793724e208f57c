"""Structured outputs as every dialect asks for them, turned into one StructuredOutputs.

Accepted: OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema",
"json_schema": {"name", "schema", "strict"}}) on chat and completions; vLLM's `structured_outputs`
({"json" | "json_object" | "regex" | "choice" | "grammar"}) and its older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`; the Responses API's `text.format`
({"type": "json_schema", "name", "schema"} | {"type": "json_object"}); and function tools with
`"strict": true` in the Hermes `<tool_call>` format, where the grammar covers the whole call.
The engine compiles the constraint (engine/grammar.py); where it starts depends on the
model's reasoning (`place`): after the think block the prompt opened, or, where the model opens
one itself, after that block if its first token opens it.
"""

from __future__ import annotations

import dataclasses
import json

from freetoken.engine.sampling_params import StructuredOutputs
from freetoken.server.errors import HTTPError

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_VLLM_KEYS = ("json", "json_object", "regex", "choice", "grammar")


def _bad(param: str, message: str) -> HTTPError:
    return HTTPError(400, message, type="invalid_request_error", param=param)


def from_body(body: dict) -> StructuredOutputs | None:
    """Chat Completions' and Completions' constraint fields (at most one of them)."""
    found = []
    rf = body.get("response_format")
    if rf is not None:
        spec = response_format(rf)
        if spec is not None:
            found.append(spec)
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("structured_outputs", "'structured_outputs' must be an object")
        given = {k: so[k] for k in _VLLM_KEYS if so.get(k) not in (None, False)}
        unknown = sorted(set(so) - set(_VLLM_KEYS) - {"disable_any_whitespace", "disable_additional_properties",
                                                       "whitespace_pattern", "structural_tag"})
        if unknown or so.get("structural_tag") is not None:
            raise _bad("structured_outputs", f"'structured_outputs' accepts {', '.join(_VLLM_KEYS)}; "
                                             f"got {', '.join(unknown) or 'structural_tag'}")
        found.append(_spec(given, "structured_outputs"))
    for name, key in _GUIDED.items():
        if body.get(name) is not None:
            found.append(_spec({key: body[name]}, name))
    if len(found) > 1:
        raise _bad(found[1].param, f"give one constraint: {found[0].param} and {found[1].param} were both set")
    return found[0] if found else None


def _spec(fields: dict, param: str) -> StructuredOutputs:
    for key, value in fields.items():
        ok = {"json": (dict, str, bool), "json_object": (bool,), "regex": (str,), "choice": (list,),
              "grammar": (str,)}[key]
        if not isinstance(value, ok) or (key == "choice" and not all(isinstance(c, str) for c in value)):
            raise _bad(param, f"'{param}' {key} has the wrong type ({type(value).__name__})")
    try:
        return StructuredOutputs(**fields, param=param)
    except ValueError as e:
        raise _bad(param, str(e)) from None


def response_format(rf) -> StructuredOutputs | None:
    if not isinstance(rf, dict):
        raise _bad("response_format", "'response_format' must be an object")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True, param="response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise _bad("response_format.json_schema", "'json_schema' must be an object with a 'schema'")
        return _schema(js.get("schema"), "response_format.json_schema.schema")
    raise _bad("response_format.type", f"'response_format.type' must be text, json_object or json_schema; "
                                       f"got {kind!r}")


def from_text_format(fmt: dict) -> StructuredOutputs | None:
    """The Responses API's text.format."""
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True, param="text.format")
    if kind == "json_schema":
        return _schema(fmt.get("schema"), "text.format.schema")
    raise _bad("text.format.type", f"'text.format.type' must be text, json_object or json_schema; got {kind!r}")


def _schema(schema, param: str) -> StructuredOutputs:
    if schema is None:
        return StructuredOutputs(json_object=True, param=param)   # OpenAI: no schema, any JSON object
    if not isinstance(schema, dict):
        raise _bad(param, f"'{param}' must be a JSON schema object")
    return StructuredOutputs(json=schema, param=param)


# -- tool calls ------------------------------------------------------------------------------
def tool_call_grammar(tools: list[dict], tool_choice, tokenizer, forced: bool) -> StructuredOutputs | None:
    """A grammar for Hermes tool calls when some offered tool is strict: the whole
    `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` when the call is forced
    (tool_choice required or named), else the rest of each call after the model opens one."""
    offered = [t["function"] for t in tools]
    if isinstance(tool_choice, dict):
        offered = [f for f in offered if f["name"] == tool_choice["name"]]
    if not any(f.get("strict") for f in offered):
        return None
    start, end = (_marker(tokenizer, m) for m in ("<tool_call>", "</tool_call>"))
    calls = []
    for i, f in enumerate(offered):
        schema = f.get("parameters") if f.get("strict") else None
        schema = schema if isinstance(schema, dict) and schema else {"type": "object"}
        header = _lark_str('\n{"name": ' + json.dumps(f["name"], ensure_ascii=False) + ', "arguments": ')
        calls.append((f"call{i}: {header} args{i} {_lark_str('}' + chr(10))} {end}",
                      f"args{i}: %json {json.dumps(schema)}"))
    body = " | ".join(f"call{i}" for i in range(len(calls)))
    rules = "\n".join(line for pair in calls for line in pair)
    if forced:
        lark = f"start: {start} ({body})\n{rules}"
        spec = StructuredOutputs(grammar=lark, param="tools")
    else:
        spec = StructuredOutputs(grammar=f"start: {body}\n{rules}", param="tools",
                                 after="<tool_call>", rearm=True)
    return spec


def _marker(tokenizer, text: str) -> str:
    """A marker in Lark: by token id when the tokenizer has it as one added token (llguidance
    matches added tokens by id, never by their text), else as text."""
    ids = tokenizer.encode(text)
    if len(ids) == 1 and tokenizer.id_to_token(ids[0]) == text:
        return f"<[{ids[0]}]>"
    return _lark_str(text)


def _lark_str(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def place(spec: StructuredOutputs, meta, prompt_text: str, prefix: str) -> StructuredOutputs:
    """Where the constraint starts, given the model's reasoning markers and the prompt."""
    if not meta.reasoning or spec.after is not None:
        return spec
    rendered = prompt_text + prefix
    if meta.closes_reasoning(rendered) or (prefix and meta.think_end in prefix):
        return spec
    if meta.opens_reasoning(rendered):
        return dataclasses.replace(spec, after=meta.think_end)
    return dataclasses.replace(spec, think_block=(meta.think_start, meta.think_end))
