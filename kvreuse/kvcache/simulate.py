"""The cache's own simulator: prompts admitted one after another through a KVCacheManager's own admission pair and
post-forward update (`match`, `can_admit` / `admit`, `update`, `free`: the calls the engine's scheduler makes), with
no model run. So its hit rates are what the engine would measure for those prompts in that order, generated tokens
aside (they are never cached here). `kvreuse analyze` and the bench's block-size sweep use it."""

from __future__ import annotations

from collections.abc import Iterable

from kvreuse.config import CacheConfig
from kvreuse.kvcache.accounting import ReuseRecord
from kvreuse.kvcache.manager import KVCacheManager
from kvreuse.kvcache.match import NO_MATCH


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
        match = manager.match(req)
        if not manager.can_admit(match, req.num_tokens - match.num_cached_tokens):
            manager.pool.reset_cache()
            match = NO_MATCH
            if not manager.can_admit(match, req.num_tokens):
                continue
        manager.admit(req, match, req.num_tokens - match.num_cached_tokens)
        total += ReuseRecord.admitted(req.num_tokens, req)
        manager.update(req, req.num_tokens)
        manager.free(req)
    return total
