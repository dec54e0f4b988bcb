"""Aggregate accounting across requests: token split, hit rate, block states, evictions, peak memory."""

from __future__ import annotations

import resource
import sys
from dataclasses import asdict, dataclass, field

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

    def snapshot(self, kv: KVCacheManager, bytes_per_block: int) -> dict:
        """Everything as one flat dict (for logs, `--json` summaries and metrics)."""
        pool = kv.pool
        cached = pool.num_cached_blocks
        in_use = pool.num_used_blocks
        counters = asdict(self)
        del counters["reuse"]
        return {
            **counters,
            **self.reuse.as_dict(),
            "hit_rate": round(self.reuse.hit_rate, 4),
            "approximate_hit_rate": round(self.reuse.approximate_hit_rate, 4),
            "prefill_work_tokens": self.reuse.prefill_work_tokens,
            "blocks_total": pool.num_blocks,
            "blocks_in_use": in_use,
            "blocks_cached": cached,
            "blocks_free": len(pool.free_block_ids),
            "evictions": pool.num_evictions,
            "eviction_policy": pool.evictable.name,
            "kv_bytes_in_use": in_use * bytes_per_block,
            "kv_bytes_cached": cached * bytes_per_block,
            "peak_kv_bytes_in_use": self.peak_blocks_in_use * bytes_per_block,
            "peak_kv_bytes_in_use_or_cached": self.peak_blocks_in_use_or_cached * bytes_per_block,
            "peak_rss_bytes": peak_rss_bytes(),
        }
