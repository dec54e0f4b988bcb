"""`kvreuse cache warm|stats|clear` on the tiny model: warming leaves on disk exactly the KV a later process loads
(and generates the same greedy tokens from as without any cache); stats and clear see the disk and Redis tiers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from kvreuse.cli import main
from kvreuse.llm import LLM
from kvreuse.sampling_params import SamplingParams

from .conftest import make_config

BLOCK = 16  # cache.block_size's default

PROMPTS = [
    {"prompt": "The quick brown fox jumps over the lazy dog while the cache keeps every block it has seen. " * 3},
    {"prompt": "System: you answer questions about key-value caches in transformer inference engines. " * 4},
]
CHATS = [
    {"messages": [{"role": "system", "content": "You are a terse assistant who knows storage tiers well. " * 2},
                  {"role": "user", "content": "Why would a disk tier under the memory pool help a restart?"}]},
]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def kvb_files(path: Path) -> int:
    return len(list(path.rglob("*.kvb")))


@pytest.fixture
def disk(tmp_path) -> Path:
    return tmp_path / "kv"


@pytest.fixture
def flags(tiny_model_dir, disk) -> list[str]:
    return ["--model", tiny_model_dir, "--dtype", "fp32", "--set", f"cache.disk.path={disk}"]


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> LLM:
    """The tiny model without any cache: token counts and the outputs warmed runs must reproduce."""
    return LLM(make_config(model__path=tiny_model_dir, model__dtype="fp32", cache__enabled="false"))


def prompt_tokens(llm: LLM, record: dict) -> list[int]:
    if "messages" in record:
        return llm.engine.front_end.tokenize_chat(record["messages"])
    return llm.engine.front_end.tokenize_prompt(record["prompt"])


def warm_json(argv: list[str], capsys) -> dict:
    assert main(["cache", "warm", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# --- warm ----------------------------------------------------------------------------------------------------------
def test_a_fresh_process_loads_the_warmed_prefix_from_disk_and_generates_the_same(
        tiny_model_dir, tmp_path, disk, flags, reference, capsys):
    file = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    assert main(["cache", "warm", str(file), *flags]) == 0
    out = capsys.readouterr().out
    assert out.startswith("warmed 2 prompts (") and "blocks written: disk " in out

    fresh = LLM(make_config(model__path=tiny_model_dir, model__dtype="fp32", cache__disk__path=str(disk)))
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0)
        for record in PROMPTS:
            got = fresh.generate(record["prompt"], params)[0]
            want = reference.generate(record["prompt"], params)[0]
            n = got.usage.prompt_tokens
            assert n == want.usage.prompt_tokens == len(prompt_tokens(reference, record))
            assert (n - 1) // BLOCK * BLOCK >= 2 * BLOCK  # long enough that the check means something
            assert got.usage.cached_tokens_disk == got.usage.cached_tokens == (n - 1) // BLOCK * BLOCK
            assert want.usage.cached_tokens == 0
            assert got.token_ids == want.token_ids and got.text == want.text
    finally:
        fresh.engine.close()


def test_chat_lines_warm_too_and_a_second_warm_writes_nothing(tmp_path, disk, flags, reference, capsys):
    records = PROMPTS + CHATS
    file = write_jsonl(tmp_path / "p.jsonl", records)
    lengths = [len(prompt_tokens(reference, r)) for r in records]

    first = warm_json([str(file), *flags], capsys)
    assert (first["num_items"], first["prompt_tokens"], first["cached_tokens"]) == (3, sum(lengths), 0)
    assert first["computed_prompt_tokens"] == sum(lengths)
    assert first["blocks_written"] == {"disk": sum(n // BLOCK for n in lengths)}
    assert (first["dropped_blocks"], first["flushed"], first["failed"], first["tiers"]) == (0, True, [], ["disk"])
    assert kvb_files(disk) == sum(n // BLOCK for n in lengths)

    # A new process: everything but each prompt's last partial block (and its last token) comes from disk.
    second = warm_json([str(file), *flags], capsys)
    cached = sum((n - 1) // BLOCK * BLOCK for n in lengths)
    assert second["prompt_tokens"] == sum(lengths)
    assert second["cached_tokens_details"] == {"memory": 0, "disk": cached, "redis": 0}
    assert second["computed_prompt_tokens"] == sum(lengths) - cached
    assert second["blocks_written"] == {"disk": 0}
    assert kvb_files(disk) == sum(n // BLOCK for n in lengths)


def test_the_cache_salt_warms_a_separate_chain(tmp_path, disk, flags, reference, capsys):
    file = write_jsonl(tmp_path / "p.jsonl", PROMPTS[:1])
    full_blocks = len(prompt_tokens(reference, PROMPTS[0])) // BLOCK
    assert warm_json([str(file), *flags], capsys)["blocks_written"] == {"disk": full_blocks}
    salted = warm_json([str(file), *flags, "--cache-salt", "tenant-a"], capsys)
    assert (salted["cached_tokens"], salted["blocks_written"]) == (0, {"disk": full_blocks})
    assert kvb_files(disk) == 2 * full_blocks


def test_warm_without_a_lower_tier_is_refused(tiny_model_dir, tmp_path, capsys):
    file = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    assert main(["cache", "warm", str(file), "--model", tiny_model_dir, "--dtype", "fp32"]) == 2
    err = capsys.readouterr().err
    assert "cache.disk.path" in err and "cache.redis.url" in err


def test_warm_with_caching_off_is_refused(tmp_path, disk, flags, capsys):
    file = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    assert main(["cache", "warm", str(file), *flags, "--set", "cache.enabled=false"]) == 2
    assert "cache.enabled is false" in capsys.readouterr().err


def test_a_bad_jsonl_line_is_named(tmp_path, disk, flags, capsys):
    file = tmp_path / "p.jsonl"
    file.write_text(json.dumps(PROMPTS[0]) + "\n\nnot json\n", encoding="utf-8")
    assert main(["cache", "warm", str(file), *flags]) == 2
    assert f"{file}, line 3: not valid JSON" in capsys.readouterr().err


def test_a_prompt_the_engine_refuses_is_named_and_nothing_is_warmed(tmp_path, disk, flags, capsys):
    file = write_jsonl(tmp_path / "p.jsonl", [PROMPTS[0], {"prompt": "word " * 200}, PROMPTS[1]])
    assert main(["cache", "warm", str(file), *flags, "--max-model-len", "100"]) == 2
    err = capsys.readouterr().err
    assert f"{file}, line 2: " in err and "exceeds the context limit of 100 tokens" in err
    assert kvb_files(disk) == 0  # every line is checked before any is run


def test_an_empty_file_is_refused(tmp_path, flags, capsys):
    file = tmp_path / "p.jsonl"
    file.write_text("\n", encoding="utf-8")
    assert main(["cache", "warm", str(file), *flags]) == 2
    assert f"{file}: no prompts" in capsys.readouterr().err


# --- stats and clear -----------------------------------------------------------------------------------------------
def tier_line(out: str, name: str) -> str:
    [line] = [line for line in out.splitlines() if line.startswith(f"{name}  ")]
    return line


def test_stats_counts_the_disk_tier_files(tmp_path, disk, flags, capsys):
    write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    assert main(["cache", "warm", str(tmp_path / "p.jsonl"), *flags]) == 0
    capsys.readouterr()
    files = kvb_files(disk)
    assert files > 0

    # No --model: stats never loads it.
    assert main(["cache", "stats", "--set", f"cache.disk.path={disk}"]) == 0
    line = tier_line(capsys.readouterr().out, "disk")
    assert f"  {disk}  {files} entries  " in line and line.endswith("  available")
    assert main(["cache", "stats", "--set", f"cache.disk.path={disk}", "--json"]) == 0
    [tier] = json.loads(capsys.readouterr().out)["tiers"]
    assert (tier["name"], tier["detail"], tier["num_entries"], tier["available"]) == ("disk", str(disk), files, True)
    assert tier["num_bytes"] == sum(f.stat().st_size for f in disk.rglob("*.kvb"))
    assert tier["capacity_bytes"] == 10 * 2**30


def test_stats_and_clear_without_a_tier_say_so(capsys):
    for action in ("stats", "clear"):
        assert main(["cache", action]) == 0
        assert "no lower KV tier is configured" in capsys.readouterr().out
    assert main(["cache", "stats", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"tiers": []}


def test_stats_and_clear_see_redis_and_keep_unrelated_keys(tmp_path, disk, flags, redis_url, capsys):
    file = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    tiers = ["--set", f"cache.disk.path={disk}", "--set", f"cache.redis.url={redis_url}"]
    summary = warm_json([str(file), *flags, "--set", f"cache.redis.url={redis_url}"], capsys)
    files = kvb_files(disk)
    assert summary["blocks_written"] == {"disk": files, "redis": files} and files > 0

    client = redis.Redis.from_url(redis_url)
    try:
        client.set("unrelated:key", b"keep me")
        assert main(["cache", "stats", *tiers]) == 0
        out = capsys.readouterr().out
        assert f"  {files} entries  " in tier_line(out, "disk")
        assert f"redis  {redis_url}  {files} entries  size unknown" in tier_line(out, "redis")
        assert main(["cache", "stats", *tiers, "--json"]) == 0
        counts = {t["name"]: t["num_entries"] for t in json.loads(capsys.readouterr().out)["tiers"]}
        assert counts == {"disk": files, "redis": files}

        assert main(["cache", "clear", *tiers]) == 0
        out = capsys.readouterr().out
        assert tier_line(out, "disk").endswith(f"  {files} entries removed")
        assert tier_line(out, "redis").endswith(f"  {files} entries removed")
        assert kvb_files(disk) == 0
        assert list(client.scan_iter(match="kvreuse:kv:*")) == []
        assert client.get("unrelated:key") == b"keep me"

        assert main(["cache", "clear", *tiers, "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == {"cleared": {"disk": 0, "redis": 0},
                                                       "remaining": {"disk": 0, "redis": 0}}
    finally:
        client.close()


def test_stats_never_shows_the_redis_password_and_reports_an_unreachable_redis(capsys):
    url = "redis://:hunter2@127.0.0.1:1/0"  # port 1: refused at once
    assert main(["cache", "stats", "--set", f"cache.redis.url={url}"]) == 0
    out = capsys.readouterr().out
    assert "hunter2" not in out
    assert tier_line(out, "redis") == ("redis  redis://127.0.0.1:1/0  ? entries  size unknown  no limit of ours  "
                                       "UNAVAILABLE")
