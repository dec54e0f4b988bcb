"""The engine on a background thread, for the asyncio server.

One thread owns the LLMEngine and calls `step()` in a loop. The server never touches engine state: it prepares a
request on its worker threads (`FrontEnd.make_sequence` is pure), hands the sequence over through a command queue,
and receives text deltas (the last one with the output, or an error) on a per-request asyncio.Queue. It is the
server's EngineClient (engine_client.py) for an engine in this process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from kvreuse.config import Config
from kvreuse.engine.engine import LLMEngine
from kvreuse.engine.front_end import FrontEnd
from kvreuse.engine.omp_thread import on_passing_thread
from kvreuse.engine.output import RequestOutput
from kvreuse.engine.sequence import Sequence
from kvreuse.engine.stats import EngineSnapshot
from kvreuse.kvcache.pins import PinResult
from kvreuse.kvcache.tiers.store import TieredStore
from kvreuse.server.deltas import Delta, EngineDied
from kvreuse.server.engine_client import EngineDeadError
from kvreuse.warm import warm_up

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5
# How often the step observer (the gauges) runs while the engine steps; it runs again whenever the engine runs out of
# work. Run after every step, its snapshot (getrusage included) took 0.16 ms of each 9 ms token of a streamed answer,
# the engine thread's largest cost outside the step.
OBSERVE_EVERY_S = 0.2
LOAD_BUILT_GRAPHS_S = 120.0  # how long a start waits for the load of decode graphs built before (a few seconds)
T = TypeVar("T")


def load_engine(config: Config, meanwhile: Callable[[], object] | None = None) -> LLMEngine:
    """The engine an AsyncEngine will step, loaded and warmed up on a passing thread: the caller's thread (the
    server's event loop) then holds no OpenMP team that would slow the engine thread's (omp_thread.py), and runs
    `meanwhile()` in the meantime. The decode step's graphs, where they were built before, are loaded before it
    returns, so that the first request decodes compiled; otherwise their build starts after the warm-up, and runs on
    while the engine serves eagerly."""
    def load() -> LLMEngine:
        engine = warm_up(LLMEngine(config, compile_later=True))
        engine.start_compile(wait_if_built_s=LOAD_BUILT_GRAPHS_S)
        return engine

    engine = on_passing_thread(load, meanwhile=meanwhile)
    # What loading built lives as long as the server. Frozen, it is never scanned again: a full collection while
    # serving (it stops every thread) walks only what serving allocated, not the whole heap of torch and the model.
    gc.collect()
    gc.freeze()
    return engine


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    sent_chars: dict[int, int] = field(default_factory=dict)   # per choice index
    sent_tokens: dict[int, int] = field(default_factory=dict)  # completion tokens whose logprobs were sent
    sent_prompt_logprobs: bool = False


class AsyncEngine:
    """An LLMEngine on a thread of its own: the server's EngineClient for an engine in this process."""

    def __init__(self, engine: LLMEngine, on_step: Callable[[LLMEngine], None] | None = None,
                 on_finish: Callable[[RequestOutput], None] | None = None):
        self.engine = engine
        # Called on the engine thread: `on_step` (gauges) every OBSERVE_EVERY_S while it steps, when it runs out of work
        # and after an abort; `on_finish` for every finished or aborted request.
        self.on_step, self.on_finish = on_step, on_finish
        self._next_observation = 0.0  # time.monotonic() of the next step observation
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._thread = threading.Thread(target=self._run, name="kvreuse-engine", daemon=True)
        self._stopping = False
        self.error: BaseException | None = None
        self.num_callback_errors = 0
        # Each counter has one writer (event loop / engine thread), so no lock is needed.
        self._num_submitted = 0
        self._num_finished = 0

    # --- event-loop side -----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def front_end(self) -> FrontEnd:
        return self.engine.front_end

    @property
    def tiers(self) -> TieredStore | None:
        return self.engine.tiers

    @property
    def num_in_flight(self) -> int:
        """Submitted and not yet finished (for backpressure)."""
        return self._num_submitted - self._num_finished

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def compile_states(self) -> list[str]:
        # Read off the engine thread: the compile thread replaces one string, atomically.
        graph = self.engine.runner.decode_graph
        return [graph.state if graph is not None else "eager"]

    def submit(self, seq: Sequence) -> asyncio.Queue:
        """Queue a sequence made by `front_end.make_sequence`; its deltas arrive on the returned queue."""
        if not self.is_alive:
            raise EngineDeadError(f"the engine loop is not running: {self.error!r}")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._num_submitted += 1
        self._commands.put(("add", seq, stream))
        return stream.queue

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """`fn(engine)` on the engine thread, between two steps (for admin work on engine state); its result or
        exception comes back here."""
        if not self.is_alive:
            raise EngineDeadError(f"the engine loop is not running: {self.error!r}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, future))
        return await asyncio.wrap_future(future)

    async def reset_prefix_cache(self, tiers: bool = False) -> dict[str, int]:
        """Drop the cached blocks no request holds (`tiers`: and empty the lower tiers); how many per tier."""
        dropped = await self.call(LLMEngine.reset_prefix_cache)
        if tiers and self.engine.tiers is not None:  # off the engine thread: it waits for queued writes first
            dropped.update(await asyncio.to_thread(self.engine.tiers.clear))
        return dropped

    can_pin = True

    async def pin(self, token_ids: list[int], cache_salt: str | None, ttl_s: int | None, tenant: str | None = None,
                  num_tenants: int = 1) -> PinResult:
        return await self.call(lambda engine: engine.pin_prompt(token_ids, cache_salt, ttl_s, tenant, num_tenants))

    async def unpin(self) -> int:
        return await self.call(LLMEngine.unpin_all)

    async def snapshots(self) -> list[EngineSnapshot]:
        """The engine's snapshot, taken between two steps."""
        return [await self.call(LLMEngine.stats_snapshot)]

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone); its blocks are freed on the engine thread."""
        self._commands.put(("abort", request_id, None))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread, then close the engine: what is queued for the lower tiers is written."""
        self._stopping = True
        self._commands.put(("stop", None, None))
        self._thread.join(timeout)
        self.engine.close()

    # --- engine thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_commands(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    self._deliver(self.engine.step())
                    if not self.engine.has_unfinished() or time.monotonic() >= self._next_observation:
                        self._next_observation = time.monotonic() + OBSERVE_EVERY_S
                        self._notify(self.on_step, self.engine)
        except BaseException as exc:
            self.error = exc
            logger.exception("engine loop died")
            for request_id in list(self._streams):
                self._finish_stream(request_id, EngineDied(repr(exc)))

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, arg, stream = command
            if kind == "add":
                self._streams[arg.request_id] = stream
                self.engine.add_sequence(arg)
            elif kind == "abort":
                seq = self.engine.sequences.get(arg)
                if seq is not None:
                    self.engine.abort(arg)
                    self._finish_stream(arg, self.engine.output(seq))
                    # The gauges must show the freed blocks even if nothing steps again.
                    self._notify(self.on_step, self.engine)
            elif kind == "call":
                try:
                    stream.set_result(arg(self.engine))
                except Exception as exc:  # the caller's problem, not the engine loop's
                    stream.set_exception(exc)
            elif kind == "stop":
                self._stopping = True
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, updated: list[Sequence]) -> None:
        finished: dict[str, Sequence] = {}  # requests whose every choice is done, ended once all deltas are out
        for seq in updated:
            stream = self._streams.get(seq.group_id)
            if stream is None:
                continue
            request = seq.parent or seq  # its request's choice 0
            if seq.error is not None:  # a failed request says nothing more: its client gets the error instead
                self._finish_stream(seq.group_id, self.engine.output(request))
                continue
            text = seq.detokenized.text
            text = text if seq.is_finished else _stable_prefix(text, seq.params.stop)
            sent_chars, sent_tokens = stream.sent_chars.get(seq.index, 0), stream.sent_tokens.get(seq.index, 0)
            logprobs = seq.logprobs[sent_tokens:] if seq.params.logprobs is not None else None
            if len(text) > sent_chars or logprobs or seq.is_finished:
                delta = Delta(text[sent_chars:], index=seq.index, logprobs=logprobs,
                              finish_reason=seq.finish_reason if seq.is_finished else None)
                if request.params.prompt_logprobs is not None and not stream.sent_prompt_logprobs:
                    delta.prompt_logprobs, stream.sent_prompt_logprobs = list(request.prompt_logprobs), True
                stream.sent_chars[seq.index] = max(sent_chars, len(text))
                stream.sent_tokens[seq.index] = len(seq.logprobs)
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, delta)
            if seq.group_finished:
                finished[seq.group_id] = request
        for group_id, request in finished.items():
            self._finish_stream(group_id, self.engine.output(request))

    def _finish_stream(self, request_id: str, end: RequestOutput | EngineDied) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self._num_finished += 1
        final = Delta("", end) if isinstance(end, RequestOutput) else end
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, final)
        if isinstance(end, RequestOutput):  # after the reply is on its way
            self._notify(self.on_finish, end)

    def _notify(self, callback: Callable | None, arg: object) -> None:
        """Run an observer (metrics). Its failure is logged and counted, never the engine loop's end: serving
        matters more than a gauge."""
        if callback is None:
            return
        try:
            callback(arg)
        except Exception:
            self.num_callback_errors += 1
            logger.exception("%s failed (%d so far); the engine goes on", getattr(callback, "__name__", callback),
                             self.num_callback_errors)


def _stable_prefix(text: str, stops: list[str]) -> str:
    """The part of an unfinished text that can no longer change: drop anything that could still grow into a stop
    string. (A character cut between tokens never reaches `seq.detokenized.text` before it is whole: detokenizer.py.)"""
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                text = text[:-k]
                break
    return text
