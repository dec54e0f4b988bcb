"""What the cache holds of a waiting request's prompt: `KVCacheManager.match` finds it, `can_admit` / `admit` take it
(as vLLM's get_computed_blocks, then allocate_slots)."""

from __future__ import annotations

from dataclasses import dataclass

from kvreuse.kvcache.segment import SegmentPlan
from kvreuse.kvcache.tiers.store import LoadedBlock


@dataclass(frozen=True)
class Match:
    hits: tuple[int, ...] = ()             # pool blocks of the exact prefix, in order
    loads: tuple[LoadedBlock, ...] = ()    # the prefix's continuation, read from a lower tier
    # The pool's copy of a fully cached block-aligned prompt's last block, in every group (group 0 first); () if none.
    last_blocks: tuple[int, ...] = ()
    plan: SegmentPlan | None = None        # cached segments beyond the exact prefix
    num_cached_tokens: int = 0             # tokens the exact prefix gives: hits, loads and the last block's copy
    # A grouped layout's sliding-window groups: the pool blocks of each one's window before the first computed token
    # (the hits' last blocks, as many as the window reads), in order.
    windows: tuple[tuple[int, ...], ...] = ()

    @property
    def num_cached_blocks(self) -> int:
        """Full blocks of the exact prefix (in the pool or loaded)."""
        return len(self.hits) + len(self.loads)

    @property
    def held_block_ids(self) -> set[int]:
        """Pool blocks the request holds besides its own new ones once admitted: hits and copy sources."""
        sources = self.plan.source_block_ids if self.plan else ()
        return {*self.hits, *sources, *self.last_blocks, *(b for window in self.windows for b in window)}


NO_MATCH = Match()
