"""`learned`: a freed block is kept for as long as the kind of request that freed it tends to come back, learned
online from which requests came back.

A generic cache sees blocks; a prefix cache also sees the request that frees them, at its end (`Release`): how long
its prompt was, how much of it was cached, and how many tokens it generated, which is known then and no earlier. A
request's kind is (its cached share: none, up to a quarter, more; the base-2 magnitude of its output length; that of
its prompt length). Each kind's return rate is counted as the cache runs: every release with a published block counts
once, and it came back when a later request frees a block under the release's last key (hit, or computed again after
its eviction). A kind's rate is shrunk towards its coarser kind's (the cached share alone, then with the output's
magnitude), so a kind seen rarely borrows from its neighbours. Each kind keeps its blocks in LRU order (tail first,
as the pool frees); the victim is the head with the largest age / rate: a kind that comes back half as often is kept
half as long. Blocks freed by no request's end (copy sources) take the rate of all releases.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from kvreuse.kvcache.block import KVCacheBlock
from kvreuse.kvcache.eviction.policy import Release

PRIOR_RATE = 0.5  # the rate of all releases before any was counted
SHRINK = 10       # releases of a kind at which its own count weighs as much as its coarser kind's rate

Kind = tuple  # (cached share, output magnitude, prompt magnitude); () for blocks freed by no request's end


def cached_share(release: Release) -> int:
    """0: nothing of the prompt was cached (a new prompt); 1: up to a quarter (a shared system prompt, say); 2: more
    (a later turn of a conversation)."""
    if release.num_cached_tokens == 0:
        return 0
    return 1 if 4 * release.num_cached_tokens <= release.num_prompt_tokens else 2


def kind_of(release: Release | None) -> Kind:
    if release is None:
        return ()
    return (cached_share(release), release.num_output_tokens.bit_length(), release.num_prompt_tokens.bit_length())


class LearnedPolicy:
    name = "learned"

    def __init__(self, prior_rate: float = PRIOR_RATE, shrink: float = SHRINK):
        self.prior_rate, self.shrink = prior_rate, shrink
        self._queues: dict[Kind, OrderedDict[int, KVCacheBlock]] = {}  # kind -> its evictable blocks, oldest first
        self._entries: dict[int, tuple[int, Kind]] = {}                # evictable block id -> (tick when freed, kind)
        self._released: Counter[Kind] = Counter()   # releases counted, per kind and per coarser kind (its prefix)
        self._returned: Counter[Kind] = Counter()   # of those, the ones that came back
        self._waiting: OrderedDict[bytes, Kind] = OrderedDict()  # last key of a release not yet back -> its kind
        self._waiting_size = 1   # as many releases as the most blocks the policy has held at once
        self._rates: dict[Kind, float] = {}  # rate() memo, cleared when a count changes
        self._tick = 0

    def rate(self, kind: Kind) -> float:
        """The kind's estimated return rate, always > 0."""
        rate = self._rates.get(kind)
        if rate is None:
            rate = self.prior_rate
            for depth in range(len(kind) + 1):
                level = kind[:depth]
                rate = (self._returned[level] + self.shrink * rate) / (self._released[level] + self.shrink)
            self._rates[kind] = rate
        return rate

    def _count(self, counter: Counter, kind: Kind) -> None:
        for depth in range(len(kind) + 1):
            counter[kind[:depth]] += 1
        self._rates.clear()

    def publish(self, block: KVCacheBlock, parent: KVCacheBlock | None) -> None:
        pass

    def add(self, block: KVCacheBlock, release: Release | None = None) -> None:
        kind = kind_of(release)
        if release is not None:
            returned = self._waiting.pop(block.block_key, None)
            if returned is not None:
                self._count(self._returned, returned)
            if block.block_key == release.last_key:
                self._count(self._released, kind)
                self._waiting[block.block_key] = kind
                while len(self._waiting) > self._waiting_size:
                    self._waiting.popitem(last=False)
        self._tick += 1
        self._entries[block.block_id] = (self._tick, kind)
        self._queues.setdefault(kind, OrderedDict())[block.block_id] = block
        self._waiting_size = max(self._waiting_size, len(self._entries))

    def remove(self, block: KVCacheBlock) -> None:
        _, kind = self._entries.pop(block.block_id)
        queue = self._queues[kind]
        del queue[block.block_id]
        if not queue:
            del self._queues[kind]

    def pop(self) -> KVCacheBlock:
        best_score, best_tick, best = -1.0, 0, None
        for kind, queue in self._queues.items():
            tick = self._entries[next(iter(queue))][0]
            score = (self._tick - tick + 1) / self.rate(kind)
            if score > best_score or (score == best_score and tick < best_tick):
                best_score, best_tick, best = score, tick, queue
        if best is None:
            raise KeyError("pop from an empty learned policy")
        block = next(iter(best.values()))
        self.remove(block)
        return block

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.block_id in self._entries

    def check_integrity(self) -> None:
        queued = {i: kind for kind, queue in self._queues.items() for i in queue}
        assert queued == {i: kind for i, (_, kind) in self._entries.items()}, "learned queues and entries differ"
        for queue in self._queues.values():
            assert queue, "an empty kind queue is kept"
            ticks = [self._entries[i][0] for i in queue]
            assert ticks == sorted(ticks), "a kind queue is out of LRU order"
            assert all(block.block_id == i for i, block in queue.items()), "a queue entry under another block's id"
        assert all(self._returned[k] <= n for k, n in self._released.items()), "more returns than releases"
        assert len(self._waiting) <= self._waiting_size, "the waiting releases outgrew their bound"
