"""S3-FIFO, `chain` and `learned` against small reference implementations, driven through the pool's protocol by
hypothesis: blocks are published (held), freed (added, with the end of a request or without), taken again (removed,
or hit while another request holds them), dropped as orphans (removed, then reset without being popped) and evicted.
Every victim must be the reference's.

The references are written from the policies' descriptions with plain lists, and know blocks only through what the
pool shows a policy (the calls, a block's id, uid, key, num_hits, position)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvreuse.config import CacheConfig
from kvreuse.kvcache.block import KVCacheBlock
from kvreuse.kvcache.block_pool import BlockPool
from kvreuse.kvcache.eviction import POLICIES, ChainPolicy, LearnedPolicy, Release, S3FIFOPolicy
from kvreuse.kvcache.eviction.learned import PRIOR_RATE
from kvreuse.kvcache.manager import KVCacheManager
from kvreuse.kvcache.simulate import CacheSimulator


class S3FIFOReference:
    """Small FIFO (10% of the blocks known), main FIFO with a 2-bit clock, ghost keys as many as the main FIFO."""

    def __init__(self):
        self.small: list[list] = []  # [block id, uid] oldest first
        self.main: list[list] = []
        self.ghost: list[bytes] = []
        self.freq: dict[tuple[int, int], int] = {}
        self.seen_hits: dict[tuple[int, int], int] = {}
        self.evictable: set[int] = set()

    def _queue_of(self, block_id: int) -> list | None:
        for queue in (self.small, self.main):
            if any(slot[0] == block_id for slot in queue):
                return queue
        return None

    def _drop_slots(self, block_id: int) -> None:
        for queue in (self.small, self.main):
            queue[:] = [slot for slot in queue if slot[0] != block_id]

    def publish(self, block: KVCacheBlock, parent) -> None:
        self._drop_slots(block.block_id)  # old contents left unseen

    def _touch(self, block: KVCacheBlock) -> None:
        key = (block.block_id, block.uid)
        self.freq[key] = min(3, self.freq[key] + block.num_hits - self.seen_hits[key])
        self.seen_hits[key] = block.num_hits

    def add(self, block: KVCacheBlock, release=None) -> None:
        key = (block.block_id, block.uid)
        if key not in self.freq or self._queue_of(block.block_id) is None:
            self._drop_slots(block.block_id)
            self.freq[key], self.seen_hits[key] = 0, block.num_hits
            if block.block_key in self.ghost:
                self.ghost.remove(block.block_key)
                self.main.append([block.block_id, block.uid])
            else:
                self.small.append([block.block_id, block.uid])
        else:
            self._touch(block)
        self.evictable.add(block.block_id)

    def remove(self, block: KVCacheBlock) -> None:
        self.evictable.remove(block.block_id)

    def pop(self, blocks: list[KVCacheBlock]) -> int:
        while True:
            for queue in (self.small, self.main):  # contents gone since they were queued
                queue[:] = [slot for slot in queue if blocks[slot[0]].uid == slot[1]]
            if len(self.main) > 0.9 * (len(self.small) + len(self.main)) or not self.small:
                block_id, uid = self.main.pop(0)
                block = blocks[block_id]
                self._touch(block)
                if self.freq[block_id, uid] > 0 or block_id not in self.evictable:
                    self.freq[block_id, uid] = max(0, self.freq[block_id, uid] - 1)
                    self.main.append([block_id, uid])
                    continue
            else:
                block_id, uid = self.small.pop(0)
                block = blocks[block_id]
                self._touch(block)
                if self.freq[block_id, uid] > 0 or block_id not in self.evictable:
                    self.freq[block_id, uid] = 0
                    self.main.append([block_id, uid])
                    continue
                self.ghost.append(block.block_key)
                self.ghost = self.ghost[-max(1, len(self.main)):]
            self.evictable.remove(block_id)
            return block_id


class ChainReference:
    """Proven (hit; continuing a chain that came back: after a parent computed with it that is proven, or after a
    hit parent with no children; or in the ghost) vs probation; the older head goes, a proven block's age divided by
    8; the ghost holds as many keys as the most blocks ever evictable at once."""

    def __init__(self):
        self.proven_uids: set[int] = set()
        self.links: dict[int, tuple[int, int]] = {}   # block id -> (parent block id, parent uid), for its contents
        self.since: dict[int, tuple[int, bool]] = {}  # evictable block id -> (tick, proven)
        self.ghost: list[bytes] = []
        self.ghost_size = 1
        self.tick = 0

    def _proven(self, block: KVCacheBlock) -> bool:
        return block.num_hits > 1 or block.uid in self.proven_uids

    def publish(self, block: KVCacheBlock, parent: KVCacheBlock | None) -> None:
        self.links.pop(block.block_id, None)
        came_back = block.block_key in self.ghost
        if came_back:
            self.ghost.remove(block.block_key)
        if parent is None:
            continues = False
        elif parent.num_hits == 1:
            continues = parent.uid in self.proven_uids
        else:
            continues = (parent.block_id, parent.uid) not in self.links.values()
        if came_back or continues:
            self.proven_uids.add(block.uid)
        if parent is not None:
            self.links[block.block_id] = (parent.block_id, parent.uid)

    def add(self, block: KVCacheBlock, release=None) -> None:
        self.tick += 1
        self.since[block.block_id] = (self.tick, self._proven(block))
        self.ghost_size = max(self.ghost_size, len(self.since))

    def remove(self, block: KVCacheBlock) -> None:
        del self.since[block.block_id]

    def pop(self, blocks: list[KVCacheBlock]) -> int:
        def oldest(proven: bool):
            ticks = [(t, i) for i, (t, p) in self.since.items() if p == proven]
            return min(ticks) if ticks else None
        probation, proven = oldest(False), oldest(True)
        if probation is None or (proven is not None and (self.tick - probation[0]) * 8 < self.tick - proven[0]):
            victim = proven[1]
        else:
            victim = probation[1]
        del self.since[victim]
        self.links.pop(victim, None)
        self.ghost = (self.ghost + [blocks[victim].block_key])[-self.ghost_size:]
        return victim


class LearnedReference:
    """A freed block's kind: (the prompt's cached share: 0 none, 1 up to a quarter, 2 more; the bit lengths of the
    output and prompt lengths), () with no release. A kind's rate: from 0.5, at each of its levels (), (share,),
    (share, output), the whole kind: (returns + 10 x rate) / (releases + 10). A release counts when its last key's
    block is added; it returns when a later release adds a block under that key while it is among the last N
    releases waiting (N: the most blocks ever evictable at once, before this add). The victim: the oldest block of
    the kind with the largest (age + 1) / rate, ties to the older block."""

    def __init__(self):
        self.entries: dict[int, tuple[int, tuple]] = {}  # evictable block id -> (tick, kind)
        self.released: list[tuple] = []
        self.returned: list[tuple] = []
        self.waiting: list[tuple[bytes, tuple]] = []     # (last key, kind), oldest first
        self.most = 1
        self.tick = 0

    def rate(self, kind: tuple) -> float:
        rate = 0.5
        for depth in range(len(kind) + 1):
            level = kind[:depth]
            releases = sum(k[:depth] == level for k in self.released)
            returns = sum(k[:depth] == level for k in self.returned)
            rate = (returns + 10 * rate) / (releases + 10)
        return rate

    def publish(self, block: KVCacheBlock, parent) -> None:
        pass

    def add(self, block: KVCacheBlock, release: Release | None = None) -> None:
        if release is None:
            kind = ()
        else:
            cached = release.num_cached_tokens
            share = 0 if cached == 0 else 1 if cached <= release.num_prompt_tokens / 4 else 2
            kind = (share, release.num_output_tokens.bit_length(), release.num_prompt_tokens.bit_length())
        if release is not None:
            back = [i for i, (key, _) in enumerate(self.waiting) if key == block.block_key]
            if back:
                self.returned.append(self.waiting.pop(back[0])[1])
            if block.block_key == release.last_key:
                self.released.append(kind)
                self.waiting = (self.waiting + [(block.block_key, kind)])[-self.most:]
        self.tick += 1
        self.entries[block.block_id] = (self.tick, kind)
        self.most = max(self.most, len(self.entries))

    def remove(self, block: KVCacheBlock) -> None:
        del self.entries[block.block_id]

    def pop(self, blocks: list[KVCacheBlock]) -> int:
        heads = {}
        for block_id, (tick, kind) in self.entries.items():
            if kind not in heads or tick < heads[kind][0]:
                heads[kind] = (tick, block_id)
        _, _, victim = max(((self.tick - tick + 1) / self.rate(kind), -tick, block_id)
                           for kind, (tick, block_id) in heads.items())
        del self.entries[victim]
        return victim


OPS = ["publish", "free", "hold", "hold_held", "drop", "pop"]


@pytest.mark.parametrize(("policy_cls", "reference_cls"), [(S3FIFOPolicy, S3FIFOReference),
                                                           (ChainPolicy, ChainReference),
                                                           (LearnedPolicy, LearnedReference)])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), num_blocks=st.integers(1, 8), num_keys=st.integers(1, 12))
def test_policy_evicts_what_its_reference_evicts(policy_cls, reference_cls, data, num_blocks, num_keys):
    policy, reference = policy_cls(), reference_cls()
    blocks = [KVCacheBlock(i) for i in range(num_blocks)]
    state = ["free"] * num_blocks
    uids = itertools.count(1)
    for _ in range(data.draw(st.integers(1, 80), label="num_ops")):
        where = {s: [i for i in range(num_blocks) if state[i] == s] for s in ("free", "held", "evictable")}
        used_keys = {b.block_key for b in blocks if b.block_key is not None}
        choices = [op for op in OPS if (op == "publish" and where["free"] and len(used_keys) < num_keys)
                   or (op in ("free", "hold_held") and where["held"])
                   or (op in ("hold", "drop", "pop") and where["evictable"])]
        if not choices:
            break
        op = data.draw(st.sampled_from(choices), label="op")
        if op == "publish":
            block = blocks[data.draw(st.sampled_from(where["free"]), label="block")]
            key = data.draw(st.sampled_from([b"k%d" % k for k in range(num_keys) if b"k%d" % k not in used_keys]))
            parents = [None] + [b for b in blocks if b.uid is not None]
            parent = data.draw(st.sampled_from(parents), label="parent")
            block.block_key, block.uid, block.num_hits = key, next(uids), 1
            block.position = 0 if parent is None else parent.position + 1
            policy.publish(block, parent)
            reference.publish(block, parent)
            state[block.block_id] = "held"
        elif op == "free":
            block = blocks[data.draw(st.sampled_from(where["held"]), label="block")]
            last_keys = st.sampled_from([None, block.block_key, *sorted(used_keys)])
            release = data.draw(st.none() | st.builds(Release, st.integers(0, 40), st.integers(0, 40),
                                                      st.integers(0, 40), last_keys), label="release")
            policy.add(block, release)
            reference.add(block, release)
            state[block.block_id] = "evictable"
        elif op in ("hold", "drop"):
            block = blocks[data.draw(st.sampled_from(where["evictable"]), label="block")]
            policy.remove(block)
            reference.remove(block)
            if op == "hold":
                block.num_hits += 1
                state[block.block_id] = "held"
            else:
                block.reset()
                state[block.block_id] = "free"
        elif op == "hold_held":
            blocks[data.draw(st.sampled_from(where["held"]), label="block")].num_hits += 1
        else:
            victim = policy.pop()
            assert victim.block_id == reference.pop(blocks), "the policy and its reference evicted different blocks"
            victim.reset()
            state[victim.block_id] = "free"
        if isinstance(reference, LearnedReference):  # what it learned, not only what it evicted
            assert {k: policy.rate(k) for _, k in reference.entries.values()} == \
                {k: reference.rate(k) for _, k in reference.entries.values()}, "learned rates differ"
        policy.check_integrity()
        assert len(policy) == state.count("evictable")
        assert all((b in policy) == (state[b.block_id] == "evictable") for b in blocks)


def test_every_policy_is_a_cache_policy_choice():
    from kvreuse.cli.common import choices_of
    from kvreuse.config import CacheConfig

    assert choices_of(CacheConfig, "policy") == list(POLICIES)


# --- hand-checked cases ---------------------------------------------------------------------------------------
def published(policy, block_id: int, key: bytes, uid: int, parent: KVCacheBlock | None = None) -> KVCacheBlock:
    """A block as the pool publishes it (held), with `parent` before it in its chain."""
    block = KVCacheBlock(block_id, block_key=key, uid=uid, num_hits=1,
                         position=0 if parent is None else parent.position + 1)
    policy.publish(block, parent)
    return block


def evictable(policy, *blocks: KVCacheBlock) -> None:
    for block in blocks:
        policy.add(block)


def hit(policy, block: KVCacheBlock) -> None:
    """A request takes the cached block (one more hit) and frees it again."""
    policy.remove(block)
    block.num_hits += 1
    policy.add(block)


def test_chain_evicts_a_reused_block_once_the_oldest_seen_once_is_under_an_eighth_of_its_age():
    policy = ChainPolicy()
    old = published(policy, 0, b"old", 1)
    evictable(policy, old)
    hit(policy, old)                                    # proven, evictable since tick 2
    fresh = [published(policy, i, b"f%d" % i, 10 + i) for i in range(1, 10)]
    evictable(policy, *fresh)                           # seen once, evictable since ticks 3..11
    # At tick 11, old is 9 old; block k is 9 - k old and goes first while (9 - k) * 8 >= 9, i.e. up to k = 7.
    assert [policy.pop().block_id for _ in range(7)] == [1, 2, 3, 4, 5, 6, 7]
    assert policy.pop() is old                          # block 8 is 1 old: 8 < 9
    assert [policy.pop().block_id for _ in range(2)] == [8, 9]
    policy.check_integrity()


def test_chain_proves_a_continuation_of_a_hit_and_a_key_that_comes_back():
    policy = ChainPolicy()
    once = published(policy, 3, b"once", 1)             # a prompt seen once
    root = published(policy, 0, b"root", 2)
    evictable(policy, once, root)                       # ticks 1, 2
    policy.remove(root)
    root.num_hits += 1                                  # a second request reuses root, where the first one ended...
    tail = published(policy, 1, b"tail", 3, parent=root)
    deeper = published(policy, 2, b"deeper", 4, parent=tail)  # ...and computes two blocks after it
    evictable(policy, deeper, tail, root)               # tail first, as the pool frees: ticks 3, 4, 5
    assert policy.is_proven(tail) and policy.is_proven(deeper) and not policy.is_proven(once)
    # A third request reuses root too but branches off after it (a new conversation under a shared prefix): root
    # already has a child, so its new block is on probation.
    policy.remove(root)
    root.num_hits += 1
    branch = published(policy, 4, b"branch", 5, parent=root)
    evictable(policy, branch, root)                     # ticks 6, 7
    assert not policy.is_proven(branch)
    assert policy.pop() is once                         # 6 old: 6 * 8 >= 4, the age of deeper
    assert policy.pop() is branch                       # 1 old: 8 >= 4
    assert [policy.pop() for _ in range(3)] == [deeper, tail, root]
    # `once` computed again after its eviction: the ghost list proves it; a key never evicted is not proven.
    assert policy.is_proven(published(policy, 3, b"once", 6))
    assert not policy.is_proven(published(policy, 5, b"new", 7))
    policy.check_integrity()


def test_s3fifo_a_block_seen_once_leaves_through_the_small_queue_and_comes_back_to_main():
    policy = S3FIFOPolicy()
    blocks = [published(policy, i, b"k%d" % i, i + 1) for i in range(10)]
    evictable(policy, *blocks)
    hit(policy, blocks[1])
    assert policy.pop() is blocks[0]                    # not hit: evicted from the small queue, its key ghosted
    again = published(policy, 0, b"k0", 20)
    evictable(policy, again)                            # the ghost list sends it to the main queue
    assert (policy._num_small, policy._num_main) == (9, 1)
    # Block 1 was hit in the small queue: it moves to the main queue instead of being evicted.
    assert policy.pop() is blocks[2]
    assert (policy._num_small, policy._num_main) == (7, 2)
    policy.check_integrity()


def test_s3fifo_main_queue_is_a_clock_and_a_held_block_counts_as_used():
    policy = S3FIFOPolicy()
    a, b, c = (published(policy, i, key, i + 1) for i, key in enumerate((b"a", b"b", b"c")))
    evictable(policy, a, b, c)
    policy.remove(a)                                    # a is held by a request: at the small queue's end, it is used
    assert policy.pop() is b                            # a moved to the main queue
    a.num_hits += 1
    policy.add(a)                                       # the request that held a hit it, and frees it
    hit(policy, c)
    # c, hit, moves to the main queue on the next pass (its frequency reset on entering); in the main queue a, hit
    # since it entered, goes round again with one less, and c, not hit since, is evicted.
    assert policy.pop() is c
    assert policy.pop() is a
    with pytest.raises(IndexError):
        policy.pop()


def test_chain_a_parent_whose_children_were_all_evicted_is_a_leaf_again():
    policy = ChainPolicy()
    parent = published(policy, 0, b"p", 1)
    child = published(policy, 1, b"c", 2, parent=parent)
    evictable(policy, child, parent)
    hit(policy, parent)                                 # parent is proven and newer: child goes first
    assert policy.pop() is child
    policy.remove(parent)
    parent.num_hits += 1                                # a request reuses parent where the chain now ends
    again = published(policy, 1, b"c2", 3, parent=parent)
    assert policy.is_proven(again)
    policy.check_integrity()


def test_s3fifo_finds_the_small_queues_victim_when_every_main_block_is_held():
    """Held blocks stay in S3-FIFO's main queue; with the main queue over its share and all of it held, the one
    evictable block sits in the small queue, and pop must reach it (it used to rotate the main queue forever)."""
    pool = BlockPool(12, None, "s3fifo")
    ids = pool.allocate(12)
    for i in ids:
        pool.register(i, bytes([i]), (i,), None)
    pool.free(ids)
    pool.hold(ids[:11])
    new = pool.allocate(1)  # evicts the one unheld block; the 11 held ones pass to the main queue
    pool.register(new[0], b"new", (99,), None)
    pool.free(new)
    assert pool.allocate(1) == new
    pool.check_integrity()


def test_learned_keeps_a_prompt_whose_kind_comes_back_where_lru_drops_it():
    """Short answers come back (their next turn follows), long ones never do. After six of each, a short answer's
    prompt outlives six long ones under `learned`; under LRU they push it out (12 blocks of 4 tokens)."""
    def next_turn_hit(policy: str) -> int:
        simulator = CacheSimulator(CacheConfig(block_size=4, max_blocks=12, policy=policy), "test", 12,
                                   enable_segments=False)
        fresh = itertools.count(1000)

        def prompt() -> list[int]:  # two full blocks and a partial one
            return [next(fresh) for _ in range(9)]
        for _ in range(6):
            chat = prompt()
            simulator.run(chat, num_output_tokens=2)
            simulator.run(chat + prompt(), num_output_tokens=2)
            simulator.run(prompt(), num_output_tokens=64)
        chat = prompt()
        simulator.run(chat, num_output_tokens=2)
        for _ in range(6):
            simulator.run(prompt(), num_output_tokens=64)
        simulator.manager.check_integrity([])
        return simulator.run(chat + prompt(), num_output_tokens=2).cached_tokens

    assert next_turn_hit("lru") == 0
    assert next_turn_hit("learned") == 8


def test_a_request_end_is_learned_from_and_a_preemption_is_not():
    manager = KVCacheManager.from_config(CacheConfig(block_size=4, policy="learned"), 16, "test")
    policy = manager.pool.evictable
    kind = (0, 2, 4)  # nothing cached, 3 tokens generated, a 10-token prompt

    def run(token_ids: list[int], finished: bool) -> None:
        req = manager.new_request(token_ids)
        match = manager.match(req)
        reuse = manager.admit(req, match, req.num_tokens - match.num_cached_tokens).reuse
        manager.update(req, req.num_tokens)
        req.token_ids += [1, 2, 3]  # what it generated
        manager.free(req, finished=finished, num_cached_tokens=reuse.cached_tokens)
        manager.check_integrity([])

    run(list(range(10)), finished=False)
    assert policy.rate(kind) == PRIOR_RATE               # a preempted request comes back by design: not counted
    run(list(range(100, 110)), finished=True)
    never_back = policy.rate(kind)
    assert never_back < PRIOR_RATE                       # one release of its kind, not back (yet)
    run(list(range(100, 110)) + [5, 6, 7, 8], finished=True)  # its next turn frees a block under its last key
    assert policy.rate(kind) > never_back
