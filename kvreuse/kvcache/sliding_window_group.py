"""One sliding-window group of a grouped layout (kvcache/layout.py): its table per request beside the full-attention
`block_table` (`req.tables.window_tables[group - 1]`, as long as group 0's, the null block (block.NULL_BLOCK) before
the window: from `req.tables.window_starts[group - 1]` on every block is held), the blocks a hit needs in it, and what
becomes of the blocks its window has passed.

A window block is published under its position's chain key tagged with its group, after the full-attention block of
its position (its `parent_uid`), so it is only ever found through that block's identity, and goes when it goes
(BlockPool.windows_of)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvreuse.kvcache.block import NULL_BLOCK
from kvreuse.kvcache.block_pool import BlockPool
from kvreuse.kvcache.layout import first_window_block
from kvreuse.kvcache.request import CacheRequest

BlockKey = Callable[[CacheRequest, int], bytes]  # the chain key of a request's full block i (KVCacheManager._key)


class SlidingWindowGroup:
    def __init__(self, pool: BlockPool, group: int, window: int, block_size: int, key: BlockKey):
        assert group > 0, "group 0 is the full-attention group"
        self.pool, self.group, self.window, self.block_size, self.key = pool, group, window, block_size, key

    def table(self, req: CacheRequest) -> list[int]:
        return req.tables.window_tables[self.group - 1]

    def first_block(self, num_computed_tokens: int) -> int:
        return first_window_block(num_computed_tokens, self.window, self.block_size)

    def _key(self, req: CacheRequest, index: int) -> bytes:
        return self.key(req, index) + bytes([self.group])

    def block_at(self, req: CacheRequest, index: int, anchor_uid: int | None) -> int | None:
        bs = self.block_size
        block = self.pool.lookup(self._key(req, index), req.token_ids[index * bs:(index + 1) * bs], anchor_uid)
        return None if block is None else block.block_id

    # --- admission and fork --------------------------------------------------------------------------
    def admit(self, req: CacheRequest, first: int, blocks: Sequence[int]) -> None:
        """The table of a request admitted with a hit whose blocks in this group are `blocks`, from block `first` on:
        the null block before them, they held. (The manager then grows every table alike.)"""
        table = [NULL_BLOCK] * first + list(blocks)
        self.pool.hold(table[first:])
        req.tables.window_tables.append(table)
        req.tables.window_starts.append(first)

    def fork(self, parent: CacheRequest, child: CacheRequest) -> None:
        """The child's empty table, its window starting where its parent's does (the manager then shares and copies
        every table alike)."""
        child.tables.window_tables.append([])
        child.tables.window_starts.append(parent.tables.window_starts[self.group - 1])

    # --- after a forward -----------------------------------------------------------------------------
    def publish_block(self, req: CacheRequest, index: int, anchor_uid: int) -> None:
        """Register this group's block `index` of `req` after the published full-attention block `anchor_uid`, unless
        the window has passed it, it is published already, or the pool holds the same block."""
        bs, block_id = self.block_size, self.table(req)[index]
        key, token_ids = self._key(req, index), req.token_ids[index * bs:(index + 1) * bs]
        if block_id != NULL_BLOCK and self.pool.blocks[block_id].uid is None and \
                self.pool.lookup(key, token_ids, anchor_uid) is None:
            self.pool.register(block_id, key, token_ids, anchor_uid, index * bs, req.extra_key, group=self.group)

    def release_passed(self, req: CacheRequest, num_computed_tokens: int) -> None:
        """Let go of the blocks that neither a later token of `req` nor a hit at its last two block boundaries reads
        (a prompt that diverges inside the last block of this one hits at the boundary before). Those a hit at the
        last two boundaries before the prompt's end reads are cached like any block (an edited last message, a
        retry); the others go through `let_go_passed`."""
        bs, table, g = self.block_size, self.table(req), self.group - 1
        kept_boundary = max(0, (num_computed_tokens // bs - 1) * bs)
        prompt_end = req.num_prompt_tokens // bs
        first, start = min(self.first_block(kept_boundary), len(table)), req.tables.window_starts[g]
        if first <= start:
            return
        checkpoint = range(self.first_block(max(0, prompt_end - 1) * bs), prompt_end)
        self.pool.free([table[i] for i in range(start, first) if i in checkpoint])
        self.let_go_passed([table[i] for i in range(start, first) if i not in checkpoint])
        table[start:first] = [NULL_BLOCK] * (first - start)
        req.tables.window_starts[g] = first

    def let_go_passed(self, block_ids: list[int]) -> None:
        """Let go of window blocks no later token of their request reads: cached like any block, under the pool's
        eviction policy (`kvreuse bench windows` measured that at or above the alternatives it replaces this with, on
        every scenario: bench/passed_windows.py)."""
        self.pool.free(block_ids)

    def held(self, req: CacheRequest) -> list[int]:
        """Assert `req`'s published blocks in this group were published for it and their place (its table's shape is
        BlockTables.check_integrity's); the blocks it holds here."""
        g, table = self.group, self.table(req)
        start = req.tables.window_starts[g - 1]
        for i, block_id in enumerate(table[start:], start=start):
            block = self.pool.blocks[block_id]
            assert block.block_key is None or (block.group == g and block.position == i * self.block_size), \
                f"window group {g}'s block {block_id} was published for another group or place"
        return table[start:]
