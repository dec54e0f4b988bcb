"""`kvreuse cache warm|stats|clear`: the lower KV tiers (disk, Redis) from outside a server; `warm --url` warms (and
with `--pin` pins) a running server's pool instead."""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvreuse.cli.common import InputError, build_config, common_flags
from kvreuse.config import MAX_PIN_TTL_S
from kvreuse.prompts_file import read_prompts_file

NO_TIER = "no lower KV tier is configured (cache.disk.path, cache.redis.url)"


def add_cache(sub) -> None:
    """The `cache` command and its actions."""
    cache = sub.add_parser("cache", help="the lower KV tiers (disk, Redis): warm, stats, clear",
                           description="The lower KV tiers that [cache] configures (cache.disk.path, "
                                       "cache.redis.url), from outside a server.")
    actions = cache.add_subparsers(dest="action", required=True, metavar="ACTION")

    warm = actions.add_parser("warm", help="compute the KV of a prompt file and write it to the lower tiers")
    common_flags(warm)
    warm.add_argument("file", metavar="FILE.jsonl", help='JSONL: {"prompt": ...} or {"messages": [...]} per line')
    warm.add_argument("--cache-salt", help="the salt the requests to serve will carry (KV is shared only within it)")
    warm.add_argument("--json", action="store_true", help="the summary as JSON")
    warm.add_argument("--url", help="warm a running server instead (its root, e.g. http://127.0.0.1:8000): the "
                                    "prompts go to its POST /cache/warm")
    warm.add_argument("--pin", action="store_true", help="with --url: hold the warmed prefixes in the server's pool "
                                                         "(within its cache.pin_max_share)")
    warm.add_argument("--pin-ttl-s", type=int, metavar="S", help="with --pin: how long the pins last (default the "
                                                                 "server's cache.pin_ttl_s; 0: until unpinned)")
    warm.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                      help="with --url: the server's API key (default $OPENAI_API_KEY)")
    warm.set_defaults(func=cmd_cache_warm)

    stats = actions.add_parser("stats", help="what each lower tier holds (without loading the model)")
    common_flags(stats)
    stats.add_argument("--json", action="store_true", help="the tiers as JSON")
    stats.set_defaults(func=cmd_cache_stats)

    clear = actions.add_parser("clear", help="remove every entry of every lower tier (Redis: only ours)")
    common_flags(clear)
    clear.add_argument("--json", action="store_true", help="the counts as JSON")
    clear.set_defaults(func=cmd_cache_clear)


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


def _warm_summary(summary: dict) -> str:
    by_tier = summary["cached_tokens_details"]
    written = ", ".join(f"{name} {n}" for name, n in summary["blocks_written"].items())
    lost = ", ".join(f"{name} {n}" for name, n in summary["blocks_not_written"].items() if n)
    reused = f", {summary['reused_tokens']} reused" if summary["reused_tokens"] else ""
    return (f"warmed {summary['num_items']} prompts ({summary['prompt_tokens']} prompt tokens) in "
            f"{summary['seconds']:.2f}s: {summary['cached_tokens']} tokens were already cached (memory "
            f"{by_tier['memory']}, disk {by_tier['disk']}, redis {by_tier['redis']}){reused}, "
            f"{summary['computed_prompt_tokens']} computed; blocks written: {written}; "
            + (f"NOT written (see the warnings): {lost}; " if lost else "")
            + f"{summary['dropped_blocks']} dropped by a full write queue.")


def cmd_cache_warm(args: argparse.Namespace) -> int:
    """Compute the KV of every prompt in the file and write it to the lower tiers; 1 if any failed or was lost
    (not written in time, dropped by the queue, refused by a tier)."""
    from kvreuse.engine.errors import RequestError
    from kvreuse.llm import LLM
    from kvreuse.warm import WarmError, warm

    if args.url:
        return _warm_server(args)
    if args.pin or args.pin_ttl_s is not None:
        raise InputError("--pin holds blocks in a running server's pool: give its --url (a process that warms and "
                         "exits keeps nothing pinned)")
    config = build_config(args)
    if not (config.cache.disk.path or config.cache.redis.url):
        raise InputError(f"{NO_TIER}: warming a process that then exits would be pointless; set "
                         "--set cache.disk.path=DIR and/or --set cache.redis.url=redis://HOST:PORT/DB")
    if not config.cache.enabled:
        raise InputError("cache.enabled is false: nothing would be cached or written to the lower tiers")
    records = read_prompts_file(args.file)
    if not records:
        raise InputError(f"{args.file}: no prompts")

    llm = LLM(config)
    try:
        summary = warm(llm, records, cache_salt=args.cache_salt)
    except WarmError as exc:
        raise InputError(f"{args.file}, {exc}") from exc
    except RequestError as exc:
        raise InputError(str(exc)) from exc
    finally:
        llm.engine.close()

    print(json.dumps(summary, ensure_ascii=False) if args.json else _warm_summary(summary))
    for item in summary["failed"]:
        print(f"kvreuse: {args.file}, line {item['line']}: {item['error']}", file=sys.stderr)
    if not summary["flushed"]:
        print("kvreuse: the lower tiers did not finish writing in time; some blocks may be missing",
              file=sys.stderr)
    elif not summary["tiers_written"]:
        print("kvreuse: some blocks were not written to the lower tiers (a full write queue, a full or read-only "
              "disk, Redis down); the tiers lack them", file=sys.stderr)
    return 0 if summary["tiers_written"] and not summary["failed"] else 1


def _warm_server(args: argparse.Namespace) -> int:
    """Send the file's prompts to a server's POST /cache/warm (pinned with --pin); 1 if a pin was refused."""
    import httpx

    if args.pin_ttl_s is not None and (not args.pin or not 0 <= args.pin_ttl_s <= MAX_PIN_TTL_S):
        raise InputError(f"--pin-ttl-s needs --pin and a value from 0 to {MAX_PIN_TTL_S} (30 days)")
    records = read_prompts_file(args.file)
    if not records:
        raise InputError(f"{args.file}: no prompts")
    items = [{"prompt": r.prompt} if r.prompt is not None else {"messages": r.messages} for r in records]
    for item in items:
        if args.cache_salt:
            item["cache_salt"] = args.cache_salt
    body = {"items": items, "pin": args.pin, "pin_ttl_s": args.pin_ttl_s}
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.url.rstrip("/").removesuffix("/v1") + "/cache/warm"
    try:
        response = httpx.post(url, json=body, headers=headers, timeout=httpx.Timeout(600.0, connect=10.0))
    except httpx.HTTPError as exc:
        raise InputError(f"{url}: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        detail = response.json().get("error", {}).get("message", response.text) if response.headers.get(
            "content-type", "").startswith("application/json") else response.text
        raise InputError(f"{url} answered {response.status_code}: {detail}")
    summary = response.json()
    pins = summary.get("pins") or []
    if args.json:
        print(json.dumps(summary, ensure_ascii=False))
    else:
        pinned = f"; pinned {sum(p['pinned_tokens'] for p in pins)} tokens" if args.pin else ""
        print(f"warmed {summary['num_items']} prompts ({summary['prompt_tokens']} prompt tokens) on {args.url}: "
              f"{summary['cached_tokens']} were already cached, {summary['computed_prompt_tokens']} computed{pinned}")
    refused = [(r.line, p["refused"]) for r, p in zip(records, pins, strict=False) if p["refused"]]
    for line, why in refused:
        print(f"kvreuse: {args.file}, line {line}: not pinned: {why}", file=sys.stderr)
    return 1 if refused else 0


def cmd_cache_stats(args: argparse.Namespace) -> int:
    """Print each configured lower tier's entries, size, capacity and availability."""
    from kvreuse.kvcache.tiers.store import build_tiers

    tiers = build_tiers(build_config(args).cache)
    try:
        usage = [t.usage() for t in tiers]
    finally:
        for tier in tiers:
            tier.close()
    if args.json:
        print(json.dumps({"tiers": [u.__dict__ for u in usage]}))
        return 0
    if not usage:
        print(NO_TIER)
    for u in usage:
        entries = "? entries" if u.num_entries is None else f"{u.num_entries} entries"
        size = "size unknown" if u.num_bytes is None else _mib(u.num_bytes)
        capacity = "no limit of ours" if u.capacity_bytes is None else f"capacity {_mib(u.capacity_bytes)}"
        print(f"{u.name}  {u.detail}  {entries}  {size}  {capacity}  "
              f"{'available' if u.available else 'UNAVAILABLE'}")
    return 0


def cmd_cache_clear(args: argparse.Namespace) -> int:
    """Remove every entry of every configured lower tier and print how many each held, and how many it still holds
    (entries it could not remove, or written since); 1 if any remain."""
    from kvreuse.kvcache.tiers.store import build_tiers

    tiers = build_tiers(build_config(args).cache)
    try:
        cleared = [(t.name, t.clear(), t.usage()) for t in tiers]
    finally:
        for tier in tiers:
            tier.close()
    remaining = {name: u.num_entries for name, _, u in cleared}
    status = 1 if any(n != 0 for n in remaining.values()) else 0  # None: unreachable, so unknown
    if args.json:
        print(json.dumps({"cleared": {name: n for name, n, _ in cleared}, "remaining": remaining}))
        return status
    if not cleared:
        print(NO_TIER)
    for name, n, u in cleared:
        left = "" if u.num_entries == 0 else (
            f", {u.num_entries} remain (could not be removed, or written since)" if u.num_entries else
            ", UNAVAILABLE: what remains is unknown")
        print(f"{name}  {u.detail}  {n} entries removed{left}")
    return status
