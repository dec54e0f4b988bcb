"""LFU: the cached block with the fewest hits goes first."""

from __future__ import annotations

import heapq

from kvreuse.kvcache.block import KVCacheBlock
from kvreuse.kvcache.eviction.policy import Release


class LFUPolicy:
    """Fewest hits first, least recently used among equals. A heap with lazy deletion: an entry is
    live only while its block is still evictable with the same (num_hits, last_access)."""

    name = "lfu"

    def __init__(self):
        self._heap: list[tuple[int, int, int]] = []
        self._blocks: dict[int, KVCacheBlock] = {}

    def publish(self, block: KVCacheBlock, parent: KVCacheBlock | None) -> None:
        pass

    def add(self, block: KVCacheBlock, release: Release | None = None) -> None:
        self._blocks[block.block_id] = block
        heapq.heappush(self._heap, (block.num_hits, block.last_access, block.block_id))

    def remove(self, block: KVCacheBlock) -> None:
        del self._blocks[block.block_id]
        if len(self._heap) > 4 * len(self._blocks) + 64:  # keep stale entries bounded
            self._heap = [e for e in self._heap if self._live(e)]
            heapq.heapify(self._heap)

    def _live(self, entry: tuple[int, int, int]) -> bool:
        block = self._blocks.get(entry[2])
        return block is not None and (block.num_hits, block.last_access) == entry[:2]

    def pop(self) -> KVCacheBlock:
        while True:
            entry = heapq.heappop(self._heap)
            if self._live(entry):
                return self._blocks.pop(entry[2])

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.block_id in self._blocks

    def check_integrity(self) -> None:
        live = {entry[2] for entry in self._heap if self._live(entry)}
        assert live == set(self._blocks), "an evictable block has no live LFU heap entry"
