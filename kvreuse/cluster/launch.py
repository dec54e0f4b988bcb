"""`kvreuse serve --replicas N`: the OpenAI app here, N engine replicas on Ray Serve behind it.

This process is the ingress: it resolves the model once from its metadata, never its weights (`resolve_model`:
`model.dtype = auto` among the rest), so that every replica computes, and keys its blocks, alike; builds its FrontEnd
from that ResolvedModel; starts Ray (or joins `cluster.ray_address`), deploys the replicas with the cache-aware
router, and serves the same FastAPI app as the single server, with a RemoteEngine in place of the engine thread,
through the same uvicorn server (ready line, SIGTERM draining). Serve's own HTTP proxy is not started: requests reach
the replicas only through this ingress's DeploymentHandle.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Iterator

from kvreuse.config import Config, ConfigError
from kvreuse.engine.front_end import FrontEnd
from kvreuse.engine.resolved_model import resolve_model
from kvreuse.extras import require
from kvreuse.server import lifecycle
from kvreuse.server.app import client_app
from kvreuse.server.auth import load_api_keys
from kvreuse.server.lifecycle import run_http, served_model_name
from kvreuse.server.metrics import Metrics

logger = logging.getLogger(__name__)

APP_NAME = "kvreuse"
START_TIMEOUT_S = 600.0      # model load and warm-up on every replica
ROUTING_STATS_PERIOD_S = 2.0  # how often each replica reports the keys its pool holds


class ClusterStartError(RuntimeError):
    """The replicas could not be started; the message says why (a replica's own error when it has one)."""


def serve_cluster(config: Config, *, log_level: str = "warning") -> int:
    """Serve `config`'s model on `cluster.replicas` replicas until SIGTERM or SIGINT; returns the exit code.
    Raises MissingExtraError (no Ray Serve), ConfigError, ModelLoadError (before Ray starts) or ClusterStartError."""
    require("ray.serve", "cluster", "cluster.replicas > 1")
    if config.cluster.routing == "ray_prefix":
        ray_prefix_router()  # a Ray without it fails here, before anything starts
    api_keys = load_api_keys(config.server.api_keys_file) if config.server.api_keys_file else None
    # The replicas' config names what was resolved here (path, dtype, weights): every replica loads the same weights
    # in the same dtype, with no probe, and so names its blocks with the same keys the router computes.
    resolved = resolve_model(config)
    model_name = served_model_name(config, resolved.path)  # before the path is resolved: a named model's name
    config = resolved.config_of(config)
    front = FrontEnd(config, resolved, compiles_grammars=False)  # it checks response formats; replicas compile them
    with ray_session(config) as joined:
        try:
            handle = deploy(config, front)
            metrics = Metrics(model_name)
            app = client_app(_remote(handle, front, metrics), metrics, model_name, api_keys)
            return run_http(app, config, describe(config, front, model_name, api_keys), log_level)
        finally:
            _stop_serve(joined)


def _remote(handle, front: FrontEnd, metrics: Metrics):
    from kvreuse.cluster.remote_engine import RemoteEngine

    # Ray's prefix router matches the prompt's text: the ingress sends it beside the tokens (decoded, so it is
    # exactly what the tokens say, special tokens included).
    text = None
    if front.config.cluster.routing == "ray_prefix":
        text = lambda seq: front.tokenizer.decode(seq.prompt_token_ids, skip_special_tokens=False)  # noqa: E731
    return RemoteEngine(handle, front, on_finish=metrics.observe_finished, on_snapshot=metrics.observe_replica,
                        prompt_text=text)


def describe(config: Config, front: FrontEnd, model_name: str, api_keys: dict | None) -> str:
    cluster = f"per replica replicas={config.cluster.replicas} routing={config.cluster.routing}"
    return lifecycle.describe(config, front, model_name, api_keys, cluster)


@contextlib.contextmanager
def ray_session(config: Config) -> Iterator[bool]:
    """Ray for the lifetime of the block: joined at `cluster.ray_address` (yields True), or started here, with
    enough logical CPUs for the replicas, and shut down after (yields False)."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = config.cluster.ray_address or None
    options = {} if address else {"num_cpus": max(os.cpu_count() or 1, _cpus_needed(config))}
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING, **options)
    try:
        yield address is not None
    finally:
        ray.shutdown()


def _cpus_needed(config: Config) -> int:
    return math.ceil(config.cluster.replicas * config.cluster.cpus_per_replica)


def deploy(config: Config, front: FrontEnd):
    """Deploy the replicas and wait until all run; their DeploymentHandle. ClusterStartError if they cannot start
    (a replica's constructor failed, or the cluster lacks the CPUs), never an endless wait."""
    import ray
    from ray import serve

    cluster = config.cluster
    available = ray.available_resources().get("CPU", 0.0)
    if available < cluster.replicas * cluster.cpus_per_replica:
        raise ClusterStartError(f"the Ray cluster has {available:g} free CPUs; cluster.replicas = {cluster.replicas} "
                                f"x cluster.cpus_per_replica = {cluster.cpus_per_replica:g} need more")
    serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})
    app = _deployment(config, front).bind(config)
    handle = serve.run_many([serve.RunTarget(target=app, name=APP_NAME, route_prefix=None)],
                            wait_for_applications_running=False)[0]
    _wait_running(START_TIMEOUT_S)
    return handle


def _deployment(config: Config, front: FrontEnd):
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from kvreuse.cluster.replica import EngineReplica
    from kvreuse.cluster.router import KVReuseRouter

    cluster = config.cluster
    router = RequestRouterConfig(
        request_router_class=KVReuseRouter, request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        request_router_kwargs={"routing": cluster.routing, "fingerprint": front.fingerprint,
                               "block_size": front.block_size, **_thresholds(config, front)})
    if cluster.routing == "ray_prefix":  # the peer: Ray's own character-prefix router, with its defaults
        router = RequestRouterConfig(request_router_class=ray_prefix_router())
    # The ingress admits at most server.max_queue requests; a replica takes all it is sent and queues them in its
    # scheduler, as the single server's engine does.
    return serve.deployment(EngineReplica, name="EngineReplica", num_replicas=cluster.replicas,
                            ray_actor_options={"num_cpus": cluster.cpus_per_replica},
                            max_ongoing_requests=config.server.max_queue, request_router_config=router,
                            max_constructor_retry_count=1,
                            # kvreuse logs what matters (cache hits at INFO); Serve's line per call is noise here.
                            logging_config={"log_level": "WARNING", "enable_access_log": False})


def ray_prefix_router() -> type:
    """Ray's PrefixCacheAffinityRouter (`cluster.routing = ray_prefix`), from the private path it lives at without
    vLLM; ConfigError naming the problem if this Ray lacks it."""
    try:
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
            PrefixCacheAffinityRouter,
        )
    except ImportError as exc:
        raise ConfigError(f"cluster.routing = ray_prefix needs Ray's PrefixCacheAffinityRouter, which this Ray does "
                          f"not have ({exc}); use cache_aware or round_robin") from exc
    return PrefixCacheAffinityRouter


def _thresholds(config: Config, front: FrontEnd) -> dict:
    if config.cluster.routing != "cache_aware":
        return {}
    cluster = config.cluster
    return {"cache_threshold": cluster.cache_threshold, "balance_abs": cluster.balance_abs_threshold,
            "balance_rel": cluster.balance_rel_threshold, "max_keys_per_replica": front.num_kv_blocks}


def _wait_running(timeout_s: float) -> None:
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications.get(APP_NAME)
        if status is not None and status.status == ApplicationStatus.RUNNING:
            return
        if status is not None and status.status in (ApplicationStatus.DEPLOY_FAILED, ApplicationStatus.UNHEALTHY):
            raise ClusterStartError(f"the replicas failed to start: {_cause(status)}")
        if time.monotonic() > deadline:
            raise ClusterStartError(f"the replicas did not start within {timeout_s:.0f}s: {_cause(status)}")
        time.sleep(0.25)


def _cause(status) -> str:
    if status is None:
        return "no application status"
    message = "; ".join([d.message for d in status.deployments.values() if d.message] or [status.message])
    # Serve's message ends with the replica's traceback; its last line (the exception) leads, the rest follows.
    lines = [line for line in message.splitlines() if line.strip()]
    return f"{lines[-1].strip()}\n{message}" if len(lines) > 1 else message


def _stop_serve(joined: bool) -> None:
    """Remove what this process deployed: the whole of Serve when the Ray is ours, only our app on a shared one."""
    from ray import serve

    with contextlib.suppress(Exception):  # stopping must not hide why we stop
        if joined:
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
