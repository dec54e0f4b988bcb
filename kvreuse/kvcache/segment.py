"""Segment reuse: find cached blocks of the new prompt that are not part of its exact prefix.

Every exactly computed, published block is indexed by its content (token ids + extra keys, no
position). A new prompt's uncovered part is scanned with a rolling hash over every block_size-token
window, at every token offset (a document moved by a number of tokens that is not a multiple of
block_size lands on another block grid), from the tail backwards as the article describes; hits are
confirmed token by token and extended backwards to maximal runs of consecutive cached blocks.

Reused K/V is approximate beyond layer 0 (the cached block attended to other text); engine/repair.py repairs it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from kvreuse.kvcache.block import KVCacheBlock

_MOD = (1 << 61) - 1
_BASE = 1_000_003


def window_hashes(token_ids: Sequence[int], size: int) -> list[int]:
    """Polynomial hash of every `size`-token window, in O(len): result[t] covers token_ids[t:t + size]."""
    if len(token_ids) < size:
        return []
    top = pow(_BASE, size - 1, _MOD)
    h = 0
    for token in token_ids[:size]:
        h = (h * _BASE + token + 1) % _MOD
    hashes = [h]
    for t in range(size, len(token_ids)):
        h = ((h - (token_ids[t - size] + 1) * top) * _BASE + token_ids[t] + 1) % _MOD
        hashes.append(h)
    return hashes


@dataclass
class SegmentRun:
    start: int                   # position of its first token in the new sequence
    blocks: list[KVCacheBlock]   # consecutive cached source blocks

    @property
    def num_tokens(self) -> int:
        return sum(len(b.token_ids) for b in self.blocks)

    @property
    def shifted(self) -> bool:
        return self.blocks[0].position != self.start


@dataclass
class SegmentPlan:
    runs: list[SegmentRun]       # ascending by start, non-overlapping

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.runs)

    @property
    def num_shifted_tokens(self) -> int:
        return sum(r.num_tokens for r in self.runs if r.shifted)

    @property
    def source_block_ids(self) -> list[int]:
        return [b.block_id for r in self.runs for b in r.blocks]

    def positions(self) -> list[int]:
        return [r.start + i for r in self.runs for i in range(r.num_tokens)]

    def tail(self, max_sources: int, min_blocks: int) -> SegmentPlan | None:
        """The plan cut to its last blocks, at most `max_sources` distinct source blocks (runs were found tail
        first, and the later reuse starts, the more of the prompt stays exact); a run cut below `min_blocks`
        blocks is dropped. None if nothing is left."""
        kept: list[SegmentRun] = []
        sources: set[int] = set()
        for run in reversed(self.runs):
            num_kept = 0
            for block in reversed(run.blocks):
                if block.block_id not in sources and len(sources) >= max_sources:
                    break
                sources.add(block.block_id)
                num_kept += 1
            if num_kept >= max(1, min_blocks):
                blocks = run.blocks[len(run.blocks) - num_kept:]
                kept.insert(0, SegmentRun(run.start + run.num_tokens - sum(len(b.token_ids) for b in blocks), blocks))
            if num_kept < len(run.blocks):
                break
        return SegmentPlan(kept) if kept else None


class SegmentIndex:
    """Content key -> published blocks with those tokens. Kept in step with the pool by its
    on_register / on_evict hooks, so it never names an evicted block."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._blocks: dict[tuple[bytes, int], dict[int, KVCacheBlock]] = defaultdict(dict)

    def add(self, block: KVCacheBlock) -> None:
        if len(block.token_ids) == self.block_size:
            self._blocks[self._key(block)][block.block_id] = block

    def remove(self, block: KVCacheBlock) -> None:
        key = self._key(block)
        entries = self._blocks.get(key)
        if entries is not None:
            entries.pop(block.block_id, None)
            if not entries:
                del self._blocks[key]

    def check_integrity(self, blocks: list[KVCacheBlock]) -> None:
        """Exactly the published full blocks are indexed, each under its own content key."""
        indexed = {block_id for entries in self._blocks.values() for block_id in entries}
        published = {b.block_id for b in blocks if b.block_key is not None and len(b.token_ids) == self.block_size}
        assert indexed == published, f"segment index out of step: {sorted(indexed ^ published)}"
        for key, entries in self._blocks.items():
            for block in entries.values():
                assert self._key(block) == key, f"block {block.block_id} indexed under a stale key"

    @staticmethod
    def _key(block: KVCacheBlock) -> tuple[bytes, int]:
        return block.extra_key, window_hashes(block.token_ids, len(block.token_ids))[0]

    def _confirmed(self, extra_key: bytes, window_hash: int, token_ids: tuple[int, ...], position: int,
                   successor: KVCacheBlock | None) -> KVCacheBlock | None:
        candidates = [b for b in self._blocks.get((extra_key, window_hash), {}).values() if b.token_ids == token_ids]
        if not candidates:
            return None
        # Prefer the block that preceded `successor` in its own sequence (the run stays one piece of
        # one earlier context), then one computed at this very position, then the most recently used.
        return max(candidates, key=lambda b: (successor is not None and successor.parent_uid == b.uid,
                                              b.position == position, b.last_access))

    def find_runs(self, token_ids: Sequence[int], begin: int, end: int, extra_key: bytes,
                  min_blocks: int) -> list[SegmentRun]:
        """Maximal runs of cached blocks inside token_ids[begin:end], searched from the tail backwards,
        each at least `min_blocks` blocks long."""
        bs = self.block_size
        region = token_ids[begin:end]
        hashes = window_hashes(region, bs)
        runs: list[SegmentRun] = []
        t = len(region) - bs
        while t >= 0:
            block = self._confirmed(extra_key, hashes[t], tuple(region[t:t + bs]), begin + t, None)
            if block is None:
                t -= 1
                continue
            blocks = [block]
            while t - bs >= 0:
                previous = self._confirmed(extra_key, hashes[t - bs], tuple(region[t - bs:t]), begin + t - bs,
                                           blocks[0])
                if previous is None:
                    break
                blocks.insert(0, previous)
                t -= bs
            if len(blocks) >= max(1, min_blocks):
                runs.append(SegmentRun(begin + t, blocks))
                t -= bs
            else:
                t -= 1  # too short: windows overlapping it may still start a longer run on another grid
        return runs[::-1]
