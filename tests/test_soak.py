"""Randomized soak of the engine (issue 12, "beyond the list"), seeded with hypothesis so that a failure shrinks to a
short program of operations.

1. `test_soak_3000_operations_seed_1212`: at least 3,000 operations (75 programs of 40-80, seed 1212) on LLMEngine
   with its real scheduler, KV cache manager and postprocess, and a recording stand-in for the forward (the model
   adds nothing here): requests made of shared prefixes (exact hits), shared documents at other offsets (segment
   reuse), fillers, salts and `use_cache=false`; steps with chunked prefill, preemption on a tiny pool, eviction
   under a small `cache.max_blocks`, every eviction policy; aborts at random points; faults injected into the forward;
   segment reuse switched on and off. The stand-in keeps, for every KV slot, the token whose K/V it would hold
   and reads each sequence back through its block table before sampling, so a wrong hit, a misplaced copy or a
   reused freed block fails at once; it samples from the tokens read back, so the expected completion of each
   request is known without any cache.
2. `test_soak_tiny_model_180_operations_seed_1213`: the tiny random-weight model itself, exact reuse only
   (prefix hits), greedy: every completion equals the one computed alone with caching off.

After every step `check_integrity()` holds, within a deadline; a request may fail only by a fault the soak injected
(an assertion of the stand-in, the scheduler or the cache fails the soak); at the end every request has exactly one
terminal outcome (stop, length, abort or error, each reported once: by `step()` or by the abort), every request
drained within a bounded number of steps, and no block is held (all free or cached). The driver is soak_driver.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from kvreuse.engine.engine import LLMEngine
from kvreuse.engine.model_runner import StepOutput
from kvreuse.engine.sequence import Sequence
from kvreuse.kvcache.eviction import POLICIES
from kvreuse.llm import LLM
from kvreuse.sampling_params import SamplingParams
from kvreuse.weights.tokenizer import Tokenizer

from .conftest import make_config
from .soak_driver import Faults, Run, programs_from_the_seed_alone

SOAK_SEED = 1212
SOAK_PROGRAMS = 75
SOAK_OPERATIONS = 3000          # at least: 75 programs of 40-80 operations
MODEL_SEED = 1213
MODEL_PROGRAMS = 6
MODEL_OPERATIONS = 180          # at least: 6 programs of 30-40 operations

EOS = 2
# What the stand-in samples: plain words (they detokenize to ordinary text) and EOS now and then.
SAMPLED = [260, 2644, 2643, 335, 253, 1171, 284, 965, 2767, 7674, 2025, EOS]
PREFIXES = [list(range(1000 + 40 * i, 1000 + 40 * i + n)) for i, n in enumerate((12, 20, 29))]
DOCUMENTS = [list(range(3000 + 50 * i, 3000 + 50 * i + n)) for i, n in enumerate((9, 16, 24, 33))]
FAULT = 5  # a "fault" operation injects one only when it draws this (faults fail whole steps: keep them rare)


def next_token(context: list[int]) -> int:
    """The stand-in model: a deterministic function of the last tokens of the context."""
    return SAMPLED[sum((i + 1) * t for i, t in enumerate(context[-6:])) % len(SAMPLED)]


def expected_completion(prompt: list[int], params: SamplingParams) -> list[int]:
    tokens = list(prompt)
    for _ in range(params.max_tokens):
        tokens.append(next_token(tokens))
        if tokens[-1] == EOS and not params.ignore_eos:
            break
    return tokens[len(prompt):]


class RecordingForward:
    """Stands in for the ModelRunner. Every KV slot holds the token whose K/V it would hold: computed rows are
    written, segment plans copied from their sources as repair.copy_segments copies K/V, blocks copied as
    `copy_blocks` copies them. Before sampling, the whole sequence is read back through its block table and must be
    its tokens."""

    def __init__(self, engine: LLMEngine, coverage: Counter):
        self.engine, self.coverage = engine, coverage
        self.bs = engine.block_size
        self.slots: list[int | None] = [None] * (len(engine.kv_manager.pool.blocks) * self.bs)  # the null block too

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.kv.tables.block_table[position // self.bs] * self.bs + position % self.bs

    def run(self, seqs: list[Sequence], segments) -> StepOutput:
        tokens = [self.forward(seq) for seq in seqs]
        return StepOutput([None if t is None else [(t, None)] for t in tokens])

    def forward(self, seq: Sequence) -> int | None:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
        assert len(seq.kv.tables.block_table) * self.bs >= end, f"{seq.request_id}: table too short for {end} tokens"
        if start and seq.admitted is not None and start == seq.admitted.cached_tokens and seq.reuse is None:
            self.check_hits(seq)
        copied = self.copy_segments(seq) if seq.kv.pending.segment_plan is not None else set()
        for position in range(start, end):
            if position not in copied:
                self.slots[self.slot(seq, position)] = seq.token_ids[position]
        if end < seq.num_tokens:
            self.coverage["chunked prefill steps"] += 1
            return None
        context = [self.slots[self.slot(seq, p)] for p in range(seq.num_tokens)]
        assert context == seq.token_ids, f"{seq.request_id} reads back KV of other tokens"
        return next_token(context)

    def check_hits(self, seq: Sequence) -> None:
        self.coverage["prefix hits"] += 1
        pool = self.engine.kv_manager.pool
        for block_id in seq.kv.tables.block_table[:seq.admitted.cached_tokens // self.bs]:
            assert pool.blocks[block_id].extra_key == seq.kv.extra_key, "a hit crossed a salt"

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """The engine's block copies (a cached last block, a forked partial block), slot by slot."""
        self.coverage["block copies"] += len(copies)
        for source, destination in copies:
            for j in range(self.bs):
                self.slots[destination * self.bs + j] = self.slots[source * self.bs + j]

    def copy_segments(self, seq: Sequence) -> set[int]:
        self.coverage["segment reuse"] += 1
        copied = set()
        for run in seq.kv.pending.segment_plan.runs:
            for i, block in enumerate(run.blocks):
                assert block.extra_key == seq.kv.extra_key, "a segment crossed a salt"
                for j in range(self.bs):
                    position = run.start + i * self.bs + j
                    self.slots[self.slot(seq, position)] = self.slots[block.block_id * self.bs + j]
                    copied.add(position)
        return copied


# --- programs of operations --------------------------------------------------------------------------------------
def prompts() -> st.SearchStrategy[list[int]]:
    document = st.sampled_from(range(len(DOCUMENTS))).map(lambda i: DOCUMENTS[i])
    piece = st.one_of(st.sampled_from(range(len(PREFIXES))).map(lambda i: PREFIXES[i]), document, document,
                      st.lists(st.integers(5000, 6000), min_size=1, max_size=7))
    return st.lists(piece, min_size=1, max_size=3).map(lambda pieces: [t for p in pieces for t in p])


def operations(max_tokens: int) -> st.SearchStrategy[tuple]:
    add = st.tuples(st.just("add"), prompts(), st.integers(1, max_tokens), st.sampled_from([None, None, "a", "b"]),
                    st.sampled_from([True, True, True, False]), st.booleans())
    # An earlier request's prompt again: as it was, extended (prefix hits) or after a new head (segment reuse).
    resend = st.tuples(st.just("resend"), st.integers(0, 99), st.sampled_from(["same", "extended", "moved"]),
                       st.lists(st.integers(5000, 6000), min_size=1, max_size=9), st.integers(1, max_tokens))
    step = st.tuples(st.just("step"), st.integers(1, 3))
    abort = st.tuples(st.just("abort"), st.integers(0, 99))
    fault = st.tuples(st.just("fault"), st.integers(0, 9))
    segments = st.tuples(st.just("segments"), st.sampled_from([True, True, False]))
    return st.one_of(add, add, resend, resend, step, step, abort, fault, segments)


@st.composite
def engine_settings(draw) -> dict:
    block_size = draw(st.sampled_from([2, 4, 8]))
    return {"cache__block_size": block_size,
            "engine__num_kv_blocks": draw(st.integers(48, 256)) // block_size,
            "cache__max_blocks": draw(st.integers(4, 32)),
            "cache__policy": draw(st.sampled_from(list(POLICIES))),
            "cache__min_match_blocks": draw(st.integers(1, 2)),
            "cache__suffix__enabled": draw(st.sampled_from([True, True, True, False])),
            "engine__max_num_batched_tokens": draw(st.integers(8, 64)),
            "engine__max_num_seqs": draw(st.integers(1, 6))}


def run_program(run: Run, program: list[tuple], coverage: Counter, exact_only: bool = False,
                fault_at: int | None = None) -> None:
    """Run `program`, then drain. `exact_only`: "segments" operations do nothing (segment reuse stays off).
    `fault_at`: also arm a fault before that operation (few programs draw a fault of their own)."""
    engine = run.engine
    faults = Faults(engine)
    for index, op in enumerate(program):
        coverage["operations"] += 1
        if index == fault_at:
            faults.armed = "forward"
        if op[0] == "add":
            _, prompt, max_tokens, salt, use_cache, ignore_eos = op
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
            coverage["requests" if run.add(prompt, params, salt, use_cache) else "refused"] += 1
        elif op[0] == "resend" and run.requests:
            _, index, how, tokens, max_tokens = op
            earlier = run.earlier(index)
            prompt = {"same": earlier.prompt_token_ids, "extended": earlier.prompt_token_ids + tokens,
                      "moved": tokens + earlier.prompt_token_ids}[how]
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=earlier.params.ignore_eos)
            coverage["requests" if run.add(prompt, params, run.salts[earlier.request_id], True) else "refused"] += 1
        elif op[0] == "step":
            for _ in range(op[1]):
                run.step()
        elif op[0] == "abort":
            run.abort(op[1])
        elif op[0] == "fault" and op[1] == FAULT:
            faults.armed = "forward"
        elif op[0] == "segments" and not exact_only:
            engine.set_segment_settings(engine.segment_settings.with_changes(enabled=op[1]))
    faults.armed = None
    run.drain()
    run.check_the_end()
    coverage["preemptions"] += engine.scheduler.num_preemptions
    coverage["evictions"] += engine.kv_manager.pool.num_evictions
    for seq in run.requests:
        coverage[f"finished {seq.finish_reason}"] += 1
        coverage["requests with hits"] += seq.reuse_or_planned.cached_tokens > 0
        coverage["requests reusing segments"] += seq.reuse_or_planned.reused_tokens > 0


@pytest.fixture(scope="module")
def engine_factory(tiny_model_dir, real_tokenizer) -> Callable[..., LLMEngine]:
    """Fresh engines on the tiny model, cheaply: the tokenizer (read-only, ~0.7 s to load) is loaded once."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Tokenizer, "load", classmethod(lambda cls, path, fingerprint, chat_template=None: real_tokenizer))

        def make(**settings) -> LLMEngine:
            return LLM(make_config(model__path=tiny_model_dir, model__dtype="fp32", **settings)).engine

        yield make


# --- 1. the engine, with a recording stand-in for the forward ------------------------------------------------------
def test_soak_3000_operations_seed_1212(engine_factory):
    coverage: Counter = Counter()

    @seed(SOAK_SEED)
    @settings(max_examples=SOAK_PROGRAMS, deadline=None, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(settings_=engine_settings(), program=st.lists(operations(max_tokens=24), min_size=40, max_size=80))
    def soak(settings_: dict, program: list[tuple]) -> None:
        engine = engine_factory(**settings_)
        engine.runner = RecordingForward(engine, coverage)
        run = Run(engine)
        run_program(run, program, coverage)
        for seq in run.requests:
            expected = expected_completion(seq.prompt_token_ids, seq.params)
            if seq.finish_reason in ("stop", "length"):
                assert seq.completion_token_ids == expected, seq.request_id
            else:  # aborted or failed: what it had produced so far
                assert seq.completion_token_ids == expected[:seq.num_completion_tokens], seq.request_id

    with programs_from_the_seed_alone():
        soak()
    assert coverage["operations"] >= SOAK_OPERATIONS, coverage
    for seen in ("prefix hits", "segment reuse", "block copies", "chunked prefill steps", "preemptions", "evictions",
                 "refused", "finished stop", "finished length", "finished abort", "finished error"):
        assert coverage[seen] > 0, f"the soak never covered {seen}: {coverage}"


# --- 2. the tiny model: exact reuse gives the outputs of no reuse --------------------------------------------------
def test_soak_tiny_model_180_operations_seed_1213(engine_factory):
    coverage: Counter = Counter()
    alone: dict[tuple, list[int]] = {}
    reference = engine_factory(cache__enabled="false", engine__num_kv_blocks=64)

    def completion_alone(seq: Sequence) -> list[int]:
        key = (tuple(seq.prompt_token_ids), seq.params.max_tokens)
        if key not in alone:
            solo = reference.add_request(seq.prompt_token_ids, SamplingParams(max_tokens=key[1], ignore_eos=True))
            while reference.has_unfinished():
                reference.step()
            alone[key] = solo.completion_token_ids
        return alone[key]

    @seed(MODEL_SEED)
    @settings(max_examples=MODEL_PROGRAMS, deadline=None, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(block_size=st.sampled_from([4, 8]), budget=st.integers(12, 48),
           program=st.lists(operations(max_tokens=6), min_size=30, max_size=40))
    def soak(block_size: int, budget: int, program: list[tuple]) -> None:
        engine = engine_factory(cache__block_size=block_size, engine__num_kv_blocks=96 // block_size,
                                cache__max_blocks=8, engine__max_num_batched_tokens=budget)
        run = Run(engine, step_seconds=30)  # the model's steps, on a shared CPU
        # Six programs draw about two faults between them: arm one mid-program in each, so faults are always covered.
        run_program(run, [op if op[0] != "add" else (*op[:5], True) for op in program], coverage, exact_only=True,
                    fault_at=len(program) // 2)
        for seq in run.requests:
            expected = completion_alone(seq)
            assert seq.completion_token_ids == expected[:seq.num_completion_tokens], seq.request_id
            if seq.finish_reason == "length":
                assert len(seq.completion_token_ids) == len(expected)
            coverage["cached tokens"] += seq.reuse_or_planned.cached_tokens

    with programs_from_the_seed_alone():
        soak()
    assert coverage["operations"] >= MODEL_OPERATIONS, coverage
    for seen in ("cached tokens", "preemptions", "finished length", "finished abort", "finished error"):
        assert coverage[seen] > 0, f"the soak never covered {seen}: {coverage}"
