"""The full-attention group (group 0 of every layout, the only one of a layout without sliding windows): every block of
a sequence is read by every later token, so it is held for the whole sequence, and its published blocks form the
prefix chain every hit starts from (each found after the one before it)."""

from __future__ import annotations

from collections.abc import Callable

from kvreuse.kvcache.block_pool import BlockPool
from kvreuse.kvcache.request import CacheRequest

BlockKey = Callable[[CacheRequest, int], bytes]  # the chain key of a request's full block i (KVCacheManager._key)


class FullAttentionGroup:
    group = 0

    def __init__(self, pool: BlockPool, block_size: int, key: BlockKey):
        self.pool, self.block_size, self.key = pool, block_size, key

    def table(self, req: CacheRequest) -> list[int]:
        return req.tables.block_table

    def first_block(self, num_computed_tokens: int) -> int:
        return 0

    def block_at(self, req: CacheRequest, index: int, anchor_uid: int | None) -> int | None:
        bs = self.block_size
        block = self.pool.lookup(self.key(req, index), req.token_ids[index * bs:(index + 1) * bs], anchor_uid)
        return None if block is None else block.block_id

    def find_hit(self, req: CacheRequest, max_blocks: int) -> list[int]:
        """Block ids of the leading run of `req`'s first `max_blocks` full blocks that the pool holds."""
        hits: list[int] = []
        parent_uid = None
        for i in range(max_blocks):
            block_id = self.block_at(req, i, parent_uid)
            if block_id is None:
                break
            hits.append(block_id)
            parent_uid = self.pool.blocks[block_id].uid
        return hits

    def publish(self, req: CacheRequest, num_computed_tokens: int) -> list[int]:
        """Register the exact full blocks of `req` (of its first `num_computed_tokens`) not yet registered, extending
        `req.tables.block_uids`; the indexes of those that got a new identity (not a twin's), which the lower tiers
        lack."""
        bs, new = self.block_size, []
        for i in range(len(req.tables.block_uids), req.tables.num_publishable_tokens(num_computed_tokens) // bs):
            parent_uid = req.tables.block_uids[i - 1] if i else None
            if i and parent_uid is None:
                req.tables.block_uids.append(None)  # the chain is broken before this block: it stays private
                continue
            block_id, key, token_ids = req.tables.block_table[i], self.key(req, i), req.token_ids[i * bs:(i + 1) * bs]
            uid = self.pool.blocks[block_id].uid
            if uid is None:
                # Computed here while an identical block got cached (a concurrent twin): same contents,
                # same identity, so the chain continues through it.
                twin = self.pool.lookup(key, token_ids, parent_uid)
                uid = twin.uid if twin else self.pool.register(block_id, key, token_ids, parent_uid, i * bs,
                                                               req.extra_key)
                if twin is None and uid is not None:
                    new.append(i)
            req.tables.block_uids.append(uid)
        return new

    def release_passed(self, req: CacheRequest, num_computed_tokens: int) -> None:
        """Nothing passes: every later token reads every block."""

    def held(self, req: CacheRequest) -> list[int]:
        return list(req.tables.block_table)
