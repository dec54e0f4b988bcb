"""What the cache keeps of one layer group of the layout (kvcache/layout.py), as vLLM v1's single-type managers: the
interface both kinds of group implement, the full-attention group (full_attention_group.py) and a sliding-window group
(sliding_window_group.py). The coordinator (coordinator.py) holds one per group and combines them."""

from __future__ import annotations

from typing import Protocol

from kvreuse.kvcache.request import CacheRequest


class GroupCache(Protocol):
    group: int  # its index in the layout: 0 is the full-attention group

    def table(self, req: CacheRequest) -> list[int]:
        """`req`'s block table in this group (the null block where the group no longer holds a block)."""

    def first_block(self, num_computed_tokens: int) -> int:
        """The first block the next token (at `num_computed_tokens`) reads in this group: a hit must hold this
        group's blocks from there on."""

    def block_at(self, req: CacheRequest, index: int, anchor_uid: int | None) -> int | None:
        """The pool block this group publishes for `req`'s block `index`, found after the published block `anchor_uid`
        (the full-attention group: the block before it, None for the first; a window group: the full-attention block
        of the same position), or None if the pool lacks it."""

    def release_passed(self, req: CacheRequest, num_computed_tokens: int) -> None:
        """`req` has computed `num_computed_tokens`: let go of the blocks of its table that no later token reads."""

    def held(self, req: CacheRequest) -> list[int]:
        """Assert `req`'s table in this group is consistent; the pool blocks it holds there (check_integrity)."""
