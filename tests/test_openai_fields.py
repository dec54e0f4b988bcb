"""The OpenAI fields real clients send, through the real `openai` SDK against `kvreuse serve` on the real model:
logprobs, echo with prompt logprobs (the same with caching on and off), n (whole and streamed), structured output,
batched prompts, max_completion_tokens, sampling fields, tools refused by name."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from .server_process import start_server

CONTEXT = ("Port Elling's library opens at nine on weekdays and at ten on Saturdays. Members may borrow up to twelve "
           "books for three weeks and renew them twice, unless another member has reserved them. The reading room "
           "on the second floor is quiet, and the café on the ground floor serves tea until four. ") * 3
QUESTION = "\nQuestion: How long may members keep a book?\nAnswer:"
CHOICES = [" three weeks", " twelve days", " until four", " on Saturdays"]
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                                      "member": {"type": "boolean"}}, "required": ["name", "age", "member"]},
    {"type": "object", "properties": {"day": {"enum": ["monday", "saturday"]}, "opens": {"type": "integer"},
                                      "rooms": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                "maxItems": 2}},
     "required": ["day", "opens", "rooms"]},
    {"type": "object", "properties": {"book": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 30}, "weeks": {"type": "integer"}}, "required": ["title", "weeks"]}},
     "required": ["book"]},
]


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server-logs") / "openai-fields.log"
    with start_server("--dtype", "fp32", "--set", "engine.num_kv_blocks=512", log_path=log) as server:
        yield server


@pytest.fixture(scope="module")
def client(real_server):
    with openai.OpenAI(base_url=real_server.base_url, api_key="unused", max_retries=0, timeout=180.0,
                       http_client=openai.DefaultHttpxClient(trust_env=False)) as client:
        yield client


def score(client, model, use_cache: bool):
    return client.completions.create(model=model, prompt=[CONTEXT + QUESTION + c for c in CHOICES], max_tokens=1,
                                     echo=True, logprobs=1, temperature=0, extra_body={"use_cache": use_cache})


def test_echo_logprobs_are_the_same_with_caching_on_and_off(client, real_server):
    first = score(client, real_server.model, use_cache=True)   # computes the context, stores its logprobs
    cached = score(client, real_server.model, use_cache=True)
    fresh = score(client, real_server.model, use_cache=False)
    assert [c.index for c in cached.choices] == [0, 1, 2, 3]
    assert cached.usage.prompt_tokens_details.cached_tokens > 0
    assert fresh.usage.computed_prompt_tokens == fresh.usage.prompt_tokens
    # The batch's first prompt computes the context and the others wait a step to reuse it with its logprobs;
    # once stored, each prompt computes one block of the context again (its last row) and its answer.
    assert first.usage.computed_prompt_tokens < fresh.usage.prompt_tokens / 2
    assert cached.usage.computed_prompt_tokens < fresh.usage.prompt_tokens / 4
    for a, b, choice in zip(cached.choices, fresh.choices, CHOICES, strict=True):
        assert a.text.startswith(CONTEXT + QUESTION + choice)
        lp, lq = a.logprobs, b.logprobs
        assert lp.tokens == lq.tokens and lp.text_offset == lq.text_offset
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(lq.token_logprobs[1:], abs=1e-4)
        assert "".join(lp.tokens) == a.text
        for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
            assert top[token] == pytest.approx(value) and len(top) <= 2  # the best, and the token itself
    # What lm-eval scores: the answer's tokens, the same choice either way; the right answer wins here.
    sums = [[sum(c.logprobs.token_logprobs[-len(choice) - 1:-1]) for c in r.choices] for r in (cached, fresh)]
    assert max(range(4), key=sums[0].__getitem__) == max(range(4), key=sums[1].__getitem__)


def test_scoring_a_prompt_without_generating(client, real_server):
    reply = client.completions.create(model=real_server.model, prompt=CONTEXT, max_tokens=0, echo=True, logprobs=0)
    choice = reply.choices[0]
    assert choice.text == CONTEXT and choice.finish_reason == "length" and reply.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == reply.usage.prompt_tokens


def test_chat_logprobs_with_alternatives(client, real_server):
    reply = client.chat.completions.create(model=real_server.model, messages=[{"role": "user", "content": "Hi!"}],
                                           max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token  # greedy: the best
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
    assert "".join(e.token for e in content) == reply.choices[0].message.content


def test_n_choices_whole_and_streamed(client, real_server):
    request = dict(model=real_server.model, messages=[{"role": "user", "content": "Name a color."}], max_tokens=6,
                   temperature=1.0, seed=4, n=3, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**request)
    assert sorted(c.index for c in whole.choices) == [0, 1, 2]
    assert whole.usage.completion_tokens == 18  # counted over every choice
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    usage = None
    for chunk in client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}  # same seeds, same choices
    assert set(finished) == {0, 1, 2} and usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.message.content for c in whole.choices}) > 1


@pytest.mark.parametrize("schema", SCHEMAS, ids=["flat", "enum-array", "nested"])
def test_structured_output_parses_and_validates(client, real_server, schema):
    reply = client.chat.completions.create(
        model=real_server.model, messages=[{"role": "user", "content": "Describe a library member as JSON."}],
        max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


def test_json_object_and_refused_schemas(client, real_server):
    reply = client.chat.completions.create(model=real_server.model, max_tokens=60, temperature=0,
                                           messages=[{"role": "user", "content": "Give me a JSON object."}],
                                           response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=real_server.model, messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
                                           "type": "object", "patternProperties": {"^a": {"type": "string"}}}}})
    assert "patternProperties" in error.value.body["message"] and error.value.body["param"] == "response_format"


def test_batched_token_prompts_and_max_completion_tokens(client, real_server):
    ids = [[1, 504, 3012, 282], [1, 504, 3012, 282, 253, 1463]]
    reply = client.completions.create(model=real_server.model, prompt=ids, max_tokens=50, temperature=0,
                                      extra_body={"max_completion_tokens": 3, "ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.usage.completion_tokens == 6 and reply.usage.prompt_tokens == 10
    alone = client.completions.create(model=real_server.model, prompt=ids[1], max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert alone.choices[0].text == reply.choices[1].text


def test_sampling_fields_over_the_wire(client, real_server):
    forced = 504
    reply = client.completions.create(model=real_server.model, prompt="Hello", max_tokens=4, temperature=0,
                                      logit_bias={str(forced): 100}, logprobs=0, presence_penalty=0.0)
    assert reply.choices[0].logprobs.tokens == [client.completions.create(
        model=real_server.model, prompt=[forced], max_tokens=0, echo=True, logprobs=0).choices[0].text] * 4
    penalized = client.completions.create(model=real_server.model, prompt="Hello", max_tokens=4, temperature=0,
                                          logit_bias={str(forced): 100}, frequency_penalty=2.0,
                                          extra_body={"repetition_penalty": 2.0, "min_tokens": 2,
                                                      "stop_token_ids": [2]})
    assert penalized.usage.completion_tokens >= 2
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=real_server.model, prompt="Hello", logit_bias={"99999999": 1})
    assert error.value.body["param"] == "logit_bias"


def test_a_tool_choice_naming_no_tool_is_refused_by_name(client, real_server):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=real_server.model, messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
                                       tool_choice={"type": "function", "function": {"name": "g"}})
    assert error.value.body["param"] == "tool_choice" and "'g'" in error.value.body["message"]


def test_streamed_batch_with_echo_matches_the_whole_answer(client, real_server):
    request = dict(model=real_server.model, prompt=["The river", "A small fort"], max_tokens=4, temperature=0,
                   echo=True, logprobs=1)
    whole = client.completions.create(**request)
    texts: dict[int, str] = {}
    tokens: dict[int, list] = {}
    for chunk in client.completions.create(**request, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens if choice.logprobs else [])
    assert texts == {c.index: c.text for c in whole.choices}
    assert tokens == {c.index: c.logprobs.tokens for c in whole.choices}
    assert whole.choices[1].text.startswith("A small fort")
