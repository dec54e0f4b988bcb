"""Belady's MIN, the offline optimum: evict the block whose next use is farthest in the future.

It needs the future, so it exists only for replaying a known sequence of prompts (`kvreuse bench trace`), as the
limit that online policies are measured against; `cache.policy` never offers it.

In a prefix cache a block is only usable after every block before it in its chain, so every prompt that uses a
block uses its parent too: a block's next use is never earlier than its parent's. Evicting the farthest next use,
deeper blocks first among equal ones, therefore evicts a chain from its tail and never leaves a block cached behind
an evicted one (whose next use would be void). The cached set stays closed under prefixes, every block-level hit
is a prefix hit, and MIN's optimality for single-block accesses carries over to prefix hits.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

from kvreuse.kvcache.block import KVCacheBlock
from kvreuse.kvcache.eviction.policy import Release


class FutureUses:
    """When each chain key will be used: the index of every prompt whose usable prefix holds it. `now` is the index
    of the prompt being replayed; the caller advances it before each prompt."""

    def __init__(self, keys_per_prompt: Iterable[Sequence[bytes]]):
        self._uses: dict[bytes, list[int]] = defaultdict(list)
        for index, keys in enumerate(keys_per_prompt):
            for key in keys:
                self._uses[key].append(index)
        self.now = -1

    def next_use(self, key: bytes) -> float:
        """The first prompt after `now` that uses `key`; math.inf if none does."""
        uses = self._uses.get(key, ())
        i = bisect.bisect_right(uses, self.now)
        return uses[i] if i < len(uses) else math.inf


class BeladyPolicy:
    """Farthest next use first, then the deepest block (largest position), then the least recently freed. A block's
    next use cannot change while it is evictable (a use would take it), so each heap entry is fixed when added."""

    name = "belady"

    def __init__(self, future: FutureUses):
        self.future = future
        self._heap: list[tuple[float, int, int, int]] = []  # (-next use, -position, serial, block id)
        self._serials: dict[int, int] = {}                  # evictable block id -> serial of its live entry
        self._blocks: dict[int, KVCacheBlock] = {}
        self._serial = 0

    def publish(self, block: KVCacheBlock, parent: KVCacheBlock | None) -> None:
        pass

    def add(self, block: KVCacheBlock, release: Release | None = None) -> None:
        self._serial += 1
        self._serials[block.block_id] = self._serial
        self._blocks[block.block_id] = block
        heapq.heappush(self._heap, (-self.future.next_use(block.block_key), -block.position, self._serial,
                                    block.block_id))

    def remove(self, block: KVCacheBlock) -> None:
        del self._serials[block.block_id]
        del self._blocks[block.block_id]
        if len(self._heap) > 4 * len(self._serials) + 64:  # keep stale entries bounded
            self._heap = [e for e in self._heap if self._serials.get(e[3]) == e[2]]
            heapq.heapify(self._heap)

    def pop(self) -> KVCacheBlock:
        while True:
            _, _, serial, block_id = heapq.heappop(self._heap)
            if self._serials.get(block_id) == serial:
                del self._serials[block_id]
                return self._blocks.pop(block_id)

    def __len__(self) -> int:
        return len(self._serials)

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.block_id in self._serials

    def check_integrity(self) -> None:
        live = {e[3] for e in self._heap if self._serials.get(e[3]) == e[2]}
        assert live == set(self._serials) == set(self._blocks), "an evictable block has no live MIN heap entry"
