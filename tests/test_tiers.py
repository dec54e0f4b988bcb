"""The lower tiers under the pool, end to end with the tiny model: blocks written through to disk and Redis, read
back after a restart or by another engine, and every fault (a corrupted, truncated or foreign entry, a dead Redis,
a full disk, a stalled writer) a miss with output identical to no cache, counted."""

from __future__ import annotations

import json
import logging
import re
import struct
import threading
import time
from pathlib import Path

import pytest

from kvreuse.engine.engine import LLMEngine
from kvreuse.kvcache.tiers import entry
from kvreuse.kvcache.tiers.tier_secret import load_tier_secret
from kvreuse.llm import LLM
from kvreuse.sampling_params import SamplingParams

from .helpers import drain, tiny_llm
from .redis_faults import FaultyRedis

BS = 16
PROMPT = "The lighthouse keeper wrote in the log every night, noting the wind and the ships that passed. " * 12
OTHER = "A recipe for bread needs flour, water, salt and time; the dough rests overnight in a cool room. " * 12
GREEDY = SamplingParams(max_tokens=8)


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> dict[str, list[int]]:
    """Greedy outputs with caching off: what every tiered run must reproduce."""
    llm = tiny_llm(tiny_model_dir, cache__enabled="false")
    return {p: llm.generate(p, GREEDY)[0].token_ids for p in (PROMPT, OTHER)}


def full_blocks(llm: LLM, prompt: str) -> int:
    """Prompt tokens in full blocks before the last token: what an exact prefix hit can cover."""
    return (len(llm.tokenizer.encode(prompt)) - 1) // BS * BS


def chain_keys(llm: LLM, prompt: str) -> list[bytes]:
    manager = llm.engine.kv_manager
    req = manager.new_request(llm.tokenizer.encode(prompt))
    return [manager._key(req, i) for i in range(req.num_tokens // BS)]


def entry_file(disk: Path, key: bytes) -> Path:
    return disk / key.hex()[:2] / f"{key.hex()}.kvb"


def tier_counters(engine: LLMEngine, tier: str) -> dict:
    return engine.stats_snapshot().tiers["tiers"][tier]


def computed_then_closed(tiny_model_dir: str, prompt: str = PROMPT, **overrides) -> list[int]:
    """One engine computes `prompt` with the tiers of `overrides`, writes them and exits."""
    llm = tiny_llm(tiny_model_dir, **overrides)
    tokens = llm.generate(prompt, GREEDY)[0].token_ids
    llm.engine.close()
    return tokens


# --- disk: restart ---------------------------------------------------------------------------------------------
def test_a_restarted_engine_loads_the_prefix_from_disk_with_identical_output(tiny_model_dir, tmp_path, reference):
    assert computed_then_closed(tiny_model_dir, cache__disk__path=tmp_path) == reference[PROMPT]
    llm = tiny_llm(tiny_model_dir, cache__disk__path=tmp_path)
    out = llm.generate(PROMPT, GREEDY)[0]
    expected = full_blocks(llm, PROMPT)
    assert out.token_ids == reference[PROMPT]
    assert out.usage.cached_tokens == out.usage.cached_tokens_disk == expected > 0.9 * out.usage.prompt_tokens
    assert out.usage.cached_by_tier() == {"memory": 0, "disk": expected, "redis": 0}
    assert out.tier_load_s > 0
    assert tier_counters(llm.engine, "disk")["hit_blocks"] == expected // BS
    again = llm.generate(PROMPT, GREEDY)[0]  # now in the pool: from memory
    assert again.usage.cached_by_tier() == {"memory": expected, "disk": 0, "redis": 0}
    llm.engine.check_integrity()
    llm.engine.tiers.check_integrity()
    llm.engine.close()


def test_only_exactly_computed_registered_blocks_reach_a_tier(tiny_model_dir, tmp_path):
    """Segment reuse copies approximate K/V; none of it (nor anything after it) may be written."""
    llm = tiny_llm(tiny_model_dir, cache__disk__path=tmp_path, cache__suffix__enabled="true",
                   cache__suffix__recompute_ratio="0.1")
    registered: set[bytes] = set()
    llm.engine.kv_manager.pool.on_register.append(lambda block: registered.add(block.block_key))
    doc = "Document seven: the river floods each spring and the town moved uphill in 1840. " * 6
    llm.generate("Question one. " + doc, GREEDY)
    reuse = llm.generate("A different opening sentence that shifts everything. " + doc, GREEDY)[0]
    assert reuse.usage.reused_tokens > 0  # the document was reused as a segment, approximately
    llm.engine.tiers.flush()
    stored = {bytes.fromhex(p.stem) for p in tmp_path.rglob("*.kvb")}
    assert stored == registered
    assert len(stored) == tier_counters(llm.engine, "disk")["entries_written"]
    llm.engine.close()


def test_another_dtype_never_reads_these_entries(tiny_model_dir, tmp_path):
    computed_then_closed(tiny_model_dir, cache__disk__path=tmp_path)
    bf16 = tiny_llm(tiny_model_dir, cache__disk__path=tmp_path, model__dtype="bf16")
    plain = tiny_llm(tiny_model_dir, cache__enabled="false", model__dtype="bf16")
    out = bf16.generate(PROMPT, GREEDY)[0]
    assert out.usage.cached_tokens == 0  # its keys carry its dtype: not one matches
    assert out.token_ids == plain.generate(PROMPT, GREEDY)[0].token_ids
    assert tier_counters(bf16.engine, "disk")["invalid_entries"] == {}
    bf16.engine.close()


# --- disk: faults ----------------------------------------------------------------------------------------------
def rewrite_header(path: Path, **changes) -> None:
    data = path.read_bytes()
    magic, version, head_len = struct.unpack_from("<4sHI", data)
    header = json.loads(data[10:10 + head_len])
    version = changes.pop("version", version)
    header.update(changes)
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<4sHI", magic, version, len(head)) + head + data[10 + head_len:])


def flip_a_payload_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-entry.SIGNATURE_BYTES - 1] ^= 0x01  # the payload's last byte
    path.write_bytes(bytes(data))


def flip_a_signature_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


FAULTS = {
    "checksum": flip_a_payload_byte,
    "signature": flip_a_signature_byte,
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "fingerprint": lambda p: rewrite_header(p, fingerprint="another-model:float32"),
    "dtype": lambda p: rewrite_header(p, dtype="bfloat16"),
    "tokens": lambda p: rewrite_header(p, tokens=[1] * BS),
    "version": lambda p: rewrite_header(p, version=entry.VERSION + 1),
    "magic": lambda p: p.write_bytes(b"PK\x03\x04" + p.read_bytes()[4:]),
}


def replace_header(path: Path, head: bytes) -> None:
    data = path.read_bytes()
    magic, version, head_len = struct.unpack_from("<4sHI", data)
    path.write_bytes(struct.pack("<4sHI", magic, version, len(head)) + head + data[10 + head_len:])


def header_text(path: Path) -> bytes:
    data = path.read_bytes()
    return data[10:10 + struct.unpack_from("<4sHI", data)[2]]


# Headers no decoder should choke on: each is refused with reason "header", never a traceback.
HEADER_FAULTS = {
    "nested-200k-deep": lambda p: replace_header(p, b"[" * 200_000 + b"]" * 200_000),  # json's RecursionError
    # Parses, but a field 900 deep (repr'd in a message, it could recurse past the limit): only flat fields pass.
    "field-nested-900-deep": lambda p: replace_header(p, re.sub(rb'"key": ?"[0-9a-f]+"',
                                                                b'"key":' + b"[" * 900 + b"]" * 900, header_text(p))),
    "not-json": lambda p: replace_header(p, b"\xff\xfe{not json"),
    "not-an-object": lambda p: replace_header(p, b"[1, 2, 3]"),
}
CASES = [*FAULTS.items(), *(("header", fault) for fault in HEADER_FAULTS.values())]


@pytest.mark.parametrize("reason,fault", CASES, ids=[*FAULTS, *HEADER_FAULTS])
def test_a_bad_entry_is_a_miss_counted_deleted_and_recomputed(tiny_model_dir, tmp_path, reference, reason, fault,
                                                              caplog):
    computed_then_closed(tiny_model_dir, cache__disk__path=tmp_path)
    bad_index = 3
    llm = tiny_llm(tiny_model_dir, cache__disk__path=tmp_path)
    bad = entry_file(tmp_path, chain_keys(llm, PROMPT)[bad_index])
    fault(bad)
    llm = tiny_llm(tiny_model_dir, cache__disk__path=tmp_path)  # a fresh index over the damaged files
    with caplog.at_level(logging.DEBUG, logger="kvreuse"):
        out = llm.generate(PROMPT, GREEDY)[0]
    assert out.token_ids == reference[PROMPT]
    assert out.usage.cached_tokens_disk == bad_index * BS  # the chain up to the bad entry
    disk = tier_counters(llm.engine, "disk")
    assert disk["invalid_entries"] == {reason: 1}
    assert [r.getMessage()[:80] for r in caplog.records if r.exc_info] == []  # refused, not crashed on
    llm.engine.tiers.flush()
    # The bad entry was deleted; the block, computed again, was written again, valid.
    payload = entry.decode(bad.read_bytes(), llm.engine.tiers.spec, chain_keys(llm, PROMPT)[bad_index],
                           chain_keys(llm, PROMPT)[bad_index - 1], llm.tokenizer.encode(PROMPT)[bad_index * BS:
                                                                                                 (bad_index + 1) * BS],
                           secret=load_tier_secret(""))
    assert payload.nbytes == llm.engine.tiers.spec.payload_bytes
    llm.engine.tiers.check_integrity()
    llm.engine.close()


def test_a_full_disk_tier_keeps_the_chain_heads_and_stays_under_its_limit(tiny_model_dir, tmp_path, reference):
    entry_bytes = 9_000  # the tiny model's block: 8 KiB of K/V and its header
    room = 6 * entry_bytes / 2**30
    computed_then_closed(tiny_model_dir, cache__disk__path=tmp_path, cache__disk__max_gb=room)
    files = list(tmp_path.rglob("*.kvb"))
    assert 0 < len(files) <= 6 and sum(f.stat().st_size for f in files) <= room * 2**30
    llm = tiny_llm(tiny_model_dir, cache__disk__path=tmp_path, cache__disk__max_gb=room)
    out = llm.generate(PROMPT, GREEDY)[0]
    assert out.token_ids == reference[PROMPT]
    assert out.usage.cached_tokens_disk == len(files) * BS  # LRU dropped tails: the head chain survived
    llm.engine.close()


def test_a_stalled_writer_drops_blocks_and_never_stalls_a_step(tiny_model_dir, tmp_path, reference):
    llm = tiny_llm(tiny_model_dir, cache__disk__path=tmp_path, cache__tier_queue_mb=1)
    disk = llm.engine.tiers.tiers[0]
    release, put = threading.Event(), disk.put
    disk.put = lambda entries: (release.wait(60), put(entries))[1]  # a disk that does not answer
    outputs = [llm.generate(p * 7, GREEDY)[0] for p in (PROMPT, OTHER)]  # ~1.7 MB of blocks for a 1 MB queue
    assert all(o.finish_reason == "length" for o in outputs)
    snapshot = llm.engine.tiers.snapshot()
    assert snapshot["dropped_blocks"] > 0 and snapshot["queued_bytes"] <= 2**20
    release.set()
    assert llm.engine.tiers.flush(timeout=30)
    assert tier_counters(llm.engine, "disk")["entries_written"] == snapshot["queued_blocks"]
    llm.engine.close()


def test_a_request_waits_for_its_load_while_the_batch_runs_on(tiny_model_dir, tmp_path, reference):
    computed_then_closed(tiny_model_dir, cache__disk__path=tmp_path)
    llm = tiny_llm(tiny_model_dir, cache__disk__path=tmp_path)
    engine = llm.engine
    disk, release = engine.tiers.tiers[0], threading.Event()
    get = disk.get
    disk.get = lambda keys: (release.wait(60), get(keys))[1]  # a slow disk
    running = engine.add_request(OTHER, SamplingParams(max_tokens=6))
    engine.step()  # OTHER is admitted (its prefill runs)
    loading = engine.add_request(PROMPT, GREEDY)
    for _ in range(4):
        engine.step()
    assert running.num_completion_tokens >= 4  # decoding went on...
    assert loading.num_computed_tokens == 0 and engine.kv_manager.is_loading(loading.kv)  # ...while this waited
    release.set()
    drain(engine)
    out = engine.output(loading)
    assert out.usage.cached_tokens_disk == full_blocks(llm, PROMPT)
    assert out.token_ids == reference[PROMPT]
    engine.close()


# --- Redis -----------------------------------------------------------------------------------------------------
def test_a_second_engine_loads_from_redis_with_identical_output(tiny_model_dir, redis_url, reference):
    assert computed_then_closed(tiny_model_dir, cache__redis__url=redis_url) == reference[PROMPT]
    other = tiny_llm(tiny_model_dir, cache__redis__url=redis_url)
    out = other.generate(PROMPT, GREEDY)[0]
    assert out.token_ids == reference[PROMPT]
    assert out.usage.cached_by_tier() == {"memory": 0, "disk": 0, "redis": full_blocks(other, PROMPT)}
    other.engine.close()


def test_a_redis_hit_is_also_written_to_the_nearer_disk(tiny_model_dir, redis_url, tmp_path, reference):
    computed_then_closed(tiny_model_dir, cache__redis__url=redis_url)
    both = tiny_llm(tiny_model_dir, cache__redis__url=redis_url, cache__disk__path=tmp_path)
    assert both.generate(PROMPT, GREEDY)[0].usage.cached_tokens_redis == full_blocks(both, PROMPT)
    both.engine.close()
    disk_only = tiny_llm(tiny_model_dir, cache__disk__path=tmp_path)
    out = disk_only.generate(PROMPT, GREEDY)[0]
    assert out.usage.cached_tokens_disk == full_blocks(disk_only, PROMPT) and out.token_ids == reference[PROMPT]
    disk_only.engine.close()


def test_salted_requests_share_nothing_through_redis(tiny_model_dir, redis_url):
    llm = tiny_llm(tiny_model_dir, cache__redis__url=redis_url)
    llm.generate(PROMPT, GREEDY, cache_salt="tenant-a")
    llm.engine.close()
    other = tiny_llm(tiny_model_dir, cache__redis__url=redis_url)
    assert other.generate(PROMPT, GREEDY, cache_salt="tenant-b")[0].usage.cached_tokens == 0
    assert other.generate(PROMPT, GREEDY, cache_salt="tenant-a")[0].usage.cached_tokens_redis > 0
    other.engine.close()


def wait_until(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_redis_killed_and_restarted_mid_run(tiny_model_dir, reference):
    with FaultyRedis() as server:
        llm = tiny_llm(tiny_model_dir, cache__redis__url=server.url, cache__redis__timeout_ms="200")
        engine, redis = llm.engine, llm.engine.tiers.tiers[0]
        redis.BACKOFF_MIN_S = redis.BACKOFF_MAX_S = 0.2
        assert llm.generate(PROMPT, GREEDY)[0].token_ids == reference[PROMPT]
        assert engine.tiers.flush(10) and tier_counters(engine, "redis")["entries_written"] > 0
        server.kill()
        out = llm.generate(OTHER, GREEDY)[0]  # computed; its writes fail: counted, not raised
        assert out.token_ids == reference[OTHER] and out.usage.cached_tokens == 0
        assert engine.tiers.flush(10) and tier_counters(engine, "redis")["errors"] >= 1
        server.restart()  # empty: it saves nothing
        # Back by itself after the backoff: a request's blocks are written again and another engine reads them.
        # (Computed again each time: a write during the backoff is dropped, and the pool would then hold them.)
        assert wait_until(lambda: (engine.reset_prefix_cache(), llm.generate(OTHER, GREEDY), engine.tiers.flush(10),
                                   redis.contains(chain_keys(llm, OTHER)[:1]))[-1] == [True])
        reader = tiny_llm(tiny_model_dir, cache__redis__url=server.url)
        again = reader.generate(OTHER, GREEDY)[0]
        assert again.token_ids == reference[OTHER] and again.usage.cached_tokens_redis == full_blocks(reader, OTHER)
        for closing in (llm, reader):
            closing.engine.close()


def test_an_unreachable_redis_is_only_misses(tiny_model_dir, reference):
    from kvreuse.bench.redis_process import free_port

    llm = tiny_llm(tiny_model_dir, cache__redis__url=f"redis://127.0.0.1:{free_port()}/0",
                   cache__redis__timeout_ms="100")
    outs = [llm.generate(p, GREEDY)[0] for p in (PROMPT, OTHER, PROMPT)]
    assert [o.token_ids for o in outs] == [reference[PROMPT], reference[OTHER], reference[PROMPT]]
    assert outs[2].usage.cached_by_tier()["memory"] == full_blocks(llm, PROMPT)  # the pool still works
    assert tier_counters(llm.engine, "redis")["errors"] >= 1
    llm.engine.close()
