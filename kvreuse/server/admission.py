"""The requests in flight, as the event loop sees them: one tenant's share of the queue, and the drain's cut.

A request is added once it is handed to the engine and released once its answer is over, however it ends:
finished, aborted by its client, failed by the engine, or cut at the drain deadline. The counts are the sizes
of the sets of live admissions, so releasing twice cannot count twice, and a count cannot drift.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass


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

    def cut_all(self, abort: Callable[[str], None]) -> int:
        """The drain deadline: admit nothing more, abort every live request in the engine (`abort(request_id)`)
        and wake its consumer, which answers "shutting down". Returns how many were cut."""
        self.closed = True
        live = [admission for admissions in self._by_tenant.values() for admission in admissions]
        for admission in live:
            admission.cut = True
            abort(admission.request_id)
            # None ends a request's deltas, so its consumer stops waiting at once, even when the engine is
            # in a long step or dead; the abort's own final delta comes later and is never read.
            admission.deltas.put_nowait(None)
        return len(live)
