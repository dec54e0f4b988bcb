"""The eviction policy protocol: which unreferenced cached block the pool drops first when it needs room.

A policy tracks only evictable blocks (ref_cnt 0, holding a key): the pool calls `publish` when a block gets a key,
`add` when it becomes evictable (with the `Release` of the request that ended, when one did), `remove` when a request
takes it again and `pop` to evict. Whatever else a policy remembers (queues, counters, a ghost list of evicted keys)
is its own, keyed by block id and checked against the block's uid, since a physical block is reused for other
contents after it is evicted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvreuse.kvcache.block import KVCacheBlock


@dataclass(frozen=True)
class Release:
    """A request's end, as the blocks it frees tell it: what it was (sizes), and the key of its last published block,
    the one its next turn would reuse (so a later request carrying that key is this request coming back)."""
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int   # prompt tokens it took from the cache
    last_key: bytes | None   # None: it published no block


class EvictionPolicy(Protocol):
    name: str

    def publish(self, block: KVCacheBlock, parent: KVCacheBlock | None) -> None:
        """`block` was just registered (it is held), after `parent` in its chain (None: a first block)."""

    def add(self, block: KVCacheBlock, release: Release | None = None) -> None:
        """`block` became evictable; `release`: the end of the request that held it last (None: not a request's end,
        such as a copy source let go after admission)."""

    def remove(self, block: KVCacheBlock) -> None: ...

    def pop(self) -> KVCacheBlock:
        """Take the victim out of the policy and return it; raises if the policy holds nothing."""

    def __len__(self) -> int: ...
    def __contains__(self, block: KVCacheBlock) -> bool: ...

    def check_integrity(self) -> None:
        """Assert the policy's own invariants (its queues and indexes agree)."""
