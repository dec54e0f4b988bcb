"""`kvreuse bench replay URL --trace FILE` (kvreuse.bench.live_trace) against a real `kvreuse serve` subprocess (the
tiny random-weight model of conftest): token-id prompts whose shared hash ids are served from the cache block for
block, arrivals never early, max_tokens from output_length with ignore_eos, late arrivals counted, the CLI's table,
and clear errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvreuse.bench import live_trace
from kvreuse.bench.trace import TraceRequest, write_trace
from kvreuse.bench.vocab_prompts import FIRST_ORDINARY_ID, SMOLLM2_VOCAB_SIZE, hash_block, vocab_prompt
from kvreuse.cli import main

from .helpers import server_args
from .server_process import REPO_ROOT, start_server

BLOCK = 16  # the server's cache.block_size (the default), and tokens per hash id here, so that one id is one block
# Request 2 shares request 1's first three hash ids, then has two of its own (the last one partial); request 3
# shares nothing. 300 ms apart at time scale 1.
TRACE = [TraceRequest(0, 4 * BLOCK, 5, (0, 1, 2, 3)),
         TraceRequest(300, 4 * BLOCK + 6, 3, (0, 1, 2, 9, 10)),
         TraceRequest(600, BLOCK + 4, 2, (20, 21))]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    log = tmp_path_factory.mktemp("server-logs") / "live-trace.log"
    with start_server(*server_args(tiny_model_dir, f"cache.block_size={BLOCK}"), log_path=log) as server:
        yield server


def replay(server, requests, **options) -> dict:
    options = {"tokens_per_hash": BLOCK, "hash_block_tokens": BLOCK, **options}
    return live_trace.run(server.root, requests, **options)


def test_hash_ids_become_equal_blocks_of_ordinary_vocabulary_ids():
    prompts = [vocab_prompt(r, BLOCK, hash_block_tokens=BLOCK) for r in TRACE]
    assert [len(p) for p in prompts] == [64, 70, 20]
    assert prompts[0][:3 * BLOCK] == prompts[1][:3 * BLOCK]  # equal hash ids, equal blocks
    assert prompts[0][3 * BLOCK:] != prompts[1][3 * BLOCK:4 * BLOCK]
    assert all(FIRST_ORDINARY_ID <= t < SMOLLM2_VOCAB_SIZE for p in prompts for t in p)
    assert hash_block(5, 8, 1000, seed=1) != hash_block(5, 8, 1000, seed=0)


def test_shared_hash_ids_are_served_from_the_cache(server):
    report = replay(server, TRACE, time_scale=1.0, max_output_tokens=4)
    assert report["completed"] == 3 and report["failed"] == 0
    rows = report["per_request"]
    assert [r["prompt_tokens"] for r in rows] == [64, 70, 20]
    # Request 2 hits exactly request 1's three shared full blocks; request 3's own ids hit nothing.
    assert [r["cached_tokens"] for r in rows] == [0, 3 * BLOCK, 0]
    assert report["exact_hit_rate"] == pytest.approx(3 * BLOCK / (64 + 70 + 20))
    # max_tokens is output_length capped at 4, and ignore_eos makes every request run to it.
    assert [r["max_tokens"] for r in rows] == [4, 3, 2] and report["capped_outputs"] == 1
    assert [r["output_tokens"] for r in rows] == [4, 3, 2]
    # Arrivals at the trace's times, measured on the client: never early.
    assert [r["scheduled_ms"] for r in rows] == pytest.approx([0, 300, 600])
    assert all(r["sent_ms"] >= r["scheduled_ms"] for r in rows)
    assert report["late_arrivals"] == 0 and report["replicas"] == {}
    assert report["p50_ttft_ms"] <= report["p90_ttft_ms"] <= report["p99_ttft_ms"]


def test_a_compressed_time_scale_and_a_concurrency_cap_make_arrivals_late(server):
    spaced = [TraceRequest(1000 * i, BLOCK + 1, 4, (100 + i, 200 + i)) for i in range(3)]
    fast = replay(server, spaced, time_scale=0.05)  # gaps of 50 ms
    assert [r["scheduled_ms"] for r in fast["per_request"]] == pytest.approx([0, 50, 100])
    assert all(r["sent_ms"] >= r["scheduled_ms"] for r in fast["per_request"])
    # All due at once, one at a time: the second and third wait for the whole of the ones before.
    capped = replay(server, spaced, time_scale=0, concurrency=1, arrival_slack_s=0.001)
    assert capped["late_arrivals"] >= 2 and capped["max_lateness_ms"] > 1
    sent = [r["sent_ms"] for r in capped["per_request"]]
    assert sent == sorted(sent) and sent[2] - sent[0] >= 2 * min(r["ttft_ms"] for r in capped["per_request"])


def test_ids_outside_the_served_vocabulary_fail_clearly(server):
    with pytest.raises(RuntimeError, match=r"HTTP 400.*token ids.*--vocab-size is 10000000"):
        replay(server, TRACE[:1], vocab_size=10_000_000, time_scale=0)


def test_cli_replays_a_trace_and_prints_the_table(server, tmp_path):
    trace = write_trace(tmp_path / "trace.jsonl", TRACE)
    done = subprocess.run([sys.executable, "-m", "kvreuse", "bench", "replay", server.base_url, "--trace", str(trace),
                           "--tokens-per-hash", str(BLOCK), "--hash-block-tokens", str(BLOCK), "--time-scale", "0.1",
                           "--start", "1", "--max-output-tokens", "2", "--out", str(tmp_path / "out")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert live_trace.TABLE_HEADER in done.stdout
    assert "| 2 | 0 | 0 |" in done.stdout and "2 requests of trace.jsonl" in done.stdout
    report = json.loads((tmp_path / "out" / "live-trace.json").read_text())
    assert report["start"] == 1 and report["requests"] == 2 and report["total_output_tokens"] == 4
    assert (tmp_path / "out" / "live-trace.md").read_text().startswith(live_trace.TABLE_HEADER)


@pytest.mark.parametrize(("flags", "message"), [
    (["--time-scale", "-1"], "argument --time-scale: expected a number >= 0"),
    (["--tokens-per-hash", "0"], "argument --tokens-per-hash: expected an integer >= 1"),
    (["--vocab-size", "100"], "argument --vocab-size: expected an integer above 256"),
])
def test_bad_flags_name_the_flag(tmp_path, capsys, flags, message):
    trace = write_trace(tmp_path / "trace.jsonl", TRACE)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "replay", "http://127.0.0.1:9", "--trace", str(trace), *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_bad_input_names_the_file_line_field_or_flag(tmp_path, capsys):
    url = "http://127.0.0.1:9"  # never reached: every case fails before a request
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "hash_ids": [1]}\n{"timestamp": -3, "input_length": 5}\n')
    trace = write_trace(tmp_path / "trace.jsonl", TRACE)
    cases = [(["--trace", str(tmp_path / "missing.jsonl")], "--trace: [Errno 2]"),
             (["--trace", str(bad)], f"{bad}:2: timestamp must be a non-negative integer"),
             (["--trace", str(trace), "--start", "3"], "no requests from --start 3 (the trace has 3)"),
             (["chat", "--trace", str(trace), "--requests", "2"], "leave out --requests, SCENARIO"),
             (["chat", "--tokens-per-hash", "8"], "--tokens-per-hash need --trace")]
    for flags, message in cases:
        assert main(["bench", "replay", url, *flags]) == 2, flags
        assert message in capsys.readouterr().err, flags


def test_cluster_targets_and_table():
    from kvreuse.bench import live_trace_cluster

    def result(hit_rate, ttft_ms):
        return {"exact_hit_rate": hit_rate, "mean_ttft_ms": ttft_ms, "completed": 4, "failed": 0, "late_arrivals": 1,
                "max_lateness_ms": 70.0, "p50_ttft_ms": ttft_ms, "p90_ttft_ms": ttft_ms, "p99_ttft_ms": ttft_ms,
                "output_throughput": 2.0, "replicas": {"r0": 3, "r1": 1}}

    results = {"cache_aware": {"t": result(0.27, 90)}, "round_robin": {"t": result(0.20, 100)},
               "cache_aware+redis": {"t": result(0.40, 110)}, "round_robin+redis": {"t": result(0.30, 100)}}
    checks = live_trace_cluster.targets(results)
    assert {text: check["met"] for text, check in checks.items()} == {
        "t: hit rate >= 1.3x round_robin's": True, "t: mean TTFT below round_robin's": True,
        "t+redis: hit rate >= 1.3x round_robin's": True,
        "t+redis: mean TTFT below round_robin's": False}
    assert checks["t: hit rate >= 1.3x round_robin's"]["ratio"] == pytest.approx(1.35)
    report = {"replicas": 2, "traces": {"t": {"requests": 4}}, "options": {"max_output_tokens": 4},
              "cpu": {"cpu": "Test CPU", "flags": ["avx2"]}, "servers": results, "targets": checks}
    table = live_trace_cluster.markdown(report)
    assert "| cache_aware+redis | t | 4 | 0 | 1 | 70 | 40.0% | 110 | 110 | 110 | 110 | 2.0 | r0 3, r1 1 |" in table
    assert "t+redis: mean TTFT below round_robin's: not met (1.10x)" in table
    assert set(live_trace_cluster.servers(2, redis=False)) == {"single", "cache_aware", "round_robin", "ray_prefix"}
