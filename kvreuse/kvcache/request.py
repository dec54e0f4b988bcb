"""What the KV cache knows about one request. The engine's Sequence owns one; the cache never sees the Sequence.
Every field below the identity is written by the KVCacheManager alone; the engine reads them."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from kvreuse.kvcache.block_tables import BlockTables
from kvreuse.kvcache.hashing import extra_keys
from kvreuse.kvcache.pending_sources import PendingSources
from kvreuse.kvcache.retention import NO_SESSION, SessionHint


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
    tables: BlockTables = field(default_factory=BlockTables)         # every group's table, how far published
    pending: PendingSources = field(default_factory=PendingSources)  # copy sources held until copied

    def __post_init__(self):
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def block_tables(self) -> list[list[int]]:
        """Every group's block table, group 0's (full attention) first."""
        return self.tables.groups

    @property
    def use_cache(self) -> bool:
        return self.scope is not ReuseScope.NONE


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
