"""A server renders conversations in a worker process with a deadline and a memory cap (kvreuse/weights/chat_render.py):
the same text as in process, a looping or a huge template refused with 400 naming the bound, other requests served
meanwhile, and SIGTERM exiting cleanly while a render is stuck."""

import signal
import threading
import time

import pytest

from kvreuse.weights.chat_render import ChatTemplateFailed, ChatTemplateLimit, RenderLimits
from tests.server_process import http_client, start_server

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_start|>there"}]
WORD = {"type": "object", "properties": {"word": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Looks a word up.", "parameters": WORD}}]
# Loops 10^10 times for a message that says "loop", renders plainly otherwise: content drives a template's loops.
LOOPING = ("{% for m in messages %}{% if m.content == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}"
           "{% endfor %}{% endfor %}{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
           "<|im_start|>assistant\n")
HUGE = "{{ 'x' * 1000000000 }}"
# The looping template, with a message that says "huge" rendering a gigabyte and one that says "list" making a list of
# 10^9 elements (8 GB): content drives what a template allocates too.
LOOPING_OR_HUGE = LOOPING.replace("{% endif %}", "{% elif m.content == 'huge' %}{{ 'x' * 1000000000 }}"
                                                 "{% elif m.content == 'list' %}{{ ([0] * 1000000000)|length }}"
                                                 "{% endif %}", 1)


@pytest.fixture
def tokenizer(real_tokenizer):
    yield real_tokenizer
    real_tokenizer.render_in_process()  # the session's tokenizer: each test puts its own template back


def test_the_worker_renders_what_the_process_renders(tokenizer):
    in_process = [tokenizer.render_chat(MESSAGES, tools).text for tools in (None, TOOLS)]
    tokenizer.render_in_worker(RenderLimits(30.0, 256))
    assert [tokenizer.render_chat(MESSAGES, tools).text for tools in (None, TOOLS)] == in_process


def test_a_looping_render_is_stopped_at_the_deadline_and_the_next_one_is_served(tokenizer):
    own = tokenizer.hf.chat_template
    try:
        tokenizer.hf.chat_template = LOOPING
        tokenizer.render_in_worker(RenderLimits(2.0, 256))
        tokenizer.apply_chat_template([{"role": "user", "content": "warm"}])  # the worker started
        started = time.monotonic()
        with pytest.raises(ChatTemplateLimit, match=r"more than 2 s .*server\.chat_template_timeout_s"):
            tokenizer.apply_chat_template([{"role": "user", "content": "loop"}])
        assert time.monotonic() - started < 10
        assert "plain" in tokenizer.apply_chat_template([{"role": "user", "content": "plain"}])
    finally:
        tokenizer.hf.chat_template = own


def test_a_huge_render_is_refused_by_the_memory_cap(tokenizer):
    own = tokenizer.hf.chat_template
    try:
        tokenizer.hf.chat_template = HUGE
        tokenizer.render_in_worker(RenderLimits(30.0, 64))
        with pytest.raises(ChatTemplateLimit, match=r"more than 64 MB .*server\.chat_template_max_mb"):
            tokenizer.apply_chat_template(MESSAGES)
        tokenizer.hf.chat_template = "{{ raise_exception('roles must alternate') }}"
        tokenizer.render_in_worker(RenderLimits(30.0, 64))
        with pytest.raises(ChatTemplateFailed, match="roles must alternate"):
            tokenizer.apply_chat_template(MESSAGES)
    finally:
        tokenizer.hf.chat_template = own


def test_a_server_refuses_a_looping_template_serves_meanwhile_and_exits_on_sigterm(tmp_path):
    template = tmp_path / "looping.jinja"
    template.write_text(LOOPING_OR_HUGE)
    with start_server("--chat-template", str(template), "--set", "server.chat_template_timeout_s=3",
                      log_path=tmp_path / "server.log") as server, http_client(60.0) as client:
        chat = f"{server.base_url}/chat/completions"
        body = {"model": server.model, "max_tokens": 1, "messages": [{"role": "user", "content": "loop"}]}
        answers = {}
        looping = threading.Thread(target=lambda: answers.update(loop=client.post(chat, json=body)))
        started = time.monotonic()
        looping.start()
        time.sleep(0.5)
        plain = client.post(f"{server.base_url}/completions", json={"model": server.model, "prompt": "Hi",
                                                                      "max_tokens": 1})
        assert plain.status_code == 200, plain.text
        looping.join(30)
        refused = answers["loop"]
        assert refused.status_code == 400, refused.text
        assert time.monotonic() - started < 3 + 10  # the deadline, a new worker, and slack for 2 busy cores
        assert refused.json()["error"]["code"] == "chat_template_limit"
        assert "server.chat_template_timeout_s" in refused.json()["error"]["message"]
        for content in ("huge", "list"):  # past the worker's memory cap: the same 400, naming that key
            started = time.monotonic()
            huge = client.post(chat, json={**body, "messages": [{"role": "user", "content": content}]})
            assert huge.status_code == 400 and time.monotonic() - started < 3 + 10, (content, huge.text)
            assert huge.json()["error"]["code"] == "chat_template_limit", huge.text
            assert "server.chat_template_max_mb" in huge.json()["error"]["message"], huge.text
        again = client.post(chat, json={**body, "messages": [{"role": "user", "content": "plain"}]})
        assert again.status_code == 200, again.text

        threading.Thread(target=lambda: client.post(chat, json=body), daemon=True).start()  # stuck while we stop
        time.sleep(1.0)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(30) == 0, server.log_tail()
