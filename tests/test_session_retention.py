"""Session retention (kvcache/retention.py): a session's blocks, left by a request with a `prompt_cache_key`, are
evicted after every other cached block, the newest retention first and its tail first; they go to the policy when the
session's next request is admitted or the retention expires; retentions keep within `cache.session_max_share`; and an
agent loop on a pool too small for its sessions computes fewer prompt tokens with them than without (LRU alone evicts
exactly the session whose tool is about to return)."""

from __future__ import annotations

import random

from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvreuse.kvcache.accounting import ReuseRecord
from kvreuse.kvcache.layout import KVLayout
from kvreuse.kvcache.manager import KVCacheManager

from .helpers import app_server, tiny_engine
from .server_process import http_client
from .test_sliding_window_cache import BLOCK as WINDOW_BLOCK
from .test_sliding_window_cache import WINDOW, gemma_args
from .test_sliding_window_cache import tokens as window_tokens

BS = 4


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def manager(num_blocks: int, max_retained_blocks: int | None = None, policy: str = "lru") -> KVCacheManager:
    kv = KVCacheManager(num_blocks, BS, policy=policy, fingerprint="test",
                        max_retained_blocks=num_blocks if max_retained_blocks is None else max_retained_blocks)
    kv.clock = Clock()
    return kv


def run(kv: KVCacheManager, token_ids: list[int], session: str | None = None, retention_s: float = 60.0,
        salt: str | None = None) -> ReuseRecord:
    """Admit, compute and publish a whole prompt, then end the request; what its admission took from the cache."""
    req = kv.new_request(list(token_ids), cache_salt=salt, session_key=session, retention_s=retention_s)
    match = kv.match(req)
    num_new = req.num_tokens - match.num_cached_tokens
    assert kv.can_admit(match, num_new), "the pool has no room"
    reuse = kv.admit(req, match, num_new).reuse
    kv.update(req, req.num_tokens)
    kv.check_integrity([req])
    kv.free(req, num_cached_tokens=reuse.cached_tokens)
    kv.check_integrity()
    return reuse


def tokens(tag: int, num_blocks: int, start: int = 0) -> list[int]:
    return [1000 * tag + i for i in range(start * BS, num_blocks * BS)]


def cached_blocks(kv: KVCacheManager, token_ids: list[int]) -> int:
    """Leading blocks of `token_ids` in the pool (a prompt of one more token would hit them all)."""
    return len(kv.match_prefix(kv.new_request([*token_ids, 7])))


def test_retained_blocks_are_evicted_after_the_policys_the_newest_retention_first_and_its_tail_first():
    kv = manager(12)
    run(kv, tokens(1, 3), session="a")   # retained first: kept longest
    run(kv, tokens(2, 3))                # no session: the policy's
    run(kv, tokens(3, 3), session="c")   # retained last: the first retained to go
    assert len(kv.pool.retention) == 6 and len(kv.pool.evictable) == 3
    kv.pool.allocate(3 + 3)              # (3 free) + the policy's three
    assert cached_blocks(kv, tokens(2, 3)) == 0 and cached_blocks(kv, tokens(1, 3)) == 3
    assert cached_blocks(kv, tokens(3, 3)) == 3
    kv.pool.allocate(1)                  # then c's last block: its first two stay usable
    assert cached_blocks(kv, tokens(3, 3)) == 2 and cached_blocks(kv, tokens(1, 3)) == 3
    kv.pool.allocate(2)
    assert cached_blocks(kv, tokens(3, 3)) == 0 and cached_blocks(kv, tokens(1, 3)) == 3
    kv.pool.check_integrity()


def test_the_sessions_next_request_takes_what_it_retained_and_hands_the_rest_to_the_policy():
    kv = manager(16)
    first = tokens(1, 4)
    run(kv, first, session="a")
    assert len(kv.pool.retention) == 4
    # The client edited the last turn: the next request shares three blocks.
    edited = first[:3 * BS] + tokens(9, 1)
    req = kv.new_request(edited, session_key="a", retention_s=60.0)
    match = kv.match(req)
    assert match.num_cached_tokens == 3 * BS
    kv.admit(req, match, req.num_tokens - match.num_cached_tokens)
    assert len(kv.pool.retention) == 0 and len(kv.pool.evictable) == 1  # the edited-away block: an ordinary one
    assert kv.pool.retention.sessions == {}
    kv.update(req, req.num_tokens)
    kv.free(req)
    assert len(kv.pool.retention) == 4  # retained again, as the session's new chain
    kv.check_integrity()


def test_a_retention_ends_when_its_time_passes():
    kv = manager(16)
    run(kv, tokens(1, 2), session="a", retention_s=10.0)
    run(kv, tokens(2, 2), session="b", retention_s=30.0)
    kv.clock.now = 10.0
    kv.expire(kv.clock.now)
    assert list(kv.pool.retention.sessions) == [run_key(kv, "b")] and len(kv.pool.evictable) == 2
    kv.clock.now = 30.0
    kv.expire(kv.clock.now)
    assert not kv.pool.retention.sessions and len(kv.pool.retention) == 0 and len(kv.pool.evictable) == 4
    kv.check_integrity()


def run_key(kv: KVCacheManager, session: str, salt: str | None = None) -> bytes:
    return kv.new_request([1], cache_salt=salt, session_key=session).session.key


def test_retentions_keep_within_their_share_and_one_beyond_is_not_made():
    kv = manager(32, max_retained_blocks=5)
    run(kv, tokens(1, 3), session="a")
    run(kv, tokens(2, 3), session="b")   # 6 > 5: not retained, cached as any block
    assert list(kv.pool.retention.sessions) == [run_key(kv, "a")] and len(kv.pool.evictable) == 3
    run(kv, tokens(1, 5), session="a")   # a's own chain grows to 5: its old retention makes room for it
    assert len(kv.pool.retention.retainers) == 5
    run(kv, tokens(1, 6), session="a")   # 6: a's retention ends, and is not made again
    assert not kv.pool.retention.sessions and len(kv.pool.retention) == 0
    kv.check_integrity()


def test_a_shared_prefix_ranks_by_its_oldest_session_and_sessions_are_scoped_by_salt():
    kv = manager(20)
    shared = tokens(0, 2)
    run(kv, shared + tokens(1, 4, start=2), session="a")
    run(kv, shared + tokens(2, 4, start=2), session="b")
    assert len(kv.pool.retention) == 6
    kv.pool.allocate(20 - 6 + 2)        # b's own two go first; the shared two stay, with a's
    assert cached_blocks(kv, shared + tokens(2, 4, start=2)) == 2
    assert cached_blocks(kv, shared + tokens(1, 4, start=2)) == 4
    # The same key under another salt is another session: it does not end a's retention.
    assert run_key(kv, "a", salt="tenant-2") != run_key(kv, "a")
    kv.check_integrity()


def test_a_retained_block_evicted_and_reused_is_not_taken_for_the_retained_one():
    kv = manager(4)
    run(kv, tokens(1, 2), session="a")
    kv.pool.free(kv.pool.allocate(4))    # a's blocks are evicted, their ids reused
    run(kv, tokens(2, 2), session="b")   # on a's old block ids
    kv.pool.end_retention(run_key(kv, "a"))
    assert len(kv.pool.retention) == 2 and cached_blocks(kv, tokens(2, 2)) == 2
    kv.check_integrity()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["run", "alloc", "tick"]), st.integers(0, 5), st.integers(1, 6)),
                min_size=1, max_size=40))
def test_random_sessions_allocations_and_time_keep_every_structure_consistent(ops):
    kv = manager(24, max_retained_blocks=10)
    held = []
    for op, tag, size in ops:
        if op == "run" and kv.pool.num_free_blocks >= size + 1:
            run(kv, tokens(tag % 3, size), session=f"s{tag}" if tag < 4 else None, retention_s=5.0)
        elif op == "alloc" and kv.pool.can_allocate(size):
            held += kv.pool.allocate(size)
            if len(held) > 12:
                kv.pool.free(held)
                held = []
        elif op == "tick":
            kv.clock.now += size
            kv.expire(kv.clock.now)
        kv.pool.check_integrity()


def agent_loop(retention_s: float, num_sessions: int = 4, num_steps: int = 6, num_blocks: int = 64,
               last_steps: tuple[int, ...] | None = None) -> tuple[int, int]:
    """Sessions of growing prompts, round robin (each step: the session's last prompt + 3 new blocks, as tool
    results and glue), on a pool that ends up holding three sessions' chains of four; each session ends after
    `num_steps` steps, or after its own number in `last_steps`; (prompt tokens computed, new ones)."""
    kv = manager(num_blocks)
    rng = random.Random(0)
    last_steps = last_steps or (num_steps,) * num_sessions
    prompts = {s: tokens(s, 2) for s in range(len(last_steps))}  # a 2-block system prompt of each
    computed = new = 0
    for step in range(max(last_steps)):
        for s, last in enumerate(last_steps):
            if step >= last:
                continue  # its conversation is over: it never comes back
            grown = prompts[s] + [rng.randrange(10**6) for _ in range(3 * BS)]
            reuse = run(kv, grown, session=f"agent-{s}", retention_s=retention_s)
            if step:
                computed += reuse.computed_prompt_tokens
                new += len(grown) - len(prompts[s])
            prompts[s] = grown
    return computed, new


def test_an_agent_loop_on_a_small_pool_computes_fewer_tokens_with_session_retention():
    computed_lru, new = agent_loop(retention_s=0.0)
    computed_kept, same_new = agent_loop(retention_s=60.0)
    assert same_new == new
    print(f"computed/new: LRU {computed_lru / new:.2f}, with retention {computed_kept / new:.2f}")
    assert computed_kept < 0.75 * computed_lru, (computed_kept, computed_lru)


def test_sessions_whose_conversation_is_over_do_not_keep_the_pool_from_those_still_running():
    # Sessions ending after 3, 6, 9 and 9 steps: those that ended stay retained (their expiry is far), the oldest
    # retentions of all. Ranked newest first they kept the pool from the sessions still running (2.01 computed per
    # new token against LRU's 1.00); overtaken by sessions retained after them, they go first.
    computed_lru, new = agent_loop(retention_s=0.0, last_steps=(3, 6, 9, 9))
    computed_kept, same_new = agent_loop(retention_s=60.0, last_steps=(3, 6, 9, 9))
    assert same_new == new
    print(f"computed/new: LRU {computed_lru / new:.2f}, with retention {computed_kept / new:.2f}")
    assert computed_kept <= computed_lru, (computed_kept, computed_lru)


def test_a_retention_overtaken_by_a_later_ones_session_goes_before_those_still_in_order():
    kv = manager(16)
    run(kv, tokens(1, 3), session="a")   # a, b, c retained in this order
    run(kv, tokens(2, 3), session="b")
    run(kv, tokens(3, 3), session="c")
    run(kv, tokens(2, 4), session="b")   # b is back before a: a broke the order (its conversation may be over)
    assert cached_blocks(kv, tokens(2, 3)) == 3 and len(kv.pool.retention) == 10
    kv.pool.allocate(16 - 10 + 3)        # the free six, then a's three: a goes first, not b, the newest
    assert cached_blocks(kv, tokens(1, 3)) == 0
    assert cached_blocks(kv, tokens(2, 4)) == 4 and cached_blocks(kv, tokens(3, 3)) == 3
    kv.pool.allocate(1)                  # then the newest retention still in order (b's), its tail first
    assert cached_blocks(kv, tokens(2, 4)) == 3 and cached_blocks(kv, tokens(3, 3)) == 3
    kv.check_integrity()


def test_a_session_overtaken_and_back_overtakes_none_of_those_retained_after_it():
    kv = manager(16)
    run(kv, tokens(1, 3), session="a")
    run(kv, tokens(2, 3), session="b")
    run(kv, tokens(3, 3), session="c")
    run(kv, tokens(2, 4), session="b")   # a overtaken
    run(kv, tokens(1, 4), session="a")   # a back: c and b were retained after a left, they are still in order
    assert len(kv.pool.retention) == 11
    kv.pool.allocate(16 - 11 + 1)        # the free five, then the newest retention's tail: a's
    assert cached_blocks(kv, tokens(1, 4)) == 3
    assert cached_blocks(kv, tokens(2, 4)) == 4 and cached_blocks(kv, tokens(3, 3)) == 3
    kv.check_integrity()


# --- through the server --------------------------------------------------------------------------------------
def test_prompt_cache_key_retains_the_sessions_blocks_and_bad_hints_are_a_400_naming_the_field(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir)
    chat = {"model": "tiny", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "system", "content": "You plan trips with tools. " * 8},
                         {"role": "user", "content": "Book a train to Lyon."}]}
    with app_server(engine, timeout=60.0) as (_, root), http_client(60.0) as http:
        def sessions() -> dict:
            return http.get(f"{root}/cache/stats").json()["sessions"]

        assert http.post(f"{root}/v1/chat/completions", json=chat).status_code == 200
        assert sessions()["num_sessions"] == 0               # no key: nothing retained
        for retention in (None, "in_memory", "24h"):
            answer = http.post(f"{root}/v1/chat/completions",
                               json={**chat, "prompt_cache_key": "trip-42", "prompt_cache_retention": retention})
            assert answer.status_code == 200, answer.text
        stats = sessions()
        assert stats["num_sessions"] == 1 and stats["blocks"] > 0 and stats["blocks"] == stats["blocks_evictable"]
        assert stats["next_expiry_s"] > 80_000                # the last one asked for a day
        for field, value, words in [("prompt_cache_retention", "1h", "in_memory"),
                                    ("prompt_cache_key", 42, "string"), ("prompt_cache_key", "k" * 1025, "1024"),
                                    ("prompt_cache_key", "", "at least 1")]:
            answer = http.post(f"{root}/v1/chat/completions", json={**chat, field: value})
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert error["param"] == field and words in error["message"], error
        completion = {"model": "tiny", "prompt": "Another session's plan.", "max_tokens": 2, "prompt_cache_key": "p7"}
        assert http.post(f"{root}/v1/completions", json=completion).status_code == 200
        assert sessions()["num_sessions"] == 2                # the engine served on, and completions take the key too
    engine.scheduler.check_integrity()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(1, 6), st.booleans()), min_size=1, max_size=24))
@example([(0, 3, False), (3, 3, False), (0, 3, False), (0, 2, False), (3, 3, False), (3, 2, False), (0, 1, False)])
@example([(0, 1, False), (0, 2, False), (1, 5, False), (1, 6, True), (0, 4, True), (3, 4, False), (0, 4, True),
          (0, 1, False)])
def test_sessions_on_a_sliding_window_layout_keep_every_structure_consistent(ops):
    # Retained chains there hold window blocks (group > 0) that go with the full-attention block they hang on.
    layout = KVLayout.of(gemma_args(6, pattern=3, window=WINDOW))
    kv = KVCacheManager(160, WINDOW_BLOCK, layout=layout, max_retained_blocks=80)
    kv.clock = Clock()
    for tag, num_windows, tick in ops:
        prompt = window_tokens(num_windows * WINDOW // 2 + tag, tag % 3)
        req = kv.new_request(prompt, session_key=f"s{tag}", retention_s=10.0)
        match = kv.match(req)
        if kv.can_admit(match, req.num_tokens - match.num_cached_tokens):
            kv.admit(req, match, req.num_tokens - match.num_cached_tokens)
            kv.update(req, req.num_tokens)
            kv.free(req)
        if tick:
            kv.clock.now += 4.0
            kv.expire(kv.clock.now)
        kv.check_integrity()
