"""The ingress's engine: the server's EngineClient, with the requests run by the replicas instead of a thread here.

`submit` sends the request's spec through a streaming DeploymentHandle (the router picks the replica) and relays
the replica's deltas onto the asyncio.Queue the server reads, exactly as the engine thread would fill it. A replica
that fails mid-request (its actor died, the call raised) ends the request with an error delta: 500, or an error
event in a stream, and the server goes on; one that fails before sending anything is retried once (the router
then picks among the live replicas). `abort` cancels the call, which cancels `generate` on the replica, which
aborts the request there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvreuse.cluster.spec import AdminSpec, RequestSpec
from kvreuse.engine.front_end import FrontEnd
from kvreuse.engine.output import RequestOutput
from kvreuse.engine.sequence import Sequence
from kvreuse.engine.stats import EngineSnapshot
from kvreuse.kvcache.pins import PinResult
from kvreuse.server.deltas import Delta
from kvreuse.server.engine_client import PINS_UNSUPPORTED, EngineDeadError, PinsUnsupported
from kvreuse.server.errors import APIError

logger = logging.getLogger(__name__)

RETRIES = 1  # a request whose replica fails before it sent anything is sent again, once


class RemoteEngine:
    """The replicas behind a DeploymentHandle, as the server's EngineClient; `front_end` prepares the requests here."""

    tiers = None  # the replicas write their own lower tiers; this process writes none

    def __init__(self, handle, front_end: FrontEnd, on_finish: Callable[[RequestOutput], None] | None = None,
                 on_snapshot: Callable[[EngineSnapshot], None] | None = None,
                 prompt_text: Callable[[Sequence], str] | None = None):
        self._generate = handle.options(stream=True).generate
        self._admin = handle.admin
        self.front_end = front_end
        self.replicas: set[str] = set()  # replicas that have served a request: where admin work goes
        self._prompt_text = prompt_text  # for a router that matches prompt text (ray_prefix)
        # Metrics: the ingress counts every replica's requests, and keeps each replica's gauges as of its last one.
        self.on_finish, self.on_snapshot = on_finish, on_snapshot
        self._relays: dict[str, asyncio.Task] = {}
        self._running = False
        self._compile_states: dict[str, str] = {}  # replica -> its decode step's state, as of its latest request

    def start(self) -> None:
        self._running = True

    @property
    def num_in_flight(self) -> int:
        """Submitted and not yet finished, on every replica (for backpressure)."""
        return len(self._relays)

    @property
    def is_alive(self) -> bool:
        """Serving; a replica that dies is replaced by Serve, and its requests fail, but the ingress stays up."""
        return self._running

    @property
    def compile_states(self) -> list[str]:
        """Each replica's decode step as of its latest finished request; with `engine.compile = off`, all eager."""
        config = self.front_end.config
        if config.engine.compile == "off":
            return ["eager"] * config.cluster.replicas
        return [self._compile_states[name] for name in sorted(self._compile_states)]

    def submit(self, seq: Sequence) -> asyncio.Queue:
        """Send a sequence made by the front end to a replica; its deltas arrive on the returned queue."""
        if not self._running:
            raise EngineDeadError("the cluster ingress is not running")
        deltas: asyncio.Queue = asyncio.Queue()
        relay = asyncio.get_running_loop().create_task(self._relay(seq, deltas))
        self._relays[seq.request_id] = relay
        relay.add_done_callback(lambda _: self._relays.pop(seq.request_id, None))
        return deltas

    async def _relay(self, seq: Sequence, deltas: asyncio.Queue) -> None:
        for attempt in range(1 + RETRIES):
            relayed = 0
            text = self._prompt_text(seq) if self._prompt_text else None
            stream = self._generate.remote(RequestSpec.of(seq, text))
            try:
                async for delta in stream:
                    relayed += 1
                    deltas.put_nowait(delta)
                    if delta.finished:
                        self._finished(delta)
                return
            except asyncio.CancelledError:
                stream.cancel()  # the replica's generate is cancelled in turn, and aborts the request
                raise
            except Exception as exc:
                if relayed == 0 and attempt < RETRIES:  # nothing reached the client yet: another replica may take it
                    logger.warning("request %s failed on its replica before any output (%s: %s); retrying once",
                                   seq.request_id, type(exc).__name__, exc)
                    continue
                logger.warning("request %s failed on its replica: %s: %s", seq.request_id, type(exc).__name__, exc)
                # Ray's message names the actor, its pid and its node's address: the log has it, the client does not.
                seq.finish_reason, seq.error = "error", (f"the replica computing this request failed "
                                                         f"({type(exc).__name__}); the server log has the details")
                deltas.put_nowait(Delta("", RequestOutput.from_sequence(seq)))
                return

    def _finished(self, delta: Delta) -> None:
        if delta.output.replica:
            self.replicas.add(delta.output.replica)
        self._notify(self.on_finish, delta.output)
        if delta.snapshot is not None:
            self._compile_states[delta.snapshot.replica] = delta.snapshot.compile_state
            self._notify(self.on_snapshot, delta.snapshot)

    def _notify(self, callback: Callable | None, *args) -> None:
        if callback is None:
            return
        try:
            callback(*args)
        except Exception:  # serving matters more than a counter
            logger.exception("a metrics observer failed; the ingress goes on")

    def abort(self, request_id: str) -> None:
        relay = self._relays.get(request_id)
        if relay is not None:
            relay.cancel()

    async def reset_prefix_cache(self, tiers: bool = False) -> dict[str, int]:
        """Every replica that has served drops its cached blocks (and with `tiers` its tiers); the sums per tier. A
        replica that never served holds nothing to drop."""
        total: dict[str, int] = {}
        for dropped in (await self._fan_out("reset_prefix_cache", tiers)).values():
            for tier, count in dropped.items():
                total[tier] = total.get(tier, 0) + count
        return total

    can_pin = False

    async def pin(self, token_ids: list[int], cache_salt: str | None, ttl_s: int | None, tenant: str | None = None,
                  num_tenants: int = 1) -> PinResult:
        raise PinsUnsupported(PINS_UNSUPPORTED)

    async def unpin(self) -> int:
        raise PinsUnsupported(PINS_UNSUPPORTED)

    async def snapshots(self) -> list[EngineSnapshot]:
        """The engine snapshot of every replica that has served, in the order of their names."""
        return list((await self._fan_out("stats")).values())

    async def _fan_out(self, operation: str, tiers: bool = False) -> dict[str, EngineSnapshot | dict[str, int]]:
        if self._prompt_text is not None:  # ray_prefix: Ray's router picks by prompt text, it cannot address one
            raise APIError(501, "not available with cluster.routing = ray_prefix: Ray's router cannot address a "
                                "replica by name", "not_implemented")
        results = {}
        for name in sorted(self.replicas):
            try:
                results[name] = await self._admin.remote(AdminSpec(name, operation, tiers))
            except Exception as exc:  # replaced since (a new replica has a new name): forget it
                logger.info("replica %s did not take %s (%s); it is forgotten", name, operation, exc)
                self.replicas.discard(name)
                self._compile_states.pop(name, None)
        return results

    def shutdown(self, timeout: float = 10.0) -> None:
        self._running = False
