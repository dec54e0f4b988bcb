"""`kvreuse bench replay URL --trace FILE`: a Mooncake-format trace replayed live against any OpenAI-compatible server.

Each request is one streaming POST /v1/completions whose `prompt` is a list of token ids built from its hash ids
(`vocab_prompts`), so no tokenizer round trip moves a block boundary; `output_length` becomes `max_tokens` (capped by
`max_output_tokens`) with `ignore_eos`, greedy. Request i is sent `(timestamp_i - timestamp_0) * time_scale` ms after
the start (time_scale 1: real time; 0.1: ten times faster; 0: all at once), or as soon as a slot is free under
`concurrency`; one sent more than `arrival_slack_s` after its time missed its arrival. TTFT is timed on the client,
prompt and cached tokens come from the server's usage, and the replica from our cluster's usage.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from kvreuse.bench.metrics import percentile, serving_metrics
from kvreuse.bench.replay import RequestResult, cache_totals, http_client, resolve_model, stream, stream_body
from kvreuse.bench.trace import MOONCAKE_HASH_BLOCK_TOKENS, TraceRequest
from kvreuse.bench.vocab_prompts import SMOLLM2_VOCAB_SIZE, vocab_prompt

DEFAULT_ARRIVAL_SLACK_S = 0.05


@dataclass
class Sent:
    """One trace request as replayed: when it was due and when it went out (s from the start), and its result."""
    scheduled_s: float
    sent_s: float
    max_tokens: int
    result: RequestResult

    @property
    def lateness_s(self) -> float:
        return self.sent_s - self.scheduled_s


def schedule(requests: list[TraceRequest], time_scale: float) -> list[float]:
    """Each request's send time in seconds from the start: its timestamp's offset from the first's, scaled."""
    first = requests[0].timestamp
    return [(r.timestamp - first) / 1000 * time_scale for r in requests]


def output_tokens(request: TraceRequest, cap: int | None) -> int:
    """The request's `max_tokens`: its output length (at least 1), at most `cap`."""
    wanted = max(1, request.output_length)
    return wanted if cap is None else min(wanted, cap)


async def _replay(root: str, prompts: list[list[int]], due: list[float], max_tokens: list[int], model: str | None,
                  concurrency: int | None, api_key: str, progress: Callable[[int], None] | None
                  ) -> tuple[str, list[Sent], float]:
    async with http_client(concurrency, api_key) as client:
        model = await resolve_model(client, root, model)
        semaphore = asyncio.Semaphore(concurrency) if concurrency is not None else asyncio.Semaphore(len(prompts))
        start = time.perf_counter()

        async def one(prompt: list[int], scheduled: float, tokens: int) -> Sent:
            while (wait := start + scheduled - time.perf_counter()) > 0:  # never early, whatever the loop's clock
                await asyncio.sleep(wait)
            async with semaphore:
                sent = time.perf_counter() - start
                result = await stream(client, f"{root}/v1/completions", stream_body(model, tokens, prompt=prompt))
            if progress is not None:
                progress(1)
            return Sent(scheduled, sent, tokens, result)

        sent = await asyncio.gather(*(one(p, d, n) for p, d, n in zip(prompts, due, max_tokens, strict=True)))
        return model, list(sent), time.perf_counter() - start


def run(url: str, requests: list[TraceRequest], *, tokens_per_hash: int = MOONCAKE_HASH_BLOCK_TOKENS,
        hash_block_tokens: int = MOONCAKE_HASH_BLOCK_TOKENS, time_scale: float = 1.0,
        max_output_tokens: int | None = None, vocab_size: int = SMOLLM2_VOCAB_SIZE, concurrency: int | None = None,
        arrival_slack_s: float = DEFAULT_ARRIVAL_SLACK_S, model: str | None = None, api_key: str = "EMPTY",
        seed: int = 0, progress: Callable[[int], None] | None = None) -> dict:
    """Replay `requests` live against the server at `url` (its root, with or without /v1) and return the report:
    `vllm bench serve`'s keys, TTFT p50/p90/p99, the hit rate from usage, late arrivals, the replicas that served
    and each request's figures under "per_request". ValueError for bad arguments; RuntimeError if the server cannot
    be reached or no request succeeds (its first error, with a hint where the token ids were refused)."""
    if not requests:
        raise ValueError("no trace requests to replay")
    if tokens_per_hash < 1 or hash_block_tokens < 1:
        raise ValueError(f"tokens_per_hash and hash_block_tokens must be >= 1, got {tokens_per_hash}, "
                         f"{hash_block_tokens}")
    if not time_scale >= 0:
        raise ValueError(f"time_scale must be >= 0, got {time_scale}")
    if max_output_tokens is not None and max_output_tokens < 1:
        raise ValueError(f"max_output_tokens must be >= 1, got {max_output_tokens}")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1 or None, got {concurrency}")
    root = url.strip().rstrip("/").removesuffix("/v1")
    prompts = [vocab_prompt(r, tokens_per_hash, vocab_size, hash_block_tokens, seed) for r in requests]
    max_tokens = [output_tokens(r, max_output_tokens) for r in requests]
    model, sent, duration = asyncio.run(_replay(root, prompts, schedule(requests, time_scale), max_tokens, model,
                                                concurrency, api_key, progress))
    ok = [s.result for s in sent if s.result.success]
    errors = [s.result.error for s in sent if not s.result.success]
    if not ok:
        hint = (f" (are the token ids inside the model's vocabulary? --vocab-size is {vocab_size})"
                if "token id" in errors[0] else "")
        raise RuntimeError(f"no request to {root} succeeded ({len(errors)} failed); first error: {errors[0]}{hint}")
    total_in, cached, hit_rate = cache_totals(ok)
    late = [s.lateness_s for s in sent if s.lateness_s > arrival_slack_s]
    ttfts_ms = [r.ttft * 1000 for r in ok]
    return {
        "url": root, "model": model, "requests": len(requests), "tokens_per_hash": tokens_per_hash,
        "hash_block_tokens": hash_block_tokens, "time_scale": time_scale, "max_output_tokens": max_output_tokens,
        "capped_outputs": sum(n < max(1, r.output_length) for n, r in zip(max_tokens, requests, strict=True)),
        "vocab_size": vocab_size, "concurrency": concurrency, "arrival_slack_ms": arrival_slack_s * 1000,
        "trace_span_s": sent[-1].scheduled_s,
        "failed": len(errors), "first_error": errors[0] if errors else None,
        **serving_metrics([r.ttft for r in ok], [r.latency for r in ok], [r.output_tokens for r in ok], duration,
                          total_in),
        **{f"p{q}_ttft_ms": percentile(ttfts_ms, q) for q in (50, 90)},
        "cached_tokens": cached, "exact_hit_rate": hit_rate, "cached_by_tier": cached_by_tier(ok),
        "late_arrivals": len(late), "max_lateness_ms": max(s.lateness_s for s in sent) * 1000,
        "replicas": dict(sorted(Counter(r.replica for r in ok if r.replica).items())),
        "per_request": [per_request(s) for s in sent],
    }


def cached_by_tier(ok: list[RequestResult]) -> dict[str, int]:
    """Cached tokens summed per tier they came from, where the server says (ours: memory, disk, redis)."""
    totals: Counter = Counter()
    for r in ok:
        totals.update(r.cached_by_tier or {})
    return dict(totals)


def per_request(sent: Sent) -> dict:
    r = sent.result
    return {"scheduled_ms": sent.scheduled_s * 1000, "sent_ms": sent.sent_s * 1000, "max_tokens": sent.max_tokens,
            "ttft_ms": r.ttft * 1000 if r.success else None, "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens, "output_tokens": r.output_tokens if r.success else None,
            "replica": r.replica, "error": r.error or None}


TABLE_HEADER = ("| completed | failed | late | max lateness ms | hit rate | mean TTFT ms | p50 | p90 | p99 | "
                "output tok/s | replicas |")


def row(report: dict) -> str:
    """One replay's cells (after any leading cells of the caller), matching TABLE_HEADER."""
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    replicas = ", ".join(f"{name} {count}" for name, count in report["replicas"].items()) or "-"
    return (f"| {report['completed']} | {report['failed']} | {report['late_arrivals']} | "
            f"{report['max_lateness_ms']:.0f} | {fmt(report['exact_hit_rate'], '.1%')} | "
            f"{report['mean_ttft_ms']:.0f} | {report['p50_ttft_ms']:.0f} | {report['p90_ttft_ms']:.0f} | "
            f"{report['p99_ttft_ms']:.0f} | {report['output_throughput']:.1f} | {replicas} |")


def markdown(report: dict) -> str:
    """A live trace replay's report as a one-row Markdown table and a line saying how it was replayed."""
    cap = report["max_output_tokens"]
    capped = f" capped at {cap} ({report['capped_outputs']} capped)" if cap else ""
    how = (f"{report['requests']} requests of {report.get('trace', 'the trace')}, {report['tokens_per_hash']} tokens "
           f"per hash id, time scale {report['time_scale']:g} ({report['trace_span_s']:.1f} s of arrivals), "
           f"max_tokens = output_length{capped}; late: sent over {report['arrival_slack_ms']:.0f} ms after its time.")
    return "\n".join([TABLE_HEADER, "|---" * TABLE_HEADER.count("|", 1) + "|", row(report), "", how])
