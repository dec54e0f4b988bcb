"""Tool calling below the server: the request's checks, each format's grammar against its parser's text, the
conversation the chat template gets, and the splice of a generated turn (no model weights: the real tokenizer)."""

from __future__ import annotations

import pytest

from kvreuse.structured import GrammarCompiler
from kvreuse.tools.conversation import template_messages
from kvreuse.tools.grammar import LAYOUTS, tool_format
from kvreuse.tools.parsers import get_parser
from kvreuse.tools.parsers.base import ToolCall
from kvreuse.tools.request import ToolError, parse_tool_request
from kvreuse.tools.turns import GeneratedTurn, TurnStore
from kvreuse.weights.tokenizer import TokenSplice

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The forecast of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, CLOCK]
PARIS = ToolCall("get_weather", '{"city": "Paris", "days": 3}')


@pytest.mark.parametrize("tools, choice, field", [
    ([{"type": "function", "function": {"description": "no name"}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "tools[0].function.name"),
    ([{"type": "retrieval"}], None, "tools[0].type"),
    ([{"type": "function", "function": {"name": "f", "parameters": "city: str"}}], None,
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None,
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}], None,
     "tools[0].function.parameters"),
    ([WEATHER, WEATHER], None, "tools[1].function.name"),
    (TOOLS, {"type": "function", "function": {"name": "send_email"}}, "tool_choice"),
    (TOOLS, "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_bad_tools_are_refused_naming_the_field(tools, choice, field):
    with pytest.raises(ToolError) as refused:
        parse_tool_request(tools, choice)
    assert refused.value.field == field
    assert str(refused.value).startswith(f"{field}: ")


def test_a_tool_request_says_what_may_be_called():
    assert parse_tool_request(None, None) is None and parse_tool_request([], "none") is None
    auto = parse_tool_request(TOOLS, None)
    assert auto.mode == "auto" and auto.names == ("get_weather", "get_time") and auto.max_calls is None
    named = parse_tool_request(TOOLS, {"type": "function", "function": {"name": "get_time"}}, True)
    assert [t.name for t in named.callable_tools] == ["get_time"] and named.max_calls == 1
    assert named.finish_reason == "stop" and auto.finish_reason == "tool_calls"
    assert parse_tool_request(TOOLS, "required", False).max_calls == 1
    assert parse_tool_request(TOOLS, "none").callable_tools == ()
    assert named.tools[1].parameters == {"type": "object", "properties": {}}


@pytest.fixture(scope="module")
def grammars(real_tokenizer):
    return GrammarCompiler(real_tokenizer, len(real_tokenizer.hf))


def accepts(grammars, real_tokenizer, spec, text: str) -> bool:
    matcher = grammars.compile(spec).matcher()
    try:
        for token in real_tokenizer.hf.encode(text, add_special_tokens=False):
            matcher.accept(token)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_each_format_forces_the_text_its_parser_reads(grammars, real_tokenizer, name):
    """`required` accepts exactly the calls the parser renders: schema-valid arguments of a given tool."""
    parser = get_parser(name, ["get_weather", "get_time"])
    spec = tool_format(parse_tool_request(TOOLS, "required"), name)
    two = [PARIS, ToolCall("get_time", "{}")]
    assert accepts(grammars, real_tokenizer, spec, parser.render(two))
    assert parser.parse(parser.render(two)).calls == tuple(two)
    wrong = [ToolCall("get_weather", '{"city": "Paris"}'),             # a required property missing
             ToolCall("get_weather", '{"city": "Paris", "days": "3"}'),  # the wrong type
             ToolCall("get_news", "{}")]                                 # no such tool
    for call in wrong:
        assert not accepts(grammars, real_tokenizer, spec, parser.render([call])), call
    one = tool_format(parse_tool_request(TOOLS, "required", False), name)
    assert accepts(grammars, real_tokenizer, one, parser.render([PARIS]))
    assert not accepts(grammars, real_tokenizer, one, parser.render(two))


@pytest.mark.parametrize("name", ["hermes", "json"])
def test_auto_is_free_until_the_trigger(grammars, real_tokenizer, name):
    parser = get_parser(name, ["get_weather", "get_time"])
    spec = tool_format(parse_tool_request(TOOLS, "auto"), name)
    assert accepts(grammars, real_tokenizer, spec, "It is sunny in Paris, I think.")
    assert accepts(grammars, real_tokenizer, spec, parser.render([PARIS]))
    assert not accepts(grammars, real_tokenizer, spec, LAYOUTS[name].prefix + LAYOUTS[name].begin("get_news"))


def test_pythonic_parses_but_forces_nothing():
    assert tool_format(parse_tool_request(TOOLS, "auto"), "pythonic") is None
    with pytest.raises(ToolError, match="tool_choice"):
        tool_format(parse_tool_request(TOOLS, "required"), "pythonic")
    assert tool_format(parse_tool_request(TOOLS, "none"), "json") is None


def test_tool_schemas_are_held_to_the_structured_limits(real_tokenizer):
    from kvreuse.config import StructuredConfig
    from kvreuse.structured.errors import UnsupportedFormat

    many = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(40)}}
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": many}} for i in range(3)]
    compiler = GrammarCompiler(real_tokenizer, len(real_tokenizer.hf),
                               StructuredConfig(max_schema_properties=100, compile_timeout_s=0))
    with pytest.raises(UnsupportedFormat) as refused:
        compiler.compile(tool_format(parse_tool_request(tools, "required"), "json"))
    assert refused.value.field == "tools" and "120 properties" in str(refused.value)
    assert "structured.max_schema_properties" in str(refused.value)


def conversation(arguments: str = PARIS.arguments, content=None, call_id: str = "call_1") -> list[dict]:
    call = {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": content, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": "sunny, 21 C"}]


def test_the_json_format_shows_tools_in_a_stable_preamble_and_results_as_a_user_turn():
    request = parse_tool_request(TOOLS, "required")
    parser = get_parser("json", request.names)
    first, tools = template_messages(conversation()[:2], request, parser, False, TurnStore(), None)
    later, _ = template_messages(conversation(), request, parser, False, TurnStore(), None)
    assert tools is None and first[0] == later[0]  # byte-stable: the cached prefix holds
    assert first[0]["content"].startswith("You are terse.\n\n") and '"name": "get_weather"' in first[0]["content"]
    assert later[2] == {"role": "assistant", "content": parser.render([PARIS])}
    assert later[3]["role"] == "user" and "sunny, 21 C" in later[3]["content"]


def test_native_formats_give_the_template_tools_and_calls():
    request = parse_tool_request(TOOLS, "auto")
    messages, tools = template_messages(conversation(), request, get_parser("hermes", request.names), True,
                                        TurnStore(), None)
    assert tools == [WEATHER | {"function": {**WEATHER["function"]}}, CLOCK_DEFINITION]
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 3}
    assert messages[3] == {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1", "name": "get_weather"}


CLOCK_DEFINITION = {"type": "function", "function": {"name": "get_time", "description": "",
                                                     "parameters": {"type": "object", "properties": {}}}}


def test_a_tool_result_must_answer_a_call():
    request = parse_tool_request(TOOLS, "auto")
    messages = conversation()
    messages[3]["tool_call_id"] = "call_unknown"
    with pytest.raises(ToolError) as refused:
        template_messages(messages, request, get_parser("json", request.names), False, TurnStore(), None)
    assert refused.value.field == "messages[3].tool_call_id"


def generated(scope=None) -> GeneratedTurn:
    return GeneratedTurn(scope, ("call_1",), (PARIS,), "", (11, 22, 33), "<text>")


@pytest.mark.parametrize("native", [False, True])
def test_an_echoed_turn_is_spliced_as_generated_and_an_edited_one_is_text(native):
    request = parse_tool_request(TOOLS, "auto")
    parser = get_parser("hermes" if native else "json", request.names)
    turns = TurnStore()
    turns.record(generated())
    reordered = '{"days": 3, "city": "Paris"}'  # the same JSON value: still the generated turn
    for arguments in (PARIS.arguments, reordered):
        messages, _ = template_messages(conversation(arguments), request, parser, native, turns, None)
        assert messages[2] == {"role": "assistant", "content": TokenSplice((11, 22, 33), "<text>")}
    edits = [conversation('{"city": "Rome", "days": 3}'), conversation('{"city": "Paris", "days": 3.0}'),
             conversation(content="Let me look."), conversation(call_id="call_2")]
    for messages in edits:
        rendered, _ = template_messages(messages, request, parser, native, turns, None)
        assert not isinstance(rendered[2]["content"], TokenSplice)
    other_salt, _ = template_messages(conversation(), request, parser, native, turns, "tenant-b")
    assert not isinstance(other_salt[2]["content"], TokenSplice)


def test_the_turn_store_is_bounded():
    turns = TurnStore(max_turns=2)
    for i in range(3):
        turns.record(GeneratedTurn(None, (f"call_{i}",), (PARIS,), "", (i,), ""))
    assert len(turns) == 2 and turns.find(None, ["call_0"], [PARIS], "") is None
    assert turns.find(None, ["call_2"], [PARIS], "").token_ids == (2,)


def test_a_splice_is_tokenized_as_given(real_tokenizer):
    """The turn's tokens go in as they are, between the template's own tokens around the turn."""
    def tokens(messages):
        return real_tokenizer.encode_chat(real_tokenizer.render_chat(messages))

    hi, more = {"role": "user", "content": "Hi"}, {"role": "user", "content": "Go on"}
    spliced = tokens([hi, {"role": "assistant", "content": TokenSplice((42, 7, 42), "x")}, more])
    plain = tokens([hi, {"role": "assistant", "content": "x"}, more])
    before = tokens([hi])  # ends with the generation prompt: the turn's own start
    assert spliced[:len(before)] == before == plain[:len(before)]
    assert spliced[len(before):len(before) + 3] == [42, 7, 42]
    num_x = len(plain) - len(spliced) + 3
    assert spliced[len(before) + 3:] == plain[len(before) + num_x:]
