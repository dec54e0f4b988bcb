"""What clients ask of sampling beyond temperature: logits processors, logprobs, n / best_of forked from one prefill,
prompt logprobs served from the cache, stop_token_ids, min_tokens (engine level, tiny model)."""

from __future__ import annotations

import math

import pytest
import torch

from kvreuse.engine.engine import RequestError
from kvreuse.layers.logits_processors import SamplingRow, process_logits
from kvreuse.layers.sampler import sample_rows
from kvreuse.sampling_params import InvalidSamplingParam, SamplingParams

from .helpers import drain, greedy, tiny_config

VOCAB = 40
PROMPT = "The history of the city begins in the Roman era, when a small fort was built on the river bank."


def logits_of(seed: int, rows: int = 1) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


# --- logits processors --------------------------------------------------------------------------------------------
def test_penalties_and_bias_match_their_definitions():
    logits = logits_of(0)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3, logit_bias={7: 2.0})
    prompt, output = [1, 2, 3], [3, 5, 5, 9]
    expected = logits[0].clone()
    expected[7] += 2.0
    for t in {1, 2, 3, 5, 9}:
        expected[t] = expected[t] / 1.3 if expected[t] > 0 else expected[t] * 1.3
    for t, count in {3: 1, 5: 2, 9: 1}.items():
        expected[t] -= 0.25 * count + 0.5
    process_logits(logits, [SamplingRow(p, None, prompt, output)])
    torch.testing.assert_close(logits[0], expected)


def test_min_tokens_masks_the_stop_ids_until_reached():
    p = SamplingParams(min_tokens=2, logit_bias={4: 100.0})
    row = SamplingRow(p, None, (), [11], stop_ids=frozenset({4, 6}))
    logits = logits_of(1)
    process_logits(logits, [row])
    assert logits[0, 4] == -math.inf and logits[0, 6] == -math.inf
    row.output_token_ids = [11, 12]
    logits = logits_of(1)
    process_logits(logits, [row])
    assert int(logits.argmax()) == 4  # the bias wins once min_tokens are there


def test_rows_that_ask_for_nothing_are_untouched():
    logits = logits_of(2, rows=2)
    before = logits.clone()
    rows = [SamplingRow(SamplingParams(), None), SamplingRow(SamplingParams(logit_bias={0: 1.0}), None)]
    process_logits(logits, rows)
    assert torch.equal(logits[0], before[0]) and not torch.equal(logits[1], before[1])


def test_logprobs_are_of_the_distribution_sampled_from():
    logits = logits_of(3)
    greedy = SamplingParams(logprobs=3)
    hot = SamplingParams(temperature=0.5, logprobs=2, seed=1)
    [token], [record] = sample_rows(logits.clone(), [SamplingRow(greedy, None)])
    reference = torch.log_softmax(logits[0], -1)
    assert token == int(reference.argmax()) and record.rank == 1
    assert record.logprob == pytest.approx(float(reference[token]), abs=1e-6)
    assert [t for t, _ in record.top] == reference.topk(3).indices.tolist()
    [token], [record] = sample_rows(logits.clone(), [SamplingRow(hot, torch.Generator().manual_seed(1))])
    scaled = torch.log_softmax(logits[0] / 0.5, -1)
    assert record.logprob == pytest.approx(float(scaled[token]), abs=1e-5)
    assert record.rank == int((scaled > scaled[token]).sum()) + 1


@pytest.mark.parametrize("field, value", [("n", 0), ("n", 17), ("logprobs", 21), ("presence_penalty", 3),
                                          ("repetition_penalty", 0), ("logit_bias", {1: 200}), ("min_tokens", 9),
                                          ("stop_token_ids", [-1]), ("max_tokens", 0)])
def test_each_field_is_checked_by_name(field, value):
    with pytest.raises(InvalidSamplingParam) as error:
        SamplingParams(**{"max_tokens": 8, field: value})
    assert error.value.field == field


def test_best_of_must_cover_n():
    with pytest.raises(InvalidSamplingParam, match="best_of"):
        SamplingParams(n=3, best_of=2)
    assert SamplingParams(max_tokens=0, prompt_logprobs=1).max_tokens == 0  # scoring a prompt only


def test_token_ids_beyond_the_vocabulary_are_refused(tiny_llm):
    vocab = tiny_llm.engine.front_end.model_args.vocab_size
    for field, value in (("logit_bias", {vocab: 1.0}), ("stop_token_ids", [vocab])):
        with pytest.raises(RequestError) as error:
            tiny_llm.engine.front_end.make_sequence("hi", SamplingParams(**{field: value}))
        assert error.value.field == field


# --- n and best_of ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra_tokens", [0, 5])  # prompt ends on a block boundary / inside a block (copied)
def test_each_choice_is_what_its_own_seed_gives_alone(tiny_llm, extra_tokens):
    engine = tiny_llm.engine
    prompt = engine.front_end.tokenize_prompt(PROMPT * 3)[:32 + extra_tokens]
    assert len(prompt) == 32 + extra_tokens
    params = dict(max_tokens=12, temperature=1.0, ignore_eos=True)
    together = tiny_llm.generate(prompt, SamplingParams(n=3, seed=11, logprobs=0, **params))[0]
    engine.check_integrity()
    alone = [tiny_llm.generate(prompt, SamplingParams(seed=11 + i, **params), use_cache=False)[0] for i in range(3)]
    assert [c.index for c in together.all_choices] == [0, 1, 2]
    assert [c.token_ids for c in together.all_choices] == [a.token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in together.all_choices}) > 1  # really sampled
    assert together.usage.prompt_tokens == len(prompt) and together.usage.completion_tokens == 36
    for choice in together.all_choices:
        assert len(choice.logprobs) == 12
        assert choice.cumulative_logprob == pytest.approx(sum(r.logprob for r in choice.logprobs))


def test_choices_share_one_prefill(tiny_llm):
    engine = tiny_llm.engine
    prompt = engine.front_end.tokenize_prompt(PROMPT * 3)
    before = engine.stats.prefill_tokens_run
    out = tiny_llm.generate(prompt, SamplingParams(n=4, max_tokens=4, temperature=1.0, seed=3), use_cache=False)[0]
    assert engine.stats.prefill_tokens_run - before == len(prompt)  # not 4x
    assert out.usage.computed_prompt_tokens == len(prompt) and engine.stats.num_requests == 1
    assert engine.kv_manager.pool.num_used_blocks == 0


def test_forked_choices_hold_shared_blocks_once_each(tiny_llm):
    engine = tiny_llm.engine
    prompt = engine.front_end.tokenize_prompt(PROMPT * 3)[:37]
    seq = engine.add_request(prompt, SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=1, ignore_eos=True))
    while not any(c.num_completion_tokens for c in seq.choices):
        engine.step()
    shared = seq.kv.tables.block_table[:37 // 16]
    assert all(engine.kv_manager.pool.blocks[b].ref_cnt == 3 for b in shared)
    last_blocks = {c.kv.tables.block_table[2] for c in seq.choices}
    assert len(last_blocks) == 3  # the partial block: one copy per choice
    engine.check_integrity()
    engine.abort(seq.request_id)
    assert all(c.is_finished for c in seq.choices) and engine.kv_manager.pool.num_used_blocks == 0


def test_best_of_returns_the_n_most_likely(tiny_llm):
    prompt = tiny_llm.engine.front_end.tokenize_prompt(PROMPT)
    params = dict(max_tokens=8, temperature=1.0, ignore_eos=True)
    out = tiny_llm.generate(prompt, SamplingParams(n=2, best_of=4, seed=5, **params))[0]
    alone = [tiny_llm.generate(prompt, SamplingParams(seed=5 + i, logprobs=0, **params))[0] for i in range(4)]
    ranked = sorted(alone, key=lambda o: o.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in out.all_choices] == [o.token_ids for o in ranked]
    assert [c.index for c in out.all_choices] == [0, 1]
    assert out.usage.completion_tokens == 32  # every generated token counts


# --- prompt logprobs from the cache ----------------------------------------------------------------------------
def test_prompt_logprobs_from_the_cache_equal_computed_ones(tiny_llm):
    engine = tiny_llm.engine
    context = engine.front_end.tokenize_prompt(PROMPT * 4)
    scored = SamplingParams(max_tokens=1, prompt_logprobs=2, logprobs=2)
    first = tiny_llm.generate(context + [300, 301], scored)[0]
    again = tiny_llm.generate(context + [302, 303, 304], scored)[0]
    fresh = tiny_llm.generate(context + [302, 303, 304], scored, use_cache=False)[0]
    assert first.usage.computed_prompt_tokens == len(context) + 2
    # Blocks with stored logprobs are served, the last of them computed again for its last row's logits.
    full = len(context) // 16
    assert again.usage.cached_tokens == (full - 1) * 16
    assert engine.kv_manager.prompt_logprobs.num_hits >= full
    assert again.prompt_logprobs[0] is None and len(again.prompt_logprobs) == len(context) + 3
    assert [r.token_id for r in again.prompt_logprobs[1:]] == (context + [302, 303, 304])[1:]
    for cached, computed in zip(again.prompt_logprobs[1:], fresh.prompt_logprobs[1:], strict=True):
        assert [t for t, _ in cached.top] == [t for t, _ in computed.top]
        assert cached.logprob == pytest.approx(computed.logprob, abs=1e-4)
    assert again.token_ids == fresh.token_ids
    engine.check_integrity()


def test_a_richer_request_does_not_take_poorer_entries(tiny_llm):
    context = tiny_llm.engine.front_end.tokenize_prompt(PROMPT * 3)
    tiny_llm.generate(context, SamplingParams(max_tokens=1, prompt_logprobs=1))
    richer = tiny_llm.generate(context, SamplingParams(max_tokens=1, prompt_logprobs=4))[0]
    assert richer.usage.cached_tokens == 0
    assert all(len(r.top) == 4 for r in richer.prompt_logprobs[1:])


def test_choices_of_one_question_score_in_two_steps(tiny_llm):
    """lm-eval sends a question's 4 choices together: the first computes the context, the others wait one step and
    each computes only its last context block (again) and its answer."""
    engine = tiny_llm.engine
    context = engine.front_end.tokenize_prompt(PROMPT * 5)
    for seq in [engine.add_request(context + [400 + i, 401], SamplingParams(max_tokens=1, prompt_logprobs=1))
                for i in range(4)]:
        assert seq.kv.prompt_logprobs == 1
    assert drain(engine) == 2


def test_scoring_only_generates_nothing(tiny_llm):
    context = tiny_llm.engine.front_end.tokenize_prompt(PROMPT)
    out = tiny_llm.generate(context, SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert out.token_ids == [] and out.finish_reason == "length" and len(out.prompt_logprobs) == len(context)
    with pytest.raises(RequestError, match="n"):
        tiny_llm.engine.front_end.make_sequence(context, SamplingParams(max_tokens=0, prompt_logprobs=0, n=2))


def test_evicted_blocks_take_their_logprobs_along(tiny_model_dir):
    from kvreuse.llm import LLM

    llm = LLM(tiny_config(tiny_model_dir, engine__num_kv_blocks=16))
    for i in range(4):
        prompt = llm.engine.front_end.tokenize_prompt(f"{i} " + PROMPT * 2)
        llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))
        llm.engine.check_integrity()
    store = llm.engine.kv_manager.prompt_logprobs
    assert 0 < len(store.entries) <= llm.engine.kv_manager.pool.num_cached_blocks


# --- stops ---------------------------------------------------------------------------------------------------
def test_stop_token_ids_and_min_tokens(tiny_llm):
    prompt = tiny_llm.engine.front_end.tokenize_prompt(PROMPT)
    free = tiny_llm.generate(prompt, greedy(8))[0]
    stop_at = free.token_ids[3]
    cut = tiny_llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[stop_at]))[0]
    assert cut.finish_reason == "stop" and cut.token_ids == free.token_ids[:free.token_ids.index(stop_at) + 1]
    eos = 2
    forced = tiny_llm.generate(prompt, SamplingParams(max_tokens=8, logit_bias={eos: 100.0}, min_tokens=3))[0]
    assert forced.token_ids[-1] == eos and len(forced.token_ids) == 4 and forced.finish_reason == "stop"
