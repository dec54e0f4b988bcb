"""The segment index on its own (no model): the rolling window hash, and find_runs on hand-built blocks.

find_runs scans the uncovered region of a new prompt tail-first at every token offset, confirms each hash hit by
its tokens and extra key, extends hits backwards to maximal runs of consecutive cached blocks, and keeps runs of
at least `min_blocks` blocks.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvreuse.kvcache import segment
from kvreuse.kvcache.block import KVCacheBlock
from kvreuse.kvcache.segment import SegmentIndex, SegmentRun, window_hashes

BS = 4
KEY = b"model-fp32-bs4"
_ids = iter(range(1, 1_000_000))


def direct_hash(window: list[int]) -> int:
    """The polynomial hash of one window, computed from its definition: sum of (token + 1) * BASE^(n - 1 - i)."""
    n = len(window)
    return sum((t + 1) * pow(segment._BASE, n - 1 - i, segment._MOD) for i, t in enumerate(window)) % segment._MOD


def block(tokens, position: int = 0, extra_key: bytes = KEY, **fields) -> KVCacheBlock:
    """A published block (it has a key) holding `tokens`, computed at `position`."""
    block_id = next(_ids)
    return KVCacheBlock(block_id, block_key=b"key-%d" % block_id, token_ids=tuple(tokens), position=position,
                        extra_key=extra_key, **fields)


def index_of(*blocks: KVCacheBlock) -> SegmentIndex:
    index = SegmentIndex(BS)
    for b in blocks:
        index.add(b)
    return index


def runs_of(index: SegmentIndex, tokens: list[int], min_blocks: int = 1, begin: int = 0, end: int | None = None,
            extra_key: bytes = KEY) -> list[tuple[int, list[KVCacheBlock]]]:
    runs = index.find_runs(tokens, begin, len(tokens) if end is None else end, extra_key, min_blocks)
    assert all(isinstance(r, SegmentRun) for r in runs)
    return [(r.start, r.blocks) for r in runs]


# --- window_hashes ----------------------------------------------------------------------------------------------
@settings(max_examples=50, deadline=None)
@given(tokens=st.lists(st.integers(0, 49_151), max_size=40), size=st.integers(1, 12))
def test_window_hashes_equal_the_direct_hash_of_every_window(tokens, size):
    hashes = window_hashes(tokens, size)
    assert hashes == [direct_hash(tokens[t:t + size]) for t in range(len(tokens) - size + 1)]


def test_window_hashes_empty_when_shorter_than_the_window_and_one_when_equal():
    assert window_hashes([], 4) == []
    assert window_hashes([1, 2, 3], 4) == []
    assert window_hashes((1, 2, 3, 4), 4) == [direct_hash([1, 2, 3, 4])]


def test_equal_windows_at_different_offsets_hash_equal():
    rng = random.Random(0)
    doc = [rng.randrange(50_000) for _ in range(BS)]
    tokens = [7, 8, 9] + doc + [1] * 5 + doc + [2]
    hashes = window_hashes(tokens, BS)
    assert hashes[3] == hashes[3 + BS + 5] == direct_hash(doc)
    # Token 0 and the empty token are told apart (tokens enter the hash as token + 1), and so is order.
    assert window_hashes([0, 0, 1], 2)[0] != window_hashes([0, 0, 1], 2)[1]
    assert window_hashes([1, 2], 2) != window_hashes([2, 1], 2)


# --- find_runs --------------------------------------------------------------------------------------------------
def test_a_run_is_found_at_an_offset_off_the_block_grid():
    a, b = block([10, 11, 12, 13], position=0), block([14, 15, 16, 17], position=BS)
    index = index_of(a, b)
    tokens = [1, 2, 3, *a.token_ids, *b.token_ids, 99]      # the pair moved by 3 tokens: not a multiple of BS
    [run] = index.find_runs(tokens, 0, len(tokens), KEY, 1)
    assert (run.start, run.blocks) == (3, [a, b])
    assert run.num_tokens == 2 * BS and run.shifted


def test_a_run_at_its_own_position_is_not_shifted():
    a = block([10, 11, 12, 13], position=8)
    [run] = index_of(a).find_runs([0] * 8 + [10, 11, 12, 13], 0, 12, KEY, 1)
    assert run.start == 8 and not run.shifted


def test_search_is_tail_first():
    # [5, 5, 5, 5, 5] holds the cached window [5, 5, 5, 5] at offsets 0 and 1: the tail one is taken.
    x = block([5, 5, 5, 5])
    assert runs_of(index_of(x), [5, 5, 5, 5, 5]) == [(1, [x])]
    # Two overlapping candidates on different grids: the one nearer the tail wins and the other is not used.
    head, tail = block([1, 2, 3, 4]), block([3, 4, 5, 6])
    assert runs_of(index_of(head, tail), [1, 2, 3, 4, 5, 6]) == [(2, [tail])]


def test_runs_are_extended_backwards_to_maximal_runs_and_returned_in_order():
    a, b, c = block([10, 11, 12, 13]), block([14, 15, 16, 17]), block([18, 19, 20, 21])
    d = block([30, 31, 32, 33])
    index = index_of(a, b, c, d)
    tokens = [0, *a.token_ids, *b.token_ids, *c.token_ids, 0, 0, *d.token_ids, 0]
    assert runs_of(index, tokens) == [(1, [a, b, c]), (1 + 3 * BS + 2, [d])]
    # A run is cut where the cached blocks stop being consecutive in the prompt (here b is missing).
    tokens = [*a.token_ids, 0, *c.token_ids]
    assert runs_of(index, tokens) == [(0, [a]), (BS + 1, [c])]


def test_search_stays_inside_begin_end():
    a, b = block([10, 11, 12, 13]), block([14, 15, 16, 17])
    index = index_of(a, b)
    tokens = [*a.token_ids, *b.token_ids, *a.token_ids]
    assert runs_of(index, tokens, begin=2) == [(BS, [b, a])]           # the first a starts before `begin`
    assert runs_of(index, tokens, begin=0, end=2 * BS) == [(0, [a, b])]  # the last a ends after `end`
    assert runs_of(index, tokens, begin=1, end=2 * BS - 1) == []


def test_min_blocks_is_honoured_and_a_too_short_hit_does_not_hide_a_longer_run_on_another_grid():
    p, q, r = block([1, 2, 3, 4]), block([5, 6, 7, 8]), block([8, 9, 9, 9])
    index = index_of(p, q, r)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9]
    # Tail first: r (1 block) is found first; with min_blocks=2 it is too short, and the scan goes on one token at
    # a time into it, where q, extended back to p, makes a run of 2.
    assert runs_of(index, tokens, min_blocks=2) == [(0, [p, q])]
    assert runs_of(index, tokens, min_blocks=3) == []
    # With min_blocks=1 the tail hit r is kept, and p is what remains before it (q overlaps r).
    assert runs_of(index, tokens, min_blocks=1) == [(0, [p]), (7, [r])]
    # min_blocks <= 0 means 1.
    assert runs_of(index, tokens, min_blocks=0) == runs_of(index, tokens, min_blocks=1)


def test_a_different_extra_key_never_matches():
    a = block([10, 11, 12, 13], extra_key=b"tenant-a")
    index = index_of(a)
    tokens = [0, 10, 11, 12, 13]
    assert runs_of(index, tokens, extra_key=b"tenant-a") == [(1, [a])]
    assert runs_of(index, tokens, extra_key=b"tenant-b") == []
    assert runs_of(index, tokens, extra_key=b"") == []


def test_a_hash_collision_with_different_tokens_is_never_returned(monkeypatch):
    # Every window of every size hashes to 0: each lookup finds the cached block, only its tokens tell them apart.
    monkeypatch.setattr(segment, "window_hashes", lambda token_ids, size: [0] * max(0, len(token_ids) - size + 1))
    a = block([10, 11, 12, 13])
    index = index_of(a)
    assert runs_of(index, [20, 21, 22, 23, 24, 25]) == []
    assert runs_of(index, [20, 10, 11, 12, 13, 25]) == [(1, [a])]
    # Two cached blocks under one (colliding) key: each is returned only where its own tokens are.
    b = block([14, 15, 16, 17])
    index.add(b)
    index.check_integrity([a, b])                    # both indexed, each under its own (equal) key
    assert runs_of(index, [14, 15, 16, 17, 0, 10, 11, 12, 13]) == [(0, [b]), (5, [a])]


def test_among_equal_blocks_the_predecessor_of_the_run_is_preferred():
    # Two cached copies of the same tokens; the one whose uid is the next block's parent_uid extends the run.
    successor_parent = block([10, 11, 12, 13], uid=7, last_access=1)
    other = block([10, 11, 12, 13], uid=8, last_access=99)           # more recent, but from another sequence
    successor = block([14, 15, 16, 17], uid=9, parent_uid=7)
    index = index_of(other, successor_parent, successor)
    assert runs_of(index, [0, 10, 11, 12, 13, 14, 15, 16, 17]) == [(1, [successor_parent, successor])]
    # With no predecessor to follow: the one computed at this very position, then the most recently used.
    at_position = block([10, 11, 12, 13], position=1, uid=10, last_access=0)
    assert runs_of(index_of(other, at_position), [0, 10, 11, 12, 13]) == [(1, [at_position])]
    assert runs_of(index_of(other, successor_parent), [0, 10, 11, 12, 13]) == [(1, [other])]


def test_partial_blocks_are_not_indexed():
    index = SegmentIndex(BS)
    partial = block([10, 11, 12])
    index.add(partial)
    index.check_integrity([partial])                 # published but not full: not indexed
    assert runs_of(index, [10, 11, 12, 13]) == []


def test_remove_then_no_match():
    a, b = block([10, 11, 12, 13]), block([10, 11, 12, 13])
    index = index_of(a, b)
    index.check_integrity([a, b])
    index.remove(a)
    index.check_integrity([b])
    assert runs_of(index, [10, 11, 12, 13]) == [(0, [b])]
    index.remove(b)
    index.check_integrity([])
    assert runs_of(index, [10, 11, 12, 13]) == []
    index.remove(b)                                  # removing what is not indexed is a no-op
    index.check_integrity([])


def test_check_integrity():
    a, b = block([10, 11, 12, 13]), block([14, 15, 16, 17])
    unpublished = KVCacheBlock(next(_ids))
    index = index_of(a, b)
    index.check_integrity([a, b, unpublished])
    with pytest.raises(AssertionError, match=f"segment index out of step: \\[{a.block_id}\\]"):
        index.check_integrity([b])                   # a is indexed but no longer published
    c = block([18, 19, 20, 21])
    with pytest.raises(AssertionError, match=f"segment index out of step: \\[{c.block_id}\\]"):
        index.check_integrity([a, b, c])             # c is published but not indexed
    b.token_ids = (1, 2, 3, 4)                       # the block was reused for other tokens without remove/add
    with pytest.raises(AssertionError, match=f"block {b.block_id} indexed under a stale key"):
        index.check_integrity([a, b])
