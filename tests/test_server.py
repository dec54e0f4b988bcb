"""The OpenAI-compatible HTTP server, end to end: `kvreuse serve` runs as a real subprocess on 127.0.0.1 and is
driven with the `openai` client (happy paths) and httpx (raw, bad and interrupted requests).

Servers: the real SmolLM2-135M in fp32 (slow tests, compared with the offline engine), and the tiny random-weight
model of conftest in several configurations (default, API keys, max_queue=2, truncate=oldest, and a fresh one for
SIGTERM). Each configuration starts once; every wait below is bounded in time and in count.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from kvreuse.sampling_params import SamplingParams

from .helpers import doc_block, server_args
from .server_process import (
    READY,
    REPO_ROOT,
    Metrics,
    Server,
    http_client,
    read_stream,
    sse_events,
    start_long_requests,
    start_server,
    stop,
)

BLOCK_SIZE = 16  # cache.block_size default: prefix-cache hits come in whole blocks
SYSTEM = ("You are a concise assistant for the city library of Port Elling. You answer questions about opening "
          "hours, borrowing rules and events. Keep answers short, friendly and factual, and never invent details.")


def readme_block(language: str, containing: str) -> str:
    """The README's fenced ```language block (plain ``` for language "") that contains `containing`."""
    return doc_block(REPO_ROOT / "README.md", language, containing)


# --- servers and clients ---------------------------------------------------------------------------------
def serve(tmp_path_factory, name: str, *args: str):
    log = tmp_path_factory.mktemp("server-logs") / f"{name}.log"
    return start_server(*args, log_path=log)


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    # fp32 and the same pool size as the offline `real_llm` fixture, so greedy outputs match it exactly.
    with serve(tmp_path_factory, "real", "--dtype", "fp32", "--set", "engine.num_kv_blocks=512") as server:
        yield server


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory, tiny_model_dir):
    with serve(tmp_path_factory, "tiny", *server_args(tiny_model_dir)) as server:
        yield server


@pytest.fixture(scope="module")
def client_for():
    """client_for(server, api_key) -> an `openai.OpenAI` for that server (no retries, no proxy), closed at the end."""
    clients: dict[tuple[str, str], openai.OpenAI] = {}

    def get(server: Server, api_key: str = "unused") -> openai.OpenAI:
        key = (server.base_url, api_key)
        if key not in clients:
            clients[key] = openai.OpenAI(base_url=server.base_url, api_key=api_key, max_retries=0, timeout=120.0,
                                         http_client=openai.DefaultHttpxClient(trust_env=False))
        return clients[key]

    yield get
    for client in clients.values():
        client.close()


@pytest.fixture(scope="module")
def http():
    with http_client(120.0) as client:
        yield client


def post(client: httpx.Client, server: Server, path: str, body: dict, **kwargs) -> httpx.Response:
    """POST /chat/completions and /completions under /v1; /tokenize and /detokenize at the root."""
    base = server.base_url if path in ("/chat/completions", "/completions") else server.root
    return client.post(f"{base}{path}", json=body, **kwargs)


def assert_error(response: httpx.Response, status: int, *needles: str, param: str | None = "any") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    for needle in needles:
        assert needle in error["message"], f"{needle!r} not in {error['message']!r}"
    if param != "any":
        assert error["param"] == param, error
    return error


def assert_serving(client: httpx.Client, server: Server) -> None:
    """A small good request still succeeds."""
    r = post(client, server, "/completions", {"model": server.model, "prompt": "Hello", "max_tokens": 2,
                                              "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def wait_idle(server: Server, timeout: float = 10.0) -> Metrics:
    """Poll until nothing runs or waits and no KV block is held by a request; assert it got there."""
    m = server.model

    def idle(scrape: Metrics) -> bool:
        return (scrape.get("vllm:num_requests_running", model_name=m) == 0
                and scrape.get("vllm:num_requests_waiting", model_name=m) == 0
                and scrape.get("vllm:kv_cache_usage_perc", model_name=m) == 0)

    scrape = server.wait_for(idle, timeout)
    assert scrape.get("vllm:num_requests_running", model_name=m) == 0, "requests still counted as running"
    assert scrape.get("vllm:num_requests_waiting", model_name=m) == 0, "requests still counted as waiting"
    assert scrape.get("vllm:kv_cache_usage_perc", model_name=m) == 0, "KV blocks still held by requests"
    return scrape


def wait_running(server: Server, count: int, timeout: float = 20.0) -> None:
    scrape = server.wait_for(lambda s: s.get("vllm:num_requests_running", model_name=server.model) >= count,
                             timeout, interval=0.05)
    assert scrape.get("vllm:num_requests_running", model_name=server.model) >= count, "request never started"


def aborts(scrape: Metrics, server: Server) -> float:
    return scrape.get_or_zero("vllm:request_success_total", model_name=server.model, finished_reason="abort")


# --- 1. the real model: the server's greedy output is the offline engine's --------------------------------
@pytest.mark.slow
class TestRealModel:
    MAX_TOKENS = 16

    def test_chat_plain_and_streamed_equal_offline_greedy(self, real_server, real_llm, client_for):
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "What can I borrow from a library?"}]
        expected = real_llm.chat(messages, SamplingParams(max_tokens=self.MAX_TOKENS))[0]
        assert expected.text
        client = client_for(real_server)

        reply = client.chat.completions.create(model=real_server.model, messages=messages,
                                               max_tokens=self.MAX_TOKENS, temperature=0)
        assert reply.object == "chat.completion" and reply.model == real_server.model
        assert reply.choices[0].message.role == "assistant"
        assert reply.choices[0].message.content == expected.text
        assert reply.choices[0].finish_reason == expected.finish_reason
        assert reply.usage.prompt_tokens == expected.usage.prompt_tokens
        assert reply.usage.completion_tokens == expected.usage.completion_tokens
        assert reply.usage.total_tokens == expected.usage.prompt_tokens + expected.usage.completion_tokens

        pieces, finish, usage, ids = [], None, None, set()
        stream = client.chat.completions.create(model=real_server.model, messages=messages,
                                                max_tokens=self.MAX_TOKENS, temperature=0, stream=True,
                                                stream_options={"include_usage": True})
        for chunk in stream:
            ids.add(chunk.id)
            if chunk.usage is not None:
                assert chunk.choices == []
                usage = chunk.usage
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        assert len(ids) == 1
        assert "".join(pieces) == expected.text
        assert finish == expected.finish_reason
        assert usage is not None and usage.completion_tokens == expected.usage.completion_tokens
        assert usage.prompt_tokens == expected.usage.prompt_tokens

    def test_completion_plain_and_streamed_equal_offline_greedy(self, real_server, real_llm, client_for):
        prompt = "The three primary colors are"
        expected = real_llm.generate(prompt, SamplingParams(max_tokens=self.MAX_TOKENS))[0]
        client = client_for(real_server)

        reply = client.completions.create(model=real_server.model, prompt=prompt, max_tokens=self.MAX_TOKENS,
                                          temperature=0)
        assert reply.object == "text_completion"
        assert reply.choices[0].text == expected.text
        assert reply.choices[0].finish_reason == expected.finish_reason
        assert reply.usage.prompt_tokens == expected.usage.prompt_tokens

        pieces, finish = [], None
        for chunk in client.completions.create(model=real_server.model, prompt=prompt, max_tokens=self.MAX_TOKENS,
                                               temperature=0, stream=True):
            assert chunk.usage is None  # no include_usage: no usage chunk
            for choice in chunk.choices:
                pieces.append(choice.text)
                finish = choice.finish_reason or finish
        assert "".join(pieces) == expected.text
        assert finish == expected.finish_reason

    def test_repeated_request_is_served_from_the_prefix_cache(self, real_server, client_for):
        client = client_for(real_server)
        # A nonce first, so nothing earlier in this server's life shares even the first block.
        messages = [{"role": "system", "content": f"[{uuid.uuid4().hex}] {SYSTEM}"},
                    {"role": "user", "content": "When are you open on Sundays?"}]
        replies = [client.chat.completions.create(model=real_server.model, messages=messages, max_tokens=8,
                                                  temperature=0) for _ in range(2)]
        first, second = (r.usage for r in replies)
        assert first.prompt_tokens_details.cached_tokens == 0
        assert second.prompt_tokens == first.prompt_tokens > 2 * BLOCK_SIZE
        # Every full block of the prompt except the one holding the last token (which is always computed).
        assert second.prompt_tokens_details.cached_tokens == (second.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert second.model_extra["computed_prompt_tokens"] == (second.prompt_tokens
                                                                - second.prompt_tokens_details.cached_tokens)
        assert replies[1].choices[0].message.content == replies[0].choices[0].message.content

    def test_the_readmes_curl_call_answers_as_written(self, real_server):
        command = readme_block("bash", "curl ")
        assert "localhost:8000" in command and real_server.model in command
        command = command.replace("localhost:8000", real_server.root.removeprefix("http://"))
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        body = json.loads(done.stdout)
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"].strip()
        assert body["usage"]["prompt_tokens"] > 0 and 0 < body["usage"]["completion_tokens"] <= 32

    def test_the_readmes_python_snippet_runs_as_written(self, real_server):
        code = readme_block("python", "OpenAI(")
        assert "http://127.0.0.1:8000/v1" in code
        code = code.replace("http://127.0.0.1:8000/v1", real_server.base_url)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
        assert done.returncode == 0, done.stderr
        *reply, cached_tokens = done.stdout.strip().splitlines()
        assert "".join(reply).strip() and cached_tokens.isdigit()

    def test_the_readmes_ready_line_is_the_servers(self, real_server):
        documented, settings = readme_block("", "kvreuse ready:").strip().splitlines()
        served = real_server.ready_line
        assert READY.search(documented) and READY.search(served)
        assert [f.split("=")[0] for f in documented.split() if "=" in f] == \
            [f.split("=")[0] for f in served.split() if "=" in f]
        defaults = "kvreuse settings: defaults: exact prefix reuse only, LRU eviction; decode step "
        assert settings.startswith(defaults) and real_server.settings_line.startswith(defaults)

    def test_raw_stream_framing_with_usage_and_done(self, real_server, http):
        body = {"model": real_server.model, "messages": [{"role": "user", "content": "Say hello."}],
                "max_tokens": 8, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        with http.stream("POST", f"{real_server.base_url}/chat/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = list(sse_events(r))
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert len({c["id"] for c in chunks}) == 1
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        usage_chunk, finish_chunk = chunks[-1], chunks[-2]
        assert usage_chunk["choices"] == []
        assert finish_chunk["choices"][0]["finish_reason"] in ("stop", "length")
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
        usage = usage_chunk["usage"]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
        plain = post(http, real_server, "/chat/completions", {**body, "stream": False}).json()
        assert text == plain["choices"][0]["message"]["content"]
        assert usage["completion_tokens"] == plain["usage"]["completion_tokens"]
        assert usage["prompt_tokens"] == plain["usage"]["prompt_tokens"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert "cached_tokens" in usage["prompt_tokens_details"]


# --- 2, 3, 4, 7, 10: the tiny model with the default configuration ----------------------------------------
class TestMetrics:
    COUNTERS = {  # metric -> the usage number each finished request adds to it
        "vllm:prompt_tokens_total": "prompt_tokens",
        "vllm:generation_tokens_total": "completion_tokens",
        "vllm:prefix_cache_queries_total": "prompt_tokens",
        "vllm:prefix_cache_hits_total": "cached_tokens",
        "kvreuse:computed_prompt_tokens_total": "computed_prompt_tokens",
    }

    def usage_numbers(self, usage: dict) -> dict:
        return {**usage, "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}

    def test_counters_move_by_each_requests_usage(self, tiny_server, http):
        m = tiny_server.model
        messages = [{"role": "system", "content": f"[{uuid.uuid4().hex}] {SYSTEM}"},
                    {"role": "user", "content": "Tell me about events."}]
        seen_hits = False
        for stream in (False, False, True):  # cold, then warm (cache hits), then warm and streamed
            before = tiny_server.metrics()
            body = {"model": m, "messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                    "stream": stream, "stream_options": {"include_usage": True}}
            if stream:
                with http.stream("POST", f"{tiny_server.base_url}/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    usage = read_stream(r)["usage"]
            else:
                r = post(http, tiny_server, "/chat/completions", body)
                assert r.status_code == 200, r.text
                usage = r.json()["usage"]
            numbers = self.usage_numbers(usage)
            assert numbers["computed_prompt_tokens"] == numbers["prompt_tokens"] - numbers["cached_tokens"]
            seen_hits |= numbers["cached_tokens"] > 0
            after = tiny_server.metrics()
            for metric, field in self.COUNTERS.items():
                delta = after.get(metric, model_name=m) - before.get(metric, model_name=m)
                assert delta == numbers[field], f"{metric} moved by {delta}, the request's {field} is {numbers[field]}"
            for histogram in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count"):
                assert after.get(histogram, model_name=m) - before.get_or_zero(histogram, model_name=m) == 1
            success = "vllm:request_success_total"
            assert (after.get(success, model_name=m, finished_reason="length")
                    - before.get_or_zero(success, model_name=m, finished_reason="length")) == 1
        assert seen_hits, "the repeated request never hit the prefix cache"

    def test_gauges_and_format(self, tiny_server, http):
        r = http.get(f"{tiny_server.root}/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        Metrics.parse(r.text)  # every line parses
        scrape = wait_idle(tiny_server)  # and the gauges read 0 once nothing runs
        assert scrape.get("kvreuse:peak_rss_bytes", model_name=tiny_server.model) > 0
        assert re.search(r"^# TYPE vllm:prompt_tokens(_total)? counter$", r.text, re.M)

    def test_health(self, tiny_server, http):
        r = http.get(f"{tiny_server.root}/health")
        assert r.status_code == 200 and r.json() == {"status": "ok", "compile": "eager"}  # engine.compile = off
        scrape = tiny_server.metrics()
        assert scrape.get("kvreuse:decode_compile_state", model_name=tiny_server.model, state="eager") == 1
        assert scrape.get("kvreuse:decode_compile_state", state="compiling") == 0

    def test_the_settings_line_says_defaults(self, tiny_server):
        assert tiny_server.settings_line == ("kvreuse settings: defaults: exact prefix reuse only, LRU eviction; "
                                             "decode step eager (engine.compile off)")


M = "<served model>"  # replaced by the server's model name in the bad-input table
BAD_INPUTS = [
    # id, path, body (bytes: sent raw), status, words the message must contain, param
    ("malformed-json", "/completions", b'{"model": "m", "prompt": "hi",', 400, ["malformed JSON"], None),
    ("not-an-object", "/completions", b"[1, 2]", 400, ["dictionary"], None),
    ("max_tokens-string", "/completions", {"model": M, "prompt": "hi", "max_tokens": "ten"}, 400,
     ["max_tokens", "integer"], "max_tokens"),
    ("max_tokens-zero", "/completions", {"model": M, "prompt": "hi", "max_tokens": 0}, 400,
     ["max_tokens", ">= 1 (0 only when scoring the prompt"], "max_tokens"),
    ("max_tokens-negative", "/chat/completions",
     {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, 400,
     ["max_tokens", "greater than or equal to 0"], "max_tokens"),
    ("max_completion_tokens-zero", "/chat/completions",
     {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, 400,
     ["max_completion_tokens"], "max_completion_tokens"),
    ("temperature-negative", "/completions", {"model": M, "prompt": "hi", "temperature": -0.5}, 400,
     ["temperature", "greater than or equal to 0"], "temperature"),
    ("top_p-zero", "/completions", {"model": M, "prompt": "hi", "top_p": 0}, 400, ["top_p"], "top_p"),
    ("empty-messages", "/chat/completions", {"model": M, "messages": []}, 400, ["messages", "at least 1"],
     "messages"),
    ("bad-role", "/chat/completions", {"model": M, "messages": [{"role": "wizard", "content": "hi"}]}, 400,
     ["messages.0.role"], "messages.0.role"),
    ("image-part", "/chat/completions",
     {"model": M, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, ["only text content parts"], "messages"),
    ("empty-prompt", "/completions", {"model": M, "prompt": ""}, 400, ["prompt must not be empty"], "prompt"),
    ("65-prompts", "/completions", {"model": M, "prompt": ["a"] * 65}, 400, ["at most 64 prompts"], "prompt"),
    ("empty-prompt-in-batch", "/completions", {"model": M, "prompt": ["a", ""]}, 400, ["every prompt"], "prompt"),
    ("token-out-of-vocab", "/completions", {"model": M, "prompt": [1, 10_000_000]}, 400,
     ["prompt token ids", "integers in [0, "], "prompt"),
    ("unknown-model", "/completions", {"model": "no-such-model", "prompt": "hi"}, 404,
     ["'no-such-model' does not exist"], "model"),
    ("unknown-model-chat", "/chat/completions",
     {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, ["'gpt-4o' does not exist"], "model"),
    ("model-not-a-string", "/completions", {"model": 7, "prompt": "hi"}, 400, ["model"], "model"),
    ("salt-empty", "/completions", {"model": M, "prompt": "hi", "cache_salt": ""}, 400,
     ["cache_salt", "at least 1 character"], "cache_salt"),
    ("salt-too-long", "/completions", {"model": M, "prompt": "hi", "cache_salt": "s" * 300}, 400,
     ["cache_salt", "at most 256"], "cache_salt"),
    ("salt-number", "/chat/completions",
     {"model": M, "messages": [{"role": "user", "content": "hi"}], "cache_salt": 42}, 400,
     ["cache_salt", "string"], "cache_salt"),
    ("use_cache-not-bool", "/completions", {"model": M, "prompt": "hi", "use_cache": "perhaps"}, 400,
     ["use_cache"], "use_cache"),
    ("n-17", "/completions", {"model": M, "prompt": "hi", "n": 17}, 400, ["n", "less than or equal to 16"], "n"),
    ("best_of-below-n", "/completions", {"model": M, "prompt": "hi", "n": 3, "best_of": 2}, 400,
     ["best_of must be an integer in [n, 16]"], "best_of"),
    ("logprobs-21", "/completions", {"model": M, "prompt": "hi", "logprobs": 21}, 400,
     ["logprobs", "less than or equal to 20"], "logprobs"),
    ("top_logprobs-alone", "/chat/completions",
     {"model": M, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
     ["top_logprobs needs logprobs"], "top_logprobs"),
    ("tools", "/chat/completions",
     {"model": M, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400,
     ["tools[0].function", "must be an object with a name"], "tools[0].function"),
    ("logit_bias-not-an-id", "/completions", {"model": M, "prompt": "hi", "logit_bias": {"the": 1}}, 400,
     ["logit_bias keys must be token ids"], "logit_bias"),
    ("logit_bias-5000-digits", "/completions", {"model": M, "prompt": "hi", "logit_bias": {"9" * 5000: 1}}, 400,
     ["logit_bias keys must be token ids", "at most 10 digits"], "logit_bias"),
    ("logit_bias-unicode-digit", "/completions", {"model": M, "prompt": "hi", "logit_bias": {"\u00b2": 1}}, 400,
     ["logit_bias keys must be token ids"], "logit_bias"),
    ("bad-response-format", "/chat/completions",
     {"model": M, "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}, 400,
     ["response_format.type must be one of"], "response_format"),
    ("empty-stop", "/completions", {"model": M, "prompt": "hi", "stop": ["x", ""]}, 400, ["stop strings"], "stop"),
]


class TestBadInputs:
    @pytest.mark.parametrize("path, body, status, needles, param", [case[1:] for case in BAD_INPUTS],
                             ids=[case[0] for case in BAD_INPUTS])
    def test_bad_request_gets_4xx_naming_the_problem_and_the_server_keeps_serving(
            self, tiny_server, http, path, body, status, needles, param):
        url = f"{tiny_server.base_url}{path}"
        if isinstance(body, bytes):
            r = http.post(url, content=body, headers={"content-type": "application/json"})
        else:
            body = {k: (tiny_server.model if v == M else v) for k, v in body.items()}
            r = http.post(url, json=body)
        assert_error(r, status, *needles, param=param)
        assert_serving(http, tiny_server)

    @pytest.mark.parametrize("item, needles, param", [
        ({"prompt": "hi", "cache_salt": ""}, ["cache_salt", "at least 1 character"], "items.0.cache_salt"),
        ({"prompt": "hi", "cache_salt": "s" * 10_000}, ["cache_salt", "at most 256"], "items.0.cache_salt"),
        ({"prompt": "hi", "cache_salt": "\ud800"}, ["cache_salt", "surrogate"], "items.0.cache_salt"),
        ({"prompt": ""}, ["prompt must not be empty"], "items.0.prompt"),
        ({"prompt": []}, ["prompt must not be empty"], "items.0.prompt"),
        ({"messages": []}, ["messages", "at least 1 item"], "items.0.messages"),
    ], ids=["salt-empty", "salt-10000-chars", "salt-lone-surrogate", "prompt-empty", "prompt-no-ids", "messages-none"])
    def test_a_bad_warm_item_gets_400_naming_its_field_and_the_server_keeps_serving(
            self, tiny_server, http, item, needles, param):
        body = json.dumps({"items": [item]})   # ASCII JSON: "\ud800" stays an escape, as a client may send it
        r = http.post(f"{tiny_server.root}/cache/warm", content=body, headers={"content-type": "application/json"})
        assert_error(r, 400, *needles, param=param)
        assert_serving(http, tiny_server)

    @pytest.mark.parametrize("path, body", [
        ("/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})])
    def test_a_request_without_model_is_served_by_the_served_model(self, tiny_server, http, path, body):
        r = http.post(f"{tiny_server.base_url}{path}", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == tiny_server.model and r.json()["usage"]["completion_tokens"] == 2

    @pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
    def test_prompt_over_the_context_limit_names_prompt_tokens_max_tokens_and_limit(self, tiny_server, http, path):
        text = " ".join(f"w{i}" for i in range(800))  # ~2300 tokens, over the 2048-token limit alone
        if path == "/completions":
            body, field = {"model": tiny_server.model, "prompt": text}, "prompt"
            count = post(http, tiny_server, "/tokenize", {"prompt": text}).json()["count"]
        else:
            messages = [{"role": "user", "content": text}]
            body, field = {"model": tiny_server.model, "messages": messages}, "messages"
            count = post(http, tiny_server, "/tokenize", {"messages": messages}).json()["count"]
        assert count > 2048
        r = post(http, tiny_server, path, {**body, "max_tokens": 64})
        error = assert_error(r, 400, f"prompt ({count} tokens)", "max_tokens (64)", f"= {count + 64} tokens",
                             "context limit of 2048 tokens", param=field)
        assert error["code"] == "context_length_exceeded"
        # Without max_tokens the server picks what fits, and there is no room at all.
        assert_error(post(http, tiny_server, path, body), 400, f"prompt ({count} tokens)", "2048", param=field)
        assert_serving(http, tiny_server)

    def test_max_tokens_alone_can_push_a_fitting_prompt_over_the_limit(self, tiny_server, http):
        text = " ".join(f"w{i}" for i in range(530))  # ~2010 tokens
        count = post(http, tiny_server, "/tokenize", {"prompt": text}).json()["count"]
        room = 2048 - count
        assert 1 <= room <= 64, count
        body = {"model": tiny_server.model, "prompt": text, "temperature": 0, "ignore_eos": True}
        r = post(http, tiny_server, "/completions", {**body, "max_tokens": room + 1})
        assert_error(r, 400, f"prompt ({count} tokens)", f"max_tokens ({room + 1})", "= 2049 tokens",
                     "context limit of 2048 tokens (server.max_tokens)")
        r = post(http, tiny_server, "/completions", {**body, "max_tokens": room})  # exactly at the limit
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == room
        # Without max_tokens the default is capped to what fits.
        r = post(http, tiny_server, "/completions", {key: v for key, v in body.items()})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == room

    def test_openai_client_sees_typed_errors(self, tiny_server, client_for):
        client = client_for(tiny_server)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=tiny_server.model, prompt="hi", max_tokens=0)
        assert "max_tokens" in str(info.value)


class TestRequestOptions:
    def complete(self, http, server: Server, **fields) -> dict:
        body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0,
                "ignore_eos": True, **fields}
        if body.get("stream"):
            with http.stream("POST", f"{server.base_url}/completions", json=body) as r:
                assert r.status_code == 200
                result = read_stream(r)
            assert result["done"]
            return {"text": result["text"], "finish_reason": result["finish_reason"]}
        r = post(http, server, "/completions", body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    def test_stop_string_cuts_streamed_and_plain_text_alike(self, tiny_server, http):
        full = self.complete(http, tiny_server)["text"]
        # An ASCII piece from the middle of the greedy text; the output ends right before its first occurrence.
        candidates = [full[i:i + 4] for i in range(len(full) // 3, len(full) - 4)
                      if full[i:i + 4].isascii() and full[i:i + 4].strip() == full[i:i + 4]]
        assert candidates, full
        stop_at = candidates[0]
        expected = full[:full.find(stop_at)]
        for stream in (False, True):
            choice = self.complete(http, tiny_server, stop=[stop_at, "never-appears-zq"], stream=stream)
            assert choice["text"] == expected, stream
            assert choice["finish_reason"] == "stop", stream
        assert self.complete(http, tiny_server, stop=stop_at)["text"] == expected  # a single string too

    def test_seed_makes_sampling_repeatable(self, tiny_server, http):
        runs = [self.complete(http, tiny_server, temperature=1.0, seed=1234, max_tokens=12)["text"] for _ in range(2)]
        assert runs[0] == runs[1]

    def test_prompt_as_token_ids_equals_the_text_prompt(self, tiny_server, http):
        tokens = post(http, tiny_server, "/tokenize", {"prompt": "Once upon a time"}).json()["tokens"]
        assert self.complete(http, tiny_server, prompt=tokens)["text"] == self.complete(http, tiny_server)["text"]
        assert self.complete(http, tiny_server, prompt=["Once upon a time"])["text"] == \
            self.complete(http, tiny_server)["text"]

    def test_max_completion_tokens_and_text_parts(self, tiny_server, http):
        body = {"model": tiny_server.model, "max_completion_tokens": 5, "ignore_eos": True, "temperature": 0,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello "},
                                                          {"type": "text", "text": "there"}]}]}
        r = post(http, tiny_server, "/chat/completions", body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5
        plain = {**body, "messages": [{"role": "user", "content": "Hello there"}]}
        assert r.json()["choices"][0] == post(http, tiny_server, "/chat/completions", plain).json()["choices"][0]

    def test_cache_salt_and_use_cache_control_reuse(self, tiny_server, http):
        prompt = f"[{uuid.uuid4().hex}] {SYSTEM}"

        def cached(**fields) -> int:
            r = post(http, tiny_server, "/completions", {"model": tiny_server.model, "prompt": prompt,
                                                         "max_tokens": 2, **fields})
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            assert usage["computed_prompt_tokens"] == usage["prompt_tokens"] - usage["prompt_tokens_details"][
                "cached_tokens"]
            return usage["prompt_tokens_details"]["cached_tokens"]

        assert cached(use_cache=False) == 0
        assert cached(use_cache=False) == 0  # opting out neither reads nor publishes
        assert cached() == 0
        assert cached() > 0
        assert cached(use_cache=False) == 0  # and never reads what others published
        assert cached(cache_salt="one") == 0  # a salt is its own partition
        assert cached(cache_salt="two") == 0
        assert cached(cache_salt="one") > 0

    def test_stream_request_refused_before_streaming_starts(self, tiny_server, http):
        body = {"model": tiny_server.model, "prompt": "hi", "max_tokens": 5000, "stream": True}
        with http.stream("POST", f"{tiny_server.base_url}/completions", json=body) as r:
            r.read()
        assert r.headers["content-type"].startswith("application/json")
        assert_error(r, 400, "max_tokens (5000)", "context limit")

    def test_unknown_route_and_wrong_method_answer_in_openai_error_format(self, tiny_server, http):
        # The server promises OpenAI's error JSON for every error; the router's own 404/405 are errors too.
        assert_error(http.get(f"{tiny_server.base_url}/no-such-endpoint"), 404)
        assert_error(http.get(f"{tiny_server.base_url}/chat/completions"), 405)


class TestConcurrentStreams:
    NUM_STREAMS = 16
    DISCONNECT = {1, 4, 9, 14}  # these close their stream after a few chunks
    MAX_TOKENS = 96

    def body(self, model: str, i: int, stream: bool) -> tuple[str, dict]:
        common = {"model": model, "max_tokens": self.MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                  "stream": stream, "stream_options": {"include_usage": True}}
        if i % 2:
            return "/chat/completions", {**common, "messages": [
                {"role": "user", "content": f"Question {i}: what is {i} times {i + 3}?"}]}
        return "/completions", {**common, "prompt": f"Story {i}: once upon a time, in a land of {i} rivers,"}

    def test_16_streams_with_4_disconnects_complete_and_free_everything(self, tiny_server):
        server = tiny_server
        before = server.metrics()
        barrier = threading.Barrier(self.NUM_STREAMS, timeout=30)

        def run(i: int) -> dict:
            path, body = self.body(server.model, i, stream=True)
            with http_client(120.0) as client:
                barrier.wait()
                with client.stream("POST", f"{server.base_url}{path}", json=body) as r:
                    assert r.status_code == 200, r.read()
                    return read_stream(r, stop_after_text_chunks=3 if i in self.DISCONNECT else None)

        with ThreadPoolExecutor(self.NUM_STREAMS) as pool:
            results = list(pool.map(run, range(self.NUM_STREAMS), timeout=120))

        for i, result in enumerate(results):
            if i in self.DISCONNECT:
                assert not result["done"] and result["finish_reason"] is None
                continue
            assert result["done"], f"stream {i} did not end with [DONE]"
            assert result["finish_reason"] == "length", i
            assert result["usage"]["completion_tokens"] == self.MAX_TOKENS, i

        # The clients that went away are aborted; their blocks come back; nothing is left running.
        scrape = wait_idle(server)
        assert aborts(scrape, server) - aborts(before, server) == len(self.DISCONNECT)
        assert scrape.get("kvreuse:cached_blocks", model_name=server.model) > 0

        def plain(i: int) -> str:
            path, body = self.body(server.model, i, stream=False)
            with http_client(120.0) as client:
                r = client.post(f"{server.base_url}{path}", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "length"
            return choice["message"]["content"] if "message" in choice else choice["text"]

        completed = [i for i in range(self.NUM_STREAMS) if i not in self.DISCONNECT]
        with ThreadPoolExecutor(4) as pool:
            expected = dict(zip(completed, pool.map(plain, completed, timeout=120), strict=True))
        for i in completed:
            assert results[i]["text"] == expected[i], f"stream {i} differs from its non-streamed greedy run"
        wait_idle(server)


class TestDisconnects:
    def finished(self, scrape: Metrics, server: Server) -> tuple[float, float]:
        """(aborted, finished by length) requests so far."""
        return aborts(scrape, server), scrape.get_or_zero("vllm:request_success_total", model_name=server.model,
                                                          finished_reason="length")

    def wait_for_the_end(self, server: Server, before: Metrics) -> str:
        """How the one request in flight ended: 'abort' or 'length' (polls up to 20 s)."""
        start = self.finished(before, server)
        scrape = server.wait_for(lambda s: self.finished(s, server) != start, timeout=20.0)
        aborted, by_length = (now - then for now, then in zip(self.finished(scrape, server), start, strict=True))
        assert (aborted, by_length) in ((1, 0), (0, 1)), (aborted, by_length)
        return "abort" if aborted else "length"

    def test_non_streaming_client_timeout_aborts_the_request(self, tiny_server, http):
        server = tiny_server
        before = server.metrics()
        body = {"model": server.model, "prompt": "A very long story:", "max_tokens": 1500, "temperature": 0,
                "ignore_eos": True}
        with http_client(httpx.Timeout(30.0, read=1.0)) as impatient, pytest.raises(httpx.ReadTimeout):
            impatient.post(f"{server.base_url}/completions", json=body)
        assert self.wait_for_the_end(server, before) == "abort", \
            "the client went away, yet the server generated all 1500 tokens for it"
        wait_idle(server)
        assert_serving(http, server)

    def test_lone_stream_disconnect_aborts_and_frees_everything(self, tiny_server, http):
        server = tiny_server
        before = server.metrics()
        body = {"model": server.model, "prompt": "Another long story:", "max_tokens": 1500, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with http_client(30.0) as client, client.stream("POST", f"{server.base_url}/completions", json=body) as r:
            assert r.status_code == 200
            result = read_stream(r, stop_after_text_chunks=3)
        assert not result["done"]
        assert self.wait_for_the_end(server, before) == "abort"
        wait_idle(server)  # nothing else runs after it: the gauges must still come back to 0
        assert_serving(http, server)


class TestTokenizeAndModels:
    def test_tokenize_detokenize_round_trip(self, tiny_server, http):
        text = "Paged attention keeps keys and values in blocks. Ünïcødé too: 東京 🚀"
        r = post(http, tiny_server, "/tokenize", {"prompt": text})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == 2048
        assert all(isinstance(t, int) for t in body["tokens"])
        r = post(http, tiny_server, "/detokenize", {"tokens": body["tokens"]})
        assert r.status_code == 200, r.text
        assert r.json() == {"prompt": text}
        # With the model name too; and the token count is what a completion reports as its prompt.
        assert post(http, tiny_server, "/tokenize", {"prompt": text, "model": tiny_server.model}).json() == body
        r = post(http, tiny_server, "/completions", {"model": tiny_server.model, "prompt": text, "max_tokens": 1})
        assert r.json()["usage"]["prompt_tokens"] == body["count"]

    def test_tokenize_messages_counts_the_chat_prompt(self, tiny_server, http):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi!"}]
        count = post(http, tiny_server, "/tokenize", {"messages": messages}).json()["count"]
        r = post(http, tiny_server, "/chat/completions", {"model": tiny_server.model, "messages": messages,
                                                          "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == count

    def test_tokenize_and_detokenize_errors(self, tiny_server, http):
        assert_error(post(http, tiny_server, "/tokenize", {"prompt": "a", "messages": [{"role": "user"}]}), 400,
                     "exactly one of")
        assert_error(post(http, tiny_server, "/tokenize", {}), 400, "exactly one of")
        assert_error(post(http, tiny_server, "/tokenize", {"prompt": "a", "model": "nope"}), 404, "'nope'")
        assert_error(post(http, tiny_server, "/detokenize", {"tokens": [1, 10_000_000]}), 400, "tokens must be",
                     param="tokens")
        assert_error(post(http, tiny_server, "/detokenize", {"tokens": [-1]}), 400, "tokens")
        assert_error(post(http, tiny_server, "/detokenize", {"tokens": "abc"}), 400, "tokens")

    def test_models_lists_the_served_model(self, tiny_server, client_for, tiny_model_dir):
        models = client_for(tiny_server).models.list()
        assert tiny_server.model == Path(tiny_model_dir).name  # a directory is served as its name
        assert [m.id for m in models.data] == [tiny_server.model]
        assert models.data[0].owned_by == "kvreuse"
        assert models.data[0].model_extra["max_model_len"] == 2048


# --- model.served_name, and the settings line of a server with approximate and non-default behaviours -------
@pytest.fixture(scope="class")
def renamed_server(tmp_path_factory, tiny_model_dir):
    sets = ("model.served_name=acme/kv-tiny", "cache.suffix.enabled=true", "cache.policy=lfu")
    with serve(tmp_path_factory, "renamed", *server_args(tiny_model_dir, *sets)) as server:
        yield server


class TestServedNameAndSettings:
    def test_the_served_name_is_listed_and_answers(self, renamed_server, client_for):
        client = client_for(renamed_server)
        assert renamed_server.model == "acme/kv-tiny"
        assert [m.id for m in client.models.list().data] == ["acme/kv-tiny"]
        reply = client.completions.create(model="acme/kv-tiny", prompt="Hello", max_tokens=2, temperature=0)
        assert reply.model == "acme/kv-tiny" and reply.usage.completion_tokens <= 2

    def test_another_model_gets_404_naming_the_served_one(self, renamed_server, http, tiny_model_dir):
        body = {"model": Path(tiny_model_dir).name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        error = assert_error(post(http, renamed_server, "/chat/completions", body), 404,
                             f"{Path(tiny_model_dir).name!r} does not exist", "this server serves 'acme/kv-tiny'",
                             param="model")
        assert error["code"] == "model_not_found"

    def test_the_settings_line_names_segment_reuse_and_the_policy(self, renamed_server):
        line = renamed_server.settings_line
        assert line.startswith("kvreuse settings: segment reuse, approximate: blend recomputing 15%, guard 0.03 nats "
                               "(cache.suffix.enabled); eviction lfu (cache.policy); decode step eager"), line
        assert "defaults" not in line


# --- 5. tenants: API keys isolate the prefix cache ------------------------------------------------------
@pytest.fixture(scope="class")
def keyed_server(tmp_path_factory, tiny_model_dir):
    keys = tmp_path_factory.mktemp("keys") / "api_keys.txt"
    keys.write_text("# key tenant\nkey-alpha-123 alpha\nkey-beta-456 beta\n")
    with serve(tmp_path_factory, "keyed", *server_args(tiny_model_dir), "--api-keys", str(keys)) as server:
        yield server


class TestTenants:
    def cached(self, client: openai.OpenAI, server: Server, messages: list[dict], **extra) -> int:
        reply = client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=3, temperature=0, extra_body=extra or None)
        return reply.usage.prompt_tokens_details.cached_tokens

    def test_same_tenant_hits_the_other_tenant_does_not(self, keyed_server, client_for):
        alpha, beta = client_for(keyed_server, "key-alpha-123"), client_for(keyed_server, "key-beta-456")
        messages = [{"role": "system", "content": f"[{uuid.uuid4().hex}] {SYSTEM}"},
                    {"role": "user", "content": "Can I renew a book online?"}]
        assert self.cached(alpha, keyed_server, messages) == 0
        assert self.cached(alpha, keyed_server, messages) > 0
        assert self.cached(beta, keyed_server, messages) == 0  # alpha's blocks are not beta's
        assert self.cached(beta, keyed_server, messages) > 0   # beta's own are
        # A request's cache_salt only narrows sharing inside its tenant: alpha + salt is a fresh partition...
        assert self.cached(alpha, keyed_server, messages, cache_salt="team-x") == 0
        assert self.cached(alpha, keyed_server, messages, cache_salt="team-x") > 0
        # ...and the same salt from another tenant does not reach into it.
        assert self.cached(beta, keyed_server, messages, cache_salt="team-x") == 0

    def test_missing_or_wrong_key_gets_401(self, keyed_server, http, client_for):
        chat = {"model": keyed_server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        url = f"{keyed_server.base_url}/chat/completions"
        for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": "key-alpha-123"},
                        {"Authorization": "Basic key-alpha-123"}, {"Authorization": "Bearer key-alpha-12"},
                        {"Authorization": "Bearer"}, {"Authorization": "Bearer key-alpha-123x"}):
            error = assert_error(http.post(url, json=chat, headers=headers), 401, "API key")
            assert error["type"] == "authentication_error"
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize"),
                             ("POST", "/detokenize")):
            r = http.request(method, f"{keyed_server.root}{path}", json={"prompt": "hi", "tokens": [1]})
            assert_error(r, 401, "API key")
        with pytest.raises(openai.AuthenticationError):
            client_for(keyed_server, "wrong-key").chat.completions.create(
                model=keyed_server.model, messages=chat["messages"], max_tokens=2)
        # The right key works, for the raw client too.
        r = http.post(url, json=chat, headers={"Authorization": "Bearer key-beta-456"})
        assert r.status_code == 200, r.text
        r = http.post(f"{keyed_server.root}/tokenize", json={"prompt": "hi"},
                      headers={"Authorization": "Bearer key-alpha-123"})
        assert r.status_code == 200, r.text

    def test_health_needs_no_key_and_metrics_does(self, keyed_server, http):  # issue 12, finding 5
        assert http.get(f"{keyed_server.root}/health").status_code == 200
        assert_error(http.get(f"{keyed_server.root}/metrics"), 401, "API key")
        # A tenant's key may not read every tenant's counters (issue 26, finding 12): /metrics needs an admin key.
        keyed = http.get(f"{keyed_server.root}/metrics", headers={"Authorization": "Bearer key-beta-456"})
        assert_error(keyed, 403, "admin API key")


# --- 6. backpressure -------------------------------------------------------------------------------------
@pytest.fixture(scope="class")
def queue2_server(tmp_path_factory, tiny_model_dir):
    with serve(tmp_path_factory, "queue2", *server_args(tiny_model_dir, "server.max_queue=2")) as server:
        yield server


class TestBackpressure:
    def test_beyond_max_queue_gets_429_with_retry_after(self, queue2_server, http):
        server = queue2_server
        num, max_tokens = 6, 400
        barrier = threading.Barrier(num, timeout=30)

        def fire(i: int) -> httpx.Response:
            body = {"model": server.model, "prompt": f"Long request {i}:", "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}
            with http_client(120.0) as client:
                barrier.wait()
                return client.post(f"{server.base_url}/completions", json=body)

        with ThreadPoolExecutor(num) as pool:
            responses = list(pool.map(fire, range(num), timeout=120))
        statuses = sorted(r.status_code for r in responses)
        assert set(statuses) <= {200, 429}, statuses
        assert 1 <= statuses.count(200) <= 2 and statuses.count(429) >= 1, statuses
        for r in responses:
            if r.status_code == 429:
                error = assert_error(r, 429, "server.max_queue = 2")
                assert error["type"] == "rate_limit_error"
                assert r.headers.get("retry-after") == "1"
            else:
                assert r.json()["usage"]["completion_tokens"] == max_tokens
        wait_idle(server)
        assert_serving(http, server)


# --- 8. server.truncate ----------------------------------------------------------------------------------
LIMIT = 2048  # both servers keep the default context limit; only server.truncate differs


def long_conversation(turns: int = 8, words: int = 80) -> list[dict]:
    """A chat of ~2600 tokens: over the limit, while its newest turns alone fit easily."""
    messages = [{"role": "system", "content": "You are a patient tutor."}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn}: "
                         + " ".join(f"q{turn}x{i}" for i in range(words))})
        messages.append({"role": "assistant", "content": f"Answer {turn}: "
                         + " ".join(f"a{turn}y{i}" for i in range(words))})
    messages.append({"role": "user", "content": "And the last question: what did we cover?"})
    return messages


@pytest.fixture(scope="class")
def truncating_server(tmp_path_factory, tiny_model_dir):
    with serve(tmp_path_factory, "truncate-oldest", *server_args(tiny_model_dir, "server.truncate=oldest")) as server:
        yield server


class TestTruncation:
    MAX_TOKENS = 16

    def count(self, http, server: Server, messages: list[dict]) -> int:
        r = post(http, server, "/tokenize", {"messages": messages})
        assert r.status_code == 200, r.text
        return r.json()["count"]

    def test_oldest_drops_whole_turns_until_it_fits(self, truncating_server, http):
        server, messages = truncating_server, long_conversation()
        assert self.count(http, server, messages) + self.MAX_TOKENS > LIMIT
        body = {"model": server.model, "messages": messages, "max_tokens": self.MAX_TOKENS, "temperature": 0}
        r = post(http, server, "/chat/completions", body)
        assert r.status_code == 200, r.text
        reply = r.json()
        dropped = reply["truncated_turns"]
        assert 1 <= dropped < 8
        kept = messages[:1] + messages[1 + 2 * dropped:]  # the system message and the newest turns
        assert reply["usage"]["prompt_tokens"] == self.count(http, server, kept)
        assert reply["usage"]["prompt_tokens"] + self.MAX_TOKENS <= LIMIT
        one_less = messages[:1] + messages[1 + 2 * (dropped - 1):]
        assert self.count(http, server, one_less) + self.MAX_TOKENS > LIMIT, "dropped more turns than needed"

        with http.stream("POST", f"{server.base_url}/chat/completions", json={**body, "stream": True}) as s:
            assert s.status_code == 200
            result = read_stream(s)
        assert result["done"] and all(c["truncated_turns"] == dropped for c in result["chunks"])
        assert result["text"] == reply["choices"][0]["message"]["content"]

    def test_oldest_leaves_fitting_conversations_alone(self, truncating_server, http):
        body = {"model": truncating_server.model, "messages": long_conversation()[-3:], "max_tokens": 4}
        r = post(http, truncating_server, "/chat/completions", body)
        assert r.status_code == 200, r.text
        assert r.json().get("truncated_turns", 0) == 0

    def test_oldest_still_refuses_a_last_message_that_cannot_fit(self, truncating_server, http):
        huge = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "old question"}, {"role": "assistant", "content": "old answer"},
                {"role": "user", "content": " ".join(f"w{i}" for i in range(800))}]
        r = post(http, truncating_server, "/chat/completions", {"model": truncating_server.model,
                                                                "messages": huge, "max_tokens": 8})
        assert_error(r, 400, f"context limit of {LIMIT} tokens", param="messages")
        assert_serving(http, truncating_server)

    def test_error_mode_refuses_the_same_conversation(self, tiny_server, http):
        messages = long_conversation()
        count = self.count(http, tiny_server, messages)
        r = post(http, tiny_server, "/chat/completions", {"model": tiny_server.model, "messages": messages,
                                                          "max_tokens": self.MAX_TOKENS})
        error = assert_error(r, 400, f"prompt ({count} tokens)", f"max_tokens ({self.MAX_TOKENS})",
                             f"context limit of {LIMIT} tokens", param="messages")
        assert error["code"] == "context_length_exceeded"
        assert_serving(http, tiny_server)


# --- 9. SIGTERM drains -----------------------------------------------------------------------------------
def test_sigterm_refuses_new_requests_finishes_in_flight_ones_and_exits_0(tmp_path_factory, tiny_model_dir):
    max_tokens = 800  # seconds on the tiny model
    with serve(tmp_path_factory, "sigterm", *server_args(tiny_model_dir)) as server:
        results, workers = start_long_requests(server, max_tokens, 120.0, read_stream, include_usage=True)
        wait_running(server, 2)
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # let the signal land

        late = {"model": server.model, "prompt": "Too late", "max_tokens": 2}
        try:
            with http_client(10.0) as client:
                r = client.post(f"{server.base_url}/completions", json=late)
            assert_error(r, 503, "shutting down")
        except httpx.TransportError:
            pass  # refused outright: the listening socket is closed
        assert server.process.poll() is None, "the server exited with requests in flight"

        for worker in workers:
            worker.join(90)
            assert not worker.is_alive(), "an in-flight request never finished"
        assert not isinstance(results["plain"], Exception), f"{results['plain']!r}\n{server.log_tail()}"
        assert not isinstance(results["streamed"], Exception), f"{results['streamed']!r}\n{server.log_tail()}"
        response = results["plain"]
        assert response.status_code == 200, response.text
        choice, usage = response.json()["choices"][0], response.json()["usage"]
        assert choice["finish_reason"] == "length" and usage["completion_tokens"] == max_tokens
        status, stream = results["streamed"]
        assert status == 200 and stream["done"] and stream["finish_reason"] == "length"
        assert stream["usage"]["completion_tokens"] == max_tokens
        assert stop(server.process, timeout=30) == 0, server.log_tail()


@pytest.fixture(scope="class")
def truncating_segment_server(tmp_path_factory, tiny_model_dir):
    sets = ("server.truncate=oldest", "cache.suffix.enabled=true", "cache.suffix.guard_margin=0")
    with serve(tmp_path_factory, "truncate-segments", *server_args(tiny_model_dir, *sets)) as server:
        yield server


class TestTruncationWithSegmentReuse:
    def test_surviving_turns_still_hit_as_shifted_segments(self, truncating_segment_server, http):
        server, messages = truncating_segment_server, long_conversation()
        question = messages[-1]
        count = lambda msgs: post(http, server, "/tokenize", {"messages": msgs}).json()["count"]
        # The longest conversation that still fits, as the client sent it one turn ago...
        turns = max(t for t in range(1, 8) if count(messages[: 1 + 2 * t] + [question]) + 16 <= LIMIT)
        earlier = messages[: 1 + 2 * turns] + [question]
        body = {"model": server.model, "max_tokens": 16, "temperature": 0}
        first = post(http, server, "/chat/completions", {**body, "messages": earlier})
        assert first.status_code == 200 and first.json().get("truncated_turns", 0) == 0
        # ...and the next one, which no longer fits: its oldest turn goes, every surviving turn moves up.
        later = messages[: 1 + 2 * (turns + 1)] + [question]
        second = post(http, server, "/chat/completions", {**body, "messages": later})
        assert second.status_code == 200, second.text
        reply = second.json()
        assert reply["truncated_turns"] >= 1
        details = reply["usage"]["prompt_tokens_details"]
        assert details["reused_tokens"] > 0, details
        assert details["cached_tokens"] + details["reused_tokens"] + reply["usage"]["computed_prompt_tokens"] \
            == reply["usage"]["prompt_tokens"]
