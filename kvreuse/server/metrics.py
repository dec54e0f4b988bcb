"""Prometheus metrics in vLLM's names (so existing dashboards work), plus kvreuse's own.

Each app gets its own registry: no global state, several engines can live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvreuse.engine.engine import LLMEngine
from kvreuse.engine.output import RequestOutput

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.prefix_cache_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                            labels, registry=r)
        self.prefix_cache_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache",
                                         labels, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", labels, registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests", labels + ["finished_reason"],
                                       registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", labels,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks held by requests (0-1)", labels,
                              registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", labels, registry=r)
        self.computed = Counter("kvreuse:computed_prompt_tokens", "Prompt tokens computed fresh", labels, registry=r)
        self.reused = Counter("kvreuse:reused_prompt_tokens", "Prompt tokens from approximate segment reuse",
                              labels, registry=r)
        self.recomputed = Counter("kvreuse:recomputed_prompt_tokens", "Reused tokens recomputed by the repair",
                                  labels, registry=r)
        self.discarded = Counter("kvreuse:discarded_prompt_tokens",
                                 "Token work of approximate passes the fidelity guard threw away", labels, registry=r)
        self.guarded = Counter("kvreuse:guarded_requests", "Requests the fidelity guard recomputed exactly",
                               labels, registry=r)
        self.evictions = Gauge("kvreuse:cache_evictions", "Cached blocks evicted so far", labels + ["policy"],
                               registry=r)
        self.cached_blocks = Gauge("kvreuse:cached_blocks", "Unreferenced cached KV blocks kept for reuse", labels,
                                   registry=r)
        self.peak_kv_bytes = Gauge("kvreuse:peak_kv_bytes_in_use", "Peak KV bytes held by requests", labels,
                                   registry=r)
        self.peak_rss = Gauge("kvreuse:peak_rss_bytes", "Peak resident memory of the server process", labels,
                              registry=r)
        self.model_name = model_name
        for metric in (self.prefix_cache_queries, self.prefix_cache_hits, self.prompt_tokens, self.generation_tokens,
                       self.computed, self.reused, self.recomputed, self.kv_usage, self.running, self.waiting):
            metric.labels(model_name)  # exported as 0 from the start, not only after the first request

    def observe_step(self, engine: LLMEngine) -> None:
        """Gauges, from the engine thread after each step."""
        m = self.model_name
        pool = engine.kv_manager.pool
        in_use = pool.num_used_blocks
        self.kv_usage.labels(m).set(in_use / pool.num_blocks)
        self.running.labels(m).set(len(engine.scheduler.running))
        self.waiting.labels(m).set(len(engine.scheduler.waiting))
        self.cached_blocks.labels(m).set(pool.num_cached_blocks)
        self.evictions.labels(m, pool.evictable.name).set(pool.num_evictions)
        self.peak_kv_bytes.labels(m).set(engine.stats.peak_blocks_in_use * engine.runner.bytes_per_block)

    def observe_finished(self, out: RequestOutput) -> None:
        m, u = self.model_name, out.usage
        self.prefix_cache_queries.labels(m).inc(u.prompt_tokens)
        self.prefix_cache_hits.labels(m).inc(u.cached_tokens)
        self.prompt_tokens.labels(m).inc(u.prompt_tokens)
        self.generation_tokens.labels(m).inc(u.completion_tokens)
        self.computed.labels(m).inc(u.computed_prompt_tokens)
        self.reused.labels(m).inc(u.reused_tokens)
        self.recomputed.labels(m).inc(u.recomputed_tokens)
        self.discarded.labels(m).inc(u.discarded_tokens)
        if u.guarded:
            self.guarded.labels(m).inc()
        self.request_success.labels(m, out.finish_reason or "abort").inc()
        if out.ttft_s is not None:
            self.ttft.labels(m).observe(out.ttft_s)
        if out.total_s is not None:
            self.e2e.labels(m).observe(out.total_s)
