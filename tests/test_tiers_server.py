"""The tiers through the real server: `kvreuse serve` subprocesses on 127.0.0.1 restarted over one disk directory,
two of them sharing one real redis-server, two tenants isolated across them; warm-up, reset and stats routes;
the tier counters on /metrics. Driven with the `openai` client and httpx."""

from __future__ import annotations

import openai
import pytest

from .helpers import server_args
from .server_process import http_client, start_server

BS = 16
GREEDY = {"max_tokens": 12, "temperature": 0.0}


def serve(tmp_path, name: str, *args: str):
    return start_server(*args, log_path=tmp_path / f"{name}.log")


def complete(server, prompt: str, api_key: str = "EMPTY", **extra):
    client = openai.OpenAI(base_url=server.base_url, api_key=api_key, max_retries=0, timeout=120)
    return client.completions.create(model=server.model, prompt=prompt, **GREEDY, extra_body=extra)


def cached_details(response) -> dict:
    return response.usage.prompt_tokens_details.model_extra["cached_tokens_details"]


# --- the issue's own check: restart on the real model, a 2,000-token prompt ------------------------------------
@pytest.mark.slow
def test_real_model_restart_serves_a_2000_token_prompt_from_disk(tmp_path, real_tokenizer):
    prompt = " ".join(f"Record {i}: the tide at the harbour stood at {i % 7} metres and the wind came from the "
                      f"{('north', 'east', 'south', 'west')[i % 4]}." for i in range(88))
    num_tokens = len(real_tokenizer.encode(prompt))
    assert 1900 <= num_tokens <= 2100, num_tokens
    args = ["--dtype", "fp32", "--max-model-len", "4096", "--set", f"cache.disk.path={tmp_path / 'kv'}"]
    with serve(tmp_path, "first", *args) as server:
        first = complete(server, prompt)
    with serve(tmp_path, "second", *args) as server:
        again = complete(server, prompt)
        uncached = complete(server, prompt, use_cache=False)
        scrape = server.metrics()
    assert again.usage.prompt_tokens_details.cached_tokens >= 0.95 * num_tokens
    assert cached_details(again) == {"memory": 0, "disk": again.usage.prompt_tokens_details.cached_tokens, "redis": 0}
    assert again.choices[0].text == first.choices[0].text == uncached.choices[0].text
    assert scrape.get("kvreuse:tier_hit_tokens_total", tier="disk") == cached_details(again)["disk"]
    assert scrape.get("kvreuse:tier_load_seconds_count") == 1


# --- two processes, one Redis, two tenants ---------------------------------------------------------------------
def test_two_servers_share_one_redis_and_tenants_stay_apart(tmp_path, tiny_model_dir, redis_url):
    keys = tmp_path / "keys.txt"
    keys.write_text("key-alpha-123 alpha\nkey-beta-456 beta\n")
    args = server_args(tiny_model_dir, f"cache.redis.url={redis_url}") + ["--api-keys", str(keys)]
    prompt = "Minutes of the harbour board: the new crane arrives in May and the old one is sold for scrap. " * 8
    with serve(tmp_path, "one", *args) as one, serve(tmp_path, "two", *args) as two:
        computed = complete(one, prompt, api_key="key-alpha-123")
        assert computed.usage.prompt_tokens_details.cached_tokens == 0
        with http_client() as client:  # the writes are off the hot path: wait for them
            client.post(f"{one.root}/cache/warm", json={"items": [{"prompt": "x"}]},
                        headers={"Authorization": "Bearer key-alpha-123"}).raise_for_status()
        other_tenant = complete(two, prompt, api_key="key-beta-456")
        same_tenant = complete(two, prompt, api_key="key-alpha-123")
        full = (computed.usage.prompt_tokens - 1) // BS * BS
    assert other_tenant.usage.prompt_tokens_details.cached_tokens == 0  # the salt is in every Redis key
    assert cached_details(same_tenant) == {"memory": 0, "disk": 0, "redis": full}
    assert same_tenant.choices[0].text == other_tenant.choices[0].text == computed.choices[0].text


# --- warm-up, reset, stats -------------------------------------------------------------------------------------
def test_warm_reset_and_stats_routes(tmp_path, tiny_model_dir):
    document = "Appendix B lists every lighthouse on the northern coast with its height and range. " * 10
    with serve(tmp_path, "admin", *server_args(tiny_model_dir, f"cache.disk.path={tmp_path / 'kv'}")) as server, \
            http_client() as client:
        warmed = client.post(f"{server.root}/cache/warm", json={"items": [
            {"prompt": document}, {"messages": [{"role": "system", "content": document}]}]})
        assert warmed.status_code == 200, warmed.text
        body = warmed.json()
        assert (body["num_items"], body["tiers"], body["tiers_written"]) == (2, ["disk"], True)
        assert body["computed_prompt_tokens"] > 0

        hit = complete(server, document + " Which is the tallest?")
        assert hit.usage.prompt_tokens_details.cached_tokens >= (len(document) // 8) // BS * BS // 2
        assert cached_details(hit)["memory"] == hit.usage.prompt_tokens_details.cached_tokens

        stats = client.get(f"{server.root}/cache/stats").json()
        (disk,) = stats["tiers"]
        files = list((tmp_path / "kv").rglob("*.kvb"))
        assert disk["name"] == "disk" and disk["num_entries"] == len(files) > 0
        assert stats["memory"]["blocks_cached"] > 0

        reset = client.post(f"{server.root}/reset_prefix_cache").json()
        assert reset["dropped"]["memory"] == stats["memory"]["blocks_cached"] and "disk" not in reset["dropped"]
        from_disk = complete(server, document + " Which is the tallest?")
        assert cached_details(from_disk)["disk"] == hit.usage.prompt_tokens_details.cached_tokens
        assert from_disk.choices[0].text == hit.choices[0].text

        num_files = len(list((tmp_path / "kv").rglob("*.kvb")))
        everything = client.post(f"{server.root}/reset_prefix_cache", params={"tiers": "true"}).json()
        assert everything["dropped"]["disk"] == num_files > 0
        assert list((tmp_path / "kv").rglob("*.kvb")) == []
        cold = complete(server, document + " Which is the tallest?")
        assert cold.usage.prompt_tokens_details.cached_tokens == 0

        both = {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}
        bad = client.post(f"{server.root}/cache/warm", json={"items": [both]})
        assert bad.status_code == 400 and "exactly one" in bad.json()["error"]["message"]
        assert client.post(f"{server.root}/cache/warm", json={"items": []}).status_code == 400
