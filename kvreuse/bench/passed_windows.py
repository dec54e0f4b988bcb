"""What `kvreuse bench windows` (bench/window_retention.py) compares: what becomes of the sliding-window blocks a
running sequence's window has passed. The cache does one thing with them ("policy": cached like any block, under
`cache.policy`); this module installs the alternatives on a manager, from outside the cache, for the bench and the
tests to measure:
- "cold": cached, but evicted before anything the eviction policy holds, unless a hit reused them (an eviction policy
  wrapping the pool's own, `ColdFirst`);
- "end": unpublished and freed at once, unless a hit reused them, so only the windows a sequence holds when it ends
  stay cached.
Under all three a request keeps the windows of hits at its last two block boundaries and at the last two before its
prompt's end (the window groups free those themselves), and window blocks go as soon as the full-attention block they
are found through goes.

`PassedWindows.install` wraps the pool's policy in a `ColdFirst` and takes each sliding-window group's `let_go_passed`
(kvcache/sliding_window_group.py), the one place passed window blocks leave a request; the pool and the manager know
nothing of either."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from kvreuse.kvcache.block import KVCacheBlock
from kvreuse.kvcache.eviction import EvictionPolicy, Release
from kvreuse.kvcache.manager import KVCacheManager

WindowRetention = Literal["policy", "cold", "end"]
RETENTIONS: tuple[WindowRetention, ...] = ("cold", "policy", "end")


class ColdFirst:
    """An eviction policy around `inner` that evicts its `cold` blocks first, oldest first: the blocks added while
    their ids are in `passing` (let go as passed windows) that no hit has reused."""

    def __init__(self, inner: EvictionPolicy):
        self.inner = inner
        self.name = inner.name
        self.cold: dict[int, KVCacheBlock] = {}  # by block id, in the order they became evictable
        self.passing: set[int] = set()

    def publish(self, block: KVCacheBlock, parent: KVCacheBlock | None) -> None:
        self.inner.publish(block, parent)

    def add(self, block: KVCacheBlock, release: Release | None = None) -> None:
        if block.block_id in self.passing and block.num_hits <= 1:
            self.cold[block.block_id] = block
        else:
            self.inner.add(block, release)

    def remove(self, block: KVCacheBlock) -> None:
        if self.cold.pop(block.block_id, None) is None:
            self.inner.remove(block)

    def pop(self) -> KVCacheBlock:
        if self.cold:
            return self.cold.pop(next(iter(self.cold)))
        return self.inner.pop()

    def __len__(self) -> int:
        return len(self.cold) + len(self.inner)

    def __contains__(self, block: KVCacheBlock) -> bool:
        return self.cold.get(block.block_id) is block or block in self.inner

    def check_integrity(self) -> None:
        """The cold blocks are unreferenced published blocks the inner policy does not hold; then the inner's own."""
        for block_id, block in self.cold.items():
            assert block.block_id == block_id and block.ref_cnt == 0 and block.block_key is not None, \
                f"cold block {block_id} is stale"
            assert block not in self.inner, f"cold block {block_id} is also in the policy"
        self.inner.check_integrity()


class PassedWindows:
    """The retention `mode` of a manager's passed window blocks, installed on a fresh manager (its pool holds no
    cached block yet); `mode` can change at any time and applies to the blocks passed from then on."""

    def __init__(self, manager: KVCacheManager, mode: WindowRetention = "policy"):
        self.pool, self.mode = manager.pool, mode
        assert not len(self.pool.evictable), "install on a pool that caches nothing yet"
        self.policy = ColdFirst(self.pool.evictable)
        self.pool.evictable = self.policy

    @classmethod
    def install(cls, manager: KVCacheManager, mode: WindowRetention = "policy") -> PassedWindows:
        """Take over what becomes of `manager`'s passed window blocks (a layout without window groups has none)."""
        passed = cls(manager, mode)
        for group in manager.coordinator.windows:
            group.let_go_passed = passed.let_go
        return passed

    def let_go(self, block_ids: Sequence[int]) -> None:
        if self.mode == "end":
            self._end(block_ids)
            return
        self.policy.passing.update(block_ids if self.mode == "cold" else ())
        try:
            self.pool.free(block_ids)
        finally:
            self.policy.passing.clear()

    def _end(self, block_ids: Sequence[int]) -> None:
        """Those left unreferenced that no hit has reused are unpublished and freed (not evictions); the others freed
        as under "policy"."""
        kept = []
        for block_id in block_ids:
            block = self.pool.blocks[block_id]
            if block.ref_cnt == 1 and block.num_hits <= 1:
                block.ref_cnt = 0
                if block.block_key is not None:
                    self.pool._drop(block, count=False)  # (no public way: only this experiment unpublishes held blocks)
                self.pool.free_block_ids.append(block_id)
            else:
                kept.append(block_id)
        self.pool.free(kept)
