"""Sliding-window layers in the cache (kvcache/layout.py): Gemma 3-shaped random-weight models whose window layers keep
only what their window reads, against the same engine with the cache off and with every layer's K/V kept
(`cache.sliding_kv = full`): multi-turn chats several windows long, a request diverging inside the last block before
its end (vLLM #57610), preemption and eviction pressure, forks, prompt scoring; the layouts themselves; the KV bytes a
long context needs, measured from the pool."""

from __future__ import annotations

import random

import pytest
import torch

from kvreuse.config import ConfigError
from kvreuse.kvcache.layout import KVLayout
from kvreuse.layers.rotary import Rope
from kvreuse.model.args import ModelArgs
from kvreuse.sampling_params import SamplingParams

from .conftest import GROUPED_GEMMA_WINDOW
from .helpers import greedy, tiny_llm
from .test_architectures import build

WINDOW, BLOCK = GROUPED_GEMMA_WINDOW, 8  # a window that is not a multiple of the block size


def engine(path: str, **sets):
    return tiny_llm(path, cache__block_size=BLOCK, **sets)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 40000) for _ in range(n)]


# --- layouts --------------------------------------------------------------------------------------------


def gemma_args(num_layers: int, pattern: int = 6, window: int = 512) -> ModelArgs:
    kinds = tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers))
    return ModelArgs(architecture="gemma3", vocab_size=10, hidden_size=64, intermediate_size=128,
                     num_layers=num_layers, num_heads=4, num_kv_heads=1, head_dim=16, rope=Rope(10000.0),
                     rms_norm_eps=1e-6, max_position_embeddings=32768, layer_kinds=kinds, sliding_window=window)


def test_gemma3_270m_groups_its_18_layers_into_six_blocks_of_three():
    layout = KVLayout.of(gemma_args(18))
    assert layout.layers_per_block == 3 and len(layout.groups) == 6
    assert layout.groups[0].layer_ids == (5, 11, 17) and layout.groups[0].window is None
    assert [g.window for g in layout.window_groups] == [512] * 5
    assert sorted(i for g in layout.groups for i in g.layer_ids) == list(range(18))
    assert layout.slot_of[11] == 1 and layout.group_of[11] == 0 and layout.group_of[0] == 1


def test_a_group_short_of_layers_is_padded():
    """Gemma 3 1B: 26 layers, 4 of them full; the 22 sliding ones fill five groups of 4 and one of 2."""
    layout = KVLayout.of(gemma_args(26))
    assert layout.layers_per_block == 4
    assert [len(g.layer_ids) for g in layout.groups] == [4, 4, 4, 4, 4, 4, 2]


def test_models_without_both_kinds_and_sliding_kv_full_keep_one_group():
    assert not KVLayout.of(gemma_args(18), keep_window_kv=True).is_grouped
    assert not KVLayout.of(gemma_args(6, pattern=100)).is_grouped   # every layer slides (Mistral with a window)
    assert not KVLayout.of(gemma_args(6, pattern=1)).is_grouped     # every layer is full


def test_the_engine_groups_the_pool_and_says_so(grouped_gemma_dir):
    llm = engine(grouped_gemma_dir)
    front = llm.engine.front_end
    assert front.kv_layout.is_grouped and llm.engine.runner.kv_cache.shape[0] == 2
    assert "3 groups of 2 layers per block" in front.describe_kv()
    assert not engine(grouped_gemma_dir, cache__sliding_kv="full").engine.front_end.kv_layout.is_grouped


def test_window_with_segment_reuse_is_refused_by_name_and_a_tier_keeps_the_groups(grouped_gemma_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"cache.sliding_kv = window .*cache.suffix.enabled"):
        engine(grouped_gemma_dir, cache__sliding_kv="window", cache__suffix__enabled="true")
    assert engine(grouped_gemma_dir, cache__disk__path=str(tmp_path)).engine.front_end.kv_layout.is_grouped
    auto = engine(grouped_gemma_dir, cache__suffix__enabled="true")  # auto: every layer's K/V, for segment reuse
    assert not auto.engine.front_end.kv_layout.is_grouped
    grouped = engine(grouped_gemma_dir)
    with pytest.raises(ValueError, match="cache.sliding_kv = full"):
        grouped.engine.set_segment_settings(grouped.engine.segment_settings.with_changes(enabled=True))


# --- outputs equal, hits counted exactly -----------------------------------------------------------------


def chat(llm, turns: list[list[int]], num_tokens: int = 6) -> tuple[list[list[int]], list[int]]:
    """A conversation: each turn's prompt is the previous prompt, its answer and the next user tokens. The answers
    and the cached tokens of each turn."""
    history, answers, cached = [], [], []
    for user in turns:
        history = history + user
        out = llm.generate(history, greedy(num_tokens))[0]
        answers.append(out.token_ids)
        cached.append(out.usage.cached_tokens)
        history = history + out.token_ids
    return answers, cached


def test_a_chat_several_windows_long_equals_the_cache_off_and_hits_every_turn(grouped_gemma_dir):
    turns = [tokens(n, seed) for seed, n in enumerate((45, 13, 30, 7, 52))]
    want, _ = chat(engine(grouped_gemma_dir, cache__enabled="false"), turns)
    llm = engine(grouped_gemma_dir)
    got, cached = chat(llm, turns)
    assert got == want
    # Each later turn reuses every full block of the previous turn's prompt and answer, its last token excepted.
    history = 0
    for i, user in enumerate(turns):
        if i:
            assert cached[i] == (history - 1) // BLOCK * BLOCK, f"turn {i}: {cached}"
        history += len(user) + 6
    llm.engine.scheduler.check_integrity()


def test_a_prompt_diverging_inside_the_last_block_hits_up_to_that_block(grouped_gemma_dir):
    """vLLM #57610: the second prompt shares the first up to 3 tokens before its end; it reuses every block before the
    one it diverges in."""
    first = tokens(8 * BLOCK + 5, 1)
    second = first[:-3] + tokens(9, 2)
    want = engine(grouped_gemma_dir, cache__enabled="false").generate(second, greedy(8))[0].token_ids
    llm = engine(grouped_gemma_dir)
    llm.generate(first, greedy(4))
    out = llm.generate(second, greedy(8))[0]
    assert out.usage.cached_tokens == (len(first) - 3) // BLOCK * BLOCK
    assert out.token_ids == want


def test_a_fully_cached_block_aligned_prompt_computes_only_its_last_token(grouped_gemma_dir):
    """Its last block is copied in every group (the window groups' too), so the step computes one token."""
    prompt = tokens(7 * BLOCK, 14)
    want = engine(grouped_gemma_dir, cache__enabled="false").generate(prompt, greedy(6))[0].token_ids
    llm = engine(grouped_gemma_dir)
    llm.generate(prompt, greedy(2))
    out = llm.generate(prompt, greedy(6))[0]
    assert out.usage.computed_prompt_tokens == 1 and out.token_ids == want
    llm.engine.scheduler.check_integrity()


def test_a_hit_deep_inside_an_earlier_prompt_needs_its_window_and_finds_it(grouped_gemma_dir):
    """A shared document followed by different questions, each longer than the window: the window blocks before the
    document's end were released by the first request (to the cache), and the second finds them."""
    doc = tokens(6 * BLOCK, 3)
    a, b = doc + tokens(50, 4), doc + tokens(41, 5)
    want = engine(grouped_gemma_dir, cache__enabled="false").generate(b, greedy(6))[0].token_ids
    llm = engine(grouped_gemma_dir)
    llm.generate(a, greedy(2))
    out = llm.generate(b, greedy(6))[0]
    assert out.usage.cached_tokens == len(doc) and out.token_ids == want


def test_a_hit_whose_window_was_evicted_is_cut_to_where_the_window_is_whole(grouped_gemma_dir):
    llm = engine(grouped_gemma_dir)
    doc = tokens(6 * BLOCK, 6)
    llm.generate(doc + tokens(50, 7), greedy(2))
    manager = llm.engine.kv_manager
    released = [b for b in manager.pool.blocks if b.group == 1 and b.ref_cnt == 0 and b.block_key is not None
                and b.position == len(doc) - BLOCK]  # group 1's block just before the document's end
    assert len(released) == 1
    manager.pool._uncache(released[0])
    manager.pool.free_block_ids.append(manager.pool._drop(released[0]).block_id)
    out = llm.generate(doc + tokens(30, 8), greedy(2))[0]
    assert out.usage.cached_tokens == len(doc) - BLOCK  # never a hit whose window is missing
    llm.engine.scheduler.check_integrity()


def run_batch(llm, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


def test_preemption_and_eviction_pressure_leave_outputs_equal(grouped_gemma_dir):
    """Eight requests sharing prefixes in a pool that holds about two of them at once: sequences are preempted and
    recomputed, cached blocks evicted, and every answer equals the cache-off engine's."""
    shared = tokens(40, 9)
    prompts = [shared[:random.Random(i).randrange(10, 40)] + tokens(30 + 7 * i, 10 + i) for i in range(8)]
    want = run_batch(engine(grouped_gemma_dir, cache__enabled="false"), prompts, greedy(24))
    llm = engine(grouped_gemma_dir, engine__num_kv_blocks=60, engine__max_num_seqs=8, engine__max_num_batched_tokens=48)
    assert run_batch(llm, prompts, greedy(24)) == want
    assert run_batch(llm, prompts, greedy(24)) == want  # again, from what the cache kept
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.kv_manager.pool.num_evictions > 0
    llm.engine.scheduler.check_integrity()


def test_forks_and_prompt_scoring_match_the_full_layout(grouped_gemma_dir):
    prompt = tokens(3 * WINDOW + 3, 11)
    params = SamplingParams(max_tokens=10, n=3, temperature=1.0, seed=5)
    scoring = SamplingParams(max_tokens=2, prompt_logprobs=2)
    outs = {}
    for mode in ("window", "full"):
        llm = engine(grouped_gemma_dir, cache__sliding_kv=mode)
        llm.generate(prompt[:40], greedy(2))
        forked = llm.generate(prompt, params)[0]
        scored = [llm.generate(prompt, scoring)[0] for _ in range(2)]  # the second from the cache
        outs[mode] = ([c.token_ids for c in forked.choices],
                      [[(r.token_id, round(r.logprob, 4)) for r in s.prompt_logprobs[1:]] for s in scored])
        llm.engine.scheduler.check_integrity()
    assert outs["window"] == outs["full"]


# --- memory ---------------------------------------------------------------------------------------------


def test_kv_bytes_per_token_at_8k_are_under_a_third_of_the_full_layout(tmp_path, real_tokenizer):
    """Gemma 3 270M's layer plan (18 layers, 3 of them full, window 512) at a tiny width: the pool bytes a
    sequence of 8,192 tokens holds, grouped against full, with the same answer."""
    kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]
    path = str(build("gemma3", tmp_path, len(real_tokenizer.hf), real_tokenizer, num_hidden_layers=18,
                     layer_types=kinds, sliding_window=512, max_position_embeddings=16384,
                     num_key_value_heads=1, hidden_size=32, intermediate_size=32, num_attention_heads=2))
    prompt = tokens(8192 - 4, 12)
    held, answers = {}, {}
    for mode in ("window", "full"):
        llm = tiny_llm(path, cache__sliding_kv=mode, engine__num_kv_blocks=1200, server__max_tokens=9000,
                       engine__max_num_batched_tokens=1024)
        engine = llm.engine
        seq = engine.add_request(prompt, greedy(4))
        while engine.has_unfinished():
            engine.step()
            if seq.num_completion_tokens == 2:  # decoding at 8k: what the sequence holds
                held[mode] = engine.kv_manager.pool.num_used_blocks * engine.bytes_per_block
        answers[mode] = seq.completion_token_ids
    assert answers["window"] == answers["full"]
    ratio = held["window"] / held["full"]
    assert ratio <= 0.3, f"grouped / full KV bytes at 8k: {ratio:.3f}"
    print(f"KV bytes at 8k, grouped / full: {ratio:.3f}")


@pytest.mark.parametrize("mode", ["window", "full"])
def test_the_reported_capacity_fits(grouped_gemma_dir, mode):
    """kv_capacity is the longest sequence the pool takes: one of that length runs, one block more is refused."""
    llm = engine(grouped_gemma_dir, cache__sliding_kv=mode, engine__num_kv_blocks=40, engine__max_num_batched_tokens=32,
                 server__max_tokens=4096)
    capacity = llm.engine.front_end.kv_capacity_tokens
    assert capacity >= 40 * BLOCK // 3
    llm.generate(tokens(capacity - 4, 13), greedy(4))
    with pytest.raises(ValueError, match="does not fit in the KV pool"):
        llm.generate(tokens(capacity + BLOCK - 4, 13), greedy(4))
    assert torch.is_tensor(llm.engine.runner.kv_cache)


# --- the simulator --------------------------------------------------------------------------------------


def test_the_simulator_predicts_the_engines_hits_under_groups(grouped_gemma_dir):
    """`kvreuse analyze` and the trace replay run the manager without a model: over the engine's layout they count
    the hits the engine counts, windows and their evictions included, on a pool small enough to evict."""
    from kvreuse.kvcache.simulate import simulate

    docs = [tokens(5 * BLOCK + 3, 20 + i) for i in range(3)]
    prompts = [docs[i % 3][:len(docs[0]) - (i % 4)] + tokens(30 + 3 * i, 30 + i) for i in range(12)]
    llm = engine(grouped_gemma_dir, engine__num_kv_blocks=100)
    evicted_windows = []
    llm.engine.kv_manager.pool.on_evict.append(lambda block: block.group and evicted_windows.append(block))
    measured = [llm.generate(p, greedy(1))[0].usage.cached_tokens for p in prompts]
    config, front = llm.engine.front_end.config, llm.engine.front_end
    predicted = simulate(prompts, config.cache, front.fingerprint, 100, layout=front.kv_layout)
    assert sum(measured) > 0 and evicted_windows
    assert predicted.cached_tokens == sum(measured)


# --- which window blocks stay (the manager alone, no model) ---------------------------------------------


def manager(retention: str = "cold", num_blocks: int = 400):
    """A grouped manager whose passed window blocks become what `retention` says (bench/passed_windows.py)."""
    from kvreuse.bench.passed_windows import PassedWindows
    from kvreuse.kvcache.manager import KVCacheManager

    layout = KVLayout.of(gemma_args(6, pattern=3, window=WINDOW))
    mgr = KVCacheManager(num_blocks, BLOCK, layout=layout)
    PassedWindows.install(mgr, retention)
    return mgr


def admit_and_finish(mgr, token_ids: list[int], num_computed: int | None = None) -> int:
    """One request through admission, a forward to `num_computed` tokens (all of them) and free; its cached tokens."""
    req = mgr.new_request(list(token_ids))
    match = mgr.match(req)
    mgr.admit(req, match, req.num_tokens - match.num_cached_tokens)
    mgr.update(req, req.num_tokens if num_computed is None else num_computed)
    mgr.check_integrity([req])
    mgr.free(req)
    mgr.check_integrity()
    return match.num_cached_tokens


@pytest.mark.parametrize("retention", ["cold", "policy", "end"])
@pytest.mark.parametrize("tail", range(BLOCK))
def test_the_next_turn_and_a_prompt_diverging_in_the_last_block_hit_under_every_retention(retention, tail):
    """Whatever becomes of passed window blocks, a request keeps the windows of hits at its last two block boundaries
    and at the last two before its prompt's end: the next turn, a prompt diverging in its last block, and a retry
    after it generated (its completion computed) all hit up to there."""
    first = tokens(8 * BLOCK + tail, 40)
    mgr = manager(retention)
    admit_and_finish(mgr, first)
    assert admit_and_finish(mgr, first + tokens(9, 41)) == len(first) // BLOCK * BLOCK
    assert admit_and_finish(mgr, first[:-3] + tokens(9, 42)) == (len(first) - 3) // BLOCK * BLOCK
    answered = manager(retention)
    prompt = first[:-2 * BLOCK]
    req = answered.new_request(list(prompt))
    answered.admit(req, answered.match(req), req.num_tokens)
    answered.update(req, req.num_tokens)
    req.token_ids += tokens(2 * BLOCK, 43)  # its completion, computed
    answered.allocate(req, req.num_tokens)
    answered.update(req, req.num_tokens - 1)
    answered.free(req)
    assert admit_and_finish(answered, prompt[:-3] + tokens(9, 44)) == (len(prompt) - 3) // BLOCK * BLOCK


def test_end_keeps_window_blocks_another_request_left_cached():
    shared = tokens(3 * WINDOW, 45)
    mgr = manager("end")
    admit_and_finish(mgr, shared + tokens(5, 46))          # leaves its end windows cached
    admit_and_finish(mgr, shared + tokens(5, 46) + tokens(4 * WINDOW, 47))  # hits them, then passes them
    assert admit_and_finish(mgr, shared + tokens(5, 46) + tokens(9, 48)) == (len(shared) + 5) // BLOCK * BLOCK


def test_a_finished_requests_window_blocks_are_evicted_before_the_block_they_are_found_through():
    mgr = manager("policy")
    admit_and_finish(mgr, tokens(10 * BLOCK, 49))
    evicted = []  # (group, position), in eviction order
    mgr.pool.on_evict.append(lambda block: evicted.append((block.group, block.position)))
    while mgr.pool.num_cached_blocks:
        mgr.pool.free_block_ids.append(mgr.pool._evict().block_id)
        mgr.pool.check_integrity()
    assert len(evicted) == 10 * 3 and len(set(evicted)) == len(evicted)
    for k, (group, position) in enumerate(evicted):
        if group == 0:
            assert all((g, position) in evicted[:k] for g in (1, 2)), evicted


def test_window_blocks_go_with_the_block_they_are_found_through():
    mgr = manager("policy")
    admit_and_finish(mgr, tokens(10 * BLOCK, 50))
    anchor = next(b for b in mgr.pool.blocks if b.group == 0 and b.position == 9 * BLOCK)
    windows = [b for b in mgr.pool.blocks if b.group and b.parent_uid == anchor.uid]
    assert len(windows) == 2
    mgr.pool._uncache(anchor)
    mgr.pool.free_block_ids.append(mgr.pool._drop(anchor).block_id)
    assert all(b.block_key is None and b.block_id in mgr.pool.free_block_ids for b in windows)
    mgr.check_integrity()


def test_a_window_table_holds_the_null_block_where_its_window_has_passed():
    from kvreuse.kvcache.block import NULL_BLOCK

    mgr = manager("policy")
    req = mgr.new_request(tokens(10 * BLOCK, 52))
    mgr.admit(req, mgr.match(req), req.num_tokens)
    mgr.update(req, req.num_tokens)
    assert NULL_BLOCK not in req.tables.block_table
    for table, start in zip(req.tables.window_tables, req.tables.window_starts, strict=True):
        assert start > 0 and table[:start] == [NULL_BLOCK] * start and NULL_BLOCK not in table[start:]
    child = mgr.new_request(list(req.token_ids))
    mgr.fork(req, child, req.num_tokens)  # shares every table, the null block's entries included
    assert child.tables.window_tables == req.tables.window_tables
    mgr.check_integrity([req, child])
    num_window = 10 - req.tables.window_starts[0]
    assert mgr.num_blocks_in_use_by_group([req, child]) == (10, num_window, num_window)
    null = mgr.pool.blocks[NULL_BLOCK]
    assert null.ref_cnt == 0 and null.uid is None and NULL_BLOCK not in mgr.pool.free_block_ids
    mgr.free(child)
    mgr.free(req)
    mgr.check_integrity()
    assert mgr.pool.num_free_blocks == mgr.pool.num_blocks == 400


def test_a_request_whose_tables_a_failed_step_left_uneven_is_still_freed():
    mgr = manager()
    req = mgr.new_request(tokens(5 * BLOCK, 51))
    mgr.admit(req, mgr.match(req), req.num_tokens)
    req.tables.block_table += mgr.pool.allocate(1)  # group 0 grew, the window groups did not
    mgr.free(req)
    assert mgr.pool.num_used_blocks == 0
    mgr.check_integrity()
