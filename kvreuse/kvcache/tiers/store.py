"""The tiers under the pool, as one store: blocks written through to them off the hot path, and a request's prefix
chain read back from them while the request waits.

Write path: when the pool publishes exactly computed blocks, `store` copies their K/V out of the pool (on the
engine thread: a later step may overwrite the pool block) and queues them; a writer thread encodes each as a
checked entry signed with the tier secret (entry.py, tier_secret.py) and puts it into every tier. The queue is
bounded in bytes; what overflows is dropped and counted, so a slow disk or a dead Redis never makes a step wait.

Read path: `prefetch` hands a request's chain keys to a loader thread, which continues the chain tier by tier
(disk, then Redis): one batched existence check per tier, then one batched read of the leading run, each entry
decoded and checked against the request (its key, its parent's key, its tokens, the model) and its signature. The
first entry that fails ends the run in that tier: it is counted by reason and deleted, and the request computes
from there, as it would without the store.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from kvreuse.config import CacheConfig
from kvreuse.kvcache.tiers import entry
from kvreuse.kvcache.tiers.base import KVTier, TierUsage
from kvreuse.kvcache.tiers.tier_secret import load_tier_secret

logger = logging.getLogger(__name__)

# Parallel reads of one chain. Measured on 2 cores, a 2048-token chain (47 MB in bf16), interleaved: from a page-cached
# disk in 44 ms with 1 thread, 30 with 4; from Redis ~105 ms either way (one server thread sends it all).
READ_THREADS = 4


class BlockIO(Protocol):
    """The pool's K/V, as the store sees it (the engine's implementation wraps the KV tensor). Engine thread only."""

    spec: entry.BlockSpec

    def read(self, positions: Sequence[tuple[int, ...]]) -> list:
        """Host copies of each position's K/V (its pool block in every layer group), each a buffer of
        `spec.payload_bytes` bytes, safe to keep."""

    def write(self, positions: Sequence[tuple[int, ...]], payloads: Sequence) -> None:
        """Put the payloads (as `read` returns them) into each position's blocks."""


@dataclass(frozen=True)
class StoredBlock:
    """A published block to write: what its entry says besides the K/V."""

    key: bytes
    parent_key: bytes | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class LoadedBlock:
    key: bytes
    tier: str           # where it was read from
    payload: memoryview


@dataclass(frozen=True)
class TierLoad:
    """What the loader found for one request: chain blocks `start`, `start + 1`, ... read from the tiers."""

    start: int
    blocks: list[LoadedBlock]
    seconds: float      # from the loader taking the job to the last entry checked


@dataclass
class StoreCounters:
    hit_blocks: Counter = field(default_factory=Counter)       # tier -> blocks loaded and checked
    loaded_bytes: Counter = field(default_factory=Counter)     # tier -> payload bytes of those
    invalid_entries: Counter = field(default_factory=Counter)  # (tier, reason) -> entries refused and deleted
    queued_blocks: int = 0       # blocks handed to the writer
    dropped_blocks: int = 0      # blocks not written: the write queue was full
    num_loads: int = 0           # prefetches that found at least one block
    load_seconds: float = 0.0    # their loader time, summed


def build_tiers(cache: CacheConfig) -> list[KVTier]:
    """The tiers `[cache]` configures, nearest first: disk (`cache.disk.path`), then Redis (`cache.redis.url`)."""
    from kvreuse.kvcache.tiers.disk_tier import DiskTier

    tiers: list[KVTier] = []
    if cache.disk.path:
        tiers.append(DiskTier(cache.disk.path, int(cache.disk.max_gb * 2**30)))
    if cache.redis.url:
        from kvreuse.kvcache.tiers.redis_tier import RedisTier  # the redis extra

        tiers.append(RedisTier(cache.redis.url, ttl_s=cache.redis.ttl_s, timeout_s=cache.redis.timeout_ms / 1000))
    return tiers


class TieredStore:
    def __init__(self, tiers: Sequence[KVTier], spec: entry.BlockSpec, io: BlockIO, max_queue_bytes: int, *,
                 secret: bytes, store_tokens: bool = False):
        self.tiers = list(tiers)  # read in this order: the nearest first
        self.spec, self.io = spec, io
        self._secret, self._store_tokens = secret, store_tokens  # entries signed with it; token ids kept or hashed
        self.max_queue_bytes = max_queue_bytes
        self.counters = StoreCounters()
        self._lock = threading.Lock()  # guards counters and the queued byte count
        self._queued_bytes = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Condition(self._lock)
        self._writer = threading.Thread(target=self._write_loop, name="kvreuse-tier-writer", daemon=True)
        self._writer.start()
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvreuse-tier-loader")
        self._readers = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="kvreuse-tier-reader")
        self._closed = False

    @classmethod
    def from_config(cls, cache: CacheConfig, io: BlockIO) -> TieredStore | None:
        """The tiers `[cache]` configures over the pool `io` reads and writes; None without any, or with caching off.
        ConfigError if the tier secret cannot be had (tier_secret.py)."""
        if not (cache.enabled and (cache.disk.path or cache.redis.url)):
            return None
        secret = load_tier_secret(cache.tier_secret_file)
        return cls(build_tiers(cache), io.spec, io, cache.tier_queue_mb * 2**20, secret=secret,
                   store_tokens=cache.tier_store_tokens)

    @property
    def tier_names(self) -> list[str]:
        return [t.name for t in self.tiers]

    # --- write path ----------------------------------------------------------------------------------
    def can_store(self, num_blocks: int) -> bool:
        return self._queued_bytes + num_blocks * self.spec.payload_bytes <= self.max_queue_bytes

    def store(self, blocks: Sequence[StoredBlock], positions: Sequence[tuple[int, ...]],
              tiers: Sequence[str] | None = None) -> bool:
        """Queue published blocks (their K/V in the pool blocks of `positions`, one tuple per block: its block in every
        layer group) for the tiers named in `tiers` (default: all). Engine thread; copies the K/V now and returns at
        once. False (dropped, counted) if the queue is full."""
        targets = [t for t in self.tiers if tiers is None or t.name in tiers]
        if not blocks or not targets or self._closed:
            return False
        if not self.can_store(len(blocks)):
            with self._lock:
                self.counters.dropped_blocks += len(blocks)
            return False
        payloads = self.io.read(positions)
        with self._lock:
            self._queued_bytes += len(blocks) * self.spec.payload_bytes
            self.counters.queued_blocks += len(blocks)
        self._queue.put((list(blocks), payloads, targets))
        return True

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            blocks, payloads, targets = job
            try:
                entries = [(b.key, entry.encode(self.spec, b.key, b.parent_key, b.token_ids, p, secret=self._secret,
                                                store_tokens=self._store_tokens))
                           for b, p in zip(blocks, payloads, strict=True)]
                for tier in targets:
                    tier.put(entries[::-1])  # tail first: see _load_run; never raises for its medium's faults
            except Exception:
                logger.exception("writing %d blocks to the KV tiers failed; they are dropped", len(blocks))
            finally:
                with self._lock:
                    self._queued_bytes -= len(blocks) * self.spec.payload_bytes
                    self._idle.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written (or dropped); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._queued_bytes == 0, timeout)

    # --- read path -----------------------------------------------------------------------------------
    def prefetch(self, keys: Sequence[bytes], token_blocks: Sequence[Sequence[int]], start: int,
                 parent_key: bytes | None) -> Future:
        """Read chain blocks `start`, `start + 1`, ... (`keys` and `token_blocks` are theirs; `parent_key` is the
        key before `keys[0]`) on the loader thread. The future's TierLoad holds the leading run found and checked,
        possibly empty; it never fails."""
        return self._loader.submit(self._load, list(keys), [tuple(t) for t in token_blocks], start, parent_key)

    def _load(self, keys: list[bytes], token_blocks: list[tuple[int, ...]], start: int,
              parent_key: bytes | None) -> TierLoad:
        began = time.perf_counter()
        blocks: list[LoadedBlock] = []
        try:
            for tier in self.tiers:
                if len(blocks) == len(keys):
                    break
                blocks += self._load_run(tier, keys, token_blocks, len(blocks), parent_key)
        except Exception:  # a bug in a tier must not fail the request: it computes what was not loaded
            logger.exception("reading the KV tiers failed; the request computes its prefix")
        seconds = time.perf_counter() - began
        if blocks:
            with self._lock:
                self.counters.num_loads += 1
                self.counters.load_seconds += seconds
        return TierLoad(start, blocks, seconds)

    def _load_run(self, tier: KVTier, keys: list[bytes], token_blocks: list[tuple[int, ...]], first: int,
                  parent_key: bytes | None) -> list[LoadedBlock]:
        """The checked blocks `first`, `first + 1`, ... that `tier` holds, up to the first it lacks or refuses."""
        present = tier.contains(keys[first:])
        run = next((i for i, p in enumerate(present) if not p), len(present))
        if run == 0:
            return []
        # Read and check in READ_THREADS slices at once (a read waits on the disk or the network, the checksum on
        # memory: both release the GIL), tail slices first, as writes go: see `_read_slice`.
        bounds = [first + run * k // READ_THREADS for k in range(READ_THREADS + 1)]
        slices = [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if a < b][::-1]
        read = self._readers.map(lambda ab: self._read_slice(tier, keys, token_blocks, *ab, parent_key), slices)
        found: list[LoadedBlock] = []
        for blocks in reversed(list(read)):
            for i, block in enumerate(blocks, start=first + len(found)):
                if isinstance(block, entry.InvalidEntry):
                    self._refuse(tier, keys[i], block)
                if not isinstance(block, LoadedBlock):
                    break
                found.append(block)
            else:
                continue
            break  # the chain stops at the first block missing or refused
        with self._lock:
            self.counters.hit_blocks[tier.name] += len(found)
            self.counters.loaded_bytes[tier.name] += len(found) * self.spec.payload_bytes
        return found

    def _read_slice(self, tier: KVTier, keys: list[bytes], token_blocks: list[tuple[int, ...]], start: int, end: int,
                    parent_key: bytes | None) -> list[LoadedBlock | entry.InvalidEntry | None]:
        """Blocks `start` to `end` as read and checked; None for one gone since the existence check (evicted,
        expired, flushed). Read tail first, here and on write, so an LRU tier keeps a chain's head as its most recent
        part and loses its tail first: a prefix is only usable up to its first missing block (the pool frees in the
        same order)."""
        blocks: list[LoadedBlock | entry.InvalidEntry | None] = []
        for i, raw in enumerate(tier.get(keys[start:end][::-1])[::-1], start=start):
            if raw is None:
                blocks.append(None)
                continue
            try:
                payload = entry.decode(raw, self.spec, keys[i], keys[i - 1] if i else parent_key, token_blocks[i],
                                       secret=self._secret)
                blocks.append(LoadedBlock(keys[i], tier.name, payload))
            except entry.InvalidEntry as exc:
                blocks.append(exc)
        return blocks

    def _refuse(self, tier: KVTier, key: bytes, exc: entry.InvalidEntry) -> None:
        with self._lock:
            self.counters.invalid_entries[tier.name, exc.reason] += 1
            first = self.counters.invalid_entries[tier.name, exc.reason] == 1
        log = logger.warning if first else logger.debug
        log("refused a %s entry (%s), deleted it; the request computes from there: %s", tier.name, exc.reason, exc)
        tier.delete([key])

    # --- admin and reporting -------------------------------------------------------------------------
    def clear(self) -> dict[str, int]:
        """Remove every entry of every tier; how many per tier (where known)."""
        self.flush(timeout=30)
        return {t.name: t.clear() for t in self.tiers}

    def usage(self) -> list[TierUsage]:
        return [t.usage() for t in self.tiers]

    def snapshot(self) -> dict:
        """Counters as plain values: per tier (the store's and the tier's own), and the write queue's."""
        with self._lock:
            c = self.counters
            per_tier = {t.name: {"hit_blocks": c.hit_blocks[t.name], "loaded_bytes": c.loaded_bytes[t.name],
                                 "invalid_entries": {r: n for (name, r), n in c.invalid_entries.items()
                                                     if name == t.name},
                                 **t.counters.as_dict()} for t in self.tiers}
            return {"tiers": per_tier, "queued_blocks": c.queued_blocks, "dropped_blocks": c.dropped_blocks,
                    "queued_bytes": self._queued_bytes, "num_loads": c.num_loads,
                    "load_seconds": round(c.load_seconds, 6)}

    def check_integrity(self) -> None:
        assert 0 <= self._queued_bytes, f"queued bytes {self._queued_bytes}"
        for tier in self.tiers:
            tier.check_integrity()

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (up to `timeout`), then stop the threads and close the tiers."""
        if self._closed:
            return
        self._closed = True
        self.flush(timeout)
        self._queue.put(None)
        self._writer.join(timeout)
        self._loader.shutdown(wait=True, cancel_futures=True)
        self._readers.shutdown(wait=True)
        for tier in self.tiers:
            tier.close()
