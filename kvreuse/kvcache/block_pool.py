"""The KV block pool: which physical blocks are free and how many holders each block has."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0


class BlockPool:
    """Owns `num_blocks` physical KV blocks. Invariant: a block is free iff its ref_cnt is 0,
    and every free block is in `free_block_ids` exactly once."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_block_ids)

    def allocate(self, num_blocks: int) -> list[int]:
        assert self.can_allocate(num_blocks), f"asked for {num_blocks} blocks, {self.num_free_blocks} free"
        block_ids = [self.free_block_ids.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self.blocks[block_id].ref_cnt = 1
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        # Freed in reverse so a sequence's tail blocks are reused first and its head stays longest.
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"double free of block {block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_ids.append(block_id)

    def check_integrity(self) -> None:
        free = set(self.free_block_ids)
        assert len(free) == len(self.free_block_ids), "a block is in the free list twice"
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            assert (block.ref_cnt == 0) == (block.block_id in free), f"block {block.block_id} free-list mismatch"
