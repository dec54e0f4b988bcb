"""Server policy (issue 12, findings 2, 5, 6 and 9; issue 26, finding 12): what the server refuses before it reads
a body, who may read what (admin routes need an admin key), one tenant's share of the queue, and how requests end
when the drain timeout passes.

The server tests drive a real `kvreuse serve` subprocess (the tiny random-weight model) on 127.0.0.1:
`open_server` runs without API keys, `keyed_server` with two tenants and an admin key (`--admin-api-keys`, tenant
"ops"); both accept bodies up to 1 MB (`server.max_body_mb = 1`) and 3 sequences in flight (`server.max_queue =
3`), 2 per tenant on the keyed one (`server.max_queue_per_tenant = 2`). The drain test starts its own (it exits).
Two tests run the app in-process, for faults no real server can be asked for: an engine step that raises (uvicorn
on a thread), and an ASGI 2.4 server whose `send` raises because the client left before the response started (the
app called directly). Every wait is bounded in time.
"""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress

import httpx
import pytest

from kvreuse.server.admission import Admissions
from kvreuse.server.app import create_app
from kvreuse.server.deltas import Cut

from .helpers import app_server, server_args, tiny_engine
from .server_process import Metrics, Server, http_client, sse_events, start_long_requests
from .test_server import assert_error, assert_serving, serve, wait_idle, wait_running

MB = 1024 * 1024
LIMIT_MB = 1
KEYS = {"alpha": "key-alpha-123", "beta": "key-beta-456", "ops": "key-ops-789"}  # tenant -> key
ADMIN = "ops"  # the tenant of the admin key
PER_TENANT = 2
MAX_QUEUE = 3
IDLE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
LONG = 2000  # completion tokens: several seconds on the tiny model, so a request stays in flight


def auth(tenant: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def policy_sets() -> list[str]:
    return [f"server.max_body_mb={LIMIT_MB}", f"server.max_queue={MAX_QUEUE}",
            f"server.max_queue_per_tenant={PER_TENANT}"]


@pytest.fixture(scope="module")
def open_server(tmp_path_factory, tiny_model_dir):
    with serve(tmp_path_factory, "policy-open", *server_args(tiny_model_dir, *policy_sets())) as server:
        yield server


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory, tiny_model_dir):
    folder = tmp_path_factory.mktemp("policy-keys")
    keys, admin_keys = folder / "api_keys.txt", folder / "admin_keys.txt"
    keys.write_text("".join(f"{key} {tenant}\n" for tenant, key in KEYS.items() if tenant != ADMIN))
    admin_keys.write_text(f"{KEYS[ADMIN]} {ADMIN}\n")
    with serve(tmp_path_factory, "policy-keyed", *server_args(tiny_model_dir, *policy_sets()),
               "--api-keys", str(keys), "--admin-api-keys", str(admin_keys)) as server:
        yield server


@pytest.fixture(scope="module")
def http():
    with http_client(60.0) as client:
        yield client


def completion(server: Server, max_tokens: int = 2, **fields) -> dict:
    return {"model": server.model, "prompt": "Hello", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **fields}


def settle(server: Server) -> None:
    """Wait (bounded) until the engine is idle, scraping /metrics with the admin key, and a moment more: the
    event loop gives a request's place back right after the engine's last delta."""
    with http_client(10.0, headers=auth(ADMIN)) as client:
        def idle(scrape: Metrics) -> bool:
            return all(scrape.get(name, model_name=server.model) == 0 for name in IDLE_GAUGES)

        deadline = time.monotonic() + 30
        while not idle(scrape := server.metrics(client)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert idle(scrape), {name: scrape.get(name, model_name=server.model) for name in IDLE_GAUGES}
    time.sleep(0.5)


def assert_keyed_serving(client: httpx.Client, server: Server, tenant: str = "beta") -> None:
    r = client.post(f"{server.base_url}/completions", json=completion(server), headers=auth(tenant))
    assert r.status_code == 200, r.text


# --- raw HTTP: a request head whose body never comes ------------------------------------------------------
def raw_exchange(server: Server, head: str, body: bytes = b"", timeout: float = 10.0) -> tuple[int, dict]:
    """Send `head` (and `body`) on a fresh socket and read the answer until the server closes it. A server that
    waits for a body it was promised but not sent times out here (socket.timeout) instead of answering."""
    host, port = server.root.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head.encode("latin-1") + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    header_block, _, payload = data.partition(b"\r\n\r\n")
    status = int(header_block.split(b" ", 2)[1])
    return status, json.loads(payload)


def post_head(path: str, content_length: int, headers: dict | None = None) -> str:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
             f"Content-Length: {content_length}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return "\r\n".join(lines) + "\r\n\r\n"


def assert_error_body(body: dict, *needles: str) -> dict:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    for needle in needles:
        assert needle in body["error"]["message"], f"{needle!r} not in {body['error']['message']!r}"
    return body["error"]


# --- finding 2 (the body limit) -------------------------------------------------------------------------
class TestBodyLimit:
    def test_a_declared_body_over_the_limit_gets_413_before_it_is_sent(self, open_server, http):
        status, body = raw_exchange(open_server, post_head("/v1/completions", 200 * MB))
        assert status == 413, body
        error = assert_error_body(body, f"{200 * MB} bytes", f"{LIMIT_MB} MB", "server.max_body_mb")
        assert error["type"] == "invalid_request_error"
        assert_serving(http, open_server)

    @pytest.mark.parametrize("padding_mb", [LIMIT_MB, 64], ids=["just-over", "64MB"])
    def test_a_body_over_the_limit_from_httpx_gets_413(self, open_server, http, padding_mb):
        payload = json.dumps(completion(open_server)).encode() + b" " * padding_mb * MB  # JSON allows the padding
        r = http.post(f"{open_server.base_url}/completions", content=payload,
                      headers={"content-type": "application/json"})
        assert_error(r, 413, "server.max_body_mb", f"{LIMIT_MB} MB")
        assert_serving(http, open_server)

    def test_a_chunked_body_is_counted_as_it_streams_and_stopped_at_the_limit(self, open_server, http):
        sent = []

        def body() -> Iterator[bytes]:  # no Content-Length: httpx sends it chunked
            for _ in range(1024):       # up to 64 MB, far more than the server should read
                sent.append(64 * 1024)
                yield b" " * (64 * 1024)

        r = http.post(f"{open_server.base_url}/completions", content=body(),
                      headers={"content-type": "application/json"})
        assert "content-length" not in r.request.headers
        assert_error(r, 413, "server.max_body_mb", f"{LIMIT_MB} MB")
        # The server stopped reading at the limit: the rest was never asked for (socket buffers aside).
        assert sum(sent) < 24 * MB, f"the client could send {sum(sent)} bytes"
        assert_serving(http, open_server)

    @pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
    def test_a_body_under_the_limit_is_served(self, open_server, http, chunked):
        payload = json.dumps(completion(open_server)).encode() + b" " * (LIMIT_MB * MB - 4096)
        content = iter([payload[:len(payload) // 2], payload[len(payload) // 2:]]) if chunked else payload
        r = http.post(f"{open_server.base_url}/completions", content=content,
                      headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2


# --- finding 5: with API keys, everything but /health needs a key, and the key is checked before the body ----
PROTECTED_GETS = ["/metrics", "/docs", "/redoc", "/openapi.json"]
# --- issue 26, finding 12: what acts on or shows every tenant's state needs an admin key ----------------------
ADMIN_ROUTES = [("GET", "/metrics"), ("GET", "/cache/stats"), ("POST", "/reset_prefix_cache"),
                ("POST", "/reset_prefix_cache?tiers=true")]


class TestWhoMayReadWhat:
    @pytest.mark.parametrize("path", PROTECTED_GETS)
    def test_with_keys_metrics_and_docs_need_a_valid_key(self, keyed_server, http, path):
        url = f"{keyed_server.root}{path}"
        for headers in ({}, {"Authorization": "Bearer wrong-key"}):
            error = assert_error(http.get(url, headers=headers), 401, "API key")
            assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
        assert http.get(url, headers=auth(ADMIN)).status_code == 200
        if path != "/metrics":
            assert http.get(url, headers=auth("alpha")).status_code == 200

    @pytest.mark.parametrize("method, path", ADMIN_ROUTES, ids=[f"{m} {p}" for m, p in ADMIN_ROUTES])
    def test_a_tenant_key_gets_403_on_the_admin_routes_and_an_admin_key_200(self, keyed_server, http, method, path):
        url = f"{keyed_server.root}{path}"
        route = f"{method} {path.split('?')[0]}"
        for tenant in ("alpha", "beta"):
            error = assert_error(http.request(method, url, headers=auth(tenant)), 403, route, "admin API key",
                                 "--admin-api-keys", "server.admin_api_keys_file")
            assert error["type"] == "permission_error" and error["code"] == "admin_key_required"
        assert_error(http.request(method, url), 401, "API key")
        r = http.request(method, url, headers=auth(ADMIN))
        assert r.status_code == 200, r.text

    def test_a_tenant_cannot_watch_another_tenants_prompt_tokens_in_metrics(self, keyed_server, http):
        # The audit's leak: beta scraped /metrics and read exactly alpha's 124 prompt tokens.
        server = keyed_server
        settle(server)
        with http_client(10.0, headers=auth(ADMIN)) as admin:
            before = server.metrics(admin).get_or_zero("vllm:prompt_tokens_total")
            r = http.post(f"{server.base_url}/completions", json=completion(server, prompt="tok " * 120),
                          headers=auth("alpha"))
            assert r.status_code == 200, r.text
            assert_error(http.get(f"{server.root}/metrics", headers=auth("beta")), 403, "GET /metrics")
            settle(server)
            after = server.metrics(admin).get("vllm:prompt_tokens_total")
        assert after - before == r.json()["usage"]["prompt_tokens"]  # the admin sees it; the tenant did not

    def test_with_keys_health_stays_open(self, keyed_server, http):
        r = http.get(f"{keyed_server.root}/health")
        assert r.status_code == 200 and r.json()["status"] == "ok"
        assert set(r.json()) <= {"status", "compile"}, r.json()  # liveness and the decode step's state, nothing more

    @pytest.mark.parametrize("path", PROTECTED_GETS + ["/health"])
    def test_without_keys_everything_stays_open(self, open_server, http, path):
        assert http.get(f"{open_server.root}{path}").status_code == 200

    def test_an_unauthenticated_caller_gets_401_before_its_body_is_read(self, keyed_server, http):
        url = f"{keyed_server.base_url}/completions"
        malformed = b'{"model": "m", "prompt": "hi",'
        assert_error(http.post(url, content=malformed, headers={"content-type": "application/json"}), 401,
                     "API key")
        # A promised 200 MB body is never waited for: no key, 401; a valid key, 413.
        status, body = raw_exchange(keyed_server, post_head("/v1/completions", 200 * MB))
        assert status == 401 and assert_error_body(body, "API key")["type"] == "authentication_error"
        status, body = raw_exchange(keyed_server, post_head("/v1/completions", 200 * MB, auth("alpha")))
        assert status == 413, body
        assert_error_body(body, "server.max_body_mb")
        assert_keyed_serving(http, keyed_server)


# --- finding 6: one tenant cannot take the whole queue; no ending leaks a slot ---------------------------------
@contextmanager
def held_streams(server: Server, tenant: str, count: int) -> Iterator[list[httpx.Response]]:
    """`count` long streams of `tenant`, each admitted (200) and left unread until the block exits (which
    disconnects them)."""
    with ExitStack() as stack:
        client = stack.enter_context(http_client(30.0))
        responses = []
        for i in range(count):
            body = completion(server, LONG, prompt=f"Held stream {i} of {tenant}:", stream=True)
            r = stack.enter_context(client.stream("POST", f"{server.base_url}/completions", json=body,
                                                  headers=auth(tenant)))
            assert r.status_code == 200, r.read()
            responses.append(r)
        yield responses


def refused_by_tenant_limit(r: httpx.Response, tenant: str) -> None:
    error = assert_error(r, 429, f"server.max_queue_per_tenant = {PER_TENANT}", repr(tenant))
    assert error["type"] == "rate_limit_error" and r.headers.get("retry-after") == "1"


def disconnect_before_the_answer(server: Server, tenant: str, stream: bool) -> None:
    """Send a whole request and hang up at once, before any byte of the answer."""
    payload = json.dumps(completion(server, 300, prompt="Gone at once:", stream=stream)).encode()
    host, port = server.root.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10.0) as sock:
        sock.sendall(post_head("/v1/completions", len(payload), auth(tenant)).encode() + payload)


class TestTenantQueue:
    def test_a_tenant_at_its_limit_gets_429_naming_it_while_others_are_served(self, keyed_server, http):
        server = keyed_server
        with held_streams(server, "alpha", PER_TENANT):
            refused_by_tenant_limit(http.post(f"{server.base_url}/completions", json=completion(server),
                                              headers=auth("alpha")), "alpha")
            assert_keyed_serving(http, server, "beta")  # alpha holds 2 of the 3 places, beta gets the third
            with held_streams(server, "beta", 1):        # and now the whole server is full
                r = http.post(f"{server.base_url}/completions", json=completion(server), headers=auth("beta"))
                error = assert_error(r, 429, f"server.max_queue = {MAX_QUEUE}")
                assert "max_queue_per_tenant" not in error["message"]
        settle(server)
        assert_keyed_serving(http, server, "alpha")

    def test_every_ending_gives_the_slot_back_exactly_once(self, keyed_server, http):
        server, url = keyed_server, f"{keyed_server.base_url}/completions"
        for _ in range(3):  # finished, plain and streamed
            assert http.post(url, json=completion(server, 4), headers=auth("alpha")).status_code == 200
            with http.stream("POST", url, json=completion(server, 4, stream=True), headers=auth("alpha")) as r:
                assert r.status_code == 200 and list(sse_events(r))[-1] == "[DONE]"
        for _ in range(3):  # streams the client closes after a few events
            with http.stream("POST", url, json=completion(server, LONG, stream=True), headers=auth("alpha")) as r:
                assert r.status_code == 200
                next(iter(r.iter_lines()))
        for _ in range(2):  # plain requests whose client gives up
            with http_client(httpx.Timeout(10.0, read=0.5)) as impatient, pytest.raises(httpx.ReadTimeout):
                impatient.post(url, json=completion(server, LONG), headers=auth("alpha"))
        for stream in (False, True, False, True):  # clients gone before the answer started
            disconnect_before_the_answer(server, "alpha", stream)
        settle(server)  # the share is checked before the body is prepared: a 400 needs a free place, then none
        assert_error(http.post(url, json=completion(server, max_tokens=0), headers=auth("alpha")), 400)
        settle(server)
        with held_streams(server, "alpha", PER_TENANT):  # refusals take no slot either
            for _ in range(3):
                refused_by_tenant_limit(http.post(url, json=completion(server), headers=auth("alpha")), "alpha")
        settle(server)
        # Exactly PER_TENANT places again: one leaked slot would refuse the last stream, one released twice
        # would admit a third.
        with held_streams(server, "alpha", PER_TENANT):
            refused_by_tenant_limit(http.post(url, json=completion(server), headers=auth("alpha")), "alpha")

    def test_without_keys_only_the_server_limit_applies(self, open_server, http):
        server = open_server
        with ExitStack() as stack:
            client = stack.enter_context(http_client(30.0))
            for i in range(MAX_QUEUE):  # more than max_queue_per_tenant: no keys, no tenant
                body = completion(server, LONG, prompt=f"Open stream {i}:", stream=True)
                r = stack.enter_context(client.stream("POST", f"{server.base_url}/completions", json=body))
                assert r.status_code == 200, r.read()
            r = http.post(f"{server.base_url}/completions", json=completion(server))
            error = assert_error(r, 429, f"server.max_queue = {MAX_QUEUE}")
            assert "max_queue_per_tenant" not in error["message"]
        wait_idle(server)
        assert_serving(http, server)


def test_admissions_count_per_tenant_and_release_once():
    async def scenario():
        admissions = Admissions()
        a1, a2 = admissions.add("r1", "alpha", asyncio.Queue()), admissions.add("r2", "alpha", asyncio.Queue())
        b = admissions.add("r3", None, asyncio.Queue())
        assert (admissions.in_flight("alpha"), admissions.in_flight(None), len(admissions)) == (2, 1, 3)
        admissions.release(a1)
        admissions.release(a1)  # a second release of the same request changes nothing
        assert (admissions.in_flight("alpha"), len(admissions)) == (1, 2)
        aborted = []
        assert admissions.cut_all(aborted.append) == 2
        assert sorted(aborted) == ["r2", "r3"] and a2.cut and b.cut and not a1.cut and admissions.closed
        assert isinstance(a2.deltas.get_nowait(), Cut)  # its consumer wakes up at once
        for admission in (a2, b):
            admissions.release(admission)
        assert len(admissions) == 0 and admissions.in_flight("alpha") == 0

    asyncio.run(scenario())


# --- the engine fails a step: the slot comes back too (in-process: a fault only a test hook can cause) -------
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_failed_engine_step_gives_the_tenant_its_slot_back(tiny_model_dir, monkeypatch, stream):
    engine = tiny_engine(tiny_model_dir)
    real_step, calls = engine.step, []

    def step_failing_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected fault in a step")
        return real_step()

    monkeypatch.setattr(engine, "step", step_failing_once)
    with app_server(engine, {key: tenant for tenant, key in KEYS.items()}) as (app, root):
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "stream": stream}
        with http_client(30.0) as client, client.stream("POST", f"{root}/v1/completions", json=body,
                                                        headers=auth("alpha")) as r:
            r.read()
        if stream and r.status_code == 200:
            events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
            assert any("error" in json.loads(e) for e in events if e != "[DONE]"), r.text
        else:
            assert r.status_code >= 500
            assert_error_body(r.json())
        admissions = app.state.kvreuse.admissions
        deadline = time.monotonic() + 5
        while len(admissions) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert calls, "the engine never stepped"
        assert admissions.in_flight("alpha") == 0 and len(admissions) == 0


def asgi_scope(path: str, payload: bytes, headers: dict) -> dict:
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
           *((k.lower().encode(), v.encode()) for k, v in headers.items())]
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "headers": raw, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "state": {}}


def test_a_stream_whose_client_left_before_its_first_byte_gives_its_place_back_and_stops(tiny_model_dir):
    # An ASGI 2.4 server's `send` raises OSError once the client is gone; gone before the response starts, the
    # SSE body iterator (and with it `stream`, which aborts a request whose client left) never runs at all.
    # Called as ASGI here: uvicorn 0.54 speaks ASGI 2.3 and never raises, so a real server cannot show it yet.
    engine = tiny_engine(tiny_model_dir)
    app = create_app(engine, "tiny", {key: tenant for tenant, key in KEYS.items()})
    payload = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": LONG, "ignore_eos": True,
                          "stream": True}).encode()
    statuses = []

    async def scenario():
        messages = iter([{"type": "http.request", "body": payload, "more_body": False}])
        left = asyncio.Event()  # the client leaves as the response starts: after its request was admitted

        async def receive():
            message = next(messages, None)
            if message is None:
                await left.wait()
                message = {"type": "http.disconnect"}
            return message

        async def send(message):
            if message["type"] == "http.response.start":
                statuses.append(message["status"])
                left.set()
                if message["status"] == 200:
                    raise OSError("the client is gone")

        loop = asyncio.get_running_loop()
        async with app.router.lifespan_context(app):
            with suppress(Exception):  # Starlette turns the OSError into ClientDisconnect
                await app(asgi_scope("/v1/completions", payload, auth("alpha")), receive, send)
            assert statuses == [200], statuses  # admitted, then gone
            state = app.state.kvreuse
            assert state.admissions.in_flight("alpha") == 0 and len(state.admissions) == 0
            deadline = loop.time() + 3  # generating all LONG tokens would take several seconds
            while state.engine.num_in_flight and loop.time() < deadline:
                await asyncio.sleep(0.05)
            assert state.engine.num_in_flight == 0, "the engine kept generating for a client that was gone"

    asyncio.run(scenario())


# --- finding 9: past server.drain_timeout_s, unfinished requests end with a clean error ----------------------
def test_past_the_drain_timeout_unfinished_requests_get_503_or_an_error_event_and_done(tmp_path_factory,
                                                                                      tiny_model_dir):
    with serve(tmp_path_factory, "drain-cut", *server_args(tiny_model_dir, "server.drain_timeout_s=1")) as server:
        results, workers = start_long_requests(server, LONG, 60.0, lambda r: list(sse_events(r)))
        wait_running(server, 2)
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        for worker in workers:
            worker.join(30)
            assert not worker.is_alive(), "a request was neither finished nor cut"
        assert server.process.wait(30) == 0, server.log_tail()
        assert time.monotonic() - signalled < 15, "the server took far longer than its drain timeout"

        response = results["plain"]
        assert not isinstance(response, Exception), f"{response!r}\n{server.log_tail()}"
        error = assert_error(response, 503, "shutting down", "server.drain_timeout_s")
        assert error["type"] == "service_unavailable"

        assert not isinstance(results["streamed"], Exception), f"{results['streamed']!r}\n{server.log_tail()}"
        status, events = results["streamed"]
        assert status == 200 and events[-1] == "[DONE]" and events.count("[DONE]") == 1, events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert all("error" not in c for c in chunks[:-1]) and len(chunks) > 1, "tokens streamed before the cut"
        assert_error_body(chunks[-1], "shutting down", "server.drain_timeout_s")
        assert chunks[-1]["error"]["type"] == "service_unavailable"
