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

# OpenAI's effort values; any of them is accepted, "none" turns thinking off.
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
EFFORT_KWARG = "reasoning_effort"


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    think_start: str | None = None     # reasoning markers; None: the family does not reason
    think_end: str | None = None
    toggle: str | None = None          # template variable turning thinking on/off; None: always on
    toggle_on: object = True
    toggle_off: object = False
    grades_effort: bool = False        # its templates read `reasoning_effort`
    tool_format: str | None = None     # "hermes" is parsed; other formats are named, not parsed yet


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("qwen3", ("qwen3", "qwen3_moe", "qwen3_next", "qwen3_vl_moe"), "<think>", "</think>",
           toggle="enable_thinking", tool_format="hermes"),
    Family("glm", ("glm4_moe", "glm4", "glm4v_moe"), "<think>", "</think>",
           toggle="enable_thinking", tool_format="glm45"),
    Family("gemma4", ("gemma4", "gemma4_text"), "<|channel>thought", "<channel|>",
           toggle="enable_thinking", tool_format="gemma4"),
    Family("minimax_m3", ("minimax_m3",), "<mm:think>", "</mm:think>",
           toggle="thinking_mode", toggle_on="enabled", toggle_off="disabled", tool_format="minimax"),
    # Always-on thinkers: no toggle; effort "none" closes the think block in the prompt instead.
    Family("deepseek_r1", ("deepseek_v3",), "<think>", "</think>", tool_format=None),
    Family("qwen2", ("qwen2", "qwen2_moe"), tool_format="hermes"),
    Family("mixtral", ("mixtral", "mistral")),
)}
PARSER_CHOICES = ("auto", "off", *(n for n, f in FAMILIES.items() if f.think_start))


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
    tool_format: str | None = None
    markers_are_special: bool = False  # decode with special tokens kept, or the markers vanish

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
        if self.opens_reasoning(prompt):
            return "\n" + self.think_end + "\n\n"
        if self.toggle is None:
            return self.think_start + "\n\n" + self.think_end + "\n\n"
        return ""

    def describe(self) -> dict:
        return {"family": self.family, "reasoning_parser": self.family if self.reasoning else None,
                "reasoning_markers": [self.think_start, self.think_end] if self.reasoning else None,
                "thinking_toggle": self.toggle, "grades_effort": self.grades_effort,
                "reasoning_efforts": self.efforts, "tool_call_format": self.tool_format}


def resolve(model_type: str, template: str, reasoning_parser: str = "auto",
            special_tokens=()) -> ModelMeta:
    """The served model's ModelMeta from its model_type, its chat template's text and the
    --reasoning-parser choice (auto | off | a family name)."""
    if reasoning_parser not in PARSER_CHOICES:
        raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; choose from {', '.join(PARSER_CHOICES)}")
    family = next((f for f in FAMILIES.values() if model_type in f.model_types), None)
    if family is None or not _reasons_in(family, template):
        # The template decides: a Qwen3-style template on another architecture reasons like Qwen3.
        family = next((f for f in FAMILIES.values() if _reasons_in(f, template)), family)
    if reasoning_parser == "auto":
        thinker = family if family is not None and _reasons_in(family, template) else None
    else:
        thinker = None if reasoning_parser == "off" else FAMILIES[reasoning_parser]
    tool_format = family.tool_format if family is not None else None
    if tool_format is None and "<tool_call>" in template:
        tool_format = "hermes"
    if thinker is None:
        return ModelMeta(family=family.name if family is not None else None, tool_format=tool_format)
    return ModelMeta(
        family=thinker.name, think_start=thinker.think_start, think_end=thinker.think_end,
        toggle=thinker.toggle if thinker.toggle and thinker.toggle in template else None,
        toggle_on=thinker.toggle_on, toggle_off=thinker.toggle_off,
        grades_effort=EFFORT_KWARG in template, tool_format=tool_format,
        markers_are_special=thinker.think_start in special_tokens or thinker.think_end in special_tokens)


def _reasons_in(family: Family, template: str) -> bool:
    """The template writes the family's reasoning markers (so the model reasons in them)."""
    return family.think_end is not None and family.think_end in template
