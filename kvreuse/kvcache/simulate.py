"""The cache's own simulator: prompts admitted one after another through a KVCacheManager's own admission pair and
post-forward update (`match`, `can_admit` / `admit`, `update`, `free`: the calls the engine's scheduler makes), with
no model run, over the engine's pool layout (a sliding-window model's layer groups included). So its hit rates are
what the engine would measure for those prompts in that order, generated tokens aside (they are never cached here).
`kvreuse analyze`, the bench's block-size sweep and `kvreuse bench trace` use it."""

from __future__ import annotations

from collections.abc import Iterable

from kvreuse.config import CacheConfig
from kvreuse.kvcache.accounting import ReuseRecord
from kvreuse.kvcache.eviction import EvictionPolicy
from kvreuse.kvcache.layout import KVLayout
from kvreuse.kvcache.manager import KVCacheManager
from kvreuse.kvcache.match import NO_MATCH


class CacheSimulator:
    """A fresh `[cache]` manager of `num_blocks` blocks that prompts go through one at a time (`enable_segments`
    overrides `cache.suffix.enabled`, `policy` `cache.policy`: an offline MIN needs a policy object)."""

    def __init__(self, cache: CacheConfig, fingerprint: str, num_blocks: int, *, enable_segments: bool | None = None,
                 policy: EvictionPolicy | None = None, layout: KVLayout | None = None):
        self.manager = KVCacheManager.from_config(cache, num_blocks, fingerprint, enable_segments=enable_segments,
                                                  policy=policy, layout=layout)
        self.num_skipped = 0

    def run(self, token_ids: list[int], num_output_tokens: int = 0) -> ReuseRecord:
        """Admit, 'compute' and free one prompt that generates `num_output_tokens` (extending its tokens as the
        engine's sequence does, but never cached); its reuse record. When the prompt with its hits cannot fit, the
        cache is dropped first (the engine would evict it); a prompt larger than the whole pool is skipped, as the
        engine refuses it (an empty record, counted in `num_skipped`)."""
        manager = self.manager
        req = manager.new_request(list(token_ids))
        match = manager.match(req)
        if not manager.can_admit(match, req.num_tokens - match.num_cached_tokens):
            manager.pool.reset_cache()
            match = NO_MATCH
            if not manager.can_admit(match, req.num_tokens):
                self.num_skipped += 1
                return ReuseRecord()
        record = manager.admit(req, match, req.num_tokens - match.num_cached_tokens).reuse
        manager.update(req, req.num_tokens)
        req.token_ids += [0] * num_output_tokens
        manager.free(req, num_cached_tokens=record.cached_tokens)
        return record


def simulate(token_lists: Iterable[list[int]], cache: CacheConfig, fingerprint: str, num_blocks: int, *,
             enable_segments: bool | None = None, layout: KVLayout | None = None) -> ReuseRecord:
    """Every prompt in turn through one `CacheSimulator` (over `layout`'s groups: a sliding-window model's hits need
    their windows); the summed reuse record."""
    simulator = CacheSimulator(cache, fingerprint, num_blocks, enable_segments=enable_segments, layout=layout)
    total = ReuseRecord()
    for token_ids in token_lists:
        total += simulator.run(token_ids)
    return total
