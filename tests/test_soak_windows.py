"""Randomized soak of the grouped KV pool (kvcache/layout.py: sliding-window groups beside the full-attention group),
seeded with hypothesis so that a failure shrinks to a short program of operations.

`test_soak_windows_3600_operations_seed_1414`: at least 3,600 operations (120 programs of 30-60, seed 1414) on
LLMEngine with its real front end, scheduler, KV cache manager and postprocess, over tiny random-weight Gemma 3 models
(2 full-attention layers and 2 or 4 sliding ones: 2 or 3 groups; windows of 20 and 24 tokens, blocks of 4 or 8, so
that most prompts outgrow their window), and a recording stand-in for the forward. Operations: requests made of
shared prefixes of several lengths (ending mid-block or on a block boundary), prompts diverging inside the last block
of an earlier prompt, multi-turn continuations (an earlier request's prompt and completion, then new tokens), fillers,
cache salts, `use_cache=false`, n > 1 (choices forked from their request's prompt); steps with chunked prefill that
crosses window boundaries, preemption on a tiny pool, eviction under a small `cache.max_blocks`, every eviction policy
and every window retention (what becomes of the window blocks a window has passed, bench/passed_windows.py: `cold`
puts them in the `ColdFirst` policy's `cold`, evicted first); aborts at random points; faults injected into the
forward and into block copies; a disk tier under the pool in about two programs of three, so that evicted prefixes
(and all of them, when the pool's cache is reset) come back as tier loads, alone or continuing a pool hit.
Segment reuse is left out: a grouped layout refuses it (kvcache/layout.resolve_layout), as it needs every layer's K/V.

A wrong window is silent in a real model (a few logits drift), so the stand-in makes it loud. It keeps, for every KV
slot, what K/V it would hold (the group, the position and the tokens up to it), writes each computed position into
every group's table, and before the step's queries read, reads back through group 0's table every position so far
and through each window group's table every position its window reads (from `start - window + 1` on, none of them
NULL_BLOCK). A wrong hit, a window block missing or of another group, a block freed while still read and reused, fails
there. The tier's entries are the slots' records (RecordingBlockIO), so a load that put the wrong K/V into any group's
block fails the same read-back. It samples from the tokens so read back, so each choice's completion is known without
any cache. The engine turns an exception inside a step into finish_reason "error" for that step's requests; the soak
fails on every error but its own injected faults, so neither the stand-in's checks nor the scheduler's or the cache's
assertions are lost.

After every step `check_integrity()` holds, and a step that runs past its deadline fails the soak with the stack it
was stuck in; at the end every choice of every request has exactly one terminal outcome (stop, length, abort or
error, each reported once: by `step()` or by the abort), everything drained within a bounded number of steps, no block
is held, and the soak is asserted to have covered what it is for: hits that needed window blocks, hits of a whole
block-aligned prompt (its last block copied in every group), chunks past the window, forks, preemptions, evictions,
evictions from `cold`, tier loads (alone, after a pool hit, and after one whose windows the load needed), aborts
and failed steps.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import get_args

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from kvreuse.bench.passed_windows import PassedWindows, WindowRetention
from kvreuse.engine.engine import LLMEngine
from kvreuse.engine.model_runner import StepOutput
from kvreuse.engine.sequence import Sequence
from kvreuse.kvcache.accounting import ReuseRecord
from kvreuse.kvcache.block import NULL_BLOCK
from kvreuse.kvcache.block_pool import BlockPool
from kvreuse.kvcache.eviction import POLICIES
from kvreuse.kvcache.layout import first_window_block
from kvreuse.kvcache.tiers.entry import BlockSpec
from kvreuse.llm import LLM
from kvreuse.sampling_params import SamplingParams
from kvreuse.weights.tokenizer import Tokenizer

from .conftest import make_config
from .soak_driver import Faults, Run, choices, programs_from_the_seed_alone
from .test_architectures import build

SOAK_SEED = 1414
SOAK_PROGRAMS = 120
SOAK_OPERATIONS = 3600          # at least: 120 programs of 30-60 operations
MAX_PROMPT = 160                # longer continuations are not sent (the pool would refuse most of them)

LAYERS = {2: ["sliding_attention", "full_attention"] * 2,                             # 2 full, 2 sliding: 2 groups
          3: ["sliding_attention", "sliding_attention", "full_attention"] * 2}        # 2 full, 4 sliding: 3 groups
MODELS = [(3, 20), (2, 24), (3, 24), (2, 20)]  # (groups, window): 20 is no multiple of 8, 24 one of both block sizes

EOS = 2
# What the stand-in samples: plain words (they detokenize to ordinary text) and EOS now and then.
SAMPLED = [260, 2644, 2643, 335, 253, 1171, 284, 965, 2767, 7674, 2025, EOS]
DOCUMENTS = [list(range(1000, 1072)), list(range(2000, 2064))]
# Shared prefix lengths: mid-block (9, 23, 31, 57) or on a block boundary (16, 40, 48, 64, 72) for blocks of 4 and 8.
CUTS = (9, 16, 23, 31, 40, 48, 57, 64, 72)
# What every run must have seen at least once (beside each eviction policy and window retention).
COVERED = ("prefix hits", "hits past the window", "hits of a whole prompt", "turn", "again", "diverge", "forks",
           "block copies", "chunked prefill steps", "chunks past the window", "preemptions", "evictions",
           "window blocks unpublished", "cold evictions", "refused", "salted requests", "requests without the cache",
           "finished stop", "finished length", "finished abort", "finished error", "faults in the forward",
           "faults in the copy", "pool resets", "programs with a disk tier", "tier loads",
           "tier loads after a pool hit", "tier loads reading the pool's windows")
FAULT = 5  # a "fault" operation injects one only when it draws this (faults fail whole steps: keep them rare)

Held = tuple[int, int, int]  # what a KV slot holds: (group, position, hash of the tokens up to that position)


def next_token(context: list[int], index: int) -> int:
    """The stand-in model: a deterministic function of the last tokens of the context, and of the choice's index
    (so the choices of a request differ, and a fork's copied block is read back by a sequence of other tokens)."""
    return SAMPLED[(sum((i + 1) * t for i, t in enumerate(context[-6:])) + 5 * index) % len(SAMPLED)]


def expected_completion(prompt: list[int], params: SamplingParams, index: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(params.max_tokens):
        tokens.append(next_token(tokens, index))
        if tokens[-1] == EOS and not params.ignore_eos:
            break
    return tokens[len(prompt):]


class RecordingForward:
    """Stands in for the ModelRunner on a grouped pool. Every KV slot holds what the K/V written there would be: the
    group, the position and (a hash of) the tokens up to it. Computed positions are written into every group's table,
    `copy_blocks` copies slot by slot; before sampling or advancing, group 0 reads back every position and each window
    group the positions its window reads, and each must hold that group's K/V of this sequence."""

    def __init__(self, engine: LLMEngine, coverage: Counter):
        self.engine, self.coverage = engine, coverage
        self.bs = engine.block_size
        self.windows = engine.kv_manager.windows
        self.slots: list[Held | None] = [None] * (len(engine.kv_manager.pool.blocks) * self.bs)  # the null block too
        self.prefix_hashes: dict[str, list[int]] = {}
        self.admissions: set[tuple[str, int]] = set()

    def run(self, seqs: list[Sequence], segments) -> StepOutput:
        return StepOutput([self.forward(seq) for seq in seqs])

    def hashes(self, seq: Sequence) -> list[int]:
        """Per position, a hash of the sequence's tokens up to it: what its K/V there depend on."""
        hashes = self.prefix_hashes.setdefault(seq.request_id, [])
        for token in seq.token_ids[len(hashes):]:
            hashes.append(hash((hashes[-1] if hashes else 0, token)))
        return hashes

    def slot(self, seq: Sequence, group: int, position: int) -> int:
        block_id = seq.kv.block_tables[group][position // self.bs]
        assert block_id != NULL_BLOCK, f"{seq.request_id}: group {group} released the block of position {position}"
        return block_id * self.bs + position % self.bs

    def forward(self, seq: Sequence) -> list[tuple[int, None]] | None:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
        tables = seq.kv.block_tables
        assert len(tables) == 1 + len(self.windows), f"{seq.request_id} has {len(tables)} block tables"
        assert all(len(t) * self.bs >= end for t in tables), f"{seq.request_id}: a table too short for {end} tokens"
        self.on_admission(seq, start)
        if not seq.kv.use_cache:
            pool = self.engine.kv_manager.pool
            assert all(pool.blocks[b].block_key is None for t in tables for b in t if b != NULL_BLOCK), \
                f"{seq.request_id} (use_cache=False) holds a published block"
        hashes = self.hashes(seq)
        for group in range(len(tables)):
            for position in range(start, end):
                self.slots[self.slot(seq, group, position)] = (group, position, hashes[position])
        self.read_back(seq, 0, 0, end)
        for group, window in enumerate(self.windows, start=1):
            self.read_back(seq, group, max(0, start - window + 1), end)
        if end < seq.num_tokens:
            self.coverage["chunked prefill steps"] += 1
            self.coverage["chunks past the window"] += any(s > 0 for s in seq.kv.tables.window_starts)
            return None
        return [(next_token(seq.token_ids, c.index), None) for c in [seq, *seq.unforked_choices]]

    def read_back(self, seq: Sequence, group: int, first: int, end: int) -> None:
        hashes = self.hashes(seq)
        for position in range(first, end):
            held = self.slots[self.slot(seq, group, position)]
            if held != (group, position, hashes[position]):
                block_id = seq.kv.block_tables[group][position // self.bs]
                what = "nothing" if held is None else (f"group {held[0]}'s K/V of position {held[1]} of "
                                                       f"{'these' if held[2] == hashes[held[1]] else 'other'} tokens")
                raise AssertionError(f"{seq.request_id} reads position {position} through group {group} (block "
                                     f"{block_id}, computed {seq.num_computed_tokens}): it holds {what}")

    def on_admission(self, seq: Sequence, start: int) -> None:
        """The first forward since `seq` was admitted (or forked): count forks and check prefix hits."""
        admission = (seq.request_id, seq.num_preemptions)
        if admission in self.admissions or start == 0:
            self.admissions.add(admission)
            return
        self.admissions.add(admission)
        kv, admitted = seq.kv, seq.admitted or ReuseRecord()  # a forked choice was never admitted
        if start != admitted.cached_tokens:
            assert seq.parent is not None, f"{seq.request_id} starts at {start}, of which {admitted.cached_tokens} hit"
            self.coverage["forks"] += 1
            return
        assert kv.use_cache, f"{seq.request_id} (use_cache=False) got a hit"
        # Whole blocks, or a block-aligned prompt's all but its last token (its last block copied in every group).
        whole_prompt = start == seq.num_tokens - 1 and seq.num_tokens % self.bs == 0
        assert start % self.bs == 0 or whole_prompt, f"{seq.request_id} hit {start} tokens, not whole blocks"
        pool, num_hits = self.engine.kv_manager.pool, start // self.bs
        # The loaded blocks follow the pool's hits. They are the request's own (published at admission, the windows'
        # after the step, or kept private beside a twin the pool already holds): their contents are checked by the
        # read-back, their salt by the tier's keys.
        num_pool_hits = num_hits - (admitted.cached_tokens_disk + admitted.cached_tokens_redis) // self.bs
        for group, table in enumerate(kv.block_tables):
            first = 0 if group == 0 else first_window_block(start, self.windows[group - 1], self.bs)
            for i, block_id in enumerate(table[first:num_hits], start=first):
                assert block_id != NULL_BLOCK, f"{seq.request_id}: a hit without group {group}'s window"
                block = pool.blocks[block_id]
                if i >= num_pool_hits:
                    continue
                assert block.extra_key == kv.extra_key, "a hit crossed a salt"
                assert block.group == group, f"group {group} hit block {block_id} of group {block.group}"
        if num_pool_hits < num_hits:
            self.coverage["tier loads"] += 1
            self.coverage["tier loads after a pool hit"] += num_pool_hits > 0
            self.coverage["tier loads reading the pool's windows"] += any(
                first_window_block(start, w, self.bs) < num_pool_hits for w in self.windows)
        self.coverage["prefix hits"] += 1
        self.coverage["hits of a whole prompt"] += start % self.bs > 0
        self.coverage["hits past the window"] += start > min(self.windows)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """The engine's block copies (a forked partial block, a cached prompt's last block: in every group), slot by
        slot."""
        self.coverage["block copies"] += len(copies)
        for source, destination in copies:
            assert NULL_BLOCK not in (source, destination), f"a copy of a released block: {source} -> {destination}"
            for j in range(self.bs):
                self.slots[destination * self.bs + j] = self.slots[source * self.bs + j]


class RecordingBlockIO:
    """Stands in for the pool's BlockIO under the disk tier: an entry is the records of its position's slots in every
    group (as RecordingForward keeps them), padded to a fixed size; a load writes them back into the new blocks."""

    ENTRY_BYTES = 2048

    def __init__(self, forward: RecordingForward, fingerprint: str):
        self.forward = forward
        self.spec = BlockSpec(fingerprint, "records", forward.bs, (self.ENTRY_BYTES,), 1)

    def read(self, positions: list[tuple[int, ...]]) -> list[bytes]:
        bs, slots = self.forward.bs, self.forward.slots
        entries = [json.dumps([slots[b * bs:(b + 1) * bs] for b in block_ids]).encode() for block_ids in positions]
        assert all(len(e) <= self.ENTRY_BYTES for e in entries), "an entry outgrew ENTRY_BYTES"
        return [e.ljust(self.ENTRY_BYTES) for e in entries]

    def write(self, positions: list[tuple[int, ...]], payloads: list) -> None:
        bs, slots = self.forward.bs, self.forward.slots
        for block_ids, payload in zip(positions, payloads, strict=True):
            records = json.loads(bytes(payload))
            assert len(records) == len(block_ids), f"an entry of {len(records)} groups for {len(block_ids)}"
            for block_id, held in zip(block_ids, records, strict=True):
                slots[block_id * bs:(block_id + 1) * bs] = [None if h is None else tuple(h) for h in held]


def watch_evictions(pool: BlockPool, passed: PassedWindows, coverage: Counter) -> None:
    """Count the evictions of window blocks, and of those the ones taken from `cold` (released by a window that
    passed them, never hit since)."""
    evict = pool._evict

    def counting_evict(count: bool = True):
        coverage["cold evictions"] += bool(passed.policy.cold)  # evicted first, whenever there is one
        return evict(count)

    pool._evict = counting_evict
    pool.on_evict.append(lambda block: coverage.update({"window blocks unpublished": int(block.group > 0)}))


# --- programs of operations --------------------------------------------------------------------------------------
def fresh(max_size: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(5000, 6000), min_size=1, max_size=max_size)


def prompts() -> st.SearchStrategy[list[int]]:
    prefix = st.tuples(st.sampled_from(range(len(DOCUMENTS))), st.sampled_from(CUTS)).map(
        lambda d: DOCUMENTS[d[0]][:d[1]])
    shared = st.tuples(prefix, st.lists(st.integers(5000, 6000), max_size=12)).map(lambda p: p[0] + p[1])
    return st.one_of(shared, shared, shared, fresh(40))


def operations(max_tokens: int) -> st.SearchStrategy[tuple]:
    num_tokens = st.integers(1, max_tokens)
    add = st.tuples(st.just("add"), prompts(), num_tokens, st.sampled_from([None, None, "a", "b"]),
                    st.sampled_from([True, True, True, False]), st.booleans(), st.sampled_from([1, 1, 1, 2, 3]))
    # An earlier request's prompt and what it has completed so far, then the user's next tokens.
    turn = st.tuples(st.just("turn"), st.integers(0, 99), fresh(10), num_tokens)
    # An earlier request's prompt again (a block-aligned one is cached whole: its last block is copied).
    again = st.tuples(st.just("again"), st.integers(0, 99), num_tokens)
    # An earlier request's prompt, cut inside its last block, then other tokens.
    diverge = st.tuples(st.just("diverge"), st.integers(0, 99), st.integers(0, 7), fresh(9), num_tokens)
    step = st.tuples(st.just("step"), st.integers(1, 3))
    retention = st.tuples(st.just("retention"), st.sampled_from(get_args(WindowRetention)))
    abort = st.tuples(st.just("abort"), st.integers(0, 99))
    fault = st.tuples(st.just("fault"), st.integers(0, 9), st.sampled_from(["forward", "copy"]))
    # Drop the pool's cached blocks (not the tier's), when it draws 0, then send an earlier request's prompt again: what
    # the pool lost comes back from the tier, where there is one.
    forget = st.tuples(st.just("forget"), st.integers(0, 4), st.integers(0, 99), num_tokens)
    return st.one_of(add, add, turn, turn, again, diverge, step, step, step, abort, fault, retention, forget)


@st.composite
def engine_settings(draw) -> dict:
    block_size = draw(st.sampled_from([4, 8]))
    return {"cache__block_size": block_size,
            "engine__num_kv_blocks": draw(st.integers(120, 480)) // block_size,
            "cache__max_blocks": draw(st.integers(4, 96)),
            "cache__policy": draw(st.sampled_from(list(POLICIES))),
            "cache__min_match_blocks": draw(st.integers(1, 2)),
            "engine__max_num_batched_tokens": draw(st.integers(8, 48)),
            "engine__max_num_seqs": draw(st.integers(1, 8)),
            "disk": draw(st.sampled_from([True, True, False]))}


def run_program(run: Run, passed: PassedWindows, program: list[tuple], coverage: Counter) -> None:
    engine = run.engine
    faults = Faults(engine)
    for op in program:
        coverage["operations"] += 1
        prompt = None
        if op[0] == "forget" and op[1] == 0:
            engine.reset_prefix_cache()
            coverage["pool resets"] += 1
            op = ("again", *op[2:])
        if op[0] == "add":
            _, prompt, max_tokens, salt, use_cache, ignore_eos, n = op
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, n=n)
            coverage["salted requests"] += salt is not None
            coverage["requests without the cache"] += not use_cache
            coverage["requests of several choices"] += n > 1
        elif op[0] in ("turn", "again", "diverge") and run.requests:
            earlier = run.earlier(op[1])
            salt, use_cache = run.salts[earlier.request_id], True
            if op[0] == "turn":
                prompt = earlier.token_ids + op[2]
            elif op[0] == "again":
                prompt = earlier.prompt_token_ids
            else:  # cut 1 to all of the tokens of its last block
                last = (earlier.num_prompt_tokens - 1) % engine.block_size + 1
                prompt = earlier.prompt_token_ids[:-(1 + op[2] % last)] + op[3]
            params = SamplingParams(max_tokens=op[-1], ignore_eos=earlier.params.ignore_eos)
        elif op[0] == "step":
            for _ in range(op[1]):
                run.step()
        elif op[0] == "abort":
            run.abort(op[1])
        elif op[0] == "fault" and op[1] == FAULT:
            faults.armed = op[2]
        elif op[0] == "retention":
            # Not a config key but the bench's (bench/passed_windows.py), read at each release: what the blocks passed
            # from now on become.
            passed.mode = op[1]
            coverage[f"window retention set to {op[1]}"] += 1
        if prompt is not None and len(prompt) <= MAX_PROMPT:
            coverage[op[0] if run.add(prompt, params, salt, use_cache) else "refused"] += 1
    faults.armed = None
    run.drain()
    run.check_the_end()
    coverage.update(f"faults in the {where}" for where in run.faulted)
    coverage["preemptions"] += engine.scheduler.num_preemptions
    coverage["evictions"] += engine.kv_manager.pool.num_evictions
    for seq in run.requests:
        for choice in choices(seq):
            coverage[f"finished {choice.finish_reason}"] += 1
        coverage["cached tokens"] += seq.reuse_or_planned.cached_tokens


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, real_tokenizer) -> dict[tuple[int, int], str]:
    """A tiny random-weight Gemma 3 directory for each (groups, window) of MODELS."""
    return {(groups, window): str(build("gemma3", tmp_path_factory.mktemp(f"gemma3-{groups}-groups-{window}"),
                                        len(real_tokenizer.hf), real_tokenizer, num_hidden_layers=len(LAYERS[groups]),
                                        layer_types=LAYERS[groups], sliding_window=window))
            for groups, window in MODELS}


@pytest.fixture(scope="module")
def engine_factory(model_dirs, real_tokenizer, tmp_path_factory) -> Callable[..., LLMEngine]:
    """Fresh grouped engines, cheaply: the tokenizer (read-only, ~0.7 s to load) is loaded once."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Tokenizer, "load", classmethod(lambda cls, path, fingerprint, chat_template=None: real_tokenizer))

        def make(model: tuple[int, int], disk: bool = False, **settings) -> LLMEngine:
            if disk:  # on tmpfs where there is one: the tier fsyncs every entry, and the soak writes thousands
                root = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path_factory.getbasetemp()
                settings["cache__disk__path"] = str(Path(tempfile.mkdtemp(prefix="kvreuse-soak-disk-", dir=root)))
            config = make_config(model__path=model_dirs[model], model__dtype="fp32", cache__sliding_kv="window",
                                 **settings)
            engine = LLM(config).engine
            layout = engine.front_end.kv_layout
            groups, window = model
            assert layout.is_grouped and len(layout.groups) == groups, layout
            assert [g.window for g in layout.window_groups] == [window] * (groups - 1), layout
            return engine

        yield make


def test_soak_windows_3600_operations_seed_1414(engine_factory):
    coverage: Counter = Counter()

    @seed(SOAK_SEED)
    @settings(max_examples=SOAK_PROGRAMS, deadline=None, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(model=st.sampled_from(MODELS), settings_=engine_settings(),
           program=st.lists(operations(max_tokens=24), min_size=30, max_size=60))
    def soak(model: tuple[int, int], settings_: dict, program: list[tuple]) -> None:
        engine = engine_factory(model, **settings_)
        coverage[f"programs under {settings_['cache__policy']}"] += 1
        engine.runner = RecordingForward(engine, coverage)
        if engine.tiers is not None:
            coverage["programs with a disk tier"] += 1
            engine.tiers.io = RecordingBlockIO(engine.runner, engine.front_end.fingerprint)
            engine.tiers.spec = engine.tiers.io.spec
        passed = PassedWindows.install(engine.kv_manager)
        watch_evictions(engine.kv_manager.pool, passed, coverage)
        run = Run(engine)  # a step takes milliseconds here: one past Run.step_seconds is stuck
        try:
            run_program(run, passed, program, coverage)
        finally:
            if engine.tiers is not None:
                engine.tiers.close()
                shutil.rmtree(engine.tiers.tiers[0].path, ignore_errors=True)
        for seq in run.requests:
            for choice in choices(seq):
                expected = expected_completion(choice.prompt_token_ids, choice.params, choice.index)
                if choice.finish_reason in ("stop", "length"):
                    assert choice.completion_token_ids == expected, choice.request_id
                else:  # aborted or failed: what it had produced so far
                    assert choice.completion_token_ids == expected[:choice.num_completion_tokens], choice.request_id

    with programs_from_the_seed_alone():
        soak()
    assert coverage["operations"] >= SOAK_OPERATIONS, coverage
    for seen in (*(f"programs under {p}" for p in POLICIES),
                 *(f"window retention set to {r}" for r in get_args(WindowRetention)), *COVERED):
        assert coverage[seen] > 0, f"the soak never covered {seen}: {coverage}"
