"""The sliding-window groups of a grouped layout (kvcache/layout.py), for the KVCacheManager: each request's window
tables beside its full-attention `block_table`, the window a prefix hit needs, and what becomes of the blocks a
window has passed. The manager calls these at the points it handles group 0 (match, admit, update, fork, free,
check_integrity); the tables are as long as group 0's, the null block (block.NULL_BLOCK) before the window (from
`window_starts[g]` on every block is held).

A window block is published under its position's chain key tagged with its group, after the full-attention block of
its position (its `parent_uid`), so it is only ever found through that block's identity, and goes when it goes
(BlockPool.windows_of)."""

from __future__ import annotations

from collections.abc import Callable

from kvreuse.kvcache.block import NULL_BLOCK
from kvreuse.kvcache.block_pool import BlockPool
from kvreuse.kvcache.layout import first_window_block
from kvreuse.kvcache.match import Match
from kvreuse.kvcache.request import CacheRequest

BlockKey = Callable[[CacheRequest, int], bytes]  # the chain key of a request's full block i (KVCacheManager._key)


class WindowGroups:
    def __init__(self, pool: BlockPool, windows: list[int], block_size: int, key: BlockKey):
        self.pool, self.windows, self.block_size, self.key = pool, windows, block_size, key

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def first_block(self, num_computed_tokens: int) -> int:
        """The first block any group's next token reads (where windows differ, the widest one's)."""
        return min(first_window_block(num_computed_tokens, w, self.block_size) for w in self.windows)

    def _key(self, req: CacheRequest, index: int, group: int) -> bytes:
        return self.key(req, index) + bytes([group])

    # --- matching ------------------------------------------------------------------------------------
    def run(self, req: CacheRequest, hits: list[int], need: int) -> tuple[list[int], tuple[tuple[int, ...], ...]]:
        """The longest leading part of `hits` (group 0's prefix hits) whose every window group holds the blocks its
        window reads before the hit's end, with those blocks per group; ([], ()) if shorter than `need` blocks. Each
        position is looked up once, from the end backwards: a missing window block at i cuts the hit to i blocks."""
        found: dict[int, list[int]] = {}
        n, i = len(hits), len(hits) - 1
        while n >= need and i >= self.first_block(n * self.block_size):
            blocks = self.blocks_at(req, i, self.pool.blocks[hits[i]].uid)
            if blocks is None:
                n = i
            else:
                found[i] = blocks
            i -= 1
        if n < need:
            return [], ()
        first = self.first_block(n * self.block_size)
        return hits[:n], tuple(tuple(found[i][g] for i in range(first, n)) for g in range(self.num_groups))

    def blocks_at(self, req: CacheRequest, index: int, anchor_uid: int | None) -> list[int] | None:
        """Block `index` of every window group, as the pool holds it after the full-attention block `anchor_uid`, or
        None if a group lacks it."""
        bs, blocks = self.block_size, []
        for g in range(1, self.num_groups + 1):
            block = self.pool.lookup(self._key(req, index, g), req.token_ids[index * bs:(index + 1) * bs], anchor_uid)
            if block is None:
                return None
            blocks.append(block.block_id)
        return blocks

    # --- admission, growth and fork ------------------------------------------------------------------
    def admit(self, req: CacheRequest, match: Match) -> None:
        """Window tables for a request admitted with `match`: the null block before the window, the hits' window
        blocks held. (The manager then grows every table alike.)"""
        first = len(match.hits) - (len(match.windows[0]) if match.windows else 0)
        req.window_tables = [[NULL_BLOCK] * first + list(w) for w in match.windows or [()] * self.num_groups]
        for table in req.window_tables:
            self.pool.hold(table[first:])
        req.window_starts = [first] * self.num_groups
        req.num_window_published = len(match.hits)

    def fork(self, parent: CacheRequest, child: CacheRequest, num_full: int) -> None:
        """The child's empty window tables and its parent's window state for its first `num_full` blocks (the manager
        then shares and copies every table alike)."""
        child.window_tables = [[] for _ in self.windows]
        child.window_starts = list(parent.window_starts)
        child.num_window_published = min(parent.num_window_published, num_full)

    # --- after a forward -----------------------------------------------------------------------------
    def publish(self, req: CacheRequest) -> None:
        """Register each window group's block at every position whose full-attention block got published since."""
        bs = self.block_size
        for i in range(req.num_window_published, len(req.block_uids)):
            anchor_uid = req.block_uids[i]
            if anchor_uid is None:
                continue  # a private full-attention block: its window blocks stay private too
            token_ids = req.token_ids[i * bs:(i + 1) * bs]
            for g, table in enumerate(req.window_tables, start=1):
                block_id, key = table[i], self._key(req, i, g)
                if block_id != NULL_BLOCK and self.pool.blocks[block_id].uid is None and \
                        self.pool.lookup(key, token_ids, anchor_uid) is None:
                    self.pool.register(block_id, key, token_ids, anchor_uid, i * bs, req.extra_key, group=g)
        req.num_window_published = len(req.block_uids)

    def release(self, req: CacheRequest, num_computed_tokens: int) -> None:
        """Let go of the window blocks that neither a later token of `req` nor a hit at its last two block boundaries
        reads (a prompt that diverges inside the last block of this one hits at the boundary before). Those a hit at
        the last two boundaries before the prompt's end reads are cached like any block (an edited last message, a
        retry); the others go through `let_go_passed`."""
        bs = self.block_size
        kept_boundary = max(0, (num_computed_tokens // bs - 1) * bs)
        prompt_end = req.num_prompt_tokens // bs
        for g, (table, window) in enumerate(zip(req.window_tables, self.windows, strict=True)):
            first, start = min(first_window_block(kept_boundary, window, bs), len(table)), req.window_starts[g]
            if first <= start:
                continue
            checkpoint = range(first_window_block(max(0, prompt_end - 1) * bs, window, bs), prompt_end)
            self.pool.free([table[i] for i in range(start, first) if i in checkpoint])
            self.let_go_passed([table[i] for i in range(start, first) if i not in checkpoint])
            table[start:first] = [NULL_BLOCK] * (first - start)
            req.window_starts[g] = first

    def let_go_passed(self, block_ids: list[int]) -> None:
        """Let go of window blocks no later token of their request reads: cached like any block, under the pool's
        eviction policy (`kvreuse bench windows` measured that at or above the alternatives it replaces this with, on
        every scenario: bench/passed_windows.py)."""
        self.pool.free(block_ids)

    def release_order(self, req: CacheRequest) -> list[int]:
        """Every block `req` holds, in the order to free them: position by position, each window group's block after
        the full-attention one it is found through. So LRU evicts tail first and a position's window blocks before
        their anchor: a shorter hit stays whole."""
        starts = [0, *req.window_starts] if req.window_tables else [0]
        order = []
        for i in range(max(map(len, req.block_tables))):  # (a failed step may leave the tables uneven)
            order += [t[i] for t, start in zip(req.block_tables, starts, strict=True) if start <= i < len(t)]
        return order

    def check(self, req: CacheRequest) -> list[int]:
        """Assert `req`'s window tables match its full-attention table; the window blocks it holds."""
        assert len(req.window_tables) == self.num_groups == len(req.window_starts), "window tables missing"
        held = []
        for g, (table, start) in enumerate(zip(req.window_tables, req.window_starts, strict=True), start=1):
            assert len(table) == len(req.block_table), f"window group {g}'s table is not as long as group 0's"
            assert all(b == NULL_BLOCK for b in table[:start]), f"window group {g} holds a block before its window"
            assert NULL_BLOCK not in table[start:], f"window group {g} released a block inside its window"
            for i, block_id in enumerate(table[start:], start=start):
                block = self.pool.blocks[block_id]
                assert block.block_key is None or (block.group == g and block.position == i * self.block_size), \
                    f"window group {g}'s block {block_id} was published for another group or place"
            held += table[start:]
        return held
