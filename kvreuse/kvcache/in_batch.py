"""In-batch prefix caching (SGLang's, extended to segments): of several equal prompts arriving together only the first
is computed, and the rest wait a step to reuse it. Whether a waiting request gains by waiting, for the KVCacheManager
(`gains_by_waiting`), which the scheduler asks."""

from __future__ import annotations

from collections.abc import Sequence

from kvreuse.kvcache.match import Match
from kvreuse.kvcache.request import CacheRequest, ReuseScope
from kvreuse.kvcache.segment import SegmentPlan
from kvreuse.kvcache.tokens import common_prefix_length


def gains_by_waiting(req: CacheRequest, match: Match, publishing: Sequence[tuple[CacheRequest, int]], block_size: int,
                     need: int, segments: bool) -> bool:
    """Whether `req` (a request that uses the cache), admitted one step later than with `match`, would reuse at least
    `need` more blocks: blocks that the requests in `publishing` (each with its computed tokens once this step has
    run) compute exactly and publish in this step; beyond its exact prefix too where `segments` (segment reuse) is
    on."""
    if not publishing:
        return False
    bs = block_size
    usable, num_cached_blocks, scored = (req.num_tokens - 1) // bs, match.num_cached_blocks, _scored(req)
    published: set[tuple[int, ...]] = set()  # contents of the blocks this step publishes
    gained = 0
    for other, num_computed in publishing:
        if not other.use_cache or other.extra_key != req.extra_key:
            continue
        if scored and not (_scored(other) and other.prompt_logprobs >= req.prompt_logprobs):
            continue  # it publishes K/V without the prompt logprobs req needs
        end = other.tables.num_publishable_tokens(num_computed) // bs
        if end <= len(other.tables.block_uids):
            continue  # publishes nothing new this step (a decode, mostly): nothing to wait for
        published.update(tuple(other.token_ids[i * bs:(i + 1) * bs]) for i in range(len(other.tables.block_uids), end))
        # Exact prefix: the blocks req shares from the start with one that publishes them (scoring a prompt, the
        # last of them would be computed again: see KVCacheManager.match_prefix).
        common = common_prefix_length(other.token_ids[:min(end, usable) * bs], req.token_ids)
        gained = max(gained, common // bs - int(scored) - num_cached_blocks)
    if gained >= need or scored or not segments or not published:
        return gained >= need
    return num_published_windows(req, num_cached_blocks, match.plan, published, need, bs) >= need


def _scored(req: CacheRequest) -> bool:
    return req.scope is ReuseScope.SCORED


def num_published_windows(req: CacheRequest, num_hits: int, plan: SegmentPlan | None,
                          published: set[tuple[int, ...]], need: int, block_size: int) -> int:
    """Non-overlapping windows of the part that neither hits nor `plan` cover, at any offset, whose contents are those
    of a block published this step (counted up to `need`)."""
    bs = block_size
    covered = set(plan.positions()) if plan else set()
    region = req.token_ids[num_hits * bs:req.num_tokens - 1]
    t, num_windows = 0, 0
    while t + bs <= len(region) and num_windows < need:
        start = num_hits * bs + t
        if tuple(region[t:t + bs]) in published and start not in covered and start + bs - 1 not in covered:
            num_windows, t = num_windows + 1, t + bs
        else:
            t += 1
    return num_windows
