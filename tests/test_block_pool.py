"""BlockPool (free / cached / in-use states, LRU and LFU eviction, max_cached_blocks, the confirmed cache
index) and the KVCacheManager prefix matching built on it."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvreuse.kvcache.block import NULL_BLOCK
from kvreuse.kvcache.block_pool import BlockPool, num_physical_blocks
from kvreuse.kvcache.manager import KVCacheManager
from kvreuse.kvcache.request import CacheRequest

# --------------------------------------------------------------------------------------------------------
# helpers


def keyed_pool(num_blocks: int, keys: list[bytes], max_cached_blocks: int | None = None,
               policy: str = "lru") -> tuple[BlockPool, dict[bytes, int]]:
    """A pool whose first len(keys) blocks are allocated and registered, one key each, all still held."""
    pool = BlockPool(num_blocks, max_cached_blocks, policy)
    ids = pool.allocate(len(keys))
    key_to_id = {}
    for block_id, key in zip(ids, keys, strict=True):
        assert pool.register(block_id, key, tokens_of(key), None) == pool.blocks[block_id].uid is not None
        key_to_id[key] = block_id
    pool.check_integrity()
    return pool, key_to_id


def tokens_of(key: bytes) -> tuple[int, ...]:
    return tuple(key)


def hit(pool: BlockPool, key: bytes) -> int:
    """Find `key` in the cache (confirmed) and hold it, as a request reusing it would."""
    block = pool.lookup(key, tokens_of(key), None)
    assert block is not None, f"{key!r} not cached"
    pool.hold([block.block_id])
    return block.block_id


def evict_one_at_a_time(pool: BlockPool, keys: list[bytes]) -> list[bytes]:
    """Allocate single blocks until every key in `keys` is gone; return the keys in eviction order."""
    order = []
    while any(k in pool.key_to_block for k in keys):
        before = set(pool.key_to_block)
        pool.allocate(1)
        pool.check_integrity()
        gone = before - set(pool.key_to_block)
        assert len(gone) == 1, f"one allocation evicted {gone}"
        order.extend(gone)
    return order


# --------------------------------------------------------------------------------------------------------
# 1. property test: random operations against a reference model


class PoolModel:
    """An independent reference of what BlockPool should do: exact free-list order, exact victims. Blocks 1 to
    num_blocks; block 0 is the null block, which nothing touches."""

    def __init__(self, num_blocks: int, max_cached: int, policy: str):
        self.policy = policy
        self.max_cached = max_cached
        self.free = deque(range(1, num_blocks + 1))
        self.ref = [0] * (num_blocks + 1)
        self.key: list[bytes | None] = [None] * (num_blocks + 1)
        self.hits = [0] * (num_blocks + 1)
        self.evictable: dict[int, int] = {}  # block id -> stamp of the moment it became evictable
        self.stamp = 0
        self.evictions = 0

    def _evict(self, count: bool = True) -> int:
        if self.policy == "lru":
            victim = min(self.evictable, key=lambda b: self.evictable[b])
        else:
            victim = min(self.evictable, key=lambda b: (self.hits[b], self.evictable[b]))
        del self.evictable[victim]
        self.key[victim] = None
        self.hits[victim] = 0
        self.evictions += count
        return victim

    def allocate(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            b = self.free.popleft() if self.free else self._evict()
            self.ref[b] = 1
            out.append(b)
        return out

    def touch(self, ids: list[int]) -> None:
        for b in ids:
            if self.ref[b] == 0:
                del self.evictable[b]
            self.ref[b] += 1
            self.hits[b] += 1

    def release(self, ids: list[int]) -> None:
        for b in reversed(ids):
            self.ref[b] -= 1
            if self.ref[b]:
                continue
            self.stamp += 1
            if self.key[b] is None:
                self.free.append(b)
            else:
                self.evictable[b] = self.stamp
        while len(self.evictable) > self.max_cached:
            self.free.append(self._evict())

    def drop(self, b: int) -> None:
        """An unreferenced orphan gives its key up to a block registered under it."""
        del self.evictable[b]
        self.key[b] = None
        self.hits[b] = 0
        self.evictions += 1
        self.free.append(b)

    def register(self, b: int, key: bytes) -> bool:
        if key in self.key:
            return False
        self.key[b] = key
        self.hits[b] = 1
        return True

    def reset_cache(self) -> int:
        n = len(self.evictable)
        while self.evictable:
            self.free.append(self._evict(count=False))
        return n


OPS = ["allocate", "register", "register_taken", "touch", "free", "reset_cache"]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(1, 12), max_cached=st.integers(0, 12), policy=st.sampled_from(["lru", "lfu"]),
       data=st.data())
def test_random_operations_keep_pool_consistent(num_blocks, max_cached, policy, data):
    pool = BlockPool(num_blocks, max_cached, policy)
    model = PoolModel(num_blocks, max_cached, policy)
    holders: list[list[int]] = []                              # who holds what: one list per holder
    history: dict[bytes, tuple[int, tuple[int, ...], int]] = {}  # every key ever registered
    next_key = 0
    uids: set[int] = set()

    for _ in range(data.draw(st.integers(1, 40), label="num_ops")):
        held_unkeyed = [b for b in range(1, num_blocks + 1) if model.ref[b] > 0 and model.key[b] is None]
        indexed = sorted(pool.key_to_block)
        choices = [op for op in OPS
                   if (op == "allocate" and pool.num_free_blocks > 0)
                   or (op == "register" and held_unkeyed)
                   or (op == "register_taken" and held_unkeyed and indexed)
                   or (op == "touch" and indexed)
                   or (op == "free" and holders)
                   or op == "reset_cache"]
        op = data.draw(st.sampled_from(choices), label="op")
        ref_before = list(model.ref)
        keys_before = set(pool.key_to_block)

        if op == "allocate":
            n = data.draw(st.integers(1, pool.num_free_blocks), label="n")
            assert pool.can_allocate(n)
            assert not pool.can_allocate(pool.num_free_blocks + 1)
            ids = pool.allocate(n)
            assert ids == model.allocate(n), "allocate took other blocks than free-first-then-evict"
            assert len(set(ids)) == n
            holders.append(ids)
        elif op == "register":
            b = data.draw(st.sampled_from(held_unkeyed), label="block")
            key = b"key-%d" % next_key
            next_key += 1
            tokens = tuple(data.draw(st.lists(st.integers(0, 50), min_size=1, max_size=4), label="tokens"))
            # A first block, or one after a block published now (as the manager registers them).
            parent = data.draw(st.sampled_from([None, *sorted(pool.uid_to_block)]), label="parent_uid")
            uid = pool.register(b, key, tokens, parent)
            assert model.register(b, key)
            assert uid > 0 and uid not in uids, "uids must be fresh and non-zero"
            uids.add(uid)
            history[key] = (b, tokens, parent)
            assert pool.lookup(key, tokens, parent) is pool.blocks[b]
        elif op == "register_taken":
            b = data.draw(st.sampled_from(held_unkeyed), label="block")
            key = data.draw(st.sampled_from(indexed), label="taken_key")
            owner = pool.key_to_block[key]
            # An owner whose predecessor is gone is reachable by no lookup: unreferenced, it gives its key up.
            orphan = owner.parent_uid is not None and owner.parent_uid not in pool.uid_to_block and owner.ref_cnt == 0
            uid = pool.register(b, key, (1,), None)
            if orphan:
                model.drop(owner.block_id)
                assert model.register(b, key) and uid is not None and pool.key_to_block[key] is pool.blocks[b]
                uids.add(uid)
                history[key] = (b, (1,), None)
            else:
                assert uid is None and not model.register(b, key)
                assert pool.blocks[b].block_key is None and pool.blocks[b].uid is None
                assert pool.key_to_block[key] is owner
        elif op == "touch":
            keys = data.draw(st.lists(st.sampled_from(indexed), min_size=1, max_size=3, unique=True), label="keys")
            ids = []
            for key in keys:
                b, tokens, parent = history[key]
                block = pool.lookup(key, tokens, parent)
                assert block is pool.blocks[b]
                assert pool.lookup(key, tokens, -1) is None                # confirmed, not trusted
                assert pool.lookup(key, (*tokens, 0), parent) is None
                ids.append(b)
            pool.hold(ids)
            model.touch(ids)
            holders.append(ids)
        elif op == "free":
            ids = holders.pop(data.draw(st.integers(0, len(holders) - 1), label="holder"))
            pool.free(ids)
            model.release(ids)
        else:
            assert pool.reset_cache() == model.reset_cache()
            assert pool.num_cached_blocks == 0

        # --- after every operation --------------------------------------------------------------------
        pool.check_integrity()
        held = [0] * (num_blocks + 1)
        for ids in holders:
            for b in ids:
                held[b] += 1
        assert [blk.ref_cnt for blk in pool.blocks] == held == model.ref
        assert pool.num_used_blocks == sum(count > 0 for count in held)
        assert list(pool.free_block_ids) == list(model.free)
        assert {blk.block_id for blk in pool.blocks if blk in pool.evictable} == set(model.evictable)
        assert {k: blk.block_id for k, blk in pool.key_to_block.items()} == {
            k: b for b, k in enumerate(model.key) if k is not None}
        assert pool.num_evictions == model.evictions
        assert pool.num_cached_blocks <= pool.max_cached_blocks
        n_free, n_cached = len(pool.free_block_ids), pool.num_cached_blocks
        n_used = sum(blk.ref_cnt > 0 for blk in pool.blocks)
        assert n_free + n_cached + n_used == num_blocks
        assert pool.num_free_blocks == n_free + n_cached and pool.num_used_blocks == n_used

        for key in keys_before - set(pool.key_to_block):  # evicted by this operation
            b = history[key][0]
            # unheld before the operation (evicted to make room), or released by it (max_cached_blocks)
            assert ref_before[b] == 0 or (op == "free" and model.ref[b] == 0), f"block {b} evicted while held"
            assert pool.blocks[b].block_key is None and pool.blocks[b].token_ids is None
            assert pool.blocks[b].uid is None and pool.blocks[b].num_hits == 0
        for key, (b, tokens, parent) in history.items():
            if key not in pool.key_to_block:  # keys are never reused, so gone for good
                assert pool.lookup(key, tokens, parent) is None
                assert pool.blocks[b].block_key != key
            elif pool.blocks[b].ref_cnt == 0:
                assert pool.blocks[b] in pool.evictable
        for b in range(1, num_blocks + 1):  # a held keyed block keeps its key
            if model.ref[b] > 0 and model.key[b] is not None:
                assert pool.key_to_block.get(model.key[b]) is pool.blocks[b]


# --------------------------------------------------------------------------------------------------------
# 2. LRU order


def test_free_releases_tail_first():
    pool = BlockPool(4)
    ids = pool.allocate(4)
    assert ids == [1, 2, 3, 4] and not pool.free_block_ids  # block 0 is the null block
    pool.free([1, 2, 3, 4])
    assert list(pool.free_block_ids) == [4, 3, 2, 1]
    ticks = [pool.blocks[b].last_access for b in (4, 3, 2, 1)]
    assert ticks == sorted(ticks) and len(set(ticks)) == 4
    assert pool.allocate(2) == [4, 3]


def test_lru_evicts_a_freed_sequence_tail_first():
    keys = [b"A", b"B", b"C", b"D"]
    pool, ids = keyed_pool(4, keys)
    pool.free([ids[k] for k in keys])  # released D, C, B, A
    assert pool.num_cached_blocks == 4 and pool.num_free_blocks == 4 and not pool.free_block_ids
    assert evict_one_at_a_time(pool, keys) == [b"D", b"C", b"B", b"A"]
    assert pool.num_evictions == 4


def test_lru_evicts_least_recently_freed_first_and_a_hit_moves_to_most_recent():
    keys = [b"A", b"B", b"C", b"D"]
    pool, ids = keyed_pool(4, keys)
    for k in keys:
        pool.free([ids[k]])            # cached in order A, B, C, D
    assert hit(pool, b"B") == ids[b"B"]
    assert pool.num_cached_blocks == 3 and pool.blocks[ids[b"B"]].ref_cnt == 1
    pool.free([ids[b"B"]])             # B is now the most recent
    pool.check_integrity()
    assert evict_one_at_a_time(pool, keys) == [b"A", b"C", b"D", b"B"]
    for k in keys:
        assert pool.lookup(k, tokens_of(k), None) is None
    assert all(pool.blocks[b].block_key is None and pool.blocks[b].ref_cnt == 1 for b in ids.values())


def test_lru_block_hit_while_held_becomes_evictable_at_last_release():
    """A block hit while another request still holds it becomes evictable only at its last release."""
    keys = [b"A", b"B", b"C"]
    pool, ids = keyed_pool(3, keys)
    hit(pool, b"A")                    # A now held twice
    pool.free([ids[b"A"]])             # still held once: not cached
    assert pool.blocks[ids[b"A"]].ref_cnt == 1 and pool.num_cached_blocks == 0
    pool.free([ids[b"B"]])
    pool.free([ids[b"C"]])
    pool.free([ids[b"A"]])
    assert evict_one_at_a_time(pool, keys) == [b"B", b"C", b"A"]


# --------------------------------------------------------------------------------------------------------
# 3. LFU order


def test_lfu_evicts_fewest_hits_first_ties_least_recent_first():
    keys = [b"A", b"B", b"C", b"D"]
    pool, ids = keyed_pool(4, keys, policy="lfu")
    # register counts as 1 hit: A=1, B=1+2=3, C=1+1=2, D=1
    touched = [hit(pool, b"B"), hit(pool, b"B"), hit(pool, b"C")]
    assert pool.blocks[ids[b"B"]].num_hits == 3 and pool.blocks[ids[b"C"]].num_hits == 2
    pool.free(touched)
    # release order C, D, A, B: plain LRU would give C, D, A, B; block ids would put A before D
    for k in (b"C", b"D", b"A", b"B"):
        pool.free([ids[k]])
    assert pool.num_cached_blocks == 4
    assert evict_one_at_a_time(pool, keys) == [b"D", b"A", b"C", b"B"]


def test_lfu_hit_on_a_cached_block_reorders_it():
    keys = [b"A", b"B", b"C"]
    pool, ids = keyed_pool(3, keys, policy="lfu")
    pool.free([ids[b"B"]])
    pool.free([ids[b"A"]])
    pool.free([ids[b"C"]])             # all 1 hit, cached in order B, A, C
    hit(pool, b"B")                    # B: 2 hits, its old heap entry is now stale
    pool.free([ids[b"B"]])
    hit(pool, b"A")
    pool.free([ids[b"A"]])             # A: 2 hits, released after B
    assert [pool.blocks[ids[k]].num_hits for k in keys] == [2, 2, 1]
    assert evict_one_at_a_time(pool, keys) == [b"C", b"B", b"A"]


def test_lfu_many_stale_entries_still_evict_correctly():
    """Enough hit/release cycles to trigger the heap compaction; the order is still by hits."""
    keys = [b"A", b"B"]
    pool, ids = keyed_pool(2, keys, policy="lfu")
    pool.free([ids[b"A"], ids[b"B"]])
    for _ in range(100):
        hit(pool, b"A")
        pool.free([ids[b"A"]])
        pool.check_integrity()
    for _ in range(50):
        hit(pool, b"B")
        pool.free([ids[b"B"]])
    assert len(pool.evictable._heap) <= 4 * len(pool.evictable) + 64 + 1
    assert evict_one_at_a_time(pool, keys) == [b"B", b"A"]


# --------------------------------------------------------------------------------------------------------
# 4. max_cached_blocks


def test_max_cached_blocks_keeps_the_most_recent():
    keys = [b"A", b"B", b"C", b"D"]
    pool, ids = keyed_pool(4, keys, max_cached_blocks=2)
    pool.free([ids[k] for k in keys])  # released D, C, B, A: B and A are the most recent
    pool.check_integrity()
    assert pool.num_cached_blocks == 2
    assert set(pool.key_to_block) == {b"A", b"B"}
    assert list(pool.free_block_ids) == [ids[b"D"], ids[b"C"]]
    for k in (b"C", b"D"):
        block = pool.blocks[ids[k]]
        assert block.block_key is None and block.token_ids is None and block.uid is None
        assert pool.lookup(k, tokens_of(k), None) is None
    assert pool.num_evictions == 2
    assert pool.num_free_blocks == 4
    # the free ones go first, then the cached ones (oldest first)
    assert pool.allocate(2) == [ids[b"D"], ids[b"C"]]
    assert set(pool.key_to_block) == {b"A", b"B"} and pool.num_evictions == 2
    assert pool.allocate(1) == [ids[b"B"]]
    assert pool.num_evictions == 3


def test_max_cached_blocks_zero_retains_nothing():
    keys = [b"A", b"B", b"C", b"D"]
    pool, ids = keyed_pool(4, keys, max_cached_blocks=0)
    assert len(pool.key_to_block) == 4  # held blocks keep their keys regardless of the bound
    pool.free([ids[k] for k in keys])
    pool.check_integrity()
    assert pool.num_cached_blocks == 0 and not pool.key_to_block
    assert sorted(pool.free_block_ids) == [1, 2, 3, 4]
    assert pool.num_evictions == 4
    assert all(b.block_key is None for b in pool.blocks)


def test_reset_cache_drops_only_unheld_blocks():
    keys = [b"A", b"B", b"C"]
    pool, ids = keyed_pool(4, keys)
    pool.free([ids[b"A"], ids[b"B"]])
    assert pool.reset_cache() == 2
    pool.check_integrity()
    assert set(pool.key_to_block) == {b"C"}
    assert pool.num_evictions == 0  # a reset is not an eviction
    assert pool.reset_cache() == 0


# --------------------------------------------------------------------------------------------------------
# 5. requests win over the cache


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_allocation_evicts_every_cached_block_when_needed(policy):
    keys = [b"A", b"B", b"C", b"D"]
    pool, ids = keyed_pool(4, keys, policy=policy)
    pool.free(list(ids.values()))
    assert pool.num_cached_blocks == 4 and pool.num_used_blocks == 0
    assert pool.can_allocate(4) and not pool.can_allocate(5)
    got = pool.allocate(4)
    pool.check_integrity()
    assert sorted(got) == [1, 2, 3, 4]
    assert not pool.key_to_block and pool.num_cached_blocks == 0 and pool.num_evictions == 4
    assert all(pool.blocks[b].ref_cnt == 1 and pool.blocks[b].block_key is None for b in got)


def test_allocation_takes_free_blocks_before_evicting():
    keys = [b"A", b"B"]
    pool, ids = keyed_pool(4, keys)
    pool.free([ids[b"A"]])
    pool.free([ids[b"B"]])
    assert pool.num_free_blocks == 4
    assert pool.allocate(2) == [3, 4]
    assert set(pool.key_to_block) == {b"A", b"B"} and pool.num_evictions == 0
    assert pool.allocate(2) == [ids[b"A"], ids[b"B"]]
    assert pool.num_evictions == 2 and not pool.key_to_block
    with pytest.raises(AssertionError):
        pool.allocate(1)


def test_the_null_block_is_never_allocated_held_freed_evicted_or_published():
    pool = BlockPool(3)
    assert len(pool.blocks) == num_physical_blocks(3) == 4 and pool.num_blocks == pool.num_free_blocks == 3
    ids = pool.allocate(3)
    assert NULL_BLOCK not in ids and not pool.can_allocate(1) and pool.num_used_blocks == 3
    for i, block_id in enumerate(ids):
        pool.register(block_id, bytes([i]), (i,), None)
    pool.free(ids)
    assert pool.num_cached_blocks == 3
    assert NULL_BLOCK not in pool.allocate(3) and pool.num_evictions == 3  # evicting every cached block
    with pytest.raises(AssertionError):
        pool.hold([NULL_BLOCK])
    with pytest.raises(AssertionError):
        pool.free([NULL_BLOCK])
    with pytest.raises(AssertionError):
        pool.register(NULL_BLOCK, b"null", (0,), None)
    null = pool.blocks[NULL_BLOCK]
    assert null.ref_cnt == 0 and null.block_key is None and null.uid is None and null.num_hits == 0
    pool.check_integrity()
    pool.free_block_ids.append(NULL_BLOCK)
    with pytest.raises(AssertionError, match="null block"):
        pool.check_integrity()


def test_in_use_blocks_are_never_evicted():
    keys = [b"A", b"B"]
    pool, ids = keyed_pool(3, keys)
    pool.free([ids[b"B"]])
    assert pool.num_free_blocks == 2 and not pool.can_allocate(3)
    pool.allocate(2)
    assert pool.key_to_block == {b"A": pool.blocks[ids[b"A"]]}
    assert pool.lookup(b"A", tokens_of(b"A"), None) is pool.blocks[ids[b"A"]]


# --------------------------------------------------------------------------------------------------------
# 6. lookup confirms, register refuses a taken key


def test_lookup_confirms_tokens_and_parent():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    uid = pool.register(b, b"key", [1, 2, 3], 7)
    assert uid == 1 and pool.blocks[b].uid == uid and pool.blocks[b].num_hits == 1   # the pool's first uid
    assert pool.lookup(b"key", [1, 2, 3], 7) is pool.blocks[b]
    assert pool.lookup(b"key", (1, 2, 3), 7) is pool.blocks[b]
    assert pool.lookup(b"key", [1, 2, 4], 7) is None
    assert pool.lookup(b"key", [1, 2], 7) is None
    assert pool.lookup(b"key", [1, 2, 3], None) is None
    assert pool.lookup(b"key", [1, 2, 3], uid) is None
    assert pool.lookup(b"other", [1, 2, 3], 7) is None


def test_register_of_a_taken_key_leaves_the_block_private_and_free_on_release():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    uid = pool.register(a, b"key", [1], None)
    assert pool.register(b, b"key", [9], None) is None
    block = pool.blocks[b]
    assert block.block_key is None and block.token_ids is None and block.uid is None
    assert pool.key_to_block == {b"key": pool.blocks[a]}
    assert pool.lookup(b"key", [9], None) is None
    pool.free([b])
    pool.check_integrity()
    assert b in pool.free_block_ids and block not in pool.evictable and pool.num_cached_blocks == 0
    pool.free([a])
    assert pool.blocks[a] in pool.evictable and pool.lookup(b"key", [1], None).uid == uid
    # a new registration after eviction gets a fresh uid
    pool.reset_cache()
    (c,) = pool.allocate(1)
    assert pool.register(c, b"key", [1], None) > uid


def test_register_requires_a_held_unkeyed_block():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.register(a, b"k", [1], None)
    with pytest.raises(AssertionError):
        pool.register(a, b"k2", [1], None)   # already keyed
    with pytest.raises(AssertionError):
        pool.register(2, b"k3", [1], None)   # not held
    pool.free([a])
    with pytest.raises(AssertionError):
        pool.free([a])                     # double free


# --------------------------------------------------------------------------------------------------------
# 7. manager-level prefix matching

BS = 4


def make_seq(mgr: KVCacheManager, tokens, salt: str | None = None, use_cache: bool = True) -> CacheRequest:
    return mgr.new_request(list(tokens), salt, use_cache)


def admit_and_compute(mgr: KVCacheManager, seq: CacheRequest, running: list[CacheRequest] = ()) -> list[int]:
    """Admit `seq` with what the cache holds of it, 'compute' all its tokens and publish its full blocks; returns its
    prefix hits."""
    match = mgr.match(seq)
    assert mgr.can_admit(match, seq.num_tokens - match.num_cached_tokens)
    reuse = mgr.admit(seq, match, seq.num_tokens - match.num_cached_tokens).reuse
    assert reuse.cached_tokens == match.num_cached_tokens
    if not match.last_blocks:
        assert reuse.cached_tokens == len(match.hits) * mgr.block_size
    assert len(seq.tables.block_table) == -(-seq.num_tokens // mgr.block_size)
    mgr.update(seq, seq.num_tokens)
    mgr.check_integrity([*running, seq])
    return list(match.hits)


def assert_hits_are_exact(mgr: KVCacheManager, seq: CacheRequest, hits: list[int]) -> None:
    for i, block_id in enumerate(hits):
        assert mgr.pool.blocks[block_id].token_ids == tuple(seq.token_ids[i * BS:(i + 1) * BS])


def test_colliding_hash_never_serves_wrong_blocks():
    mgr = KVCacheManager(32, BS, hash_fn=lambda parent, tokens, extra: b"const")
    first = make_seq(mgr, range(1, 14))               # 13 tokens: 3 full blocks
    assert admit_and_compute(mgr, first) == []
    assert list(mgr.pool.key_to_block) == [b"const"]

    others = [list(range(101, 114)), [1, 2, 3, 4, 50, 60, 70, 80, 9, 10, 11, 12, 13], [2, 1, 3, 4] + [0] * 9]
    for tokens in others:
        seq = make_seq(mgr, tokens)
        hits = mgr.match_prefix(seq)
        assert_hits_are_exact(mgr, seq, hits)
        assert hits == ([first.tables.block_table[0]] if tokens[:BS] == [1, 2, 3, 4] else [])

    # a second sequence computed under the colliding key stays private: an identical third one gets
    # no hits from it, and the first's block (other tokens) is never served
    second = make_seq(mgr, range(101, 114))
    assert admit_and_compute(mgr, second) == []
    assert mgr.pool.blocks[second.tables.block_table[0]].block_key is None
    third = make_seq(mgr, range(101, 114))
    assert mgr.match_prefix(third) == []

    same = make_seq(mgr, range(1, 14))
    first_block = first.tables.block_table[0]
    hits = mgr.match_prefix(same)
    assert hits[:1] == [first_block]
    assert_hits_are_exact(mgr, same, hits)
    mgr.free(first)
    mgr.free(second)
    mgr.check_integrity()
    hits = mgr.match_prefix(same)                              # still cached after release
    assert hits[:1] == [first_block]
    assert_hits_are_exact(mgr, same, hits)
    assert mgr.match_prefix(make_seq(mgr, range(101, 114))) == []


def test_shared_prefix_matches_exactly_the_shared_blocks():
    mgr = KVCacheManager(32, BS)
    base = list(range(1, 18))                                  # 17 tokens: 4 full blocks
    first = make_seq(mgr, base)
    admit_and_compute(mgr, first)
    assert len(mgr.pool.key_to_block) == 4

    seq = make_seq(mgr, base[:8] + [999] + base[9:])   # differs in block 2
    hits = mgr.match_prefix(seq)
    assert hits == first.tables.block_table[:2]
    assert_hits_are_exact(mgr, seq, hits)
    assert admit_and_compute(mgr, seq, [first]) == first.tables.block_table[:2]
    assert [mgr.pool.blocks[b].ref_cnt for b in first.tables.block_table[:3]] == [2, 2, 1]
    mgr.check_integrity([first, seq])

    strict = KVCacheManager(32, BS, min_match_blocks=3)
    admit_and_compute(strict, make_seq(strict, base))
    assert strict.match_prefix(make_seq(strict, base[:8] + [999] + base[9:])) == []
    assert len(strict.match_prefix(make_seq(strict, base))) == 4


def test_match_is_capped_so_the_last_token_is_computed():
    mgr = KVCacheManager(32, BS)
    first = make_seq(mgr, range(1, 13))                # exactly 3 blocks
    admit_and_compute(mgr, first)
    assert len(mgr.pool.key_to_block) == 3
    hits = mgr.match_prefix(make_seq(mgr, range(1, 13)))
    assert hits == first.tables.block_table[:2]
    assert mgr.match_prefix(make_seq(mgr, list(range(1, 13)) + [77])) == first.tables.block_table[:3]
    assert mgr.match_prefix(make_seq(mgr, range(1, 5))) == []       # one full block: nothing to reuse


def test_different_salt_gives_no_hits():
    mgr = KVCacheManager(32, BS)
    tokens = list(range(1, 14))
    admit_and_compute(mgr, make_seq(mgr, tokens))
    assert mgr.match_prefix(make_seq(mgr, tokens, "tenant-b")) == []
    admit_and_compute(mgr, make_seq(mgr, tokens, "tenant-a"))
    assert len(mgr.match_prefix(make_seq(mgr, tokens, "tenant-a"))) == 3
    assert mgr.match_prefix(make_seq(mgr, tokens, "tenant-b")) == []
    assert len(mgr.match_prefix(make_seq(mgr, tokens))) == 3


def test_caching_disabled_or_opted_out_gives_no_hits():
    tokens = list(range(1, 14))
    off = KVCacheManager(32, BS, enable_caching=False)
    admit_and_compute(off, make_seq(off, tokens))
    assert off.match_prefix(make_seq(off, tokens)) == [] and not off.pool.key_to_block

    mgr = KVCacheManager(32, BS)
    admit_and_compute(mgr, make_seq(mgr, tokens))
    assert mgr.match_prefix(make_seq(mgr, tokens, use_cache=False)) == []


def test_freed_sequence_stays_matchable_until_evicted():
    mgr = KVCacheManager(4, BS)
    first = make_seq(mgr, range(1, 14))                # 4 blocks: the whole pool
    admit_and_compute(mgr, first)
    first_blocks = list(first.tables.block_table)
    mgr.free(first)
    assert mgr.num_free_blocks == 4 and mgr.pool.num_cached_blocks == 3
    again = make_seq(mgr, range(1, 14))
    assert admit_and_compute(mgr, again) == first_blocks[:3]
    mgr.free(again)
    other = make_seq(mgr, range(100, 113))            # needs the whole pool: evicts the cache
    assert admit_and_compute(mgr, other) == []
    assert mgr.match_prefix(make_seq(mgr, range(1, 14))) == []


def test_concurrent_twins_share_one_chain():
    """Two identical sequences computed at once: the second publishes nothing twice, but its later
    blocks chain onto the first's cached ones."""
    mgr = KVCacheManager(32, BS)
    s1, s2 = make_seq(mgr, range(1, 10)), make_seq(mgr, range(1, 10))   # 2 full blocks each
    for seq in (s1, s2):
        match = mgr.match(seq)
        assert match.num_cached_tokens == 0
        mgr.admit(seq, match, seq.num_tokens)
    for seq in (s1, s2):
        mgr.update(seq, seq.num_tokens)
    mgr.check_integrity([s1, s2])
    assert len(mgr.pool.key_to_block) == 2
    assert s2.tables.block_uids == s1.tables.block_uids and None not in s1.tables.block_uids
    assert all(mgr.pool.blocks[b].block_key is None for b in s2.tables.block_table)

    s2.token_ids += [10, 11, 12]                                 # s2 decodes into its third block
    mgr.allocate(s2, s2.num_tokens)
    mgr.update(s2, s2.num_tokens)
    mgr.check_integrity([s1, s2])
    assert len(mgr.pool.key_to_block) == 3
    s3 = make_seq(mgr, list(range(1, 13)) + [13])
    assert mgr.match_prefix(s3) == s1.tables.block_table[:2] + [s2.tables.block_table[2]]

    s2_private = s2.tables.block_table[:2]
    mgr.free(s1)
    mgr.free(s2)
    mgr.check_integrity()
    assert all(b in mgr.pool.free_block_ids for b in s2_private)
    assert len(mgr.match_prefix(s3)) == 3


def test_an_orphaned_block_gives_its_key_to_a_reachable_chain():
    """A block published after a twin's predecessor outlives it when that predecessor is evicted: no lookup reaches
    it any more, and it must not keep the same chain, computed again, from being published past it."""
    pool = BlockPool(8)
    head, tail = pool.allocate(2)
    head_uid = pool.register(head, b"H", [1], None)
    assert pool.register(tail, b"T", [2], head_uid) is not None
    pool.free([head])
    pool.free([tail])                          # the head is the older: evicted first
    held = pool.allocate(7)                    # 6 free blocks and the head
    assert head in held and b"H" not in pool.key_to_block and pool.key_to_block[b"T"].parent_uid == head_uid
    evicted: list[bytes] = []
    pool.on_evict.append(lambda block: evicted.append(block.block_key))
    pool.free(held[:2])
    new_head, new_tail = pool.allocate(2)      # the same chain, computed again
    new_uid = pool.register(new_head, b"H", [1], None)
    assert pool.register(new_tail, b"T", [2], new_uid) is not None   # the orphan gave its key up
    assert evicted == [b"T"] and pool.blocks[tail].block_key is None and tail in pool.free_block_ids
    assert pool.lookup(b"T", [2], new_uid).block_id == new_tail
    pool.check_integrity()


def test_a_held_orphan_keeps_its_key():
    pool = BlockPool(4)
    head, tail = pool.allocate(2)
    head_uid = pool.register(head, b"H", [1], None)
    pool.register(tail, b"T", [2], head_uid)
    pool.free([head])
    held = pool.allocate(3)                    # 2 free blocks and the head; the tail's request still holds it
    pool.free([b for b in held if b != head])
    new_head, new_tail = pool.allocate(2)
    new_uid = pool.register(new_head, b"H", [1], None)
    assert pool.register(new_tail, b"T", [2], new_uid) is None        # in use: it stays, the new one stays private
    assert pool.key_to_block[b"T"].block_id == tail
    pool.check_integrity()
