"""The Redis tier against a real redis-server: round trips, sharing between instances, TTL, and every fault as a
miss (refused, killed and restarted, flushed, maxmemory, a server that never answers). Model-free and fast."""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
import time

import pytest
import redis

from kvreuse.bench.redis_process import RedisProcess, free_port
from kvreuse.kvcache.tiers.redis_tier import RedisTier, redact_url

from .redis_faults import FaultyRedis

LOGGER = "kvreuse.kvcache.tiers.redis_tier"


def key(i: int) -> bytes:
    return hashlib.sha256(f"block {i}".encode()).digest()


def value(i: int, size: int = 64) -> bytes:
    return (f"entry {i} ".encode() * size)[:size]


class Clock:
    """A monotonic clock the test moves by hand, so backoff needs no sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def raw(redis_url):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def timed(fn, *args):
    start = time.monotonic()
    result = fn(*args)
    return result, time.monotonic() - start


def warnings_and_infos(caplog) -> tuple[list[str], list[str]]:
    ours = [r for r in caplog.records if r.name == LOGGER]
    return ([r.getMessage() for r in ours if r.levelno == logging.WARNING],
            [r.getMessage() for r in ours if r.levelno == logging.INFO])


def test_round_trip(redis_url, raw):
    tier = RedisTier(redis_url)
    try:
        entries = [(key(i), value(i, 100 + i)) for i in range(3)]
        assert tier.put(entries) == 3
        assert raw.get("kvreuse:kv:" + key(1).hex()) == value(1, 101)
        assert tier.contains([key(0), key(9), key(2), key(1)]) == [True, False, True, True]
        assert tier.contains([]) == []
        assert tier.get([key(2), key(9), key(0)]) == [value(2, 102), None, value(0, 100)]
        tier.delete([key(1), key(9)])
        assert tier.contains([key(0), key(1), key(2)]) == [True, False, True]
        assert tier.get([key(1)]) == [None]
        usage = tier.usage()
        assert (usage.name, usage.num_entries, usage.num_bytes, usage.capacity_bytes, usage.available,
                usage.detail) == ("redis", 2, None, None, True, redis_url)
        assert tier.counters.as_dict() == {"entries_written": 3, "bytes_written": 100 + 101 + 102,
                                           "entries_dropped": 0, "entries_read": 2, "bytes_read": 102 + 100,
                                           "entries_deleted": 1, "evictions": 0, "errors": 0}
        tier.check_integrity()
    finally:
        tier.close()


def test_clear_removes_only_its_namespace(redis_url, raw):
    raw.set("unrelated", b"keep")
    raw.set("kvreuse:other:" + key(0).hex(), b"keep too")
    raw.set("t1:" + key(0).hex(), b"not under t[1]: (a glob would match it)")
    tier, odd = RedisTier(redis_url), RedisTier(redis_url, namespace="t[1]:")
    try:
        assert tier.put([(key(i), value(i)) for i in range(5)]) == 5
        assert odd.put([(key(0), value(0))]) == 1
        assert tier.usage().num_entries == 5
        assert odd.usage().num_entries == 1
        assert tier.clear() == 5
        assert odd.clear() == 1
        assert tier.usage().num_entries == 0
        assert tier.counters.entries_deleted == 5
        assert sorted(raw.keys()) == sorted([b"unrelated", b"kvreuse:other:" + key(0).hex().encode(),
                                             b"t1:" + key(0).hex().encode()])
        assert tier.clear() == 0
    finally:
        tier.close()
        odd.close()


def test_clear_walks_more_than_one_scan_batch(redis_url, raw):
    tier = RedisTier(redis_url)
    try:
        assert tier.put([(key(i), b"x") for i in range(2500)]) == 2500
        assert tier.usage().num_entries == 2500
        assert tier.clear() == 2500
        assert raw.dbsize() == 0
    finally:
        tier.close()


def test_two_instances_share_entries_and_namespaces_separate(redis_url):
    a, b = RedisTier(redis_url), RedisTier(redis_url)
    other = RedisTier(redis_url, namespace="tenant-b:kv:")
    try:
        assert a.put([(key(1), value(1)), (key(2), value(2))]) == 2
        assert b.contains([key(1), key(2), key(3)]) == [True, True, False]
        assert b.get([key(2)]) == [value(2)]
        assert other.contains([key(1), key(2)]) == [False, False]
        assert other.get([key(1)]) == [None]
        b.delete([key(1)])
        assert a.contains([key(1), key(2)]) == [False, True]
        assert (a.counters.entries_deleted, b.counters.entries_deleted) == (0, 1)
    finally:
        for tier in (a, b, other):
            tier.close()


def test_ttl_sets_an_expiry_and_the_entry_expires(redis_url, raw):
    expiring, lasting = RedisTier(redis_url, ttl_s=1), RedisTier(redis_url, namespace="lasting:")
    try:
        assert expiring.put([(key(1), value(1))]) == 1
        assert lasting.put([(key(1), value(1))]) == 1
        assert 0 < raw.pttl("kvreuse:kv:" + key(1).hex()) <= 1000
        assert raw.ttl("lasting:" + key(1).hex()) == -1
        time.sleep(1.2)
        assert expiring.contains([key(1)]) == [False]
        assert expiring.get([key(1)]) == [None]
        assert lasting.get([key(1)]) == [value(1)]
        assert expiring.counters.errors == 0
    finally:
        expiring.close()
        lasting.close()


def test_refused_connection_is_a_quick_miss_with_backoff(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = Clock()
    url = f"redis://kv:s3cret@127.0.0.1:{free_port()}/0"
    tier = RedisTier(url, clock=clock)
    tier.BACKOFF_MAX_S = 2.0
    try:
        assert tier.usage().detail == f"redis://kv@127.0.0.1:{url.rsplit(':', 1)[1]}"
        found, elapsed = timed(tier.contains, [key(1), key(2)])
        assert found == [False, False] and elapsed < 1.0
        assert tier.counters.errors == 1
        # In backoff: immediate misses, nothing counted, no network.
        for call, args, miss in ((tier.contains, ([key(1)],), [False]), (tier.get, ([key(1), key(2)],), [None, None]),
                                 (tier.put, ([(key(1), value(1))],), 0), (tier.delete, ([key(1)],), None),
                                 (tier.clear, (), 0)):
            result, elapsed = timed(call, *args)
            assert result == miss and elapsed < 0.05
        usage = tier.usage()
        assert (usage.available, usage.num_entries) == (False, None)
        assert tier.counters.errors == 1
        # Each retry is one counted attempt; the backoff doubles 0.5 -> 1 -> 2 and stays at its cap.
        for backoff, errors in ((0.5, 2), (1.0, 3), (2.0, 4), (2.0, 5)):
            clock.now += backoff - 0.01
            assert tier.put([(key(1), value(1))]) == 0
            assert tier.counters.errors == errors - 1
            clock.now += 0.01
            found, elapsed = timed(tier.get, [key(1)])
            assert found == [None] and elapsed < 1.0
            assert tier.counters.errors == errors
        warnings, infos = warnings_and_infos(caplog)
        assert len(warnings) == 1 and infos == []
        assert "is down" in warnings[0] and "ConnectionError" in warnings[0] and "s3cret" not in warnings[0]
        assert tier.counters.entries_written == tier.counters.entries_read == 0
        tier.check_integrity()
    finally:
        tier.close()


def test_redis_killed_then_restarted_recovers_by_itself(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = Clock()
    with FaultyRedis() as server:
        tier = RedisTier(server.url, clock=clock)
        try:
            assert tier.put([(key(1), value(1)), (key(2), value(2))]) == 2
            assert tier.get([key(1)]) == [value(1)]
            server.kill()
            found, elapsed = timed(tier.contains, [key(1), key(2)])
            assert found == [False, False] and elapsed < 1.0
            assert tier.get([key(1)]) == [None]
            assert tier.put([(key(3), value(3))]) == 0
            assert tier.counters.errors == 1
            assert tier.usage().available is False

            server.restart()
            assert tier.get([key(1)]) == [None]   # still in backoff: no attempt yet
            assert tier.counters.errors == 1
            clock.now += tier.BACKOFF_MIN_S
            assert tier.put([(key(3), value(3))]) == 1
            assert tier.get([key(3), key(1)]) == [value(3), None]   # the restarted Redis kept nothing
            assert tier.contains([key(3)]) == [True]
            assert tier.usage().available is True
            assert tier.counters.errors == 1
            warnings, infos = warnings_and_infos(caplog)
            assert len(warnings) == 1 and "is down" in warnings[0]
            assert len(infos) == 1 and "is back after 1 failed attempts" in infos[0]

            # A second incident starts again from the shortest backoff and logs again.
            server.kill()
            assert tier.get([key(3)]) == [None]
            server.restart()
            clock.now += tier.BACKOFF_MIN_S
            assert tier.get([key(3)]) == [None]    # answered: the entry is gone with the old process
            assert tier.put([(key(4), value(4))]) == 1
            assert tier.counters.errors == 2
            warnings, infos = warnings_and_infos(caplog)
            assert (len(warnings), len(infos)) == (2, 2)
        finally:
            tier.close()


def test_an_entry_flushed_between_contains_and_get_is_none(redis_url, raw):
    tier = RedisTier(redis_url)
    try:
        assert tier.put([(key(1), value(1)), (key(2), value(2))]) == 2
        assert tier.contains([key(1), key(2)]) == [True, True]
        raw.delete("kvreuse:kv:" + key(2).hex())
        assert tier.get([key(1), key(2)]) == [value(1), None]
        raw.flushdb()
        assert tier.get([key(1), key(2)]) == [None, None]
        assert tier.counters.errors == 0
        assert (tier.counters.entries_read, tier.counters.bytes_read) == (1, len(value(1)))
    finally:
        tier.close()


def test_maxmemory_lru_evicts_early_entries_silently():
    entries = [(key(i), bytes([i]) * 100_000) for i in range(50)]
    with RedisProcess(maxmemory="2mb", policy="allkeys-lru") as server:
        tier = RedisTier(server.url)
        try:
            assert sum(tier.put([entry]) for entry in entries) == 50
            values = tier.get([k for k, _ in entries])
            present = [i for i, v in enumerate(values) if v is not None]
            assert values[0] is None
            assert values[-1] == entries[-1][1]
            assert 1 <= len(present) < 50
            assert all(values[i] == entries[i][1] for i in present)
            assert tier.counters.errors == 0 and tier.counters.evictions == 0
            assert tier.usage().num_entries == len(present)
        finally:
            tier.close()


def test_maxmemory_noeviction_drops_writes_without_raising(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    entries = [(key(i), bytes([i]) * 100_000) for i in range(50)]
    with RedisProcess(maxmemory="2mb", policy="noeviction") as server:
        tier = RedisTier(server.url)
        try:
            written = tier.put(entries)
            assert 1 <= written < 50
            assert tier.counters.errors == 1
            assert tier.counters.entries_written == written
            assert tier.counters.bytes_written == written * 100_000
            assert tier.put([(key(99), b"x" * 100_000)]) == 0
            assert tier.counters.errors == 2
            # Redis answers: no backoff, and what was written reads back.
            assert tier.usage().available is True
            assert tier.contains([entries[0][0], key(99)]) == [True, False]
            assert tier.get([entries[0][0]]) == [entries[0][1]]
            warnings, _ = warnings_and_infos(caplog)
            assert len(warnings) == 1 and "refuses writes (OutOfMemoryError" in warnings[0]
        finally:
            tier.close()


def test_a_server_that_never_answers_times_out_as_a_miss():
    # A listening socket that never accepts: the kernel completes the connection, nobody ever replies.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        clock = Clock()
        tier = RedisTier(f"redis://127.0.0.1:{listener.getsockname()[1]}/0", timeout_s=0.2, clock=clock)
        try:
            found, elapsed = timed(tier.contains, [key(1)])
            assert found == [False] and 0.15 < elapsed < 1.0
            clock.now += tier.BACKOFF_MIN_S
            got, elapsed = timed(tier.get, [key(1)])
            assert got == [None] and elapsed < 1.0
            clock.now += 2 * tier.BACKOFF_MIN_S
            written, elapsed = timed(tier.put, [(key(1), value(1))])
            assert written == 0 and elapsed < 1.0
            assert tier.counters.errors == 3
            assert tier.usage().available is False
        finally:
            tier.close()


def test_concurrent_writer_and_loader(redis_url):
    tier = RedisTier(redis_url)
    failures: list[BaseException] = []

    def writer() -> None:
        try:
            for i in range(200):
                assert tier.put([(key(i), value(i))]) == 1
        except BaseException as exc:
            failures.append(exc)

    def loader() -> None:
        try:
            for i in range(200):
                got = tier.get([key(i)])[0]
                assert got in (None, value(i))
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=fn) for fn in (writer, loader)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert failures == []
        assert tier.contains([key(i) for i in range(200)]) == [True] * 200
        assert tier.counters.entries_written == 200 and tier.counters.errors == 0
    finally:
        tier.close()


def test_redact_url():
    assert redact_url("redis://:pw@h:6379/0") == "redis://h:6379/0"
    assert redact_url("rediss://user:pw@h:6380/1?password=pw&ssl_cert_reqs=none") == \
        "rediss://user@h:6380/1?ssl_cert_reqs=none"
    assert redact_url("unix:///run/redis.sock?db=2&password=pw") == "unix:///run/redis.sock?db=2"
