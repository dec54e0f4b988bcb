"""The KV block pool: free blocks, blocks in use, and cached blocks kept for reuse.

Every block is in exactly one state:
- in use:  ref_cnt > 0 (it may also hold a key: a cached block that requests share);
- cached:  ref_cnt == 0 with a key, evictable, tracked by the eviction policy or retained for a session
  (retention.py);
- free:    ref_cnt == 0 without a key, in `free_block_ids`.
Requests always win over the cache: `allocate` takes free blocks first, then evicts cached ones: the policy's victim
first, then the blocks retained for sessions whose next request is yet to come.
`max_cached_blocks` bounds the cached (unreferenced) blocks retained; the pool size bounds the rest.

Beside its `num_blocks` blocks (ids 1 to num_blocks) the pool has one more, the null block (block.NULL_BLOCK, id 0),
in none of those states: it stands in block tables where a sliding window has passed a block, and pads ragged tables.
It is allocated on top of the configured size, so `num_blocks` (engine.num_kv_blocks, cache.max_blocks, the stats)
counts usable blocks only; the K/V tensor holds num_blocks + 1 blocks (`num_physical_blocks`), and a pool derived
from `engine.kv_cache_memory_mb` gives the null block's memory up from its usable blocks.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Callable, Sequence

from kvreuse.kvcache.block import NULL_BLOCK, KVCacheBlock
from kvreuse.kvcache.eviction import EvictionPolicy, Release, make_policy
from kvreuse.kvcache.retention import SessionHint, SessionRetention


def num_physical_blocks(num_blocks: int) -> int:
    """Blocks the K/V tensor of a pool of `num_blocks` usable blocks holds: the null block too."""
    return num_blocks + 1


class BlockPool:
    def __init__(self, num_blocks: int, max_cached_blocks: int | None = None, policy: str | EvictionPolicy = "lru",
                 max_retained_blocks: int = 0):
        self.num_blocks = num_blocks
        self.max_cached_blocks = num_blocks if max_cached_blocks is None else max_cached_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_physical_blocks(num_blocks))]  # the null block's too
        self.free_block_ids: deque[int] = deque(range(NULL_BLOCK + 1, num_physical_blocks(num_blocks)))
        self.evictable = make_policy(policy)  # by `cache.policy` name, or an instance (a replay's offline MIN)
        self.retention = SessionRetention(max_retained_blocks)  # cached blocks evicted after the policy's
        self.key_to_block: dict[bytes, KVCacheBlock] = {}
        self.uid_to_block: dict[int, KVCacheBlock] = {}  # published blocks by identity: whose parent still exists
        # Published sliding-window blocks (group > 0) by the uid of the full-attention block they are found through:
        # they go when it goes, as no lookup can reach them after.
        self.windows_of: dict[int, set[int]] = {}
        self.num_evictions = 0
        self._tick = itertools.count(1)
        self._uids = itertools.count(1)
        # Told about every block published / evicted: the segment index (and, later, KV event publishers).
        self.on_register: list[Callable[[KVCacheBlock], None]] = []
        self.on_evict: list[Callable[[KVCacheBlock], None]] = []

    # --- sizes ---------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can get now: free ones plus cached ones that can be evicted."""
        return len(self.free_block_ids) + self.num_cached_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.evictable) + len(self.retention)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by requests (ref_cnt > 0)."""
        return self.num_blocks - self.num_free_blocks

    # --- allocation ----------------------------------------------------------------------------------
    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        assert self.can_allocate(num_blocks), f"asked for {num_blocks} blocks, {self.num_free_blocks} available"
        block_ids = []
        for _ in range(num_blocks):
            block = self.blocks[self.free_block_ids.popleft()] if self.free_block_ids else self._evict()
            block.ref_cnt = 1
            block.last_access = next(self._tick)
            block_ids.append(block.block_id)
        return block_ids

    def hold(self, block_ids: Sequence[int]) -> None:
        """A request reuses these blocks: take a reference to each (a cached one stops being evictable)."""
        tick = next(self._tick)
        for block_id in block_ids:
            assert block_id != NULL_BLOCK, "the null block is never held"
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                self._uncache(block)
            block.ref_cnt += 1
            block.num_hits += 1
            block.last_access = tick

    def free(self, block_ids: Sequence[int], release: Release | None = None) -> None:
        """Release one reference to each block. `release`: the request whose end this is, told to the policy with
        each block it leaves evictable."""
        # Released tail first, so under LRU a sequence's last blocks are evicted before its first ones
        # (a prefix is only usable up to its first missing block).
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"double free of block {block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt > 0:
                continue
            block.last_access = next(self._tick)
            if block.block_key is None:
                self.free_block_ids.append(block_id)
            elif block.group and block.parent_uid not in self.uid_to_block:  # its anchor went while it was held
                self.free_block_ids.append(self._drop(block).block_id)
            elif self.retention.retains(block):
                self.retention.add(block)
            else:
                self.evictable.add(block, release)
        while self.num_cached_blocks > self.max_cached_blocks:
            self.free_block_ids.append(self._evict().block_id)

    def _uncache(self, block: KVCacheBlock) -> None:
        """Take an unreferenced cached block out of the retained blocks or the policy."""
        if block in self.retention:
            self.retention.remove(block)
        else:
            self.evictable.remove(block)

    def _evict(self, count: bool = True) -> KVCacheBlock:
        if len(self.evictable):
            return self._drop(self.evictable.pop(), count)
        return self._drop(self.retention.pop(), count)

    # --- sessions (retention.py) ---------------------------------------------------------------------
    def can_retain(self, hint: SessionHint, block_ids: Sequence[int]) -> bool:
        return self.retention.can_retain(hint, self._published_uids(block_ids))

    def retain(self, hint: SessionHint, block_ids: Sequence[int], release: Release | None, now: float) -> None:
        """Retain the published ones of `block_ids` (held by the session's ending request) for the session."""
        self._to_policy(self.retention.retain(hint, self._published_uids(block_ids), release, now))

    def end_retention(self, key: bytes) -> None:
        self._to_policy(self.retention.end(key))

    def expire_retentions(self, now: float) -> None:
        self._to_policy(self.retention.expire(now))

    def _published_uids(self, block_ids: Sequence[int]) -> list[int]:
        return [self.blocks[b].uid for b in block_ids if self.blocks[b].uid is not None]

    def _to_policy(self, uids: Sequence[int]) -> None:
        """Blocks no session retains any more: the unreferenced ones go to the policy."""
        for uid in uids:
            release = self.retention.release_of(uid)
            block = self.uid_to_block.get(uid)
            if block is not None and block in self.retention:
                self.retention.remove(block)
                self.evictable.add(block, release)

    def _drop(self, block: KVCacheBlock, count: bool = True) -> KVCacheBlock:
        """Unpublish an unreferenced cached block (already out of `evictable`), and free the unreferenced window
        blocks found through it."""
        del self.key_to_block[block.block_key]
        del self.uid_to_block[block.uid]
        self.retention.forget(block.uid)
        for listener in self.on_evict:
            listener(block)
        if block.group:
            anchored = self.windows_of[block.parent_uid]
            anchored.discard(block.block_id)
            if not anchored:
                del self.windows_of[block.parent_uid]
        uid = block.uid
        block.reset()
        self.num_evictions += count
        for window_id in sorted(self.windows_of.get(uid, ())):  # a held one goes when it is freed
            window = self.blocks[window_id]
            if window.ref_cnt == 0:
                self._uncache(window)
                self.free_block_ids.append(self._drop(window, count).block_id)
        return block

    # --- the cache index -----------------------------------------------------------------------------
    def lookup(self, key: bytes, token_ids: Sequence[int], parent_uid: int | None) -> KVCacheBlock | None:
        """The cached block for `key`, confirmed by its tokens and its predecessor's uid (None: it is a
        first block), else None."""
        block = self.key_to_block.get(key)
        if block is None or block.parent_uid != parent_uid or block.token_ids != tuple(token_ids):
            return None
        return block

    def register(self, block_id: int, key: bytes, token_ids: Sequence[int], parent_uid: int | None,
                 position: int = 0, extra_key: bytes = b"", group: int = 0) -> int | None:
        """Publish an exactly computed block under `key`. Returns its uid, or None if the key is already
        taken (the same block computed twice concurrently, or a hash collision): it stays private. A block of a
        sliding-window group (`group` > 0) names as its parent the full-attention block of the same position."""
        block = self.blocks[block_id]
        assert block.ref_cnt > 0 and block.block_key is None, f"block {block_id} cannot be registered"
        taken = self.key_to_block.get(key)
        if taken is not None and self._is_orphan(taken) and taken.ref_cnt == 0:
            # No lookup reaches it (its predecessor was evicted), yet it would keep this chain private from here on.
            self._uncache(taken)
            self.free_block_ids.append(self._drop(taken).block_id)
        elif taken is not None:
            return None
        block.block_key, block.token_ids, block.parent_uid = key, tuple(token_ids), parent_uid
        block.position, block.extra_key, block.group = position, extra_key, group
        block.uid = next(self._uids)
        self.uid_to_block[block.uid] = block
        if group:
            self.windows_of.setdefault(parent_uid, set()).add(block_id)
        block.num_hits = 1
        self.key_to_block[key] = block
        self.evictable.publish(block, None if parent_uid is None else self.uid_to_block.get(parent_uid))
        for listener in self.on_register:
            listener(block)
        return block.uid

    def _is_orphan(self, block: KVCacheBlock) -> bool:
        """Published after a predecessor that is no longer published (a twin's, evicted since)."""
        return block.parent_uid is not None and block.parent_uid not in self.uid_to_block

    def reset_cache(self) -> int:
        """Drop every cached block nobody holds; returns how many."""
        dropped = self.num_cached_blocks
        while self.num_cached_blocks:
            self.free_block_ids.append(self._evict(count=False).block_id)
        return dropped

    def check_integrity(self) -> None:
        free = Counter(self.free_block_ids)
        assert all(c == 1 for c in free.values()), "a block is in the free list twice"
        self._check_null_block(free)
        in_use = cached = 0
        for block in self.blocks[NULL_BLOCK + 1:]:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            is_free, is_cached, is_retained = block.block_id in free, block in self.evictable, block in self.retention
            assert not (is_cached and is_retained), f"block {block.block_id} is both in the policy and retained"
            is_cached |= is_retained
            assert not (is_free and is_cached), f"block {block.block_id} is both free and cached"
            if block.ref_cnt > 0:
                assert not is_free and not is_cached, f"block {block.block_id} is in use and evictable"
                in_use += 1
            elif block.block_key is None:
                assert is_free, f"unreferenced block {block.block_id} without a key is not free"
            else:
                assert is_cached, f"unreferenced block {block.block_id} with a key is not evictable"
                cached += 1
            if block.block_key is not None:
                assert self.key_to_block.get(block.block_key) is block, f"block {block.block_id} key not indexed"
        assert in_use + cached + len(free) == self.num_blocks, "free + cached + in use != total"
        assert len(self.key_to_block) == sum(b.block_key is not None for b in self.blocks), "stale keys in index"
        assert len(self.uid_to_block) == len(self.key_to_block), "published uids and keys differ"
        assert all(self.uid_to_block[b.uid] is b for b in self.key_to_block.values()), "uid index is stale"
        windows = {(b.parent_uid, b.block_id) for b in self.key_to_block.values() if b.group}
        assert windows == {(uid, i) for uid, ids in self.windows_of.items() for i in ids}, "window index is stale"
        assert all(self.blocks[i].ref_cnt > 0 for uid, ids in self.windows_of.items() if uid not in self.uid_to_block
                   for i in ids), "a cached window block outlived the block it is found through"
        assert self.num_cached_blocks <= self.max_cached_blocks, "more cached blocks than max_cached_blocks"
        self.evictable.check_integrity()
        self.retention.check_integrity()

    def _check_null_block(self, free: Counter) -> None:
        null = self.blocks[NULL_BLOCK]
        assert NULL_BLOCK not in free, "the null block is in the free list"
        assert null.ref_cnt == 0 and null.num_hits == 0, f"the null block is held (ref_cnt {null.ref_cnt})"
        assert null.block_key is None and null.uid is None, "the null block is published"
        assert null not in self.evictable and null not in self.retention, \
            "the null block is cached"
