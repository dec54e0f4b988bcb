"""The admission pair's values: what the cache holds of a waiting request's prompt (`Match`: `KVCacheManager.match`
finds it, `can_admit` / `admit` take it, as vLLM's get_computed_blocks, then allocate_slots), and what the admission
took (`AdmissionOutcome`, which `admit` returns)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvreuse.kvcache.accounting import ReuseRecord
from kvreuse.kvcache.copy_jobs import CopyJobs
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


@dataclass(frozen=True)
class AdmissionOutcome:
    """What one admission took from the cache, as `KVCacheManager.admit` returns it: a value, kept by the engine's
    sequence (the request's record on the cache holds only its tables and the sources still to copy)."""
    reuse: ReuseRecord  # its prompt: tokens cached (and per tier, loaded) and reused; the rest computed
    copy_jobs: CopyJobs = field(default_factory=CopyJobs)  # the copies into its new blocks, run before its forward
    load_seconds: float | None = None    # the lower tiers' read of the blocks it loaded; None: it loaded none
    # Scoring the prompt: the stored records of the positions of its hits and of the block after them (position 0
    # has none), in order; () when it scores nothing or has no hits.
    prompt_logprobs: tuple = ()
