"""The scheduler without a model: one token budget per step, chunked prefill, decodes riding along with prefills,
preemption of the youngest, max_num_seqs, and in-batch reuse (a prompt waits one step for blocks being computed)."""

from __future__ import annotations

from kvreuse.engine.scheduler import Scheduler
from kvreuse.engine.sequence import Sequence, SequenceStatus
from kvreuse.kvcache.manager import KVCacheManager
from kvreuse.sampling_params import SamplingParams

BS = 4


def make(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 16) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BS), max_num_seqs, budget)


def add(scheduler: Scheduler, name: str, tokens: list[int], max_tokens: int = 4) -> Sequence:
    seq = Sequence(name, scheduler.kv_manager.new_request(list(tokens)), SamplingParams(max_tokens=max_tokens))
    scheduler.add(seq)
    return seq


def step(scheduler: Scheduler) -> list[tuple[str, int]]:
    """Schedule, then do what the engine does after a forward (with token 0 as every sample); returns
    (request id, scheduled tokens) of the step."""
    scheduled = [(s.request_id, s.num_scheduled_tokens) for s in scheduler.schedule().seqs]
    for seq in list(scheduler.running):
        if not seq.num_scheduled_tokens:
            continue
        seq.num_computed_tokens += seq.num_scheduled_tokens
        seq.num_scheduled_tokens = 0
        scheduler.kv_manager.cache_computed_blocks(seq.kv, seq.num_computed_tokens)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(0)
            if seq.num_completion_tokens >= seq.params.max_tokens:
                scheduler.finish(seq, "length")
    scheduler.check_integrity()
    return scheduled


def test_one_budget_per_step_is_spent_in_arrival_order_and_chunks_the_rest():
    scheduler = make(budget=16)
    for name in "abc":
        add(scheduler, name, [ord(name)] * 10)
    assert step(scheduler) == [("a", 10), ("b", 6)]          # b's prompt is chunked, c waits
    # Running sequences first: a decodes, b finishes its prompt, c gets what is left.
    assert step(scheduler) == [("a", 1), ("b", 4), ("c", 10)]
    assert [s.request_id for s in scheduler.running] == ["a", "b", "c"]


def test_a_long_prompt_is_prefilled_in_budget_sized_chunks_and_samples_once():
    scheduler = make(budget=16)
    seq = add(scheduler, "long", list(range(1, 41)), max_tokens=2)
    assert [step(scheduler) for _ in range(3)] == [[("long", 16)], [("long", 16)], [("long", 8)]]
    assert seq.num_completion_tokens == 1                     # only the last chunk reached the last token
    assert step(scheduler) == [("long", 1)]
    assert seq.is_finished and not scheduler.has_unfinished()


def test_decodes_ride_along_with_a_prefill_instead_of_waiting_for_it():
    scheduler = make(budget=16)
    add(scheduler, "chat", [1, 2, 3], max_tokens=8)
    step(scheduler)
    add(scheduler, "doc", list(range(100, 140)))
    assert step(scheduler) == [("chat", 1), ("doc", 15)]
    assert step(scheduler) == [("chat", 1), ("doc", 15)]


def test_max_num_seqs_bounds_the_running_batch():
    scheduler = make(max_num_seqs=2, budget=64)
    for name in "abc":
        add(scheduler, name, [ord(name)] * 5)
    assert [name for name, _ in step(scheduler)] == ["a", "b"]
    assert [s.request_id for s in scheduler.waiting] == ["c"]


def test_when_the_pool_runs_out_the_youngest_running_sequence_is_preempted_and_requeued_first():
    scheduler = make(num_blocks=5, budget=64)
    old = add(scheduler, "old", list(range(1, 9)), max_tokens=20)       # 2 blocks each, a third at the first decode
    young = add(scheduler, "young", list(range(50, 58)), max_tokens=20)
    assert step(scheduler) == [("old", 8), ("young", 8)]
    # old's decode takes the last free block; young's finds none, and young is the youngest: it gives way.
    assert step(scheduler) == [("old", 1)]
    assert old.num_preemptions == 0 and old.status == SequenceStatus.RUNNING
    assert young.num_preemptions == 1 and young.status == SequenceStatus.WAITING and scheduler.waiting[0] is young
    assert young.num_computed_tokens == 0 and not young.kv.block_table
    assert scheduler.kv_manager.num_free_blocks == 5 - 3
    assert scheduler.num_preemptions == 1


def test_equal_prompts_arriving_together_compute_their_shared_blocks_once():
    scheduler = make(budget=64)
    shared = list(range(1, 13))                              # 3 full blocks
    first = add(scheduler, "first", shared + [20])
    second = add(scheduler, "second", shared + [30])
    assert step(scheduler) == [("first", 13)]               # second waits: first is publishing what it needs
    assert step(scheduler) == [("first", 1), ("second", 1)]
    assert second.kv.num_cached_tokens == 12 and second.kv.block_table[:3] == first.kv.block_table[:3]


def test_a_prompt_does_not_wait_for_blocks_of_another_tenant():
    scheduler = make(budget=64)
    shared = list(range(1, 13))
    kv = scheduler.kv_manager
    for name in ("a", "b"):
        scheduler.add(Sequence(name, kv.new_request(shared + [7], cache_salt=name), SamplingParams(max_tokens=2)))
    assert step(scheduler) == [("a", 13), ("b", 13)]
