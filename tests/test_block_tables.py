"""BlockTables.check_integrity: the invariants of a request's tables, each broken once."""

import pytest

from kvreuse.kvcache.block import NULL_BLOCK
from kvreuse.kvcache.block_tables import BlockTables


def tables() -> BlockTables:
    """Three blocks, two published; one window group whose window starts at block 1."""
    return BlockTables(block_table=[5, 6, 7], block_keys=[b"a", b"b"], block_uids=[1, 2],
                       window_tables=[[NULL_BLOCK, 8, 9]], window_starts=[1], num_window_published=2,
                       num_logprob_blocks_stored=2)


def test_consistent_tables_pass():
    tables().check_integrity(num_full_blocks=2)
    BlockTables().check_integrity(num_full_blocks=0)


@pytest.mark.parametrize("break_it, message", [
    (lambda t: t.block_table.__setitem__(0, NULL_BLOCK), "null block"),
    (lambda t: t.window_starts.append(0), "without its start"),
    (lambda t: t.window_tables[0].pop(), "not as long"),
    (lambda t: t.window_tables[0].__setitem__(0, 4), "before its window"),
    (lambda t: t.window_tables[0].__setitem__(2, NULL_BLOCK), "inside its window"),
    (lambda t: t.block_keys.append(b"c"), "not full"),
    (lambda t: t.block_uids.extend([3, 4]), "more published blocks"),
    (lambda t: t.block_uids.__setitem__(0, None), "broken chain"),
    (lambda t: setattr(t, "num_window_published", 3), "beyond the published"),
    (lambda t: setattr(t, "num_logprob_blocks_stored", 3), "no key"),
])
def test_each_broken_invariant_is_caught(break_it, message):
    t = tables()
    break_it(t)
    with pytest.raises(AssertionError, match=message):
        t.check_integrity(num_full_blocks=2)


def test_release_forgets_the_blocks_and_keeps_the_keys():
    t = tables()
    t.num_exact_tokens = 4
    t.release()
    assert t.groups == [[]] and t.block_uids == [] and t.num_window_published == 0 and t.num_exact_tokens is None
    assert t.block_keys == [b"a", b"b"] and t.num_logprob_blocks_stored == 2
