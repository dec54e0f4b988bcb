"""Maps requests to KV blocks: exact prefix and segment matching at admission, growing block tables, publishing
fully computed blocks to the cache (and through it to the lower tiers), and freeing. It works on CacheRequest
records and block ids only: the tensor work it decides comes back as CopyJobs for the engine to run."""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvreuse.config import CacheConfig
from kvreuse.kvcache.accounting import ReuseRecord
from kvreuse.kvcache.block import NULL_BLOCK
from kvreuse.kvcache.block_pool import BlockPool
from kvreuse.kvcache.coordinator import KVCacheCoordinator
from kvreuse.kvcache.copy_jobs import CopyJobs
from kvreuse.kvcache.eviction import EvictionPolicy, Release
from kvreuse.kvcache.hashing import BlockHashFn, extend_chain, sha256_block_key
from kvreuse.kvcache.in_batch import gains_by_waiting
from kvreuse.kvcache.layout import KVLayout
from kvreuse.kvcache.match import NO_MATCH, AdmissionOutcome, Match
from kvreuse.kvcache.pins import Pins
from kvreuse.kvcache.prompt_logprobs import PromptLogprobStore
from kvreuse.kvcache.request import CacheRequest, ReuseScope, new_cache_request
from kvreuse.kvcache.segment import SegmentIndex, SegmentPlan
from kvreuse.kvcache.tier_loads import TierLoads
from kvreuse.kvcache.tiers.store import LoadedBlock, StoredBlock, TieredStore


class KVCacheManager:
    """Invariants: a running request's `block_table` covers its computed tokens, and each block in it holds one
    reference from that request (a waiting request holds none). Only exactly computed blocks (their whole prefix
    computed in this request, an exact hit, or loaded from a lower tier) are ever registered under chain keys, and
only registered blocks are written to the lower tiers.

Each layer group of the layout (kvcache/layout.py) has its table: `block_table` is the full-attention group's, and
each sliding-window group's (`window_tables`) is allocated with it, published under the same chain keys tagged with
the group, and released once the window has passed its blocks. The coordinator (coordinator.py) holds one GroupCache
per group: a prefix hit of n blocks also needs, in every window group, the blocks its window reads before position n.
A layout of one group has no window group: the same path, with nothing to cut a hit."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True,
                 max_cached_blocks: int | None = None, policy: str | EvictionPolicy = "lru", min_match_blocks: int = 1,
                 fingerprint: str = "", hash_fn: BlockHashFn = sha256_block_key, enable_segments: bool = False,
                 tiers: TieredStore | None = None, layout: KVLayout | None = None, max_pinned_blocks: int = 0,
                 max_retained_blocks: int = 0):
        self.block_size = block_size
        self.layout = layout or KVLayout.full(1)
        self.windows = [g.window for g in self.layout.window_groups]  # of each sliding-window group (1, 2, ...)
        assert not (self.windows and enable_segments), "segment reuse needs a one-group layout"
        self.enable_caching = enable_caching
        self.enable_segments = enable_caching and enable_segments
        self.min_match_blocks = min_match_blocks
        self.fingerprint = fingerprint
        self.hash_fn = hash_fn  # a test can swap in a constant to prove hits are confirmed, not trusted
        self.pool = BlockPool(num_blocks, max_cached_blocks if enable_caching else 0, policy,
                              max_retained_blocks if enable_caching else 0)
        self.coordinator = KVCacheCoordinator(self.pool, self.layout, block_size, self._key)
        self.segments = SegmentIndex(block_size)
        self.tiers = tiers if enable_caching else None  # disk / Redis under the pool
        self.tier_loads = TierLoads(self.tiers, block_size, min_match_blocks)
        self.prompt_logprobs = PromptLogprobStore(self.pool, block_size)
        self.pins = Pins(self.pool, max_pinned_blocks if enable_caching else 0)
        # Indexed whenever caching is on, so segment reuse can be switched on for a running engine (one group only).
        self.indexes_segments = enable_caching and not self.windows
        if self.indexes_segments:
            self.pool.on_register.append(self.segments.add)
            self.pool.on_evict.append(self.segments.remove)

    @classmethod
    def from_config(cls, cache: CacheConfig, num_blocks: int, fingerprint: str, *,
                    enable_segments: bool | None = None, tiers: TieredStore | None = None,
                    policy: EvictionPolicy | None = None, layout: KVLayout | None = None) -> KVCacheManager:
        """The `[cache]` section's manager; `enable_segments` overrides `cache.suffix.enabled`, `policy` (a policy
        object: a replay's offline MIN) `cache.policy`. The tiers are built by the caller, who owns the K/V they copy
        (`TieredStore.from_config`)."""
        segments = cache.suffix.enabled if enable_segments is None else enable_segments
        return cls(num_blocks, cache.block_size, enable_caching=cache.enabled, max_cached_blocks=cache.max_blocks,
                   policy=cache.policy if policy is None else policy, min_match_blocks=cache.min_match_blocks,
                   fingerprint=fingerprint, enable_segments=segments, tiers=tiers, layout=layout,
                   max_pinned_blocks=int(cache.pin_max_share * num_blocks),
                   max_retained_blocks=int(cache.session_max_share * num_blocks))

    def new_request(self, token_ids: list[int], cache_salt: str | None = None, use_cache: bool = True,
                    prompt_logprobs: int | None = None, session_key: str | None = None,
                    retention_s: float = 0.0) -> CacheRequest:
        """The cache's record of a new request (`new_cache_request` for this manager's model and block size)."""
        return new_cache_request(token_ids, self.fingerprint, self.block_size, cache_salt=cache_salt,
                                 use_cache=use_cache, prompt_logprobs=prompt_logprobs, session_key=session_key,
                                 retention_s=retention_s)

    @staticmethod
    def clock() -> float:
        """Time as retentions and pins count it (time.monotonic; a test sets its own clock on the instance)."""
        return time.monotonic()

    def expire(self, now: float) -> None:
        """End the pins and the sessions' retentions whose time is past."""
        self.pins.expire(now)
        self.pool.expire_retentions(now)

    def caches(self, req: CacheRequest) -> bool:
        return self.enable_caching and req.use_cache

    # --- matching ------------------------------------------------------------------------------------
    def _key(self, req: CacheRequest, index: int) -> bytes:
        """Chain key of full block `index`, computing (and keeping) the keys before it."""
        return extend_chain(req.tables.block_keys, req.token_ids, self.block_size, req.extra_key, index + 1,
                            self.hash_fn)[index]

    def match(self, req: CacheRequest) -> Match:
        """What the cache holds of a waiting request's prompt, its last token excluded (its logits are needed): the
        exact prefix from the pool with its continuation prefetched from the lower tiers (an entry holds every layer,
        so the loaded part brings its own windows) where the pool holds the windows the loaded end reads before it;
        else the pool's hits whose windows are cached, or for a block-aligned prompt cached whole the pool's copy of
        its last block; then cached segments beyond that prefix."""
        if not self.caches(req):
            return NO_MATCH
        hits = self.match_prefix(req)
        loads = self.tier_loads.match(req, hits)
        if loads:
            num_blocks = len(hits) + len(loads)
            windows = self.coordinator.windows_before(req, hits, num_blocks)
            if windows is not None:
                return Match(tuple(hits), tuple(loads), plan=self._match_segments(req, num_blocks), windows=windows,
                             num_cached_tokens=num_blocks * self.block_size)
        hits, windows = self.coordinator.find_hit(req, hits, max(1, self.min_match_blocks))
        last_blocks = self._match_last_block(req, hits) if req.scope is ReuseScope.ANY else ()
        if last_blocks:
            return Match(tuple(hits), last_blocks=last_blocks, windows=windows, num_cached_tokens=req.num_tokens - 1)
        plan = self._match_segments(req, len(hits)) if req.scope is ReuseScope.ANY else None
        return Match(tuple(hits), plan=plan, windows=windows, num_cached_tokens=len(hits) * self.block_size)

    def match_prefix(self, req: CacheRequest) -> list[int]:
        """Block ids of the longest cached exact prefix of `req` (confirmed token by token), capped so the
        last token is always computed; empty if shorter than `min_match_blocks` or caching is off."""
        if not self.caches(req):
            return []
        hits = self._pool_run(req)
        if req.scope is ReuseScope.SCORED:
            # Only blocks with stored prompt logprobs, and the last of those is computed again: its last row's logits
            # give the first position after it.
            hits = hits[:max(0, self._num_logprob_blocks(req, len(hits)) - 1)]
        return hits if len(hits) >= max(1, self.min_match_blocks) else []

    def _match_last_block(self, req: CacheRequest, hits: Sequence[int]) -> tuple[int, ...]:
        """For a block-aligned prompt whose every block but the last is a hit (`hits`): the pool's copy of its last
        block in every group, if it holds them all, else (). Its last token must be computed again (its logits are
        needed); a copy of the block brings the other tokens' K/V, so the step computes one token instead of a block's
        worth."""
        bs, num_blocks = self.block_size, len(hits) + 1
        if req.num_tokens != num_blocks * bs or num_blocks < self.min_match_blocks:
            return ()
        parent_uid = self.pool.blocks[hits[-1]].uid if hits else None
        block = self.pool.lookup(self._key(req, len(hits)), req.token_ids[-bs:], parent_uid)
        if block is None:
            return ()
        windows = self.coordinator.blocks_at(req, len(hits), block.uid)
        return () if windows is None else (block.block_id, *windows)

    def _num_logprob_blocks(self, req: CacheRequest, num_blocks: int) -> int:
        """How many of `req`'s first `num_blocks` blocks, in a row, have prompt logprobs stored as rich as it asks."""
        for i in range(num_blocks):
            if self.prompt_logprobs.get(self._key(req, i), req.prompt_logprobs) is None:
                return i
        return num_blocks

    def _pool_run(self, req: CacheRequest) -> list[int]:
        """Block ids of the leading run of `req`'s full blocks (before its last token) that the pool holds."""
        return self.coordinator.full.find_hit(req, self._num_usable_blocks(req))

    def _num_usable_blocks(self, req: CacheRequest) -> int:
        """Full blocks before the last token, which is always computed (its logits are needed)."""
        return (req.num_tokens - 1) // self.block_size

    def _match_segments(self, req: CacheRequest, num_prefix_blocks: int) -> SegmentPlan | None:
        """Cached runs inside the part of `req` that its exact prefix does not cover, leaving the last
        token to be computed; None if there are none or segment reuse is off. The plan's sources are held
        beside the request's own blocks until they are copied, so it is cut (tail first) to what fits in the
        whole pool with them: a plan that could never fit would keep its request out forever, and strict
        arrival order would keep out everyone behind it."""
        if not self.enable_segments:
            return None
        runs = self.segments.find_runs(req.token_ids, num_prefix_blocks * self.block_size, req.num_tokens - 1,
                                       req.extra_key, self.min_match_blocks)
        if not runs:
            return None
        room = self.pool.num_blocks - -(-req.num_tokens // self.block_size)
        plan = SegmentPlan(runs)
        return plan if len(set(plan.source_block_ids)) <= room else plan.tail(room, self.min_match_blocks)

    def gains_by_waiting(self, req: CacheRequest, match: Match, publishing: Sequence[tuple[CacheRequest, int]]
                         ) -> bool:
        """Whether `req`, admitted one step later than with `match`, would reuse at least `min_match_blocks` more
        blocks: blocks that the requests in `publishing` (each with its computed tokens once this step has run)
        compute exactly and publish in this step (in_batch.py)."""
        return self.caches(req) and gains_by_waiting(req, match, publishing, self.block_size,
                                                     max(1, self.min_match_blocks), self.enable_segments)

    # --- the lower tiers -----------------------------------------------------------------------------
    def prefetch(self, req: CacheRequest) -> None:
        """Start reading, in the background, the part of `req`'s prefix chain that the pool lacks from the lower
        tiers (tier_loads.py); `match` hands it over at admission. Nothing to do without tiers."""
        if self.tiers is None or not self.caches(req) or req.scope is not ReuseScope.ANY:
            return  # (the tiers keep K/V only: a request scoring its prompt needs the logprobs too)
        self.tier_loads.prefetch(req, len(self._pool_run(req)), self._num_usable_blocks(req), self.hash_fn)

    def is_loading(self, req: CacheRequest) -> bool:
        """Its prefetch is still reading: admitting it now would compute what is about to arrive."""
        return self.tier_loads.is_loading(req)

    def wait_for_load(self, req: CacheRequest, timeout: float) -> None:
        self.tier_loads.wait_for_load(req, timeout)

    # --- admission and growth ------------------------------------------------------------------------
    def num_new_blocks(self, req: CacheRequest, num_tokens: int) -> int:
        """Blocks to allocate so that `req`'s table covers `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(req.tables.block_table))

    def can_admit(self, match: Match, num_new_tokens: int) -> bool:
        """The pool has room for a waiting request that takes `match` and computes `num_new_tokens` beyond it."""
        # Hits and copy sources that sit unreferenced in the cache stop being available once held.
        num_held = sum(self.pool.blocks[b].ref_cnt == 0 for b in match.held_block_ids)
        num_blocks = -(-(match.num_cached_tokens + num_new_tokens) // self.block_size) - len(match.hits)
        return self.pool.can_allocate(num_blocks * len(self.layout.groups) + num_held)

    def admit(self, req: CacheRequest, match: Match, num_new_tokens: int) -> AdmissionOutcome:
        """Give a waiting request the blocks of `match` and new ones for `num_new_tokens` beyond it: it holds its
        hits, takes the loaded blocks into its first new blocks and publishes them, and holds its segment sources,
        or its last block's cached copy, until the step after this one has copied them. Returns what it took: its
        reuse record, the copy jobs, the tiers' read time and, scoring its prompt, the hits' stored records."""
        assert not req.tables.block_table, "admission is for a request that holds no blocks"
        self.pool.hold(match.hits)
        self.pool.end_retention(req.session.key)  # its session is back: what it retained and did not take, cached
        req.tables.block_table = list(match.hits)
        req.tables.block_uids = [self.pool.blocks[b].uid for b in match.hits]
        records = ()
        if req.scope is ReuseScope.SCORED and match.hits:  # before allocating below can evict the block after them
            records = self.prompt_logprobs.take(req, [self._key(req, i) for i in range(len(match.hits) + 1)])
        if match.plan is not None:
            self.pool.hold(match.plan.source_block_ids)
            req.pending.segment_plan = match.plan
            req.tables.num_exact_tokens = match.plan.runs[0].start
        if match.last_blocks:
            self.pool.hold(match.last_blocks)
            req.pending.last_block_sources = list(match.last_blocks)
        self.coordinator.admit(req, match)
        self.allocate(req, match.num_cached_tokens + num_new_tokens)
        jobs = CopyJobs()
        jobs.copies += [(source, table[len(match.hits)])
                        for source, table in zip(match.last_blocks, req.block_tables, strict=False)]
        load_seconds = None
        if match.loads:
            load_seconds = req.pending.tier_load.result().seconds
            self._fill(req, len(match.hits), match.loads, jobs)
        req.pending.tier_load = None
        return AdmissionOutcome(self._reuse_of(req, match), jobs, load_seconds, records)

    def _reuse_of(self, req: CacheRequest, match: Match) -> ReuseRecord:
        """The reuse record of `req`'s prompt admitted with `match`: cached (per tier loaded from) and reused tokens,
        the rest computed."""
        loaded: dict[str, int] = {}
        for block in match.loads:
            loaded[block.tier] = loaded.get(block.tier, 0) + self.block_size
        plan = match.plan
        return ReuseRecord.planned(req.num_prompt_tokens, match.num_cached_tokens, plan.num_tokens if plan else 0,
                                   plan.num_shifted_tokens if plan else 0, loaded)

    def can_allocate(self, req: CacheRequest, num_tokens: int) -> bool:
        """A running request's tables can grow to cover `num_tokens` tokens."""
        return self.pool.can_allocate(self.num_new_blocks(req, num_tokens) * len(self.layout.groups))

    def allocate(self, req: CacheRequest, num_tokens: int) -> None:
        num_blocks = self.num_new_blocks(req, num_tokens)
        blocks = self.pool.allocate(num_blocks * len(self.layout.groups))  # every group's, or none
        for g, table in enumerate(req.block_tables):
            table.extend(blocks[g * num_blocks:(g + 1) * num_blocks])

    def _fill(self, req: CacheRequest, first: int, loads: Sequence[LoadedBlock], jobs: CopyJobs) -> None:
        """Put loaded K/V into the request's blocks `first`, ... (a job) and publish them. A block from a farther tier
        is also written to the nearer ones (a Redis hit lands on the local disk)."""
        positions = [self._position(req, first + j) for j in range(len(loads))]
        tiers = self.tier_loads.write(positions, loads, jobs)
        self._publish(req, (first + len(loads)) * self.block_size, tiers, jobs)

    # --- after a forward ----------------------------------------------------------------------------
    def update(self, req: CacheRequest, num_computed_tokens: int, *, exact: bool = False,
               prompt_logprobs: Sequence = ()) -> CopyJobs:
        """A forward has computed `req` up to `num_computed_tokens`: let its copy sources go (their K/V are in its own
        blocks now), mark its K/V exact if the repair recomputed every reused token (`exact`), publish the full blocks
        that hold exact K/V (returning the lower tiers' writes as jobs), and, scoring its prompt, store the prompt
        logprob records of its published blocks whose every position `prompt_logprobs` (the records known so far,
        from position 0, which has none) holds."""
        self._release_sources(req)
        if exact:
            req.tables.num_exact_tokens = None
        jobs = CopyJobs()
        if self.caches(req):
            self._publish(req, num_computed_tokens, self.tiers.tier_names if self.tiers else [], jobs)
        if self.caches(req):
            self.coordinator.publish_windows(req)
        self.coordinator.release_passed(req, num_computed_tokens)
        if req.prompt_logprobs is not None:
            self.prompt_logprobs.store(req, prompt_logprobs, publishes=self.caches(req))
        return jobs

    def _release_sources(self, req: CacheRequest) -> None:
        pending = req.pending
        if pending.segment_plan is not None:
            self.pool.free(pending.segment_plan.source_block_ids)
            pending.segment_plan = None
        if pending.last_block_sources:
            self.pool.free(pending.last_block_sources)
            pending.last_block_sources = []

    def _publish(self, req: CacheRequest, num_computed_tokens: int, tiers: Sequence[str], jobs: CopyJobs) -> None:
        """Register the exact full blocks not yet registered, and queue those that got a new identity (not a twin's)
        for `tiers` (not those of a position a window has passed: an entry holds every group's block)."""
        stored: list[StoredBlock] = []
        stored_ids: list[tuple[int, ...]] = []
        bs = self.block_size
        for i in self.coordinator.full.publish(req, num_computed_tokens):
            position = self._position(req, i)
            if NULL_BLOCK not in position:
                stored.append(StoredBlock(req.tables.block_keys[i], req.tables.block_keys[i - 1] if i else None,
                                          tuple(req.token_ids[i * bs:(i + 1) * bs])))
                stored_ids.append(position)
        jobs.store(stored, stored_ids, tiers)

    @staticmethod
    def _position(req: CacheRequest, index: int) -> tuple[int, ...]:
        """Block `index` of `req` in every layer group, group 0 first (the null block where a window has passed it)."""
        return tuple(table[index] for table in req.block_tables)

    # --- pinned prefixes (pins.py) -----------------------------------------------------------------------
    def cached_chain(self, req: CacheRequest) -> tuple[list[int], int]:
        """The pool blocks a request with `req`'s prompt would hit now, every layer group's, and how many prompt
        tokens they cover."""
        hits, windows = self.coordinator.find_hit(req, self.match_prefix(req), max(1, self.min_match_blocks))
        return hits + [b for window in windows for b in window], len(hits) * self.block_size

    def can_pin(self, req: CacheRequest, tenant: str | None = None, num_tenants: int = 1) -> bool:
        """The cached chain of `req`'s prompt fits within the pins' share of the pool, and within `tenant`'s share of
        that (split among `num_tenants`; pins.py); an empty one always does."""
        block_ids, num_tokens = self.cached_chain(req)
        return not num_tokens or self.pins.can_pin(self._key(req, num_tokens // self.block_size - 1), block_ids,
                                                   tenant, num_tenants)

    def pin(self, req: CacheRequest, expires_at: float | None, tenant: str | None = None, num_tenants: int = 1) -> int:
        """Hold the cached chain of `req`'s prompt for `tenant` until `expires_at` (time.monotonic(); None: until
        unpinned); the prompt tokens it covers (0: nothing of it is cached)."""
        block_ids, num_tokens = self.cached_chain(req)
        if num_tokens:
            self.pins.pin(self._key(req, num_tokens // self.block_size - 1), block_ids, num_tokens, expires_at,
                          tenant, num_tenants)
        return num_tokens

    # --- n > 1: choices forked from one prompt ---------------------------------------------------------
    def can_fork(self, req: CacheRequest, num_computed_tokens: int) -> bool:
        """Blocks are free for the copy of `req`'s partial last block (in every group), if it has one."""
        return self.pool.can_allocate(int(num_computed_tokens % self.block_size > 0) * len(self.layout.groups))

    def fork(self, parent: CacheRequest, child: CacheRequest, num_computed_tokens: int) -> CopyJobs:
        """Give `child` (a request with the parent's tokens and no blocks) the parent's K/V for its first
        `num_computed_tokens`: the full blocks shared (one more reference each), the partial last block copied on
        write (a job)."""
        assert not child.tables.block_table
        assert child.token_ids[:num_computed_tokens] == parent.token_ids[:num_computed_tokens]
        num_full = num_computed_tokens // self.block_size
        self.coordinator.fork(parent, child, num_full)
        jobs = CopyJobs()
        starts = [0, *child.tables.window_starts]  # each table's first block held; the null block before it
        for parent_table, child_table, start in zip(parent.block_tables, child.block_tables, starts, strict=True):
            shared = parent_table[:num_full]
            self.pool.hold(shared[start:])
            child_table += shared
            if num_computed_tokens % self.block_size:
                child_table += self.pool.allocate(1)
                jobs.copies.append((parent_table[num_full], child_table[-1]))
        child.tables.block_keys = parent.tables.block_keys[:num_full]
        child.tables.block_uids = parent.tables.block_uids[:num_full]
        child.tables.num_exact_tokens = parent.tables.num_exact_tokens
        return jobs

    def free(self, req: CacheRequest, finished: bool = True, num_cached_tokens: int = 0) -> None:
        """Let go of every block `req` holds. `finished`: this is its end, which the eviction policy is told, with the
        prompt tokens its last admission took from the cache (`num_cached_tokens`; False: a preemption, which admits
        it again)."""
        self._release_sources(req)
        req.pending.tier_load = None
        release = self._release(req, num_cached_tokens) if finished else None
        block_ids = self.coordinator.release_order(req)
        if finished and self.pool.can_retain(req.session, block_ids):
            self.pool.retain(req.session, block_ids, release, self.clock())
        elif finished:
            self.pool.end_retention(req.session.key)
        self.pool.free(block_ids, release=release)
        req.tables.release()

    @staticmethod
    def _release(req: CacheRequest, num_cached_tokens: int) -> Release:
        uids, keys = req.tables.block_uids, req.tables.block_keys
        num_published = next((i for i, uid in enumerate(uids) if uid is None), len(uids))
        return Release(req.num_prompt_tokens, req.num_tokens - req.num_prompt_tokens, num_cached_tokens,
                       keys[num_published - 1] if num_published else None)

    # --- reporting -----------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_blocks_in_use_by_group(self, holders: Sequence[CacheRequest]) -> tuple[int, ...]:
        """Per layer group, the distinct blocks `holders` (the requests holding blocks) hold in it."""
        groups: list[set[int]] = [set() for _ in self.layout.groups]
        for req in holders:
            for held, table in zip(groups, req.block_tables, strict=False):
                held.update(table)
        for held in groups:
            held.discard(NULL_BLOCK)
        return tuple(map(len, groups))

    def check_integrity(self, holders: Sequence[CacheRequest] = ()) -> None:
        """The pool is consistent, each block of `holders` (requests holding blocks) and of the pins has exactly their
        references, and the segment index names exactly the published blocks."""
        self.pool.check_integrity()
        held: dict[int, int] = {}
        for block_id in self.pins.held_block_ids():
            held[block_id] = held.get(block_id, 0) + 1
        for req in holders:
            req.tables.check_integrity(req.num_tokens // self.block_size)
            for block_id in self.coordinator.held(req) + req.pending.held_block_ids():
                held[block_id] = held.get(block_id, 0) + 1
        for block_id, count in held.items():
            assert self.pool.blocks[block_id].ref_cnt == count, f"block {block_id} held {count}x, ref_cnt differs"
        if self.indexes_segments:
            self.segments.check_integrity(self.pool.blocks)
        self.prompt_logprobs.check_integrity()
        self.pins.check_integrity()
