"""`kvreuse bench replay URL`: replay a scenario against any OpenAI-compatible server (ours, vLLM, llama.cpp).

As `vllm bench serve` does it: each conversation is one streaming POST /v1/chat/completions (greedy, ignore_eos,
a fixed max_tokens), sent all at once or as a seeded Poisson process, with at most `concurrency` in flight;
multi-turn requests resend the replies the server gave (`workloads.LiveReplies`). With `sessions`, each chat
session (a request and the later ones that extend it, `sessions_of`) sends its turns one after another, each when
the previous reply is in, and the sessions run side by side, as the clients of vLLM's multi-turn benchmark do.
TTFT, TPOT, ITL and end-to-end latency are timed on the client; prompt and cached tokens come from the server's
`usage` where it reports them. Failed requests are counted, not raised. Keys follow `vllm bench serve`.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from kvreuse.bench.metrics import serving_metrics, summary_ms
from kvreuse.bench.workloads import WORKLOADS, LiveReplies, chat

CONNECT_TIMEOUT_S = 10.0
# Long, since a queued request may wait minutes for its first chunk; only a server silent this long fails it.
READ_TIMEOUT_S = 600.0


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    text: str = ""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    replica: str | None = None  # behind `kvreuse serve --replicas N`: which replica served it
    cached_by_tier: dict | None = None  # ours: where the cached tokens came from (memory, disk, redis)


def describe(exc: Exception) -> str:
    # Some httpx errors (timeouts, for one) carry an empty message.
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def resolve_model(client: httpx.AsyncClient, root: str, model: str | None) -> str:
    # Always probed, so that an unreachable server fails once, clearly, before any request is timed.
    try:
        response = await client.get(f"{root}/v1/models")
    except httpx.HTTPError as exc:
        raise RuntimeError(f"cannot reach the server at {root}: {describe(exc)}") from exc
    if model is not None:  # a server without /v1/models can still be replayed against when the model is named
        return model
    if response.status_code != 200:
        raise RuntimeError(f"GET {root}/v1/models failed with HTTP {response.status_code}: {response.text[:300]} "
                           "(name the model to skip this look-up)")
    try:
        return response.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise RuntimeError(f"GET {root}/v1/models named no model: {response.text[:300]}") from exc


def stream_body(model: str, max_tokens: int, **fields) -> dict:
    """A greedy, ignore_eos, streaming request body of exactly `max_tokens` tokens that asks for usage."""
    return {"model": model, **fields, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}


async def send(client: httpx.AsyncClient, root: str, model: str, messages: list[dict],
               max_tokens: int) -> RequestResult:
    return await stream(client, f"{root}/v1/chat/completions", stream_body(model, max_tokens, messages=messages))


async def stream(client: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    """POST the streaming `body` to `url` (chat or plain completions) and time its chunks; failures in `error`."""
    result = RequestResult()
    usage, content_chunks, last = None, 0, None
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:300]}"
                return result
            async for line in response.aiter_lines():
                if line.startswith("error:"):  # llama.cpp's way of failing mid-stream
                    result.error = line[:300]
                    return result
                if not line.startswith("data:"):  # blank separators, comments, event: lines
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"error in stream: {json.dumps(chunk['error'])[:300]}"
                    return result
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choices = chunk.get("choices") or []
                # A plain completion streams `text`; a chat streams a delta, and reasoning models their thinking as
                # reasoning_content (vLLM, llama.cpp): tokens all the same.
                delta = ((choices[0].get("delta") or {"content": choices[0].get("text")}) if choices else {})
                result.text += delta.get("content") or ""
                if delta.get("content") or delta.get("reasoning_content"):
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    content_chunks += 1
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: a chunk that is not JSON
        result.error = describe(exc)
        return result
    result.latency = time.perf_counter() - start
    if last is None:  # nothing visible came (say, only special tokens): the first token is as late as the end
        result.ttft = result.latency
    usage = usage or {}
    completion = usage.get("completion_tokens")
    result.output_tokens = completion if isinstance(completion, int) else content_chunks
    result.prompt_tokens = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details") or {}
    result.cached_tokens = details.get("cached_tokens")
    result.cached_by_tier = details.get("cached_tokens_details")
    result.replica = usage.get("replica")
    result.success = True
    return result


def sessions_of(conversations: list[list[dict]]) -> list[list[int]]:
    """The chat sessions among `conversations`, as index lists in order: a request continues the latest session
    whose last request it extends (its messages start with all of that request's), else it opens one."""
    sessions: list[list[int]] = []
    for i, messages in enumerate(conversations):
        extended = next((s for s in reversed(sessions) if len(messages) > len(conversations[s[-1]])
                         and messages[:len(conversations[s[-1]])] == conversations[s[-1]]), None)
        if extended is None:
            sessions.append([i])
        else:
            extended.append(i)
    return sessions


def http_client(concurrency: int | None, api_key: str) -> httpx.AsyncClient:
    """The replay's client: no proxy, the bearer token, and one connection per allowed in-flight request, so no
    request waits for a pooled connection while timed."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S, pool=None)
    return httpx.AsyncClient(trust_env=False, timeout=timeout, limits=limits,
                             headers={"Authorization": f"Bearer {api_key}"})


async def replay(root: str, conversations: list[list[dict]], model: str | None, max_tokens: int,
                 concurrency: int | None, request_rate: float, api_key: str, seed: int,
                 progress: Callable[[int], None] | None, sessions: bool = False
                 ) -> tuple[str, list[RequestResult], float]:
    async with http_client(concurrency, api_key) as client:
        model = await resolve_model(client, root, model)
        semaphore = asyncio.Semaphore(concurrency) if concurrency is not None else None
        rng = random.Random(seed)

        replies = LiveReplies()

        async def one(messages: list[dict]) -> RequestResult:
            # Filled once a slot is free, so a turn sent after its predecessor finished carries its reply.
            if semaphore is None:
                result = await send(client, root, model, replies.fill(messages), max_tokens)
            else:
                async with semaphore:
                    result = await send(client, root, model, replies.fill(messages), max_tokens)
            if result.success:
                replies.record(messages, result.text)
            if progress is not None:
                progress(1)
            return result

        start = time.perf_counter()
        if sessions:
            results = await replay_sessions(conversations, one)
            return model, results, time.perf_counter() - start
        tasks = []
        for i, messages in enumerate(conversations):
            # Arrivals do not wait for the semaphore (as in vLLM): a capped run queues them client-side.
            if i and math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
            tasks.append(asyncio.create_task(one(messages)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return model, list(results), duration


async def replay_sessions(conversations: list[list[dict]], one: Callable) -> list[RequestResult]:
    """Each session's turns in order, each after the previous one's reply; the sessions at once. Results in the
    order of `conversations`."""
    results: list[RequestResult | None] = [None] * len(conversations)

    async def session(indices: list[int]) -> None:
        for i in indices:
            results[i] = await one(conversations[i])

    await asyncio.gather(*(session(indices) for indices in sessions_of(conversations)))
    return results


def run(url: str, conversations: list[list[dict]], *, model: str | None = None, max_tokens: int = 16,
        concurrency: int | None = None, request_rate: float = float("inf"), api_key: str = "EMPTY",
        seed: int = 0, progress: Callable[[int], None] | None = None, sessions: bool = False) -> dict:
    """Replay `conversations` (chat message lists) against the OpenAI-compatible server at `url` and return
    `vllm bench serve`'s metrics.

    `url` is the server root, with or without `/v1`; `model` defaults to the first id of GET /v1/models.
    Each conversation is one streaming chat completion of exactly `max_tokens` tokens (temperature 0,
    ignore_eos). `request_rate` (requests/s) draws Poisson arrivals seeded by `seed`; infinity sends all at
    once. `concurrency` caps requests in flight (None: no cap). `progress(1)` is called after each finished
    request, failed or not (tqdm's `update` fits). Failed requests are counted in `failed`; RuntimeError if
    the server cannot be reached or no request succeeds. Token counts and cached tokens come from the server's
    usage reports: total_input_tokens, cached_tokens and exact_hit_rate are None where it sends none.
    `sessions`: send each chat session's turns in order, the sessions side by side (`request_rate` unused);
    `session_affinity` is then the mean share of a session's turns served by its most used replica (None when the
    server names no replica).
    """
    if not conversations:
        raise ValueError("no conversations to replay")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1 or None, got {concurrency}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    root = url.strip().rstrip("/").removesuffix("/v1")
    model, results, duration = asyncio.run(replay(root, conversations, model, max_tokens, concurrency,
                                                  request_rate, api_key, seed, progress, sessions))
    ok = [r for r in results if r.success]
    errors = [r.error for r in results if not r.success]
    if not ok:
        raise RuntimeError(f"no request to {root} succeeded ({len(errors)} failed); first error: {errors[0]}")

    total_in, cached, hit_rate = cache_totals(ok)
    return {
        "url": root, "model": model, "concurrency": concurrency,
        "request_rate": "inf" if math.isinf(request_rate) else request_rate,
        "failed": len(errors), "first_error": errors[0] if errors else None,
        **serving_metrics([r.ttft for r in ok], [r.latency for r in ok], [r.output_tokens for r in ok], duration,
                          total_in),
        **summary_ms("itl", [gap for r in ok for gap in r.itl]),
        "cached_tokens": cached, "exact_hit_rate": hit_rate,
        "sessions": sessions, "session_affinity": session_affinity(conversations, results),
        "replicas": sorted({r.replica for r in ok if r.replica}),
    }


def cache_totals(ok: list[RequestResult]) -> tuple[int | None, int | None, float | None]:
    """Prompt tokens, cached tokens and their ratio over successful requests, from the server's usage (None where it
    reported none); the rate is over the requests that reported cached tokens, so a partial report stays a ratio."""
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    cached_pairs = [(r.cached_tokens, r.prompt_tokens or 0) for r in ok if r.cached_tokens is not None]
    cached = sum(c for c, _ in cached_pairs) if cached_pairs else None
    cached_of = sum(p for _, p in cached_pairs)
    return (sum(prompts) if prompts else None, cached,
            cached / cached_of if cached is not None and cached_of else None)


def session_affinity(conversations: list[list[dict]], results: list[RequestResult]) -> float | None:
    """Mean over sessions of the share of its served turns that its most used replica served."""
    served = [[results[i].replica for i in s if results[i].success and results[i].replica]
              for s in sessions_of(conversations)]
    served = [replicas for replicas in served if replicas]
    if not served:
        return None
    return sum(max(map(replicas.count, replicas)) / len(replicas) for replicas in served) / len(served)


def run_scenarios(url: str, scenarios: list[str], num_requests: int, max_tokens: int, turns: int | None = None,
                  **options) -> dict:
    """`run` on each scenario's workload of `num_requests` conversations, with a progress bar per scenario;
    `turns` sets the chat workload's turns per session; `options` are run's keyword arguments. Returns
    {"suite": "replay", "url", "requests", "max_tokens", "scenarios": {scenario: run(...)}}."""
    report = {"suite": "replay", "url": url, "requests": num_requests, "max_tokens": max_tokens, "scenarios": {}}
    for scenario in scenarios:
        conversations = (chat(num_requests, turns) if scenario == "chat" and turns else
                         WORKLOADS[scenario](num_requests))
        with tqdm(total=len(conversations), desc=f"{scenario} @ {url}", unit="req", leave=False,
                  disable=None) as bar:  # no bar when stderr is not a terminal
            report["scenarios"][scenario] = run(url, conversations, max_tokens=max_tokens, progress=bar.update,
                                                **options)
    return report


def markdown(report: dict) -> str:
    """A `kvreuse bench replay` report ({"scenarios": {name: run(...)}}) as a Markdown table."""
    lines = ["| scenario | completed | failed | mean TTFT ms | p99 TTFT ms | mean TPOT ms | req/s | output tok/s | "
             "cached tokens | session affinity |", "|---" * 10 + "|"]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    for scenario, r in report["scenarios"].items():
        lines.append(f"| {scenario} | {r['completed']} | {r['failed']} | {r['mean_ttft_ms']:.0f} | "
                     f"{r['p99_ttft_ms']:.0f} | {fmt(r['mean_tpot_ms'], '.1f')} | {r['request_throughput']:.2f} | "
                     f"{r['output_throughput']:.1f} | {fmt(r['exact_hit_rate'], '.1%')} | "
                     f"{fmt(r.get('session_affinity'), '.2f')} |")
    return "\n".join(lines)
