"""`kvreuse serve` as a real subprocess on a free 127.0.0.1 port, plus small HTTP helpers for the server tests."""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
READY = re.compile(r"kvreuse ready: (http://127\.0\.0\.1:\d+/v1) model=(\S+)")
SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class ServerFailed(RuntimeError):
    pass


def http_client(timeout: float = 60.0, **kwargs) -> httpx.Client:
    """A client that never goes through a proxy (only 127.0.0.1 is ever contacted)."""
    return httpx.Client(timeout=timeout, trust_env=False, **kwargs)


@dataclass
class Metrics:
    """One /metrics scrape: (name, labels) -> value."""
    samples: dict[tuple[str, frozenset], float]

    @classmethod
    def parse(cls, text: str) -> Metrics:
        samples = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            match = SAMPLE.match(line)
            assert match, f"unparseable metrics line: {line!r}"
            name, labels, value = match.groups()
            samples[(name, frozenset(LABEL.findall(labels or "")))] = float(value)
        return cls(samples)

    def get(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`; KeyError if there is none."""
        wanted = set(labels.items())
        found = [v for (n, ls), v in self.samples.items() if n == name and wanted <= ls]
        if not found:
            raise KeyError(f"no sample {name}{labels or ''} in /metrics")
        return sum(found)

    def get_or_zero(self, name: str, **labels: str) -> float:
        try:
            return self.get(name, **labels)
        except KeyError:
            return 0.0


@dataclass
class Server:
    base_url: str          # http://127.0.0.1:PORT/v1
    model: str
    process: subprocess.Popen
    log_path: Path         # its stderr
    ready_line: str = ""
    settings_line: str = ""  # the line after the ready line: `kvreuse settings: ...`

    @property
    def root(self) -> str:
        return self.base_url.removesuffix("/v1")

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def metrics(self, client: httpx.Client | None = None) -> Metrics:
        own = client is None
        client = client or http_client(10.0)
        try:
            response = client.get(f"{self.root}/metrics")
        finally:
            if own:
                client.close()
        assert response.status_code == 200, response.text
        return Metrics.parse(response.text)

    def gauge(self, name: str) -> float:
        return self.metrics().get(name, model_name=self.model)

    def wait_for(self, predicate: Callable[[Metrics], bool], timeout: float = 10.0, interval: float = 0.1) -> Metrics:
        """Poll /metrics until `predicate` holds (bounded in time); returns the last scrape either way."""
        deadline = time.monotonic() + timeout
        while True:
            scrape = self.metrics()
            if predicate(scrape) or time.monotonic() > deadline:
                return scrape
            time.sleep(interval)


def _pump(stream, lines: queue.Queue) -> None:
    with stream:
        for line in stream:
            lines.put(line)
    lines.put(None)


@contextmanager
def start_server(*args: str, log_path: Path, ready_timeout: float = 90.0, stop_timeout: float = 30.0,
                 compile_off: bool = True, env: dict[str, str] | None = None,
                 kvreuse: Sequence[str] = (sys.executable, "-m", "kvreuse"), cwd: Path = REPO_ROOT) -> Iterator[Server]:
    """Run `python -m kvreuse serve --port 0 ARGS` (or `kvreuse`: another install's command; in `cwd`, with the
    environment `env`), wait for its ready line, yield a Server;
    on exit SIGTERM it (if it still runs) and wait, killing it after `stop_timeout`. With `compile_off` the decode
    step is not compiled unless ARGS ask for it (`--set engine.compile=decode`): compiling costs CPU the other tests
    need, and tests time nothing."""
    cmd = [*kvreuse, "serve", "--host", "127.0.0.1", "--port", "0",
           *(("--set", "engine.compile=off") if compile_off else ()), *args]
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=log, text=True, bufsize=1, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(process.stdout, lines), daemon=True).start()
    try:
        server = None
        deadline = time.monotonic() + ready_timeout
        while server is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ServerFailed(f"no ready line within {ready_timeout:.0f}s: {' '.join(cmd)}\n"
                                   f"{log_path.read_text(errors='replace')[-3000:]}")
            try:
                line = lines.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if line is None:
                process.wait(10)
                raise ServerFailed(f"server exited with {process.returncode} before it was ready: {' '.join(cmd)}\n"
                                   f"{log_path.read_text(errors='replace')[-3000:]}")
            match = READY.search(line)
            if match:
                settings = lines.get(timeout=max(1.0, deadline - time.monotonic())) or ""  # printed with the ready line
                server = Server(match.group(1), match.group(2), process, log_path, line.strip(), settings.strip())
        yield server
    finally:
        stop(process, stop_timeout)


def stop(process: subprocess.Popen, timeout: float = 30.0) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    return process.returncode


def sse_events(response: httpx.Response) -> Iterator[str]:
    """The `data:` payloads of a server-sent-events response, in order."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: "):]
        else:
            assert line == "", f"unexpected SSE line: {line!r}"


def read_stream(response: httpx.Response, stop_after_text_chunks: int | None = None,
                max_events: int = 10_000) -> dict:
    """Consume an SSE completion stream: text, finish reason, usage, whether [DONE] came, the chunks."""
    text, finish, usage, done, chunks, text_chunks = [], None, None, False, [], 0
    for data in sse_events(response):
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        chunks.append(chunk)
        assert "error" not in chunk, chunk
        if chunk.get("usage") is not None:
            usage = chunk["usage"]
        for choice in chunk["choices"]:
            piece = choice["delta"].get("content") if "delta" in choice else choice.get("text")
            if piece:
                text.append(piece)
                text_chunks += 1
            finish = choice.get("finish_reason") or finish
        if stop_after_text_chunks is not None and text_chunks >= stop_after_text_chunks:
            break
        assert len(chunks) < max_events, "runaway stream"
    return {"text": "".join(text), "finish_reason": finish, "usage": usage, "done": done, "chunks": chunks}


def start_long_requests(server: Server, max_tokens: int, timeout: float,
                        read_events: Callable[[httpx.Response], object],
                        include_usage: bool = False) -> tuple[dict, list[threading.Thread]]:
    """A long plain completion and a long chat stream (greedy, ignore_eos), each on a thread of its own, started.
    The returned dict gets "plain" (the httpx response) and "streamed" ((status, read_events(response))), or the
    exception either raised, for the test's thread to report."""
    results: dict = {}
    common = {"model": server.model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}

    def plain() -> None:
        try:
            with http_client(timeout) as client:
                results["plain"] = client.post(f"{server.base_url}/completions",
                                               json={**common, "prompt": "Keep going:"})
        except Exception as exc:
            results["plain"] = exc

    def streamed() -> None:
        body = {**common, "messages": [{"role": "user", "content": "Talk."}], "stream": True}
        if include_usage:
            body["stream_options"] = {"include_usage": True}
        try:
            with http_client(timeout) as client, client.stream("POST", f"{server.base_url}/chat/completions",
                                                             json=body) as r:
                results["streamed"] = (r.status_code, read_events(r))
        except Exception as exc:
            results["streamed"] = exc

    workers = [threading.Thread(target=fn, daemon=True) for fn in (plain, streamed)]
    for worker in workers:
        worker.start()
    return results, workers
