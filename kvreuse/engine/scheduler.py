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
fork, and after each forward (`update`, which also has the cache publish what was computed).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvreuse.engine.sequence import Sequence, SequenceStatus
from kvreuse.engine.waiting_queue import WaitingQueue
from kvreuse.kvcache.copy_jobs import CopyJobs
from kvreuse.kvcache.manager import KVCacheManager

if TYPE_CHECKING:
    from kvreuse.engine.model_runner import StepOutput

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    seqs: list[Sequence]
    copy_jobs: CopyJobs = field(default_factory=CopyJobs)  # what admission asks for before the forward

    @property
    def num_prefill_tokens(self) -> int:
        """Scheduled tokens that are not decodes (prompt chunks, and recomputation after a preemption)."""
        return sum(s.num_scheduled_tokens for s in self.seqs if s.is_prefilling)


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv_manager = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.considering: Sequence | None = None  # the queue's head while `schedule` weighs admitting it

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def wait_for_head(self, timeout: float) -> None:
        """With nothing to run, wait (up to `timeout`) for the prefix read of the queue's head, instead of spinning."""
        if self.waiting and not self.running:
            self.kv_manager.wait_for_load(self.waiting.head.kv, timeout)

    def schedule(self) -> SchedulerOutput:
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
            self.considering = seq
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
            out.copy_jobs += kv.admit(seq.kv, match, num_tokens)
            seq.num_computed_tokens = match.num_cached_tokens
            seq.num_scheduled_tokens = num_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            num_prefilling += 1
            budget -= num_tokens
            seats += self.seats_of(seq)
        self.considering = None
        return out

    @property
    def num_seats_taken(self) -> int:
        """Places of the running batch in use: the running sequences and the choices they will fork."""
        return sum(s.num_seats for s in self.running)

    def seats_of(self, seq: Sequence) -> int:
        """The places `seq` takes when admitted; a request of more choices than the batch holds takes all of them,
        and its choices beyond go to the queue when forked."""
        return min(seq.num_seats, self.max_num_seqs)

    def update(self, out: SchedulerOutput, step: StepOutput) -> CopyJobs:
        """After the forward of `out`: each sequence's computed tokens advance by what it computed, and the cache
        publishes them (see KVCacheManager.update). Returns the copy jobs that publishing asks for."""
        jobs = CopyJobs()
        for seq in out.seqs:
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            outcome = step.outcomes.get(seq.request_id)
            jobs += self.kv_manager.update(seq.kv, seq.num_computed_tokens, exact=outcome is not None and outcome.exact,
                                           prompt_logprobs=step.prompt_logprobs.get(seq.request_id))
        return jobs

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
        self.kv_manager.free(seq.kv)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def check_integrity(self) -> None:
        self.kv_manager.check_integrity([s.kv for s in self.running])
        assert len(self.running) <= self.max_num_seqs, f"{len(self.running)} running > max_num_seqs {self.max_num_seqs}"
        bs = self.kv_manager.block_size
        for seq in self.running:
            assert len(seq.kv.block_table) * bs >= seq.num_computed_tokens, f"{seq.request_id} has a short table"
        for seq in self.waiting:
            assert not seq.kv.block_table, f"waiting {seq.request_id} holds blocks"
