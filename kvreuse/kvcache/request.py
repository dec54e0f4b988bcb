"""What the KV cache knows about one request. The engine's Sequence owns one; the cache never sees the Sequence."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from kvreuse.kvcache.segment import SegmentPlan


@dataclass
class CacheRequest:
    token_ids: list[int]              # prompt + completion so far (the Sequence reads and extends this list)
    extra_key: bytes                  # model fingerprint + block size + salt: part of every key of this request
    use_cache: bool = True            # False: this request neither reuses nor publishes KV
    block_table: list[int] = field(default_factory=list)   # physical block of each logical block
    block_keys: list[bytes] = field(default_factory=list)  # chain keys of the full blocks, computed as needed
    # Identity (pool uid) of each published full block, in order; None: private (not published, or its chain broke).
    block_uids: list[int | None] = field(default_factory=list)
    num_cached_tokens: int = 0        # tokens the last admission took from the exact prefix cache
    segment_plan: SegmentPlan | None = None  # cached segments to copy in; dropped once copied
    # A fully cached block-aligned prompt: (the cached last block, its own last block). The engine copies the first
    # into the second before the step that computes the last token; the source is held until then.
    last_block_copy: tuple[int, int] | None = None
    # K/V from this position on attended to reused (approximate) K/V and are never published; None: all exact.
    num_exact_tokens: int | None = None
    tier_load: Future | None = None   # the lower tiers' read of its prefix chain (a TierLoad), until admission
    # Of num_cached_tokens, how many the last admission loaded from each lower tier ("disk", "redis"), and the time
    # that took (reading on the loader thread, then copying into the pool).
    num_loaded_tokens: dict[str, int] = field(default_factory=dict)
    load_seconds: float = 0.0
    # Scoring the prompt (echo + logprobs): the alternatives per position asked for, else None. Such a request reuses
    # only exact prefix blocks whose prompt logprobs are stored (prompt_logprobs.py), and at admission takes them here.
    prompt_logprobs: int | None = None
    cached_logprob_records: list = field(default_factory=list)
    num_logprob_blocks_stored: int = 0  # leading blocks whose records are in the store (put or found there)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def num_publishable_tokens(self, num_computed_tokens: int) -> int:
        """Of the first `num_computed_tokens`, how many hold exact K/V."""
        if self.num_exact_tokens is None:
            return num_computed_tokens
        return min(num_computed_tokens, self.num_exact_tokens)
