"""Continuous batching: which sequences compute how many tokens in the next forward.

Each step spends a budget of `max_num_batched_tokens` (as vLLM's scheduler does): running sequences first, in
admission order, each with its next token (decode) or its next prompt chunk, then waiting sequences: in arrival
order within a tenant, the tenants in turn (waiting_queue.py). So decodes ride along with prefills instead of
stalling behind them, and one tenant's thousand queued sequences delay another's request by one admission. The
running batch holds at most `max_num_seqs` sequences, the choices of n > 1 included: a request is admitted with a
seat for each choice still to be forked from it. A prompt that reuses cached
segments is taken whole (its repair is one forward). A waiting prompt that shares blocks with a prompt of this
step waits one step and reuses them instead of computing them alongside. A prompt whose prefix is being read from
a lower tier (disk, Redis) waits for the read, while the running sequences go on. When the KV pool runs out, the
youngest running sequence is preempted: its blocks are freed and it goes back to the front of the queue, to be
recomputed later.

The scheduler alone writes a sequence's `num_computed_tokens` and `num_scheduled_tokens`: at admission, preemption and
fork, and after each forward. It owns the whole aftermath of a forward (`postprocess`): computed tokens advance and
the cache publishes them, n > 1 choices fork, the drawn tokens are appended, the engine's stop check says who
finishes, and finished sequences free their blocks. A fault in `schedule` or `postprocess` leaves as a
`SchedulerFault` that names what the engine must fail besides the step's sequences (a queue head whose weighing keeps
raising), and what `postprocess` had already done.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvreuse.engine.sequence import Sequence, SequenceStatus
from kvreuse.engine.waiting_queue import WaitingQueue
from kvreuse.kvcache.accounting import ReuseRecord
from kvreuse.kvcache.copy_jobs import CopyJobs
from kvreuse.kvcache.manager import KVCacheManager
from kvreuse.kvcache.match import AdmissionOutcome
from kvreuse.kvcache.prompt_logprobs import merge_records

if TYPE_CHECKING:
    from kvreuse.engine.model_runner import Draw, StepOutput
    from kvreuse.layers.sampler import TokenLogprob

logger = logging.getLogger(__name__)

# Steps in a row whose scheduling may raise while weighing the same waiting request before it is failed: a fault that
# passes spares it, one of its own must not hold the queue behind it.
MAX_ADMISSION_FAULTS = 3

# The engine's stop check: why `seq` finishes after appending `token_id` ("stop", "length"), or None.
StopRule = Callable[[Sequence, int], "str | None"]


@dataclass
class SchedulerOutput:
    seqs: list[Sequence]
    copy_jobs: CopyJobs = field(default_factory=CopyJobs)  # what admission asks for before the forward

    @property
    def num_prefill_tokens(self) -> int:
        """Scheduled tokens that are not decodes (prompt chunks, and recomputation after a preemption)."""
        return sum(s.num_scheduled_tokens for s in self.seqs if s.is_prefilling)


@dataclass
class StepResult:
    """What `postprocess` did after a forward."""
    updated: list[Sequence] = field(default_factory=list)   # produced a token or finished, in that order
    finished: list[Sequence] = field(default_factory=list)  # finished (blocks freed), in that order
    copy_jobs: list[CopyJobs] = field(default_factory=list)  # to run in this order (publishing, then each fork)


class SchedulerFault(Exception):
    """`cause` raised inside `schedule` or `postprocess`. `culprits`: sequences to fail besides the step's own (the
    queue's head, once weighing it has raised MAX_ADMISSION_FAULTS steps in a row: a fault of its own, which would
    otherwise hold the queue behind it forever). `done`: what `postprocess` had done before it raised, if it had
    started."""

    def __init__(self, cause: Exception, culprits: list[Sequence] | None = None, done: StepResult | None = None):
        super().__init__(str(cause))
        self.cause, self.culprits, self.done = cause, culprits or [], done


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv_manager = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._considering: Sequence | None = None  # the queue's head while `schedule` weighs admitting it

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def wait_for_head(self, timeout: float) -> None:
        """With nothing to run, wait (up to `timeout`) for the prefix read of the queue's head, instead of spinning."""
        if self.waiting and not self.running:
            self.kv_manager.wait_for_load(self.waiting.head.kv, timeout)

    def schedule(self) -> SchedulerOutput:
        """The next forward's sequences and token counts, and the copy jobs their admission asks for. Raises
        SchedulerFault where it fails."""
        try:
            return self._schedule()
        except Exception as exc:
            raise SchedulerFault(exc, culprits=self._count_head_fault()) from exc

    def _count_head_fault(self) -> list[Sequence]:
        """After `schedule` raised: count a fault against the queue's head if it was being weighed; it is the fault's
        culprit from its MAX_ADMISSION_FAULTS-th on."""
        head, self._considering = self._considering, None
        if head is None or all(s is not head for s in self.waiting):
            return []
        head.num_admission_faults += 1
        return [head] if head.num_admission_faults >= MAX_ADMISSION_FAULTS else []

    def _schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        out = SchedulerOutput([])
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status == SequenceStatus.RUNNING and self._reserve(seq, min(seq.num_uncomputed_tokens, budget)):
                out.seqs.append(seq)
                budget -= seq.num_scheduled_tokens
        num_prefilling = sum(s.is_prefilling for s in out.seqs)
        kv = self.kv_manager
        seats = self.num_seats_taken
        while self.waiting and budget > 0:
            seq = self.waiting.head
            if seats + self.seats_of(seq) > self.max_num_seqs:
                break  # the batch is full, counting the choices its requests will fork
            if kv.is_loading(seq.kv):
                break  # strict arrival order: the queue waits for its head's prefix to arrive
            self._considering = seq
            match = kv.match(seq.kv)
            publishing = [(s.kv, s.num_computed_tokens + s.num_scheduled_tokens) for s in out.seqs]
            if kv.gains_by_waiting(seq.kv, match, publishing):
                break  # blocks it shares with this step's prompts are reusable from the next step on
            num_tokens = seq.num_tokens - match.num_cached_tokens
            if match.plan is None:
                num_tokens = min(num_tokens, budget)
            elif num_prefilling and num_tokens > budget:
                break  # a prompt that reuses segments is repaired in one forward, whole
            if not kv.can_admit(match, num_tokens):
                if not self.running and kv.pins.pins:
                    # Nothing runs that could free blocks: the pins yield, or the head (and the queue) would wait
                    # forever.
                    logger.warning("unpinning every prefix (%d blocks): request %s needs the room and nothing else "
                                   "runs", kv.pins.unpin_all(), seq.request_id)
                    continue
                break  # strict arrival order: nobody overtakes the head of the queue
            self.waiting.popleft()
            self._keep_outcome(seq, kv.admit(seq.kv, match, num_tokens), out)
            seq.num_computed_tokens = match.num_cached_tokens
            seq.num_scheduled_tokens = num_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            num_prefilling += 1
            budget -= num_tokens
            seats += self.seats_of(seq)
        self._considering = None
        return out

    @staticmethod
    def _keep_outcome(seq: Sequence, admission: AdmissionOutcome, out: SchedulerOutput) -> None:
        """What `seq`'s admission took, kept on it: its record, the tiers' read time, the stored prompt logprobs."""
        out.copy_jobs += admission.copy_jobs
        seq.admitted = admission.reuse
        if admission.load_seconds is not None:
            seq.times.tier_load_s = admission.load_seconds
        merge_records(seq.prompt_logprobs, 0, admission.prompt_logprobs)

    @property
    def num_seats_taken(self) -> int:
        """Places of the running batch in use: the running sequences and the choices they will fork."""
        return sum(s.num_seats for s in self.running)

    def seats_of(self, seq: Sequence) -> int:
        """The places `seq` takes when admitted; a request of more choices than the batch holds takes all of them,
        and its choices beyond go to the queue when forked."""
        return min(seq.num_seats, self.max_num_seqs)

    def postprocess(self, out: SchedulerOutput, step: StepOutput, stop: StopRule) -> StepResult:
        """The aftermath of the forward of `out`: each sequence's computed tokens advance and the cache publishes
        them (KVCacheManager.update); a sequence that drew tokens forks its unforked choices (n > 1), takes its token
        and gives each choice its own; `stop` says which of them finish, and those free their blocks. Raises
        SchedulerFault (with what was done) where it fails after publishing."""
        done = StepResult(copy_jobs=[self._advance(out, step)])
        now = time.perf_counter()
        try:
            for seq, draws in zip(out.seqs, step.draws, strict=True):
                if draws is not None:
                    self._take_draws(seq, draws, stop, now, done)
        except Exception as exc:
            raise SchedulerFault(exc, done=done) from exc
        return done

    def _advance(self, out: SchedulerOutput, step: StepOutput) -> CopyJobs:
        """Each sequence's computed tokens advance by what it computed, and the cache publishes them; the copy jobs
        that publishing asks for."""
        jobs = CopyJobs()
        for seq in out.seqs:
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            outcome = step.outcomes.get(seq.request_id)
            if seq.kv.prompt_logprobs is not None:
                merge_records(seq.prompt_logprobs, *step.prompt_logprobs.get(seq.request_id, (0, ())))
            jobs += self.kv_manager.update(seq.kv, seq.num_computed_tokens, exact=outcome is not None and outcome.exact,
                                           prompt_logprobs=seq.prompt_logprobs)
        return jobs

    def _take_draws(self, seq: Sequence, draws: list[Draw], stop: StopRule, now: float, done: StepResult) -> None:
        if seq.params.max_tokens == 0:  # it only scores its prompt: the prompt is done
            self._finish_at(seq, "length", now, done)
            done.updated.append(seq)
            return
        forked = seq.unforked_choices
        for choice in forked:  # before `seq` takes its token: a first token that ends it frees its blocks
            choice.reuse = ReuseRecord()  # the prompt is its request's, accounted once, on `seq`
            done.copy_jobs.append(self.fork(seq, choice))
        for target, (token_id, logprob) in zip([seq, *forked], draws, strict=True):
            self._append(target, token_id, logprob, stop, now, done)
            done.updated.append(target)

    def _append(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None, stop: StopRule, now: float,
                done: StepResult) -> None:
        seq.token_ids.append(token_id)
        if logprob is not None:
            seq.cumulative_logprob += logprob.logprob
            if seq.params.logprobs is not None:
                seq.logprobs.append(logprob)
        if seq.matcher is not None and not seq.matcher.is_finished():
            seq.matcher.accept(token_id)
        if seq.times.first_token is None:
            seq.times.first_token = now
        reason = stop(seq, token_id)
        if reason is not None:
            self._finish_at(seq, reason, now, done)

    def _finish_at(self, seq: Sequence, reason: str, now: float, done: StepResult) -> None:
        seq.times.finish = now
        self.finish(seq, reason)
        done.finished.append(seq)

    def fork(self, seq: Sequence, choice: Sequence) -> CopyJobs:
        """Start `choice` (n > 1) from `seq`'s computed prompt: running beside it, sharing its full blocks with a copy
        of its partial last block, in the seat `seq`'s admission kept for it; without a seat (a request of more
        choices than max_num_seqs) or a block free for that copy, first in its tenant's queue, to compute its prompt
        again (from the prefix cache, mostly)."""
        if len(self.running) >= self.max_num_seqs or not self.kv_manager.can_fork(seq.kv, seq.num_computed_tokens):
            self.waiting.appendleft(choice)
            return CopyJobs()
        jobs = self.kv_manager.fork(seq.kv, choice.kv, seq.num_computed_tokens)
        choice.num_computed_tokens = seq.num_computed_tokens
        choice.status = SequenceStatus.RUNNING
        self.running.append(choice)
        return jobs

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Allocate room for `num_tokens` of a running sequence, preempting the youngest running
        sequences as needed; False if `seq` itself had to be preempted."""
        needed = seq.num_computed_tokens + num_tokens
        while not self.kv_manager.can_allocate(seq.kv, needed):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        self.kv_manager.allocate(seq.kv, needed)
        seq.num_scheduled_tokens = num_tokens
        return True

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv_manager.free(seq.kv, finished=False)
        seq.num_computed_tokens = 0
        seq.num_scheduled_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (finished, aborted or failed) wherever it is and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        # Also when it is in neither: a step that failed while admitting it may have left it holding blocks.
        self.kv_manager.free(seq.kv, num_cached_tokens=seq.admitted.cached_tokens if seq.admitted else 0)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def check_integrity(self) -> None:
        self.kv_manager.check_integrity([s.kv for s in self.running])
        assert len(self.running) <= self.max_num_seqs, f"{len(self.running)} running > max_num_seqs {self.max_num_seqs}"
        bs = self.kv_manager.block_size
        for seq in self.running:
            assert len(seq.kv.tables.block_table) * bs >= seq.num_computed_tokens, f"{seq.request_id} has a short table"
        for seq in self.waiting:
            assert not seq.kv.tables.block_table, f"waiting {seq.request_id} holds blocks"
