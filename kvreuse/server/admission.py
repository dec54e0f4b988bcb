"""The requests in flight, as the event loop sees them: what is admitted to the engine's queue (one tenant's share,
the server's bound: 429 beyond), and the drain's cut.

A request is added once it is handed to the engine and released once its answer is over, however it ends:
finished, aborted by its client, failed by the engine, or cut at the drain deadline. The counts are the sizes
of the sets of live admissions, so releasing twice cannot count twice, and a count cannot drift.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvreuse.server.deltas import Cut
from kvreuse.server.engine_client import EngineDeadError
from kvreuse.server.errors import APIError

if TYPE_CHECKING:
    from kvreuse.engine.sequence import Sequence
    from kvreuse.server.state import ServerState


@dataclass(eq=False)  # compared by identity: each request is its own admission
class Admission:
    request_id: str
    tenant: str | None   # None when the server runs without API keys
    deltas: asyncio.Queue
    cut: bool = False    # ended by the server at the drain deadline, not by the engine or the client


class Admissions:
    def __init__(self):
        self._by_tenant: dict[str | None, set[Admission]] = {}
        self.closed = False  # set by `cut_all`: nothing is admitted any more

    def __len__(self) -> int:
        return sum(len(live) for live in self._by_tenant.values())

    def in_flight(self, tenant: str | None) -> int:
        return len(self._by_tenant.get(tenant, ()))

    def add(self, request_id: str, tenant: str | None, deltas: asyncio.Queue) -> Admission:
        admission = Admission(request_id, tenant, deltas)
        self._by_tenant.setdefault(tenant, set()).add(admission)
        return admission

    def release(self, admission: Admission) -> None:
        """The request's answer is over. Idempotent."""
        live = self._by_tenant.get(admission.tenant)
        if live is not None:
            live.discard(admission)
            if not live:
                del self._by_tenant[admission.tenant]

    def release_all(self, admissions: Iterable[Admission], abort: Callable[[str], None] | None = None) -> None:
        """The answers of `admissions` are over, however they ended: each gives its place back and, with `abort`,
        its request stops in the engine (`abort(request_id)`; nothing for a request that already ended)."""
        for admission in admissions:
            self.release(admission)
            if abort is not None:
                abort(admission.request_id)

    def cut_all(self, abort: Callable[[str], None]) -> int:
        """The drain deadline: admit nothing more, abort every live request in the engine (`abort(request_id)`)
        and wake its consumer, which answers "shutting down". Returns how many were cut."""
        self.closed = True
        live = [admission for admissions in self._by_tenant.values() for admission in admissions]
        for admission in live:
            admission.cut = True
            abort(admission.request_id)
            # A Cut ends a request's deltas, so its consumer stops waiting at once, even when the engine is
            # in a long step or dead; the abort's own final delta comes later and is never read.
            admission.deltas.put_nowait(Cut())
        return len(live)


def admit_all(state: ServerState, seqs: list[Sequence], tenant: str | None) -> list[Admission]:
    """`admit` each sequence of one request, or none of them: a refusal gives back those already admitted."""
    admissions: list[Admission] = []
    try:
        for seq in seqs:
            admissions.append(admit(state, seq, tenant))
    except APIError:
        state.admissions.release_all(admissions, state.engine.abort)
        raise
    return admissions


def admit(state: ServerState, seq: Sequence, tenant: str | None = None) -> Admission:
    """Hand `seq` to the engine as `tenant`'s (None without API keys). 429 beyond `server.max_queue_per_tenant`
    requests of the tenant or `server.max_queue` in all; 503 if the engine died or the drain deadline passed."""
    check_queue(state, tenant)
    try:
        deltas = state.engine.submit(seq)
    except EngineDeadError as exc:
        raise APIError(503, str(exc), "service_unavailable") from exc
    return state.admissions.add(seq.request_id, tenant, deltas)


def check_queue(state: ServerState, tenant: str | None) -> None:
    """Raise the APIError that refuses one more request of `tenant` now, if any."""
    if state.admissions.closed:
        raise shutting_down(state)
    config = state.config.server
    held = state.admissions.in_flight(tenant)
    # Without API keys every request belongs to no tenant, and only server.max_queue applies.
    if tenant is not None and held >= config.max_queue_per_tenant:
        raise busy(f"tenant {tenant!r} has {held} requests in flight "
                   f"(server.max_queue_per_tenant = {config.max_queue_per_tenant})")
    in_flight = state.engine.num_in_flight
    if in_flight >= config.max_queue:
        raise busy(f"server busy: {in_flight} requests in flight (server.max_queue = {config.max_queue})")


def busy(reason: str) -> APIError:
    return APIError(429, f"{reason}; retry later", "rate_limit_error", headers={"Retry-After": "1"})


def shutting_down(state: ServerState) -> APIError:
    """The answer of a request cut at the drain deadline, and of one arriving after it."""
    timeout = state.config.server.drain_timeout_s
    return APIError(503, f"the server is shutting down: server.drain_timeout_s ({timeout} s) passed before this "
                         f"request finished", "service_unavailable")
