"""An exception inside a step fails only the requests of that step (issue 12, "beyond the list"): they finish with
finish_reason "error" and the exception on `RequestOutput.error`, their blocks are freed, the engine checks its
integrity and keeps serving everything else. Over HTTP a failed request gets a 500 OpenAI error (`server_error`), a
failed stream an error event and then `[DONE]`, and /health stays ok.

The fault is a test hook: the model runner raises once (monkeypatched in-process; a real server cannot be made to
fail a forward on demand). The server runs in-process (uvicorn on a thread, 127.0.0.1, a free port) so that the
hook reaches its engine; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from kvreuse.engine.engine import MAX_ADMISSION_FAULTS, LLMEngine

from .helpers import app_server, drain, greedy, tiny_engine, tiny_llm
from .server_process import http_client, sse_events

MAX_STEPS = 200  # drain's bound here: every test's requests finish in a few dozen steps


class InjectedFault(RuntimeError):
    pass


def fail_next_forwards(engine: LLMEngine, count: int = 1) -> list[list[str]]:
    """The runner raises on its next `count` calls; returns the request ids of each failed forward."""
    run, failed = engine.runner.run, []

    def faulty(seqs, segments):
        if len(failed) < count:
            failed.append([s.request_id for s in seqs])
            raise InjectedFault("injected fault in the forward")
        return run(seqs, segments)

    engine.runner.run = faulty
    return failed


# --- offline: LLMEngine ------------------------------------------------------------------------------------------
def test_a_forward_that_raises_fails_only_the_requests_of_that_step(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir, engine__num_kv_blocks=64, engine__max_num_seqs=2)
    expected = tiny_llm(tiny_model_dir, engine__num_kv_blocks=64).generate("Third in line", greedy(6))[0].token_ids
    first, second, third = (engine.add_request(p, greedy(6)) for p in ("First prompt", "Second one", "Third in line"))
    failed = fail_next_forwards(engine)
    updated = engine.step()       # before: the exception escaped step() (and killed the server's engine thread)
    assert failed == [[first.request_id, second.request_id]]
    assert updated == [first, second]
    for seq in (first, second):
        out = engine.output(seq)
        assert out.finish_reason == "error" and "InjectedFault: injected fault in the forward" in out.error
        assert not seq.kv.tables.block_table and seq.request_id not in engine.sequences
    engine.check_integrity()
    # the one waiting behind them was not part of that step: it runs as if alone
    drain(engine, MAX_STEPS, check_integrity=True)
    assert (third.finish_reason, engine.output(third).error) == ("length", None)
    assert third.completion_token_ids == expected
    assert engine.kv_manager.num_free_blocks == engine.num_kv_blocks
    assert engine.stats.num_requests == 1     # failed requests, like aborted ones, are not in the totals


def test_a_fault_after_some_tokens_keeps_the_text_so_far_and_the_engine_serves_new_requests(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir, engine__num_kv_blocks=64)
    prompt = "Generate for a while, and keep going. " * 6
    seq = engine.add_request(prompt, greedy(20))
    for _ in range(4):
        engine.step()
    fail_next_forwards(engine)
    assert engine.step() == [seq]
    assert seq.finish_reason == "error" and seq.num_completion_tokens == 4
    assert engine.output(seq).text == engine.front_end.tokenizer.decode(seq.completion_token_ids)
    later = engine.add_request(prompt, greedy(5))
    drain(engine, MAX_STEPS, check_integrity=True)
    assert later.finish_reason == "length" and later.num_completion_tokens == 5
    assert later.admitted.cached_tokens > 0     # it reused the failed request's published prompt blocks (exact)


def test_a_fault_in_a_reusing_forward_releases_the_segment_sources(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir, engine__num_kv_blocks=64, cache__suffix__enabled="true")
    document = "The printing press spread across Europe within decades, and with it cheap books. " * 4
    engine.add_request(document, greedy(1))
    drain(engine, MAX_STEPS, check_integrity=True)
    seq = engine.add_request("Question first, then the text: " + document, greedy(4))
    fail_next_forwards(engine)
    engine.step()
    assert seq.finish_reason == "error" and seq.kv.pending.segment_plan is None
    engine.check_integrity()
    assert engine.kv_manager.num_free_blocks == engine.num_kv_blocks


# --- over HTTP: the real app, in-process -------------------------------------------------------------------------
@pytest.fixture
def faulty_server(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir, engine__num_kv_blocks=64)
    with app_server(engine) as (_, root), http_client(30.0) as http:
        yield engine, root, http


def completion(**extra) -> dict:
    return {"model": "tiny", "prompt": "Tell me about caches", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, **extra}


def test_a_failed_request_gets_a_500_server_error_and_the_next_one_succeeds(faulty_server):
    engine, root, http = faulty_server
    fail_next_forwards(engine)
    response = http.post(f"{root}/v1/completions", json=completion())
    # Before: 500 "the engine stopped", and from then on 503 for everything, /health included.
    assert response.status_code == 500, response.text
    assert http.get(f"{root}/health").json()["status"] == "ok"
    chat = http.post(f"{root}/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "ignore_eos": True})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 3, chat.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "server_error" and "InjectedFault: injected fault in the forward" in error["message"]
    engine_state = engine.stats_snapshot()
    assert engine_state.blocks_in_use == 0 and engine_state.num_requests_running == 0


def test_a_failed_stream_gets_an_error_event_then_done_and_the_next_stream_succeeds(faulty_server):
    engine, root, http = faulty_server
    fail_next_forwards(engine)
    with http.stream("POST", f"{root}/v1/completions", json=completion(stream=True)) as response:
        assert response.status_code == 200
        events = list(sse_events(response))
    assert events[-1] == "[DONE]", events
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "InjectedFault" in error["message"], events
    with http.stream("POST", f"{root}/v1/completions", json=completion(stream=True)) as response:
        events = list(sse_events(response))
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events
    assert http.get(f"{root}/health").json()["status"] == "ok"


def test_a_fault_while_scheduling_fails_the_running_requests_and_spares_the_waiting_ones(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir, engine__num_kv_blocks=64)
    running = engine.add_request("Already running", greedy(8))
    engine.step()
    waiting = engine.add_request("Arrives later", greedy(3))
    match_prefix, calls = engine.kv_manager.match_prefix, []

    def faulty(req):
        calls.append(req)
        if len(calls) == 1:
            raise InjectedFault("injected fault in admission")
        return match_prefix(req)

    engine.kv_manager.match_prefix = faulty
    assert engine.step() == [running]          # running had its decode slot reserved when admission raised
    assert running.finish_reason == "error" and "admission" in running.error
    engine.check_integrity()
    drain(engine, MAX_STEPS, check_integrity=True)
    assert waiting.finish_reason == "length" and waiting.num_completion_tokens == 3
    assert engine.kv_manager.num_free_blocks == engine.num_kv_blocks


def test_observers_that_raise_are_logged_and_the_engine_thread_keeps_serving(tiny_model_dir, caplog):
    """Metrics observers run on the engine thread: one that raises must not end the loop (it used to)."""
    from kvreuse.server.async_engine import AsyncEngine
    from kvreuse.server.deltas import Delta, is_last

    def broken(_):
        raise ValueError("broken gauge")

    engine = tiny_engine(tiny_model_dir, engine__num_kv_blocks=64)
    async_engine = AsyncEngine(engine, on_step=broken, on_finish=broken)

    async def two_requests() -> list:
        outputs = []
        for prompt in ("First request", "Second request"):
            deltas = async_engine.submit(engine.front_end.make_sequence(prompt, greedy(4)))
            while not is_last(delta := await asyncio.wait_for(deltas.get(), 30)):
                pass
            outputs.append(delta.output if isinstance(delta, Delta) else delta)
        return outputs

    async_engine.start()
    try:
        outputs = asyncio.run(two_requests())
    finally:
        async_engine.shutdown()
    assert [o.finish_reason for o in outputs] == ["length", "length"]
    assert async_engine.error is None and async_engine.num_callback_errors >= 4   # a step and a finish each
    assert "broken failed" in caplog.text


def test_a_request_whose_admission_always_raises_is_failed_and_the_queue_behind_it_goes_on(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir, engine__num_kv_blocks=64)
    poisoned = engine.add_request("This prompt's match always raises", greedy(3))
    behind = engine.add_request("Arrives later", greedy(3))
    match_prefix = engine.kv_manager.match_prefix

    def faulty(req):
        if req is poisoned.kv:
            raise InjectedFault("injected fault in this request's match")
        return match_prefix(req)

    engine.kv_manager.match_prefix = faulty
    failed_at = next(step for step in range(1, MAX_STEPS) if poisoned in engine.step())
    assert failed_at == MAX_ADMISSION_FAULTS
    assert poisoned.finish_reason == "error" and "this request's match" in poisoned.error
    drain(engine, MAX_STEPS, check_integrity=True)
    assert behind.finish_reason == "length" and behind.num_completion_tokens == 3
    assert engine.kv_manager.num_free_blocks == engine.num_kv_blocks
