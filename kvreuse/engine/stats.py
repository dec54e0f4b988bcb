"""Aggregate accounting across requests: token split, hit rate, block states, evictions, peak memory."""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass, field, fields

from kvreuse.engine.sequence import Sequence
from kvreuse.kvcache.accounting import ReuseRecord
from kvreuse.kvcache.manager import KVCacheManager


def peak_rss_bytes() -> int:
    # ru_maxrss is the kernel's own high-water mark: kilobytes on Linux, bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


@dataclass
class EngineStats:
    num_requests: int = 0
    reuse: ReuseRecord = field(default_factory=ReuseRecord)  # summed over finished requests
    completion_tokens: int = 0
    prefill_tokens_run: int = 0       # tokens run through prefill steps, recomputation after preemption included
    num_preemptions: int = 0
    peak_blocks_in_use: int = 0
    peak_blocks_in_use_or_cached: int = 0

    def record_step(self, kv: KVCacheManager, num_prefill_tokens: int) -> None:
        pool = kv.pool
        self.prefill_tokens_run += num_prefill_tokens
        in_use = pool.num_used_blocks
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, in_use)
        self.peak_blocks_in_use_or_cached = max(self.peak_blocks_in_use_or_cached, in_use + pool.num_cached_blocks)

    def record_finished(self, seq: Sequence) -> None:
        self.num_requests += seq.index == 0  # the other choices of a request (n > 1) are not requests of their own
        self.reuse += seq.reuse_or_planned
        self.completion_tokens += seq.num_completion_tokens
        self.num_preemptions += seq.num_preemptions

    def snapshot(self, kv: KVCacheManager, bytes_per_block: int, **engine_state) -> EngineSnapshot:
        """These counters with the pool's state now; `engine_state`: the rest of EngineSnapshot's fields."""
        pool = kv.pool
        counters = {f.name: getattr(self, f.name) for f in fields(self)}
        return EngineSnapshot(**counters, blocks_total=pool.num_blocks, blocks_in_use=pool.num_used_blocks,
                              blocks_cached=pool.num_cached_blocks, blocks_free=len(pool.free_block_ids),
                              evictions=pool.num_evictions, eviction_policy=pool.evictable.name,
                              bytes_per_block=bytes_per_block, peak_rss_bytes=peak_rss_bytes(), **engine_state)


# The decode step's states (decode_graph.py): eager until compiled, and eager for good once failed or cancelled (the
# engine closed first). `engine.compile = off` is "eager" throughout.
COMPILE_STATES = ("eager", "compiling", "compiled", "failed", "cancelled")


def compile_summary(states: list[str]) -> str:
    """The decode step of every engine, briefly: their common state, "mixed: 1 compiling, 2 compiled" where
    they differ (a cluster's replicas), "unknown" with none known (replicas that have served nothing yet)."""
    if not states:
        return "unknown"
    if len(set(states)) == 1:
        return states[0]
    return "mixed: " + ", ".join(f"{states.count(s)} {s}" for s in COMPILE_STATES if s in states)


@dataclass(frozen=True)
class DecodeGraphStatus:
    """The compiled decode step (`engine.compile = decode`, decode_graph.py): its state and use so far."""
    state: str                # one of COMPILE_STATES
    num_steps: int            # steps run through the graph
    compile_s: float | None   # how long compiling took, once done


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state and accounting at one moment: what metrics, logs, `/cache/stats` and the benches read of
    it. Plain values only, so that it pickles: a cluster replica sends its own to the ingress."""
    num_requests: int                  # finished requests (the choices of one request count once)
    reuse: ReuseRecord                 # how the prompts of the finished requests were obtained, summed
    completion_tokens: int
    prefill_tokens_run: int            # tokens run through prefill steps, recomputation after preemption included
    num_preemptions: int
    peak_blocks_in_use: int
    peak_blocks_in_use_or_cached: int
    blocks_total: int
    blocks_in_use: int                 # held by requests and pins
    blocks_cached: int                 # held by no request, kept for reuse
    blocks_free: int
    evictions: int                     # cached blocks evicted so far
    eviction_policy: str
    bytes_per_block: int               # of K/V, all layers
    peak_rss_bytes: int                # of this process
    num_requests_running: int
    num_requests_waiting: int
    kv_capacity_tokens: int = 0        # the longest sequence the pool holds (FrontEnd.kv_capacity_tokens)
    threads: int = 0                   # of the engine's parallel ops now (engine/cpu_share.py)
    group_windows: tuple[int | None, ...] = (None,)  # each layer group's window (None: full attention)
    # Tokens whose K/V requests hold, per layer group, in whole blocks (a window group holds only its windows).
    group_tokens_in_use: tuple[int, ...] = ()
    decode_graph: DecodeGraphStatus | None = None  # with `engine.compile = decode`
    tiers: dict | None = None          # with lower tiers: their counters and the write queue's (TieredStore.snapshot)
    pins: dict | None = None           # pinned prefixes (Pins.snapshot)
    sessions: dict | None = None       # sessions' retained blocks (SessionRetention.snapshot)
    events: dict | None = None         # with `[events] endpoint`: the publisher's counters (KVEventPublisher.snapshot)
    replica: str | None = None         # the cluster replica whose engine this is; None: this process's own engine

    @property
    def compile_state(self) -> str:
        """The decode step's state, one of COMPILE_STATES ("eager" with `engine.compile = off`)."""
        return self.decode_graph.state if self.decode_graph is not None else "eager"

    @property
    def kv_usage(self) -> float:
        """The fraction of the pool's blocks held by requests."""
        return self.blocks_in_use / self.blocks_total

    @property
    def kv_bytes_in_use(self) -> int:
        return self.blocks_in_use * self.bytes_per_block

    @property
    def kv_bytes_cached(self) -> int:
        return self.blocks_cached * self.bytes_per_block

    @property
    def peak_kv_bytes_in_use(self) -> int:
        return self.peak_blocks_in_use * self.bytes_per_block

    @property
    def peak_kv_bytes_in_use_or_cached(self) -> int:
        return self.peak_blocks_in_use_or_cached * self.bytes_per_block
