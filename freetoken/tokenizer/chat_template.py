"""Chat templates: the Jinja environment and the rendering, in one place.

Checkpoints' templates are written for transformers' renderer, so this one matches it: a
sandboxed environment with trim_blocks and lstrip_blocks, the loopcontrols extension and a
no-op `{% generation %}` tag, a `tojson` that keeps non-ASCII text as is, `raise_exception`,
`strftime_now`, and a `namespace` that refuses underscore names. The inputs are prepared as
transformers prepares them: None-valued message keys are dropped (OpenAI clients send
`content: null`), and a message's reasoning under any of its names is also given as
`reasoning_content` and `thinking`. Tools are JSON-schema dicts, usually OpenAI's
`{"type": "function", "function": {...}}`, passed to the template unchanged.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    for inference it renders its body unchanged."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace minus underscore attributes, which would reach Python internals."""

    def __init__(*args, **kwargs):        # Jinja's own signature trick, so namespace(self=1) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's built-in escapes HTML characters and non-ASCII; prompts need the text verbatim.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without the type object itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """Compile once per template text; raises ValueError on a syntax error."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       namespace=_Namespace, dict=_Dict())
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse (line {e.lineno}): {e.message}") from None


def prepare_messages(messages) -> list[dict]:
    """Copies of the messages as the template should see them (see the module docstring)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of message dicts")
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise ValueError(f"each message must be a dict, got {type(m).__name__}")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render_chat(source: str, messages, *, tools=None, documents=None,
                add_generation_prompt: bool = False, **context) -> str:
    """Render a conversation; `context` is everything else the template may read (special
    token strings, enable_thinking, ...). Template errors become ValueError."""
    if tools is not None and (not isinstance(tools, (list, tuple))
                              or not all(isinstance(t, dict) for t in tools)):
        raise ValueError("tools must be a list of JSON-schema dicts, e.g. "
                         '{"type": "function", "function": {"name": ..., "parameters": ...}}')
    template = compile_template(source)
    try:
        return template.render(messages=prepare_messages(messages), tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **context)
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template failed: {e}") from None
    except (TypeError, KeyError, IndexError, AttributeError) as e:
        # A template meeting input it does not expect (a number where it adds strings, ...).
        raise ValueError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
