"""Engine behaviour: batching, chunked prefill, preemption under a small KV pool, limits, stops, aborts."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvreuse.engine.detokenizer import detokenize
from kvreuse.engine.engine import LLMEngine, RequestError
from kvreuse.engine.model_runner import StepOutput
from kvreuse.engine.sequence import Sequence
from kvreuse.kvcache.request import CacheRequest
from kvreuse.llm import LLM
from kvreuse.sampling_params import SamplingParams

from .helpers import drain, greedy, tiny_config

PROMPTS = [
    "Hi",
    "The history of the printing press begins",
    "In a small village by the sea there lived an old fisherman who",
    "List the planets of the solar system:",
    "def add(a, b):\n    return",
    "Paged attention stores keys and values in fixed-size blocks so that " * 3,
    "1, 1, 2, 3, 5, 8, 13, 21, 34, 55,",
    "Translate to French: The cat sleeps on the warm windowsill while the rain falls outside.",
]


@pytest.mark.slow
def test_batch_of_8_equals_one_at_a_time_on_the_real_model(real_llm):
    assert len({len(real_llm.tokenizer.encode(p)) for p in PROMPTS}) == len(PROMPTS)
    batched = real_llm.generate(PROMPTS, greedy(24))
    for prompt, out in zip(PROMPTS, batched, strict=True):
        assert out.token_ids == real_llm.generate(prompt, greedy(24))[0].token_ids, prompt
    real_llm.engine.check_integrity()
    assert real_llm.engine.kv_manager.num_free_blocks == real_llm.engine.num_kv_blocks


def test_batch_equals_sequential_on_the_tiny_model(tiny_llm):
    batched = tiny_llm.generate(PROMPTS, greedy(20))
    assert [o.token_ids for o in batched] == [tiny_llm.generate(p, greedy(20))[0].token_ids for p in PROMPTS]


def test_small_kv_pool_preempts_and_still_completes_every_request(tiny_model_dir, tiny_llm):
    expected = [o.token_ids for o in tiny_llm.generate(PROMPTS, greedy(40))]
    # 12 blocks of 8 tokens: room for one or two requests at a time, so the scheduler must preempt.
    small = LLM(tiny_config(tiny_model_dir, engine__num_kv_blocks=12, cache__block_size=8))
    outputs = small.generate(PROMPTS, greedy(40))
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finish_reason == "length" for o in outputs)
    assert small.engine.scheduler.num_preemptions > 0
    small.engine.check_integrity()
    assert small.engine.kv_manager.num_free_blocks == 12


@pytest.mark.parametrize("budget", [16, 37])
def test_chunked_prefill_gives_the_same_tokens(tiny_model_dir, tiny_llm, budget):
    long_prompts = [p * 4 for p in PROMPTS[:4]]
    expected = [o.token_ids for o in tiny_llm.generate(long_prompts, greedy(12))]
    chunked = LLM(tiny_config(tiny_model_dir, engine__max_num_batched_tokens=budget))
    assert [o.token_ids for o in chunked.generate(long_prompts, greedy(12))] == expected


def test_max_num_seqs_bounds_the_batch(tiny_model_dir):
    llm = LLM(tiny_config(tiny_model_dir, engine__max_num_seqs=2))
    for p in PROMPTS:
        llm.engine.add_request(p, greedy(5))
    while llm.engine.has_unfinished():
        llm.engine.step()
        assert len(llm.engine.scheduler.running) <= 2


def test_outputs_report_usage_and_timings(tiny_llm):
    out = tiny_llm.generate("Hello world", greedy(7))[0]
    n = len(tiny_llm.tokenizer.encode("Hello world"))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (n, 7)
    assert out.usage.cached_tokens + out.usage.computed_prompt_tokens == n
    assert 0 < out.ttft_s <= out.total_s
    assert out.text == tiny_llm.tokenizer.decode(out.token_ids)


def test_context_limit_is_refused_with_both_numbers_and_the_engine_keeps_serving(tiny_model_dir):
    llm = LLM(tiny_config(tiny_model_dir, server__max_tokens=64))
    prompt = "word " * 60
    with pytest.raises(RequestError, match=r"prompt \(\d+ tokens\) \+ max_tokens \(10\) = \d+ tokens exceeds "
                                           r"the context limit of 64 tokens \(server.max_tokens\)"):
        llm.generate(prompt, greedy(10))
    with pytest.raises(RequestError, match="prompt is empty"):
        llm.generate("", greedy(10))
    with pytest.raises(RequestError, match="token ids must be integers"):
        llm.generate([1, 2, 10**9], greedy(3))
    assert llm.generate("Still serving", greedy(3))[0].usage.completion_tokens == 3
    llm.engine.check_integrity()


def test_request_larger_than_the_kv_pool_is_refused(tiny_model_dir):
    llm = LLM(tiny_config(tiny_model_dir, engine__num_kv_blocks=2, cache__block_size=8))
    with pytest.raises(RequestError, match="does not fit in the KV pool of 16 tokens"):
        llm.generate("a b c d e f g h i j k", greedy(8))


def test_stop_strings_cut_the_text(real_llm):
    free = real_llm.generate("1, 2, 3, 4, 5,", greedy(16))[0]
    assert " 7" in free.text
    stopped = real_llm.generate("1, 2, 3, 4, 5,", SamplingParams(max_tokens=16, stop=[" 7"]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index(" 7")]


def test_eos_finishes_a_chat_answer(real_llm):
    out = real_llm.chat([{"role": "user", "content": "Say just the word yes."}], SamplingParams(max_tokens=40))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in real_llm.tokenizer.eos_token_ids


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_llm):
    p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    alone = tiny_llm.generate("Once upon a time", p)[0].token_ids
    batched = tiny_llm.generate(["Other prompt", "Once upon a time"], [greedy(10), p])[1].token_ids
    assert alone == batched
    other = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=8, ignore_eos=True)
    assert tiny_llm.generate("Once upon a time", other)[0].token_ids != alone


def test_abort_frees_blocks(tiny_llm):
    engine = tiny_llm.engine
    seq = engine.add_request("A request that will be aborted", greedy(50))
    engine.step()
    engine.step()
    assert seq.num_computed_tokens == seq.num_prompt_tokens + 1    # the prompt, then one decode
    assert len(seq.kv.tables.block_table) == -(-seq.num_computed_tokens // engine.block_size)
    engine.abort(seq.request_id)
    assert seq.finish_reason == "abort" and not engine.has_unfinished()
    engine.check_integrity()
    assert engine.kv_manager.num_free_blocks == engine.num_kv_blocks


def test_engine_seed_makes_unseeded_sampling_reproducible(tiny_model_dir):
    def sampled(seed: int) -> list[list[int]]:
        llm = LLM(tiny_config(tiny_model_dir, engine__num_kv_blocks=64, engine__seed=seed))
        params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)   # no per-request seed
        return [o.token_ids for o in llm.generate(["Once upon a time", "The cache"], params)]

    assert sampled(7) == sampled(7)
    assert sampled(7) != sampled(8)


# --- stop strings checked incrementally (issue 12, finding 10) -------------------------------------------------
MULTIBYTE = "héllo wörld, naïve café: 日本語のテキスト, Ελληνικά, русский, emoji 🙂🚀👩‍👩‍👧 and ∑∞≠ math"


def test_each_step_decodes_only_its_new_tokens_and_a_little_context(tiny_llm, monkeypatch):
    tokenizer = tiny_llm.engine.front_end.tokenizer
    decode, lengths = tokenizer.decode, []

    def spy(token_ids, *args, **kwargs):
        lengths.append(len(token_ids))
        return decode(token_ids, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "decode", spy)
    params = SamplingParams(max_tokens=150, ignore_eos=True, stop=["a stop string that never appears"])
    out = tiny_llm.generate("Once upon a time", params)[0]
    monkeypatch.undo()
    assert out.usage.completion_tokens == 150 and out.text == tokenizer.decode(out.token_ids)
    # Before: every step decoded the whole completion so far (150 tokens at the end, 11,325 in all).
    assert max(lengths) <= 8 and sum(lengths) <= 4 * 150, (max(lengths), sum(lengths))


@pytest.fixture(scope="module")
def scripted_llm(tiny_model_dir):
    """The tiny engine whose forward is replaced by a script: each request's completion is given, so that any
    token sequence (partial UTF-8 characters included) runs through the engine's own finishing code."""
    llm = LLM(tiny_config(tiny_model_dir, engine__num_kv_blocks=64))
    script: dict[str, list[int]] = {}

    def run(seqs, segments):
        return StepOutput([[(script[s.request_id][s.num_completion_tokens], None)]
                           if s.num_computed_tokens + s.num_scheduled_tokens == s.num_tokens else None for s in seqs])

    llm.engine.runner.run = run
    llm.script = script
    return llm


def whole_decode_finish(tokenizer, completion: list[int], stops: list[str]) -> tuple[str, int]:
    """Today's rule, the reference: after each token decode the whole completion, cut at the earliest stop."""
    text = ""
    for i in range(1, len(completion) + 1):
        text = tokenizer.decode(completion[:i])
        cut = min((j for j in (text.find(s) for s in stops) if j >= 0), default=-1)
        if cut >= 0:
            return text[:cut], i
    return text, len(completion)


def multibyte_token_ids(tokenizer) -> list[int]:
    return sorted(set(tokenizer.encode(MULTIBYTE)))


@given(data=st.data())
@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
def test_incremental_stops_cut_where_whole_decoding_cut(scripted_llm, data):
    tokenizer, engine = scripted_llm.tokenizer, scripted_llm.engine
    vocab = len(tokenizer.hf)
    token = st.one_of(st.integers(0, vocab - 1), st.sampled_from(multibyte_token_ids(tokenizer)))
    completion = data.draw(st.lists(token, min_size=1, max_size=30), label="completion")
    text = tokenizer.decode(completion)
    stops = []
    for _ in range(data.draw(st.integers(0, 3), label="number of stops")):
        start = data.draw(st.integers(0, max(0, len(text) - 1)), label="stop start")
        stop = text[start:start + data.draw(st.integers(1, 6), label="stop length")]
        if stop and "\ufffd" not in stop:   # docs/server.md: a stop string never matches half a character
            stops.append(stop)
    stops.append("a stop that is not there")
    seq = engine.add_request([1, 2, 3], SamplingParams(max_tokens=len(completion), ignore_eos=True, stop=stops))
    scripted_llm.script[seq.request_id] = completion
    drain(engine)
    expected_text, expected_tokens = whole_decode_finish(tokenizer, completion, stops)
    assert (seq.detokenized.text, seq.num_completion_tokens) == (expected_text, expected_tokens)
    assert seq.finish_reason == ("stop" if expected_tokens < len(completion) or expected_text != text else "length")


def completions(tokenizer) -> st.SearchStrategy[list[int]]:
    """Random token ids (any of the vocabulary, byte fragments of multi-byte characters among them), or the
    tokens of random text, cut at any point."""
    token = st.one_of(st.integers(0, len(tokenizer.hf) - 1), st.sampled_from(multibyte_token_ids(tokenizer)))
    return st.one_of(st.lists(token, max_size=40), st.text(max_size=40).map(lambda t: tokenizer.encode(t)[:40]))


@given(data=st.data())
@settings(max_examples=300, deadline=None, derandomize=True)
def test_incremental_detokenization_equals_whole_decoding_at_every_token(real_tokenizer, data):
    completion = data.draw(completions(real_tokenizer), label="completion")
    seq = Sequence("r", CacheRequest([5, 6], b""), SamplingParams())
    pending = ""
    for i, token_id in enumerate(completion):
        seq.token_ids.append(token_id)
        pending = detokenize(real_tokenizer, seq.detokenized, seq.token_ids, seq.num_prompt_tokens)
        whole = real_tokenizer.decode(completion[:i + 1])
        assert seq.detokenized.text + pending == whole
        assert not seq.detokenized.text.endswith("\ufffd")      # a partial character is held back, never streamed
    assert seq.detokenized.text + pending == real_tokenizer.decode(completion)


def test_an_engine_resolves_its_model_once(tiny_model_dir, monkeypatch):
    """One resolve_model per engine: one read of the model's metadata, one dtype probe (`auto`); the front end and the
    compiled step's build command take what it decided."""
    from kvreuse.engine import engine as engine_module
    from kvreuse.engine import resolved_model
    from kvreuse.tuning import dtype_probe

    calls = {"resolve_model": 0, "load_model_info": 0, "probe": 0}

    def counting(module, name):
        real = getattr(module, name)

        def counted(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)

    counting(engine_module, "resolve_model")
    counting(resolved_model, "load_model_info")
    counting(dtype_probe, "probe")
    llm = LLM(tiny_config(tiny_model_dir, model__dtype="auto"))
    try:
        assert calls == {"resolve_model": 1, "load_model_info": 1, "probe": 1}
        engine = llm.engine
        assert engine.front_end.resolved is engine.resolved
        assert engine.front_end.fingerprint == engine.resolved.fingerprint
        assert engine.resolved.dtype_why.startswith("auto: ")
        assert engine.dtype_description == f"fp32 ({engine.resolved.dtype_why})"
        model_config = engine.resolved.model_config  # what the compiled step's build process resolves: no probe
        assert model_config.dtype == "fp32" and model_config.path == str(engine.front_end.model_path)
        given = LLMEngine(tiny_config(tiny_model_dir, model__dtype="auto"), resolved=engine.resolved)
        try:  # an engine given its ResolvedModel resolves nothing
            assert calls == {"resolve_model": 1, "load_model_info": 1, "probe": 1}
            assert given.front_end.fingerprint == engine.front_end.fingerprint
        finally:
            given.close()
    finally:
        llm.close()
