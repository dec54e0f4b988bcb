"""Mooncake-format traces: reading and writing them, turning hash ids into prompts, replaying them through the cache
simulator per policy and capacity (`kvreuse bench trace`), and the scenario workloads exported as one. The traces
here are made by the tests (`session_trace`), so nothing outside the repository is read."""

from __future__ import annotations

import json
import random
from collections import OrderedDict

import pytest
from matplotlib.image import imread

from kvreuse.bench import trace_export
from kvreuse.bench.plots import capacity_plot
from kvreuse.bench.trace import TraceError, TraceRequest, prompt_length, prompt_tokens, read_trace, write_trace
from kvreuse.bench.trace_bench import POLICY_NAMES, Scale, default_block_size, markdown, replay, run
from kvreuse.cli import main


def session_trace(num_sessions: int = 40, seed: int = 0, hash_block_tokens: int = 512) -> list[TraceRequest]:
    """A Mooncake-shaped trace: sessions of 1-5 turns, each turn extending the previous turn's blocks by a few new
    ids, some sessions under one of two shared system prompts, sessions interleaved by arrival time."""
    rng = random.Random(seed)
    next_id = iter(range(10, 10**9))
    system = {0: [0, 1, 2], 1: [3, 4]}
    arrivals = []
    for s in range(num_sessions):
        blocks = list(system[s % 2]) if s % 3 else []
        at = rng.uniform(0, 100_000)
        for _ in range(rng.randint(1, 5)):
            blocks += [next(next_id) for _ in range(rng.randint(1, 6))]
            tail = rng.randint(1, hash_block_tokens - 1)  # never block-aligned: the last block is partial
            arrivals.append((at, (len(blocks) - 1) * hash_block_tokens + tail, tuple(blocks)))
            at += rng.expovariate(1 / 20_000)
    return [TraceRequest(round(at), length, 8, ids) for at, length, ids in sorted(arrivals)]


# --- the file format -------------------------------------------------------------------------------------------
def test_a_trace_reads_back_as_written(tmp_path):
    requests = session_trace(5)
    path = write_trace(tmp_path / "sub" / "t.jsonl", requests)
    assert read_trace(path) == requests
    first = json.loads(path.read_text().splitlines()[0])
    assert list(first) == ["timestamp", "input_length", "output_length", "hash_ids"]


@pytest.mark.parametrize("line,message", [
    ("not json", "line 2: not JSON"),
    ("[1]", "line 2: expected a JSON object"),
    ('{"timestamp": 1, "input_length": 5, "hash_ids": []}', "line 2: hash_ids must be a non-empty list"),
    ('{"timestamp": 1, "input_length": 5, "hash_ids": [1, -2]}', "line 2: hash_ids must be a non-empty list"),
    ('{"timestamp": -1, "input_length": 5, "hash_ids": [1]}', "line 2: timestamp must be a non-negative integer"),
    ('{"timestamp": 0, "input_length": "5", "hash_ids": [1]}', "line 2: input_length must be a non-negative int"),
    ('{"timestamp": 0, "input_length": 0, "hash_ids": [1]}', "line 2: input_length must be at least 1"),
])
def test_a_bad_trace_line_is_named(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [7]}\n\n' + line + "\n")
    with pytest.raises(TraceError, match=f"^{path}:3: " + message.split(": ", 1)[1]):
        read_trace(path)


# --- hash ids to prompts ---------------------------------------------------------------------------------------
def test_a_prompt_is_its_hash_blocks_cut_to_the_scaled_input_length():
    request = TraceRequest(0, 3 * 512 + 100, 1, (5, 9, 2, 7))
    assert prompt_length(request, 32) == 3 * 32 + 6                  # 100 * 32 / 512 = 6.25, rounded
    tokens = prompt_tokens(request, 32)
    assert len(tokens) == 102 and tokens[:32] == list(range(160, 192)) and tokens[96:] == list(range(224, 230))
    # The length stays inside the last block: at least one token of it, at most all of it.
    assert prompt_length(TraceRequest(0, 3 * 512 + 1, 1, (5, 9, 2, 7)), 8) == 3 * 8 + 1
    assert prompt_length(TraceRequest(0, 2 * 512 - 1, 1, (5, 9)), 8) == 15   # the trace's last block is partial
    assert prompt_length(TraceRequest(0, 10_000, 1, (5, 9)), 8) == 16
    assert prompt_length(TraceRequest(0, 1024, 1, (5, 9)), 1) == 2            # one token per block: all full
    # Another request with the same first ids shares exactly those blocks.
    other = prompt_tokens(TraceRequest(0, 2 * 512 + 5, 1, (5, 9, 4)), 32)
    assert other[:64] == tokens[:64] and other[64] != tokens[64]


def test_the_default_block_size_is_the_largest_divisor_within_the_config_bound():
    assert [default_block_size(n) for n in (16, 32, 256, 512, 300, 7)] == [16, 32, 256, 256, 150, 7]


# --- replay ----------------------------------------------------------------------------------------------------
def lru_block_model(requests: list[TraceRequest], capacity: int) -> int:
    """Hash blocks hit under LRU, counted by hand: a request hits the leading run of its ids (all but its partial
    last one) that are cached, holds them, evicts the least recently freed cached ids to fit its new blocks (its
    partial last one too), then frees its ids deepest first. A request larger than the pool empties the cache and
    is skipped, as the simulator does."""
    cached: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for request in requests:
        ids = request.hash_ids
        if len(ids) > capacity:
            cached.clear()
            continue
        k = 0
        while k < len(ids) - 1 and ids[k] in cached:
            k += 1
        hits += k
        for h in ids[:k]:
            del cached[h]
        while capacity - len(cached) - k < len(ids) - k:
            cached.popitem(last=False)
        for h in reversed(ids[:-1]):
            cached[h] = None
    return hits


@pytest.mark.parametrize("capacity", [12, 30, 80])
def test_lru_through_the_cache_manager_hits_what_a_block_model_counts(capacity):
    requests = session_trace(30, seed=capacity)
    scale = Scale(tokens_per_hash=4, block_size=4)
    assert replay(requests, scale, capacity, "lru")["cached_tokens"] == 4 * lru_block_model(requests, capacity)


def test_every_policy_is_replayed_beside_the_infinite_cache_and_min():
    requests = session_trace(40, seed=3)
    scale = Scale(tokens_per_hash=8, block_size=4)                  # two cache blocks per hash block
    report = run(requests, scale, [40, 100, 10_000], list(POLICY_NAMES), name="sessions")
    infinite = report["infinite"]
    assert report["prompt_tokens"] == sum(prompt_length(r, 8) for r in requests) == infinite["prompt_tokens"]
    by = {(r["capacity"], r["policy"]): r for r in report["results"]}
    for (capacity, policy), result in by.items():
        assert result["eviction_cost_tokens"] == infinite["cached_tokens"] - result["cached_tokens"] >= 0
        assert result["cached_tokens"] <= by[capacity, "belady"]["cached_tokens"], (capacity, policy)
        assert result["prompt_tokens"] == report["prompt_tokens"] and result["skipped_requests"] == 0
    assert all(by[10_000, p]["hit_rate"] == infinite["hit_rate"] > 0.3 for p in POLICY_NAMES)
    assert by[40, "belady"]["hit_rate"] > by[40, "lru"]["hit_rate"]
    table = markdown(report)
    assert "| capacity (hash blocks) | trace tokens | lru | lfu | s3fifo | chain | learned | belady |" in table
    assert f"| 100 | 51k | {by[100, 'lru']['hit_rate']:.3f} |" in table


def test_the_capacity_plot_is_a_png(tmp_path):
    report = run(session_trace(10), Scale(4, 512, 4), [10, 40], ["lru", "belady"])
    path = capacity_plot(report, tmp_path / "p.png")
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 200 and image.std() > 0


def test_bench_trace_prints_the_table_and_writes_the_report(tmp_path, capsys):
    path = write_trace(tmp_path / "t.jsonl", session_trace(12))
    out = tmp_path / "out"
    argv = ["bench", "trace", str(path), "--tokens-per-hash", "4", "--capacity", "40", "10", "--policies", "lru",
            "chain", "belady", "--out", str(out)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "| capacity (hash blocks) | trace tokens | lru | chain | belady |" in table
    report = json.loads((out / "trace.json").read_text())
    assert (report["capacities"], report["block_size"], report["trace"]) == ([10, 40], 4, "t.jsonl")
    assert (out / "trace.md").read_text() == table
    assert (out / "trace_hit_rate_vs_capacity.png").stat().st_size > 1000


@pytest.mark.parametrize("argv,message", [
    (["--tokens-per-hash", "8", "--block-size", "3"], "--block-size 3 must divide --tokens-per-hash 8"),
    (["--tokens-per-hash", "512", "--block-size", "512"], "be at most 256"),
])
def test_bench_trace_refuses_a_block_size_that_does_not_fit(tmp_path, argv, message, capsys):
    path = write_trace(tmp_path / "t.jsonl", session_trace(2))
    assert main(["bench", "trace", str(path), *argv]) == 2
    assert message in capsys.readouterr().err


def test_bench_trace_names_a_bad_line(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0}\n')
    assert main(["bench", "trace", str(path)]) == 2
    assert f"{path}:1: input_length must be a non-negative integer" in capsys.readouterr().err


# --- the scenario workloads as a trace -------------------------------------------------------------------------
def test_hash_ids_name_a_block_and_everything_before_it():
    chains = trace_export.hash_ids([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [9, 2, 3, 4], [1, 2, 3]], 2)
    assert chains == [(0, 1, 2), (0, 1, 3), (4, 5), (0, 6)]  # [3] alone is not [3, 4]: a partial block of its own


def fake_encode(messages: list[dict]) -> list[int]:
    return [ord(c) for m in messages for c in f"<{m['role']}>{m['content']}"]


def test_the_scenario_trace_interleaves_sessions_that_extend_their_own_turns():
    mix = trace_export.SessionMix(num_sessions=60, seed=1)
    requests = trace_export.scenario_trace(mix, fake_encode, hash_block_tokens=16)
    assert [r.timestamp for r in requests] == sorted(r.timestamp for r in requests)
    assert all(len(r.hash_ids) == -(-r.input_length // 16) and 16 <= r.output_length <= 256 for r in requests)
    # Multi-turn sessions: a later request holds all of an earlier one's full blocks, and other requests come
    # between them.
    extends = [(i, j) for i, a in enumerate(requests) for j in range(i + 1, len(requests))
               if len(a.hash_ids) > 2 and requests[j].hash_ids[:len(a.hash_ids) - 1] == a.hash_ids[:-1]]
    assert extends and any(j > i + 1 for i, j in extends)
    assert trace_export.scenario_trace(mix, fake_encode, 16) == requests  # seeded


def test_bench_scenario_trace_writes_a_trace_bench_trace_reads(tmp_path, monkeypatch, capsys):
    class FakeTokenizer:
        def apply_chat_template(self, messages):
            return "".join(f"<{m['role']}>{m['content']}" for m in messages)

        def encode(self, text):
            return [ord(c) for c in text]

        def render_chat(self, messages):
            return self.apply_chat_template(messages)

        def encode_chat(self, text):
            return self.encode(text)

    import kvreuse.analyze

    monkeypatch.setattr(kvreuse.analyze, "load_tokenizer", lambda config: (FakeTokenizer(), "fp"))
    path = tmp_path / "scenario.jsonl"
    assert main(["bench", "scenario-trace", str(path), "--sessions", "20"]) == 0
    assert "hash blocks of 16 tokens" in capsys.readouterr().out
    requests = read_trace(path)
    assert len(requests) >= 20
    assert main(["bench", "trace", str(path), "--hash-block-tokens", "16", "--tokens-per-hash", "16",
                 "--capacity", "50", "--policies", "lru"]) == 0
