"""What a request holds until its K/V are copied into its blocks, written by the KVCacheManager alone (a CacheRequest
holds one as `pending`)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from kvreuse.kvcache.segment import SegmentPlan


@dataclass
class PendingSources:
    """The sources held until the step after admission has copied them (or, the tiers' read, until admission)."""
    segment_plan: SegmentPlan | None = None  # cached segments to copy in
    # A fully cached aligned prompt's cached last block, in every group.
    last_block_sources: list[int] = field(default_factory=list)
    tier_load: Future | None = None   # the lower tiers' read of its prefix chain (a TierLoad), until admission

    def held_block_ids(self) -> list[int]:
        """The pool blocks held as copy sources (segment sources, then last block copies)."""
        sources = self.segment_plan.source_block_ids if self.segment_plan else []
        return sources + self.last_block_sources
