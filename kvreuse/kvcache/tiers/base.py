"""The interface of a KV tier below the pool: a store of encoded block entries (entry.py) under their chain keys.

A tier holds only exactly computed prefix blocks, keyed by the same sha256 chain keys as the pool (hashing.py), so
an entry written by one process is found by another with the same model, dtype, block size and tenant salt.
Tiers deal in opaque bytes: encoding, checking and trusting an entry is the caller's job (entry.py, store.py).

Every method is called from the store's background threads (a writer and a loader, concurrently), so an
implementation is thread-safe. None raises for a fault of its medium (a full disk, a refused connection, a
timeout): it counts the fault in `counters`, logs it once per incident, and answers as if the entry were absent
(or the write dropped). Faults are misses, never outages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Protocol


@dataclass
class TierCounters:
    """What a tier did, from its own point of view (the store counts hits and invalid entries)."""

    entries_written: int = 0
    bytes_written: int = 0
    entries_dropped: int = 0  # entries a put did not store: a fault, no room, Redis down (not: already stored)
    entries_read: int = 0
    bytes_read: int = 0
    entries_deleted: int = 0
    evictions: int = 0        # entries the tier dropped on its own to stay within its limit (LRU, maxmemory)
    errors: int = 0           # operations that failed for a fault of the medium (I/O error, connection, timeout)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class TierUsage:
    """What a tier holds now. `num_entries`/`num_bytes` are None where the medium cannot say cheaply."""

    name: str
    num_entries: int | None
    num_bytes: int | None
    capacity_bytes: int | None  # the configured limit, None if the medium manages it (Redis maxmemory)
    available: bool             # False while the medium is unreachable (Redis down, in backoff)
    detail: str = ""            # where it is: a directory, a URL without its password


class KVTier(Protocol):
    name: str                   # "disk" | "redis": the label in usage, metrics and logs
    counters: TierCounters

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether an entry is stored under it: one batched check (one round trip for a remote
        store). A fault answers False for all."""

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The stored entry of each key, None where absent or unreadable (one round trip for a remote store)."""

    def put(self, entries: Sequence[tuple[bytes, bytes]]) -> int:
        """Store (key, entry) pairs; an existing entry under the key may be kept or replaced. Returns how many
        were written; what is not written (a fault, no room) is dropped and counted."""

    def delete(self, keys: Sequence[bytes]) -> None:
        """Remove the entries of `keys` (an invalid entry, found on read). Absent keys are ignored."""

    def clear(self) -> int:
        """Remove every entry of this tier (and only those: a shared Redis keeps other keys); returns how many
        were removed where known, else 0. An entry that cannot be removed stays, and `usage` still counts it."""

    def usage(self) -> TierUsage:
        """What the tier holds now."""

    def check_integrity(self) -> None:
        """Assert the tier's own bookkeeping is consistent (the disk index matches its files and its limit)."""

    def close(self) -> None:
        """Release files and connections; the tier is not used afterwards."""
