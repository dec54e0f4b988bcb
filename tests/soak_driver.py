"""What the randomized soaks (test_soak.py, test_soak_windows.py) drive an engine with: a program's requests and the
outcome of each choice, steps under a deadline, faults injected into the forward or the block copies, and the checks
at the end (one terminal outcome per choice, everything drained, no block held).

A step that raises fails its requests with finish_reason "error" and the engine goes on; the soak then fails on every
error but the faults it injected itself, so neither a stand-in forward's checks nor the scheduler's or the cache's
assertions are lost."""

from __future__ import annotations

import signal
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from hypothesis.internal.conjecture import providers

from kvreuse.engine.engine import LLMEngine, RequestError
from kvreuse.engine.model_runner import StepOutput
from kvreuse.engine.sequence import Sequence
from kvreuse.sampling_params import SamplingParams

DRAIN_STEPS = 3000  # liveness: everything left finishes within this many steps
TIER_WAIT_S = 60.0  # bound on waiting for the tier's writer or a prefetch (milliseconds here, unless the CPU is shared)
INJECTED = "InjectedFault: injected by the soak"  # how an injected fault reads in a failed request's error


class InjectedFault(RuntimeError):
    pass


class StepStuck(RuntimeError):
    pass


@contextmanager
def programs_from_the_seed_alone() -> Iterator[None]:
    """Hypothesis draws now and then from the literals of every local module imported so far (its "local
    constants"), so a seeded soak's programs would change with the code and with the tests run before it (a clean
    CI run drew other programs than the soak alone, and missed a covered case). Within this, it draws from its own
    constants only. Internal API: pinned hypothesis."""
    def none() -> providers.Constants:
        return providers.Constants()

    original = providers._get_local_constants
    providers.CONSTANTS_CACHE.cache.clear()  # allowed constants already computed with the local ones
    providers._get_local_constants = none
    try:
        yield
    finally:
        providers._get_local_constants = original
        providers.CONSTANTS_CACHE.cache.clear()


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise StepStuck, with the stack it interrupts, where the body runs past `seconds` (an endless loop would
    otherwise hang the test run). Main thread only (SIGALRM)."""
    def stuck(signum, frame):
        where = "".join(traceback.format_stack(frame, limit=6))
        raise StepStuck(f"still running after {seconds} s, in:\n{where}")

    previous = signal.signal(signal.SIGALRM, stuck)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Faults:
    """Wraps an engine's forward and block copies: once armed for one of them ("forward" or "copy"), its next call
    raises (and fails the requests of its step). A copy fails between a fork and its choices' first tokens."""

    def __init__(self, engine: LLMEngine):
        self.forward, self.copy, self.armed = engine.runner.run, engine.runner.copy_blocks, None
        engine.runner.run, engine.runner.copy_blocks = self.run, self.copy_blocks

    def fire(self, where: str) -> None:
        if self.armed == where:
            self.armed = None
            raise InjectedFault(f"injected by the soak into the {where}")

    def run(self, seqs: list[Sequence], segments) -> StepOutput:
        self.fire("forward")
        return self.forward(seqs, segments)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.fire("copy")
        self.copy(copies)


def choices(seq: Sequence) -> list[Sequence]:
    return seq.choices or [seq]


@dataclass
class Run:
    """One program's requests (choice 0 of each) and what became of each choice."""
    engine: LLMEngine
    step_seconds: float = 2.0  # a step past this is stuck, and fails the soak naming where
    requests: list[Sequence] = field(default_factory=list)
    outcomes: dict[str, list[str]] = field(default_factory=dict)
    salts: dict[str, str | None] = field(default_factory=dict)
    faulted: set[str] = field(default_factory=set)  # where the faults that failed requests were injected

    def add(self, prompt: list[int], params: SamplingParams, salt: str | None, use_cache: bool) -> bool:
        tiers = self.engine.tiers
        if tiers is not None:  # what was published is in the tiers, whatever the writer thread's pace
            assert tiers.flush(timeout=TIER_WAIT_S), "the tier's writer did not catch up"
        try:
            seq = self.engine.add_request(prompt, params, cache_salt=salt, use_cache=use_cache)
        except RequestError:
            return False  # larger than the pool or the context: refused, never queued
        # Its tier read done before the next step: a program runs alike whatever the threads' timing.
        self.engine.kv_manager.wait_for_load(seq.kv, TIER_WAIT_S)
        self.requests.append(seq)
        for choice in choices(seq):
            self.outcomes[choice.request_id] = []
        self.salts[seq.request_id] = salt
        return True

    def earlier(self, index: int) -> Sequence | None:
        return self.requests[index % len(self.requests)] if self.requests else None

    def step(self) -> None:
        with deadline(self.step_seconds):
            updated = self.engine.step()
        for seq in updated:
            if seq.is_finished:
                self.outcomes[seq.request_id].append(seq.finish_reason)
            if seq.finish_reason == "error":
                assert INJECTED in seq.error, f"{seq.request_id}: {seq.error}"
                self.faulted.add(seq.error.rsplit(" ", 1)[-1])
        self.engine.check_integrity()

    def abort(self, index: int) -> None:
        seq = self.earlier(index)
        if seq is not None and seq.request_id in self.engine.sequences:
            unfinished = [c for c in choices(seq) if not c.is_finished]
            self.engine.abort(seq.request_id)
            for choice in unfinished:
                self.outcomes[choice.request_id].append("abort")
        self.engine.check_integrity()

    def drain(self) -> None:
        for _ in range(DRAIN_STEPS):
            if not self.engine.has_unfinished():
                return
            self.step()
        raise AssertionError(f"requests still unfinished after {DRAIN_STEPS} steps: {list(self.engine.sequences)}")

    def check_the_end(self) -> None:
        engine = self.engine
        for seq in self.requests:
            for choice in choices(seq):
                assert self.outcomes[choice.request_id] == [choice.finish_reason], \
                    (choice.request_id, self.outcomes[choice.request_id])
        assert not engine.sequences and not engine.has_unfinished()
        engine.check_integrity()
        engine.kv_manager.check_integrity([])
        pool = engine.kv_manager.pool
        assert pool.num_used_blocks == 0 and engine.kv_manager.num_free_blocks == engine.num_kv_blocks
        assert pool.num_cached_blocks <= pool.max_cached_blocks
