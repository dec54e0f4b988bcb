"""The scheduler's waiting queue, shared fairly between tenants: FIFO within a tenant, the tenants in turn.

Each tenant (`Sequence.owner`: the server's API-key tenant) has its own FIFO. The head of the queue is the oldest
sequence of the tenant admitted least recently (round robin; tenants not admitted yet in the order they came), so a
tenant that queued a thousand sequences holds another tenant's request back by one admission, not a thousand. A
sequence put back at the front (preempted, or a forked choice without a seat) goes to the front of its tenant's
FIFO. With one tenant (a server without API keys, the offline API) this is exactly one FIFO.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from kvreuse.engine.sequence import Sequence


class WaitingQueue:
    def __init__(self):
        # tenant -> its waiting sequences, oldest first; tenants in the order they came (ties of the turn order).
        self._queues: dict[str | None, deque[Sequence]] = {}
        self._last_turn: dict[str | None, int] = {}  # tenant -> the number of its latest admission
        self._num_admitted = 0

    def append(self, seq: Sequence) -> None:
        """At the back of its tenant's FIFO."""
        self._queues.setdefault(seq.owner, deque()).append(seq)

    def appendleft(self, seq: Sequence) -> None:
        """At the front of its tenant's FIFO."""
        self._queues.setdefault(seq.owner, deque()).appendleft(seq)

    @property
    def head(self) -> Sequence:
        """The sequence admitted next: the oldest of the tenant whose turn it is. IndexError when empty."""
        if not self._queues:
            raise IndexError("the waiting queue is empty")
        return self._queues[self._next_tenant()][0]

    def popleft(self) -> Sequence:
        """Take the head (it is being admitted); its tenant's turn is over."""
        tenant = self._next_tenant()
        queue = self._queues[tenant]
        seq = queue.popleft()
        if not queue:
            del self._queues[tenant]
        self._num_admitted += 1
        self._last_turn[tenant] = self._num_admitted
        return seq

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out wherever it is (finished or aborted while waiting); nobody's turn changes."""
        queue = self._queues[seq.owner]
        queue.remove(seq)
        if not queue:
            del self._queues[seq.owner]

    def _next_tenant(self) -> str | None:
        # min keeps the first of equals: among tenants never admitted, the one that came first.
        return min(self._queues, key=lambda tenant: self._last_turn.get(tenant, 0))

    def __contains__(self, seq: Sequence) -> bool:
        return seq in self._queues.get(seq.owner, ())

    def __iter__(self) -> Iterator[Sequence]:
        """Every waiting sequence, tenant by tenant, each tenant's oldest first."""
        for queue in list(self._queues.values()):
            yield from list(queue)

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    def __bool__(self) -> bool:
        return bool(self._queues)
