"""Maps sequences to KV blocks: grows each sequence's block table as it computes tokens, frees it at the end."""

from __future__ import annotations

from kvreuse.engine.sequence import Sequence
from kvreuse.kvcache.block_pool import BlockPool


class KVCacheManager:
    """Invariant: a running sequence's `block_table` covers at least its `num_computed_tokens`, and
    every block in it holds one reference from that sequence."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        num_tokens = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.pool.can_allocate(self.num_new_blocks(seq, num_new_tokens))

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make room for `num_new_tokens` more KV entries of `seq`."""
        seq.block_table.extend(self.pool.allocate(self.num_new_blocks(seq, num_new_tokens)))

    def free(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table)
        seq.block_table = []

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    def check_integrity(self, running: list[Sequence] = ()) -> None:
        self.pool.check_integrity()
        held: dict[int, int] = {}
        for seq in running:
            assert len(seq.block_table) * self.block_size >= seq.num_computed_tokens, f"{seq.request_id} short table"
            for block_id in seq.block_table:
                held[block_id] = held.get(block_id, 0) + 1
        for block_id, count in held.items():
            assert self.pool.blocks[block_id].ref_cnt >= count, f"block {block_id} held {count}x, ref_cnt lower"
