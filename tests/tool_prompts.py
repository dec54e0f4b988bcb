"""Tools, prompts and `openai` client helpers shared by the tool-calling tests against a real `kvreuse serve`
(test_tool_server.py: SmolLM2; test_tool_gemma3.py: Gemma 3 under its chat template)."""

from __future__ import annotations

import json

import jsonschema
import openai

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The forecast of a city for some days",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city", "days"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search_docs", "description": "Search the documentation",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                    "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
                   "required": ["query"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The current time"}}
BOOKING = {"type": "function", "function": {  # an enum, a bounded integer and a nested object
    "name": "book_trip", "description": "Book a trip to a city for a traveler",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"},
        "cabin": {"type": "string", "enum": ["economy", "premium", "business"]},
        "travelers": {"type": "integer", "minimum": 1, "maximum": 9},
        "contact": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                    "required": ["name", "age"]}},
        "required": ["city", "cabin", "travelers", "contact"]}}}
TOOLS = [WEATHER, SEARCH, CLOCK]
CITIES = ["Paris", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Perth", "Accra", "Hanoi", "Bern"]
ASKS = ["What is the weather in {} this week?", "Find the docs about caching in {}.", "What time is it in {}?",
        "Plan a trip to {}.", "Tell me a joke about {}."]
PROMPTS = [ask.format(city) for city in CITIES for ask in ASKS]  # 50 varied prompts


def schemas_of(tools: list[dict]) -> dict[str, dict]:
    """Each tool's name -> the JSON schema of its arguments (no parameters: an object)."""
    return {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in tools}


def named(name: str) -> dict:
    """The tool_choice that names a tool."""
    return {"type": "function", "function": {"name": name}}


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300.0,
                         http_client=openai.DefaultHttpxClient(trust_env=False))


def ask(client, model, content: str | list[dict], tools: list[dict] = TOOLS, max_tokens: int = 64, **fields):
    """One chat completion with `tools` at temperature 0; `content` is the user's text, or the whole messages."""
    messages = [{"role": "user", "content": content}] if isinstance(content, str) else content
    return client.chat.completions.create(model=model, messages=messages, tools=tools, temperature=0,
                                          max_tokens=max_tokens, **fields)


def check_valid(reply, names=None, tools: list[dict] = TOOLS):
    """The reply's calls, each of a tool in `names` (default: any of `tools`) with arguments valid under its
    schema."""
    schemas = schemas_of(tools)
    calls = reply.choices[0].message.tool_calls
    assert calls, reply
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_"), call
        assert call.function.name in (names or schemas), call
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    return calls


def streamed_calls(client, model, prompt: str | list[dict], **fields) -> tuple[list[tuple[str, dict]], str]:
    """The calls of a streamed answer reassembled from their deltas (name, parsed arguments), and its finish
    reason; `fields` as `ask` takes them."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in ask(client, model, prompt, stream=True, **fields):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                if delta.id is not None:
                    assert delta.index not in calls and delta.function.name and delta.type == "function"
                    calls[delta.index] = {"name": delta.function.name, "arguments": ""}
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], finish


def parsed(reply) -> list[tuple[str, dict]]:
    """A whole answer's calls as streamed_calls gives them."""
    return [(c.function.name, json.loads(c.function.arguments)) for c in reply.choices[0].message.tool_calls or []]
