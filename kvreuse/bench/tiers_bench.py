"""`kvreuse bench tiers`: TTFT of one prompt computed cold, then served from each place the KV cache keeps it: the
pool in memory, the disk tier (its files in the OS page cache, as after a restart on a machine with RAM to spare,
and read from the device, the page cache dropped), the Redis tier. One engine with both tiers; the ways are
interleaved round by round (cold, memory, disk_cached, disk, redis, then the next round on a fresh prompt variant),
round 0 warms up and is discarded, and the medians and their ratios to cold are reported with the CPU, its bf16
flags and the dtype.

Each measured request is checked to have been served from where it is claimed (the usage's per-tier cached
tokens), and its greedy first token to equal the cold one (exact reuse reproduces it)."""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kvreuse.bench.engine_bench import machine, synthetic_prompt
from kvreuse.config import load_config
from kvreuse.engine.output import RequestOutput
from kvreuse.kvcache.tiers.redis_tier import redact_url
from kvreuse.kvcache.tiers.store import TieredStore
from kvreuse.llm import LLM
from kvreuse.sampling_params import SamplingParams
from kvreuse.tuning.dtype_probe import cpu_identity

WAYS = ("cold", "memory", "disk_cached", "disk", "redis")
TIER_OF = {"memory": "memory", "disk_cached": "disk", "disk": "disk", "redis": "redis"}
# A hit from each tier must cost at most this fraction of the cold TTFT.
TARGETS = {"disk_cached": 1 / 8, "disk": 1 / 8, "redis": 1 / 4}
TARGET_TEXT = {"disk_cached": "disk hit (page cache) <= 1/8 of cold",
               "disk": "disk hit (device) <= 1/8 of cold", "redis": "Redis hit <= 1/4 of cold"}
GREEDY = SamplingParams(max_tokens=1)  # temperature 0
FLUSH_TIMEOUT_S = 120.0
# A pause before every measured request (all ways alike). Tiers are read a while after they are written (by another
# process, after a restart); read right after a 47 MB write, Redis answered 2-3x slower on a 2-core machine
# (measured: ~150 vs ~45 ms for the same MGET), which would time the write's aftermath, not the read.
SETTLE_S = 0.5
MB = 1e6  # load bandwidth in MB/s, decimal


class BenchError(AssertionError):
    """A measured request was not served the way the bench claims (or its first token differed): the figures would
    be wrong, so the run stops. Raised explicitly: unlike `assert`, `python -O` does not remove it."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise BenchError(message)


def redis_server_available() -> bool:
    return shutil.which("redis-server") is not None


@contextmanager
def reading_only(store: TieredStore, name: str) -> Iterator[None]:
    """While inside, the store reads (and writes) only the tier `name`; the original tier list after. The loader
    thread reads `store.tiers` per prefetch, so the swap must happen with none in flight (the bench runs one
    request at a time and flushes first). A block loaded from the only tier has no nearer tier to be copied to."""
    saved = store.tiers
    only = [t for t in saved if t.name == name]
    expect(len(only) == 1, f"the store has no single {name!r} tier: {store.tier_names}")
    store.tiers = only
    try:
        yield
    finally:
        store.tiers = saved


def drop_page_cache(root: Path) -> int:
    """Ask the kernel to drop the disk tier's entry files from the page cache, so that the disk way reads the device
    rather than RAM (the tier fsyncs every entry it writes, so the pages are clean and can go). Advisory, best
    effort; how many files were asked for (0 where `posix_fadvise` is missing, e.g. not Linux)."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    count = 0
    for file in root.rglob("*.kvb"):
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            count += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return count


def filesystem(path: Path) -> str:
    """The type of the filesystem holding `path` (ext4, tmpfs, ...), from /proc/mounts; "unknown" elsewhere."""
    target, best, kind = str(path.resolve()), "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) < 3:
                continue
            mount = fields[1]
            inside = target == mount or target.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best):
                best, kind = mount, fields[2]
    except OSError:
        pass
    return kind


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def run(repeats: int = 3, redis_url: str | None = None, dtype: str = "auto", prompt_tokens: int = 2048,
        progress: Callable[[str], None] = print, model_path: str | None = None, kv_cache_memory_mb: int = 1024,
        disk_dir: str | None = None, drop_disk_page_cache: bool = True, kv_dtype: str = "auto") -> dict:
    """Run the suite; `model_path` (`model.path`, default the embedded model), `kv_cache_memory_mb` and `disk_dir`
    (the parent of the disk tier's temporary directory, default the system's temp dir) are for tests and for
    measuring a particular device. Without `redis_url`, a redis-server is started for the run, and without one on
    PATH the redis way is skipped (the report says so)."""
    expect(repeats >= 1, "repeats must be >= 1")
    with ExitStack() as stack:
        redis_note, url = None, redis_url
        if url is None:
            if redis_server_available():
                from kvreuse.bench.redis_process import RedisProcess

                server = stack.enter_context(RedisProcess())
                url = server.url
                redis_note = f"a redis-server started for this run ({server.url})"
            else:
                redis_note = "skipped: redis-server is not on PATH and no Redis URL was given"
        else:
            redis_note = f"given: {redact_url(url)}"
        disk = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvreuse-tiers-bench-", dir=disk_dir)))
        overrides = [f"model.dtype={dtype}", "server.max_tokens=4096", "engine.max_num_batched_tokens=2048",
                     f"engine.kv_cache_memory_mb={kv_cache_memory_mb}", f"cache.disk.path={disk}",
                     f"cache.kv_dtype={kv_dtype}"]
        if url:
            overrides.append(f"cache.redis.url={url}")
        if model_path:
            overrides.append(f"model.path={model_path}")
        llm = LLM(load_config(None, overrides))
        llm.wait_compiled()
        stack.callback(llm.engine.close)
        report = _measure(llm, repeats, prompt_tokens, bool(url), disk if drop_disk_page_cache else None, progress)
        report["disk"]["filesystem"] = filesystem(disk)
    report["redis"] = redis_note
    return report


@dataclass
class _Samples:
    """What the measured rounds (not the warm-up) recorded, per way, and what every round recorded."""

    ways: list[str]
    first_tokens: list[int] = field(default_factory=list)    # every round's, the warm-up's too
    dropped_files: list[int] = field(default_factory=list)   # page-cache drops, one per disk read
    ttft: dict[str, list[float]] = field(init=False)         # seconds, per way
    load: dict[str, list[float]] = field(init=False)         # tier load seconds, per way that loads
    bandwidth: dict[str, list[float]] = field(init=False)    # tier load MB/s, likewise
    cached: dict[str, list[int]] = field(init=False)         # cached tokens, per way

    def __post_init__(self) -> None:
        self.ttft, self.load, self.bandwidth, self.cached = ({w: [] for w in self.ways} for _ in range(4))

    def add(self, outs: dict[str, RequestOutput], full_blocks: int, block_size: int, bytes_per_block: int) -> None:
        for way, out in outs.items():
            self.ttft[way].append(out.ttft_s)
            self.cached[way].append(out.usage.cached_tokens)
            if way in TARGETS:  # checked by _check_round: they loaded `full_blocks` tokens, in > 0 s
                self.load[way].append(out.tier_load_s)
                self.bandwidth[way].append(full_blocks / block_size * bytes_per_block / out.tier_load_s / MB)


def _measure(llm: LLM, repeats: int, prompt_tokens: int, with_redis: bool, page_cache_dir: Path | None,
             progress: Callable[[str], None]) -> dict:
    """The interleaved rounds on `llm` (tiers: disk, and Redis if `with_redis`); `page_cache_dir`: the disk tier's
    directory, to drop from the page cache before each disk read (None: leave it)."""
    engine = llm.engine
    store = engine.tiers
    expect(store is not None and "disk" in store.tier_names, "the engine has no disk tier")
    bs = engine.block_size
    full_blocks = (prompt_tokens - 1) // bs * bs  # an exact hit covers the full blocks before the last token
    expect(full_blocks > 0, f"prompt_tokens={prompt_tokens} has no full block before its last token (block size "
                            f"{bs}): nothing could hit")
    # A salt new to this run: its chain keys are new to every tier, so a Redis shared with earlier runs (or anyone)
    # holds nothing for it, and the cold request is cold in every tier.
    salt = f"tiers-bench-{uuid.uuid4().hex}"
    samples = _Samples([w for w in WAYS if w != "redis" or with_redis])
    for round_index in range(repeats + 1):  # round 0 warms up and is discarded
        prompt = synthetic_prompt(llm.tokenizer, prompt_tokens, variant=7000 + round_index)
        expect(len(prompt) == prompt_tokens, f"the synthetic prompt has {len(prompt)} tokens, not {prompt_tokens}")
        outs = _run_round(llm, prompt, salt, with_redis, page_cache_dir, samples.dropped_files)
        _check_round(outs, full_blocks, store)
        samples.first_tokens.append(outs["cold"].token_ids[0])
        if round_index:
            samples.add(outs, full_blocks, bs, engine.bytes_per_block)
        progress(_round_line(round_index, repeats, outs))
    rows = _rows(samples)
    return {"suite": "tiers", "repeats": repeats, "prompt_tokens": prompt_tokens, "block_size": bs,
            "full_block_tokens": full_blocks, "bytes_per_block": engine.bytes_per_block,
            "dtype": engine.dtype_description, "kv_dtype": engine.resolved.kv_format.name, "cpu": cpu_identity(),
            "machine": machine(), "ways": rows, "targets": _targets(rows),
            "first_tokens": samples.first_tokens,
            "first_tokens_match": True,  # checked every round (BenchError otherwise)
            "disk": {"page_cache": ("dropped before each disk read (posix_fadvise DONTNEED, advisory)"
                                    if samples.dropped_files and all(samples.dropped_files) else
                                    "warm: the entries were just written and the OS likely holds them in RAM")},
            "tier_counters": store.snapshot()}


def _timed_request(llm: LLM, prompt: list[int], salt: str) -> RequestOutput:
    """One measured request, after the settling pause; the tiers' writes it queued are flushed before returning."""
    time.sleep(SETTLE_S)
    out = llm.generate(prompt, GREEDY, cache_salt=salt)[0]
    expect(out.finish_reason != "error" and len(out.token_ids) == 1, f"the request failed: {out.error}")
    # What the request queued for the tiers is written before the next one, off its clock.
    expect(llm.engine.tiers.flush(FLUSH_TIMEOUT_S), f"the tier writer did not finish within {FLUSH_TIMEOUT_S:.0f}s")
    return out


def _run_round(llm: LLM, prompt: list[int], salt: str, with_redis: bool, page_cache_dir: Path | None,
               dropped_files: list[int]) -> dict[str, RequestOutput]:
    """One round: `prompt` served each way in turn (WAYS' order); how many files each page-cache drop asked for is
    appended to `dropped_files`."""
    engine, store = llm.engine, llm.engine.tiers
    outs: dict[str, RequestOutput] = {}
    # cold: the first request for a new variant, with caching on. Nothing holds its blocks (a new variant under a
    # salt new to this run), so it computes all of them, and it pays what a first request in a tiered engine
    # really pays: the tiers' existence check when it arrives and the copy of its blocks for the writer. (With
    # use_cache=False it would skip both and publish nothing, so it would time a request the engine never serves
    # that way, and another request would have to fill the tiers.) It fills the pool, the disk and Redis.
    outs["cold"] = _timed_request(llm, prompt, salt)
    # memory: the same prompt right after, its prefix held in the pool.
    outs["memory"] = _timed_request(llm, prompt, salt)
    # disk_cached: the pool's cached blocks dropped: the prefix is prefetched from the disk, the nearest tier,
    # whose files the OS still holds in RAM (as after a restart on a machine with memory to spare).
    engine.reset_prefix_cache()
    outs["disk_cached"] = _timed_request(llm, prompt, salt)
    # disk: the same, with the files dropped from the page cache first: read from the device.
    engine.reset_prefix_cache()
    if page_cache_dir is not None:
        dropped_files.append(drop_page_cache(page_cache_dir))
    outs["disk"] = _timed_request(llm, prompt, salt)
    if with_redis:
        # redis: the pool dropped again, and the store reading Redis alone (the disk holds the blocks too).
        engine.reset_prefix_cache()
        disk_hits = store.counters.hit_blocks["disk"]
        with reading_only(store, "redis"):
            outs["redis"] = _timed_request(llm, prompt, salt)
        expect(store.counters.hit_blocks["disk"] == disk_hits, "the redis way read blocks from the disk")
    return outs


def _round_line(round_index: int, repeats: int, outs: dict[str, RequestOutput]) -> str:
    """The progress line of one round: each way's TTFT, and its tier load time where it loaded."""
    def timing(way: str, out: RequestOutput) -> str:
        load = f" (load {out.tier_load_s * 1000:.1f} ms)" if out.tier_load_s else ""
        return f"{way} {out.ttft_s * 1000:.1f} ms{load}"

    warm_up = " (warm-up)" if not round_index else ""
    return f"round {round_index}/{repeats}{warm_up}: " + ", ".join(timing(w, o) for w, o in outs.items())


def _rows(samples: _Samples) -> dict[str, dict]:
    """The report's row per way: medians (TTFT, load time and bandwidth), the ratio to cold, and the samples."""
    cold_ms = statistics.median(samples.ttft["cold"]) * 1000
    rows = {}
    for way in samples.ways:
        ttft_ms = statistics.median(samples.ttft[way]) * 1000
        load_s = median_or_none(samples.load[way])
        rows[way] = {"median_ttft_ms": ttft_ms, "x_cold": ttft_ms / cold_ms,
                     "median_load_ms": None if load_s is None else load_s * 1000,
                     "median_load_mb_s": median_or_none(samples.bandwidth[way]),
                     "cached_tokens": samples.cached[way],
                     "samples_ms": [x * 1000 for x in samples.ttft[way]],
                     "load_samples_ms": [x * 1000 for x in samples.load[way]]}
    return rows


def _targets(rows: dict[str, dict]) -> dict[str, dict]:
    """Each tier's target and whether its median met it (None: the way was not measured)."""
    return {tier: {"target": TARGET_TEXT[tier], "max_x_cold": limit,
                   "x_cold": rows[tier]["x_cold"] if tier in rows else None,
                   "met": rows[tier]["x_cold"] <= limit if tier in rows else None}
            for tier, limit in TARGETS.items()}


def _check_round(outs: dict[str, RequestOutput], full_blocks: int, store: TieredStore) -> None:
    """Every request of the round was served from where it is claimed, with the cold request's first token."""
    def where(out: RequestOutput) -> str:
        return f"cached tokens {out.usage.cached_by_tier()} of {out.usage.prompt_tokens}"

    cold = outs["cold"]
    expect(cold.usage.cached_tokens == 0, f"the cold request hit: {where(cold)}")
    for way, out in outs.items():
        if way == "cold":
            continue
        tier = TIER_OF[way]
        expected = {t: full_blocks if t == tier else 0 for t in ("memory", "disk", "redis")}
        got = out.usage.cached_by_tier()
        if way == "memory" and full_blocks <= got.get("memory", 0) < out.usage.prompt_tokens:
            expected["memory"] = got["memory"]  # the pool may also hold the last block's tokens before the last one
        expect(got == expected,
               f"the {way} request was not served from {tier} alone: {where(out)}, expected {full_blocks} tokens "
               f"from {tier}; tier counters {store.snapshot()}")
        expect((out.tier_load_s > 0) == (tier != "memory"),
               f"the {way} request's tier load time is {out.tier_load_s} s")
        expect(out.token_ids[0] == cold.token_ids[0],
               f"the {way} request's first token {out.token_ids[0]} differs from the cold one {cold.token_ids[0]}")


def markdown(report: dict) -> str:
    def cell(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = ["| way | TTFT ms | x cold | load ms | load MB/s |", "|---|---|---|---|---|"]
    for way, row in report["ways"].items():
        lines.append(f"| {way} | {row['median_ttft_ms']:.1f} | {row['x_cold']:.3f} | "
                     f"{cell(row['median_load_ms'], '.1f')} | {cell(row['median_load_mb_s'], '.0f')} |")
    cpu = report["cpu"]
    targets = "; ".join(
        f"{t['target']}: " + ("not measured" if t["met"] is None else
                              f"{'met' if t['met'] else 'not met'} ({t['x_cold']:.3f}x)")
        for t in report["targets"].values())
    rounds = f"{report['repeats']} interleaved round{'s' if report['repeats'] != 1 else ''}"
    lines += ["",
              f"{report['prompt_tokens']}-token prompt, {report['full_block_tokens']} tokens cached, median of "
              f"{rounds}. CPU: {cpu['cpu']} ({cpu['machine']}; flags: {', '.join(cpu['flags']) or 'none'}); "
              f"dtype: {report['dtype']}, KV {report.get('kv_dtype', report['dtype'])}. Targets: {targets}.",
              f"Disk: {report['disk'].get('filesystem', 'unknown')}, page cache {report['disk']['page_cache']}. "
              f"Redis: {report['redis']}."]
    return "\n".join(lines)
