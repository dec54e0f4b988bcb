"""Maps sequences to KV blocks: exact prefix matching at admission, growing block tables, publishing
fully computed blocks to the cache, and freeing."""

from __future__ import annotations

from kvreuse.engine.sequence import Sequence
from kvreuse.kvcache.block_pool import BlockPool
from kvreuse.kvcache.hashing import BlockHashFn, extra_keys, sha256_block_key
from kvreuse.kvcache.segment import SegmentIndex, SegmentPlan


class KVCacheManager:
    """Invariants: a running sequence's `block_table` covers its `num_computed_tokens`, and each block
    in it holds one reference from that sequence. Only exactly computed blocks (their whole prefix
    computed in this sequence, or itself an exact hit) are ever registered under chain keys."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True,
                 max_cached_blocks: int | None = None, policy: str = "lru", min_match_blocks: int = 1,
                 fingerprint: str = "", hash_fn: BlockHashFn = sha256_block_key, enable_segments: bool = False):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.enable_segments = enable_caching and enable_segments
        self.min_match_blocks = min_match_blocks
        self.fingerprint = fingerprint
        self.hash_fn = hash_fn  # a test can swap in a constant to prove hits are confirmed, not trusted
        self.pool = BlockPool(num_blocks, max_cached_blocks if enable_caching else 0, policy)
        self.segments = SegmentIndex(block_size)
        # Indexed whenever caching is on, so segment reuse can be switched on for a running engine.
        if enable_caching:
            self.pool.on_register.append(self.segments.add)
            self.pool.on_evict.append(self.segments.remove)

    def caches(self, seq: Sequence) -> bool:
        return self.enable_caching and seq.use_cache

    # --- prefix matching -----------------------------------------------------------------------------
    def _key(self, seq: Sequence, index: int) -> bytes:
        """Chain key of the seq's full block `index`, computing (and keeping) the keys before it."""
        if not seq.extra_key:
            seq.extra_key = extra_keys(self.fingerprint, self.block_size, seq.cache_salt)
        bs = self.block_size
        while len(seq.block_keys) <= index:
            i = len(seq.block_keys)
            parent = seq.block_keys[-1] if seq.block_keys else b""
            seq.block_keys.append(self.hash_fn(parent, seq.token_ids[i * bs:(i + 1) * bs], seq.extra_key))
        return seq.block_keys[index]

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached exact prefix of `seq` (confirmed token by token), capped so the
        last token is always computed; empty if shorter than `min_match_blocks` or caching is off."""
        if not self.caches(seq):
            return []
        hits: list[int] = []
        parent_uid = 0
        bs = self.block_size
        for i in range((seq.num_tokens - 1) // bs):
            block = self.pool.lookup(self._key(seq, i), seq.token_ids[i * bs:(i + 1) * bs], parent_uid)
            if block is None:
                break
            hits.append(block.block_id)
            parent_uid = block.uid
        return hits if len(hits) >= max(1, self.min_match_blocks) else []

    def match_segments(self, seq: Sequence, num_prefix_blocks: int) -> SegmentPlan | None:
        """Cached runs inside the part of `seq` that its exact prefix does not cover, leaving the last
        token to be computed; None if there are none or segment reuse is off."""
        if not (self.enable_segments and seq.use_cache):
            return None
        self._key(seq, 0)  # sets seq.extra_key
        runs = self.segments.find_runs(seq.token_ids, num_prefix_blocks * self.block_size, seq.num_tokens - 1,
                                       seq.extra_key, self.min_match_blocks)
        return SegmentPlan(runs) if runs else None

    def gains_by_waiting(self, seq: Sequence, hits: list[int], plan: SegmentPlan | None,
                         scheduled: list[Sequence]) -> bool:
        """Whether `seq`, admitted one step later, would reuse at least `min_match_blocks` more blocks: blocks
        that the sequences `scheduled` in this step compute exactly and publish after it. (SGLang's in-batch
        prefix caching, extended to segments: of several equal prompts arriving together only the first is
        computed, and the rest reuse it instead of computing it alongside.)"""
        if not self.caches(seq) or not scheduled:
            return False
        bs, need = self.block_size, max(1, self.min_match_blocks)
        self._key(seq, 0)  # sets seq.extra_key
        usable = (seq.num_tokens - 1) // bs  # full blocks before the last token, which is always computed
        published: set[tuple[int, ...]] = set()  # contents of the blocks this step publishes
        gained = 0
        for other in scheduled:
            if not self.caches(other) or other.extra_key != seq.extra_key:
                continue
            end = min(other.num_computed_tokens + other.num_scheduled_tokens, other.num_exact_tokens) // bs
            if end <= len(other.block_uids):
                continue  # publishes nothing new this step (a decode, mostly): nothing to wait for
            published.update(tuple(other.token_ids[i * bs:(i + 1) * bs]) for i in range(len(other.block_uids), end))
            # Exact prefix: the blocks seq shares from the start with one that publishes them.
            limit = min(end, usable) * bs
            pairs = zip(other.token_ids[:limit], seq.token_ids, strict=False)
            common = next((k for k, (x, y) in enumerate(pairs) if x != y), min(limit, seq.num_tokens))
            gained = max(gained, common // bs - len(hits))
        if gained >= need or not self.enable_segments or not published:
            return gained >= need
        # Segments: windows of the uncovered part, at any offset, with the contents of a published block.
        covered = set(plan.positions()) if plan else set()
        region = seq.token_ids[len(hits) * bs:seq.num_tokens - 1]
        t, num_windows = 0, 0
        while t + bs <= len(region) and num_windows < need:
            start = len(hits) * bs + t
            if tuple(region[t:t + bs]) in published and start not in covered and start + bs - 1 not in covered:
                num_windows, t = num_windows + 1, t + bs
            else:
                t += 1
        return num_windows >= need

    # --- allocation ----------------------------------------------------------------------------------
    def num_new_blocks(self, seq: Sequence, num_new_tokens: int, num_hit_blocks: int = 0) -> int:
        num_tokens = max(seq.num_computed_tokens, num_hit_blocks * self.block_size) + num_new_tokens
        return max(0, -(-num_tokens // self.block_size) - max(len(seq.block_table), num_hit_blocks))

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] = (),
                     plan: SegmentPlan | None = None) -> bool:
        # Hits and segment sources that sit unreferenced in the cache stop being available once held.
        held = set(hits) | set(plan.source_block_ids if plan else ())
        num_held = sum(self.pool.blocks[b].ref_cnt == 0 for b in held)
        return self.pool.can_allocate(self.num_new_blocks(seq, num_new_tokens, len(hits)) + num_held)

    def allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] = (),
                 plan: SegmentPlan | None = None) -> None:
        """Make room for `num_new_tokens` more KV entries of `seq`; a waiting sequence first takes its
        prefix hits, which count as computed, and holds its segment sources until they are copied."""
        if hits:
            assert not seq.block_table and seq.num_computed_tokens == 0, "hits only apply at admission"
            self.pool.touch(hits)
            seq.block_table = list(hits)
            seq.block_uids = [self.pool.blocks[b].uid for b in hits]
            seq.num_computed_tokens = len(hits) * self.block_size
        if plan is not None:
            self.pool.touch(plan.source_block_ids)
            seq.segment_plan = plan
            seq.num_exact_tokens = plan.runs[0].start
        seq.block_table.extend(self.pool.allocate(self.num_new_blocks(seq, num_new_tokens)))

    def release_sources(self, seq: Sequence) -> None:
        """The plan's K/V have been copied into the sequence's own blocks: let the sources go."""
        if seq.segment_plan is not None:
            self.pool.free(seq.segment_plan.source_block_ids)
            seq.segment_plan = None

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the blocks that the last step completed, so later requests can reuse them."""
        if not self.caches(seq):
            return
        bs = self.block_size
        for i in range(len(seq.block_uids), min(seq.num_computed_tokens, seq.num_exact_tokens) // bs):
            parent_uid = seq.block_uids[-1] if seq.block_uids else 0
            if i > 0 and parent_uid == 0:
                seq.block_uids.append(0)  # the chain is broken before this block: it stays private
                continue
            block_id, key, token_ids = seq.block_table[i], self._key(seq, i), seq.token_ids[i * bs:(i + 1) * bs]
            uid = self.pool.blocks[block_id].uid
            if not uid:
                # Computed here while an identical block got cached (a concurrent twin): same contents,
                # same identity, so the chain continues through it.
                twin = self.pool.lookup(key, token_ids, parent_uid)
                uid = twin.uid if twin else self.pool.register(block_id, key, token_ids, parent_uid, i * bs,
                                                               seq.extra_key)
            seq.block_uids.append(uid)

    def free(self, seq: Sequence) -> None:
        self.release_sources(seq)
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.block_uids = []
        seq.num_exact_tokens = 1 << 62

    # --- reporting -----------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def check_integrity(self, running: list[Sequence] = ()) -> None:
        self.pool.check_integrity()
        held: dict[int, int] = {}
        for seq in running:
            assert len(seq.block_table) * self.block_size >= seq.num_computed_tokens, f"{seq.request_id} short table"
            sources = seq.segment_plan.source_block_ids if seq.segment_plan else []
            for block_id in seq.block_table + sources:
                held[block_id] = held.get(block_id, 0) + 1
        for block_id, count in held.items():
            assert self.pool.blocks[block_id].ref_cnt == count, f"block {block_id} held {count}x, ref_cnt differs"
        if self.enable_caching:
            self.segments.check_integrity(self.pool.blocks)
