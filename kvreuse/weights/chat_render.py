"""Where a conversation is rendered with the chat template: in this process, or, for a server, in a worker process
with a deadline and a memory cap.

A template comes from a model's files or `--chat-template`, and a request's messages drive its loops: two chats
whose content made a template run nested `range(100000)` loops stopped every request, and blocked SIGTERM, and
`{{ 'x' * 1000000000 }}` rendered a gigabyte before any check. Jinja's sandbox bounds neither time nor memory, and a
thread cannot be stopped, so the server renders in a child process that it kills at the deadline (and replaces),
whose address space is capped. The child runs the same transformers code on a copy of the same tokenizer, so it
renders the same text.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Protocol

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # the worker's start: importing transformers and unpickling the tokenizer
_HEADER = struct.Struct("<Q")


class ChatTemplateLimit(ValueError):
    """A render went past the deadline or the memory cap (the message names the bound and its config key)."""


class ChatTemplateFailed(ValueError):
    """The template refused the conversation (its raise_exception, or a Jinja error while rendering)."""


class ChatRenderer(Protocol):
    """Renders a conversation with a transformers tokenizer's chat template (`apply_chat_template`, untokenized)."""

    def render(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        """The prompt text; ChatTemplateLimit or ChatTemplateFailed (or jinja's TemplateError in process)."""

    def close(self) -> None:
        """Stop what renders (a worker process); idempotent."""


class InProcessRenderer:
    """Renders on the calling thread (offline runs, where the caller owns the template and the messages)."""

    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer

    def render(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        return self.hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class RenderLimits:
    timeout_s: float
    max_mb: int                 # the worker's memory beyond its start, and the rendered text's size
    timeout_key: str = "server.chat_template_timeout_s"
    memory_key: str = "server.chat_template_max_mb"


class WorkerRenderer:
    """Renders in a child process, one render at a time: killed at `limits.timeout_s` and started again, its address
    space capped at its size after start plus `limits.max_mb`."""

    def __init__(self, hf_tokenizer, limits: RenderLimits):
        self.limits = limits
        self._tokenizer = pickle.dumps(hf_tokenizer)
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._closed = False
        self._starting = threading.Thread(target=self._start_quietly, name="kvreuse-template-worker", daemon=True)
        self._starting.start()

    def wait_started(self) -> None:
        """Block until the worker's start (begun when this renderer was made) is over, however it went."""
        self._starting.join()

    def render(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        self._starting.join()  # a worker starting (a first, or the replacement of one killed at the deadline)
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._start()
            kind, value = self._call((messages, tools, add_generation_prompt))
        if kind == "ok":
            return value
        if kind == "template":
            raise ChatTemplateFailed(value)
        if kind == "memory":
            raise ChatTemplateLimit(f"rendering this conversation with the chat template needs more than "
                                    f"{self.limits.max_mb} MB ({self.limits.memory_key})")
        raise RuntimeError(f"the chat template worker failed: {value}")

    def close(self) -> None:
        with self._lock:
            self._closed = True  # a start still waiting for the lock starts nothing
            self._kill()

    def _call(self, request) -> tuple[str, object]:
        process = self._process
        try:
            _write(process.stdin, request)
            return _read(process.stdout, time.monotonic() + self.limits.timeout_s)
        except TimeoutError:
            self._kill()
            self._starting = threading.Thread(target=self._start_quietly, daemon=True)
            self._starting.start()  # the next render finds a worker ready
            raise ChatTemplateLimit(f"the chat template took more than {self.limits.timeout_s:g} s to render this "
                                    f"conversation ({self.limits.timeout_key})") from None
        except (OSError, EOFError, pickle.UnpicklingError):
            # The worker died mid-render: out of memory past what Python could catch (the kernel's limit).
            self._kill()
            return "memory", None

    def _start_quietly(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                self._start()
            except Exception:  # the first render starts it again and raises
                logger.warning("the chat template worker did not start", exc_info=True)
                self._kill()

    def _start(self) -> None:
        self._kill()
        self._process = subprocess.Popen([sys.executable, "-m", "kvreuse.weights.chat_render"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        _write(self._process.stdin, (self._tokenizer, self.limits))
        kind, value = _read(self._process.stdout, time.monotonic() + START_TIMEOUT_S)
        if kind != "ready":
            raise RuntimeError(f"the chat template worker did not start: {value}")

    def _kill(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            for pipe in (self._process.stdin, self._process.stdout):
                pipe.close()
            self._process = None


def _write(pipe, value) -> None:
    data = pickle.dumps(value)
    pipe.write(_HEADER.pack(len(data)) + data)
    pipe.flush()


def _read(pipe, deadline: float | None):
    header = _read_exactly(pipe, _HEADER.size, deadline)
    return pickle.loads(_read_exactly(pipe, _HEADER.unpack(header)[0], deadline))


def _read_exactly(pipe, size: int, deadline: float | None) -> bytes:
    chunks, remaining = [], size
    while remaining:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([pipe], [], [], wait)[0]:
            raise TimeoutError
        chunk = os.read(pipe.fileno(), remaining)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _serve() -> None:
    """The worker: renders requests from stdin until it is killed or stdin closes (the server ended). Each render
    may also use at most twice the deadline in CPU time (RLIMIT_CPU), so that a render still running when the server
    is gone ends all the same."""
    import resource

    from jinja2 import TemplateError

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    tokenizer_bytes, limits = _read(stdin, None)
    renderer = InProcessRenderer(pickle.loads(tokenizer_bytes))
    # What rendering imports, imported before the cap (with a template of our own: the model's may be the hostile one).
    renderer.hf.apply_chat_template([{"role": "user", "content": "hi"}], chat_template="{{ messages }}", tokenize=False)
    with open("/proc/self/statm") as statm:
        size = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    max_bytes = limits.max_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (size + max_bytes, size + max_bytes))
    _write(stdout, ("ready", None))
    while True:
        try:
            messages, tools, add_generation_prompt = _read(stdin, None)
        except EOFError:
            return
        used = resource.getrusage(resource.RUSAGE_SELF)
        cpu_limit = math.ceil(used.ru_utime + used.ru_stime + 2 * limits.timeout_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_limit, resource.RLIM_INFINITY))
        try:
            text = renderer.render(messages, tools, add_generation_prompt)
            reply = ("ok", text) if len(text) <= max_bytes else ("memory", None)
        except MemoryError:
            reply = ("memory", None)
        except TemplateError as exc:
            reply = ("template", str(exc))
        except Exception as exc:  # reported to the server, which answers 500 with it
            reply = ("error", f"{type(exc).__name__}: {exc}")
        _write(stdout, reply)


if __name__ == "__main__":
    _serve()
