"""`kvreuse.bench.replay` against a real `kvreuse serve` subprocess (the tiny random-weight model of conftest):
every key present and sane, sequential chat turns reusing the cache, Poisson arrivals, counted failures, and
clear errors for an unreachable server or a run in which nothing succeeds."""

from __future__ import annotations

import socket

import pytest

from kvreuse.bench import replay, workloads

from .helpers import server_args
from .server_process import start_server

MAX_TOKENS = 4
KEYS = {"completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
        "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
        "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms",
        "p99_e2el_ms", "url", "model", "concurrency", "request_rate", "cached_tokens", "exact_hit_rate"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    log = tmp_path_factory.mktemp("server-logs") / "replay.log"
    with start_server(*server_args(tiny_model_dir), log_path=log) as server:
        yield server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_replay_concurrent_reports_every_key(server):
    finished = []
    report = replay.run(server.root, workloads.rag(6), max_tokens=MAX_TOKENS, concurrency=2,
                        progress=finished.append)
    assert KEYS <= report.keys()
    assert report["completed"] == 6 and report["failed"] == 0 and report["first_error"] is None
    assert finished == [1] * 6
    assert report["url"] == server.root and report["model"] == server.model
    assert report["concurrency"] == 2 and report["request_rate"] == "inf"
    assert report["total_output_tokens"] == 6 * MAX_TOKENS  # ignore_eos honoured: every request ran to max_tokens
    assert report["total_input_tokens"] > 6 * 50
    assert report["duration"] > 0
    assert report["request_throughput"] == pytest.approx(6 / report["duration"])
    assert report["total_token_throughput"] > report["output_throughput"] > 0
    for name in ("ttft", "tpot", "e2el"):
        assert 0 < report[f"mean_{name}_ms"] and report[f"median_{name}_ms"] <= report[f"p99_{name}_ms"]
    assert report["mean_e2el_ms"] >= report["mean_ttft_ms"]
    # Every reply streams MAX_TOKENS tokens, so there are gaps between them to measure.
    assert report["mean_itl_ms"] > 0 and report["median_itl_ms"] <= report["p99_itl_ms"]
    assert report["exact_hit_rate"] == pytest.approx(report["cached_tokens"] / report["total_input_tokens"])


def test_sequential_chat_turns_hit_the_cache(server):
    # Each chat turn resends its conversation so far: sent one at a time, later turns reuse earlier KV.
    report = replay.run(server.base_url + "/", workloads.chat(6), max_tokens=MAX_TOKENS, concurrency=1)
    assert report["url"] == server.root  # ".../v1/" normalised to the root
    assert report["completed"] == 6 and report["failed"] == 0
    assert report["cached_tokens"] > 0
    assert report["exact_hit_rate"] == pytest.approx(report["cached_tokens"] / report["total_input_tokens"])
    assert 0 < report["exact_hit_rate"] < 1


def test_sessions_send_each_chat_in_order_and_side_by_side(server):
    conversations = workloads.chat(8, turns=4)  # 2 sessions of 4 turns, listed session after session
    assert replay.sessions_of(conversations) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    order: list[int] = []
    send = replay.send

    async def recording(client, root, model, messages, max_tokens):
        order.append(len(messages))  # 2, 4, 6, 8 messages: the turn number
        return await send(client, root, model, messages, max_tokens)

    replay.send = recording
    try:
        report = replay.run(server.root, conversations, max_tokens=MAX_TOKENS, sessions=True)
    finally:
        replay.send = send
    assert report["completed"] == 8 and report["sessions"] is True
    # The sessions run side by side: both first turns go out before either's second.
    assert order[:2] == [2, 2] and sorted(order) == [2, 2, 4, 4, 6, 6, 8, 8]
    assert report["exact_hit_rate"] > 0.3  # each turn extends the previous one's prompt and reply
    assert report["session_affinity"] is None and report["replicas"] == []  # a single server names no replica


def test_finite_request_rate(server):
    report = replay.run(server.root, workloads.agent(4), model=server.model, max_tokens=MAX_TOKENS,
                        request_rate=50.0, seed=1)
    assert report["completed"] == 4 and report["failed"] == 0
    assert report["request_rate"] == 50.0 and report["concurrency"] is None
    assert report["total_output_tokens"] == 4 * MAX_TOKENS
    assert 0 < report["mean_ttft_ms"] <= report["mean_e2el_ms"]


def test_failed_requests_are_counted(server):
    conversations = workloads.agent(3)
    conversations[1] = [{"role": "narrator", "content": "not a chat role"}]  # refused by the server with 400
    report = replay.run(server.root, conversations, max_tokens=MAX_TOKENS)
    assert report["completed"] == 2 and report["failed"] == 1
    assert report["first_error"].startswith("HTTP 400")
    assert report["total_output_tokens"] == 2 * MAX_TOKENS


def test_nothing_succeeds_names_the_url_and_the_error(server):
    with pytest.raises(RuntimeError, match=rf"{server.root}.*HTTP 404.*no-such-model"):
        replay.run(server.root, workloads.agent(2), model="no-such-model", max_tokens=MAX_TOKENS)


def test_unreachable_server_names_the_url():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RuntimeError, match=rf"cannot reach the server at {url}"):
        replay.run(url + "/v1", workloads.agent(2), max_tokens=MAX_TOKENS)


def test_bench_url_cli_writes_a_report(server, tmp_path):
    import json

    from kvreuse.cli import main

    assert main(["bench", "replay", server.root, "chat", "--requests", "3", "--max-tokens", "2",
                 "--concurrency", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "replay.json").read_text())
    chat = report["scenarios"]["chat"]
    assert chat["completed"] == 3 and chat["failed"] == 0 and chat["total_output_tokens"] == 6
    assert "| chat | 3 | 0 |" in (tmp_path / "replay.md").read_text()


def test_bench_url_cli_names_an_unreachable_server(capsys):
    from kvreuse.cli import main

    url = f"http://127.0.0.1:{free_port()}"
    assert main(["bench", "replay", url, "chat", "--requests", "1"]) == 2
    assert f"cannot reach the server at {url}" in capsys.readouterr().err
