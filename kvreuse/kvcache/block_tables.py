"""A request's block table in every layer group and how far its blocks are published, written by the KVCacheManager
alone (a CacheRequest holds one as `tables`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvreuse.kvcache.block import NULL_BLOCK


@dataclass
class BlockTables:
    """Group 0's (full attention) table with its blocks' chain keys and published identities, each sliding-window
    group's table with where its window starts, and how far publishing has gone: window blocks, exact K/V, prompt
    logprob records."""
    block_table: list[int] = field(default_factory=list)   # physical block of each logical block
    block_keys: list[bytes] = field(default_factory=list)  # chain keys of the full blocks, computed as needed
    # Identity (pool uid) of each published full block, in order; None: private (not published, or its chain broke).
    block_uids: list[int | None] = field(default_factory=list)
    # A grouped layout's sliding-window groups (kvcache/layout.py): each one's block table, as long as `block_table`,
    # the null block (block.NULL_BLOCK) before its window (from `window_starts[g]` on, every block is held); and how
    # many of the leading blocks were offered for publishing.
    window_tables: list[list[int]] = field(default_factory=list)
    window_starts: list[int] = field(default_factory=list)
    num_window_published: int = 0
    # K/V from this position on attended to reused (approximate) K/V and are never published; None: all exact.
    num_exact_tokens: int | None = None
    num_logprob_blocks_stored: int = 0  # scoring the prompt: leading blocks whose records are in the store

    @property
    def groups(self) -> list[list[int]]:
        """Every group's block table, group 0's (full attention) first."""
        return [self.block_table, *self.window_tables]

    def num_publishable_tokens(self, num_computed_tokens: int) -> int:
        """Of the first `num_computed_tokens`, how many hold exact K/V."""
        if self.num_exact_tokens is None:
            return num_computed_tokens
        return min(num_computed_tokens, self.num_exact_tokens)

    def release(self) -> None:
        """Forget every block held (the manager has freed them) and how far they were published; the chain keys and
        the count of stored prompt logprob records stay (they are the tokens')."""
        self.block_table, self.window_tables, self.window_starts = [], [], []
        self.block_uids = []
        self.num_window_published = 0
        self.num_exact_tokens = None

    def check_integrity(self, num_full_blocks: int) -> None:
        """Assert the tables' invariants, for a request of `num_full_blocks` full blocks of tokens."""
        assert NULL_BLOCK not in self.block_table, "the full-attention table holds the null block"
        assert len(self.window_tables) == len(self.window_starts), "a window table without its start"
        for g, (table, start) in enumerate(zip(self.window_tables, self.window_starts, strict=True), start=1):
            assert len(table) == len(self.block_table), f"window group {g}'s table is not as long as group 0's"
            assert all(b == NULL_BLOCK for b in table[:start]), f"window group {g} holds a block before its window"
            assert NULL_BLOCK not in table[start:], f"window group {g} released a block inside its window"
        assert len(self.block_keys) <= num_full_blocks, "a chain key for a block not full"
        assert len(self.block_uids) <= len(self.block_table), "more published blocks than blocks"
        first_private = next((i for i, uid in enumerate(self.block_uids) if uid is None), len(self.block_uids))
        assert all(uid is None for uid in self.block_uids[first_private:]), "a published block after a broken chain"
        assert self.num_window_published <= len(self.block_uids), "window blocks offered beyond the published ones"
        assert self.num_logprob_blocks_stored <= len(self.block_keys), "prompt logprobs stored for a block with no key"
