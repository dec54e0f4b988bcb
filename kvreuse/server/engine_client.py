"""What the server needs of an engine: its front end (request preparation), running and stopping requests, the
engine's snapshots and cache administration. `AsyncEngine` (one engine on a thread of this process) and the cluster's
`RemoteEngine` (replicas on Ray Serve) implement it; the routes see only this."""

from __future__ import annotations

import asyncio
from typing import Protocol

from kvreuse.engine.front_end import FrontEnd
from kvreuse.engine.sequence import Sequence
from kvreuse.engine.stats import EngineSnapshot
from kvreuse.kvcache.pins import PinResult
from kvreuse.kvcache.tiers.store import TieredStore


class EngineDeadError(RuntimeError):
    """The engine is not running: nothing can be submitted to it."""


class PinsUnsupported(RuntimeError):
    """Pinning needs the engine in this process: a cluster's replicas each hold their own pool."""


PINS_UNSUPPORTED = ("pinning holds blocks in one engine's pool, and each replica of --replicas has its own: run a "
                    "single engine to pin")


class EngineClient(Protocol):
    @property
    def front_end(self) -> FrontEnd:
        """Prepares requests (tokenize, validate, make_sequence) from any thread, as the engine would."""

    @property
    def tiers(self) -> TieredStore | None:
        """The lower tiers this process writes (the engine's own); None without tiers, or when the engines are
        elsewhere (a cluster's replicas write their own)."""

    @property
    def num_in_flight(self) -> int:
        """Submitted and not yet finished (for backpressure)."""

    @property
    def is_alive(self) -> bool:
        """Accepts and runs requests."""

    @property
    def compile_states(self) -> list[str]:
        """The decode step's state (stats.COMPILE_STATES) of each engine: this process's own, or each replica's as of
        its latest finished request (none before a replica has served)."""

    def start(self) -> None:
        """Start serving (the app's startup)."""

    def submit(self, seq: Sequence) -> asyncio.Queue:
        """Run `seq` (made by `front_end`); its Deltas arrive on the returned queue, the last one with the output, or
        an EngineDied in its place. EngineDeadError if the engine is not running."""

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (client gone); nothing for a request that already ended."""

    async def snapshots(self) -> list[EngineSnapshot]:
        """The snapshot of each engine: this process's own (`replica` None), or each replica's that has served."""

    async def reset_prefix_cache(self, tiers: bool = False) -> dict[str, int]:
        """Drop the cached blocks no request holds (`tiers`: and empty the lower tiers); how many per tier."""

    @property
    def can_pin(self) -> bool:
        """Whether `pin` and `unpin` can act: the engine runs in this process."""

    async def pin(self, token_ids: list[int], cache_salt: str | None, ttl_s: int | None, tenant: str | None = None,
                  num_tenants: int = 1) -> PinResult:
        """Pin the cached chain of a prompt for `tenant`, one of `num_tenants` sharing the pins' share of the pool
        (LLMEngine.pin_prompt). PinsUnsupported where not `can_pin`."""

    async def unpin(self) -> int:
        """End every pin; how many blocks they held. PinsUnsupported where not `can_pin`."""

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop serving and release the engine: what is queued for the lower tiers is written first."""
