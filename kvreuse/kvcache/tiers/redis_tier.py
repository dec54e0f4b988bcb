"""A KV tier in Redis: each entry is one plain value under `namespace + key.hex()`, so every process pointed at the
same Redis (and namespace) shares the same entries.

Each batched call is one round trip: a pipeline of EXISTS, an MGET, a pipeline of SET (with an expiry if `ttl_s`),
one DEL. Redis manages its own memory (maxmemory and its policy): an entry may vanish at any time, and a vanished
entry is simply a miss; the tier never counts evictions because it never sees them.

Redis down is not an outage. A call that fails on the connection (refused, timed out, reset, still loading, ...)
counts one error, answers as a miss, and puts the tier in backoff: until its retry time every call is an immediate
miss that neither touches the network nor counts. The backoff doubles from BACKOFF_MIN_S to BACKOFF_MAX_S per
consecutive failed attempt and resets on the first success; one warning is logged when the tier goes down and one
info line when it is back. redis-py reconnects on the next command after the backoff, so recovery needs no help.
A write that Redis refuses per command (OOM under `maxmemory-policy noeviction`) is dropped and counted, but is no
backoff: the server answers, and reads still work.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlencode, urlsplit

from kvreuse.extras import require
from kvreuse.kvcache.tiers.base import TierCounters, TierUsage

if TYPE_CHECKING:
    import redis

logger = logging.getLogger(__name__)

SCAN_BATCH = 1000


def redact_url(url: str) -> str:
    """`url` without its password (in the userinfo or as a `password=` query parameter)."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}@{host}" if user else host
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "password"])
    # Built by hand: urlunsplit turns unix:///path (no host) into unix:/path.
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")


def _glob_escape(text: str) -> str:
    for special in "\\*?[]":
        text = text.replace(special, "\\" + special)
    return text


class RedisTier:
    name = "redis"
    BACKOFF_MIN_S = 0.5
    BACKOFF_MAX_S = 10.0

    def __init__(self, url: str, *, namespace: str = "kvreuse:kv:", ttl_s: int = 0, timeout_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic):
        self.url = url
        self.detail = redact_url(url)
        self.namespace = namespace
        self.ttl_s = ttl_s
        self.counters = TierCounters()
        self._match = _glob_escape(namespace) + "*"
        self._clock = clock
        redis = require("redis", "redis", "cache.redis.url")
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._errors = (redis.exceptions.RedisError, OSError)  # a call that fails on the connection
        # No retries inside redis-py, said explicitly (redis.Redis() itself defaults to retrying with sleeps): the
        # backoff below is the retry policy, and the pool already reconnects a stale connection it hands out.
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                            health_check_interval=30, retry=Retry(NoBackoff(), 0))
        self._lock = threading.Lock()
        self._down = False
        self._probing = False     # one caller retries a down Redis; the others keep missing meanwhile
        self._failures = 0        # consecutive failed attempts
        self._retry_at = 0.0
        self._refusing_writes = False

    def _key(self, key: bytes) -> str:
        return self.namespace + key.hex()

    # --- the fault policy ----------------------------------------------------------------------------
    def _call(self, fn: Callable[[redis.Redis], object], default):
        with self._lock:
            if self._down:
                if self._probing or self._clock() < self._retry_at:
                    return default
                self._probing = True
        try:
            result = fn(self._client)
        except self._errors as exc:
            self._failed(exc)
            return default
        self._succeeded()
        return result

    def _failed(self, exc: BaseException) -> None:
        with self._lock:
            self.counters.errors += 1
            self._failures += 1
            backoff = min(self.BACKOFF_MIN_S * 2 ** (self._failures - 1), self.BACKOFF_MAX_S)
            self._retry_at = self._clock() + backoff
            self._probing = False
            went_down, self._down = not self._down, True
        if went_down:
            logger.warning("redis tier %s is down (%s: %s): its entries are misses, retrying in %.1fs",
                           self.detail, type(exc).__name__, exc, backoff)

    def _succeeded(self) -> None:
        with self._lock:
            came_back, failures = self._down, self._failures
            self._down = self._probing = False
            self._failures = 0
        if came_back:
            logger.info("redis tier %s is back after %d failed attempts", self.detail, failures)

    # --- KVTier --------------------------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []

        def run(client: redis.Redis) -> list[bool]:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._key(key))
            return [bool(n) for n in pipe.execute()]

        return self._call(run, [False] * len(keys))

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        values = self._call(lambda client: client.mget([self._key(k) for k in keys]), [None] * len(keys))
        found = [v for v in values if v is not None]
        with self._lock:
            self.counters.entries_read += len(found)
            self.counters.bytes_read += sum(len(v) for v in found)
        return values

    def put(self, entries: Sequence[tuple[bytes, bytes]]) -> int:
        if not entries:
            return 0

        def run(client: redis.Redis) -> list:
            pipe = client.pipeline(transaction=False)
            for key, value in entries:
                pipe.set(self._key(key), value, ex=self.ttl_s if self.ttl_s > 0 else None)
            # Per-command errors (OOM) come back in the results; a connection error still raises.
            return pipe.execute(raise_on_error=False)

        results = self._call(run, None)
        if results is None:  # down, or in backoff
            with self._lock:
                self.counters.entries_dropped += len(entries)
            return 0
        refused = [r for r in results if isinstance(r, Exception)]
        written = [len(value) for (_, value), r in zip(entries, results, strict=True) if r is True]
        with self._lock:
            self.counters.entries_written += len(written)
            self.counters.bytes_written += sum(written)
            self.counters.entries_dropped += len(entries) - len(written)
            self.counters.errors += bool(refused)
            started, self._refusing_writes = refused and not self._refusing_writes, bool(refused)
        if started:
            logger.warning("redis tier %s refuses writes (%s: %s), %d of %d entries dropped", self.detail,
                           type(refused[0]).__name__, refused[0], len(refused), len(entries))
        return len(written)

    def delete(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        removed = self._call(lambda client: client.delete(*[self._key(k) for k in keys]), 0)
        with self._lock:
            self.counters.entries_deleted += removed

    def clear(self) -> int:
        def run(client: redis.Redis) -> int:
            removed, batch = 0, []
            for name in client.scan_iter(match=self._match, count=SCAN_BATCH):
                batch.append(name)
                if len(batch) >= SCAN_BATCH:
                    removed += client.unlink(*batch)
                    batch.clear()
            if batch:
                removed += client.unlink(*batch)
            return removed

        removed = self._call(run, 0)
        with self._lock:
            self.counters.entries_deleted += removed
        return removed

    def usage(self) -> TierUsage:
        # Counting walks the whole keyspace with SCAN (fine for tests and the CLI, not for a hot path).
        count = self._call(lambda client: sum(1 for _ in client.scan_iter(match=self._match, count=SCAN_BATCH)),
                           None)
        with self._lock:
            available = not self._down
        return TierUsage(self.name, count, None, None, available, detail=self.detail)

    def check_integrity(self) -> None:
        """Redis keeps no bookkeeping of ours; only the counters can be checked."""
        for field, value in self.counters.as_dict().items():
            assert value >= 0, f"redis tier counter {field} is {value}"

    def close(self) -> None:
        self._client.close()
