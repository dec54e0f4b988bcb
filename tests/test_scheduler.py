"""The scheduler without a model: one token budget per step, chunked prefill, decodes riding along with prefills,
preemption of the youngest, max_num_seqs, in-batch reuse (a prompt waits one step for blocks being computed), and
tenants taking turns; with the tiny model, forked choices (n > 1) kept within max_num_seqs."""

from __future__ import annotations

import pytest

from kvreuse.engine.model_runner import StepOutput
from kvreuse.engine.scheduler import Scheduler, SchedulerOutput
from kvreuse.engine.sequence import Sequence, SequenceStatus
from kvreuse.kvcache.manager import KVCacheManager
from kvreuse.sampling_params import SamplingParams

from .helpers import drain, greedy, tiny_engine

BS = 4


def make(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 16) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BS), max_num_seqs, budget)


def add(scheduler: Scheduler, name: str, tokens: list[int], max_tokens: int = 4) -> Sequence:
    seq = Sequence(name, scheduler.kv_manager.new_request(list(tokens)), SamplingParams(max_tokens=max_tokens))
    scheduler.add(seq)
    return seq


def step(scheduler: Scheduler) -> list[tuple[str, int]]:
    """Schedule and run a step (`finish_step`); returns (request id, scheduled tokens) of the step."""
    batch = scheduler.schedule()
    scheduled = [(s.request_id, s.num_scheduled_tokens) for s in batch.seqs]
    finish_step(scheduler, batch)
    return scheduled


def finish_step(scheduler: Scheduler, batch: SchedulerOutput) -> None:
    """The engine's postprocess after the forward of `batch` (with token 0 as every sample, finishing on max_tokens
    only), then the integrity check."""
    draws = [[(0, None)] if s.num_computed_tokens + s.num_scheduled_tokens == s.num_tokens else None
             for s in batch.seqs]
    scheduler.postprocess(batch, StepOutput(draws), max_tokens_only)
    scheduler.check_integrity()


def max_tokens_only(seq: Sequence, token_id: int) -> str | None:
    return "length" if seq.num_completion_tokens >= seq.params.max_tokens else None


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
    assert young.num_preemptions == 1 and young.status == SequenceStatus.WAITING and scheduler.waiting.head is young
    assert young.num_computed_tokens == 0 and not young.kv.tables.block_table
    assert scheduler.kv_manager.num_free_blocks == 5 - 3
    assert scheduler.num_preemptions == 1


def test_equal_prompts_arriving_together_compute_their_shared_blocks_once():
    scheduler = make(budget=64)
    shared = list(range(1, 13))                              # 3 full blocks
    first = add(scheduler, "first", shared + [20])
    second = add(scheduler, "second", shared + [30])
    assert step(scheduler) == [("first", 13)]               # second waits: first is publishing what it needs
    assert step(scheduler) == [("first", 1), ("second", 1)]
    assert second.admitted.cached_tokens == 12 and second.kv.tables.block_table[:3] == first.kv.tables.block_table[:3]


def test_a_prompt_does_not_wait_for_blocks_of_another_tenant():
    scheduler = make(budget=64)
    shared = list(range(1, 13))
    kv = scheduler.kv_manager
    for name in ("a", "b"):
        scheduler.add(Sequence(name, kv.new_request(shared + [7], cache_salt=name), SamplingParams(max_tokens=2)))
    assert step(scheduler) == [("a", 13), ("b", 13)]


# --- liveness with segment reuse (issue 12, finding 1) ------------------------------------------------------------
def segment_scheduler(num_blocks: int, budget: int = 64) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BS, enable_segments=True), 8, budget)


def run_until_finished(scheduler: Scheduler, seqs: list[Sequence], max_steps: int) -> int:
    """Steps until every one of `seqs` has finished; returns how many it took, failing past `max_steps`."""
    for steps in range(1, max_steps + 1):
        step(scheduler)
        if all(s.is_finished for s in seqs):
            return steps
    stuck = [(s.request_id, s.status.value) for s in seqs if not s.is_finished]
    raise AssertionError(f"not finished after {max_steps} steps: {stuck}")


def test_a_prompt_whose_reuse_can_never_fit_the_pool_is_admitted_with_less_reuse_and_nobody_waits_forever():
    scheduler = segment_scheduler(num_blocks=20)
    document = list(range(100, 140))                      # 10 blocks, published once computed
    run_until_finished(scheduler, [add(scheduler, "doc", document, max_tokens=1)], max_steps=5)
    # 76 tokens = 19 blocks of its own, plus the 9 cached document blocks it would copy from: 28 > 20 blocks.
    # Before the fix it stayed at the head of the queue forever, and the short request behind it too.
    long = add(scheduler, "intro+doc", list(range(500, 536)) + document, max_tokens=1)
    short = add(scheduler, "short", [7, 8, 9], max_tokens=1)
    batch = scheduler.schedule()
    assert [s.request_id for s in batch.seqs] == ["intro+doc"]
    # With less reuse: the one source block that fits beside its own 19, the document's last (tail first).
    assert len(long.kv.pending.segment_plan.source_block_ids) == 1 and long.kv.pending.segment_plan.runs[0].start == 68
    finish_step(scheduler, batch)
    run_until_finished(scheduler, [long, short], max_steps=4)
    kv = scheduler.kv_manager
    assert kv.num_free_blocks == 20 and not scheduler.has_unfinished()


def test_reuse_that_fits_once_the_pool_drains_is_kept_rather_than_dropped():
    scheduler = segment_scheduler(num_blocks=32)
    document = list(range(100, 140))
    run_until_finished(scheduler, [add(scheduler, "doc", document, max_tokens=1)], max_steps=5)
    seq = add(scheduler, "intro+doc", list(range(500, 536)) + document, max_tokens=3)   # 19 + 9 <= 32 blocks
    scheduler.schedule()
    assert len(seq.kv.pending.segment_plan.source_block_ids) == 9 and seq.kv.pending.segment_plan.runs[0].start == 36


# --- tenants take turns, forks keep to max_num_seqs (issue 26, finding 11) ------------------------------------------
def add_for(scheduler: Scheduler, tenant: str | None, name: str, tokens: list[int], max_tokens: int = 1) -> Sequence:
    """A request of `tenant`'s (its salt too, as the server gives it)."""
    seq = Sequence(name, scheduler.kv_manager.new_request(list(tokens), cache_salt=tenant),
                   SamplingParams(max_tokens=max_tokens))
    seq.tenant = tenant
    scheduler.add(seq)
    return seq


def admission_order(scheduler: Scheduler, max_steps: int = 100) -> list[str]:
    """Step until nothing is left; the request ids in the order they were first scheduled."""
    order: list[str] = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return order
        order += [name for name, _ in step(scheduler) if name not in order]
    raise AssertionError(f"unfinished after {max_steps} steps")


def test_tenants_take_turns_at_admission_and_each_keeps_its_arrival_order():
    scheduler = make(max_num_seqs=1, budget=64)
    for i in range(5):
        add_for(scheduler, "a", f"a{i}", [10 + i] * 5)
    for i in range(2):
        add_for(scheduler, "b", f"b{i}", [50 + i] * 5)
    # Before: strict arrival order, b's requests after all of a's backlog.
    assert admission_order(scheduler) == ["a0", "b0", "a1", "b1", "a2", "a3", "a4"]


def test_a_tenant_just_served_waits_behind_one_that_was_not():
    scheduler = make(max_num_seqs=1, budget=64)
    add_for(scheduler, "a", "a0", [10] * 5)
    assert step(scheduler) == [("a0", 5)]
    add_for(scheduler, "a", "a1", [11] * 5)   # a's queue emptied, then a queued again before b arrived
    add_for(scheduler, "b", "b0", [50] * 5)
    assert admission_order(scheduler) == ["b0", "a1"]


def test_without_tenants_the_queue_is_one_fifo():
    scheduler = make(max_num_seqs=1, budget=64)
    for name in ("x", "y", "z"):
        add_for(scheduler, None, name, [ord(name)] * 5)
    assert admission_order(scheduler) == ["x", "y", "z"]


def test_a_preempted_sequence_goes_back_to_the_front_of_its_tenants_queue():
    scheduler = make(num_blocks=5, budget=64)
    add_for(scheduler, "a", "old", list(range(1, 9)), max_tokens=20)
    young = add_for(scheduler, "b", "young", list(range(50, 58)), max_tokens=20)
    later = add_for(scheduler, "b", "later", list(range(60, 64)), max_tokens=2)
    scheduler.max_num_seqs = 2
    assert step(scheduler) == [("old", 8), ("young", 8)]
    step(scheduler)  # old's decode takes the last free block: young is preempted
    assert young.status == SequenceStatus.WAITING and list(scheduler.waiting) == [young, later]


def run_engine(engine, max_steps: int = 500) -> int:
    """Step `engine` until done, checking integrity; the most sequences that ran in one step."""
    peak = 0
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return peak
        engine.step()
        engine.check_integrity()
        peak = max(peak, len(engine.scheduler.running))
    raise AssertionError(f"unfinished after {max_steps} steps")


def test_forked_choices_never_run_beyond_max_num_seqs(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir, engine__max_num_seqs=4)
    a = engine.add_request([5] * 6, greedy(6), "a")
    b = engine.add_request([6] * 6, greedy(6), "b")
    c = engine.add_request([7] * 6, greedy(4, n=3), "c")      # three seats: itself and two forks
    d = engine.add_request([8] * 6, greedy(6), "d")
    # Before: a, b, c and d were admitted (4 < max_num_seqs until then), and c's two forks made 6 run.
    assert run_engine(engine) == 4
    assert [s.num_completion_tokens for s in (a, b, d)] == [6, 6, 6]
    assert [choice.num_completion_tokens for choice in c.choices] == [4, 4, 4]


def test_a_request_of_more_choices_than_max_num_seqs_runs_them_within_the_batch(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir, engine__max_num_seqs=4)
    wide = engine.add_request([9] * 6, greedy(5, n=6), "wide")
    assert run_engine(engine) == 4                              # the two choices beyond wait for seats
    single = tiny_engine(tiny_model_dir)
    alone = single.add_request([9] * 6, greedy(5), "alone")
    drain(single)
    # Greedy: every choice, forked or recomputed from the queue, is the request's completion alone.
    assert [choice.completion_token_ids for choice in wide.choices] == [alone.completion_token_ids] * 6


@pytest.mark.parametrize("prompt_len", [6, 16], ids=["partial-last-block", "full-blocks"])
def test_choices_fork_even_when_the_first_choice_ends_at_its_first_token(tiny_model_dir, prompt_len):
    # Found measuring issue 26's bound: with max_tokens 1 (or a first token that stops it), choice 0 finished and
    # freed its blocks before the others forked from them (IndexError, the whole step failed).
    engine = tiny_engine(tiny_model_dir, engine__max_num_seqs=8)
    seq = engine.add_request(list(range(5, 5 + prompt_len)), greedy(1, n=4), "short")
    run_engine(engine)
    assert [(c.finish_reason, c.num_completion_tokens) for c in seq.choices] == [("length", 1)] * 4
