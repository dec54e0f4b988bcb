"""Session retention: a session's blocks kept, ahead of the eviction policy's, while its tool (or its user) is away.

A request that names its session (OpenAI's `prompt_cache_key`, scoped by the request's salt) leaves its published
blocks *retained* when it ends, until the session's next request is admitted or `retention_s` passes. Retained
blocks stay evictable: the pool evicts them only once the cold blocks and the policy's are gone, so a retention never
refuses a request room. Among retained blocks the newest retention goes first, its last block first: sessions whose
tools started earlier come back earlier (an agent loop is round robin over its sessions), which is exactly the order
LRU gets wrong. A block kept by several sessions (their shared system prompt and tools) ranks by its oldest one.
A session that breaks that order is *overtaken*: when a session comes back, the retentions made before its own are
of sessions that did not come back first, because their conversation is over (an agent's final answer, retained
until it expires) or their tool is slower. Overtaken retentions go before every retention still in order, the one
overtaken first going first. Ranked newest first like the others, the sessions of an agent run that had finished,
the oldest retentions of all, kept the pool from those still running (docs/features/sessions.md).

Retentions hold at most `max_blocks` distinct blocks: a retention that would go beyond is not made (the newest is the
first to go anyway). Everything is keyed by block uid (a published block's identity), so a block evicted and reused
for other contents is never mistaken for a retained one.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvreuse.kvcache.block import KVCacheBlock
from kvreuse.kvcache.eviction import Release


@dataclass(frozen=True)
class SessionHint:
    """The session a request belongs to and how long its blocks are retained after it ends (0: not at all)."""
    key: bytes           # the request's extra key (model, block size, salt) + its prompt_cache_key
    retention_s: float


NO_SESSION = SessionHint(b"", 0.0)
OVERTAKEN = 2**62  # overtaken retentions' ranks count down from here: after every rank still in order


@dataclass
class Retained:
    uids: tuple[int, ...]      # the session's published blocks when its request ended, in chain order
    rank: int                  # order of retention (later: evicted first); from OVERTAKEN down once overtaken
    expires_at: float          # time.monotonic() at which it ends
    release: Release | None    # the request's end, told to the policy with each block it hands over
    overtaken: bool = False    # a session retained after it came back first
    index: dict[int, int] = field(init=False)  # uid -> its place in `uids`

    def __post_init__(self):
        self.index = {uid: i for i, uid in enumerate(self.uids)}


class SessionRetention:
    def __init__(self, max_blocks: int):
        self.max_blocks = max_blocks
        self.sessions: dict[bytes, Retained] = {}
        self.retainers: dict[int, set[bytes]] = {}  # uid -> the sessions retaining it
        self._evictable: dict[int, KVCacheBlock] = {}  # unreferenced retained blocks, by uid
        self._heap: list[tuple[int, int, int]] = []  # (-rank, -index, uid): the worst-ranked first; entries go stale
        self._last_release: dict[int, Release | None] = {}  # uid -> the release of its last retention, once let go
        self._ranks = itertools.count(1)
        self._overtakes = itertools.count(1)

    # --- sessions --------------------------------------------------------------------------------------
    def can_retain(self, hint: SessionHint, uids: Iterable[int]) -> bool:
        """Retaining `uids` for `hint` (replacing its retention) keeps within max_blocks distinct blocks."""
        if hint.retention_s <= 0:
            return False
        new, old = set(uids), self.sessions.get(hint.key)
        leaving = {u for u in old.uids if self.retainers.get(u) == {hint.key}} - new if old else set()
        return len(self.retainers) - len(leaving) + len(new - self.retainers.keys()) <= self.max_blocks

    def retain(self, hint: SessionHint, uids: Iterable[int], release: Release | None, now: float) -> list[int]:
        """Retain `uids` (blocks the session's ending request holds) for `hint.retention_s`, replacing the session's
        earlier retention; the uids no session retains any more, for the pool to hand to its policy."""
        uids = tuple(dict.fromkeys(uids))
        assert self.can_retain(hint, uids), "over the retained share of the pool"
        for uid in uids:
            self.retainers.setdefault(uid, set()).add(hint.key)
        old = self.sessions.get(hint.key)
        self.sessions[hint.key] = Retained(uids, next(self._ranks), now + hint.retention_s, release)
        return self._let_go(hint.key, old, keep=set(uids))

    def end(self, key: bytes) -> list[int]:
        """End the session's retention (its next request is admitted); the uids no session retains any more. The
        retentions made before its own are overtaken."""
        retained = self.sessions.get(key)
        if retained is not None and not retained.overtaken:  # one overtaken is back after those retained since
            self._overtake(retained.rank)
        return self._let_go(key, self.sessions.pop(key, None), keep=set())

    def expire(self, now: float) -> list[int]:
        """End the retentions whose time is past; the uids no session retains any more."""
        return [uid for key in [k for k, r in self.sessions.items() if r.expires_at <= now]
                for uid in self._let_go(key, self.sessions.pop(key), keep=set())]

    def _overtake(self, rank: int) -> None:
        """The retentions still in order made before `rank` (a session that came back) go before the others now."""
        for retained in self.sessions.values():
            if retained.rank < rank and not retained.overtaken:
                retained.rank, retained.overtaken = OVERTAKEN - next(self._overtakes), True
                for uid in retained.uids:
                    if uid in self._evictable:
                        self._push(uid)

    def release_of(self, uid: int) -> Release | None:
        """The end of the request that last retained `uid` (for the policy, once no session retains it)."""
        return self._last_release.pop(uid, None)

    def _let_go(self, key: bytes, retained: Retained | None, keep: set[int]) -> list[int]:
        if retained is None:
            return []
        released, reranked = [], []
        for uid in retained.uids:
            if uid in keep or key not in self.retainers.get(uid, ()):
                continue
            keepers = self.retainers[uid]
            keepers.discard(key)
            if not keepers:
                del self.retainers[uid]
                self._last_release[uid] = retained.release
                released.append(uid)
            elif uid in self._evictable:
                reranked.append(uid)  # its protector may have changed
        for uid in reranked:  # once the whole retention is let go: a rebuilt queue ranks every block afresh
            self._push(uid)
        return released

    # --- blocks, as the pool sees them ---------------------------------------------------------------
    def retains(self, block: KVCacheBlock) -> bool:
        return block.uid in self.retainers

    def add(self, block: KVCacheBlock) -> None:
        """A retained block became unreferenced: evictable, after every block of the policy."""
        self._evictable[block.uid] = block
        self._push(block.uid)

    def remove(self, block: KVCacheBlock) -> None:
        """An unreferenced retained block is held again, or unpublished."""
        del self._evictable[block.uid]

    def forget(self, uid: int) -> None:
        """The block of `uid` was unpublished (evicted): nothing retains its contents any more."""
        self.retainers.pop(uid, None)
        self._last_release.pop(uid, None)

    def pop(self) -> KVCacheBlock:
        """Take the retained block to evict first out (the newest retention's last block)."""
        while True:
            rank, index, uid = heapq.heappop(self._heap)
            if uid in self._evictable and self._priority(uid) == (-rank, -index):
                return self._evictable.pop(uid)

    def __len__(self) -> int:
        return len(self._evictable)

    def __contains__(self, block: KVCacheBlock) -> bool:
        return self._evictable.get(block.uid) is block

    def _priority(self, uid: int) -> tuple[int, int]:
        """(rank, index) of the oldest retention keeping `uid`: it protects the block longest."""
        return min((self.sessions[k].rank, self.sessions[k].index[uid]) for k in self.retainers[uid])

    def snapshot(self, now: float) -> dict:
        return {"num_sessions": len(self.sessions), "blocks": len(self.retainers),
                "blocks_evictable": len(self._evictable), "max_blocks": self.max_blocks,
                "next_expiry_s": min((r.expires_at - now for r in list(self.sessions.values())), default=None)}

    def check_integrity(self) -> None:
        assert all(key in self.sessions and uid in self.sessions[key].index
                   for uid, keys in self.retainers.items() for key in keys), "a block's retainer does not retain it"
        assert len(self.retainers) <= self.max_blocks, f"{len(self.retainers)} retained blocks > {self.max_blocks}"
        for uid, block in self._evictable.items():
            assert block.uid == uid and block.ref_cnt == 0 and uid in self.retainers, f"stale retained block {uid}"
        live = {uid for rank, index, uid in self._heap
                if uid in self._evictable and self._priority(uid) == (-rank, -index)}
        assert live == self._evictable.keys(), "an evictable retained block has no current place in the queue"

    def _push(self, uid: int) -> None:
        rank, index = self._priority(uid)
        heapq.heappush(self._heap, (-rank, -index, uid))
        if len(self._heap) > 2 * len(self._evictable) + 64:  # stale entries: blocks held again, or ranked anew
            # (a block let go this moment is still here until the pool hands it to its policy: not ranked)
            self._heap = [(-r, -i, u) for u in self._evictable if u in self.retainers for r, i in [self._priority(u)]]
            heapq.heapify(self._heap)
