"""`chain`: eviction that knows prefix chains. Blocks of chains that came back are kept longer than blocks of a
prompt seen once.

A generic cache sees a block hit or not; a prefix cache also sees the chain a block continues. A block is *proven*
when its chain has come back: it was hit; or it continues one, computed by a request that hit the blocks before it
up to where an earlier prompt ended (the next turn of a conversation, whose new tail is as likely to come back as
the rest; a request branching off inside a shared prefix, such as a new conversation under a common system prompt,
is not one); or its key is in the ghost list of recently evicted keys (computed again after its eviction: its chain
came back too late). Other blocks are on probation: a prompt seen once, the prompt that most often never comes back.
Each class is kept in LRU order (tail first, as the pool frees); the victim is the older of the two classes' oldest
blocks, a proven block's age counted PROVEN_WEIGHT times slower. The ghost list holds as many keys as the most
blocks the policy has held at once.
"""

from __future__ import annotations

from collections import OrderedDict

from kvreuse.kvcache.block import KVCacheBlock
from kvreuse.kvcache.eviction.policy import Release

PROVEN_WEIGHT = 8


class ChainPolicy:
    name = "chain"

    def __init__(self, proven_weight: float = PROVEN_WEIGHT):
        self.proven_weight = proven_weight
        self._probation: OrderedDict[int, KVCacheBlock] = OrderedDict()  # block id -> block, oldest first
        self._proven: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self._since: dict[int, int] = {}            # block id -> tick at which it became evictable
        self._proven_uids: dict[int, int] = {}      # block id -> uid of its contents, if proven when published
        self._children: dict[int, tuple[int, int]] = {}   # block id -> (its uid, how many published children it has)
        self._parent_of: dict[int, tuple[int, int]] = {}  # block id -> (its parent's block id, the parent's uid)
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._ghost_size = 1
        self._tick = 0

    def is_proven(self, block: KVCacheBlock) -> bool:
        """Hit at least once, or proven when published."""
        return block.num_hits > 1 or self._proven_uids.get(block.block_id) == block.uid

    def _num_children(self, block: KVCacheBlock) -> int:
        uid, count = self._children.get(block.block_id, (None, 0))
        return count if uid == block.uid else 0

    def _continues(self, parent: KVCacheBlock | None) -> bool:
        """A block published after `parent` continues a chain that came back: its parent was computed by the same
        request (num_hits 1) and is proven, or was hit where an earlier prompt ended (it has no children)."""
        if parent is None:
            return False
        if parent.num_hits == 1:
            return self._proven_uids.get(parent.block_id) == parent.uid
        return self._num_children(parent) == 0

    def publish(self, block: KVCacheBlock, parent: KVCacheBlock | None) -> None:
        self._unlink(block.block_id)  # its old contents, if they left the cache unseen (an orphan's drop)
        came_back = self._ghost.pop(block.block_key, False) is None
        if came_back or self._continues(parent):
            self._proven_uids[block.block_id] = block.uid
        else:
            self._proven_uids.pop(block.block_id, None)
        if parent is not None:
            self._children[parent.block_id] = (parent.uid, self._num_children(parent) + 1)
            self._parent_of[block.block_id] = (parent.block_id, parent.uid)

    def _unlink(self, block_id: int) -> None:
        """Its contents are gone: one child fewer for their parent."""
        parent_id, parent_uid = self._parent_of.pop(block_id, (None, None))
        uid, count = self._children.get(parent_id, (None, 0))
        if parent_id is not None and uid == parent_uid:
            self._children[parent_id] = (uid, count - 1)

    def add(self, block: KVCacheBlock, release: Release | None = None) -> None:
        self._tick += 1
        self._since[block.block_id] = self._tick
        (self._proven if self.is_proven(block) else self._probation)[block.block_id] = block
        self._ghost_size = max(self._ghost_size, len(self._since))

    def remove(self, block: KVCacheBlock) -> None:
        del self._since[block.block_id]
        if self._probation.pop(block.block_id, None) is None:
            del self._proven[block.block_id]

    def pop(self) -> KVCacheBlock:
        queue = self._probation if self._probation_goes_first() else self._proven
        block_id, block = queue.popitem(last=False)
        del self._since[block_id]
        self._proven_uids.pop(block_id, None)
        self._unlink(block_id)
        self._ghost[block.block_key] = None
        while len(self._ghost) > self._ghost_size:
            self._ghost.popitem(last=False)
        return block

    def _probation_goes_first(self) -> bool:
        if not self._proven or not self._probation:
            return bool(self._probation)
        probation_age = self._tick - self._since[next(iter(self._probation))]
        proven_age = self._tick - self._since[next(iter(self._proven))]
        return probation_age * self.proven_weight >= proven_age

    def __len__(self) -> int:
        return len(self._since)

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.block_id in self._since

    def check_integrity(self) -> None:
        assert not self._probation.keys() & self._proven.keys(), "a block is both on probation and proven"
        assert self._since.keys() == self._probation.keys() | self._proven.keys(), "chain queues and ticks differ"
        for queue in (self._probation, self._proven):
            ticks = [self._since[i] for i in queue]
            assert ticks == sorted(ticks), "a chain queue is out of LRU order"
        assert all(count >= 0 for _, count in self._children.values()), "a negative child count"
        assert len(self._ghost) <= self._ghost_size, "the ghost list outgrew the cache"
