"""The lower tiers (disk, Redis) under the pool, for the KVCacheManager: a waiting request's prefix chain beyond what
the pool holds is read in the background (`prefetch`), handed over at admission when it continues the pool's hits
(`match`), and written into the request's first new blocks (`write`), which the manager then publishes."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout  # the builtin from 3.11, not on 3.10

from kvreuse.kvcache.copy_jobs import CopyJobs
from kvreuse.kvcache.hashing import BlockHashFn, extend_chain
from kvreuse.kvcache.request import CacheRequest
from kvreuse.kvcache.tiers.store import LoadedBlock, TieredStore


class TierLoads:
    def __init__(self, tiers: TieredStore | None, block_size: int, min_match_blocks: int):
        self.tiers, self.block_size = tiers, block_size
        self.need = max(1, min_match_blocks)  # the fewest blocks a hit may have

    def prefetch(self, req: CacheRequest, num_pool_blocks: int, num_usable_blocks: int, hash_fn: BlockHashFn) -> None:
        """Start reading `req`'s chain (keys by `hash_fn`) from block `num_pool_blocks` (the pool's run: it holds those
        already) to block `num_usable_blocks` (those before its last token) in the background."""
        # A pool run too short to be used at admission: the tiers' run must stand on its own.
        start = num_pool_blocks if num_pool_blocks >= self.need else 0
        end = num_usable_blocks
        if start >= end:
            return
        bs = self.block_size
        keys = extend_chain(req.tables.block_keys, req.token_ids, bs, req.extra_key, end, hash_fn)[:end]
        token_blocks = [req.token_ids[i * bs:(i + 1) * bs] for i in range(start, end)]
        parent_key = keys[start - 1] if start else None
        req.pending.tier_load = self.tiers.prefetch(keys[start:], token_blocks, start, parent_key)

    @staticmethod
    def is_loading(req: CacheRequest) -> bool:
        """Its prefetch is still reading: admitting it now would compute what is about to arrive."""
        return req.pending.tier_load is not None and not req.pending.tier_load.done()

    @classmethod
    def wait_for_load(cls, req: CacheRequest, timeout: float) -> None:
        if cls.is_loading(req):
            try:
                req.pending.tier_load.result(timeout)
            except FutureTimeout:  # still loading: the caller asks again
                pass

    def match(self, req: CacheRequest, hits: Sequence[int]) -> list[LoadedBlock]:
        """The prefetched blocks that continue `hits` (the pool's prefix hits at admission): empty if there are none,
        if the pool lost blocks before them since the prefetch, or if all together are fewer than
        `min_match_blocks`."""
        if req.pending.tier_load is None or not req.pending.tier_load.done():
            return []
        load = req.pending.tier_load.result()
        offset = len(hits) - load.start
        loads = load.blocks[offset:] if offset >= 0 else []
        return loads if len(hits) + len(loads) >= self.need else []

    def write(self, positions: Sequence[tuple[int, ...]], loads: Sequence[LoadedBlock], jobs: CopyJobs) -> list[str]:
        """Put loaded K/V into a request's blocks at `positions` (each one's block in every group: a job); the tiers
        nearer than the farthest one read from, which the manager then publishes the loaded blocks to (a Redis hit
        lands on the local disk)."""
        jobs.writes += [(position, b.payload) for position, b in zip(positions, loads, strict=True)]
        names = self.tiers.tier_names
        return names[:max(names.index(b.tier) for b in loads)]
