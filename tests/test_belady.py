"""Belady's MIN: its next-use oracle, its eviction order, and that replayed through the pool it serves as many prefix
hits as the best of every possible sequence of eviction choices (exhaustive search on small traces)."""

from __future__ import annotations

import math
from collections import OrderedDict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvreuse.bench.trace import TraceRequest
from kvreuse.bench.trace_bench import FINGERPRINT, Scale, future_uses, replay
from kvreuse.config import CacheConfig
from kvreuse.kvcache.block import KVCacheBlock
from kvreuse.kvcache.eviction import POLICIES
from kvreuse.kvcache.eviction.belady import BeladyPolicy, FutureUses
from kvreuse.kvcache.simulate import CacheSimulator

SCALE = Scale(tokens_per_hash=2, hash_block_tokens=2, block_size=2)


def test_next_use_is_the_first_later_prompt_that_uses_the_key():
    future = FutureUses([[b"a", b"b"], [b"c"], [b"a"], [b"a", b"b"]])
    future.now = 0
    assert (future.next_use(b"a"), future.next_use(b"b"), future.next_use(b"c")) == (2, 3, 1)
    future.now = 2
    assert (future.next_use(b"a"), future.next_use(b"c"), future.next_use(b"zz")) == (3, math.inf, math.inf)


def test_min_evicts_the_farthest_next_use_then_the_deepest_then_the_oldest():
    future = FutureUses([[b"p"], [b"q", b"r"], [b"s"], [b"s"]])
    future.now = 0
    policy = BeladyPolicy(future)
    blocks = {key: KVCacheBlock(i, block_key=key, position=pos) for i, (key, pos) in
              enumerate([(b"p", 0), (b"q", 0), (b"r", 1), (b"s", 5), (b"t", 0), (b"u", 0)])}
    for key in (b"t", b"s", b"q", b"r", b"u", b"p"):
        policy.add(blocks[key])
    # never used again: t and u (both at position 0: the one added first), then s (used at 2), then q and r (both
    # used at 1: r, deeper, first), then p (never: it was used at 0 only, now is 0).
    order = [policy.pop().block_key for _ in range(6)]
    assert order == [b"t", b"u", b"p", b"s", b"r", b"q"]


def trace(paths: list[list[int]]) -> list[TraceRequest]:
    """Each request's hash ids are a path of full blocks and one token of a last block of its own."""
    return [TraceRequest(i, len(path) * 2 + 1, 1, (*path, 1000 + i)) for i, path in enumerate(paths)]


def test_min_keeps_the_head_of_a_chain_when_it_must_evict_one_of_its_blocks():
    # [A, B], then C (room for it means evicting A or B, both used next at request 2), then [A, B] again. Evicting
    # A would strand B behind a miss; MIN evicts the deeper B and request 2 hits A.
    requests = trace([[1, 2], [3], [1, 2]])
    result = replay(requests, SCALE, 3, "belady", future_uses(requests, SCALE))
    assert result["cached_tokens"] == 2
    assert result["evictions"] >= 1


class ScriptedPolicy:
    """Evicts, at its i-th pop, the `script[i]`-th evictable block (in the order they became evictable), 0 past the
    script; records how many blocks each pop chose from."""

    name = "scripted"

    def __init__(self, script: list[int]):
        self.script, self.choices = script, []
        self._blocks: OrderedDict[int, KVCacheBlock] = OrderedDict()

    def publish(self, block, parent):
        pass

    def add(self, block, release=None):
        self._blocks[block.block_id] = block

    def remove(self, block):
        del self._blocks[block.block_id]

    def pop(self):
        index = self.script[len(self.choices)] if len(self.choices) < len(self.script) else 0
        self.choices.append(len(self._blocks))
        return self._blocks.pop(list(self._blocks)[index])

    def __len__(self):
        return len(self._blocks)

    def __contains__(self, block):
        return block.block_id in self._blocks

    def check_integrity(self):
        pass


def hits_with(requests: list[TraceRequest], capacity: int, policy) -> int:
    cache = CacheConfig(block_size=SCALE.block_size, max_blocks=capacity)
    simulator = CacheSimulator(cache, FINGERPRINT, capacity, enable_segments=False, policy=policy)
    future = getattr(policy, "future", None)
    total = 0
    for index, request in enumerate(requests):
        if future is not None:
            future.now = index
        total += simulator.run(SCALE.prompt(request)).cached_tokens
    return total


def best_hits(requests: list[TraceRequest], capacity: int, script: list[int] | None = None) -> int:
    """The most cached tokens any sequence of eviction choices gets (depth-first over the choices)."""
    script = script or []
    policy = ScriptedPolicy(script)
    hits = hits_with(requests, capacity, policy)
    if len(policy.choices) <= len(script):
        return hits
    return max(best_hits(requests, capacity, script + [j]) for j in range(policy.choices[len(script)]))


@st.composite
def small_traces(draw):
    """Requests along the paths of a random forest of a few hash ids, at most 3 deep (so equal ids always have equal
    prefixes, and several chains compete for a small pool)."""
    num_ids = draw(st.integers(3, 7))
    parents: list[int] = []
    for i in range(num_ids):
        shallow = [j for j in range(i) if parents[j] < 0 or parents[parents[j]] < 0]
        parents.append(draw(st.sampled_from([-1, -1, *shallow])))
    def path(node: int) -> list[int]:
        return ([] if parents[node] < 0 else path(parents[node])) + [node]
    nodes = draw(st.lists(st.integers(0, num_ids - 1), min_size=6, max_size=12))
    return trace([path(n) for n in nodes])


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(requests=small_traces(), capacity=st.integers(3, 5))
def test_min_serves_as_many_prefix_hits_as_the_best_eviction_choices(requests, capacity):
    belady = hits_with(requests, capacity, BeladyPolicy(future_uses(requests, SCALE)))
    assert belady == best_hits(requests, capacity)
    for name in POLICIES:
        assert replay(requests, SCALE, capacity, name)["cached_tokens"] <= belady, name
