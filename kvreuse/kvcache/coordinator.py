"""The layer groups of a layout (kvcache/layout.py) as the KVCacheManager sees them: one GroupCache per group
(group_cache.py: the full-attention group, then each sliding-window group), combined as vLLM v1's
KVCacheCoordinator combines its single-type managers. A hit is the full-attention group's prefix run, cut to where
every window group holds the blocks its window reads before the hit's end. A layout of one group is the plain case:
no window group, so nothing cuts a hit and each request has one table.

Every table is as long as group 0's. Window blocks are handled position by position, each after the full-attention
block of its position: published in that order, freed in that order (so LRU evicts a position's window blocks before
the block they are found through, and a shorter hit stays whole)."""

from __future__ import annotations

from kvreuse.kvcache.block_pool import BlockPool
from kvreuse.kvcache.full_attention_group import BlockKey, FullAttentionGroup
from kvreuse.kvcache.group_cache import GroupCache
from kvreuse.kvcache.layout import KVLayout
from kvreuse.kvcache.match import Match
from kvreuse.kvcache.request import CacheRequest
from kvreuse.kvcache.sliding_window_group import SlidingWindowGroup

Windows = tuple[tuple[int, ...], ...]  # per window group, its blocks from a hit's first window block to its end


class KVCacheCoordinator:
    def __init__(self, pool: BlockPool, layout: KVLayout, block_size: int, key: BlockKey):
        self.pool, self.block_size = pool, block_size
        self.full = FullAttentionGroup(pool, block_size, key)
        self.windows = [SlidingWindowGroup(pool, g, group.window, block_size, key)
                        for g, group in enumerate(layout.groups) if g]

    @property
    def groups(self) -> list[GroupCache]:
        return [self.full, *self.windows]

    def first_window_block(self, num_tokens: int) -> int:
        """The first block any window group's token at `num_tokens` reads (the widest window's); without window
        groups, the block after the last full one: no hit needs window blocks."""
        return min((w.first_block(num_tokens) for w in self.windows), default=num_tokens // self.block_size)

    # --- matching ------------------------------------------------------------------------------------
    def blocks_at(self, req: CacheRequest, index: int, anchor_uid: int | None) -> list[int] | None:
        """Block `index` of every window group, as the pool holds it after the full-attention block `anchor_uid`, or
        None if a group lacks it."""
        blocks = []
        for group in self.windows:
            block_id = group.block_at(req, index, anchor_uid)
            if block_id is None:
                return None
            blocks.append(block_id)
        return blocks

    def windows_before(self, req: CacheRequest, hits: list[int], num_blocks: int) -> Windows | None:
        """The window blocks among `hits` that a hit of `num_blocks` blocks (the hits, then blocks loaded from a lower
        tier, which bring their own) reads, per window group; None if the pool lacks one."""
        first = min(self.first_window_block(num_blocks * self.block_size), len(hits))
        found = [self.blocks_at(req, i, self.pool.blocks[hits[i]].uid) for i in range(first, len(hits))]
        if None in found:
            return None
        return tuple(tuple(blocks[g] for blocks in found) for g in range(len(self.windows)))

    def find_hit(self, req: CacheRequest, hits: list[int], need: int) -> tuple[list[int], Windows]:
        """The longest leading part of `hits` (the full-attention group's prefix hits) whose every window group holds
        the blocks its window reads before the hit's end, with those blocks per group; ([], ()) if shorter than `need`
        blocks. Each position is looked up once, from the end backwards: a missing window block at i cuts the hit to i
        blocks."""
        found: dict[int, list[int]] = {}
        n, i = len(hits), len(hits) - 1
        while n >= need and i >= self.first_window_block(n * self.block_size):
            blocks = self.blocks_at(req, i, self.pool.blocks[hits[i]].uid)
            if blocks is None:
                n = i
            else:
                found[i] = blocks
            i -= 1
        if n < need:
            return [], ()
        first = self.first_window_block(n * self.block_size)
        return hits[:n], tuple(tuple(found[i][g] for i in range(first, n)) for g in range(len(self.windows)))

    # --- admission and fork --------------------------------------------------------------------------
    def admit(self, req: CacheRequest, match: Match) -> None:
        """Every window group's table for a request admitted with `match`: the null block before the window, the hits'
        window blocks held. (The manager then grows every table alike.)"""
        first = len(match.hits) - (len(match.windows[0]) if match.windows else 0)
        for group, blocks in zip(self.windows, match.windows or [()] * len(self.windows), strict=True):
            group.admit(req, first, blocks)
        req.tables.num_window_published = len(match.hits)

    def fork(self, parent: CacheRequest, child: CacheRequest, num_full: int) -> None:
        """The child's empty window tables and its parent's window state for its first `num_full` blocks."""
        for group in self.windows:
            group.fork(parent, child)
        child.tables.num_window_published = min(parent.tables.num_window_published, num_full)

    # --- after a forward -----------------------------------------------------------------------------
    def publish_windows(self, req: CacheRequest) -> None:
        """Register each window group's block at every position whose full-attention block got published since."""
        for i in range(req.tables.num_window_published, len(req.tables.block_uids)):
            anchor_uid = req.tables.block_uids[i]
            if anchor_uid is None:
                continue  # a private full-attention block: its window blocks stay private too
            for group in self.windows:
                group.publish_block(req, i, anchor_uid)
        req.tables.num_window_published = len(req.tables.block_uids)

    def release_passed(self, req: CacheRequest, num_computed_tokens: int) -> None:
        for group in self.groups:
            group.release_passed(req, num_computed_tokens)

    def release_order(self, req: CacheRequest) -> list[int]:
        """Every block `req` holds, in the order to free them: position by position, each window group's block after
        the full-attention one it is found through. So LRU evicts tail first and a position's window blocks before
        their anchor: a shorter hit stays whole."""
        if not req.tables.window_tables:
            return req.tables.block_table
        starts = [0, *req.tables.window_starts]
        order = []
        for i in range(max(map(len, req.block_tables))):  # (a failed step may leave the tables uneven)
            order += [t[i] for t, start in zip(req.block_tables, starts, strict=True) if start <= i < len(t)]
        return order

    def held(self, req: CacheRequest) -> list[int]:
        """Assert `req` has a table in every group, each consistent with the pool; every block it holds in them."""
        assert len(req.tables.window_tables) == len(self.windows), "window tables missing"
        return [b for group in self.groups for b in group.held(req)]
