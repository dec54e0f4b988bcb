"""Pinned prefixes (kvcache/pins.py): a warmed prompt's cached chain held in the pool through eviction pressure, within
`cache.pin_max_share`, until its TTL or an unpin; on one group and under sliding windows (the window at the chain's
end pinned too); through the server's POST /cache/warm with `pin`, POST /cache/unpin and GET /cache/stats, and
`kvreuse cache warm --url --pin` as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from kvreuse.config import MAX_PIN_TTL_S, ConfigError
from kvreuse.kvcache.block_pool import BlockPool
from kvreuse.kvcache.pins import Pins

from .helpers import drain, greedy, make_config, server_args, tiny_llm
from .server_process import http_client, start_server
from .test_sliding_window_cache import BLOCK, engine, tokens

BS = 16
DOCUMENT = "Appendix C: every pier of the harbour, its length, depth at low tide and the ships it takes. " * 8
OTHERS = [f"Unrelated request {i}: a list of rivers, their sources and the seas they reach, item {i}. " * 4
          for i in range(12)]


# --- the pin set on a bare pool --------------------------------------------------------------------------------
def cached_pool(num_blocks: int = 8) -> BlockPool:
    pool = BlockPool(num_blocks, max_cached_blocks=num_blocks)
    block_ids = pool.allocate(num_blocks)
    parent = None
    for i, block_id in enumerate(block_ids):
        parent = pool.register(block_id, bytes([i]) * 32, [i] * 4, parent, i * 4)
    pool.free(block_ids)
    return pool


def test_a_pin_holds_its_blocks_and_a_replaced_pin_does_not_pile_up_references():
    pool = cached_pool()
    b0, b1, b2, b3, b4 = range(1, 6)  # block 0 is the null block
    pins = Pins(pool, max_blocks=4)
    pins.pin(b"a", [b0, b1, b2], 12, expires_at=None)
    assert [pool.blocks[b].ref_cnt for b in (b0, b1, b2, b3)] == [1, 1, 1, 0]
    assert pool.num_cached_blocks == 5  # the pinned three are held, not evictable
    pins.pin(b"a", [b0, b1, b2], 12, expires_at=5.0)  # again: a new expiry, the same references
    assert [pool.blocks[b].ref_cnt for b in (b0, b1, b2)] == [1, 1, 1]
    pins.pin(b"b", [b0, b1, b3], 12, expires_at=None)  # shares two blocks: four distinct
    assert pins.num_blocks == 4 and pool.blocks[b0].ref_cnt == 2
    assert not pins.can_pin(b"c", [b4]) and pins.can_pin(b"b", [b0, b1])  # replacing b frees its place
    pins.check_integrity()
    assert pins.expire(now=4.0) == 0 and pins.expire(now=5.0) == 1
    assert pins.num_blocks == 3 and pool.blocks[b2].ref_cnt == 0
    assert pins.unpin_all() == 3 and pool.num_used_blocks == 0
    pins.check_integrity()


def test_each_tenant_pins_within_its_own_share_and_a_full_one_shuts_nobody_out():
    """Issue 49.5: the share was global and first-come, so one tenant's permanent pins shut every other tenant out.
    Split among 2 tenants, 5 blocks are 2 each: a tenant at its cap is refused (naming it), the other still pins."""
    pool = cached_pool()
    pins = Pins(pool, max_blocks=5)
    assert pins.tenant_max_blocks(2) == 2 and pins.tenant_max_blocks(1) == 5
    pins.pin(b"a", [1, 2], 8, expires_at=None, tenant="alpha", num_tenants=2)
    assert not pins.can_pin(b"b", [3], "alpha", 2)  # alpha's share is full, the pool's share is not
    why = pins.refusal("alpha", 2, "cache.pin_max_share = 0.25")
    assert "tenant 'alpha'" in why and "cache.pin_max_share = 0.25 split among 2 tenants, 2 blocks each" in why
    assert pins.can_pin(b"a", [1, 3], "alpha", 2)  # replacing its own pin frees its place
    assert pins.can_pin(b"b", [1, 2], "beta", 2)  # the same blocks count against beta's share too
    pins.pin(b"b", [3, 4], 8, expires_at=3.0, tenant="beta", num_tenants=2)
    pins.check_integrity()
    assert pins.tenant_blocks("alpha") == pins.tenant_blocks("beta") == 2 and pins.num_blocks == 4
    assert pins.snapshot(0.0)["tenants"] == {"alpha": {"blocks": 2, "max_blocks": 2},
                                             "beta": {"blocks": 2, "max_blocks": 2}}
    assert pins.expire(now=3.0) == 1 and set(pins.tenant_caps) == {"alpha"}
    pins.check_integrity()
    assert pins.unpin_all() == 2 and pool.num_used_blocks == 0 and not pins.tenant_caps
    pins.check_integrity()


def test_without_keys_one_tenant_has_the_whole_share():
    pool = cached_pool()
    pins = Pins(pool, max_blocks=3)
    pins.pin(b"a", [1, 2, 3], 12, expires_at=None)
    assert not pins.can_pin(b"b", [4])
    assert pins.refusal(None, 1, "cache.pin_max_share = 0.4") == \
        "the pins would hold more than cache.pin_max_share = 0.4 of the pool (3 blocks; 3 pinned)"
    pins.check_integrity()


# --- the engine ------------------------------------------------------------------------------------------------
def flood(llm, prompts: list[str]) -> None:
    for prompt in prompts:
        llm.generate(prompt, greedy(1))


def test_a_pinned_prefix_survives_eviction_and_goes_at_its_ttl(tiny_model_dir, monkeypatch):
    llm = tiny_llm(tiny_model_dir, engine__num_kv_blocks=96, cache__max_blocks=16)
    eng = llm.engine
    expected = (len(llm.tokenizer.encode(DOCUMENT)) - 1) // BS * BS
    control = DOCUMENT.replace("harbour", "river port")  # as long, not pinned
    llm.generate(DOCUMENT, greedy(1))
    assert eng.pin_prompt(llm.tokenizer.encode(DOCUMENT), ttl_s=60).pinned_tokens == expected
    llm.generate(control, greedy(1))
    flood(llm, OTHERS)  # far more blocks than max_blocks keeps cached
    again = llm.generate(DOCUMENT + " Which pier is deepest?", greedy(4))[0]
    assert again.usage.cached_tokens == expected
    assert llm.generate(control, greedy(1))[0].usage.cached_tokens < expected / 2  # the flood evicts the rest
    assert eng.stats_snapshot().pins["num_pins"] == 1
    eng.check_integrity()

    later = time.monotonic() + 61
    monkeypatch.setattr(time, "monotonic", lambda: later)
    flood(llm, OTHERS)  # each step expires what is due: the pin ends, and its blocks are evictable again
    assert eng.stats_snapshot().pins["num_pins"] == 0
    assert llm.generate(DOCUMENT + " Which pier is deepest?", greedy(1))[0].usage.cached_tokens < expected


def test_pins_stay_within_their_share_and_the_refusal_names_the_key(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir, engine__num_kv_blocks=64, cache__pin_max_share="0.1")  # 6 blocks
    eng = llm.engine
    llm.generate(DOCUMENT, greedy(1))
    result = eng.pin_prompt(llm.tokenizer.encode(DOCUMENT))
    assert result.pinned_tokens == 0 and "cache.pin_max_share = 0.1" in result.refused
    short = DOCUMENT[:200]
    llm.generate(short, greedy(1))
    assert eng.pin_prompt(llm.tokenizer.encode(short)).pinned_tokens > 0
    assert eng.pin_prompt(llm.tokenizer.encode("never sent")).refused == "nothing of the prompt is cached"
    assert eng.unpin_all() > 0 and eng.kv_manager.pool.num_used_blocks == 0
    eng.check_integrity()


def test_a_pin_under_sliding_windows_keeps_the_window_at_the_chains_end(grouped_gemma_dir):
    llm = engine(grouped_gemma_dir, engine__num_kv_blocks=160, cache__max_blocks=40)
    doc = tokens(9 * BLOCK + 3, 51)
    want = engine(grouped_gemma_dir, cache__enabled="false").generate(doc + [7, 8, 9], greedy(6))[0].token_ids
    control = tokens(9 * BLOCK + 3, 52)  # as long, not pinned
    llm.generate(doc, greedy(1))
    assert llm.engine.pin_prompt(doc).pinned_tokens == 9 * BLOCK
    llm.generate(control, greedy(1))
    pin = next(iter(llm.engine.kv_manager.pins.pins.values()))
    assert {llm.engine.kv_manager.pool.blocks[b].group for b in pin.block_ids} == {0, 1, 2}
    for seed in range(8):
        llm.generate(tokens(60, 100 + seed), greedy(1))
    out = llm.generate(doc + [7, 8, 9], greedy(6))[0]
    assert out.usage.cached_tokens == 9 * BLOCK and out.token_ids == want
    assert llm.generate(control, greedy(1))[0].usage.cached_tokens < 9 * BLOCK
    llm.engine.check_integrity()


# --- the server, and the command ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    log = tmp_path_factory.mktemp("pins") / "server.log"
    with start_server(*server_args(tiny_model_dir, "engine.num_kv_blocks=96", "cache.max_blocks=16"),
                      log_path=log) as running:
        yield running


def test_warm_with_pin_unpin_and_stats_over_http(server):
    with http_client() as client:
        warmed = client.post(f"{server.root}/cache/warm", json={"items": [{"prompt": DOCUMENT}], "pin": True,
                                                                "pin_ttl_s": 600})
        assert warmed.status_code == 200, warmed.text
        [pin] = warmed.json()["pins"]
        assert pin["pinned_tokens"] > 0 and pin["refused"] is None
        for prompt in OTHERS:
            client.post(f"{server.root}/v1/completions", json={"model": server.model, "prompt": prompt,
                                                                "max_tokens": 1})
        hit = client.post(f"{server.root}/v1/completions", json={"model": server.model, "prompt": DOCUMENT + " Why?",
                                                                 "max_tokens": 1}).json()
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == pin["pinned_tokens"]
        pins = client.get(f"{server.root}/cache/stats").json()["pins"]
        assert pins["num_pins"] == 1 and 0 < pins["next_expiry_s"] <= 600
        assert client.post(f"{server.root}/cache/unpin").json()["unpinned_blocks"] == pins["blocks"]
        assert client.get(f"{server.root}/cache/stats").json()["pins"]["num_pins"] == 0


@pytest.mark.parametrize("ttl", ["5", 5.0, 1.5, True, None, [5], -1, MAX_PIN_TTL_S + 1, 10**30, 2**63])
def test_a_pin_ttl_is_whole_seconds_up_to_30_days(server, ttl):
    with http_client() as client:
        warm = client.post(f"{server.root}/cache/warm", json={"items": [{"prompt": DOCUMENT}], "pin": True,
                                                              "pin_ttl_s": ttl if ttl is not None else MAX_PIN_TTL_S})
        if ttl is None:  # the bound itself is accepted
            assert warm.status_code == 200 and warm.json()["pins"][0]["refused"] is None, warm.text
            assert MAX_PIN_TTL_S - 60 < client.get(f"{server.root}/cache/stats").json()["pins"]["next_expiry_s"]
            assert client.post(f"{server.root}/cache/unpin").json()["unpinned_blocks"] > 0
            return
        assert warm.status_code == 400, warm.text
        error = warm.json()["error"]
        assert error["param"] == "pin_ttl_s"
        assert error["message"].startswith("pin_ttl_s must be an integer number of seconds from 0 to 2592000 (30 days")
        assert client.get(f"{server.root}/cache/stats").json()["pins"]["num_pins"] == 0


def test_the_configured_pin_ttl_is_bounded_too():
    with pytest.raises(ConfigError, match=r"cache.pin_ttl_s"):
        make_config(cache__pin_ttl_s=MAX_PIN_TTL_S + 1)
    assert make_config(cache__pin_ttl_s=MAX_PIN_TTL_S).cache.pin_ttl_s == MAX_PIN_TTL_S


def test_cache_warm_url_pin_as_a_user_runs_it(server, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": DOCUMENT}) + "\n", encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "kvreuse", "cache", "warm", str(prompts), "--url", server.root,
                           "--pin"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "warmed 1 prompts" in done.stdout and "pinned" in done.stdout
    refused = subprocess.run([sys.executable, "-m", "kvreuse", "cache", "warm", str(prompts), "--pin"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--url" in refused.stderr
    with http_client() as client:
        assert client.post(f"{server.root}/cache/unpin").json()["unpinned_blocks"] > 0


def test_pins_yield_to_a_request_that_could_not_run_otherwise(tiny_model_dir):
    """A request that fits the pool but not beside the pins, with nothing running that could free blocks: the pins
    end (logged) rather than keep it, and the queue behind it, waiting forever."""
    llm = tiny_llm(tiny_model_dir, engine__num_kv_blocks=40, cache__pin_max_share="0.5")
    eng = llm.engine
    llm.generate(DOCUMENT, greedy(1))
    assert eng.pin_prompt(llm.tokenizer.encode(DOCUMENT)).pinned_tokens > 0
    long_prompt = " ".join(OTHERS)[:2200]
    assert (len(llm.tokenizer.encode(long_prompt)) + 8) // BS > 40 - eng.kv_manager.pins.num_blocks
    seq = eng.add_request(long_prompt, greedy(8))
    drain(eng, max_steps=200)  # bounded: without the pins yielding, the request would wait forever
    assert seq.finish_reason == "length" and eng.kv_manager.pins.num_blocks == 0
    eng.check_integrity()


def test_cache_warm_refuses_a_pin_ttl_over_30_days_before_sending(tmp_path, capsys):
    from kvreuse.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": DOCUMENT}) + "\n", encoding="utf-8")
    argv = ["cache", "warm", str(prompts), "--url", "http://127.0.0.1:9", "--pin", "--pin-ttl-s"]  # port 9: nobody
    assert main([*argv, str(MAX_PIN_TTL_S + 1)]) == 2
    assert "--pin-ttl-s needs --pin and a value from 0 to 2592000 (30 days)" in capsys.readouterr().err


def test_a_tenants_permanent_pins_do_not_shut_another_tenant_out(tiny_model_dir, tmp_path):
    """Issue 49.5 over HTTP with API keys: 3 tenants (alpha, beta, the admin's own) split the 24 pinnable blocks, 8
    each. alpha pins until refused, with pins that last until unpinned; the refusal names its share; beta still pins;
    a tenant's key may not unpin, the admin's ends every tenant's pins."""
    from .helpers import app_server, tiny_engine

    admin = tmp_path / "admin_keys"
    admin.write_text("key-root-789 root\n", encoding="utf-8")
    eng = tiny_engine(tiny_model_dir, engine__num_kv_blocks=96, cache__pin_max_share="0.25",
                      server__admin_api_keys_file=str(admin))
    keys = {"key-alpha-123": "alpha", "key-beta-456": "beta"}

    def warm(client, root, key, prompt):
        answer = client.post(f"{root}/cache/warm", headers={"Authorization": f"Bearer {key}"},
                             json={"items": [{"prompt": prompt}], "pin": True, "pin_ttl_s": 0})
        assert answer.status_code == 200, answer.text
        return answer.json()["pins"][0]

    with app_server(eng, keys) as (_, root), http_client() as client:
        results = [warm(client, root, "key-alpha-123", prompt) for prompt in OTHERS[:6]]  # ~2 blocks each
        refused = [r["refused"] for r in results if r["refused"]]
        assert results[0]["pinned_tokens"] > 0 and refused, results
        assert "tenant 'alpha'" in refused[0] and "cache.pin_max_share = 0.25 split among 3 tenants, 8 blocks each" \
            in refused[0], refused[0]
        assert eng.kv_manager.pins.tenant_blocks("alpha") <= 8
        beta = warm(client, root, "key-beta-456", OTHERS[7])
        assert beta["pinned_tokens"] > 0 and beta["refused"] is None, beta
        eng.check_integrity()
        stats = client.get(f"{root}/cache/stats", headers={"Authorization": "Bearer key-root-789"}).json()["pins"]
        assert set(stats["tenants"]) == {"alpha", "beta"} and stats["tenants"]["alpha"]["max_blocks"] == 8
        denied = client.post(f"{root}/cache/unpin", headers={"Authorization": "Bearer key-alpha-123"})
        assert denied.status_code == 403, denied.text
        unpinned = client.post(f"{root}/cache/unpin", headers={"Authorization": "Bearer key-root-789"})
        assert unpinned.json()["unpinned_blocks"] == stats["blocks"] > 0
        assert warm(client, root, "key-beta-456", OTHERS[8])["refused"] is None
    assert eng.kv_manager.pins.tenant_caps == {"beta": 8}
    eng.check_integrity()
