"""Prometheus metrics in vLLM's names (so existing dashboards work), plus kvreuse's own.

Each app gets its own registry: no global state, several engines can live in one process.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvreuse.engine.engine import LLMEngine
from kvreuse.engine.output import RequestOutput
from kvreuse.engine.stats import COMPILE_STATES, EngineSnapshot, peak_rss_bytes
from kvreuse.kvcache.accounting import ReuseRecord
from kvreuse.kvcache.tiers.entry import REASONS

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Counters of the lower tiers (TieredStore.snapshot, per tier): metric name -> (snapshot key, help).
TIER_COUNTERS = {
    "kvreuse:tier_hit_blocks": ("hit_blocks", "Blocks loaded from a lower tier and checked"),
    "kvreuse:tier_loaded_bytes": ("loaded_bytes", "Payload bytes loaded from a lower tier"),
    "kvreuse:tier_written_blocks": ("entries_written", "Blocks written to a lower tier"),
    "kvreuse:tier_written_bytes": ("bytes_written", "Bytes written to a lower tier"),
    "kvreuse:tier_evictions": ("evictions", "Entries a lower tier dropped to stay within its limit"),
    "kvreuse:tier_errors": ("errors", "Lower-tier operations that failed (I/O, connection, timeout): misses"),
}


@dataclass(frozen=True)
class GaugeValues:
    """What the engine gauges show: one engine's snapshot, or a cluster's replicas' together."""
    blocks_in_use: int
    blocks_total: int
    num_requests_running: int
    num_requests_waiting: int
    blocks_cached: int
    evictions: int
    eviction_policy: str
    peak_kv_bytes_in_use: int
    kv_capacity_tokens: int                 # the longest sequence one engine holds
    group_windows: tuple[int | None, ...]
    group_tokens_in_use: tuple[int, ...]
    threads: int                            # of the engines' parallel ops, summed

    @classmethod
    def of(cls, s: EngineSnapshot) -> GaugeValues:
        return cls(s.blocks_in_use, s.blocks_total, s.num_requests_running, s.num_requests_waiting, s.blocks_cached,
                   s.evictions, s.eviction_policy, s.peak_kv_bytes_in_use, s.kv_capacity_tokens, s.group_windows,
                   s.group_tokens_in_use, s.threads)

    @classmethod
    def summed(cls, snapshots: list[EngineSnapshot], eviction_policy: str) -> GaugeValues:
        """The replicas' sums, and the highest of their peaks and capacities (replicas of one model and layout)."""
        return cls(sum(s.blocks_in_use for s in snapshots), sum(s.blocks_total for s in snapshots),
                   sum(s.num_requests_running for s in snapshots), sum(s.num_requests_waiting for s in snapshots),
                   sum(s.blocks_cached for s in snapshots), sum(s.evictions for s in snapshots), eviction_policy,
                   max(s.peak_kv_bytes_in_use for s in snapshots), max(s.kv_capacity_tokens for s in snapshots),
                   snapshots[0].group_windows,
                   tuple(map(sum, zip(*(s.group_tokens_in_use for s in snapshots), strict=True))),
                   sum(s.threads for s in snapshots))


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.prefix_cache_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                            labels, registry=r)
        # One counter per field of the reuse record, named in its metadata (vllm:prompt_tokens,
        # vllm:prefix_cache_hits, kvreuse:reused_prompt_tokens, ...).
        self.reuse = {name: Counter(metric, help_text, labels, registry=r)
                      for name, metric, help_text in ReuseRecord.metrics()}
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
        self.evictions = Gauge("kvreuse:cache_evictions", "Cached blocks evicted so far", labels + ["policy"],
                               registry=r)
        self.cached_blocks = Gauge("kvreuse:cached_blocks", "Unreferenced cached KV blocks kept for reuse", labels,
                                   registry=r)
        self.peak_kv_bytes = Gauge("kvreuse:peak_kv_bytes_in_use", "Peak KV bytes held by requests", labels,
                                   registry=r)
        self.peak_rss = Gauge("kvreuse:peak_rss_bytes", "Peak resident memory of the server process", labels,
                              registry=r)
        self.kv_capacity = Gauge("kvreuse:kv_capacity_tokens", "The longest sequence the KV pool holds (a grouped "
                                 "pool's window groups keep only their windows)", labels, registry=r)
        self.group_tokens = Gauge("kvreuse:kv_tokens_in_use", "Tokens whose K/V requests hold, per layer group of the "
                                  "pool: window is full, or the sliding window's keys", labels + ["group", "window"],
                                  registry=r)
        self.threads = Gauge("kvreuse:engine_threads", "Threads of the engine's parallel ops: the CPUs it may use, "
                             "fewer while other programs keep them busy (engine.threads)", labels, registry=r)
        self.compile_state = Gauge("kvreuse:decode_compile_state", "Engines whose decode step is in this state: "
                                   "eager, compiling, compiled, failed or cancelled (1 for the one engine without "
                                   "replicas)", labels + ["state"], registry=r)
        self.tier_hit_tokens = Counter("kvreuse:tier_hit_tokens", "Cached prompt tokens by where they came from",
                                       labels + ["tier"], registry=r)
        self.tier_load = Histogram("kvreuse:tier_load_seconds", "Time a request's cached prefix took to load from "
                                   "the lower tiers (read, check, copy into the pool)", labels, buckets=LOAD_BUCKETS,
                                   registry=r)
        self.tier_counters = {name: Counter(name, help_text, labels + ["tier"], registry=r)
                              for name, (_, help_text) in TIER_COUNTERS.items()}
        self.tier_invalid = Counter("kvreuse:tier_invalid_entries", "Entries refused on read (and deleted), by why",
                                    labels + ["tier", "reason"], registry=r)
        self.tier_dropped = Counter("kvreuse:tier_dropped_blocks", "Published blocks not written to the lower tiers: "
                                    "the write queue was full", labels, registry=r)
        self._tier_seen: dict[tuple, float] = {}  # last snapshot value of each mirrored counter
        self._add_replica_gauges(labels + ["replica"])
        self.model_name = model_name
        for metric in (self.prefix_cache_queries, *self.reuse.values(), self.generation_tokens, self.kv_usage,
                       self.running, self.waiting):
            metric.labels(model_name)  # exported as 0 from the start, not only after the first request
        self.observe_compile([])

    def _add_replica_gauges(self, replica_labels: list[str]) -> None:
        """With --replicas N: each replica's latest engine snapshot, and its gauges."""
        r = self.registry
        self.replica_snapshots: dict[str, EngineSnapshot] = {}
        self.replica_kv_usage = Gauge("kvreuse:replica_kv_cache_usage_perc", "A replica's fraction of KV blocks held "
                                      "by requests (as of its latest finished request)", replica_labels, registry=r)
        self.replica_running = Gauge("kvreuse:replica_num_requests_running", "A replica's running requests",
                                     replica_labels, registry=r)
        self.replica_waiting = Gauge("kvreuse:replica_num_requests_waiting", "A replica's waiting requests",
                                     replica_labels, registry=r)

    def observe_step(self, engine: LLMEngine) -> None:
        """Gauges, from the engine thread: while it steps every `async_engine.OBSERVE_EVERY_S`, when it runs out of work
        and after an abort frees blocks."""
        snapshot = engine.stats_snapshot()
        self._set_gauges(GaugeValues.of(snapshot))
        if snapshot.tiers is not None:
            self._observe_tiers(snapshot.tiers)

    def observe_replica(self, snapshot: EngineSnapshot) -> None:
        """A cluster replica's engine snapshot (as of its latest finished request): its own gauges, labeled with the
        replica, and the cluster's gauges summed over the replicas' latest snapshots."""
        m, replica = self.model_name, snapshot.replica
        self.replica_snapshots[replica] = snapshot
        self.replica_kv_usage.labels(m, replica).set(snapshot.kv_usage)
        self.replica_running.labels(m, replica).set(snapshot.num_requests_running)
        self.replica_waiting.labels(m, replica).set(snapshot.num_requests_waiting)
        self._set_gauges(GaugeValues.summed(list(self.replica_snapshots.values()), snapshot.eviction_policy))

    def _set_gauges(self, g: GaugeValues) -> None:
        m = self.model_name
        self.kv_usage.labels(m).set(g.blocks_in_use / g.blocks_total)
        self.running.labels(m).set(g.num_requests_running)
        self.waiting.labels(m).set(g.num_requests_waiting)
        self.cached_blocks.labels(m).set(g.blocks_cached)
        self.evictions.labels(m, g.eviction_policy).set(g.evictions)
        self.peak_kv_bytes.labels(m).set(g.peak_kv_bytes_in_use)
        self.kv_capacity.labels(m).set(g.kv_capacity_tokens)
        self.threads.labels(m).set(g.threads)
        for group, (window, num_tokens) in enumerate(zip(g.group_windows, g.group_tokens_in_use, strict=True)):
            self.group_tokens.labels(m, str(group), "full" if window is None else str(window)).set(num_tokens)

    def _observe_tiers(self, snapshot: dict) -> None:
        """Mirror the store's counters (their growth since the last step) into Prometheus counters."""
        m = self.model_name
        self._advance(self.tier_dropped.labels(m), ("dropped",), snapshot["dropped_blocks"])
        for tier, values in snapshot["tiers"].items():
            for name, (key, _) in TIER_COUNTERS.items():
                self._advance(self.tier_counters[name].labels(m, tier), (name, tier), values[key])
            for reason in REASONS:
                self._advance(self.tier_invalid.labels(m, tier, reason), ("invalid", tier, reason),
                              values["invalid_entries"].get(reason, 0))

    def _advance(self, counter, key: tuple, value: float) -> None:
        counter.inc(max(0.0, value - self._tier_seen.get(key, 0.0)))
        self._tier_seen[key] = max(value, self._tier_seen.get(key, 0.0))

    def observe_compile(self, states: list[str]) -> None:
        """The decode step's state of each engine (EngineClient.compile_states), read at scrape time: it changes on
        the compile thread, between steps."""
        for state in COMPILE_STATES:
            self.compile_state.labels(self.model_name, state).set(states.count(state))

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric, for a `/metrics` scrape."""
        # Peak RSS is read at scrape time rather than per step: it is the process's, not the engine's.
        self.peak_rss.labels(self.model_name).set(peak_rss_bytes())
        return generate_latest(self.registry)

    def observe_finished(self, out: RequestOutput) -> None:
        m, u = self.model_name, out.usage
        self.prefix_cache_queries.labels(m).inc(u.prompt_tokens)
        for name, counter in self.reuse.items():
            counter.labels(m).inc(getattr(u, name))
        for tier, num_tokens in u.cached_by_tier().items():
            self.tier_hit_tokens.labels(m, tier).inc(num_tokens)
        if out.tier_load_s:
            self.tier_load.labels(m).observe(out.tier_load_s)
        self.generation_tokens.labels(m).inc(u.completion_tokens)
        self.request_success.labels(m, out.finish_reason or "abort").inc()
        if out.ttft_s is not None:
            self.ttft.labels(m).observe(out.ttft_s)
        if out.total_s is not None:
            self.e2e.labels(m).observe(out.total_s)
