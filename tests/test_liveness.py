"""No request waits forever (issue 12, finding 1 and "liveness under load"): a prompt whose segment reuse could never
fit the KV pool beside its own blocks is admitted with less reuse instead of parking at the head of the queue, and
requests behind the largest prompt the pool allows, reusing segments, finish within a bounded number of steps.

On the tiny random-weight model (offline engine and a real `kvreuse serve`), with the `rag` preset (segment reuse
on) and a pool of 32 blocks of 16 tokens; every wait is bounded in steps or seconds.
"""

from __future__ import annotations

import pytest

from kvreuse.bench import workloads
from kvreuse.engine.engine import LLMEngine
from kvreuse.engine.sequence import Sequence
from kvreuse.kvcache.block import KVCacheBlock
from kvreuse.kvcache.segment import SegmentPlan, SegmentRun
from kvreuse.llm import LLM

from .helpers import greedy, server_args, tiny_llm
from .server_process import http_client, start_server

NUM_BLOCKS = 32                              # 512 tokens of KV
DOCUMENT = workloads.documents()[0]["text"]  # ~250 tokens: 15 full blocks once computed
FILLER = "Background notes for the reader, kept for reference only. " * 18


def rag_llm(tiny_model_dir: str) -> LLM:
    return tiny_llm(tiny_model_dir, cache__preset="rag", engine__num_kv_blocks=NUM_BLOCKS)


def intro_and_document(llm: LLM) -> list[int]:
    """"Intro: " + filler + the document: its own blocks plus the document's cached blocks exceed the pool."""
    tokens = llm.tokenizer.encode(f"Intro: {FILLER}\n\n{DOCUMENT}")
    own_blocks, doc_blocks = -(-len(tokens) // 16), len(llm.tokenizer.encode(DOCUMENT)) // 16
    assert own_blocks <= NUM_BLOCKS < own_blocks + doc_blocks - 2, (own_blocks, doc_blocks)
    return tokens


def run_until_finished(engine: LLMEngine, seqs: list[Sequence], max_steps: int) -> int:
    for steps in range(1, max_steps + 1):
        engine.step()
        engine.check_integrity()
        if all(s.is_finished for s in seqs):
            return steps
    stuck = [(s.request_id, s.status.value, s.num_computed_tokens) for s in seqs if not s.is_finished]
    raise AssertionError(f"not finished after {max_steps} steps: {stuck}")


def test_reuse_that_can_never_fit_is_cut_and_the_prompt_and_those_behind_it_finish(tiny_model_dir):
    llm = rag_llm(tiny_model_dir)
    engine = llm.engine
    run_until_finished(engine, [engine.add_request(DOCUMENT, greedy(1))], max_steps=3)
    long = engine.add_request(intro_and_document(llm), greedy(8))
    short = engine.add_request("A short question?", greedy(4))
    # Before the fix neither ever ran: the engine stepped without scheduling anything, forever.
    run_until_finished(engine, [long, short], max_steps=1 + 8 + 1 + 4)
    reused = long.reuse.reused_tokens
    assert 0 < reused <= (NUM_BLOCKS - -(-long.num_prompt_tokens // 16)) * 16, reused   # with less reuse
    assert (long.finish_reason, short.finish_reason) == ("length", "length")
    assert engine.kv_manager.num_free_blocks == NUM_BLOCKS


def test_requests_behind_the_largest_prompt_reusing_segments_finish_within_a_bounded_number_of_steps(
        tiny_model_dir):
    llm = rag_llm(tiny_model_dir)
    engine = llm.engine
    run_until_finished(engine, [engine.add_request(DOCUMENT, greedy(1))], max_steps=3)
    prompt = intro_and_document(llm)
    max_tokens = NUM_BLOCKS * 16 - len(prompt)        # the largest request the pool allows: prompt + completion
    pathological = engine.add_request(prompt, greedy(max_tokens))
    behind = [engine.add_request(f"Question {i}: {DOCUMENT[:200 * i]}", greedy(6)) for i in range(1, 4)]
    # The bound: run one after another, each would take one prefill step plus one step per further token.
    # Overlapping them (and preempting on this pool) must not be slower than that.
    bound = sum(s.params.max_tokens for s in [pathological, *behind])
    run_until_finished(engine, [pathological, *behind], max_steps=bound)
    assert all(s.finish_reason == "length" for s in [pathological, *behind])
    assert pathological.reuse.reused_tokens > 0
    assert engine.kv_manager.num_free_blocks == NUM_BLOCKS


def test_the_issue_repro_against_a_live_server_answers_and_keeps_answering(tmp_path, tiny_model_dir,
                                                                           real_tokenizer):
    args = [*server_args(tiny_model_dir, f"engine.num_kv_blocks={NUM_BLOCKS}"), "--preset", "rag"]
    with start_server(*args, log_path=tmp_path / "server.log") as server, http_client(30.0) as http:
        def complete(prompt: str, max_tokens: int) -> dict:
            response = http.post(f"{server.base_url}/completions", json={
                "model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True})
            assert response.status_code == 200, response.text
            return response.json()

        complete(DOCUMENT, 1)
        prompt = f"Intro: {FILLER}\n\n{DOCUMENT}"
        assert len(real_tokenizer.encode(prompt)) > (NUM_BLOCKS - 15) * 16   # with the document's blocks: too big
        # Before the fix this never answered (the 30 s client timeout fired), and neither did anything after it.
        reply = complete(prompt, 8)
        assert 0 < reply["usage"]["prompt_tokens_details"]["reused_tokens"] and reply["usage"]["completion_tokens"] == 8
        assert complete("A short question?", 4)["usage"]["completion_tokens"] == 4
        assert http.get(f"{server.root}/health").json()["status"] == "ok"


def block(block_id: int, position: int) -> KVCacheBlock:
    b = KVCacheBlock(block_id)
    b.token_ids, b.position = (block_id,) * 4, position
    return b


@pytest.mark.parametrize(("room", "expected"), [
    (5, [(0, [1, 2]), (12, [3, 4, 5])]),     # everything fits: unchanged
    (4, [(4, [2]), (12, [3, 4, 5])]),        # the first run loses its head, the tail run is whole
    (2, [(16, [4, 5])]),                     # only the last blocks of the last run
    (0, None), (-3, None),
])
def test_a_plan_is_cut_from_its_head_to_the_source_blocks_that_fit(room, expected):
    plan = SegmentPlan([SegmentRun(0, [block(1, 40), block(2, 44)]), SegmentRun(12, [block(3, 8), block(4, 12),
                                                                                      block(5, 16)])])
    cut = plan.tail(room, min_blocks=1)
    assert (None if cut is None else [(r.start, [b.block_id for b in r.blocks]) for r in cut.runs]) == expected


def test_a_cut_shorter_than_min_match_blocks_is_dropped_and_a_repeated_source_counts_once():
    plan = SegmentPlan([SegmentRun(0, [block(1, 40), block(2, 44)]), SegmentRun(12, [block(3, 8), block(3, 8)])])
    assert [b.block_id for b in plan.tail(2, min_blocks=2).runs[0].blocks] == [3, 3]
    assert plan.tail(2, min_blocks=2).runs[0].start == 12 and len(plan.tail(2, min_blocks=2).runs) == 1
    assert plan.tail(1, min_blocks=3) is None
