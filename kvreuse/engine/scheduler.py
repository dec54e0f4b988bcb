"""Continuous batching: which sequences compute how many tokens in the next forward.

A step is either a prefill step (prompt chunks under the `max_num_batched_tokens` budget: unfinished
chunks of running sequences first, then waiting sequences in arrival order) or a decode step (one token
for every running sequence). When the KV pool runs out, the youngest running sequence is preempted:
its blocks are freed and it goes back to the front of the queue, to be recomputed later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvreuse.engine.sequence import Sequence, SequenceStatus
from kvreuse.kvcache.manager import KVCacheManager


@dataclass
class SchedulerOutput:
    seqs: list[Sequence]
    is_prefill: bool

    @property
    def num_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.seqs)


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv_manager = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        prefill = self._schedule_prefill()
        if prefill:
            return SchedulerOutput(prefill, is_prefill=True)
        return SchedulerOutput(self._schedule_decode(), is_prefill=False)

    def _schedule_prefill(self) -> list[Sequence]:
        budget = self.max_num_batched_tokens
        scheduled: list[Sequence] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status == SequenceStatus.RUNNING and seq.is_prefilling:
                num_tokens = min(seq.num_uncomputed_tokens, budget)
                if self._reserve(seq, num_tokens):
                    scheduled.append(seq)
                    budget -= num_tokens
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self.kv_manager.match_prefix(seq)
            plan = self.kv_manager.match_segments(seq, len(hits))
            num_tokens = seq.num_tokens - len(hits) * self.kv_manager.block_size
            if plan is None:
                num_tokens = min(num_tokens, budget)
            elif scheduled:
                break  # reused segments are repaired in one forward over the whole prompt, alone
            if not self.kv_manager.can_allocate(seq, num_tokens, hits, plan):
                break  # strict arrival order: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.kv_manager.allocate(seq, num_tokens, hits, plan)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
                seq.num_reused_tokens = plan.num_tokens if plan else 0
                seq.num_shifted_tokens = plan.num_shifted_tokens if plan else 0
            seq.num_scheduled_tokens = num_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(seq)
            budget -= num_tokens
            if plan is not None:
                break
        return scheduled

    def _schedule_decode(self) -> list[Sequence]:
        scheduled = []
        for seq in list(self.running):
            if seq.status == SequenceStatus.RUNNING and self._reserve(seq, 1):
                scheduled.append(seq)
        return scheduled

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Allocate room for `num_tokens` of a running sequence, preempting the youngest running
        sequences as needed; False if `seq` itself had to be preempted."""
        while not self.kv_manager.can_allocate(seq, num_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        self.kv_manager.allocate(seq, num_tokens)
        seq.num_scheduled_tokens = num_tokens
        return True

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_scheduled_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (finished or aborted) wherever it is and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
            self.kv_manager.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def check_integrity(self) -> None:
        self.kv_manager.check_integrity(self.running)
        for seq in self.waiting:
            assert not seq.block_table, f"waiting {seq.request_id} holds blocks"
