"""S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO and a ghost list, scan-resistant.

A block new to the cache enters the small queue (10% of the blocks tracked), or the main queue if its key is in the
ghost list (it was evicted from the small queue not long ago). Each hit adds one to its frequency. Leaving the small
queue, a block that was hit moves to the main queue, else it is evicted and its key is remembered in the ghost list
(as many keys as the main queue holds). The main queue is a clock with a 2-bit counter: a block that was hit goes
round again with one less. As libCacheSim's S3FIFO.c does, the main queue is evicted from while it holds more than
90% of the blocks tracked.

The pool keeps held blocks out of the policy, but a queue keeps its place across a hold: a held block reaching the
end of a queue is being used, so it counts as hit.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from kvreuse.kvcache.block import KVCacheBlock
from kvreuse.kvcache.eviction.policy import Release

SMALL_SHARE = 0.1
MAX_FREQ = 3


@dataclass
class _Entry:
    uid: int
    in_small: bool
    freq: int       # hits since it entered its queue (or went round the main queue), capped at MAX_FREQ
    num_hits: int   # the block's num_hits when last seen, so hits taken while it was held count too


class S3FIFOPolicy:
    name = "s3fifo"

    def __init__(self):
        self._small: deque[tuple[KVCacheBlock, int]] = deque()  # (block, uid), oldest first; may hold dead slots
        self._main: deque[tuple[KVCacheBlock, int]] = deque()
        self._entries: dict[int, _Entry] = {}  # block id -> its entry, for the blocks in a queue (held or evictable)
        self._num_small = self._num_main = 0   # live entries in each queue
        self._evictable: set[int] = set()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()

    def publish(self, block: KVCacheBlock, parent: KVCacheBlock | None) -> None:
        self._forget(block.block_id)  # its old contents left the cache without being popped (an orphan's drop)

    def _forget(self, block_id: int) -> None:
        entry = self._entries.pop(block_id, None)
        if entry is not None and entry.in_small:
            self._num_small -= 1
        elif entry is not None:
            self._num_main -= 1

    def add(self, block: KVCacheBlock, release: Release | None = None) -> None:
        entry = self._entries.get(block.block_id)
        if entry is None or entry.uid != block.uid:  # contents new to the policy
            self._forget(block.block_id)
            in_small = self._ghost.pop(block.block_key, False) is False
            self._entries[block.block_id] = _Entry(block.uid, in_small, 0, block.num_hits)
            (self._small if in_small else self._main).append((block, block.uid))
            self._num_small += in_small
            self._num_main += not in_small
        else:
            self._sync(block, entry)
        self._evictable.add(block.block_id)

    def remove(self, block: KVCacheBlock) -> None:
        self._evictable.remove(block.block_id)

    def pop(self) -> KVCacheBlock:
        if not self._evictable:
            raise IndexError("pop from an empty S3-FIFO policy")
        # Held blocks stay in the main queue and come round again: once main has gone round with nothing to evict
        # (every entry's frequency spent), the victim is in the small queue, whatever the share says.
        misses, limit = 0, (MAX_FREQ + 1) * (len(self._main) + 1)
        while True:
            tracked = self._num_small + self._num_main
            from_main = self._num_main > (1 - SMALL_SHARE) * tracked and misses < limit or not self._num_small
            victim = self._step_main() if from_main else self._step_small()
            misses += from_main and victim is None
            if victim is not None:
                self._evictable.remove(victim.block_id)
                del self._entries[victim.block_id]
                return victim

    def _live_entry(self, block: KVCacheBlock, uid: int) -> _Entry | None:
        """The entry a queue slot stands for, or None if its contents are gone (forgotten now if not yet)."""
        entry = self._entries.get(block.block_id)
        if entry is None or entry.uid != uid:
            return None
        if block.uid != uid:
            self._forget(block.block_id)
            return None
        return entry

    def _step_small(self) -> KVCacheBlock | None:
        block, uid = self._small.popleft()
        entry = self._live_entry(block, uid)
        if entry is None:
            return None
        self._sync(block, entry)
        self._num_small -= 1
        if entry.freq > 0 or block.block_id not in self._evictable:
            entry.in_small, entry.freq = False, 0
            self._main.append((block, uid))
            self._num_main += 1
            return None
        self._ghost[block.block_key] = None
        while len(self._ghost) > max(1, self._num_main):
            self._ghost.popitem(last=False)
        return block

    def _step_main(self) -> KVCacheBlock | None:
        block, uid = self._main.popleft()
        entry = self._live_entry(block, uid)
        if entry is None:
            return None
        self._sync(block, entry)
        if entry.freq > 0 or block.block_id not in self._evictable:
            entry.freq = max(0, entry.freq - 1)
            self._main.append((block, uid))
            return None
        self._num_main -= 1
        return block

    @staticmethod
    def _sync(block: KVCacheBlock, entry: _Entry) -> None:
        """Count the hits taken since the policy last looked (while the block was held, too)."""
        entry.freq = min(MAX_FREQ, entry.freq + block.num_hits - entry.num_hits)
        entry.num_hits = block.num_hits

    def __len__(self) -> int:
        return len(self._evictable)

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.block_id in self._evictable

    def check_integrity(self) -> None:
        assert self._evictable <= set(self._entries), "an evictable block is in no S3-FIFO queue"
        queued = {(b.block_id, uid, True) for b, uid in self._small}
        queued |= {(b.block_id, uid, False) for b, uid in self._main}
        for block_id, entry in self._entries.items():
            assert (block_id, entry.uid, entry.in_small) in queued, f"block {block_id} is not in its S3-FIFO queue"
            assert 0 <= entry.freq <= MAX_FREQ, f"block {block_id} has frequency {entry.freq}"
        small = sum(e.in_small for e in self._entries.values())
        assert (self._num_small, self._num_main) == (small, len(self._entries) - small), "S3-FIFO queue counts drift"
