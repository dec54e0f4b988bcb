"""Forced tool calls on the real Gemma 3 270M (`--model gemma3-270m`) under its chat template
(examples/gemma3-chat.jinja), by the real `openai` client. The template shows no tools, so kvreuse's json format
writes them in a preamble after the system prompt, and the template folds the system turn into the first user turn.

50 varied prompts, with and without a system message, `required` and each of four tools named in turn (strings,
integers, an enum, a nested object, no arguments): every call is of a given tool and its arguments validate under
the tool's schema. A streamed call reassembles to the whole one, and an echoed call turn with its result is answered.
One fast test (no model) holds the grammar to what Gemma needed: integers that end."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvreuse.structured import GrammarCompiler
from kvreuse.structured.tool_grammar import INTEGER_BOUND, bounded_integers
from kvreuse.tools.grammar import tool_format
from kvreuse.tools.parsers import get_parser
from kvreuse.tools.parsers.base import ToolCall
from kvreuse.tools.request import parse_tool_request

from .server_process import REPO_ROOT, start_server
from .tool_prompts import (
    BOOKING,
    CITIES,
    CLOCK,
    SEARCH,
    WEATHER,
    ask,
    check_valid,
    client_of,
    named,
    parsed,
    streamed_calls,
)

TEMPLATE = str(REPO_ROOT / "examples" / "gemma3-chat.jinja")
TOOLS = [WEATHER, SEARCH, CLOCK, BOOKING]
ASKS = ["What is the weather in {} for the next three days?", "Find the docs about caching in {}.",
        "What time is it in {}?", "Book a business-class trip to {} for Ana, who is 34.", "Tell me a joke about {}."]
SYSTEM = "You are a helpful travel assistant. Keep answers short."
CHOICES = ["required", *(named(t["function"]["name"]) for t in TOOLS)]
MAX_TOKENS = 96  # the longest call (book_trip, every argument) is about 50 Gemma tokens


def case(i: int) -> tuple[list[dict], str | dict]:
    """The i-th of 50 requests: each ask of each city, every other one with a system message, each choice paired
    with every ask twice (the choice turns with the city)."""
    city, asked = CITIES[i // len(ASKS)], ASKS[i % len(ASKS)]
    messages = [{"role": "user", "content": asked.format(city)}]
    if i % 2:
        messages.insert(0, {"role": "system", "content": SYSTEM})
    return messages, CHOICES[(i + i // len(ASKS)) % len(CHOICES)]


CASES = [case(i) for i in range(50)]


@pytest.fixture(scope="module")
def gemma_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server-logs") / "tools-gemma3.log"
    with start_server("--model", "gemma3-270m", "--chat-template", TEMPLATE, log_path=log,
                      ready_timeout=300.0) as server:
        yield server


def call_problem(reply, choice) -> str | None:
    """What is wrong with a forced answer to `choice` (None: one valid call, finished as OpenAI does)."""
    name = choice["function"]["name"] if isinstance(choice, dict) else None
    try:
        calls = check_valid(reply, (name,) if name else None, TOOLS)
    except Exception as exc:  # noqa: BLE001 - the reason is reported with the others
        return f"{type(exc).__name__}: {str(exc)[:300]} (finish {reply.choices[0].finish_reason!r}, " \
               f"content {reply.choices[0].message.content!r})"
    want = "stop" if name else "tool_calls"
    if len(calls) != 1 or reply.choices[0].finish_reason != want:
        return f"{len(calls)} calls, finish {reply.choices[0].finish_reason!r} (want 1, {want!r})"
    return None


@pytest.mark.slow
def test_required_and_named_calls_are_schema_valid_on_50_prompts(gemma_server):
    def request(case):
        messages, choice = case
        return ask(client, gemma_server.model, messages, TOOLS, MAX_TOKENS, tool_choice=choice,
                   parallel_tool_calls=False)

    start = time.monotonic()
    with client_of(gemma_server) as client, ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(request, CASES))
    seconds = time.monotonic() - start
    problems = {i: p for i, (reply, (_, choice)) in enumerate(zip(replies, CASES, strict=True))
                if (p := call_problem(reply, choice)) is not None}
    print(f"gemma3-270m forced tool calls: {len(CASES) - len(problems)}/{len(CASES)} schema-valid in {seconds:.0f} s")
    assert not problems, "\n".join(f"{CASES[i]}: {p}" for i, p in problems.items())
    names = {r.choices[0].message.tool_calls[0].function.name for r in replies}
    assert names == {t["function"]["name"] for t in TOOLS}
    assert len({r.choices[0].message.tool_calls[0].function.arguments for r in replies}) > 10  # not one answer


@pytest.mark.slow
@pytest.mark.parametrize("choice", [named("book_trip"), "required"], ids=["named", "required"])
def test_a_streamed_call_reassembles_to_the_whole_one(gemma_server, choice):
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": ASKS[3].format("Lima")}]
    with client_of(gemma_server) as client:
        whole = ask(client, gemma_server.model, messages, TOOLS, MAX_TOKENS, tool_choice=choice,
                    parallel_tool_calls=False)
        assert call_problem(whole, choice) is None
        streamed, finish = streamed_calls(client, gemma_server.model, messages, tools=TOOLS, max_tokens=MAX_TOKENS,
                                          tool_choice=choice, parallel_tool_calls=False)
    assert streamed == parsed(whole) and finish == whole.choices[0].finish_reason


@pytest.mark.slow
def test_an_echoed_call_turn_and_its_result_are_answered(gemma_server):
    """The json format's whole loop under Gemma's template (roles must alternate: the result is a user turn), the
    echoed turn hitting the cache as generated."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASKS[0].format("Oslo")}]
    with client_of(gemma_server) as client:
        first = ask(client, gemma_server.model, messages, TOOLS, MAX_TOKENS, tool_choice="required",
                    parallel_tool_calls=False)
        call = check_valid(first, tools=TOOLS)[0]
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C, all three days."}]
        reply = ask(client, gemma_server.model, messages, TOOLS, 8, tool_choice="none")
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls
    before = first.usage.prompt_tokens + first.usage.completion_tokens
    assert reply.usage.prompt_tokens > before and reply.usage.prompt_tokens_details.cached_tokens >= before // 16 * 16


def test_a_forced_integer_without_bounds_ends(real_tokenizer):
    """An integer whose schema sets no bound has at most 15 digits in a forced call (Gemma 3 270M wrote "days":
    1000... until max_tokens cut the call); the bounds a schema sets are its own."""
    grammars = GrammarCompiler(real_tokenizer, len(real_tokenizer.hf))
    parser = get_parser("json", ["get_weather"])
    spec = grammars.compile(tool_format(parse_tool_request([WEATHER], "required", False), "json"))

    def accepts(days: str) -> bool:
        matcher = spec.matcher()
        try:
            for token in real_tokenizer.hf.encode(parser.render([ToolCall("get_weather", f'{{"city": "Oslo", '
                                                                  f'"days": {days}}}')]), add_special_tokens=False):
                matcher.accept(token)
        except ValueError:
            return False
        return True

    assert accepts("3") and accepts(str(INTEGER_BOUND)) and accepts(str(-INTEGER_BOUND))
    assert not accepts(str(INTEGER_BOUND + 1)) and not accepts(str(-INTEGER_BOUND - 1))
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1},
                                               "big": {"type": "integer", "minimum": 10**16},
                                               "e": {"enum": [{"type": "integer"}]},
                                               "xs": {"type": "array", "items": {"type": "integer"}}}}
    bounded = bounded_integers(schema)["properties"]
    assert bounded["n"] == {"type": "integer", "minimum": 1, "maximum": INTEGER_BOUND}
    assert bounded["big"] == {"type": "integer", "minimum": 10**16}  # not made empty
    assert bounded["e"] == schema["properties"]["e"] and bounded["xs"]["items"]["maximum"] == INTEGER_BOUND
    assert "maximum" not in schema["properties"]["n"]  # the caller's schema is left as it is
