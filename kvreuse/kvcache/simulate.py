"""The cache's own simulator: prompts admitted one after another through a KVCacheManager, exactly as the
engine's scheduler admits them (the same matching, allocation, publishing and eviction code), with no model run.
So its hit rates are what the engine would measure for those prompts in that order, generated tokens aside
(they are never cached here). `kvreuse analyze` and the bench's block-size sweep use it."""

from __future__ import annotations

from collections.abc import Iterable

from kvreuse.config import CacheConfig
from kvreuse.kvcache.accounting import ReuseRecord
from kvreuse.kvcache.manager import KVCacheManager


def simulate(token_lists: Iterable[list[int]], cache: CacheConfig, fingerprint: str, num_blocks: int, *,
             enable_segments: bool | None = None) -> ReuseRecord:
    """Admit, 'compute' and free each prompt in turn on a fresh `[cache]` manager of `num_blocks` blocks
    (`enable_segments` overrides `cache.suffix.enabled`); returns the summed reuse record. When a prompt with its
    hits cannot fit, the cache is dropped first (the engine would evict it); a prompt larger than the whole
    pool is skipped, as the engine refuses it."""
    manager = KVCacheManager.from_config(cache, num_blocks, fingerprint, enable_segments=enable_segments)
    total = ReuseRecord()
    for token_ids in token_lists:
        req = manager.new_request(list(token_ids))
        hits = manager.match_prefix(req)
        plan = manager.match_segments(req, len(hits))
        last_block = manager.match_last_block(req, hits)
        if not manager.can_allocate(req, req.num_tokens, hits, plan, last_block):
            manager.pool.reset_cache()
            hits, plan, last_block = [], None, None
            if not manager.can_allocate(req, req.num_tokens):
                continue
        manager.allocate(req, req.num_tokens, hits, plan, last_block=last_block)
        total += ReuseRecord.planned(req.num_tokens, req.num_cached_tokens, plan.num_tokens if plan else 0,
                                     plan.num_shifted_tokens if plan else 0)
        manager.release_sources(req)
        manager.cache_computed_blocks(req, req.num_tokens)
        manager.free(req)
    return total
