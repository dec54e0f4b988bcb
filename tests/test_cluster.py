"""`kvreuse serve --replicas N`: the routing decision alone (pure, fast), the Ray adapter around it (fakes), and the
cluster end to end (real Ray, two replicas of the tiny model, `kvreuse serve` as a subprocess, bounded in time).

Which replica served a request is `usage.replica` (set by the replica on its output; only in cluster mode).
"""

from __future__ import annotations

import asyncio
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass, field, replace

import openai

from kvreuse.cluster.router import KVReuseRouter
from kvreuse.cluster.routing import (
    KEY_BYTES,
    CacheAwarePolicy,
    Holdings,
    RoundRobinPolicy,
    chain_keys,
    imbalanced,
    session_of,
)
from kvreuse.cluster.spec import RequestSpec
from kvreuse.kvcache.manager import KVCacheManager
from kvreuse.sampling_params import SamplingParams

from .helpers import server_args
from .server_process import REPO_ROOT, http_client, start_server

BLOCK = 16
FP = "weights:float32"


def keys(*blocks: int) -> list[bytes]:
    """Chain keys of a prompt made of the given one-token-per-block fillers (block i is [value] * BLOCK)."""
    return chain_keys([t for value in blocks for t in [value] * BLOCK], FP, BLOCK, None)


# --- the decision, pure ----------------------------------------------------------------------------------------
def test_chain_keys_are_the_engines_block_keys_salt_included():
    tokens = list(range(100))
    manager = KVCacheManager(8, BLOCK, fingerprint=FP)
    for salt in (None, "tenant-a"):
        req = manager.new_request(tokens, salt)
        engine_keys = [manager._key(req, i)[:KEY_BYTES] for i in range(len(tokens) // BLOCK)]
        assert chain_keys(tokens, FP, BLOCK, salt) == engine_keys
    assert chain_keys(tokens, FP, BLOCK, "a") != chain_keys(tokens, FP, BLOCK, "b")
    assert chain_keys(tokens[:15], FP, BLOCK, None) == []  # no full block, nothing to match


def test_a_request_goes_where_its_longest_prefix_was_sent():
    policy = CacheAwarePolicy(cache_threshold=0.3)
    policy.record("a", keys(1, 2))
    policy.record("b", keys(1, 2, 3, 4))
    loads = {"a": 0, "b": 0}
    assert policy.choose(keys(1, 2, 3, 4, 5), loads, {}) == "b"
    assert policy.matched("a", keys(1, 2, 3, 4, 5), None) == 2
    assert policy.choose(keys(1, 2, 9, 9), {"a": 0, "b": 3}, {}) == "a"  # equal matches: the less loaded


def test_a_short_match_or_none_goes_to_the_least_loaded_and_new_conversations_spread():
    policy = CacheAwarePolicy(cache_threshold=0.5)
    policy.record("a", keys(1))
    assert policy.choose(keys(1, 2, 3, 4), {"a": 0, "b": 1}, {}) == "a"  # 1/4 < 0.5: least loaded, a
    assert policy.choose(keys(1, 2, 3, 4), {"a": 2, "b": 1}, {}) == "b"
    # Equal loads and no match: the replica holding fewer blocks, so conversations spread over the replicas.
    assert policy.choose(keys(7, 8), {"a": 0, "b": 0}, {}) == "b"


def test_an_unbalanced_load_overrides_the_cache():
    assert imbalanced({"a": 100, "b": 10}, 64, 1.5) and not imbalanced({"a": 70, "b": 10}, 64, 1.5)
    assert not imbalanced({"a": 100, "b": 70}, 20, 1.5)
    policy = CacheAwarePolicy(cache_threshold=0.1, balance_abs=4, balance_rel=1.5)
    policy.record("a", keys(1, 2, 3))
    assert policy.choose(keys(1, 2, 3), {"a": 4, "b": 0}, {}) == "a"   # 4 - 0 is not > 4
    assert policy.choose(keys(1, 2, 3), {"a": 5, "b": 0}, {}) == "b"


def test_reports_correct_the_record_evictions_and_blocks_the_router_never_sent():
    policy = CacheAwarePolicy(cache_threshold=0.1)
    policy.record("a", keys(1, 2, 3), now=1000.0)
    # A report taken long after the send, without the third block: the replica evicted it.
    evicted = Holdings(frozenset(keys(1, 2, 3)[:2]), time=2000.0)
    assert policy.matched("a", keys(1, 2, 3), evicted) == 2
    # A report taken right after the send proves nothing yet: the request may not have computed its prompt.
    early = Holdings(frozenset(), time=1005.0)
    assert policy.matched("a", keys(1, 2, 3), early) == 3
    # What a replica reports counts even if this router never sent it (another ingress, a warm-up).
    assert policy.choose(keys(5, 6), {"a": 0, "b": 0}, {"b": Holdings(frozenset(keys(5, 6)), 2000.0)}) == "b"
    stats = {"time": 2000.0, "keys": b"".join(keys(5, 6)), "num_in_flight": 0}
    assert Holdings.from_stats(stats) == Holdings(frozenset(keys(5, 6)), 2000.0)
    assert Holdings.from_stats({}) is None and Holdings.from_stats(None) is None


def test_the_record_is_bounded_and_forgets_replicas_that_left():
    policy = CacheAwarePolicy(max_keys_per_replica=3)
    policy.record("a", keys(1, 2, 3, 4, 5))
    assert len(policy.sent["a"]) == 3 and policy.matched("a", keys(1), None) == 0  # oldest dropped
    policy.forget({"b"})
    assert policy.sent == {}


def test_round_robin_takes_turns_in_name_order():
    policy = RoundRobinPolicy()
    assert [policy.choose([], {"b": 0, "a": 5}, {}) for _ in range(4)] == ["a", "b", "a", "b"]


# --- the Ray adapter, with stand-ins for Ray's replicas and requests --------------------------------------------
@dataclass(frozen=True)
class FakeId:
    unique_id: str


@dataclass
class FakeReplica:
    name: str
    routing_stats: dict = field(default_factory=dict)

    @property
    def replica_id(self) -> FakeId:
        return FakeId(self.name)


@dataclass
class FakeMetadata:
    internal_request_id: str


@dataclass
class FakePending:
    args: list
    metadata: FakeMetadata = field(default_factory=lambda: FakeMetadata("r1"))


def fake_router(routing: str = "cache_aware") -> KVReuseRouter:
    router = KVReuseRouter.__new__(KVReuseRouter)  # Ray's constructor needs a running Serve; the hooks do not
    router.initialize_state(routing=routing, fingerprint=FP, block_size=BLOCK, cache_threshold=0.3)
    return router


def choose(router: KVReuseRouter, replicas: list, pending) -> list[list]:
    return asyncio.run(router.choose_replicas(replicas, pending))


def spec(*blocks: int) -> RequestSpec:
    return RequestSpec("r", [t for value in blocks for t in [value] * BLOCK], SamplingParams(max_tokens=1))


def test_the_router_ranks_the_chosen_replica_first_and_records_what_it_routed():
    router = fake_router()
    a, b = FakeReplica("a"), FakeReplica("b")
    first = FakePending([spec(1, 2, 3)])
    ranked = choose(router, [a, b], first)
    chosen = ranked[0][0]
    assert len(ranked) == 2 and ranked[1] == [b if chosen is a else a]
    router.on_request_routed(first, FakeId(chosen.name), None)
    assert router.in_flight[chosen.name] == {"r1"}
    # The same conversation follows, although that replica is now the busier one.
    assert choose(router, [a, b], FakePending([spec(1, 2, 3, 4)], FakeMetadata("r2")))[0] == [chosen]
    router.on_request_completed(FakeId(chosen.name), "r1")
    assert router.in_flight[chosen.name] == {"r2"}  # counted when chosen


def test_a_burst_is_spread_before_ray_reports_any_routing():
    router = fake_router()
    a, b = FakeReplica("a"), FakeReplica("b")
    burst = [FakePending([spec(10 + i, 99)], FakeMetadata(f"r{i}")) for i in range(6)]
    chosen = [choose(router, [a, b], pending)[0][0].name for pending in burst]
    assert sorted(chosen) == ["a", "a", "a", "b", "b", "b"]
    router.on_request_routed(burst[0], FakeId("b" if chosen[0] == "a" else "a"), None)  # Ray sent it elsewhere
    assert sum(len(ids) for ids in router.in_flight.values()) == 6 and "r0" not in router.in_flight[chosen[0]]


def test_admin_work_goes_to_the_replica_it_names():
    from kvreuse.cluster.spec import AdminSpec

    router = fake_router()
    a, b = FakeReplica("a"), FakeReplica("b")
    assert choose(router, [a, b], FakePending([AdminSpec("b", "stats")])) == [[b]]
    assert choose(router, [a, b], FakePending([AdminSpec("gone", "stats")])) == [[a, b]]  # refused by whoever gets it
    assert router.in_flight == {}  # admin work is not load


def test_the_router_never_raises_a_broken_request_or_policy_ranks_all_alike():
    router = fake_router()
    replicas = [FakeReplica("a"), FakeReplica("b", routing_stats={"keys": b"short", "time": "not a time"})]
    assert choose(router, replicas, FakePending(["not a spec"])) == [replicas]
    assert choose(router, replicas, None) == [replicas]
    assert choose(router, replicas, FakePending([spec(1)])) == [replicas]  # bad stats: degraded
    assert router.num_failures == 1
    broken = KVReuseRouter.__new__(KVReuseRouter)  # initialize_state never ran
    assert choose(broken, replicas, FakePending([spec(1)])) == [replicas]


# --- end to end: kvreuse serve --replicas 2 --------------------------------------------------------------------
SYSTEM = ("You are a concise assistant for the city library of Port Elling. You answer questions about opening "
          "hours, borrowing rules and events. Keep answers short, friendly and factual.")


def cluster(tmp_path, tiny_model_dir: str, routing: str, *sets: str):
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # inherited by the server and its Ray
    return start_server("--replicas", "2",
                        *server_args(tiny_model_dir, f"cluster.routing={routing}", "engine.num_kv_blocks=512", *sets),
                        log_path=tmp_path / f"{routing}.log", ready_timeout=240.0, stop_timeout=60.0)


def conversation(client: openai.OpenAI, model: str, turns: int = 4) -> list[dict]:
    """A multi-turn chat, each turn the previous turns + the reply + a new question; per turn: the replica, the
    prompt tokens and the cached tokens."""
    messages = [{"role": "system", "content": SYSTEM}]
    seen = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn}: when does the library open on day {turn}?"})
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
        usage = reply.usage
        seen.append({"replica": usage.model_extra["replica"], "prompt": usage.prompt_tokens,
                     "cached": usage.prompt_tokens_details.cached_tokens})
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    return seen


def previous_prompt_blocks(seen: list[dict], turn: int) -> int:
    """The tokens of the previous turn's full prompt blocks: what staying on its replica finds cached, at least."""
    return seen[turn - 1]["prompt"] // BLOCK * BLOCK


def test_cache_aware_keeps_a_conversation_on_one_replica_and_streams(tmp_path, tiny_model_dir):
    with cluster(tmp_path, tiny_model_dir, "cache_aware") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60,
                               http_client=http_client())
        seen = conversation(client, server.model)
        assert len({turn["replica"] for turn in seen}) == 1, seen
        assert seen[0]["cached"] == 0
        for turn in range(1, len(seen)):
            assert seen[turn]["cached"] >= previous_prompt_blocks(seen, turn) > 0, seen

        chunks = list(client.chat.completions.create(
            model=server.model, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}],
            max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text and chunks[-1].usage.completion_tokens == 8
        assert chunks[-1].usage.model_extra["replica"] == seen[0]["replica"]  # the system prompt's blocks are there

        with http_client(30) as raw:
            assert raw.get(f"{server.root}/health").json()["status"] == "ok"
            stats = raw.get(f"{server.root}/cache/stats").json()  # every replica that served, by name
            served = stats["replicas"][seen[0]["replica"]]
            assert served["blocks_cached"] > 0 and stats["memory"]["blocks_cached"] >= served["blocks_cached"]
            reset = raw.post(f"{server.root}/reset_prefix_cache").json()
            assert reset["dropped"]["memory"] == stats["memory"]["blocks_cached"]
            after = raw.get(f"{server.root}/cache/stats").json()
            assert after["memory"]["blocks_cached"] == 0
        scrape = server.metrics()
        assert scrape.get("vllm:prefix_cache_hits_total", model_name=server.model) > 0
        # Gauges: the replicas' engines, as of their latest finished requests.
        assert scrape.get("kvreuse:cached_blocks", model_name=server.model) > 0
        assert scrape.get("kvreuse:replica_num_requests_running", replica=seen[0]["replica"]) == 0

        # Pins hold blocks in one pool: refused behind the replicas, before any warming; warming alone is served.
        with http_client(30) as raw:
            for path, body in (("/cache/warm", {"items": [{"prompt": "Hi"}], "pin": True}), ("/cache/unpin", {})):
                refused = raw.post(f"{server.root}{path}", json=body)
                assert refused.status_code == 400 and "single engine to pin" in refused.text, refused.text
            assert raw.post(f"{server.root}/cache/warm", json={"items": [{"prompt": "Hi"}]}).status_code == 200


def test_round_robin_alternates_replicas_and_finds_less_in_the_cache(tmp_path, tiny_model_dir):
    with cluster(tmp_path, tiny_model_dir, "round_robin") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60,
                               http_client=http_client())
        seen = conversation(client, server.model)
    replicas = [turn["replica"] for turn in seen]
    assert len(set(replicas)) == 2 and all(replicas[i] != replicas[i + 1] for i in range(len(seen) - 1)), seen
    assert seen[1]["cached"] == 0  # the second turn's replica never saw the conversation
    for turn in range(1, len(seen)):
        assert seen[turn]["cached"] < previous_prompt_blocks(seen, turn), seen


def test_with_a_shared_redis_the_other_replica_loads_the_conversation(tmp_path, tiny_model_dir, redis_url):
    """Round robin sends each turn to the other replica, which finds the conversation so far in Redis: a routing
    miss costs a load instead of a prefill."""
    with cluster(tmp_path, tiny_model_dir, "round_robin", f"cache.redis.url={redis_url}") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60,
                               http_client=http_client())
        seen = conversation(client, server.model)
        scrape = server.metrics()
    assert len({turn["replica"] for turn in seen}) == 2
    for turn in range(1, len(seen)):  # the previous turn's prompt blocks at least, written by the other replica
        assert seen[turn]["cached"] >= previous_prompt_blocks(seen, turn) > 0, seen
    assert scrape.get("kvreuse:tier_hit_tokens_total", tier="redis") > 0


def replica_pids() -> list[int]:
    """The processes of the engine replicas (Ray names them after the deployment)."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "ServeReplica:" in line and "EngineReplica" in line]


def test_a_killed_replica_fails_its_requests_cleanly_and_the_cluster_serves_on(tmp_path, tiny_model_dir):
    import signal
    import threading
    import time

    with cluster(tmp_path, tiny_model_dir, "cache_aware") as server:
        pids = replica_pids()
        assert len(pids) == 2, pids
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120,
                               http_client=http_client())
        outcomes: dict[int, object] = {}
        streaming = [threading.Event(), threading.Event()]
        killed = threading.Event()

        def long_stream(i: int) -> None:
            try:
                stream = client.completions.create(model=server.model, prompt=f"Story {i}: once upon a time",
                                                   max_tokens=2000, temperature=0, stream=True,
                                                   extra_body={"ignore_eos": True})
                text = []
                for chunk in stream:
                    streaming[i].set()
                    killed.wait(60)  # both run until the kill
                    text.append(chunk.choices[0].text)
                outcomes[i] = "".join(text)
            except Exception as exc:  # noqa: BLE001 (what the client sees is the point)
                outcomes[i] = exc

        threads = [threading.Thread(target=long_stream, args=(i,)) for i in range(2)]
        for i, thread in enumerate(threads):  # the second starts once the first runs: least loaded, the other replica
            thread.start()
            assert streaming[i].wait(60)
        os.kill(pids[0], signal.SIGKILL)
        killed.set()
        for thread in threads:
            thread.join(120)
        assert not any(thread.is_alive() for thread in threads), "a request hung"
        failed = [o for o in outcomes.values() if isinstance(o, Exception)]
        assert len(failed) == 1 and len(outcomes) == 2, outcomes  # the killed replica's request, and only it
        message = str(failed[0])   # the exception's type, not Ray's actor id, pid or node address
        assert "(ActorDiedError)" in message and str(pids[0]) not in message and "actor_id" not in message, message
        # The cluster goes on: new requests succeed, and Serve starts a replacement.
        for i in range(4):
            reply = client.completions.create(model=server.model, prompt=f"After {i}", max_tokens=4, temperature=0)
            assert reply.choices[0].finish_reason == "length"
        deadline = time.monotonic() + 120
        while len(replica_pids()) < 2 and time.monotonic() < deadline:
            time.sleep(1.0)
        assert len(replica_pids()) == 2 and pids[0] not in replica_pids()


def test_a_replica_that_cannot_start_is_a_clear_error_not_a_hang(tmp_path, tiny_model_dir):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    # The front end never opens the disk tier; each replica's engine does, and fails.
    done = subprocess.run([sys.executable, "-m", "kvreuse", "serve", "--port", "0", "--replicas", "2",
                           *server_args(tiny_model_dir, f"cache.disk.path={not_a_dir}/kv")],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 1
    assert "kvreuse: the replicas failed to start: NotADirectoryError" in done.stderr, done.stderr[-3000:]
    assert "kvreuse ready" not in done.stdout


def test_a_bad_model_path_fails_before_ray_starts(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kvreuse", "serve", "--port", "0", "--replicas", "2",
                           "--model", str(tmp_path / "missing")], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and "model path not found" in done.stderr


def test_ray_prefix_runs_rays_own_router_as_the_peer(tmp_path, tiny_model_dir):
    """Ray's PrefixCacheAffinityRouter matches the prompt text the ingress sends beside the tokens: a conversation
    whose turns extend each other stays on the replica that has seen it."""
    with cluster(tmp_path, tiny_model_dir, "ray_prefix") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60,
                               http_client=http_client())
        seen = conversation(client, server.model)
        with http_client(30) as raw:  # no admin fan-out: Ray's router cannot address a replica (and must not hang)
            assert raw.post(f"{server.root}/reset_prefix_cache").status_code == 501
    assert len({turn["replica"] for turn in seen}) == 1, seen
    for turn in range(1, len(seen)):
        assert seen[turn]["cached"] >= previous_prompt_blocks(seen, turn) > 0, seen


# --- the ingress's relay: a replica that dies before sending anything (a fault a live cluster cannot time) ------
class FakeStream:
    """A streaming call's response: yields its deltas, or raises `fault` before the first."""

    def __init__(self, deltas: list, fault: Exception | None):
        self.deltas, self.fault, self.cancelled = deltas, fault, False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        if self.fault is not None:
            raise self.fault
        for delta in self.deltas:
            yield delta

    def cancel(self):
        self.cancelled = True


class FakeHandle:
    """A DeploymentHandle whose calls fail `faults` times before the first delta, then stream normally."""

    admin = None  # no admin work in these tests

    def __init__(self, deltas: list, faults: int):
        self.deltas, self.faults, self.calls = deltas, faults, 0

    def options(self, stream: bool):
        assert stream
        return self

    @property
    def generate(self):
        return self

    def remote(self, spec):
        self.calls += 1
        fault = RuntimeError(RAY_FAULT) if self.calls <= self.faults else None
        return FakeStream(self.deltas, fault)


RAY_FAULT = ("The actor died unexpectedly before finishing this task. class_name: ServeReplica:kvreuse:Replica "
             "actor_id: 9f1c2e7d0a pid: 48213 namespace: serve ip: 10.1.2.3")


def relay(faults: int, tiny_llm) -> tuple[list, FakeHandle]:
    from kvreuse.cluster.remote_engine import RemoteEngine
    from kvreuse.server.deltas import Delta

    seq = tiny_llm.engine.front_end.make_sequence("hello there", SamplingParams(max_tokens=2))
    finished = Delta("", tiny_llm.engine.output(seq))
    handle = FakeHandle([Delta("hi"), finished], faults)

    async def run() -> list:
        engine = RemoteEngine(handle, tiny_llm.engine.front_end)
        engine.start()
        queue = engine.submit(seq)
        got = [await queue.get()]
        while not got[-1].finished:
            got.append(await queue.get())
        return got

    return asyncio.run(run()), handle


def test_a_replica_failing_before_any_output_is_retried_once(tiny_llm):
    got, handle = relay(1, tiny_llm)
    assert handle.calls == 2 and [d.text for d in got] == ["hi", ""] and got[-1].error is None


def test_a_second_failure_is_an_error_delta(tiny_llm):
    got, handle = relay(2, tiny_llm)
    assert handle.calls == 2 and len(got) == 1
    error = got[0].error   # what the client reads: no actor id, pid or internal address of the cluster
    assert "the replica computing this request failed (RuntimeError)" in error
    assert not any(secret in error for secret in ("9f1c2e7d0a", "48213", "10.1.2.3")), error


def test_a_replica_engine_snapshot_pickles_whole_and_names_its_replica(tiny_llm):
    from kvreuse.server.metrics import Metrics

    tiny_llm.generate("hello there", SamplingParams(max_tokens=2))
    snapshot = replace(tiny_llm.engine.stats_snapshot(), replica="replica-a")  # as EngineReplica sends it
    assert pickle.loads(pickle.dumps(snapshot)) == snapshot and snapshot.reuse.prompt_tokens > 0
    metrics = Metrics("tiny")
    metrics.observe_replica(snapshot)
    assert metrics.replica_snapshots == {"replica-a": snapshot}


def test_both_engine_clients_offer_what_the_server_needs(tiny_llm):
    from kvreuse.cluster.remote_engine import RemoteEngine
    from kvreuse.server.async_engine import AsyncEngine
    from kvreuse.server.engine_client import EngineClient

    members = {name for name in vars(EngineClient) if not name.startswith("_")}
    assert {"front_end", "submit", "abort", "snapshots", "reset_prefix_cache", "can_pin", "pin", "unpin",
            "shutdown"} <= members
    local, remote = AsyncEngine(tiny_llm.engine), RemoteEngine(FakeHandle([], 0), tiny_llm.engine.front_end)
    for client in (local, remote):
        assert not {name for name in members if not hasattr(client, name)}, type(client).__name__
        assert client.front_end is tiny_llm.engine.front_end
    assert local.can_pin and not remote.can_pin


# --- response formats: checked once by the ingress, compiled by the replica off its event loop -------------------
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}


def test_the_ingress_checks_a_format_without_compiling_it_and_sends_it_checked(tiny_model_dir):
    from kvreuse.engine.front_end import FrontEnd
    from kvreuse.structured import CheckedFormat, UnsupportedFormat, parse_format

    from .helpers import tiny_config

    ingress = FrontEnd.from_config(tiny_config(tiny_model_dir))  # the ingress's own front end (launch.py)
    try:
        spec = parse_format(None, guided_json=CITY)
        seq = ingress.make_sequence("Name a city.", SamplingParams(max_tokens=8), response_format=spec)
        assert seq.grammar == CheckedFormat(spec) and seq.matcher is None
        assert len(ingress.grammars.cache) == 0  # timed in the check process, compiled nowhere in this one
        assert pickle.loads(pickle.dumps(RequestSpec.of(seq))).response_format == CheckedFormat(spec)
        # What the single server refuses, the ingress refuses, before any replica sees it.
        over = parse_format(None, guided_json={"type": "object", "properties": {f"p{i}": {} for i in range(501)}})
        try:
            ingress.make_sequence("Name a city.", SamplingParams(max_tokens=8), response_format=over)
        except UnsupportedFormat as exc:
            assert exc.field == "guided_json" and "(structured.max_schema_properties)" in str(exc)
        else:
            raise AssertionError("the ingress let a schema over the property limit through")
    finally:
        ingress.grammars.close()


def test_a_replica_compiles_a_format_off_its_event_loop(tiny_model_dir):
    """A format the ingress checked takes the replica 1-2 s to compile (800 optional properties); meanwhile its event
    loop keeps running: its other calls (routing stats, health) answer, and no tick of the loop is held up."""
    from kvreuse.cluster.replica import EngineReplica
    from kvreuse.server.async_engine import AsyncEngine
    from kvreuse.structured import CheckedFormat, parse_format

    from .helpers import tiny_engine

    engine = tiny_engine(tiny_model_dir, structured__max_schema_properties=1000)
    replica = EngineReplica.__new__(EngineReplica)  # Serve's replica context is not needed past __init__
    replica.engine, replica.runner, replica.name = engine, AsyncEngine(engine), "replica-a"
    replica.runner.start()
    slow = parse_format(None, guided_json={"type": "object",
                                           "properties": {f"field_{i}": {"type": "string"} for i in range(800)}})
    request = RequestSpec("r1", engine.front_end.tokenize_prompt("Numbers:"), SamplingParams(max_tokens=3),
                          response_format=CheckedFormat(slow))

    async def run() -> tuple[list, float, float, float]:
        loop = asyncio.get_running_loop()
        gaps: list[float] = []

        async def tick() -> None:
            last = loop.time()
            while True:
                await asyncio.sleep(0.01)
                replica.check_health()
                gaps.append(loop.time() - last)
                last = loop.time()

        ticker = asyncio.create_task(tick())
        start = loop.time()
        streamed = asyncio.create_task(collect(replica.generate(request)))
        await asyncio.sleep(0.1)
        asked = loop.time()
        await replica.record_routing_stats()
        answered = loop.time() - asked
        deltas = await streamed
        ticker.cancel()
        return deltas, loop.time() - start, answered, max(gaps)

    try:
        deltas, took, answered, longest_gap = asyncio.run(run())
    finally:
        replica.runner.shutdown()
    assert deltas[-1].finished and deltas[-1].error is None and deltas[-1].output.replica == "replica-a"
    assert took > 0.5, took  # the compile is slow enough to show a blocked loop
    assert answered < took / 4 and longest_gap < took / 4, (answered, longest_gap, took)
    assert engine.front_end.grammars.check_process.starts == 0  # the ingress timed it; the replica does not again
    assert len(engine.front_end.grammars.cache) == 1


async def collect(stream) -> list:
    return [delta async for delta in stream]


def test_a_cluster_refuses_a_format_at_the_ingress_and_a_replica_answers_under_one(tmp_path, tiny_model_dir):
    import json

    import jsonschema

    with cluster(tmp_path, tiny_model_dir, "round_robin") as server, http_client(120) as http:
        url = f"{server.root}/v1/chat/completions"
        ask = {"model": server.model, "messages": [{"role": "user", "content": "A city?"}], "max_tokens": 24,
               "temperature": 0}
        for _ in range(2):  # round robin: each replica compiles it once
            reply = http.post(url, json={**ask, "guided_json": CITY})
            assert reply.status_code == 200, reply.text
            jsonschema.validate(json.loads(reply.json()["choices"][0]["message"]["content"]), CITY)
        over = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}
        refused = http.post(url, json={**ask, "guided_json": over})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "guided_json" and "(structured.max_schema_properties)" in error["message"]
        assert http.get(f"{server.root}/health").json()["status"] == "ok"


def test_a_session_stays_on_its_replica_unless_the_load_is_unbalanced_or_the_replica_left():
    policy = CacheAwarePolicy(cache_threshold=0.5, balance_abs=4)
    session = session_of("tenant-a", "agent-1")
    assert session != session_of(None, "agent-1") and session_of("tenant-a", None) is None
    policy.record("a", keys(1, 2), session=session)
    policy.record("b", keys(5, 6, 7, 8))
    # Its next prompt starts like the one b holds (every agent's tools): the session still goes to a.
    assert policy.choose(keys(5, 6, 7, 8, 9), {"a": 1, "b": 0}, {}, session) == "a"
    assert policy.choose(keys(5, 6, 7, 8, 9), {"a": 1, "b": 0}, {}) == "b"   # without it: the prefix decides
    assert policy.choose([], {"a": 2, "b": 0}, {}, session) == "a"            # no keys (use_cache off): still a
    assert policy.choose(keys(1, 2), {"a": 6, "b": 0}, {}, session) == "b"    # unbalanced: the load wins
    policy.forget({"b", "c"})                                                # a left
    assert not policy.sessions and policy.choose(keys(1, 2), {"b": 0, "c": 0}, {}, session) == "c"  # as a new one
