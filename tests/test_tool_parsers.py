"""Tool-call parsers: recorded model answers parsed whole and streamed cut at every point."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvreuse.tools.parsers import PARSERS, detect_format, get_parser
from kvreuse.tools.parsers.base import ArgumentsDelta, CallStart, ContentDelta, ToolCall, json_end

TOOLS = ("get_weather", "get_time", "search")
PARIS = '{"city": "Paris"}'
TRICKY = '{"q": "a } \\" { b", "n": [1, {"k": "]"}]}'
UNICODE = '{"city": "Zürich 東京 \\u00e9 🌧"}'

# (format, model text, content, calls). stream=False: the text breaks a call the stream already began (see
# test_broken_call_after_start), so only parse() is checked.
CASES = [
    # hermes
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>', "",
     [("get_weather", PARIS)]),
    ("hermes", f'Let me check both.\n<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me check both.",
     [("get_weather", PARIS), ("get_time", "{}")]),
    ("hermes", f'<tool_call>{{"name":"search","arguments":{TRICKY}}}</tool_call>', "", [("search", TRICKY)]),
    ("hermes", f'<tool_call>\n  {{"name": "get_weather", "arguments": {UNICODE}}}  \n</tool_call>', "",
     [("get_weather", UNICODE)]),
    ("hermes", '<tool_call>\n{"name": "get_time"}\n</tool_call>', "", [("get_time", "{}")]),
    ("hermes", '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>', "",
     [("get_weather", '{"city": "Oslo"}')]),
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}', "", [("get_weather", PARIS)]),
    ("hermes", 'A\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\nDone.', "A\nDone.",
     [("get_time", "{}")]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}\nThat is all.', "That is all.",
     [("get_time", "{}")]),
    ("hermes", 'Wrap each call in <tool_call> tags, like <tool_call>{"a": 1}</tool_call>.',
     'Wrap each call in <tool_call> tags, like <tool_call>{"a": 1}</tool_call>.', []),
    ("hermes", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>', []),
    ("hermes", 'Here is JSON: {"name": "get_weather", "arguments": {}}', 'Here is JSON: {"name": "get_weather", '
     '"arguments": {}}', []),
    ("hermes", "  The answer is 4 < 5.\n", "  The answer is 4 < 5.\n", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', [], False),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>', [], False),
    # llama3_json
    ("llama3_json", f'{{"name": "get_weather", "parameters": {PARIS}}}', "", [("get_weather", PARIS)]),
    ("llama3_json", f'<|python_tag|>{{"name": "search", "parameters": {TRICKY}}}; {{"name": "get_time", '
     '"parameters": {}}', "", [("search", TRICKY), ("get_time", "{}")]),
    ("llama3_json", f'\n{{"name": "get_weather", "arguments": {UNICODE}}}\n', "", [("get_weather", UNICODE)]),
    ("llama3_json", '{"name": "get_time"}', "", [("get_time", "{}")]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", 'The call is {"name": "get_time", "parameters": {}}',
     'The call is {"name": "get_time", "parameters": {}}', []),
    ("llama3_json", '{"name": "get_timezone", "parameters": {}}', '{"name": "get_timezone", "parameters": {}}', []),
    ("llama3_json", '<|python_tag|>brave_search.call(query="Paris weather")',
     '<|python_tag|>brave_search.call(query="Paris weather")', []),
    ("llama3_json", '{"name": "get_weather", "parameters": [1]}', '{"name": "get_weather", "parameters": [1]}', []),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {PARIS}}} is what I would call.',
     f'{{"name": "get_weather", "parameters": {PARIS}}} is what I would call.', [], False),
    # pythonic
    ("pythonic", '[get_weather(city="Paris", days=3), get_time()]', "",
     [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", "{}")]),
    ("pythonic", """[search(q='a ) ( ] " b', filters={"lang": ["en", "fr"]}, exact=True, limit=None)]""", "",
     [("search", json.dumps({"q": 'a ) ( ] " b', "filters": {"lang": ["en", "fr"]}, "exact": True, "limit": None}))]),
    ("pythonic", '\n[get_weather(city="Zürich 東京", x=-1.5)]\n', "",
     [("get_weather", '{"city": "Zürich 東京", "x": -1.5}')]),
    ("pythonic", "I like [brackets] (really)", "I like [brackets] (really)", []),
    ("pythonic", "[1, 2, 3]", "[1, 2, 3]", []),
    ("pythonic", "[]", "[]", []),
    ("pythonic", "[delete_all(force=True)]", "[delete_all(force=True)]", []),
    ("pythonic", '[get_weather("Paris")]', '[get_weather("Paris")]', []),
    ("pythonic", '[get_weather(city=open("/etc/passwd"))]', '[get_weather(city=open("/etc/passwd"))]', []),
    ("pythonic", "[get_time(]", "[get_time(]", []),
    ("pythonic", "[get_time()] and more", "[get_time()] and more", [], False),
    # mistral
    ("mistral", f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {PARIS}}}, {{"name": "get_time", '
     '"arguments": {}}]', "", [("get_weather", PARIS), ("get_time", "{}")]),
    ("mistral", f'Sure.\n[TOOL_CALLS] [{{"name": "search", "arguments": {TRICKY}}}]', "Sure.",
     [("search", TRICKY)]),
    ("mistral", f'[TOOL_CALLS]get_weather[ARGS]{UNICODE}[TOOL_CALLS]get_time[ARGS]{{}}', "",
     [("get_weather", UNICODE), ("get_time", "{}")]),
    ("mistral", f'[TOOL_CALLS]search[ARGS]{TRICKY}', "", [("search", TRICKY)]),
    ("mistral", "Use [TOOL_CALLS] to call tools.", "Use [TOOL_CALLS] to call tools.", []),
    ("mistral", "I like [brackets] (really)", "I like [brackets] (really)", []),
    ("mistral", '[TOOL_CALLS][{"name": "nope", "arguments": {}}]', '[TOOL_CALLS][{"name": "nope", "arguments": {}}]',
     []),
    ("mistral", "[TOOL_CALLS]nope[ARGS]{}", "[TOOL_CALLS]nope[ARGS]{}", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Pa',
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Pa', [], False),
    # json
    ("json", f'{{"tool_calls": [{{"name": "get_weather", "arguments": {PARIS}}}]}}', "", [("get_weather", PARIS)]),
    ("json", f'{{"tool_calls": [{{"name": "search", "arguments": {TRICKY}}}, {{"name": "get_weather", '
     f'"arguments": {UNICODE}}}]}}', "", [("search", TRICKY), ("get_weather", UNICODE)]),
    ("json", '\n{ "tool_calls" : [\n  {"name": "get_time", "arguments": {}}\n] }\n', "", [("get_time", "{}")]),
    ("json", '{"tool_calls": [{"name": "get_time"}]}', "", [("get_time", "{}")]),
    ("json", '{"answer": 42}', '{"answer": 42}', []),
    ("json", "Hello! {not json}", "Hello! {not json}", []),
    ("json", '{"tool_calls": []}', '{"tool_calls": []}', []),
    ("json", '{"tool_calls": [{"name": "nope", "arguments": {}}]}',
     '{"tool_calls": [{"name": "nope", "arguments": {}}]}', []),
    ("json", '{"tool_calls": [{"name": "get_weather", "arguments": "Paris"}]}',
     '{"tool_calls": [{"name": "get_weather", "arguments": "Paris"}]}', []),
    ("json", '{"tool_calls": [{"name": "get_time", "arguments": {}, "id": 1}]}',
     '{"tool_calls": [{"name": "get_time", "arguments": {}, "id": 1}]}', [], False),
    ("json", '{"tool_calls": [{"name": "get_time", "arguments": {}}]', '{"tool_calls": [{"name": "get_time", '
     '"arguments": {}}]', [], False),
]
STREAMED = [c for c in CASES if len(c) < 5 or c[4]]


def _id(case) -> str:
    return f"{case[0]}-{CASES.index(case)}"


def _run(fmt: str, pieces: list[str]) -> list:
    stream = get_parser(fmt, TOOLS).stream()
    events = [e for piece in pieces for e in stream.feed(piece)]
    return events + stream.finish()


def _check_contract(fmt: str, text: str, events: list) -> None:
    expected = get_parser(fmt, TOOLS).parse(text)
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == expected.content
    started, arguments = [], {}
    for event in events:
        assert not isinstance(event, ContentDelta | ArgumentsDelta) or event.text, "empty delta"
        if isinstance(event, CallStart):
            assert event.index == len(started)
            started.append(event.name)
        elif isinstance(event, ArgumentsDelta):
            assert event.index < len(started), "arguments before their call's start"
            arguments[event.index] = arguments.get(event.index, "") + event.text
    assert started == [c.name for c in expected.calls]
    assert [arguments.get(i, "") for i in range(len(started))] == [c.arguments for c in expected.calls]


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_parse(case):
    fmt, text, content, calls = case[:4]
    parsed = get_parser(fmt, TOOLS).parse(text)
    assert parsed.content == content
    assert parsed.calls == tuple(ToolCall(n, a) for n, a in calls)
    for call in parsed.calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize("case", STREAMED, ids=_id)
def test_stream_every_split(case):
    fmt, text = case[:2]
    _check_contract(fmt, text, _run(fmt, [text]))
    _check_contract(fmt, text, _run(fmt, list(text)))
    for cut in range(len(text) + 1):
        _check_contract(fmt, text, _run(fmt, [text[:cut], text[cut:]]))


@pytest.mark.parametrize("case", STREAMED, ids=_id)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_stream_random_cuts(case, data):
    fmt, text = case[:2]
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=10)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    _check_contract(fmt, text, _run(fmt, pieces))


@pytest.mark.parametrize("fmt, text", [
    ("hermes", f'Sure.\n<tool_call>\n{{"name": "search", "arguments": {TRICKY}}}\n</tool_call>'),
    ("llama3_json", f'{{"name": "search", "parameters": {TRICKY}}}'),
    ("mistral", f'[TOOL_CALLS][{{"name": "search", "arguments": {TRICKY}}}]'),
    ("mistral", f"[TOOL_CALLS]search[ARGS]{TRICKY}"),
    ("json", f'{{"tool_calls": [{{"name": "search", "arguments": {TRICKY}}}]}}'),
])
def test_arguments_stream_as_written(fmt, text):
    """Each character of the arguments comes out as soon as it is fed."""
    start = text.index(TRICKY)
    stream = get_parser(fmt, TOOLS).stream()
    for cut in range(len(text)):
        events = stream.feed(text[cut])
        if start <= cut < start + len(TRICKY):
            assert ArgumentsDelta(0, text[cut]) in events


@pytest.mark.parametrize("fmt, pieces, held, released", [
    ("hermes", ["Sure <tool_", "call>\n", '{"na'], [ContentDelta("Sure")], [ContentDelta(' <tool_call>\n{"na')]),
    ("hermes", ["a\n<tool_call>\n", '{"name": "get_ti'], [ContentDelta("a")], [ContentDelta('\n<tool_call>\n{"name": '
                                                                                          '"get_ti')]),
    ("llama3_json", ["  {", '"name": "get_'], [], [ContentDelta('  {"name": "get_')]),
    ("llama3_json", ["<|python", "_tag|>"], [], [ContentDelta("<|python_tag|>")]),
    ("pythonic", ["[get_", "weather(city='Par"], [], [ContentDelta("[get_weather(city='Par")]),
    ("mistral", ["Ok [TOOL", "_CALLS]get_w"], [ContentDelta("Ok")], [ContentDelta(" [TOOL_CALLS]get_w")]),
    ("json", ["{", ' "tool_calls": [', '{"name"'], [], [ContentDelta('{ "tool_calls": [{"name"')]),
])
def test_held_back_until_known(fmt, pieces, held, released):
    """Text that may still start a call is held back while it may, and given back as content at the end."""
    stream = get_parser(fmt, TOOLS).stream()
    assert [e for piece in pieces for e in stream.feed(piece)] == held
    assert stream.finish() == released


@pytest.mark.parametrize("fmt, pieces, events", [
    ("json", ['{"ans'], [ContentDelta('{"ans')]),
    ("llama3_json", ['{"name": "get_tz'], [ContentDelta('{"name": "get_tz')]),
    ("llama3_json", ['{"name": "get_time", "id'], [ContentDelta('{"name": "get_time", "id')]),
    ("pythonic", ["[brack"], [ContentDelta("[brack")]),
    ("hermes", ["<tool_call>\nHello"], [ContentDelta("<tool_call>\nHello")]),
    ("mistral", ["[TOOL_CALLS]nope[A"], [ContentDelta("[TOOL_CALLS]nope[A")]),
])
def test_not_a_call_released_early(fmt, pieces, events):
    stream = get_parser(fmt, TOOLS).stream()
    assert [e for piece in pieces for e in stream.feed(piece)] == events


def test_broken_call_after_start():
    """A call the stream has begun is not taken back when the answer breaks it; parse() calls it content."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    stream = get_parser("hermes", TOOLS).stream()
    assert stream.feed(text) == [CallStart(0, "get_weather"), ArgumentsDelta(0, '{"city": "Pa')]
    assert stream.finish() == []
    assert get_parser("hermes", TOOLS).parse(text).calls == ()


CALLS = (ToolCall("get_weather", json.dumps({"city": "Zürich", "note": 'a } " {', "days": [1, 2]}, ensure_ascii=False)),
         ToolCall("get_time", "{}"), ToolCall("search", json.dumps({"exact": True, "limit": None, "f": {"x": 1.5}})))


@pytest.mark.parametrize("fmt", sorted(PARSERS))
@pytest.mark.parametrize("content", ["", "Checking the weather."])
def test_render_round_trip(fmt, content):
    parser = get_parser(fmt, TOOLS)
    if content and fmt in ("llama3_json", "pythonic", "json"):
        # A client's turn with content and calls still renders (the content, then the calls on their own line),
        # though no answer of a whole-answer format holds both: the model never wrote it, so it reads as text.
        assert parser.render(CALLS, content) == f"{content}\n{parser.render(CALLS)}"
        return
    text = parser.render(CALLS, content)
    assert parser.parse(text).calls == CALLS
    assert parser.parse(text).content == content
    _check_contract(fmt, text, _run(fmt, list(text)))
    assert parser.render([], content) == content


@pytest.mark.parametrize("fmt, text", [
    ("hermes", 'Hi\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'),
    ("llama3_json", '{"name": "get_time", "parameters": {"tz": "UTC"}}; {"name": "get_time", "parameters": {}}'),
    ("pythonic", '[get_time(tz="UTC", dst=False, at=None), get_time()]'),
    ("mistral", 'Hi\n[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "UTC"}}]'),
    ("json", '{"tool_calls": [{"name": "get_time", "arguments": {"tz": "UTC"}}, {"name": "get_time", '
     '"arguments": {}}]}'),
])
def test_render_is_canonical(fmt, text):
    parser = get_parser(fmt, TOOLS)
    parsed = parser.parse(text)
    assert parser.render(parsed.calls, parsed.content) == text


def test_get_parser_names_the_formats():
    with pytest.raises(ValueError, match="hermes.*llama3_json.*mistral.*pythonic"):
        get_parser("qwen", TOOLS)
    assert get_parser("hermes", TOOLS).name == "hermes"


@pytest.mark.parametrize("template, fmt", [
    ('{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>\n{"name": <function-name>}</tool_call>',
     "hermes"),
    ("{{ '[AVAILABLE_TOOLS]' }}{% if message.tool_calls %}[TOOL_CALLS][{% endif %}", "mistral"),
    ('<|start_header_id|>system<|end_header_id|>[func_name1(params_name1=params_value1), func_name2(params)]',
     "pythonic"),
    ("{%- if builtin_tools %}<|python_tag|>{% endif %}", "llama3_json"),
    ('<|start_header_id|>user<|end_header_id|>{% for t in tools %}{"name": ..., "parameters": ...}{% endfor %}',
     "llama3_json"),
    ("<|im_start|>{{ message.content }}<|im_end|>", "json"),
    ("", "json"),
    (None, "json"),
])
def test_detect_format(template, fmt):
    assert detect_format(template) == fmt


@pytest.mark.parametrize("text, start, end", [
    ('{"a": "}"} tail', 0, 10),
    ('x ["\\"]", {"b": []}]', 2, 20),
    ('"a\\"b" ', 0, 6),
    ("12, ", 0, 2),
    ('{"a": "}', 0, None),
    ('"abc\\', 0, None),
    ("true", 0, None),
])
def test_json_end(text, start, end):
    assert json_end(text, start) == end
