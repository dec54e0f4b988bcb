"""Exact prefix caching through the engine: reuse never changes output, and hits are accounted exactly."""

from __future__ import annotations

import json

import pytest

from kvreuse.cli import main
from kvreuse.kvcache.eviction import POLICIES
from kvreuse.llm import LLM
from kvreuse.sampling_params import SamplingParams

from .helpers import drain, greedy, tiny_llm

BS = 8


def tiny(model_dir: str, **sets) -> LLM:
    """The tiny model with BS-token blocks."""
    return tiny_llm(model_dir, **{"cache__block_size": BS, **sets})


def token_prompts(base_len: int) -> list[list[int]]:
    """Prompts sharing long prefixes, with lengths = 0, 1 and BS - 1 modulo the block size."""
    shared = [(7 * i + 3) % 5000 + 100 for i in range(base_len)]
    prompts = []
    for extra in (0, 1, BS - 1, BS, 2 * BS + 1):
        prompts.append(shared + [(11 * j + 5) % 4000 + 200 for j in range(extra)])
        prompts.append(shared[: base_len // 2] + [42] * (extra + 3))
    return prompts


@pytest.mark.parametrize("budget", [1024, 13])
def test_greedy_output_is_identical_with_caching_on_and_off(tiny_model_dir, budget):
    prompts = token_prompts(4 * BS)
    assert {len(p) % BS for p in prompts} >= {0, 1, BS - 1}
    off = tiny(tiny_model_dir, cache__enabled="false", engine__max_num_batched_tokens=budget)
    on = tiny(tiny_model_dir, engine__max_num_batched_tokens=budget)
    expected = [o.token_ids for o in off.generate(prompts, greedy(12))]
    assert sum(o.usage.cached_tokens for o in off.generate(prompts, greedy(12))) == 0
    first = on.generate(prompts, greedy(12))          # one mixed batch: shares with itself as blocks fill
    second = on.generate(prompts[::-1], greedy(12))   # now everything is cached
    one_by_one = [on.generate(p, greedy(12))[0] for p in prompts]
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in second[::-1]] == expected
    assert [o.token_ids for o in one_by_one] == expected
    assert all(o.usage.cached_tokens > 0 for o in second)
    on.engine.check_integrity()


def test_shared_prefix_reports_block_aligned_cached_tokens(tiny_model_dir):
    llm = tiny(tiny_model_dir)
    base = list(range(300, 300 + 5 * BS + 3))           # 5 full blocks + 3 tokens
    first = llm.generate(base, greedy(4))[0]
    assert first.usage.cached_tokens == 0
    # Shares 5 full blocks and 3 more tokens: only the 5 full blocks can hit.
    second = llm.generate(base + [9, 9, 9], greedy(4))[0]
    assert second.usage.cached_tokens == 5 * BS
    assert second.usage.computed_prompt_tokens == len(base) + 3 - 5 * BS
    # Diverges inside block 3: blocks 0..2 hit.
    third = llm.generate(base[: 3 * BS + 2] + [1, 2, 3, 4, 5, 6, 7], greedy(4))[0]
    assert third.usage.cached_tokens == 3 * BS


def test_fully_cached_prompt_computes_only_its_last_token(tiny_model_dir):
    llm = tiny(tiny_model_dir)
    prompt = list(range(500, 500 + 4 * BS))             # exactly 4 blocks
    a = llm.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0))[0]
    num_free = llm.engine.kv_manager.num_free_blocks
    b = llm.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0))[0]
    # Blocks 0..2 are shared; the cached block 3 is copied into a block of the request's own, and only the last
    # token, whose logits give the first output token, is computed again.
    assert b.usage.cached_tokens == 4 * BS - 1 and b.usage.computed_prompt_tokens == 1
    assert a.token_ids == b.token_ids
    assert [x.logprob for x in a.logprobs] == pytest.approx([x.logprob for x in b.logprobs], abs=1e-5)
    assert llm.engine.kv_manager.num_free_blocks == num_free   # the copy's block is cached or free again
    llm.engine.check_integrity()
    short = list(range(500, 500 + 4 * BS - 1))          # 3 full blocks + 7: all 3 blocks can hit
    assert llm.generate(short, greedy(2))[0].usage.cached_tokens == 3 * BS
    # min_match_blocks counts the copied block: a one-block prompt reuses it only when one block is enough.
    one_block = list(range(900, 900 + BS))
    strict = tiny(tiny_model_dir, cache__min_match_blocks=2)
    for engine, expected in ((llm, BS - 1), (strict, 0)):
        engine.generate(one_block, greedy(1))
        assert engine.generate(one_block, greedy(1))[0].usage.cached_tokens == expected


def test_generated_tokens_are_cached_for_the_next_turn(tiny_model_dir):
    llm = tiny(tiny_model_dir)
    prompt = list(range(700, 700 + 2 * BS))
    out = llm.generate(prompt, greedy(3 * BS))[0]
    follow_up = prompt + out.token_ids + [5, 6, 7]
    # The prompt and the answer's full blocks are reused (the last block of the answer was still
    # being filled when the request finished, so at least 4 of the 5 full blocks hit).
    assert llm.generate(follow_up, greedy(2))[0].usage.cached_tokens >= 4 * BS


def test_constant_hash_still_gives_correct_output(tiny_model_dir):
    prompts = token_prompts(3 * BS)
    expected = [o.token_ids for o in tiny(tiny_model_dir, cache__enabled="false").generate(prompts, greedy(8))]
    llm = tiny(tiny_model_dir)
    llm.engine.kv_manager.hash_fn = lambda parent, token_ids, extra: b"every key collides"
    for _ in range(2):
        assert [o.token_ids for o in llm.generate(prompts, greedy(8))] == expected
    llm.engine.check_integrity()


def test_salted_requests_share_only_with_the_same_salt(tiny_model_dir):
    llm = tiny(tiny_model_dir)
    prompt = list(range(900, 900 + 4 * BS + 1))
    llm.generate(prompt, greedy(2), cache_salt="tenant-a")
    assert llm.generate(prompt, greedy(2), cache_salt="tenant-a")[0].usage.cached_tokens == 4 * BS
    assert llm.generate(prompt, greedy(2), cache_salt="tenant-b")[0].usage.cached_tokens == 0
    assert llm.generate(prompt, greedy(2))[0].usage.cached_tokens == 0


def test_per_request_opt_out_and_min_match_blocks(tiny_model_dir):
    llm = tiny(tiny_model_dir, cache__min_match_blocks=3)
    prompt = list(range(1000, 1000 + 5 * BS))
    llm.generate(prompt, greedy(2))
    assert llm.generate(prompt, greedy(2), use_cache=False)[0].usage.cached_tokens == 0
    assert llm.generate(prompt[: 2 * BS] + [1] * BS, greedy(2))[0].usage.cached_tokens == 0   # 2 < 3 blocks
    assert llm.generate(prompt[: 3 * BS] + [1] * BS, greedy(2))[0].usage.cached_tokens == 3 * BS


@pytest.mark.parametrize("policy", list(POLICIES))
def test_max_blocks_bounds_what_stays_cached_under_every_policy(tiny_model_dir, policy):
    llm = tiny(tiny_model_dir, cache__max_blocks=3, cache__policy=policy)
    llm.generate(list(range(1100, 1100 + 6 * BS)), greedy(2))
    stats = llm.engine.stats_snapshot()
    assert stats.blocks_cached == 3 and stats.blocks_in_use == 0 and stats.eviction_policy == policy
    assert stats.evictions >= 3
    llm.engine.check_integrity()


def test_stats_split_and_hit_rate(tiny_model_dir):
    llm = tiny(tiny_model_dir)
    prompt = list(range(1200, 1200 + 4 * BS + 2))
    llm.generate(prompt, greedy(3))
    llm.generate(prompt, greedy(3))
    s = llm.engine.stats_snapshot()
    assert s.reuse.prompt_tokens == 2 * len(prompt)
    assert s.reuse.cached_tokens == 4 * BS
    assert s.reuse.cached_tokens + s.reuse.computed_prompt_tokens == s.reuse.prompt_tokens
    assert s.reuse.hit_rate == pytest.approx(4 * BS / (2 * len(prompt)), abs=1e-4)
    # One request at a time: the prompt and the two completion tokens fed back (the last one never is).
    assert s.peak_blocks_in_use == -(-(len(prompt) + 2) // BS)
    assert s.peak_kv_bytes_in_use == s.peak_blocks_in_use * llm.engine.bytes_per_block
    assert s.peak_rss_bytes > 100 * 2**20    # a Python process with torch and a model loaded


@pytest.mark.parametrize(("a", "b"), [
    ("Ｐｌｅａｓｅ　ａｎｓｗｅｒ：　ｗｈａｔ　ｉｓ　２＋２？", "Please answer: what is 2+2?"),
    ("Summarise   the\ttext  below.\r\nKeep it short.  \r\n", "Summarise the text below.\nKeep it short.\n"),
])
def test_normalize_input_makes_equal_looking_prompts_share_blocks(tiny_model_dir, a, b):
    long_tail = " The rest of the prompt is identical and long enough to fill several blocks of tokens." * 3
    for normalize, expect_hit in (("true", True), ("false", False)):
        llm = tiny(tiny_model_dir, cache__normalize_input=normalize)
        llm.generate(a + long_tail, greedy(2))
        cached = llm.generate(b + long_tail, greedy(2))[0].usage.cached_tokens
        assert (cached > 0) == expect_hit, (normalize, cached)


def test_normalize_input_applies_to_each_chat_message(tiny_model_dir):
    llm = tiny(tiny_model_dir, cache__normalize_input="true")
    rendered = llm.engine.front_end.render_chat([{"role": "user", "content": "Ｈｉ  there\r\n"}])
    assert "Hi there\n" in rendered and "Ｈ" not in rendered


def test_generate_json_input_shows_hits_from_the_second_request(tiny_model_dir, tmp_path, capsys):
    system = "You are a careful assistant. Answer in one short sentence and cite no sources. " * 3
    lines = [{"messages": [{"role": "system", "content": system}, {"role": "user", "content": q}], "max_tokens": 4}
             for q in ("What is 2+2?", "Name a colour.", "Say hello.")]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    assert main(["generate", "--model", tiny_model_dir, "--input", str(path), "--json", "--block-size", "8"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(records) == 3
    assert records[0]["cached_tokens"] == 0
    assert all(r["cached_tokens"] > 0 for r in records[1:])
    assert all(r["cached_tokens"] + r["computed_prompt_tokens"] == r["prompt_tokens"] for r in records)
    for key in ("text", "token_ids", "finish_reason", "completion_tokens", "ttft_s"):
        assert key in records[0]


@pytest.mark.slow
def test_real_model_output_is_identical_with_and_without_reuse(real_llm):
    system = "You are a meticulous assistant. Think about the question, then answer briefly and precisely. " * 4
    convs = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
             for q in ("What is the boiling point of water?", "Name two prime numbers.", "What colour is the sky?")]
    fresh = real_llm.chat(convs, greedy(16), use_cache=False)
    cached = real_llm.chat(convs, greedy(16))
    again = real_llm.chat(convs, greedy(16))
    assert [o.token_ids for o in cached] == [o.token_ids for o in fresh] == [o.token_ids for o in again]
    assert all(o.usage.cached_tokens >= 64 for o in again)


def test_prompts_sharing_a_prefix_sent_together_compute_it_once(tiny_model_dir):
    shared = list(range(300, 300 + 5 * BS))
    prompts = [shared + [7 + i] * (i + 2) for i in range(4)]
    expected = [o.token_ids for o in tiny(tiny_model_dir, cache__enabled="false").generate(prompts, greedy(6))]
    llm = tiny(tiny_model_dir)
    outputs = llm.generate(prompts, greedy(6))
    # The first computes the shared blocks; the others wait one step and hit them instead of computing them too.
    assert [o.usage.cached_tokens for o in outputs] == [0] + [5 * BS] * 3
    assert [o.token_ids for o in outputs] == expected
    # No waiting for blocks a request may not share: other salts, or no caching for it.
    llm.engine.kv_manager.pool.reset_cache()
    salted = [llm.engine.add_request(p, greedy(6), cache_salt=f"tenant-{i}") for i, p in enumerate(prompts)]
    assert len(llm.engine.step()) == 4  # one prefill step admits all four
    assert all(s.admitted.cached_tokens == 0 for s in salted)
    drain(llm.engine)
    llm.engine.check_integrity()
