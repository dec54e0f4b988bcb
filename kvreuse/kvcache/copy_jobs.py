"""Tensor work the cache decides and the engine runs, in one place: the KV cache itself handles block ids only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvreuse.kvcache.tiers.store import StoredBlock


@dataclass(frozen=True)
class StoreJob:
    """Published blocks to queue for the lower tiers named in `tiers`."""
    blocks: tuple[StoredBlock, ...]
    positions: tuple[tuple[int, ...], ...]  # each block's pool block in every layer group, group 0 first
    tiers: tuple[str, ...]


@dataclass
class CopyJobs:
    """Run in this order, before the pool is written again: bytes loaded from a lower tier into pool blocks, pool
    blocks into pool blocks (every layer: a cached last block, a forked partial block), pool blocks out to tiers."""
    # (a position's pool block in every layer group, its payload)
    writes: list[tuple[tuple[int, ...], memoryview]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)         # (source block, destination block)
    stores: list[StoreJob] = field(default_factory=list)

    def __iadd__(self, other: CopyJobs) -> CopyJobs:
        self.writes += other.writes
        self.copies += other.copies
        self.stores += other.stores
        return self

    def store(self, blocks: Sequence[StoredBlock], positions: Sequence[tuple[int, ...]], tiers: Sequence[str]
              ) -> None:
        if blocks and tiers:
            self.stores.append(StoreJob(tuple(blocks), tuple(positions), tuple(tiers)))
