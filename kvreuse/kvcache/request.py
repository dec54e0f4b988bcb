"""What the KV cache knows about one request. The engine's Sequence owns one; the cache never sees the Sequence.
Every field below the identity is written by the KVCacheManager alone; the engine reads them."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum

from kvreuse.kvcache.hashing import extra_keys
from kvreuse.kvcache.retention import NO_SESSION, SessionHint
from kvreuse.kvcache.segment import SegmentPlan


class ReuseScope(Enum):
    """What a request may take from the cache, decided when it is made, so each matcher asks once."""
    NONE = "none"      # use_cache=False: neither reuses nor publishes
    SCORED = "scored"  # scores its prompt (echo + logprobs): exact prefix blocks whose prompt logprobs are stored
    ANY = "any"        # the exact prefix (pool, lower tiers, a cached last block), then segments where enabled


@dataclass
class CacheRequest:
    """Its identity (tokens, key, scope, session), its layer groups' block tables with how far they are published, and
    the sources it holds until their K/V are copied into its blocks. What an admission took is not kept here:
    `KVCacheManager.admit` returns it (match.py's `AdmissionOutcome`)."""
    # Identity: what it is and what it may take.
    token_ids: list[int]              # prompt + completion so far (the Sequence reads and extends this list)
    extra_key: bytes                  # model fingerprint + block size + salt: part of every key of this request
    scope: ReuseScope = ReuseScope.ANY
    # Scoring the prompt: the alternatives per position asked for (prompt_logprobs.py), else None.
    prompt_logprobs: int | None = None
    session: SessionHint = NO_SESSION  # whose blocks are retained when it ends (retention.py)
    num_prompt_tokens: int = 0        # set from `token_ids` when made
    # Group tables, written by the KVCacheManager alone.
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
    # Pending sources, held until the step after admission has copied them (or, the tiers' read, until admission).
    segment_plan: SegmentPlan | None = None  # cached segments to copy in
    last_block_sources: list[int] = field(default_factory=list)  # a fully cached aligned prompt's cached last
    # block, in every group
    tier_load: Future | None = None   # the lower tiers' read of its prefix chain (a TierLoad), until admission

    def __post_init__(self):
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def block_tables(self) -> list[list[int]]:
        """Every group's block table, group 0's (full attention) first."""
        return [self.block_table, *self.window_tables]

    @property
    def use_cache(self) -> bool:
        return self.scope is not ReuseScope.NONE

    def num_publishable_tokens(self, num_computed_tokens: int) -> int:
        """Of the first `num_computed_tokens`, how many hold exact K/V."""
        if self.num_exact_tokens is None:
            return num_computed_tokens
        return min(num_computed_tokens, self.num_exact_tokens)


def new_cache_request(token_ids: list[int], fingerprint: str, block_size: int, *, cache_salt: str | None = None,
                      use_cache: bool = True, prompt_logprobs: int | None = None, session_key: str | None = None,
                      retention_s: float = 0.0) -> CacheRequest:
    """The cache's record of a new request (pure: safe from any thread). Requests with different salts never share
    KV; `use_cache=False` neither reuses nor publishes; `prompt_logprobs` (alternatives per prompt position) scores
    the prompt, reusing only blocks whose prompt logprobs are stored. A `session_key` (OpenAI's `prompt_cache_key`)
    names its session, within its salt: its blocks are retained for `retention_s` after it ends."""
    scope = ReuseScope.NONE if not use_cache else ReuseScope.ANY if prompt_logprobs is None else ReuseScope.SCORED
    extra_key = extra_keys(fingerprint, block_size, cache_salt)
    session = NO_SESSION if session_key is None else SessionHint(extra_key + session_key.encode(), retention_s)
    return CacheRequest(token_ids, extra_key, scope, prompt_logprobs, session=session)
