"""The eviction policy protocol: which unreferenced cached block the pool drops first when it needs room.

A policy tracks only evictable blocks (ref_cnt 0, holding a key): the pool calls `publish` when a block gets a key,
`add` when it becomes evictable, `remove` when a request takes it again and `pop` to evict. Whatever else a policy
remembers (queues, counters, a ghost list of evicted keys) is its own, keyed by block id and checked against the
block's uid, since a physical block is reused for other contents after it is evicted.
"""

from __future__ import annotations

from typing import Protocol

from kvreuse.kvcache.block import KVCacheBlock


class EvictionPolicy(Protocol):
    name: str

    def publish(self, block: KVCacheBlock, parent: KVCacheBlock | None) -> None:
        """`block` was just registered (it is held), after `parent` in its chain (None: a first block)."""

    def add(self, block: KVCacheBlock) -> None: ...
    def remove(self, block: KVCacheBlock) -> None: ...

    def pop(self) -> KVCacheBlock:
        """Take the victim out of the policy and return it; raises if the policy holds nothing."""

    def __len__(self) -> int: ...
    def __contains__(self, block: KVCacheBlock) -> bool: ...

    def check_integrity(self) -> None:
        """Assert the policy's own invariants (its queues and indexes agree)."""
