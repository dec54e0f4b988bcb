"""Several engine replicas on Ray Serve behind one OpenAI endpoint (`kvreuse serve --replicas N`).

- `spec.py`           RequestSpec: what the ingress sends a replica (plain, picklable)
- `routing.py`        the routing decision, pure: chain keys, cache_aware and round_robin policies
- `router.py`         the Ray Serve RequestRouter around that decision
- `replica.py`        EngineReplica: one LLMEngine and its engine thread, a Serve deployment
- `remote_engine.py`  RemoteEngine: the ingress's EngineClient, over a streaming DeploymentHandle
- `launch.py`         serve_cluster: start or join Ray, deploy, serve the OpenAI app, shut down
"""
