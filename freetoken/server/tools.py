"""Tool definitions and tool_choice as every dialect hands them over, checked; the parsers of
the models' tool-call markup live in freetoken/server/toolcalls/ (re-exported here)."""

from __future__ import annotations

from freetoken.server.errors import HTTPError
from freetoken.server.toolcalls import TOOL_PARSERS, make_tool_parser
from freetoken.server.toolcalls.base import Event
from freetoken.server.toolcalls.hermes import HermesToolParser, match_header

__all__ = ["Event", "HermesToolParser", "TOOL_PARSERS", "check_tool_choice", "check_tools",
           "make_tool_parser", "match_header"]


# -- tool definitions and tool_choice, as every dialect hands them over ---------------------
def check_tools(tools, param: str = "tools") -> list[dict] | None:
    """Chat Completions' tool list, checked: [{"type": "function", "function": {"name", ...}}]."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad(param, f"'{param}' must be a list of tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise _bad(f"{param}[{i}]", 'each tool must be {"type": "function", "function": {...}}')
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"{param}[{i}].function.name", "each function needs a non-empty 'name'")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise _bad(f"{param}[{i}].function.parameters", "'parameters' must be a JSON schema object")
    return tools or None


def check_tool_choice(choice, tools: list[dict] | None, param: str = "tool_choice"):
    """"auto" | "none" | "required" | {"name": fn}; a named or required choice needs tools."""
    names = [t["function"]["name"] for t in tools or ()]
    if choice in ("auto", "none"):
        return choice
    if choice == "required" or isinstance(choice, dict):
        if not names:
            raise _bad(param, f"'{param}' requires tools; none were given")
        if isinstance(choice, dict) and choice.get("name") not in names:
            raise _bad(param, f"'{param}' names {choice.get('name')!r}, which is not one of the tools "
                              f"({', '.join(names)})")
        return choice
    raise _bad(param, f"'{param}' must be auto, none, required or a named function")


def _bad(param: str, message: str) -> HTTPError:
    return HTTPError(400, message, type="invalid_request_error", param=param)
