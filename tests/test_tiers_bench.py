"""`kvreuse bench tiers` (kvreuse/bench/tiers_bench.py) in its smallest form, on the tiny model: the report's shape,
every hit served from the tier it names, and the first tokens equal. Timings are not asserted (the machine is
noisy)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvreuse.bench import tiers_bench

PROMPT_TOKENS = 200
BS = 16
FULL_BLOCKS = (PROMPT_TOKENS - 1) // BS * BS  # 192: the full blocks before the last token


def tiny_run(tiny_model_dir: str, redis_url: str | None, lines: list[str]) -> dict:
    return tiers_bench.run(repeats=1, redis_url=redis_url, prompt_tokens=PROMPT_TOKENS, progress=lines.append,
                           model_path=tiny_model_dir, kv_cache_memory_mb=16)


def check_common(report: dict, ways: list[str], lines: list[str]) -> None:
    assert report["suite"] == "tiers" and report["repeats"] == 1 and report["prompt_tokens"] == PROMPT_TOKENS
    assert report["block_size"] == BS and report["full_block_tokens"] == FULL_BLOCKS
    assert list(report["ways"]) == ways
    assert report["dtype"].startswith("fp32 (auto: ")  # conftest makes `auto` fp32
    assert set(report["cpu"]) == {"cpu", "machine", "flags"} and "cores" in report["machine"]
    for way, row in report["ways"].items():
        assert len(row["samples_ms"]) == 1 and row["median_ttft_ms"] > 0
        assert row["cached_tokens"] == [0 if way == "cold" else FULL_BLOCKS]
        loads = way in ("disk_cached", "disk", "redis")
        assert (row["median_load_ms"] is not None and row["median_load_ms"] > 0) == loads
        assert (row["median_load_mb_s"] is not None and row["median_load_mb_s"] > 0) == loads
    assert report["ways"]["cold"]["x_cold"] == 1.0
    for tier, target in report["targets"].items():  # timings are not asserted; the verdict on them is
        if tier in report["ways"]:
            assert target["x_cold"] == report["ways"][tier]["x_cold"], tier
            assert target["max_x_cold"] == tiers_bench.TARGETS[tier], target
            assert target["met"] == (target["x_cold"] <= target["max_x_cold"]), target
        else:
            assert target["met"] is None and target["x_cold"] is None, target
    assert report["first_tokens_match"] and len(report["first_tokens"]) == 2  # warm-up round and one measured
    # Both always hold a string ("unknown" without /proc/mounts): on Linux, the real filesystem type, and the disk
    # tier's files dropped from the page cache before each disk read (drop_disk_page_cache, the default).
    if Path("/proc/mounts").exists():
        assert report["disk"]["filesystem"] != "unknown", report["disk"]
    if hasattr(os, "posix_fadvise"):
        assert report["disk"]["page_cache"].startswith("dropped before each disk read"), report["disk"]
    assert len(lines) == 2 and "(warm-up)" in lines[0]
    json.dumps(report)  # `--out` writes it as JSON
    table = tiers_bench.markdown(report)
    assert table.startswith("| way | TTFT ms | x cold | load ms | load MB/s |")
    assert all(f"| {way} |" in table for way in ways)
    assert report["cpu"]["cpu"] in table and report["dtype"] in table and "disk hit (device) <= 1/8 of cold" in table


def test_the_tiers_bench_serves_each_way_from_its_tier(tiny_model_dir, redis_url):
    lines: list[str] = []
    report = tiny_run(tiny_model_dir, redis_url, lines)
    check_common(report, ["cold", "memory", "disk_cached", "disk", "redis"], lines)
    assert report["redis"].startswith("given: redis://127.0.0.1:")
    assert all(report["targets"][t]["met"] in (True, False) for t in ("disk", "redis"))  # timings: not asserted
    counters = report["tier_counters"]["tiers"]
    # Two rounds: each read the full blocks twice from disk, once from Redis (the redis way never read the disk).
    assert counters["disk"]["hit_blocks"] == 2 * counters["redis"]["hit_blocks"] == 4 * FULL_BLOCKS // BS
    assert "Redis hit <= 1/4 of cold" in tiers_bench.markdown(report)


def test_without_redis_server_the_redis_way_is_skipped(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(tiers_bench, "redis_server_available", lambda: False)
    lines: list[str] = []
    report = tiny_run(tiny_model_dir, None, lines)
    check_common(report, ["cold", "memory", "disk_cached", "disk"], lines)
    assert report["redis"].startswith("skipped: redis-server is not on PATH")
    assert report["targets"]["redis"]["met"] is None and report["targets"]["disk"]["met"] in (True, False)
    assert "Redis hit <= 1/4 of cold: not measured" in tiers_bench.markdown(report)


def test_reading_only_swaps_the_tiers_and_restores_them():
    class Tier:
        def __init__(self, name):
            self.name = name

    class Store:
        def __init__(self):
            self.tiers = [Tier("disk"), Tier("redis")]

        @property
        def tier_names(self):
            return [t.name for t in self.tiers]

    store = Store()
    original = store.tiers
    with pytest.raises(RuntimeError), tiers_bench.reading_only(store, "redis"):
        assert store.tier_names == ["redis"]
        raise RuntimeError("restored even on errors")
    assert store.tiers is original
    with pytest.raises(tiers_bench.BenchError):
        with tiers_bench.reading_only(store, "nfs"):
            pass
