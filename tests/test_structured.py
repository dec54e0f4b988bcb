"""Structured output: request fields parse to a FormatSpec or fail naming the field; matchers mask exactly the
grammar's tokens (EOS only at the end, padding never); and greedy decoding of the real model under each format
always yields text that parses and validates."""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import torch

from kvreuse.layers.grammar_mask import apply_mask
from kvreuse.structured import (
    FormatSpec,
    GrammarCompiler,
    UnsupportedFormat,
    parse_format,
)

VOCAB = 49152  # SmolLM2's logits width, equal to its tokenizer's vocabulary


@pytest.fixture(scope="module")
def compiler(real_tokenizer) -> Iterator[GrammarCompiler]:
    compiler = GrammarCompiler(real_tokenizer, VOCAB)
    yield compiler
    compiler.close()


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def allowed(matcher, vocab_size: int = VOCAB) -> torch.Tensor:
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    matcher.fill_mask(mask)
    return mask


def eos_id(tokenizer) -> int:
    (eos,) = tokenizer.eos_token_ids
    return eos


def accept_text(matcher, tokenizer, text: str) -> None:
    for token in tokenizer._backend.encode(text, add_special_tokens=False).ids:
        matcher.accept(token)


# --- parse_format -------------------------------------------------------------------------------------------------
def test_free_text_is_no_format():
    assert parse_format(None) is None
    assert parse_format({"type": "text"}) is None


def test_each_field_gives_its_kind():
    assert parse_format({"type": "json_object"}) == FormatSpec("json_object", None)
    spec = parse_format(schema_format({"type": "object", "properties": {"a": {"type": "integer"}}}))
    assert spec.kind == "json_schema" and json.loads(spec.value)["properties"] == {"a": {"type": "integer"}}
    assert parse_format(None, guided_json='{"type": "integer"}') == FormatSpec("json_schema", '{"type":"integer"}')
    assert parse_format(None, guided_json={"type": "integer"}) == FormatSpec("json_schema", '{"type":"integer"}')
    assert parse_format(None, guided_regex="[0-9]+") == FormatSpec("regex", "[0-9]+")
    assert parse_format({"type": "text"}, guided_choice=["a", "b"]) == FormatSpec("choice", '["a", "b"]')
    # OpenAI makes the schema optional: then any JSON value conforms
    assert parse_format({"type": "json_schema", "json_schema": {"name": "x"}}) == FormatSpec("json_schema", "{}")


def test_a_spec_is_a_cache_key_that_crosses_processes():
    spec = parse_format(schema_format({"type": "object", "properties": {"a": {"type": "string"}}}))
    assert pickle.loads(pickle.dumps(spec)) == spec and hash(spec) == hash(FormatSpec(spec.kind, spec.value))
    error = pickle.loads(pickle.dumps(UnsupportedFormat("guided_regex", "bad")))
    assert error.field == "guided_regex" and str(error) == "bad"


@pytest.mark.parametrize(("kwargs", "field", "words"), [
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}}, "response_format",
     "name"),
    ({"response_format": schema_format([1])}, "response_format", "must be a JSON object"),
    ({"response_format": None, "guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"response_format": None, "guided_regex": "a{3,"}, "guided_regex", "guided_regex"),
    ({"response_format": None, "guided_regex": "(?=a)a"}, "guided_regex", "Lookahead"),
    ({"response_format": None, "guided_choice": []}, "guided_choice", "non-empty"),
    ({"response_format": None, "guided_choice": ["a", 1]}, "guided_choice", "strings"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "at most one"),
    ({"response_format": None, "guided_json": {}, "guided_choice": ["a"]}, "guided_choice", "at most one"),
])
def test_malformed_fields_are_refused_naming_the_field(kwargs, field, words):
    with pytest.raises(UnsupportedFormat, match=re.escape(words)) as caught:
        parse_format(**kwargs)
    assert caught.value.field == field


@pytest.mark.parametrize(("schema", "words"), [
    ({"type": "object", "patternProperties": {"^a": {"type": "string"}}},
     "json_schema: 'patternProperties' is not supported"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
     "json_schema: 'not' is not supported (at properties.a)"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "'oneOf' is not supported (use 'anyOf')"),
    ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "'allOf' with more than one schema"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "'uniqueItems' is not supported"),
    ({"type": "object", "if": {}, "then": {}}, "'if' is not supported"),
    ({"type": "array", "items": [{"type": "integer"}]}, "'items' as a list"),
    ({"type": "string", "format": "credit-card"}, "format 'credit-card' is not supported"),
    ({"$ref": "https://example.com/schema.json"}, "only local references"),
    ({"type": "string", "pattern": "^(?=a)a+$"}, "Lookahead"),
    ({"type": "strin"}, "unknown type 'strin'"),
])
def test_an_unsupported_schema_feature_is_named(schema, words):
    with pytest.raises(UnsupportedFormat, match=re.escape(words)) as caught:
        parse_format(schema_format(schema))
    assert caught.value.field == "response_format"
    with pytest.raises(UnsupportedFormat) as caught:
        parse_format(None, guided_json=schema)
    assert caught.value.field == "guided_json"


@pytest.mark.parametrize(("schema", "words"), [
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "json_schema: Cannot find field '$defs'"),
    ({"type": "string", "minLength": 5, "maxLength": 3}, "json_schema: "),
])
def test_a_schema_the_engine_cannot_read_is_refused_by_the_compilers_check(compiler, schema, words):
    # The engine reads a schema only once it is within the limits (its reading alone can take gigabytes).
    for spec, field in ((parse_format(schema_format(schema)), "response_format"),
                        (parse_format(None, guided_json=schema), "guided_json")):
        for step in (compiler.check, compiler.compile):
            with pytest.raises(UnsupportedFormat, match=re.escape(words)) as caught:
                step(spec)
            assert caught.value.field == field


def test_annotations_and_unknown_keywords_pass():
    schema = {"title": "T", "description": "d", "type": "object", "x-internal": 1, "nullable": True,
              "properties": {"a": {"type": "integer", "default": 1, "examples": [2], "uniqueItems": False}},
              "$defs": {"p": {"type": "string"}}}
    assert parse_format(schema_format(schema)).kind == "json_schema"


# --- matchers -----------------------------------------------------------------------------------------------------
def test_eos_is_masked_until_the_output_is_complete_then_it_is_the_only_choice(compiler, real_tokenizer):
    eos = eos_id(real_tokenizer)
    matcher = compiler.compile(parse_format(None, guided_choice=["yes", "no"])).matcher()
    assert not allowed(matcher)[eos] and not matcher.is_finished()
    accept_text(matcher, real_tokenizer, "yes")
    mask = allowed(matcher)
    assert mask.nonzero().view(-1).tolist() == [eos] and matcher.is_finished()
    matcher.accept(eos)
    assert matcher.is_finished() and allowed(matcher).nonzero().view(-1).tolist() == [eos]


def test_json_eos_only_after_the_closing_brace(compiler, real_tokenizer):
    eos = eos_id(real_tokenizer)
    matcher = compiler.compile(parse_format({"type": "json_object"})).matcher()
    text = '{"a": [1, {"b": null}], "c": "x'
    for token in real_tokenizer._backend.encode(text, add_special_tokens=False).ids:
        assert not allowed(matcher)[eos]
        matcher.accept(token)
    accept_text(matcher, real_tokenizer, '"}')
    assert allowed(matcher).nonzero().view(-1).tolist() == [eos] and matcher.is_finished()


def test_a_match_that_may_go_on_allows_eos_and_more(compiler, real_tokenizer):
    matcher = compiler.compile(parse_format(None, guided_regex="[0-9]+")).matcher()
    accept_text(matcher, real_tokenizer, "12")
    mask = allowed(matcher)
    digit = real_tokenizer._backend.encode("3", add_special_tokens=False).ids[0]
    assert mask[eos_id(real_tokenizer)] and mask[digit] and not matcher.is_finished()


def test_a_disallowed_token_raises_and_leaves_the_state_alone(compiler, real_tokenizer):
    matcher = compiler.compile(parse_format(None, guided_choice=["yes", "no"])).matcher()
    before = allowed(matcher)
    disallowed = int((~before).nonzero()[0])
    with pytest.raises(ValueError, match=f"token {disallowed} is not allowed"):
        matcher.accept(disallowed)
    with pytest.raises(ValueError):
        matcher.accept(eos_id(real_tokenizer))
    assert torch.equal(allowed(matcher), before)
    accept_text(matcher, real_tokenizer, "no")
    assert matcher.is_finished()


def test_padding_ids_past_the_tokenizer_are_never_allowed(real_tokenizer):
    padded = VOCAB + 40
    compiler = GrammarCompiler(real_tokenizer, padded)
    matcher = compiler.compile(parse_format({"type": "json_object"})).matcher()
    accept_text(matcher, real_tokenizer, '{"key": "inside a string almost any token fits')
    mask = allowed(matcher, padded)
    assert mask[:VOCAB].sum() > VOCAB // 2 and not mask[VOCAB:].any()
    logits = torch.zeros(1, padded)
    apply_mask(logits, [matcher])
    assert torch.isinf(logits[0, VOCAB:]).all()


def test_apply_mask_masks_exactly_the_disallowed_tokens_of_rows_with_a_matcher(compiler, real_tokenizer):
    structured = compiler.compile(parse_format(schema_format({"type": "object", "properties": {
        "name": {"type": "string"}}, "required": ["name"]}))).matcher()
    in_string = compiler.compile(parse_format({"type": "json_object"})).matcher()
    accept_text(in_string, real_tokenizer, '{"a": "b')
    logits = torch.randn(3, VOCAB)
    original = logits.clone()
    apply_mask(logits, [structured, None, in_string])
    for row, matcher in ((0, structured), (2, in_string)):
        mask = allowed(matcher)
        assert torch.equal(logits[row][mask], original[row][mask])
        assert torch.isneginf(logits[row][~mask]).all()
    assert torch.equal(logits[1], original[1])
    apply_mask(logits, [None, None, None])  # nothing to do
    with pytest.raises(ValueError):
        apply_mask(logits, [structured])


def test_compiled_grammars_are_cached_and_compiling_is_thread_safe(compiler):
    specs = [parse_format(None, guided_regex=f"[a-z]{{{n}}}") for n in range(1, 9)]
    with ThreadPoolExecutor(4) as pool:
        grammars = list(pool.map(compiler.compile, specs * 3))
    for spec, grammar in zip(specs * 3, grammars, strict=True):
        assert grammar.spec == spec
    assert compiler.compile(specs[0]) is compiler.compile(specs[0])


# --- greedy decoding with the real model --------------------------------------------------------------------------
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "editor", "viewer"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "role", "skills", "address"],
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "celsius": {"type": "number"},
                   "sunny": {"type": "boolean"}, "note": {"anyOf": [{"type": "string", "maxLength": 16},
                                                                    {"type": "null"}]}},
    "required": ["city", "celsius", "sunny", "note"],
}
MAX_TOKENS = 80


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    from kvreuse.weights.loader import embedded_model_path

    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def greedy(model, tokenizer, compiler, spec: FormatSpec, prompt: str) -> tuple[str, bool]:
    """Greedy decoding under the spec's grammar (KV-cached); the text and whether it ended on EOS."""
    matcher = compiler.compile(spec).matcher()
    ids = tokenizer.encode_chat(tokenizer.render_chat([{"role": "user", "content": prompt}]))
    inputs, cache, out = torch.tensor([ids]), None, []
    with torch.inference_mode():
        for _ in range(MAX_TOKENS):
            result = model(inputs, cache=cache, use_cache=True)
            cache, logits = result.cache, result.logits[:, -1].float()               # [1, vocab]
            apply_mask(logits, [matcher])
            token = int(logits[0].argmax())
            matcher.accept(token)
            if token in tokenizer.eos_token_ids:
                return tokenizer.decode(out), True
            out.append(token)
            inputs = torch.tensor([[token]])
    return tokenizer.decode(out), False


@pytest.mark.slow
@pytest.mark.parametrize(("schema", "prompt"), [
    (PERSON, "Describe a fictional software engineer as JSON with name, age, role, skills and address."),
    (WEATHER, "Give today's weather in Paris as JSON."),
    ({"type": "object", "properties": {"answer": {"type": "integer"}, "confidence": {"type": "string",
                                                                                     "enum": ["low", "high"]}},
      "required": ["answer", "confidence"]}, "What is 12 + 30? Answer in JSON."),
])
def test_greedy_decoding_under_a_schema_validates(hf_model, real_tokenizer, compiler, schema, prompt):
    text, ended = greedy(hf_model, real_tokenizer, compiler, parse_format(schema_format(schema)), prompt)
    assert ended, f"no EOS within {MAX_TOKENS} tokens: {text!r}"
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.slow
def test_greedy_decoding_as_json_object_parses_to_an_object(hf_model, real_tokenizer, compiler):
    text, ended = greedy(hf_model, real_tokenizer, compiler, parse_format({"type": "json_object"}),
                         "Describe a cat as a JSON object with keys name and age.")
    assert ended, f"no EOS within {MAX_TOKENS} tokens: {text!r}"
    assert isinstance(json.loads(text), dict)


@pytest.mark.slow
def test_greedy_decoding_under_a_regex_and_a_choice_matches(hf_model, real_tokenizer, compiler):
    text, ended = greedy(hf_model, real_tokenizer, compiler,
                         parse_format(None, guided_regex=r"[0-9]{3}-[0-9]{4}"), "Make up a short phone number.")
    assert ended and re.fullmatch(r"[0-9]{3}-[0-9]{4}", text), text
    choices = ["positive", "negative", "neutral"]
    text, ended = greedy(hf_model, real_tokenizer, compiler, parse_format(None, guided_choice=choices),
                         "Sentiment of 'I love this phone, it is wonderful!'?")
    assert ended and text in choices, text


def test_the_gpu_masking_path_agrees_with_the_cpu_path(compiler, real_tokenizer):
    """The path for logits on an accelerator is plain torch: run here on CPU tensors to check it masks the same."""
    from kvreuse.layers.grammar_mask import _apply_device, bitmask_words

    matcher = compiler.compile(parse_format({"type": "json_object"})).matcher()
    accept_text(matcher, real_tokenizer, '{"a": ')
    bitmask = torch.empty((1, bitmask_words(VOCAB)), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    logits = torch.randn(2, VOCAB)
    expected = logits.clone()
    apply_mask(expected, [None, matcher])
    _apply_device(logits, bitmask, [1], VOCAB)
    assert torch.equal(logits, expected)


def test_the_http_app_imports_no_grammar_library_until_a_format_is_asked_for():
    # xgrammar imports transformers (~0.5 s of a server's start); the structured names load on first use.
    script = ("import sys; import kvreuse.server.app; import kvreuse.structured.errors; "
              "print(sorted(m for m in ('xgrammar', 'transformers') if m in sys.modules)); "
              "from kvreuse.structured import GrammarCompiler; print('xgrammar' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["[]", "True"]
