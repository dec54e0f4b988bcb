"""What a response format may cost: over `structured.max_schema_bytes` or `structured.max_schema_properties`, or
compiling past `structured.compile_timeout_s`, it is refused with a 400 (the engine API: UnsupportedFormat) naming
the field, the limit and its key; a compile past the deadline is killed, so nothing of it keeps running; and the
compiled grammars kept stay within `structured.grammar_cache_mb`, by xgrammar's own size of each."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import jsonschema
import pytest

from kvreuse.background import BACKGROUND_NICENESS
from kvreuse.config import StructuredConfig
from kvreuse.structured import GrammarCompiler, UnsupportedFormat, parse_format
from kvreuse.structured.compile_call import compile_format

from .helpers import app_server, greedy, tiny_engine, tiny_llm
from .server_process import http_client

VOCAB = 49152  # SmolLM2's logits width
# The audit's memory case: a 30,000-value enum (~620 KB of schema, ~150 MB compiled).
HUGE_ENUM = {"enum": [f"value number {i}" for i in range(30_000)]}
# 600 optional properties (~13 KB): over the default 500; ~1.2 s to compile, 1,000 would take ~9 s.
MANY_PROPERTIES = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}
# 6 KB that xgrammar takes minutes to compile (measured 281 s): minProperties over 250 optional properties.
SLOW = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(250)}, "minProperties": 2}
SMALL = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "A city, as JSON."}], "max_tokens": 24,
            "temperature": 0, **fields}


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    """The real app over HTTP with the default limits (and the default compile timeout of 5 s)."""
    engine = tiny_engine(tiny_model_dir)
    with app_server(engine, timeout=60.0) as (_, root), http_client(120.0) as http:
        yield engine, root, http
    engine.front_end.grammars.close()


def refusal(http, root: str, **fields) -> dict:
    response = http.post(f"{root}/v1/chat/completions", json=chat(**fields))
    assert response.status_code == 400, response.text[:500]
    return response.json()["error"]


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"response_format": schema_format(HUGE_ENUM)}, "response_format",
     f"the schema is {len(json.dumps(HUGE_ENUM, separators=(',', ':')))} bytes"),
    ({"guided_regex": "(" + "|".join(f"word{i}" for i in range(5000)) + ")"}, "guided_regex", "the regex is"),
    ({"guided_choice": [f"choice {i}" for i in range(5000)]}, "guided_choice", "the list of choices is"),
])
def test_a_format_over_the_byte_limit_is_a_400_naming_the_limit_and_its_key(server, fields, param, words):
    _, root, http = server
    error = refusal(http, root, **fields)
    assert error["param"] == param and words in error["message"], error
    assert "at most 32768 allowed (structured.max_schema_bytes)" in error["message"], error


def test_a_schema_over_the_property_limit_is_a_400_naming_the_limit_and_its_key(server):
    _, root, http = server
    error = refusal(http, root, guided_json=MANY_PROPERTIES)
    assert error["param"] == "guided_json"
    assert "declares 600 properties, at most 500 allowed (structured.max_schema_properties)" in error["message"]
    # Summed over every object of the schema, $defs included.
    spread = {"type": "object", "properties": {f"a{i}": {"$ref": "#/$defs/item"} for i in range(300)},
              "$defs": {"item": {"type": "object", "properties": {f"b{i}": {"type": "integer"} for i in range(201)}}}}
    error = refusal(http, root, response_format=schema_format(spread))
    assert error["param"] == "response_format" and "declares 501 properties" in error["message"], error


def test_a_compile_past_the_timeout_is_a_400_and_leaves_nothing_running(server):
    engine, root, http = server
    http.post(f"{root}/v1/chat/completions", json=chat(response_format=schema_format(SMALL)))  # check process up
    start = time.monotonic()
    error = refusal(http, root, response_format=schema_format(SLOW))
    waited = time.monotonic() - start
    assert error["param"] == "response_format", error
    assert "takes longer than 5 s to compile (structured.compile_timeout_s)" in error["message"], error
    assert 5.0 <= waited < 15.0, waited
    # The compile was killed with its process: this process spends no CPU on it afterwards.
    cpu = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - cpu < 0.3
    assert engine.front_end.grammars.check_process.kills == 1
    assert engine.front_end.grammars.cache.get(parse_format(schema_format(SLOW))) is None
    # Asked again, it is refused at once; and other formats compile as before.
    start = time.monotonic()
    again = refusal(http, root, guided_json=SLOW)
    assert again["param"] == "guided_json" and "structured.compile_timeout_s" in again["message"]
    assert time.monotonic() - start < 1.0
    answer = http.post(f"{root}/v1/chat/completions", json=chat(response_format=schema_format(SMALL)))
    assert answer.status_code == 200, answer.text
    jsonschema.validate(json.loads(answer.json()["choices"][0]["message"]["content"]), SMALL)


def test_the_engine_api_refuses_a_format_over_each_limit_naming_the_field_and_key(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir, structured__compile_timeout_s="1", structured__max_schema_bytes="4096",
                   structured__max_schema_properties="100")
    cases = [(parse_format(None, guided_choice=[f"choice {i}" for i in range(1000)]), "guided_choice",
              "at most 4096 allowed (structured.max_schema_bytes)"),
             (parse_format(schema_format({"type": "object", "properties": {f"p{i}": {} for i in range(101)}})),
              "response_format", "declares 101 properties, at most 100 allowed (structured.max_schema_properties)"),
             (parse_format(None, guided_json={"type": "string", "pattern": "a{10000}"}),  # 17 s, measured
              "guided_json", "takes longer than 1 s to compile (structured.compile_timeout_s)")]
    try:
        for spec, field, words in cases:
            with pytest.raises(UnsupportedFormat, match=r"\(structured\.") as caught:
                llm.engine.add_request("Name a city.", greedy(4), response_format=spec)
            assert caught.value.field == field and words in str(caught.value), str(caught.value)
        assert not llm.engine.has_unfinished()
        [out] = llm.generate("Name a city.", greedy(4))  # the engine serves on
        assert out.finish_reason == "length"
    finally:
        llm.engine.front_end.grammars.close()


def enum_spec(tag: int, values: int = 3000):
    return parse_format(None, guided_json={"enum": [f"{tag}-{i}-value" for i in range(values)]})


def test_the_grammar_cache_stays_under_its_byte_budget_after_many_large_enums(real_tokenizer):
    # A count of entries bounded nothing: ten 30,000-value enums kept 911 MB. Here 1 MB holds two of these (~390 KB).
    limits = StructuredConfig(grammar_cache_mb=1, compile_timeout_s=0.0, max_schema_bytes=2**20)
    compiler = GrammarCompiler(real_tokenizer, VOCAB, limits)
    compiled = [compiler.compile(enum_spec(tag)) for tag in range(10)]
    sizes = [grammar.memory_bytes for grammar in compiled]
    assert min(sizes) > 300_000 and sum(sizes) > 3 * compiler.cache.budget_bytes, sizes
    compiler.cache.check_integrity()  # its accounting is the sum of xgrammar's sizes of what it keeps
    assert 0 < compiler.cache.bytes <= compiler.cache.budget_bytes == 2**20
    assert compiler.cache.get(compiled[-1].spec) is compiled[-1]      # the most recent stay
    assert compiler.cache.get(compiled[0].spec) is None               # the least recent went first
    assert compiler.compile(compiled[0].spec) is not compiled[0]      # so it is compiled again
    # One grammar larger than the whole budget is used, and not kept (nothing else is dropped for it).
    kept = len(compiler.cache)
    huge = compiler.compile(enum_spec(99, values=12_000))
    assert huge.memory_bytes > compiler.cache.budget_bytes and compiler.cache.get(huge.spec) is None
    assert len(compiler.cache) == kept
    compiler.cache.check_integrity()


@pytest.mark.skipif(sys.platform != "linux", reason="thread priorities are per thread on Linux only")
def test_both_compiles_of_a_format_run_at_low_priority_and_serving_keeps_its_own(real_tokenizer, monkeypatch):
    # A large schema keeps xgrammar's threads busy for seconds (twice): on 2 cores, at the serving threads'
    # priority, another tenant's one-token request waited 308 ms for them (tests/test_tenant_fairness.py).
    compiler = GrammarCompiler(real_tokenizer, VOCAB, StructuredConfig())
    seen = []

    def compile_and_note(*args):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return compile_format(*args)

    monkeypatch.setattr("kvreuse.structured.compiler.compile_format", compile_and_note)
    try:
        compiler.compile(parse_format(schema_format(SMALL)))
        assert seen == [BACKGROUND_NICENESS]                                          # the compile for use
        assert os.getpriority(os.PRIO_PROCESS, compiler.check_process.pid) == BACKGROUND_NICENESS  # the check
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == 0        # the caller's thread
    finally:
        compiler.close()
