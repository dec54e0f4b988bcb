"""The Ray Serve RequestRouter of the engine replicas: routing.py's decision, fed from Ray's view of the replicas.

It runs in the process that holds the DeploymentHandle (the ingress). Load is the number of requests this router
has in flight on each replica (exact for one ingress): counted when it chooses (a burst of requests is routed
before Ray's routed hook runs for the first of them, and must not all see the same empty replica), moved if Ray
routed elsewhere, and dropped when Ray says it completed; holdings come from the routing policy's own record,
corrected by each replica's `record_routing_stats`. It never raises and never
waits: any failure ranks every candidate alike, and Ray then picks the least loaded of them.
"""

from __future__ import annotations

import logging
import time

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvreuse.cluster.routing import Holdings, chain_keys, make_policy, session_of
from kvreuse.cluster.spec import AdminSpec, RequestSpec

logger = logging.getLogger(__name__)

KEYS_ATTR = "_kvreuse_chain_keys"  # a pending request's chain keys, computed once, recorded once it is routed


class KVReuseRouter(RequestRouter):
    num_failures = 0  # routings that failed and fell back to ranking every replica alike

    def initialize_state(self, routing: str = "cache_aware", fingerprint: str = "", block_size: int = 16,
                         **thresholds) -> None:
        """From RequestRouterConfig.request_router_kwargs (launch.py): `cluster.routing`, the fingerprint and block
        size the replicas key their blocks with, and the cache_aware thresholds."""
        self.routing, self.fingerprint, self.block_size = routing, fingerprint, block_size
        self.policy = make_policy(routing, **thresholds)
        self.in_flight: dict[str, set[str]] = {}  # replica -> internal ids of the requests routed there

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        try:
            return self.rank(candidate_replicas, pending_request)
        except Exception:
            self.num_failures += 1
            logger.exception("routing failed (%d so far); ranking the replicas alike", self.num_failures)
            return [candidate_replicas]

    def rank(self, candidates: list[RunningReplica], pending: PendingRequest | None) -> list[list[RunningReplica]]:
        """[[the chosen replica], [the others]]: Ray takes the first rank unless that replica's queue is full."""
        spec = pending.args[0] if pending is not None and pending.args else None
        if isinstance(spec, AdminSpec):  # addressed to one replica; gone (replaced): any, which refuses it
            addressed = [replica for replica in candidates if replica.replica_id.unique_id == spec.replica]
            return [addressed or candidates]
        if len(candidates) < 2 or not isinstance(spec, RequestSpec):
            return [candidates]
        by_name = {replica.replica_id.unique_id: replica for replica in candidates}
        self.policy.forget(set(by_name))
        loads = {name: len(self.in_flight.get(name, ())) for name in by_name}
        reports = {name: Holdings.from_stats(replica.routing_stats) for name, replica in by_name.items()}
        name = self.policy.choose(self.keys_of(spec, pending), loads, reports,
                                  session_of(spec.cache_salt, spec.session_key))
        self._count(pending.metadata.internal_request_id, name)
        chosen = by_name[name]
        return [[chosen], [replica for replica in candidates if replica is not chosen]]

    def _count(self, request_id: str, name: str) -> None:
        """`request_id` is in flight on replica `name` (and on no other)."""
        for requests in self.in_flight.values():
            requests.discard(request_id)
        self.in_flight.setdefault(name, set()).add(request_id)

    def keys_of(self, spec: RequestSpec, pending: PendingRequest) -> list[bytes]:
        """The request's chain keys (none for a request that neither reuses nor publishes, nor for round_robin)."""
        keys = getattr(pending, KEYS_ATTR, None)
        if keys is None:
            keys = []
            if spec.use_cache and self.routing == "cache_aware":
                keys = chain_keys(spec.prompt_token_ids, self.fingerprint, self.block_size, spec.cache_salt)
            setattr(pending, KEYS_ATTR, keys)
        return keys

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        try:
            name = replica_id.unique_id
            self._count(pending_request.metadata.internal_request_id, name)  # where Ray really sent it
            spec = pending_request.args[0] if pending_request.args else None
            session = session_of(spec.cache_salt, spec.session_key) if isinstance(spec, RequestSpec) else None
            self.policy.record(name, getattr(pending_request, KEYS_ATTR, None) or [], time.time(), session)
        except Exception:
            logger.exception("recording a routed request failed; routing goes on")

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.in_flight.get(replica_id.unique_id, set()).discard(internal_request_id)
