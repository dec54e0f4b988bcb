"""The engine thread's step observer (the server's gauges): not after every step, which cost each streamed token a
snapshot, but every OBSERVE_EVERY_S while the engine steps and once more when it runs out of work, so the gauges are
exact once requests are done."""

from __future__ import annotations

import asyncio

from kvreuse.server import async_engine
from kvreuse.server.async_engine import AsyncEngine
from kvreuse.server.deltas import is_last

from .helpers import greedy, tiny_engine


def test_the_step_observer_runs_on_the_first_step_and_when_the_engine_runs_out_of_work(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(async_engine, "OBSERVE_EVERY_S", 3600.0)  # no period passes within the test
    engine = tiny_engine(tiny_model_dir, engine__num_kv_blocks=64)
    running_seen: list[int] = []
    runner = AsyncEngine(engine, on_step=lambda e: running_seen.append(len(e.scheduler.running)))

    async def one_request() -> int:
        deltas = runner.submit(engine.front_end.make_sequence("Count the steps", greedy(12)))
        tokens = 0
        while not is_last(delta := await asyncio.wait_for(deltas.get(), 30)):
            tokens += bool(delta.text)
        return tokens

    runner.start()
    try:
        asyncio.run(one_request())
    finally:
        runner.shutdown()
    assert running_seen == [1, 0]  # after its first step (it runs), and after its last (nothing runs)
