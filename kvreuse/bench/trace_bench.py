"""`kvreuse bench trace FILE`: replay a Mooncake-format trace through the cache simulator, once per eviction policy
and capacity, beside an infinite cache and Belady's MIN.

Each request's hash ids become prompt tokens (`trace.prompt_tokens`) that go through a `CacheSimulator`: the
engine's own KVCacheManager, block pool and policy code, with no model run. A capacity is counted in the trace's
hash blocks (512 tokens in Mooncake's release), so it means the same at any `tokens_per_hash`: the pool holds
capacity x tokens_per_hash tokens, requests in flight included, as an engine's KV pool does. Per run: the prefix hit
rate (cached prompt tokens / prompt tokens, as the engine counts it), the prefill tokens saved (the cached ones), and
the tokens the policy's evictions cost (what an infinite cache would have served on top). MIN reads the future from
the trace itself (`FutureUses`, keyed by the same chain keys the pool uses).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from kvreuse.bench.trace import MOONCAKE_HASH_BLOCK_TOKENS, TraceRequest, prompt_tokens
from kvreuse.config import CacheConfig
from kvreuse.kvcache.accounting import ReuseRecord
from kvreuse.kvcache.eviction import POLICIES
from kvreuse.kvcache.eviction.belady import BeladyPolicy, FutureUses
from kvreuse.kvcache.hashing import extend_chain
from kvreuse.kvcache.request import new_cache_request
from kvreuse.kvcache.simulate import CacheSimulator

BELADY = "belady"
POLICY_NAMES = (*POLICIES, BELADY)
DEFAULT_CAPACITIES = (1000, 2000, 4000, 6000, 10000, 20000)
FINGERPRINT = "trace-replay"  # any fixed model fingerprint: the keys only have to agree within a replay
MAX_BLOCK_SIZE = 256          # cache.block_size's bound


def default_block_size(tokens_per_hash: int) -> int:
    """The largest block size within cache.block_size's bound that divides a hash block: one cache block per hash
    block where it fits, so a capacity in hash blocks is a whole number of cache blocks."""
    return max(b for b in range(1, min(tokens_per_hash, MAX_BLOCK_SIZE) + 1) if tokens_per_hash % b == 0)


@dataclass(frozen=True)
class Scale:
    """How trace requests become prompts: tokens per hash id, the trace's own tokens per hash block, the cache's
    block size."""
    tokens_per_hash: int = MOONCAKE_HASH_BLOCK_TOKENS
    hash_block_tokens: int = MOONCAKE_HASH_BLOCK_TOKENS
    block_size: int = MAX_BLOCK_SIZE

    def prompt(self, request: TraceRequest) -> list[int]:
        return prompt_tokens(request, self.tokens_per_hash, self.hash_block_tokens)

    def num_output_tokens(self, request: TraceRequest) -> int:
        """The answer's length as the trace gives it, unscaled: nothing generated is cached, and `learned` reads its
        magnitude."""
        return request.output_length

    def cache_blocks(self, hash_blocks: int) -> int:
        return hash_blocks * self.tokens_per_hash // self.block_size


def future_uses(requests: Sequence[TraceRequest], scale: Scale) -> FutureUses:
    """The chain keys each prompt could hit (its full blocks before its last token, as the manager matches them)."""
    extra = new_cache_request([], FINGERPRINT, scale.block_size).extra_key
    keys = []
    for request in requests:
        tokens = scale.prompt(request)
        keys.append(extend_chain([], tokens, scale.block_size, extra, (len(tokens) - 1) // scale.block_size))
    return FutureUses(keys)


def replay(requests: Sequence[TraceRequest], scale: Scale, capacity: int | None, policy: str,
           future: FutureUses | None = None) -> dict:
    """One pass of the trace at `capacity` hash blocks (None: infinite) under `policy` (a cache.policy name, or
    "belady" with `future`); its counts and wall time."""
    hash_blocks = capacity if capacity is not None else sum(len(r.hash_ids) for r in requests) + 1
    num_blocks = scale.cache_blocks(hash_blocks)
    cache = CacheConfig(block_size=scale.block_size, max_blocks=num_blocks,
                        policy="lru" if policy == BELADY else policy)
    simulator = CacheSimulator(cache, FINGERPRINT, num_blocks, enable_segments=False,
                               policy=BeladyPolicy(future) if policy == BELADY else None)
    total = ReuseRecord()
    start = time.perf_counter()
    for index, request in enumerate(requests):
        if future is not None:
            future.now = index
        total += simulator.run(scale.prompt(request), scale.num_output_tokens(request))
    seconds = time.perf_counter() - start
    return {"policy": policy, "capacity": capacity, "hit_rate": round(total.hit_rate, 4),
            "prompt_tokens": total.prompt_tokens, "cached_tokens": total.cached_tokens,
            "evictions": simulator.manager.pool.num_evictions, "skipped_requests": simulator.num_skipped,
            "seconds": round(seconds, 3), "tokens_per_second": round(total.prompt_tokens / max(seconds, 1e-9))}


def run(requests: Sequence[TraceRequest], scale: Scale, capacities: Sequence[int], policies: Sequence[str],
        progress: Callable[[str], None] = lambda line: None, name: str = "") -> dict:
    """Every policy at every capacity, and the infinite cache they are measured against: the report."""
    unknown = [p for p in policies if p not in POLICY_NAMES]
    if unknown:
        raise ValueError(f"unknown policy {unknown[0]!r}; choose from {', '.join(POLICY_NAMES)}")
    infinite = replay(requests, scale, None, "lru")
    progress(f"infinite cache: hit rate {infinite['hit_rate']:.3f} ({infinite['seconds']:.1f} s)")
    future = future_uses(requests, scale) if BELADY in policies else None
    hash_blocks = sum(len(r.hash_ids) for r in requests)
    results = []
    for capacity in capacities:
        for policy in policies:
            result = replay(requests, scale, capacity, policy, future if policy == BELADY else None)
            result["eviction_cost_tokens"] = infinite["cached_tokens"] - result["cached_tokens"]
            # Hash blocks hit / hash blocks: the block-level rate, counting each partial last block as a whole one.
            result["hash_block_hit_rate"] = round(result["cached_tokens"] / scale.tokens_per_hash / hash_blocks, 4)
            results.append(result)
            progress(f"{capacity} blocks, {policy}: hit rate {result['hit_rate']:.3f} ({result['seconds']:.1f} s, "
                     f"{result['tokens_per_second'] / 1e6:.2f}M tokens/s)")
    return {"trace": name, "requests": len(requests), "hash_blocks": hash_blocks,
            "distinct_hash_blocks": len({h for r in requests for h in r.hash_ids}), **asdict(scale),
            "prompt_tokens": infinite["prompt_tokens"], "infinite": infinite, "capacities": list(capacities),
            "policies": list(policies), "results": results}


def pool_capacities(pool_mb: float, kv_dtypes: Sequence[str], tokens_per_hash: int, block_size: int,
                    model: str = "") -> dict[str, int]:
    """The capacity in hash blocks that a pool of `pool_mb` MB holds in each `cache.kv_dtype`, at `model`'s K/V bytes
    per token (the embedded model's by default; fp32 weights, so `auto` is fp32)."""
    from kvreuse.config import load_config
    from kvreuse.engine.resolved_model import resolve_model

    capacities = {}
    for kv_dtype in kv_dtypes:
        config = load_config(None, ["model.dtype=fp32", f"cache.kv_dtype={kv_dtype}", f"model.path={model}"])
        bytes_per_token = resolve_model(config).kv_bytes_per_block(block_size) / block_size
        capacities[kv_dtype] = int(pool_mb * 2**20 / bytes_per_token) // tokens_per_hash
    return capacities


def _tokens(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}k" if n >= 1e3 else f"{n:.0f}"


def markdown(report: dict) -> str:
    """The hit-rate table (capacities x policies), then each run's tokens saved, eviction cost and speed."""
    by = {(r["capacity"], r["policy"]): r for r in report["results"]}
    policies, hash_tokens = report["policies"], report["hash_block_tokens"]
    lines = [f"Trace {report['trace']}: {report['requests']} requests, {report['hash_blocks']} hash blocks "
             f"({report['distinct_hash_blocks']} distinct), {report['tokens_per_hash']} tokens per hash, block_size "
             f"{report['block_size']}: {_tokens(report['prompt_tokens'])} prompt tokens replayed. Infinite cache: "
             f"hit rate {report['infinite']['hit_rate']:.3f}.", "",
             "| capacity (hash blocks) | trace tokens | " + " | ".join(policies) + " |",
             "|---|---|" + "---|" * len(policies)]
    for capacity in report["capacities"]:
        rates = " | ".join(f"{by[capacity, p]['hit_rate']:.3f}" for p in policies)
        lines.append(f"| {capacity:,} | {_tokens(capacity * hash_tokens)} | {rates} |")
    if "pool_mb" in report:
        held = ", ".join(f"{kv_dtype} {capacity:,}" for kv_dtype, capacity in report["kv_dtype_capacities"].items())
        lines += ["", f"A pool of {report['pool_mb']:g} MB of {report['model']}'s K/V holds, in hash blocks: {held}."]
    skipped = sorted({r["capacity"] for r in report["results"] if r["skipped_requests"]})
    if skipped:
        lines += ["", f"At capacity {', '.join(map(str, skipped))} some requests were larger than the whole pool and "
                      "were skipped (not counted), as an engine refuses them."]
    lines += ["", "| capacity | policy | hit rate | prefill tokens saved | eviction cost (tokens) | evictions | "
                  "replay s | tokens/s |", "|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        lines.append(f"| {r['capacity']:,} | {r['policy']} | {r['hit_rate']:.3f} | {_tokens(r['cached_tokens'])} | "
                     f"{_tokens(r['eviction_cost_tokens'])} | {r['evictions']:,} | {r['seconds']:.1f} | "
                     f"{_tokens(r['tokens_per_second'])} |")
    return "\n".join(lines)
