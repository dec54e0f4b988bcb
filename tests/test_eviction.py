"""Eviction policies on their own (no model): every policy's membership, LRU and LFU pop order, and LFU's lazy heap
staying bounded under add/remove churn (S3-FIFO and chain: test_eviction_policies.py; Belady's MIN:
test_belady.py).

The pool's protocol: `add` when a block becomes evictable (ref_cnt 0 with a key), `remove` when a request takes it
again (its num_hits / last_access then change before it is added back), `pop` to evict."""

from __future__ import annotations

import random

import pytest

from kvreuse.kvcache.block import KVCacheBlock
from kvreuse.kvcache.eviction import POLICIES, ChainPolicy, LearnedPolicy, LFUPolicy, LRUPolicy, S3FIFOPolicy


def blocks(n: int) -> list[KVCacheBlock]:
    return [KVCacheBlock(i, block_key=b"k%d" % i, last_access=i) for i in range(n)]


def drain(policy) -> list[int]:
    out = []
    while len(policy):
        out.append(policy.pop().block_id)
    return out


def test_policies_registry():
    assert POLICIES == {"lru": LRUPolicy, "lfu": LFUPolicy, "s3fifo": S3FIFOPolicy, "chain": ChainPolicy,
                        "learned": LearnedPolicy}
    assert all(cls.name == name for name, cls in POLICIES.items())


@pytest.mark.parametrize("policy_cls", list(POLICIES.values()))
def test_contains_and_len(policy_cls):
    policy = policy_cls()
    a, b, c = blocks(3)
    assert len(policy) == 0 and a not in policy
    for x in (a, b, c):
        x.uid = x.block_id + 1
        policy.publish(x, None)
    policy.add(a)
    policy.add(b)
    assert len(policy) == 2
    assert a in policy and b in policy and c not in policy
    # Membership is by block id: another object for the same physical block counts as it.
    assert KVCacheBlock(a.block_id) in policy
    policy.remove(a)
    assert len(policy) == 1 and a not in policy and b in policy
    assert policy.pop() is b
    assert len(policy) == 0 and b not in policy
    policy.check_integrity()


@pytest.mark.parametrize(("policy_cls", "error"), [(LRUPolicy, KeyError), (LFUPolicy, IndexError),
                                                   (S3FIFOPolicy, IndexError), (ChainPolicy, KeyError),
                                                   (LearnedPolicy, KeyError)])
def test_pop_on_empty_raises(policy_cls, error):
    policy = policy_cls()
    with pytest.raises(error):
        policy.pop()


# --- LRU ------------------------------------------------------------------------------------------------------
def test_lru_pops_in_the_order_blocks_became_evictable():
    policy = LRUPolicy()
    bs = blocks(5)
    for b in (bs[3], bs[0], bs[4], bs[1], bs[2]):
        policy.add(b)
    assert drain(policy) == [3, 0, 4, 1, 2]


def test_lru_a_block_taken_and_freed_again_goes_last():
    policy = LRUPolicy()
    a, b, c = blocks(3)
    for x in (a, b, c):
        policy.add(x)
    policy.remove(a)          # a request hits a
    policy.add(a)             # and frees it
    assert drain(policy) == [1, 2, 0]


def test_lru_ignores_hit_counts():
    policy = LRUPolicy()
    a, b = blocks(2)
    a.num_hits = 100
    policy.add(a)
    policy.add(b)
    assert drain(policy) == [0, 1]


# --- LFU ------------------------------------------------------------------------------------------------------
def test_lfu_pops_fewest_hits_first():
    policy = LFUPolicy()
    bs = blocks(4)
    for b, hits in zip(bs, (3, 1, 2, 0), strict=True):
        b.num_hits = hits
        policy.add(b)
    assert drain(policy) == [3, 1, 2, 0]


def test_lfu_ties_are_broken_by_last_access():
    policy = LFUPolicy()
    bs = blocks(4)
    for b, (hits, access) in zip(bs, [(1, 40), (1, 10), (0, 99), (1, 20)], strict=True):
        b.num_hits, b.last_access = hits, access
    for b in bs:
        policy.add(b)
    assert drain(policy) == [2, 1, 3, 0]


def test_lfu_a_block_readded_with_new_hits_pops_by_its_new_count():
    policy = LFUPolicy()
    a, b, c = blocks(3)
    for x in (a, b, c):
        policy.add(x)
    # a is taken by a request (its stale heap entry stays behind), hit, and freed later than the others.
    policy.remove(a)
    a.num_hits, a.last_access = 5, 100
    policy.add(a)
    assert drain(policy) == [1, 2, 0]
    # The other way round: a block with many hits that comes back with fewer is not protected by its old entry.
    b.num_hits, c.num_hits = 9, 3
    policy.add(b)
    policy.add(c)
    policy.remove(b)
    b.num_hits, b.last_access = 0, 200
    policy.add(b)
    assert drain(policy) == [1, 2]


def test_lfu_a_removed_block_is_never_popped():
    policy = LFUPolicy()
    a, b = blocks(2)
    policy.add(a)
    policy.add(b)
    policy.remove(a)
    assert policy.pop() is b
    assert len(policy) == 0
    with pytest.raises(IndexError):
        policy.pop()


def test_lfu_heap_stays_bounded_under_churn_and_pop_order_stays_right():
    policy = LFUPolicy()
    resident = blocks(8)                       # stay evictable the whole time
    churn = [KVCacheBlock(100 + i, block_key=b"c%d" % i) for i in range(16)]
    for i, b in enumerate(resident):
        b.num_hits, b.last_access = 2, 1000 + i
        policy.add(b)
    tick = 2000
    rng = random.Random(0)
    for _ in range(2000):
        b = rng.choice(churn)
        tick += 1
        if b in policy:
            policy.remove(b)                   # a request takes it: a hit
            b.num_hits += 1
            b.last_access = tick
        else:
            b.last_access = tick               # freed: touched, then evictable
            policy.add(b)
        assert len(policy._heap) <= 4 * len(policy) + 64, (len(policy._heap), len(policy))
    in_policy = [b for b in resident + churn if b in policy]
    assert len(policy) == len(in_policy) >= len(resident)
    # Pop order is still (num_hits, last_access) over the blocks in the policy, with their current values.
    expected = [b.block_id for b in sorted(in_policy, key=lambda b: (b.num_hits, b.last_access))]
    assert drain(policy) == expected


def test_lfu_heap_compaction_keeps_the_right_order_after_readds():
    policy = LFUPolicy()
    keep = blocks(4)
    for b, hits in zip(keep, (4, 1, 3, 2), strict=True):
        b.num_hits = hits
        policy.add(b)
    x = KVCacheBlock(50, block_key=b"x", num_hits=0, last_access=0)
    # Many take / free cycles of x, each one a hit: stale entries pile up until remove compacts them.
    for cycle in range(1, 500):
        policy.add(x)
        policy.remove(x)
        x.num_hits, x.last_access = cycle, 10_000 + cycle
        assert len(policy._heap) <= 4 * len(policy) + 64
    policy.add(x)                            # back with 499 hits: evicted last
    assert len(policy._heap) <= 4 * len(policy) + 64
    assert drain(policy) == [1, 3, 2, 0, 50]
    assert len(policy) == 0


def test_lfu_pop_order_matches_a_reference_under_random_operations():
    rng = random.Random(1)
    policy = LFUPolicy()
    pool = [KVCacheBlock(i, block_key=b"k%d" % i) for i in range(12)]
    added_with: dict[int, tuple[int, int]] = {}    # block id -> (num_hits, last_access) when it was added
    tick = 0
    for _ in range(3000):
        tick += 1
        b = rng.choice(pool)
        op = rng.random()
        if b.block_id in added_with and op < 0.5:
            policy.remove(b)
            del added_with[b.block_id]
            b.num_hits += 1
            b.last_access = tick
        elif b.block_id not in added_with:
            b.last_access = tick
            policy.add(b)
            added_with[b.block_id] = (b.num_hits, b.last_access)
        elif added_with and op > 0.9:
            victim = policy.pop()
            expected = min(added_with, key=lambda i: (*added_with[i], i))
            assert victim.block_id == expected
            del added_with[victim.block_id]
        assert len(policy) == len(added_with)
        assert all((blk in policy) == (blk.block_id in added_with) for blk in pool)
        assert len(policy._heap) <= 4 * len(policy) + 64
