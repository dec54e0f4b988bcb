"""OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, checked into one ToolRequest.

Everything a request can get wrong in them is found here, in time linear in their size, and named by its field
(`tools[2].function.name`, `tool_choice`): a bad tool gets 400, never a silently dropped tool.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from kvreuse.structured.errors import UnsupportedFormat

ChoiceMode = Literal["none", "auto", "required", "function"]
CHOICE_MODES = ("none", "auto", "required")
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
NO_PARAMETERS = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """A tool field the server refuses; `field` is the request field at fault (`tools[0].function.name`)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str
    parameters: dict        # a JSON schema of an object (NO_PARAMETERS when the tool gave none)
    strict: bool

    def definition(self) -> dict:
        """The tool as chat templates and prompts show it: OpenAI's `{"type": "function", "function": {...}}`."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    """The tools a chat request offers and what it asks of them. `mode`: `none` (no call), `auto` (text or
    calls), `required` (at least one call), `function` (one call of `forced`)."""
    tools: tuple[FunctionTool, ...]
    mode: ChoiceMode
    forced: str | None = None
    parallel: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(tool.name for tool in self.tools)

    @property
    def callable_tools(self) -> tuple[FunctionTool, ...]:
        """The tools the answer may call: every tool, the forced one only, or none."""
        if self.mode == "none":
            return ()
        return tuple(t for t in self.tools if self.forced is None or t.name == self.forced)

    @property
    def max_calls(self) -> int | None:
        """How many calls one answer may hold (None: any number)."""
        return None if self.parallel and self.mode != "function" else 1

    @property
    def finish_reason(self) -> str:
        """An answer with calls finishes as `tool_calls`, but for a named choice, which OpenAI finishes as `stop`."""
        return "stop" if self.mode == "function" else "tool_calls"


def parse_tool_request(tools: Any, tool_choice: Any, parallel_tool_calls: Any = None) -> ToolRequest | None:
    """The request's tools, or None when it offers none and asks for no call. ToolError naming the field."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise ToolError("tool_choice", f"{_show(tool_choice)} needs tools, and the request gives none")
        return None
    if not isinstance(tools, list):
        raise ToolError("tools", "must be a list of function tools")
    parsed = tuple(_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools))
    seen: set[str] = set()
    for i, tool in enumerate(parsed):
        if tool.name in seen:
            raise ToolError(f"tools[{i}].function.name", f"{tool.name!r} is given twice; tool names must be unique")
        seen.add(tool.name)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ToolError("parallel_tool_calls", "must be a boolean")
    mode, forced = _choice(tool_choice, seen)
    return ToolRequest(parsed, mode, forced, parallel_tool_calls is not False)


def _tool(tool: Any, field: str) -> FunctionTool:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ToolError(f"{field}.type", 'only function tools are supported: {"type": "function", "function": {...}}')
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ToolError(f"{field}.function", "must be an object with a name")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ToolError(f"{field}.function.name", f"{_show(name)} is not a function name (1-64 letters, digits, "
                                                  f"'_' or '-')")
    description = function.get("description", "")
    if not isinstance(description, str):
        raise ToolError(f"{field}.function.description", "must be a string")
    strict = function.get("strict", False)
    if not isinstance(strict, bool | None):
        raise ToolError(f"{field}.function.strict", "must be a boolean")
    return FunctionTool(name, description, _parameters(function.get("parameters"), f"{field}.function.parameters"),
                        bool(strict))


def _parameters(schema: Any, field: str) -> dict:
    if schema is None:
        return NO_PARAMETERS
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise ToolError(field, 'must be a JSON schema of an object ({"type": "object", "properties": {...}})')
    from kvreuse.structured.schema_check import check_schema  # xgrammar (its regex check), only for tools

    try:
        check_schema(schema, field)
    except UnsupportedFormat as exc:
        raise ToolError(field, str(exc).removeprefix(f"{field}: ")) from None
    return schema


def _choice(tool_choice: Any, names: set[str]) -> tuple[ChoiceMode, str | None]:
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICE_MODES:
            raise ToolError("tool_choice", f"must be one of {', '.join(CHOICE_MODES)} or "
                                           f'{{"type": "function", "function": {{"name": ...}}}}, not {tool_choice!r}')
        return tool_choice, None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(function, dict) or tool_choice.get("type") != "function":
        raise ToolError("tool_choice", 'a named choice is {"type": "function", "function": {"name": ...}}')
    name = function.get("name")
    if name not in names:
        raise ToolError("tool_choice", f"names the function {_show(name)}, which is not among the tools "
                                       f"({', '.join(sorted(names))})")
    return "function", name


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
