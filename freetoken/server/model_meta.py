"""Model families' chat conventions, in one table, and what they resolve to for the served model.

For each family: how its chat template turns thinking on and off (a template variable and
its on/off values; none for always-on families), whether its template grades effort, its
tool-call format, and its reasoning markers. At startup the served model's family is found
from config.json's model_type and checked against its chat template, which has the last
word: a toggle or effort variable the template never reads is not offered, and markers the
template never mentions mean the model does not reason in that format.

`reasoning_effort` (Chat Completions), `reasoning.effort` (Responses) and `thinking.type`
(Messages) all become one effort value here, with vLLM's semantics: "none" turns thinking
off through the family's toggle; any other value turns it on and, for templates that grade
effort, is passed as `reasoning_effort`; the client's own chat_template_kwargs always win;
no effort leaves the template's default.
"""

from __future__ import annotations

import dataclasses
import re

from freetoken.server.toolcalls import TOOL_PARSER_CHOICES, canonical_tool_parser

# OpenAI's effort values; any of them is accepted, "none" turns thinking off.
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
EFFORT_KWARG = "reasoning_effort"


@dataclasses.dataclass(frozen=True)
class Reasoner:
    """A reasoning format: its markers, and how its templates switch thinking."""
    name: str
    think_start: str
    think_end: str
    detect: str                        # text in a chat template that says the model writes it
    toggle: str | None = None          # template variable turning thinking on/off; None: always on
    toggle_on: object = True
    toggle_off: object = False


REASONERS: dict[str, Reasoner] = {r.name: r for r in (
    Reasoner("qwen3", "<think>", "</think>", "</think>", toggle="enable_thinking"),
    Reasoner("glm45", "<think>", "</think>", "</think>", toggle="enable_thinking"),
    Reasoner("deepseek_r1", "<think>", "</think>", "</think>"),
    Reasoner("deepseek_v3", "<think>", "</think>", "</think>", toggle="thinking"),
    Reasoner("kimi_k2", "<think>", "</think>", "</think>", toggle="thinking"),
    Reasoner("minimax_m2", "<think>", "</think>", "</think>"),
    Reasoner("minimax_m3", "<mm:think>", "</mm:think>", "</mm:think>", toggle="thinking_mode",
             toggle_on="enabled", toggle_off="disabled"),
    Reasoner("mistral", "[THINK]", "[/THINK]", "[/THINK]"),
    Reasoner("gemma4", "<|channel>thought", "<channel|>", "<channel|>", toggle="enable_thinking"),
    # Harmony: the analysis channel is the reasoning (toolcalls/harmony.py parses it).
    Reasoner("gpt_oss", "<|channel|>analysis<|message|>", "<|end|>", "<|channel|>"),
)}
REASONER_ALIASES = {"glm": "glm45", "openai": "gpt_oss", "minimax": "minimax_m2"}


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    reasoner: str | None = None        # REASONERS name; None: the family does not reason
    tool_format: str | None = None     # the toolcalls parser name


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("qwen3", ("qwen3", "qwen3_moe", "qwen3_next", "qwen3_vl_moe", "qwen3_5_moe",
                     "qwen3_5_moe_text"), "qwen3", "hermes"),
    Family("glm", ("glm4_moe", "glm4_moe_lite", "glm4", "glm4v_moe"), "glm45", "glm45"),
    Family("gemma4", ("gemma4", "gemma4_text"), "gemma4", "gemma4"),
    Family("gpt_oss", ("gpt_oss",), "gpt_oss", "gpt_oss"),
    Family("deepseek", ("deepseek_v3", "deepseek_v32", "deepseek_v4"), "deepseek_r1", "deepseek_v3"),
    Family("kimi_k2", ("kimi_k2", "kimi_k25"), "kimi_k2", "kimi_k2"),
    Family("minimax_m2", ("minimax_m2",), "minimax_m2", "minimax_m2"),
    Family("minimax_m3", ("minimax_m3",), "minimax_m3", "minimax_m2"),
    Family("llama4", ("llama4", "llama4_text"), None, "llama4_pythonic"),
    Family("qwen2", ("qwen2", "qwen2_moe"), None, "hermes"),
    Family("mistral", ("mixtral", "mistral", "mistral3", "ministral3"), "mistral", "mistral"),
)}
PARSER_CHOICES = ("auto", "off", *REASONERS, *REASONER_ALIASES)

# Markers in a chat template that name the tool-call format, most specific first.
_TOOL_MARKERS = (
    ("<｜DSML｜", "deepseek_v32"),
    ("<｜tool▁sep｜>", "deepseek_v31"),
    ("<|tool_calls_section_begin|>", "kimi_k2"),
    ("<minimax:tool_call>", "minimax_m2"),
    ("<|tool_call>", "gemma4"),
    ("<parameter=", "qwen3_coder"),
    ("<arg_key>", "glm45"),
    ("to=functions.", "gpt_oss"),
    ("<|channel|>", "gpt_oss"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_start|>", "llama4_pythonic"),
    ("<tool_call>", "hermes"),
)
# The reasoner a <think> template means, by the tool format it also writes.
_THINK_BY_TOOLS = {"deepseek_v3": "deepseek_r1", "deepseek_v31": "deepseek_v3", "deepseek_v32": "deepseek_v3",
                   "kimi_k2": "kimi_k2", "minimax_m2": "minimax_m2", "glm45": "glm45", "glm47": "glm45"}


def detect_tool_format(template: str) -> str | None:
    name = next((fmt for marker, fmt in _TOOL_MARKERS if marker in template), None)
    if name == "glm45" and not re.search(r"(\\n|\n)<arg_key>", template):
        return "glm47"     # GLM-4.7 writes its elements without newlines between them
    if name == "deepseek_v31" and "```json" in template:
        return "deepseek_v3"   # R1/V3 fence the arguments
    return name


@dataclasses.dataclass(frozen=True)
class ModelMeta:
    """The served model's resolved conventions (see the module docstring)."""
    family: str | None = None
    think_start: str | None = None     # None: no reasoning parsing
    think_end: str | None = None
    toggle: str | None = None          # None: thinking cannot be switched by the template
    toggle_on: object = True
    toggle_off: object = False
    grades_effort: bool = False
    tool_format: str | None = None     # the tool-call parser (toolcalls.TOOL_PARSERS)
    markers_are_special: bool = False  # decode with special tokens kept, or the markers vanish
    reasoning_parser: str | None = None
    chosen_by: str = "auto"            # how the parsers were picked: auto, or the flags

    @property
    def harmony(self) -> bool:
        """gpt-oss's channels: one parser splits reasoning, content and calls."""
        return self.reasoning_parser == "gpt_oss" or self.tool_format == "gpt_oss"

    @property
    def reasoning(self) -> bool:
        return self.think_start is not None

    @property
    def efforts(self) -> list[str]:
        """The effort values that change what this model does."""
        if not self.reasoning:
            return []
        return list(EFFORTS) if self.grades_effort else ["none", "low", "medium", "high"]

    def template_kwargs(self, effort: str | None, explicit: dict) -> dict:
        """The chat-template variables for an effort; the client's own kwargs win."""
        derived: dict = {}
        if effort is not None and self.reasoning:
            if effort == "none":
                if self.toggle:
                    derived[self.toggle] = self.toggle_off
            else:
                if self.toggle:
                    derived[self.toggle] = self.toggle_on
                if self.grades_effort:
                    derived[EFFORT_KWARG] = effort
        return {**derived, **explicit}

    def opens_reasoning(self, prompt: str) -> bool:
        """The generation prompt leaves a think block open: the output starts inside it."""
        return self.reasoning and prompt.rstrip().endswith(self.think_start)

    def closes_reasoning(self, prompt: str) -> bool:
        """The generation prompt holds a closed (usually empty) think block: no thinking follows."""
        return self.reasoning and prompt.rstrip().endswith(self.think_end)

    def thinking_off_prefix(self, prompt: str) -> str:
        """For effort "none" where the template cannot turn thinking off: an empty think block
        to put at the start of the answer ("" where the prompt already closed thinking)."""
        if not self.reasoning or self.closes_reasoning(prompt):
            return ""
        if self.harmony:     # straight to the final channel
            return "" if prompt.rstrip().endswith("<|message|>") else "<|channel|>final<|message|>"
        if self.opens_reasoning(prompt):
            return "\n" + self.think_end + "\n\n"
        if self.toggle is None:
            return self.think_start + "\n\n" + self.think_end + "\n\n"
        return ""

    def describe(self) -> dict:
        return {"family": self.family, "reasoning_parser": self.reasoning_parser if self.reasoning else None,
                "reasoning_markers": [self.think_start, self.think_end] if self.reasoning else None,
                "thinking_toggle": self.toggle, "grades_effort": self.grades_effort,
                "reasoning_efforts": self.efforts, "tool_call_format": self.tool_format,
                "tool_call_parser": self.tool_format, "parsers_chosen_by": self.chosen_by,
                "special_tokens_kept": self.markers_are_special}


def resolve(model_type: str, template: str, reasoning_parser: str = "auto",
            special_tokens=(), tool_call_parser: str = "auto") -> ModelMeta:
    """The served model's ModelMeta from its model_type, its chat template's text and the
    --reasoning-parser (auto | off | NAME) and --tool-call-parser (auto | NAME) choices.
    auto: the family's formats where its template writes their markers; else the formats
    whose markers the template writes (the template has the last word)."""
    if reasoning_parser not in PARSER_CHOICES:
        raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; choose from {', '.join(PARSER_CHOICES)}")
    if tool_call_parser not in TOOL_PARSER_CHOICES:
        raise ValueError(f"unknown tool-call parser {tool_call_parser!r}; choose from "
                         f"{', '.join(TOOL_PARSER_CHOICES)}")
    family = next((f for f in FAMILIES.values() if model_type in f.model_types), None)
    if tool_call_parser == "auto":
        tool_format = detect_tool_format(template)
        if tool_format is None and family is not None and "tools" in template:
            tool_format = family.tool_format
    else:
        tool_format = canonical_tool_parser(tool_call_parser)
    if reasoning_parser == "auto":
        thinker = _auto_reasoner(family, template, tool_format)
    elif reasoning_parser == "off":
        thinker = None
    else:
        thinker = REASONERS[REASONER_ALIASES.get(reasoning_parser, reasoning_parser)]
    chosen_by = "auto" if reasoning_parser == tool_call_parser == "auto" else "flags"
    markers = _markers(thinker, tool_format)
    special = any(t and t in m for t in special_tokens for m in markers)
    if thinker is None:
        return ModelMeta(family=family.name if family is not None else None, tool_format=tool_format,
                         markers_are_special=special, chosen_by=chosen_by)
    return ModelMeta(
        family=thinker.name, think_start=thinker.think_start, think_end=thinker.think_end,
        toggle=thinker.toggle if thinker.toggle and thinker.toggle in template else None,
        toggle_on=thinker.toggle_on, toggle_off=thinker.toggle_off,
        grades_effort=EFFORT_KWARG in template, tool_format=tool_format,
        markers_are_special=special, reasoning_parser=thinker.name, chosen_by=chosen_by)


def _auto_reasoner(family: Family | None, template: str, tool_format: str | None) -> Reasoner | None:
    own = REASONERS.get(family.reasoner) if family is not None and family.reasoner else None
    if own is not None and own.detect in template:
        if own.name == "deepseek_r1":
            # V3.1+: the template switches thinking (a `thinking` variable); R1 always thinks.
            return REASONERS["deepseek_v3" if re.search(r"\bthinking\b", template) else "deepseek_r1"]
        mapped = _THINK_BY_TOOLS.get(tool_format)
        if own.detect == "</think>" and mapped and tool_format != family.tool_format:
            return REASONERS[mapped]     # another family's template on this architecture
        return own
    for r in ("gpt_oss", "gemma4", "minimax_m3", "mistral"):
        if REASONERS[r].detect in template:
            return REASONERS[r]
    if "</think>" in template:
        return REASONERS[_THINK_BY_TOOLS.get(tool_format, "qwen3")]
    return None


def _markers(thinker: Reasoner | None, tool_format: str | None) -> tuple[str, ...]:
    from freetoken.server.toolcalls import TOOL_PARSERS
    out = (thinker.think_start, thinker.think_end) if thinker else ()
    return out + (TOOL_PARSERS[tool_format].markers if tool_format else ())
