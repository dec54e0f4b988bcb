"""The preparation threads, shared fairly between tenants: rendering, tokenizing, grammar compiling.

Preparing a request (prompts.py) runs on PREPARE_THREADS threads, never on the event loop. The threads are handed
out here rather than by the pool's own FIFO, so that one tenant's work cannot hold up another's: with API keys, a
tenant runs at most PER_TENANT_THREADS jobs at a time (the other threads stay for the other tenants), its further
jobs wait in its own FIFO, and a freed thread goes to the waiting tenant served least recently (round robin). Four
large schemas of one tenant thus compile one after the other on one thread while another tenant's request is
tokenized on the other. Without API keys every request is one tenant's, which may use every thread.

Whatever the tenants, jobs that may compile a grammar (a response format, a tool choice) hold at most all threads but
one, and wait in a line of their own: new formats are checked one at a time, for up to `structured.compile_timeout_s`
each, so twelve format bombs in flight would otherwise hold both threads while plain requests queued behind them
(a 1-token request waited 32 s without keys). A request that compiles nothing always finds a thread.

A job whose client disconnects while it waits is dropped (499) and never starts; one that is running (a compile
cannot be interrupted) finishes, its thread is given back only then, and its result is thrown away.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from typing import TypeVar

from fastapi import Request

from kvreuse.server.errors import APIError

# Two threads. Each job is bounded: the engine refuses, before tokenizing, any text longer than the context could
# hold (server.max_tokens x the longest token: ~166K characters, ~0.15 s, by default), and the tokenizer runs in Rust
# without the GIL (so does xgrammar's compiler). More threads would only compete with the engine thread for the cores
# and multiply the memory of jobs in progress; one would let a slow job (a conversation of thousands of messages, a
# large schema) hold up every other request.
PREPARE_THREADS = 2
PER_TENANT_THREADS = 1   # with API keys: so that another tenant always finds a thread
DISCONNECT_POLL_S = 0.25

T = TypeVar("T")
Line = tuple[str | None, bool]  # where a job waits: its tenant (None: no API keys), and whether it may compile


def client_gone() -> APIError:
    return APIError(499, "client disconnected")


class Preparation:
    """Runs preparation jobs on the threads, each as its tenant's (None: no API keys, no per-tenant bound)."""

    def __init__(self, threads: int = PREPARE_THREADS, per_tenant: int = PER_TENANT_THREADS):
        self.threads, self.per_tenant = threads, per_tenant
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvreuse-prepare")
        self._running: Counter[str | None] = Counter()  # jobs on a thread now, per tenant
        self._num_compiling = 0  # jobs on a thread now that may compile a grammar
        # (tenant, compiles) -> the turns its waiting jobs wait for, oldest first; lines in the order they came.
        self._waiting: dict[Line, deque[asyncio.Future]] = {}
        self._last_turn: dict[Line, int] = {}  # line -> the number of its latest job started
        self._num_started = 0

    @property
    def num_running(self) -> int:
        return sum(self._running.values())

    def num_waiting(self, tenant: str | None) -> int:
        return sum(len(turns) for (owner, _), turns in self._waiting.items() if owner == tenant)

    async def run(self, tenant: str | None, request: Request, fn: Callable[..., T], *args,
                  compiles: bool = False) -> T:
        """`fn(*args)` on a preparation thread once it is `tenant`'s turn; its exceptions (APIError included) are
        raised here. 499 if the client of `request` disconnects before the job starts or before it is answered.
        `compiles`: the job may compile a grammar (it then waits for one of all threads but one)."""
        line = (tenant, compiles)
        await self._take_turn(line, request)
        try:
            if await request.is_disconnected():
                raise client_gone()
            job = self._pool.submit(fn, *args)
        except BaseException:
            self._leave(line)
            raise
        loop = asyncio.get_running_loop()

        def ended(_: Future) -> None:  # the thread is given back when the job ends, not when its waiter gives up
            with suppress(RuntimeError):  # the loop already closed: nothing waits any more
                loop.call_soon_threadsafe(self._leave, line)

        job.add_done_callback(ended)
        result = await asyncio.wrap_future(job)
        if await request.is_disconnected():
            raise client_gone()
        return result

    async def _take_turn(self, line: Line, request: Request) -> None:
        """Wait for a thread for `line`; 499 (the place in line given up) if the client leaves meanwhile."""
        turn = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(line, deque()).append(turn)
        self._dispatch()
        try:
            while not turn.done():
                try:
                    await asyncio.wait_for(asyncio.shield(turn), DISCONNECT_POLL_S)
                except TimeoutError:
                    if await request.is_disconnected():
                        raise client_gone() from None
        except BaseException:
            if turn.done():          # given a thread just as it gave up: give it back
                self._leave(line)
            else:
                turn.cancel()
                self._forget(line, turn)
            raise

    def _dispatch(self) -> None:
        """Hand free threads to the waiting lines in turn, each within its bounds."""
        while self.num_running < self.threads:
            ready = [line for line in self._waiting if self._may_start(line)]
            if not ready:
                return
            line = min(ready, key=lambda x: self._last_turn.get(x, 0))  # the first of equals: the first to come
            turns = self._waiting[line]
            turn = turns.popleft()
            if not turns:
                del self._waiting[line]
            tenant, compiles = line
            self._running[tenant] += 1
            self._num_compiling += compiles
            self._num_started += 1
            self._last_turn[line] = self._num_started
            turn.set_result(None)

    def _may_start(self, line: Line) -> bool:
        tenant, compiles = line
        within_tenant = tenant is None or self._running[tenant] < self.per_tenant
        return within_tenant and (not compiles or self._num_compiling < max(1, self.threads - 1))

    def _leave(self, line: Line) -> None:
        tenant, compiles = line
        self._running[tenant] -= 1
        self._num_compiling -= compiles
        if self._running[tenant] <= 0:
            del self._running[tenant]
        self._dispatch()

    def _forget(self, line: Line, turn: asyncio.Future) -> None:
        turns = self._waiting.get(line)
        if turns is not None and turn in turns:
            turns.remove(turn)
            if not turns:
                del self._waiting[line]

