"""LRU: the least recently used cached block goes first."""

from __future__ import annotations

from collections import OrderedDict

from kvreuse.kvcache.block import KVCacheBlock
from kvreuse.kvcache.eviction.policy import Release


class LRUPolicy:
    """Least recently used first; O(1) for every operation. The pool frees a sequence tail first, so a chain
    loses its last blocks before its first ones."""

    name = "lru"

    def __init__(self):
        self._blocks: OrderedDict[int, KVCacheBlock] = OrderedDict()

    def publish(self, block: KVCacheBlock, parent: KVCacheBlock | None) -> None:
        pass

    def add(self, block: KVCacheBlock, release: Release | None = None) -> None:
        self._blocks[block.block_id] = block

    def remove(self, block: KVCacheBlock) -> None:
        del self._blocks[block.block_id]

    def pop(self) -> KVCacheBlock:
        return self._blocks.popitem(last=False)[1]

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.block_id in self._blocks

    def check_integrity(self) -> None:
        assert all(block.block_id == i for i, block in self._blocks.items()), "LRU entry under another block's id"
