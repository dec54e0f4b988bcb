"""DiskTier (kvreuse/kvcache/tiers/disk_tier.py) on real files: the round trip, the index rebuilt at start with its
LRU order, eviction under max_bytes, crash leftovers, write and read faults, and concurrent use."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvreuse.kvcache.tiers import disk_tier
from kvreuse.kvcache.tiers.base import TierCounters, TierUsage
from kvreuse.kvcache.tiers.disk_tier import DiskTier
from kvreuse.kvcache.tiers.entry import BlockSpec, decode, encode

SPEC = BlockSpec(fingerprint="test-model", dtype="bfloat16", block_size=2, shape=(1, 2, 2, 1, 4), itemsize=2)
SECRET = b"a tier key of the disk tier tests, 32+ bytes"


def key(i: int) -> bytes:
    return hashlib.sha256(f"block {i}".encode()).digest()


def entry(i: int) -> bytes:
    """A realistic entry for block i (all the same length: the header holds the tokens' hash)."""
    return encode(SPEC, key(i), key(i - 1), [10 + i % 90, 11 + i % 89], bytes([i % 256]) * 32, secret=SECRET)


def blob(i: int, size: int = 100) -> bytes:
    return bytes([i % 256]) * size


def entry_file(root: Path, k: bytes) -> Path:
    return root / k.hex()[:2] / f"{k.hex()}.kvb"


def all_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


# --------------------------------------------------------------------------------------------------------


def test_put_contains_get_delete_clear(tmp_path):
    tier = DiskTier(tmp_path / "kv", max_bytes=10_000)
    size = len(entry(0))
    assert tier.put([(key(i), entry(i)) for i in range(3)]) == 3
    assert entry_file(tmp_path / "kv", key(1)).read_bytes() == entry(1)
    assert tier.contains([key(2), key(99), key(0), key(1)]) == [True, False, True, True]
    assert tier.contains([]) == []
    got = tier.get([key(1), key(99), key(0)])
    assert got == [entry(1), None, entry(0)]
    assert bytes(decode(got[0], SPEC, key(1), key(0), [11, 12], secret=SECRET)) == bytes([1]) * 32
    assert tier.usage() == TierUsage("disk", 3, 3 * size, 10_000, available=True, detail=str(tmp_path / "kv"))

    assert tier.put([(key(0), entry(0)), (key(3), entry(3))]) == 1  # key 0 is there already: not written again
    assert tier.counters == TierCounters(entries_written=4, bytes_written=4 * size, entries_read=2,
                                         bytes_read=2 * size)
    tier.check_integrity()

    tier.delete([key(1), key(99)])
    assert tier.contains([key(0), key(1), key(2), key(3)]) == [True, False, True, True]
    assert tier.get([key(1)]) == [None]
    assert not entry_file(tmp_path / "kv", key(1)).exists()
    assert tier.counters.entries_deleted == 1
    tier.check_integrity()

    assert tier.clear() == 3
    assert tier.contains([key(0), key(2), key(3)]) == [False, False, False]
    assert tier.usage().num_entries == 0 and tier.num_bytes == 0
    assert all_files(tmp_path / "kv") == []
    assert tier.counters.entries_deleted == 4
    assert tier.counters.errors == 0 and tier.counters.evictions == 0
    tier.check_integrity()
    tier.close()


def test_a_restart_finds_the_entries_in_their_lru_order(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=400)
    assert tier.put([(key(i), blob(i)) for i in range(4)]) == 4
    assert tier.get([key(1)]) == [blob(1)]  # now the most recently used
    tier.close()
    # Files that are not entries: ignored, and left alone.
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "zz").mkdir()
    (tmp_path / "zz" / f"{key(7).hex()}.kvb").write_bytes(blob(7))          # not a fan-out dir
    wrong_dir = tmp_path / ("00" if key(8).hex()[:2] != "00" else "01")
    wrong_dir.mkdir(exist_ok=True)
    (wrong_dir / f"{key(8).hex()}.kvb").write_bytes(blob(8))                # in the wrong fan-out dir
    (tmp_path / key(0).hex()[:2] / f"{key(0).hex()}.kvb.bak").write_bytes(blob(0))
    (tmp_path / key(0).hex()[:2] / "XYZ.kvb").write_bytes(blob(0))
    strays = {"notes.txt", f"zz/{key(7).hex()}.kvb", f"{wrong_dir.name}/{key(8).hex()}.kvb",
              f"{key(0).hex()[:2]}/{key(0).hex()}.kvb.bak", f"{key(0).hex()[:2]}/XYZ.kvb"}

    again = DiskTier(tmp_path, max_bytes=400)
    assert again.usage() == TierUsage("disk", 4, 400, 400, available=True, detail=str(tmp_path))
    assert again.contains([key(i) for i in range(4)] + [key(7), key(8)]) == [True] * 4 + [False, False]
    assert again.get([key(3)]) == [blob(3)]  # order now 0 2 1 3
    again.check_integrity()
    assert again.counters == TierCounters(entries_read=1, bytes_read=100)
    # Each put evicts the least recently used: 0, then 2, then 1 (refreshed before the restart).
    for new, gone in ((4, 0), (5, 2), (6, 1)):
        assert again.put([(key(new), blob(new))]) == 1
        assert again.contains([key(gone), key(new)]) == [False, True]
    assert again.contains([key(3)]) == [True]
    assert again.counters.evictions == 3
    again.check_integrity()
    assert strays <= set(all_files(tmp_path))


def test_the_order_survives_a_restart_for_writes_within_one_clock_tick(tmp_path, monkeypatch):
    # Many kernels keep a coarse mtime (one tick is milliseconds), so the tier stamps its own, strictly increasing
    # even where the clock stands still (as here, where it always reads `now`).
    now = 1_700_000_000 * 10**9
    monkeypatch.setattr(disk_tier, "time", SimpleNamespace(time_ns=lambda: now))
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # just faster
    tier = DiskTier(tmp_path, max_bytes=3000)
    for i in range(30):
        tier.put([(key(i), blob(i))])
    tier.get([key(0)])
    assert [entry_file(tmp_path, key(i)).stat().st_mtime_ns for i in range(30)] == [now + 30, *range(now + 1, now + 30)]
    again = DiskTier(tmp_path, max_bytes=3000)
    for n, gone in enumerate([*range(1, 30), 0]):
        again.put([(key(100 + n), blob(n))])
        assert again.contains([key(gone)]) == [False] and again.usage().num_entries == 30, n
    again.check_integrity()


def test_a_restart_with_a_smaller_limit_evicts_the_oldest(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=500)
    tier.put([(key(i), blob(i)) for i in range(5)])
    tier.get([key(0)])
    smaller = DiskTier(tmp_path, max_bytes=250)
    assert smaller.contains([key(i) for i in range(5)]) == [True, False, False, False, True]
    assert smaller.num_bytes == 200 and smaller.counters.evictions == 3
    smaller.check_integrity()


def test_lru_eviction_keeps_the_tier_under_max_bytes(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=300)
    assert tier.put([(key(i), blob(i)) for i in range(3)]) == 3
    assert tier.get([key(0)]) == [blob(0)]  # refreshed: key 1 is now the oldest
    assert tier.put([(key(3), blob(3))]) == 1
    assert tier.contains([key(0), key(1), key(2), key(3)]) == [True, False, True, True]
    assert not entry_file(tmp_path, key(1)).exists()
    assert tier.num_bytes == 300 and tier.counters.evictions == 1
    tier.check_integrity()

    # 150 bytes (the order is 2 0 3): the two least recently used go.
    assert tier.put([(key(4), blob(4, 150))]) == 1
    assert tier.contains([key(2), key(0), key(3), key(4)]) == [False, False, True, True]
    assert tier.num_bytes == 250 and tier.counters.evictions == 3
    tier.check_integrity()

    # Bigger than the whole tier: dropped (counted as an eviction), nothing else evicted.
    assert tier.put([(key(5), blob(5, 301))]) == 0
    assert tier.contains([key(3), key(4), key(5)]) == [True, True, False]
    assert tier.num_bytes == 250 and tier.counters.evictions == 4
    assert tier.counters.entries_written == 5

    # Exactly max_bytes: everything else goes.
    assert tier.put([(key(6), blob(6, 300))]) == 1
    assert tier.contains([key(3), key(4), key(6)]) == [False, False, True]
    assert tier.usage().num_entries == 1 and tier.num_bytes == 300 and tier.counters.evictions == 6
    tier.check_integrity()


def test_leftovers_of_a_crashed_write_are_not_entries_and_are_removed(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=10_000)
    tier.put([(key(0), entry(0))])
    tier.close()
    # A writer that died after writing its whole temp file but before the rename, and one that died mid-write.
    hex1, hex2 = key(1).hex(), key(2).hex()
    (tmp_path / hex1[:2]).mkdir(exist_ok=True)
    (tmp_path / hex2[:2]).mkdir(exist_ok=True)
    whole = tmp_path / hex1[:2] / f".{hex1}.{os.getpid()}.{threading.get_ident()}.tmp"
    cut = tmp_path / hex2[:2] / f".{hex2}.4242.17.tmp"
    whole.write_bytes(entry(1))
    cut.write_bytes(entry(2)[:20])

    again = DiskTier(tmp_path, max_bytes=10_000)
    assert again.contains([key(0), key(1), key(2)]) == [True, False, False]
    assert again.get([key(1), key(2)]) == [None, None]
    assert not whole.exists() and not cut.exists()
    assert again.num_bytes == len(entry(0))
    assert all_files(tmp_path) == [f"{key(0).hex()[:2]}/{key(0).hex()}.kvb"]
    again.check_integrity()
    assert again.put([(key(1), entry(1))]) == 1 and again.get([key(1)]) == [entry(1)]
    again.check_integrity()


@pytest.mark.parametrize("failing", ["replace", "fsync"])
def test_a_full_disk_drops_the_write_logs_once_and_recovers(tmp_path, monkeypatch, caplog, failing):
    caplog.set_level(logging.INFO, logger=disk_tier.__name__)
    tier = DiskTier(tmp_path, max_bytes=10_000)
    assert tier.put([(key(0), entry(0))]) == 1
    before = (tier.usage(), all_files(tmp_path))
    caplog.clear()

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, failing, no_space)
    assert tier.put([(key(1), entry(1))]) == 0
    assert tier.put([(key(2), entry(2)), (key(3), entry(3))]) == 0
    assert tier.counters.errors == 3
    assert tier.contains([key(0), key(1), key(2), key(3)]) == [True, False, False, False]
    assert (tier.usage(), all_files(tmp_path)) == before  # no temp file left, nothing indexed
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "No space left" in warnings[0].getMessage()
    assert tier.get([key(0)]) == [entry(0)]  # reads still work
    tier.check_integrity()

    monkeypatch.undo()
    caplog.clear()
    assert tier.put([(key(1), entry(1))]) == 1
    assert [r.levelno for r in caplog.records] == [logging.INFO] and "again" in caplog.records[0].getMessage()
    assert tier.get([key(1)]) == [entry(1)]
    assert tier.counters.entries_written == 2 and tier.counters.errors == 3
    tier.check_integrity()

    # A new incident is logged again.
    caplog.clear()
    monkeypatch.setattr(os, failing, no_space)
    assert tier.put([(key(5), entry(5))]) == 0
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


def test_a_vanished_file_is_a_miss_and_a_read_error_is_counted(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, max_bytes=10_000)
    tier.put([(key(i), blob(i)) for i in range(3)])
    entry_file(tmp_path, key(0)).unlink()  # someone else removed it
    assert tier.get([key(0), key(1)]) == [None, blob(1)]
    assert tier.contains([key(0)]) == [False] and tier.num_bytes == 200
    assert tier.counters.errors == 0
    tier.check_integrity()

    real_read = Path.read_bytes

    def failing_read(self):
        if self.name.startswith(key(2).hex()):
            raise OSError(errno.EIO, "Input/output error")
        return real_read(self)

    monkeypatch.setattr(Path, "read_bytes", failing_read)
    assert tier.get([key(2), key(1)]) == [None, blob(1)]
    assert tier.contains([key(2)]) == [False] and tier.num_bytes == 100
    assert tier.counters.errors == 1 and tier.counters.entries_read == 2
    tier.check_integrity()


def test_concurrent_puts_and_gets_keep_the_index_consistent(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=40 * len(entry(0)))  # room for 40 of the 400 entries: evictions race
    failures: list[str] = []

    def work(first: int) -> None:
        try:
            for i in range(first, first + 200):
                assert tier.put([(key(i), entry(i))]) == 1
                for j in (i, i - 5, i - 100):
                    got = tier.get([key(j)])[0]
                    assert got is None or got == entry(j), f"wrong entry for {j}"
                tier.contains([key(i), key(i - 1)])
        except Exception as exc:  # reported below: an assert in a thread would be lost
            failures.append(repr(exc))

    threads = [threading.Thread(target=work, args=(first,)) for first in (0, 1000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert tier.counters.entries_written == 400 and tier.counters.errors == 0
    assert tier.counters.evictions == 360 and tier.usage().num_entries == 40
    tier.check_integrity()
    assert DiskTier(tmp_path, max_bytes=tier.max_bytes).usage() == tier.usage()
