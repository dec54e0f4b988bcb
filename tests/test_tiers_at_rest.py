"""The tiers at rest (issue 26, findings 4, 5, 6 and 15): entries signed with the server's tier key, so a forged
Redis entry is a miss with output identical to no cache; private files whose entries hold a hash of their tokens,
not the tokens; tenant salts that no keyless caller can send; a warm and a clear that say what they could not do."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import struct
from pathlib import Path

import pytest
import redis

from kvreuse.cli import main
from kvreuse.config import ConfigError, EventsConfig
from kvreuse.kvcache.events import KVEventPublisher, is_local
from kvreuse.kvcache.hashing import scoped_salt
from kvreuse.kvcache.tiers import entry
from kvreuse.kvcache.tiers.disk_tier import DiskTier
from kvreuse.kvcache.tiers.tier_secret import load_tier_secret
from kvreuse.llm import LLM
from kvreuse.sampling_params import SamplingParams

from .helpers import app_server, tiny_engine, tiny_llm
from .server_process import http_client

BS = 16
PROMPT = "Alice's own note: the password of the archive is apple, and the spare key sits in the blue vase. " * 6
OTHER = "The weather station reads the wind every hour and files the numbers with the harbour office clerk. " * 6
GREEDY = SamplingParams(max_tokens=8)
NAMESPACE = "kvreuse:kv:"
SIG = entry.SIGNATURE_BYTES


def chain_keys(llm: LLM, prompt: str) -> list[bytes]:
    manager = llm.engine.kv_manager
    req = manager.new_request(llm.tokenizer.encode(prompt))
    return [manager._key(req, i) for i in range(req.num_tokens // BS)]


def token_blocks(llm: LLM, prompt: str) -> list[list[int]]:
    ids = llm.tokenizer.encode(prompt)
    return [ids[i:i + BS] for i in range(0, len(ids) // BS * BS, BS)]


def header(stored: bytes) -> dict:
    _, _, head_len = struct.unpack_from("<4sHI", stored)
    return json.loads(stored[10:10 + head_len])


def tier_counters(llm: LLM, tier: str) -> dict:
    return llm.engine.stats_snapshot().tiers["tiers"][tier]


def disk_entry(root: Path, key: bytes) -> bytes:
    return (root / key.hex()[:2] / f"{key.hex()}.kvb").read_bytes()


def key_file(path: Path, text: str = "k" * 40, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


# --- 4. poisoning: a forged entry is a miss ----------------------------------------------------------------------
def forge(llm: LLM, raw: redis.Redis, secret: bytes, copy_signature: bool = False) -> int:
    """Someone who can write the Redis, without the server's key: OTHER's K/V, taken from the entries a server wrote,
    put under PROMPT's keys with PROMPT's tokens and a matching checksum. How many blocks were forged."""
    spec = llm.engine.tiers.spec
    keys, others, tokens = chain_keys(llm, PROMPT), chain_keys(llm, OTHER), token_blocks(llm, PROMPT)
    for i in range(min(len(keys), len(others))):
        genuine = raw.get(NAMESPACE + others[i].hex())
        payload = genuine[-SIG - spec.payload_bytes:-SIG]
        forged = entry.encode(spec, keys[i], keys[i - 1] if i else None, tokens[i], payload, secret=secret)
        raw.set(NAMESPACE + keys[i].hex(), forged[:-SIG] + genuine[-SIG:] if copy_signature else forged)
    return min(len(keys), len(others))


def victim_and_other_written(tiny_model_dir: str, redis_url: str):
    """An engine on the Redis tier that wrote OTHER's blocks there, and PROMPT's greedy tokens computed cold."""
    writer = tiny_llm(tiny_model_dir, cache__redis__url=redis_url)
    expected = writer.generate(PROMPT, GREEDY, use_cache=False)[0].token_ids
    writer.generate(OTHER, GREEDY)
    assert writer.engine.tiers.flush(30)
    return writer, expected


@pytest.mark.parametrize("copy_signature", [False, True], ids=["signed-with-another-key", "genuine-signature-copied"])
def test_a_forged_redis_entry_is_a_miss_and_the_output_equals_use_cache_false(tiny_model_dir, redis_url, tmp_path,
                                                                               copy_signature):
    writer, expected = victim_and_other_written(tiny_model_dir, redis_url)
    raw = redis.Redis.from_url(redis_url)
    try:
        forge(writer, raw, b"the attacker's own key, not the server's", copy_signature)
        writer.engine.close()
        reader = tiny_llm(tiny_model_dir, cache__redis__url=redis_url, cache__disk__path=tmp_path / "kv")
        out = reader.generate(PROMPT, GREEDY)[0]
        assert out.usage.cached_tokens == 0 and out.token_ids == expected
        assert tier_counters(reader, "redis")["invalid_entries"] == {"signature": 1}
        assert reader.engine.tiers.flush(30)
        # Nothing of the forgery survives: the refused entry was deleted, the block computed and written again to
        # Redis (over the rest of the forgery) and to the disk, all genuine.
        secret, spec = load_tier_secret(""), reader.engine.tiers.spec
        keys, tokens = chain_keys(reader, PROMPT), token_blocks(reader, PROMPT)
        for i, k in enumerate(keys):
            for stored in (raw.get(NAMESPACE + k.hex()), disk_entry(tmp_path / "kv", k)):
                entry.decode(stored, spec, k, keys[i - 1] if i else None, tokens[i], secret=secret)
        reader.engine.close()
    finally:
        raw.close()


def test_the_same_forgery_signed_with_the_servers_key_is_served(tiny_model_dir, redis_url):
    """The control: only the key stands between a writer of the Redis and the victim's answers."""
    writer, expected = victim_and_other_written(tiny_model_dir, redis_url)
    raw = redis.Redis.from_url(redis_url)
    try:
        forged = forge(writer, raw, load_tier_secret(""))
    finally:
        raw.close()
    writer.engine.close()
    reader = tiny_llm(tiny_model_dir, cache__redis__url=redis_url)
    out = reader.generate(PROMPT, GREEDY)[0]
    assert out.usage.cached_tokens_redis == forged * BS and out.token_ids != expected  # poisoned
    reader.engine.close()


def test_servers_with_different_tier_keys_share_nothing_and_count_it(tiny_model_dir, redis_url, tmp_path):
    one, two = key_file(tmp_path / "one.key", "1" * 64), key_file(tmp_path / "two.key", "2" * 64)
    writer = tiny_llm(tiny_model_dir, cache__redis__url=redis_url, cache__tier_secret_file=one)
    expected = writer.generate(PROMPT, GREEDY)[0].token_ids
    writer.engine.close()
    stranger = tiny_llm(tiny_model_dir, cache__redis__url=redis_url, cache__tier_secret_file=two)
    out = stranger.generate(PROMPT, GREEDY)[0]
    assert out.usage.cached_tokens == 0 and out.token_ids == expected
    assert tier_counters(stranger, "redis")["invalid_entries"] == {"signature": 1}
    stranger.engine.close()  # it wrote its own entries, under its key
    peer = tiny_llm(tiny_model_dir, cache__redis__url=redis_url, cache__tier_secret_file=two)
    assert peer.generate(PROMPT, GREEDY)[0].usage.cached_tokens_redis > 0
    peer.engine.close()


def test_the_default_tier_key_is_made_once_0600_whatever_the_umask(tmp_path, monkeypatch):
    monkeypatch.setenv("KVREUSE_CACHE_DIR", str(tmp_path / "home"))
    old = os.umask(0)
    try:
        first = load_tier_secret("")
    finally:
        os.umask(old)
    path = tmp_path / "home" / "tier.key"
    assert os.stat(path).st_mode & 0o777 == 0o600 and len(first) >= 32
    assert load_tier_secret("") == first == path.read_bytes().strip()
    assert [p.name for p in path.parent.iterdir()] == ["tier.key"]  # no temp file left


@pytest.mark.parametrize("problem", ["missing", "short", "writable"])
def test_a_tier_key_file_that_is_missing_short_or_writable_by_others_is_refused(tmp_path, problem):
    path = {"missing": tmp_path / "absent.key", "short": key_file(tmp_path / "short.key", "s3cr3t"),
            "writable": key_file(tmp_path / "open.key", "w" * 64, 0o666)}[problem]
    with pytest.raises(ConfigError) as raised:
        load_tier_secret(str(path))
    message = str(raised.value)
    assert message.startswith(f"cache.tier_secret_file {path}: ")
    assert {"missing": "cannot read it", "short": "holds 6 bytes, a tier key needs at least 32",
            "writable": "writable by group or others (mode 666)"}[problem] in message
    assert "s3cr3t" not in message and "w" * 64 not in message


# --- 5. at rest: private files, no token ids --------------------------------------------------------------------
def test_disk_tier_files_are_0600_and_directories_0700_whatever_the_umask(tmp_path):
    root = tmp_path / "kv"
    old = os.umask(0)
    try:
        (root / "ab").mkdir(0o755, parents=True)  # left by an older version
        root.chmod(0o755)
        tier = DiskTier(root, max_bytes=100_000)
        assert tier.put([(hashlib.sha256(bytes([i])).digest(), b"entry %d" % i) for i in range(40)]) == 40
    finally:
        os.umask(old)
    dirs = [root, *(p for p in root.rglob("*") if p.is_dir())]
    files = [p for p in root.rglob("*") if p.is_file()]
    assert len(dirs) > 2 and len(files) == 40
    assert {oct(os.stat(d).st_mode & 0o777) for d in dirs} == {oct(0o700)}
    assert {oct(os.stat(f).st_mode & 0o777) for f in files} == {oct(0o600)}


def test_a_stored_entry_holds_a_hash_of_its_tokens_not_the_tokens(tiny_model_dir, tmp_path, redis_url):
    llm = tiny_llm(tiny_model_dir, cache__disk__path=tmp_path / "kv", cache__redis__url=redis_url)
    llm.generate(PROMPT, GREEDY)
    assert llm.engine.tiers.flush(30)
    raw = redis.Redis.from_url(redis_url)
    try:
        keys, tokens = chain_keys(llm, PROMPT), token_blocks(llm, PROMPT)
        for k, ids in zip(keys, tokens, strict=True):
            for stored in (raw.get(NAMESPACE + k.hex()), disk_entry(tmp_path / "kv", k)):
                head = header(stored)
                assert "tokens" not in head and head["tokens_sha256"] == entry.tokens_sha256(ids)
                assert ",".join(map(str, ids)).encode() not in stored
    finally:
        raw.close()
    llm.engine.close()


def test_tier_store_tokens_keeps_the_token_ids_and_they_are_checked(tiny_model_dir, tmp_path):
    llm = tiny_llm(tiny_model_dir, cache__disk__path=tmp_path, cache__tier_store_tokens="true")
    expected = llm.generate(PROMPT, GREEDY)[0].token_ids
    llm.engine.close()
    keys, tokens = chain_keys(llm, PROMPT), token_blocks(llm, PROMPT)
    assert [header(disk_entry(tmp_path, k))["tokens"] for k in keys] == tokens
    again = tiny_llm(tiny_model_dir, cache__disk__path=tmp_path)  # a reader that stores hashes reads both forms
    out = again.generate(PROMPT, GREEDY)[0]
    assert out.usage.cached_tokens_disk == len(keys) * BS and out.token_ids == expected
    again.engine.close()


def test_decode_compares_the_hash_of_the_tokens():
    spec = entry.BlockSpec("model", "float32", 2, (1, 2, 2, 1, 1), 4)
    stored = entry.encode(spec, b"k" * 32, None, [5, 6], bytes(16), secret=b"s" * 32)
    assert bytes(entry.decode(stored, spec, b"k" * 32, None, [5, 6], secret=b"s" * 32)) == bytes(16)
    with pytest.raises(entry.InvalidEntry) as raised:
        entry.decode(stored, spec, b"k" * 32, None, [5, 7], secret=b"s" * 32)
    assert raised.value.reason == "tokens"


# --- 6. salts: no keyless salt equals a tenant's -----------------------------------------------------------------
def test_scoped_salts_of_different_tenants_and_salts_never_collide():
    pairs = [(None, None), (None, "alice"), (None, "alice\x00"), (None, "\x00"), (None, '\x00["alice", null]'),
             (None, '\x00["alice", ""]'), ("alice", None), ("alice", ""), ("alice", "x"), ("alice\x00", None),
             ("alice\x00x", None), ("alice", "\x00"), ("", "alice"), ("", None), (None, "")]
    salts = [scoped_salt(tenant, salt) for tenant, salt in pairs]
    assert len({s for s in salts if s not in (None, "")}) == len(salts) - 2  # (None, None) and (None, ""): no salt
    assert scoped_salt(None, "team-x") == "team-x"  # the offline API's salts and a keyless server's are one space


def test_a_keyless_server_cannot_read_a_tenants_blocks_with_a_crafted_salt(tiny_model_dir, redis_url):
    keyed = tiny_engine(tiny_model_dir, cache__redis__url=redis_url)
    keyless = tiny_engine(tiny_model_dir, cache__redis__url=redis_url)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    with app_server(keyed, {"key-alice": "alice"}) as (_, alice), app_server(keyless) as (_, public), \
            http_client(60.0) as http:
        computed = http.post(f"{alice}/v1/completions", json=body, headers={"Authorization": "Bearer key-alice"})
        assert computed.status_code == 200, computed.text
        assert keyed.tiers.flush(30) and keyed.tiers.snapshot()["tiers"]["redis"]["entries_written"] > 0
        for salt in ("alice\x00", "alice", scoped_salt("alice", None)):
            answer = http.post(f"{public}/v1/completions", json={**body, "cache_salt": salt})
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, repr(salt)
            assert answer.json()["choices"][0]["text"] == computed.json()["choices"][0]["text"]


# --- 15. a warm and a clear that say what they could not do -----------------------------------------------------
def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_warm_says_tiers_written_false_when_every_write_fails_and_reset_says_what_remains(
        tiny_model_dir, tmp_path, monkeypatch):
    engine = tiny_engine(tiny_model_dir, cache__disk__path=tmp_path / "kv")
    with app_server(engine) as (_, root), http_client(60.0) as http:
        monkeypatch.setattr(os, "replace", no_space)  # every entry's last step
        full = http.post(f"{root}/cache/warm", json={"items": [{"prompt": PROMPT}]}).json()
        monkeypatch.undo()
        blocks = full["computed_prompt_tokens"] // BS
        assert full["tiers_written"] is False and full["blocks_written"] == {"disk": 0}
        assert full["blocks_not_written"] == full["write_errors"] == {"disk": blocks} and blocks > 0
        assert list((tmp_path / "kv").rglob("*.kvb")) == []

        room = http.post(f"{root}/cache/warm", json={"items": [{"prompt": OTHER}]}).json()
        assert room["tiers_written"] is True and room["blocks_written"]["disk"] == room["computed_prompt_tokens"] // BS

        files = len(list((tmp_path / "kv").rglob("*.kvb")))
        monkeypatch.setattr(Path, "unlink", read_only)
        stuck = http.post(f"{root}/reset_prefix_cache", params={"tiers": "true"}).json()
        monkeypatch.undo()
        assert stuck["dropped"]["disk"] == 0 and stuck["remaining"] == {"disk": files} and files > 0
        assert len(list((tmp_path / "kv").rglob("*.kvb"))) == files
        engine.tiers.check_integrity()
        cleared = http.post(f"{root}/reset_prefix_cache", params={"tiers": "true"}).json()
        assert cleared["dropped"]["disk"] == files and cleared["remaining"] == {"disk": 0}


REAL_UNLINK = Path.unlink


def read_only(self, missing_ok=False):
    if self.suffix == ".kvb":
        raise OSError(errno.EROFS, "Read-only file system")
    REAL_UNLINK(self, missing_ok=missing_ok)


def test_clearing_a_read_only_disk_tier_keeps_the_index_true_to_the_files_and_says_so(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="kvreuse.kvcache.tiers.disk_tier")
    tier = DiskTier(tmp_path / "kv", max_bytes=300)
    assert tier.put([(bytes([i]) * 32, bytes([i]) * 100) for i in range(3)]) == 3
    monkeypatch.setattr(Path, "unlink", read_only)
    assert tier.clear() == 0
    assert tier.usage().num_entries == 3 and len(list((tmp_path / "kv").rglob("*.kvb"))) == 3
    assert any("3 could not be removed" in r.getMessage() for r in caplog.records)
    assert tier.put([(b"\x09" * 32, b"x" * 100)]) == 0  # no room, and none can be made: refused, no loop
    assert tier.counters.entries_dropped == 1
    tier.check_integrity()
    monkeypatch.undo()
    assert tier.clear() == 3 and tier.usage().num_entries == 0 and list((tmp_path / "kv").rglob("*.kvb")) == []
    tier.check_integrity()


def test_cache_clear_says_what_a_read_only_disk_kept(tmp_path, monkeypatch, capsys):
    tier = DiskTier(tmp_path, max_bytes=10_000)
    tier.put([(bytes([i]) * 32, b"entry") for i in range(2)])
    monkeypatch.setattr(Path, "unlink", read_only)
    assert main(["cache", "clear", "--set", f"cache.disk.path={tmp_path}"]) == 1
    assert capsys.readouterr().out.strip().endswith("0 entries removed, 2 remain (could not be removed, or written "
                                                    "since)")
    assert main(["cache", "clear", "--set", f"cache.disk.path={tmp_path}", "--json"]) == 1
    assert json.loads(capsys.readouterr().out) == {"cleared": {"disk": 0}, "remaining": {"disk": 2}}


# --- events: loopback unless asked -------------------------------------------------------------------------------
def test_events_beyond_the_loopback_are_warned_about(caplog):
    assert is_local("tcp://127.0.0.1:5557") and is_local("tcp://[::1]:5557") and is_local("ipc:///tmp/kv")
    assert not is_local("tcp://0.0.0.0:5557") and not is_local("tcp://10.1.2.3:5557")
    caplog.set_level(logging.WARNING, logger="kvreuse.kvcache.events")
    for endpoint, warned in (("tcp://127.0.0.1:*", False), ("tcp://*:*", True)):
        caplog.clear()
        publisher = KVEventPublisher(EventsConfig(endpoint=endpoint), BS, "CPU")
        publisher.close()
        assert any("every tenant's token ids" in r.getMessage() for r in caplog.records) == warned, endpoint
