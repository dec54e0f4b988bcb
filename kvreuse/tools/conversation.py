"""A conversation with tools, as the chat template takes it: tool definitions, assistant turns with calls, tool
results.

Formats whose template shows tools (hermes, llama3_json, pythonic, mistral) get them as the template expects:
`tools=` and messages carrying `tool_calls` (arguments as objects) and `tool_call_id`. The json format, for templates
with no tool support, shows them as text the template renders like any other: a preamble after the system prompt
(byte-stable: the same tools give the same bytes, so it stays a cached prefix), calls as the format's JSON, and the
results of a turn's calls as one user message.

Either way an assistant turn that echoes a turn this server generated (turns.py) becomes a TokenSplice of the
generated tokens, which the prefix cache holds: the next step computes only what is new.
"""

from __future__ import annotations

import json
from typing import Any

from kvreuse.tools.parsers.base import ToolCall, ToolParser
from kvreuse.tools.request import ToolError, ToolRequest
from kvreuse.tools.turns import TurnStore
from kvreuse.weights.tokenizer import TokenSplice

PREAMBLE = ("You can call these tools (each line is a tool, with the JSON schema of its arguments):\n{tools}\n"
            'To call tools, answer with only a JSON object: {{"tool_calls": [{{"name": "<tool name>", "arguments": '
            '{{...}}}}]}}. Otherwise, answer in plain text.')


def template_messages(messages: list[dict], request: ToolRequest | None, parser: ToolParser, native: bool,
                      turns: TurnStore, scope: str | None) -> tuple[list[dict], list[dict] | None]:
    """The messages and the `tools` argument for the chat template (None: the template shows no tools).
    `messages` are OpenAI's (role, content, tool_calls, tool_call_id). ToolError naming the message at fault."""
    names = _call_names(messages)
    rendered: list[dict] = []
    results_at: int | None = None  # the json format's user turn holding the current turn's tool results
    for i, message in enumerate(messages):
        if message.get("tool_calls"):
            rendered.append(_assistant_turn(message, parser, native, turns, scope))
        elif message["role"] == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in names:
                raise ToolError(f"messages[{i}].tool_call_id", f"{call_id!r} matches no tool call of an earlier "
                                                               f"assistant message")
            results_at = _add_result(rendered, names[call_id], message, native, results_at)
            continue
        else:
            rendered.append({"role": message["role"], "content": message.get("content") or ""})
        results_at = None
    if request is None:
        return rendered, None
    definitions = [tool.definition() for tool in request.tools]
    return (rendered, definitions) if native else (_with_preamble(rendered, definitions), None)


def _call_names(messages: list[dict]) -> dict[str, str]:
    """Each tool call id of the conversation's assistant turns -> its function's name."""
    return {call["id"]: call["function"]["name"] for m in messages for call in m.get("tool_calls") or ()}


def _assistant_turn(message: dict, parser: ToolParser, native: bool, turns: TurnStore, scope: str | None) -> dict:
    calls = [ToolCall(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    content = message.get("content") or ""
    generated = turns.find(scope, [c["id"] for c in message["tool_calls"]], calls, content)
    if generated is not None:
        return {"role": "assistant", "content": TokenSplice(generated.token_ids, generated.text)}
    if not native:
        return {"role": "assistant", "content": parser.render(calls, content)}
    tool_calls = [{"id": c["id"], "type": "function",
                   "function": {"name": c["function"]["name"], "arguments": _object(c["function"]["arguments"])}}
                  for c in message["tool_calls"]]
    return {"role": "assistant", "content": content, "tool_calls": tool_calls}


def _add_result(rendered: list[dict], name: str, message: dict, native: bool, results_at: int | None) -> int | None:
    """Adds a tool result; returns where the json format's results turn is (None for native formats)."""
    content = message.get("content") or ""
    if native:
        rendered.append({"role": "tool", "content": content, "tool_call_id": message["tool_call_id"], "name": name})
        return None
    result = f"Result of {name} (call {message['tool_call_id']}):\n{content}"
    if results_at is not None:  # one user turn holds the results of one turn's calls
        rendered[results_at]["content"] += f"\n\n{result}"
        return results_at
    rendered.append({"role": "user", "content": result})
    return len(rendered) - 1


def _with_preamble(messages: list[dict], definitions: list[dict]) -> list[dict]:
    tools = "\n".join(json.dumps(d["function"], ensure_ascii=False) for d in definitions)
    preamble = PREAMBLE.format(tools=tools)
    if messages and messages[0]["role"] in ("system", "developer") and isinstance(messages[0]["content"], str):
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{preamble}"}, *messages[1:]]
    return [{"role": "system", "content": preamble}, *messages]


def _object(arguments: str) -> Any:
    """Arguments as templates expect them (an object, which they write with `tojson`); text that is not a JSON
    object stays text."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments
