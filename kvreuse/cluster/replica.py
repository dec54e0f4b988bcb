"""One engine replica of the cluster: an LLMEngine and its engine thread inside a Ray Serve replica actor.

launch.py makes it a deployment (`serve.deployment(EngineReplica, ...)`). The ingress calls `generate` through a
streaming DeploymentHandle; Serve's controller calls `record_routing_stats` and `check_health` periodically.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import torch
from ray import serve

from kvreuse.cluster.routing import KEY_BYTES
from kvreuse.cluster.spec import AdminSpec, RequestSpec
from kvreuse.config import Config
from kvreuse.engine.engine import LLMEngine
from kvreuse.engine.stats import EngineSnapshot
from kvreuse.server.async_engine import AsyncEngine, load_engine
from kvreuse.server.deltas import Delta, EngineDied
from kvreuse.server.engine_client import EngineDeadError


def held_keys(engine: LLMEngine, key_bytes: int) -> bytes:
    """The shortened chain keys of every block the pool has registered (in use or cached), concatenated: the
    compact form the router reads (routing.Holdings). Engine thread only."""
    return b"".join(key[:key_bytes] for key in engine.kv_manager.pool.key_to_block)


class EngineReplica:
    def __init__(self, config: Config):
        # Its share of the cores: replicas side by side must not each start a thread per core.
        torch.set_num_threads(max(1, int(config.cluster.cpus_per_replica)))
        self.engine = load_engine(config)
        self.runner = AsyncEngine(self.engine)
        self.runner.start()
        self.name = serve.get_replica_context().replica_id.unique_id

    async def generate(self, spec: RequestSpec) -> AsyncIterator[Delta]:
        """The request's deltas as the engine thread produces them; the last one carries the output, named with
        this replica. Cancelled (the client went away), it aborts the request and frees its blocks. The sequence
        is made on a worker thread: compiling a response format's grammar can take seconds, and this replica's other
        streams and Serve's health checks run on this event loop meanwhile."""
        seq = await asyncio.to_thread(self.engine.front_end.make_sequence, spec.prompt_token_ids, spec.params,
                                      spec.request_id, cache_salt=spec.cache_salt, use_cache=spec.use_cache,
                                      response_format=spec.response_format, session_key=spec.session_key,
                                      retention=spec.retention)
        deltas = self.runner.submit(seq)
        finished = False
        try:
            while not finished:
                delta = await deltas.get()
                if isinstance(delta, EngineDied):
                    raise EngineDeadError(f"the engine loop of replica {self.name} died: {delta.cause}")
                if delta.output is not None:
                    delta.output.replica = self.name
                    # Read off the engine thread: counters and lengths only, a moment's inconsistency is harmless.
                    delta.snapshot = self._named(self.engine.stats_snapshot())
                    finished = True
                yield delta
        finally:
            if not finished:
                self.runner.abort(spec.request_id)

    async def admin(self, spec: AdminSpec) -> EngineSnapshot | dict[str, int]:
        """`spec`'s operation on this replica's engine: the dropped blocks per tier, or its snapshot."""
        if spec.replica != self.name:
            raise LookupError(f"admin work for replica {spec.replica} reached replica {self.name}")
        if spec.operation == "stats":
            [snapshot] = await self.runner.snapshots()
            return self._named(snapshot)
        return await self.runner.reset_prefix_cache(spec.tiers)

    def _named(self, snapshot: EngineSnapshot) -> EngineSnapshot:
        return replace(snapshot, replica=self.name)

    async def record_routing_stats(self) -> dict:
        """What the router corrects its picture with: the keys the pool holds now, and the queue."""
        keys = await self.runner.call(lambda engine: held_keys(engine, KEY_BYTES))
        return {"time": time.time(), "keys": keys, "num_in_flight": self.runner.num_in_flight}

    def check_health(self) -> None:
        if not self.runner.is_alive:
            raise EngineDeadError(f"the engine loop died: {self.runner.error!r}")

    def __del__(self):
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.shutdown()  # and what is queued for the lower tiers is written before the replica goes
