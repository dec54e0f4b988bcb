"""One tenant's flood does not hold up another tenant (issue 26, findings 7, 10 and 11).

Against a real `kvreuse serve` subprocess (the tiny random-weight model) on 127.0.0.1 with two tenants, alpha and
beta, and an admin key (which the tests use to read /metrics). Alpha floods the server three ways, as the audit did:
four large JSON schemas to compile (finding 7), 150 prompts too long for the context, refused with 400 after
tokenizing (finding 10), and one request of 64 prompts x n=16 (finding 11). Meanwhile beta asks for one token,
through the openai SDK. Each test first measures, with the same client and an idle server, beta's latency (the
median of IDLE_RUNS) and the time of one engine step with the batch full (from beta's own requests of
max_num_seqs sequences, of 1 and 1 + STEP_TOKENS tokens), and then holds beta, under the flood, to

    BOUND = 2 x beta's idle latency + max_num_seqs x one step

(max_num_seqs: the most sequences that can be running when beta arrives, one step each). Before the fix beta waited
behind the whole flood: for the grammars, behind alpha's compiles on both preparation threads; for the long prompts,
behind their tokenizing; for the 64 x 16, behind 1024 sequences. Each test also checks that alpha's flood was still
in progress when beta's answer came (so beta was measured under it), then hangs up on the flood, which the server
drops (queued preparations never start; admitted requests are aborted).

The in-process tests drive the app on a thread (tests/helpers.app_server) to block a preparation job on an event:
no timing, only what the server does while one tenant's jobs hold their threads.
"""

from __future__ import annotations

import json
import select
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest

from .helpers import app_server, server_args, tiny_engine
from .server_process import Server, http_client
from .test_server import serve

KEYS = {"alpha": "key-alpha-123", "beta": "key-beta-456"}  # tenant -> key
ADMIN_KEY = "key-ops-789"
MAX_NUM_SEQS = 32
PER_TENANT = 1100         # sequences: room for alpha's 64 x 16 = 1024
IDLE_RUNS = 5
STEP_TOKENS = 16
FLOOD_RUNS = 3            # beta's requests under the flood, one after the other; each is held to the bound


def auth(tenant: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("fairness-keys")
    keys, admin = folder / "keys.txt", folder / "admin.txt"
    keys.write_text("".join(f"{key} {tenant}\n" for tenant, key in KEYS.items()))
    admin.write_text(f"{ADMIN_KEY} ops\n")
    sets = [f"engine.max_num_seqs={MAX_NUM_SEQS}", f"server.max_queue_per_tenant={PER_TENANT}",
            f"server.max_queue={2 * PER_TENANT}"]
    with serve(tmp_path_factory, "fairness", *server_args(tiny_model_dir, *sets), "--api-keys", str(keys),
               "--admin-api-keys", str(admin)) as running:
        yield running


@pytest.fixture(scope="module")
def beta(server) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=server.base_url, api_key=KEYS["beta"], max_retries=0, timeout=120.0,
                           http_client=openai.DefaultHttpxClient(trust_env=False))
    yield client
    client.close()


# --- beta's latency and the bound -------------------------------------------------------------------------------
def beta_latency(beta: openai.OpenAI, server: Server, max_tokens: int = 1) -> float:
    """Seconds for one completion of beta's of exactly `max_tokens` tokens."""
    start = time.perf_counter()
    done = beta.completions.create(model=server.model, prompt="Beta asks one thing:", max_tokens=max_tokens,
                                   temperature=0, extra_body={"ignore_eos": True})
    elapsed = time.perf_counter() - start
    assert done.usage.completion_tokens == max_tokens
    return elapsed


@contextmanager
def admin_http() -> Iterator[httpx.Client]:
    with http_client(10.0, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as client:
        yield client


def batch_latency(beta: openai.OpenAI, server: Server, max_tokens: int) -> float:
    """Seconds for a full batch of beta's: 2 prompts x n=16 = MAX_NUM_SEQS sequences of `max_tokens` tokens each,
    greedy, as alpha's 64 x 16 flood is."""
    start = time.perf_counter()
    done = beta.completions.create(model=server.model, prompt=["Beta batch one:", "Beta batch two:"], n=16,
                                   max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
    elapsed = time.perf_counter() - start
    assert done.usage.completion_tokens == MAX_NUM_SEQS * max_tokens
    return elapsed


def measure_bound(beta: openai.OpenAI, server: Server) -> tuple[float, float, float]:
    """(idle latency, one step of a full batch, bound) measured now, on the idle server."""
    beta_latency(beta, server)  # warm: the first request of a test pays for what later ones find ready
    idle = statistics.median(beta_latency(beta, server) for _ in range(IDLE_RUNS))
    short = statistics.median(batch_latency(beta, server, 1) for _ in range(3))
    long = statistics.median(batch_latency(beta, server, 1 + STEP_TOKENS) for _ in range(3))
    step = max(long - short, 0.0) / STEP_TOKENS
    return idle, step, 2 * idle + MAX_NUM_SEQS * step


def beta_under_flood(beta: openai.OpenAI, server: Server, flood: list[socket.socket]) -> tuple[list[float], bool]:
    """Beta's latencies of FLOOD_RUNS one-token requests, and whether some of alpha's flood was unanswered after
    them (so that they were measured under it)."""
    latencies = [beta_latency(beta, server) for _ in range(FLOOD_RUNS)]
    return latencies, any(not select.select([sock], [], [], 0)[0] for sock in flood)


def assert_within(measured: tuple[list[float], bool], idle: float, step: float, bound: float, what: str) -> None:
    latencies, under_flood = measured
    report = (f"beta under {what}: {[round(x * 1000) for x in latencies]} ms; idle {idle * 1000:.0f} ms, step "
              f"{step * 1000:.1f} ms, bound 2 x {idle * 1000:.0f} + {MAX_NUM_SEQS} x {step * 1000:.1f} = "
              f"{bound * 1000:.0f} ms")
    print(report)
    assert max(latencies) <= bound, report
    assert under_flood, f"alpha's flood was over before beta's requests were: nothing was measured under it; {report}"


# --- alpha's flood, on raw sockets: each request sent whole before beta's first -------------------------------
def send(root: str, path: str, body: dict, tenant: str = "alpha") -> socket.socket:
    """POST `body` on a connection of its own, sent whole; the answer is left unread (Connection: close)."""
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nAuthorization: Bearer {KEYS[tenant]}\r\nConnection: close\r\n\r\n")
    host, port = root.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=120.0)
    sock.sendall(head.encode() + payload)
    return sock


def status_of(sock: socket.socket) -> int:
    """The status of the answer on `sock`, read to its end."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    return int(data.split(b" ", 2)[1])


def hang_up(flood: list[socket.socket], server: Server) -> None:
    """Close the flood's connections, then wait (bounded) until alpha is served again and the engine is idle: the
    server drops alpha's queued preparations and aborts its admitted requests."""
    for sock in flood:
        sock.close()
    with http_client(120.0) as client:  # alpha's jobs run in its order: this one comes after what is left of them
        r = client.post(f"{server.base_url}/completions", headers=auth("alpha"),
                        json={"model": server.model, "prompt": "Alpha again:", "max_tokens": 1})
        assert r.status_code == 200, r.text
    wait_until_idle(server)


def gauge(server: Server, admin: httpx.Client, name: str) -> float:
    return server.metrics(admin).get(name, model_name=server.model)


def wait_until_idle(server: Server, timeout: float = 60.0) -> None:
    """Nothing running or waiting in the engine (bounded), read with the admin key."""
    with admin_http() as admin:
        deadline = time.monotonic() + timeout
        while (gauge(server, admin, "vllm:num_requests_running") or gauge(server, admin, "vllm:num_requests_waiting")):
            assert time.monotonic() < deadline, "the engine did not go idle"
            time.sleep(0.05)


def large_schema(tag: int, width: int = 60) -> dict:
    """A JSON schema that takes xgrammar a second or so: `width` required string properties, each a pattern."""
    properties = {f"field_{tag}_{i}": {"type": "string", "pattern": f"[a-z]{{{i % 7 + 1},{i % 9 + 9}}}"}
                  for i in range(width)}
    return {"type": "object", "properties": properties, "required": list(properties)}


# --- finding 7: a grammar flood --------------------------------------------------------------------------------
def test_under_a_grammar_flood_from_one_tenant_another_tenants_request_keeps_its_latency(server, beta):
    idle, step, bound = measure_bound(beta, server)
    flood = [send(server.root, "/v1/chat/completions", {
        "model": server.model, "max_tokens": 4, "messages": [{"role": "user", "content": f"Form {i}"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": f"form{i}", "schema": large_schema(i)}}})
        for i in range(4)]
    measured = beta_under_flood(beta, server, flood)
    hang_up(flood, server)
    assert_within(measured, idle, step, bound, "4 large schemas of alpha's")


# --- finding 10: oversized prompts -----------------------------------------------------------------------------
def test_oversized_prompts_from_one_tenant_do_not_delay_another_beyond_the_bound(server, beta):
    idle, step, bound = measure_bound(beta, server)
    # Under the character pre-check (81 characters a token at most), far over the context once tokenized: 400.
    text = "harbour " * (80 * 2048 // 8)
    flood = [send(server.root, "/v1/completions", {"model": server.model, "prompt": f"{i} {text}", "max_tokens": 1})
             for i in range(150)]
    measured = beta_under_flood(beta, server, flood)
    answered = [sock for sock in flood if select.select([sock], [], [], 0)[0]]
    statuses = {status_of(sock) for sock in answered}
    hang_up([sock for sock in flood if sock not in answered], server)
    assert_within(measured, idle, step, bound, "150 oversized prompts of alpha's")
    assert statuses == {400}, statuses  # those answered were refused, as the audit's were


# --- finding 11: sequences, not prompts ------------------------------------------------------------------------
def test_under_a_64x16_flood_from_one_tenant_another_tenants_request_keeps_its_latency(server, beta):
    idle, step, bound = measure_bound(beta, server)
    flood = [send(server.root, "/v1/completions", {
        "model": server.model, "prompt": [f"Story {i}:" for i in range(64)], "n": 16, "max_tokens": 8,
        "temperature": 0, "ignore_eos": True})]
    with admin_http() as admin:  # the flood is in the engine, the batch full and the rest of its prompts queued
        deadline = time.monotonic() + 30
        while gauge(server, admin, "vllm:num_requests_waiting") == 0:
            assert time.monotonic() < deadline, "alpha's flood never reached the engine's queue"
            time.sleep(0.02)
    measured = beta_under_flood(beta, server, flood)
    hang_up(flood, server)
    assert_within(measured, idle, step, bound, "64 prompts x n=16 of alpha's")


# --- in-process: the preparation threads, held on an event -----------------------------------------------------
@contextmanager
def held_preparation(tiny_model_dir: str, monkeypatch, keys: bool = True
                     ) -> Iterator[tuple[object, str, threading.Event, list]]:
    """The app on a thread (with KEYS, or without keys), whose preparation of any prompt starting "hold" waits until
    the yielded event is set; yields (app, root, event, the prompts prepared)."""
    engine = tiny_engine(tiny_model_dir)
    release, prepared = threading.Event(), []
    make_sequence = engine.front_end.make_sequence

    def holding(prompt, *args, **kwargs):
        text = engine.front_end.tokenizer.decode(prompt) if isinstance(prompt, list) else prompt
        prepared.append(text)
        if text.startswith("hold"):
            assert release.wait(30), "the test never released the held preparation"
        return make_sequence(prompt, *args, **kwargs)

    monkeypatch.setattr(engine.front_end, "make_sequence", holding)
    with app_server(engine, {key: tenant for tenant, key in KEYS.items()} if keys else None) as (app, root):
        try:
            yield app, root, release, prepared
        finally:
            release.set()  # before the server stops: it waits for its preparation threads


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def post_in_thread(root: str, tenant: str | None, prompt: str, results: dict, **fields) -> threading.Thread:
    def post():
        with http_client(60.0) as client:
            results[prompt] = client.post(f"{root}/v1/completions", headers=auth(tenant) if tenant else {},
                                          json={"model": "tiny", "prompt": prompt, "max_tokens": 1, **fields})

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    return thread


def test_one_tenant_holding_its_preparation_thread_leaves_the_other_to_another_tenant(tiny_model_dir, monkeypatch):
    with held_preparation(tiny_model_dir, monkeypatch) as (app, root, release, prepared):
        results: dict = {}
        # Alpha's two held jobs: before, they took both preparation threads, and beta's request waited for them.
        holders = [post_in_thread(root, "alpha", f"hold {i}", results) for i in range(2)]
        wait_until(lambda: len(prepared) == 1 and app.state.kvreuse.preparation.num_waiting("alpha") == 1)
        post_in_thread(root, "beta", "Beta meanwhile", results).join(30)
        assert results["Beta meanwhile"].status_code == 200, "beta waited for alpha's held preparations"
        assert prepared[0] in ("hold 0", "hold 1") and prepared[1:] == ["Beta meanwhile"]
        release.set()
        for thread in holders:
            thread.join(30)
        assert [results[f"hold {i}"].status_code for i in range(2)] == [200, 200]


def test_a_queued_preparation_whose_client_left_never_starts_and_gives_its_places_back(tiny_model_dir,
                                                                                       monkeypatch):
    with held_preparation(tiny_model_dir, monkeypatch) as (app, root, release, prepared):
        state, results = app.state.kvreuse, {}
        holder = post_in_thread(root, "alpha", "hold", results)
        wait_until(lambda: prepared == ["hold"])
        gone = send(root, "/v1/completions", {"model": "tiny", "prompt": "gone before its turn", "max_tokens": 1,
                                              "n": 3})
        wait_until(lambda: state.preparation.num_waiting("alpha") == 1)
        assert state.admissions.in_flight("alpha") == 1 + 3   # places reserved before preparing: 1 + 1 x n=3
        gone.close()
        wait_until(lambda: state.preparation.num_waiting("alpha") == 0)  # dropped from the line, not started
        assert state.admissions.in_flight("alpha") == 1
        release.set()
        holder.join(30)
        assert results["hold"].status_code == 200
        assert prepared == ["hold"]                           # "gone before its turn" was never tokenized
        wait_until(lambda: len(state.admissions) == 0)


# --- finding 11: sequences count toward the share ---------------------------------------------------------------
def test_sequences_not_prompts_count_toward_the_tenants_share(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir, server__max_queue_per_tenant=4, server__max_queue=8)
    with app_server(engine, {key: tenant for tenant, key in KEYS.items()}) as (_, root), http_client(60.0) as client:
        url = f"{root}/v1/completions"
        body = {"model": "tiny", "prompt": "Held:", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with client.stream("POST", url, json={**body, "n": 2}, headers=auth("alpha")) as held:
            assert held.status_code == 200  # two of alpha's four places, in one request
            r = client.post(url, json={"model": "tiny", "prompt": ["a", "b"], "n": 2, "max_tokens": 1},
                            headers=auth("alpha"))
            # Before: one request in flight of four allowed, so this was admitted with its four sequences.
            assert r.status_code == 429, r.text
            message = r.json()["error"]["message"]
            for needle in ("tenant 'alpha' has 2 sequences in flight", "needs 4 more",
                           "server.max_queue_per_tenant = 4 sequences"):
                assert needle in message, message
            ok = client.post(url, json={"model": "tiny", "prompt": ["a", "b"], "max_tokens": 1}, headers=auth("alpha"))
            assert ok.status_code == 200, ok.text      # two more sequences fit exactly
            other = client.post(url, json={"model": "tiny", "prompt": "b", "n": 4, "max_tokens": 1},
                                headers=auth("beta"))
            assert other.status_code == 200, other.text  # beta's own share
        too_large = client.post(url, json={"model": "tiny", "prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1},
                                headers=auth("beta"))
        assert too_large.status_code == 400, too_large.text  # 6 sequences never fit a share of 4: not a retry
        error = too_large.json()["error"]
        assert error["code"] == "too_many_sequences" and "server.max_queue_per_tenant = 4" in error["message"]


def test_without_keys_requests_that_may_compile_leave_a_thread_to_plain_ones(tiny_model_dir, monkeypatch):
    """Without API keys every request is one tenant's, so two held format requests took both threads and a plain
    request waited behind them (12 compile bombs held a 1-token request for 32 s). Jobs that may compile a grammar
    now hold at most all threads but one."""
    with held_preparation(tiny_model_dir, monkeypatch, keys=False) as (app, root, release, prepared):
        results: dict = {}
        json_object = {"response_format": {"type": "json_object"}}
        holders = [post_in_thread(root, None, f"hold {i}", results, **json_object) for i in range(2)]
        wait_until(lambda: len(prepared) == 1 and app.state.kvreuse.preparation.num_waiting(None) == 1)
        post_in_thread(root, None, "Plain meanwhile", results).join(30)
        assert results["Plain meanwhile"].status_code == 200, "a plain request waited for the held formats"
        assert prepared[0] in ("hold 0", "hold 1") and prepared[1:] == ["Plain meanwhile"]
        release.set()
        for thread in holders:
            thread.join(30)
        assert [results[f"hold {i}"].status_code for i in range(2)] == [200, 200]
