"""Tool-call parsers, one per model family's markup, named as vLLM names them.

Each turns the answer text into Events (content, tool_start, tool_args, tool_end) as it
streams; `make_tool_parser(name, tools)` builds one for a request's tools. May import the
server's JSON checker and the reasoning helpers only.
"""

from __future__ import annotations

from freetoken.server.toolcalls.call_syntax import Gemma4ToolParser, Llama4PythonicToolParser
from freetoken.server.toolcalls.harmony import HarmonyParser
from freetoken.server.toolcalls.hermes import HermesToolParser
from freetoken.server.toolcalls.json_calls import (DeepSeekV3ToolParser, DeepSeekV31ToolParser,
                                                   KimiK2ToolParser, MistralToolParser)
from freetoken.server.toolcalls.xml_calls import (DeepSeekV32ToolParser, Glm45ToolParser,
                                                  Glm47ToolParser, MiniMaxM2ToolParser,
                                                  Qwen3CoderToolParser)

TOOL_PARSERS = {
    "hermes": HermesToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "glm45": Glm45ToolParser,
    "glm47": Glm47ToolParser,
    "gpt_oss": HarmonyParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV31ToolParser,
    "deepseek_v32": DeepSeekV32ToolParser,
    "kimi_k2": KimiK2ToolParser,
    "minimax_m2": MiniMaxM2ToolParser,
    "mistral": MistralToolParser,
    "llama4_pythonic": Llama4PythonicToolParser,
    "gemma4": Gemma4ToolParser,
}
TOOL_PARSER_ALIASES = {"openai": "gpt_oss", "qwen3_xml": "qwen3_coder", "minimax": "minimax_m2",
                       "deepseek_v4": "deepseek_v32"}
TOOL_PARSER_CHOICES = ("auto", *TOOL_PARSERS, *TOOL_PARSER_ALIASES)


def canonical_tool_parser(name: str) -> str:
    return TOOL_PARSER_ALIASES.get(name, name)


def make_tool_parser(name: str, tools=None):
    """A fresh parser for one request. tools: its Chat Completions tools (or names)."""
    return TOOL_PARSERS[canonical_tool_parser(name)](tools)
