"""Prompt log-probabilities kept beside the published blocks, so that scoring a prompt (`echo` + `logprobs`) is served
from the cache like its K/V.

A cached prefix has K/V but no logits. The log-probability of prompt token p (given the tokens before it) depends on
tokens 0..p only, so every position of a block is determined by the block's chain key, and an entry is stored under
it: one record per position (opaque here: the engine's TokenLogprob; position 0 of a prompt has none), with the
number of top alternatives each record carries. An entry lives exactly as long as its block is published.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvreuse.kvcache.block import KVCacheBlock
from kvreuse.kvcache.block_pool import BlockPool
from kvreuse.kvcache.request import CacheRequest


@dataclass(frozen=True)
class LogprobEntry:
    num_top: int                  # alternatives each record carries
    records: tuple                # block_size records, one per position of the block


class PromptLogprobStore:
    def __init__(self, pool: BlockPool, block_size: int):
        self.pool, self.block_size = pool, block_size
        self.entries: dict[bytes, LogprobEntry] = {}
        pool.on_evict.append(self._evicted)
        self.num_hits = 0  # blocks whose records a request took instead of computing them

    def get(self, key: bytes, num_top: int) -> LogprobEntry | None:
        """The entry of the published block `key`, if it carries at least `num_top` alternatives per position."""
        entry = self.entries.get(key)
        return entry if entry is not None and entry.num_top >= num_top else None

    def can_put(self, key: bytes, num_top: int) -> bool:
        """The block is published and has no entry as rich."""
        return key in self.pool.key_to_block and self.get(key, num_top) is None

    def put(self, key: bytes, num_top: int, records: Sequence) -> None:
        assert self.can_put(key, num_top) and len(records) == self.block_size, "a stale or partial entry"
        self.entries[key] = LogprobEntry(num_top, tuple(records))

    def take(self, req: CacheRequest, keys: Sequence[bytes]) -> tuple:
        """At admission: the stored records of the blocks `keys` (`req`'s first blocks), every position in order."""
        entries = [self.get(key, req.prompt_logprobs) for key in keys]
        assert all(entries), "a matched block lost its prompt logprobs"
        req.tables.num_logprob_blocks_stored = len(keys)
        self.num_hits += len(keys)
        return tuple(r for entry in entries for r in entry.records)

    def store(self, req: CacheRequest, known: Sequence, publishes: bool) -> None:
        """After a step: if `publishes`, store the records of `req`'s published blocks whose every position `known`
        (its records so far, from position 0) holds."""
        bs, tables = self.block_size, req.tables
        end = min(len(known) // bs, len(tables.block_uids)) if publishes else 0
        for i in range(tables.num_logprob_blocks_stored, end):
            if tables.block_uids[i] is None:
                return  # the chain broke: nothing after it is published
            if self.can_put(tables.block_keys[i], req.prompt_logprobs):
                self.put(tables.block_keys[i], req.prompt_logprobs, known[i * bs:(i + 1) * bs])
            tables.num_logprob_blocks_stored = i + 1

    def _evicted(self, block: KVCacheBlock) -> None:
        self.entries.pop(block.block_key, None)

    def check_integrity(self) -> None:
        stale = [key for key in self.entries if key not in self.pool.key_to_block]
        assert not stale, f"{len(stale)} prompt logprob entries outlived their blocks"
        assert all(len(e.records) == self.block_size for e in self.entries.values()), "an entry is not one block"


def merge_records(known: list, first: int, records: Sequence) -> None:
    """Extend `known` (a prompt's records so far, from position 0, which has none) with `records` (computed, or taken
    at admission, from position `first` on) after the positions it knows, keeping the known ones (a recomputation
    after preemption gives them again)."""
    if records and not known:
        known.append(None)  # position 0: nothing before it
    assert first <= len(known) or not records, f"prompt logprobs from {first}, {len(known)} known"
    known.extend(records[len(known) - first:])
