"""The requests in flight, as the event loop sees them: what is admitted to the engine's queue (one tenant's share,
the server's bound: 429 beyond), and the drain's cut.

The unit is the sequence: a request runs one per prompt and per choice (prompts x n, or x best_of), and each takes
a place in the engine's batch, so a request of 64 prompts x n=16 counts 1024, not 1. A request's places are
reserved before it is prepared (tokenized, its grammar compiled: `reserve`), so a tenant at its share gets 429
before any of that work is done, and are held from its admission to the engine until its answer is over, however
it ends: finished, aborted by its client, failed by the engine, or cut at the drain deadline. The counts are sums
over the sets of live entries, so releasing twice cannot count twice, and a count cannot drift.
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
    from kvreuse.server.protocol import SamplingFields
    from kvreuse.server.state import ServerState


@dataclass(eq=False)  # compared by identity: each request is its own admission
class Admission:
    """One engine request (one prompt of an HTTP request) handed to the engine."""
    request_id: str
    tenant: str | None   # None when the server runs without API keys
    deltas: asyncio.Queue
    num_seqs: int = 1    # the sequences it runs: its choices (n, or best_of)
    cut: bool = False    # ended by the server at the drain deadline, not by the engine or the client


@dataclass(eq=False)
class Reservation:
    """The places of a request being prepared, held until its admissions take them over (or it fails)."""
    tenant: str | None
    num_seqs: int


class Admissions:
    def __init__(self):
        self._by_tenant: dict[str | None, set[Admission | Reservation]] = {}
        self.closed = False  # set by `cut_all`: nothing is admitted any more

    def __len__(self) -> int:
        """Sequences in flight in all, admitted or reserved."""
        return sum(self.in_flight(tenant) for tenant in self._by_tenant)

    def in_flight(self, tenant: str | None) -> int:
        """Sequences of `tenant` in flight, admitted or reserved."""
        return sum(entry.num_seqs for entry in self._by_tenant.get(tenant, ()))

    def add(self, request_id: str, tenant: str | None, deltas: asyncio.Queue, num_seqs: int = 1) -> Admission:
        admission = Admission(request_id, tenant, deltas, num_seqs)
        self._by_tenant.setdefault(tenant, set()).add(admission)
        return admission

    def reserve(self, tenant: str | None, num_seqs: int) -> Reservation:
        """Hold `num_seqs` places of `tenant` for a request being prepared (`check_queue` first)."""
        reservation = Reservation(tenant, num_seqs)
        self._by_tenant.setdefault(tenant, set()).add(reservation)
        return reservation

    def release(self, entry: Admission | Reservation) -> None:
        """The request's answer is over (or its preparation, for a reservation). Idempotent."""
        live = self._by_tenant.get(entry.tenant)
        if live is not None:
            live.discard(entry)
            if not live:
                del self._by_tenant[entry.tenant]

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
        live = [entry for entries in self._by_tenant.values() for entry in entries if isinstance(entry, Admission)]
        for admission in live:
            admission.cut = True
            abort(admission.request_id)
            # A Cut ends a request's deltas, so its consumer stops waiting at once, even when the engine is
            # in a long step or dead; the abort's own final delta comes later and is never read.
            admission.deltas.put_nowait(Cut())
        return len(live)


def admit_all(state: ServerState, seqs: list[Sequence], tenant: str | None,
              reservation: Reservation | None = None) -> list[Admission]:
    """`admit` each sequence of one request, or none of them: a refusal gives back those already admitted. The
    admissions take over the places of the request's `reservation`, if any."""
    if reservation is not None:
        state.admissions.release(reservation)
    admissions: list[Admission] = []
    try:
        for seq in seqs:
            admissions.append(admit(state, seq, tenant))
    except APIError:
        state.admissions.release_all(admissions, state.engine.abort)
        raise
    return admissions


def admit(state: ServerState, seq: Sequence, tenant: str | None = None) -> Admission:
    """Hand `seq` to the engine as `tenant`'s (None without API keys), whose turn the engine's scheduler keeps
    among the tenants. 429 beyond `server.max_queue_per_tenant` sequences of the tenant or `server.max_queue` in
    all; 503 if the engine died or the drain deadline passed."""
    num_seqs = seq.params.num_sequences
    check_queue(state, tenant, num_seqs)
    seq.tenant = tenant
    try:
        deltas = state.engine.submit(seq)
    except EngineDeadError as exc:
        raise APIError(503, str(exc), "service_unavailable") from exc
    return state.admissions.add(seq.request_id, tenant, deltas, num_seqs)


def reserve(state: ServerState, tenant: str | None, num_seqs: int) -> Reservation:
    """The places of a request of `num_seqs` sequences, held while it is prepared; the refusal of `check_queue`
    if it cannot have them now. Release it (idempotent) however the request ends; `admit_all` takes it over."""
    check_queue(state, tenant, num_seqs)
    return state.admissions.reserve(tenant, num_seqs)


def request_sequences(num_prompts: int, body: SamplingFields) -> int:
    """The sequences a request runs: one per prompt and per choice generated (best_of, else n)."""
    return num_prompts * max(body.n, body.num_best_of or 1)


def check_queue(state: ServerState, tenant: str | None, num_seqs: int = 1) -> None:
    """Raise the APIError that refuses `num_seqs` more sequences of `tenant` now, if any: 429 while the tenant's
    share or the server's bound is taken, 400 for a request larger than the bound itself (it never fits)."""
    if state.admissions.closed:
        raise shutting_down(state)
    config = state.config.server
    # Without API keys every request belongs to no tenant, and only server.max_queue applies.
    bounds = [("server.max_queue", config.max_queue, len(state.admissions), "the server has")]
    if tenant is not None:
        bounds.insert(0, ("server.max_queue_per_tenant", config.max_queue_per_tenant,
                          state.admissions.in_flight(tenant), f"tenant {tenant!r} has"))
    for key, limit, held, who in bounds:
        if num_seqs > limit:
            raise APIError(400, f"this request runs {num_seqs} sequences (prompts x n, or x best_of), more than "
                                f"{key} = {limit} sequences allows at once; send fewer prompts or choices",
                           param="n", code="too_many_sequences")
        if held + num_seqs > limit:
            raise busy(f"{who} {held} sequences in flight and this request needs {num_seqs} more "
                       f"({key} = {limit} sequences)")


def busy(reason: str) -> APIError:
    return APIError(429, f"{reason}; retry later", "rate_limit_error", headers={"Retry-After": "1"})


def shutting_down(state: ServerState) -> APIError:
    """The answer of a request cut at the drain deadline, and of one arriving after it."""
    timeout = state.config.server.drain_timeout_s
    return APIError(503, f"the server is shutting down: server.drain_timeout_s ({timeout} s) passed before this "
                         f"request finished", "service_unavailable")
