"""Eviction policies: which unreferenced cached block goes first when the pool needs room (`cache.policy`).

The engine and the cache simulator build them from this table, so every policy a replay measures is the code the
engine runs. Belady's MIN (belady.py) is the offline limit and is not in it: it needs the future.
"""

from __future__ import annotations

from kvreuse.kvcache.eviction.chain import ChainPolicy
from kvreuse.kvcache.eviction.learned import LearnedPolicy
from kvreuse.kvcache.eviction.lfu import LFUPolicy
from kvreuse.kvcache.eviction.lru import LRUPolicy
from kvreuse.kvcache.eviction.policy import EvictionPolicy, Release
from kvreuse.kvcache.eviction.s3fifo import S3FIFOPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "lfu": LFUPolicy, "s3fifo": S3FIFOPolicy,
                                             "chain": ChainPolicy, "learned": LearnedPolicy}


def make_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """A fresh policy by its `cache.policy` name, or `policy` itself when it is one already (a replay's MIN)."""
    return POLICIES[policy]() if isinstance(policy, str) else policy


__all__ = ["POLICIES", "ChainPolicy", "EvictionPolicy", "LFUPolicy", "LRUPolicy", "LearnedPolicy", "Release",
           "S3FIFOPolicy", "make_policy"]
