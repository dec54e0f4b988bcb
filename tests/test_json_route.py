"""Request bodies are parsed by pydantic-core, with the json module's values and errors (server/json_route.py)."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvreuse.server import json_route
from kvreuse.server.json_route import FastJSONRequest

from .helpers import app_server, tiny_engine
from .server_process import http_client

# Any character, lone surrogates included (legal in JSON as escapes, refused by pydantic-core: the json module's).
TEXT = st.text(st.characters(codec=None, categories=None), max_size=20)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4), max_leaves=20)


def parsed(body: bytes):
    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    request = FastJSONRequest({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)
    return asyncio.run(request.json())


def same(a, b) -> bool:
    """Equal values of equal types (1 is not 1.0, nor True), all the way down."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@given(JSON_VALUES, st.booleans())
def test_a_body_parses_to_what_the_json_module_reads(value, ensure_ascii):
    body = json.dumps(value, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")
    assert same(parsed(body), json.loads(body))


@pytest.mark.parametrize("body", [b'{"model": "m", "prompt": "hi",', b"", b'{"a": 1} x', b"[1, 2"])
def test_a_malformed_body_raises_the_json_modules_error(body):
    with pytest.raises(json.JSONDecodeError):  # what FastAPI turns into its json_invalid error
        parsed(body)


def test_a_valid_body_is_not_parsed_by_the_json_module(monkeypatch):
    def refuse(*_):
        raise AssertionError("the json module parsed a body pydantic-core reads")

    monkeypatch.setattr(json_route.json, "loads", refuse)
    prompt = "harbour " * 20_000
    assert parsed(json.dumps({"model": "m", "prompt": prompt}).encode()) == {"model": "m", "prompt": prompt}


def test_the_served_routes_parse_bodies_with_pydantic_core(tiny_model_dir, monkeypatch):
    def refuse(*_):
        raise AssertionError("the json module parsed a body pydantic-core reads")

    with app_server(tiny_engine(tiny_model_dir)) as (_, root), http_client(30.0) as client:
        monkeypatch.setattr(json_route.json, "loads", refuse)
        for path, body in [("/v1/completions", {"model": "tiny", "prompt": "Once upon", "max_tokens": 2}),
                           ("/v1/chat/completions", {"model": "tiny", "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "Hi"}]}),
                           ("/tokenize", {"model": "tiny", "prompt": "Once upon"})]:
            answer = client.post(root + path, json=body)
            assert answer.status_code == 200, (path, answer.text)
        # What pydantic-core refuses still goes to the json module, and so gets the json module's answer.
        monkeypatch.undo()
        surrogate = b'{"model": "tiny", "prompt": "\\ud800", "max_tokens": 1}'
        answer = client.post(root + "/v1/completions", content=surrogate, headers={"content-type": "application/json"})
        assert answer.status_code == 400 and "lone surrogate" in answer.text, answer.text
