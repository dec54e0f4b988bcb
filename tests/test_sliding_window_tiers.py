"""The disk and Redis tiers under a grouped pool (kvcache/layout.py): an entry holds one position's K/V of every layer
in the model's order, so a windows-only engine writes and loads whole positions, shares entries with an engine keeping
every layer (`cache.sliding_kv = full`), and continues a pool hit with a load when the pool holds the window the
loaded end reads. Outputs equal the cache off; the cached counts are exact, by tier."""

from __future__ import annotations

import pytest

from .helpers import greedy
from .test_sliding_window_cache import BLOCK, engine, tokens

PROMPT = tokens(9 * BLOCK + 5, 21)  # several windows long, a partial last block


@pytest.fixture(scope="module")
def reference(grouped_gemma_dir) -> dict[tuple[int, ...], list[int]]:
    llm = engine(grouped_gemma_dir, cache__enabled="false")
    return {tuple(p): llm.generate(p, greedy(6))[0].token_ids for p in (PROMPT, PROMPT[:6 * BLOCK + 2])}


def computed_then_closed(path: str, prompt: list[int], **sets) -> list[int]:
    llm = engine(path, **sets)
    out = llm.generate(prompt, greedy(6))[0].token_ids
    llm.engine.close()
    return out


def full_blocks(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK * BLOCK


@pytest.mark.parametrize("writer,reader", [("window", "window"), ("full", "window"), ("window", "full")])
def test_a_restarted_engine_loads_whole_positions_from_disk_whatever_the_layouts(grouped_gemma_dir, tmp_path, reference,
                                                                                  writer, reader):
    assert computed_then_closed(grouped_gemma_dir, PROMPT, cache__sliding_kv=writer, cache__disk__path=tmp_path) == \
        reference[tuple(PROMPT)]
    llm = engine(grouped_gemma_dir, cache__sliding_kv=reader, cache__disk__path=tmp_path)
    assert llm.engine.front_end.kv_layout.is_grouped == (reader == "window")
    out = llm.generate(PROMPT, greedy(6))[0]
    assert out.token_ids == reference[tuple(PROMPT)]
    assert out.usage.cached_by_tier() == {"memory": 0, "disk": full_blocks(PROMPT), "redis": 0}
    again = llm.generate(PROMPT, greedy(6))[0]  # the loaded positions' windows were published: a pool hit now
    assert again.usage.cached_by_tier() == {"memory": full_blocks(PROMPT), "disk": 0, "redis": 0}
    assert again.token_ids == reference[tuple(PROMPT)]
    llm.engine.scheduler.check_integrity()
    llm.engine.tiers.check_integrity()
    llm.engine.close()


@pytest.mark.parametrize("num_pool_tokens", [2 * BLOCK + 3, 8 * BLOCK + 3], ids=["window-in-load", "window-in-pool"])
def test_a_pool_hit_continued_by_a_load(grouped_gemma_dir, tmp_path, reference, num_pool_tokens):
    """The pool holds the first blocks (computed by a shorter prompt), the disk the rest: the request takes both. With
    the pool's part ending within a window of the load's end, the pool's window blocks before it are taken too."""
    computed_then_closed(grouped_gemma_dir, PROMPT, cache__disk__path=tmp_path)
    llm = engine(grouped_gemma_dir, cache__disk__path=tmp_path)
    in_pool = full_blocks(PROMPT[:num_pool_tokens])
    first = llm.generate(PROMPT[:num_pool_tokens], greedy(1))[0]  # its full blocks into the pool, from the disk
    assert first.usage.cached_tokens_disk == in_pool
    out = llm.generate(PROMPT, greedy(6))[0]
    assert out.usage.cached_by_tier() == {"memory": in_pool, "disk": full_blocks(PROMPT) - in_pool, "redis": 0}
    assert out.token_ids == reference[tuple(PROMPT)]
    llm.engine.scheduler.check_integrity()
    llm.engine.close()


def test_a_load_whose_window_the_pool_lacks_is_not_taken(grouped_gemma_dir, tmp_path, reference):
    """The pool's part ends within a window of the load's end, but its window blocks there are gone: the load would
    need them, so the request takes the pool's hit as its windows allow and computes the rest (never a claim of K/V it
    lacks)."""
    computed_then_closed(grouped_gemma_dir, PROMPT, cache__disk__path=tmp_path)
    llm = engine(grouped_gemma_dir, cache__disk__path=tmp_path)
    llm.generate(PROMPT[:8 * BLOCK + 3], greedy(1))  # loads 8 blocks; keeps their windows in the pool
    manager = llm.engine.kv_manager
    for block in [b for b in manager.pool.blocks if b.group and b.ref_cnt == 0 and b.block_key is not None
                  and b.position == 7 * BLOCK]:  # every window group's block at the pool part's last position
        manager.pool._uncache(block)
        manager.pool.free_block_ids.append(manager.pool._drop(block).block_id)
    out = llm.generate(PROMPT, greedy(6))[0]
    assert out.token_ids == reference[tuple(PROMPT)]
    assert out.usage.cached_tokens_disk == 0 and out.usage.cached_tokens == 7 * BLOCK
    llm.engine.scheduler.check_integrity()
    llm.engine.close()


def test_a_second_windows_only_engine_loads_from_redis(grouped_gemma_dir, redis_url, reference):
    salt = {"cache__redis__url": redis_url}
    prompt = PROMPT[:6 * BLOCK + 2]
    assert computed_then_closed(grouped_gemma_dir, prompt, **salt) == reference[tuple(prompt)]
    llm = engine(grouped_gemma_dir, **salt)
    assert llm.engine.front_end.kv_layout.is_grouped
    out = llm.generate(prompt, greedy(6))[0]
    assert out.token_ids == reference[tuple(prompt)]
    assert out.usage.cached_by_tier() == {"memory": 0, "disk": 0, "redis": full_blocks(prompt)}
    llm.engine.close()
