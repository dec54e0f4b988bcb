"""Cache administration: `POST /cache/warm` (with `pin`: held in the pool), `POST /cache/unpin`, `POST
/reset_prefix_cache` (vLLM's name), `GET /cache/stats`.

With API keys, resetting and the stats need an admin key (`auth.admin_only`): they act on or show every tenant's
cache (the stats: the disk path and the Redis URL too).

API key required when configured. Warming (kvreuse/warm.py) runs each item as a one-token greedy completion under the
caller's tenant salt (so it warms exactly what that tenant's requests will find), through the server's queue like any
request, then waits until the lower tiers have written it; `tiers_written` says whether they stored all of it. A
tenant's pins hold at most its share of `cache.pin_max_share`, split evenly among the tenants the API keys name
(kvcache/pins.py), so no tenant's pins keep another from pinning; unpinning (admin) ends every tenant's pins.
Resetting drops what no request or pin holds: blocks in use stay until their requests finish, pinned ones until their
pins end; with `tiers=true` the answer says what each tier still holds (entries it could not remove, or written
since).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request

from kvreuse.engine.output import RequestOutput
from kvreuse.engine.sequence import Sequence
from kvreuse.engine.stats import EngineSnapshot
from kvreuse.server.admission import admit
from kvreuse.server.auth import TenantDep, admin_only, authenticate
from kvreuse.server.engine_client import PINS_UNSUPPORTED
from kvreuse.server.errors import APIError
from kvreuse.server.json_route import FastJSONRoute
from kvreuse.server.prompts import chat_prompt, check_model, completion_prompts
from kvreuse.server.protocol import ChatCompletionRequest, CompletionRequest, WarmItem, WarmRequest
from kvreuse.server.responses import collect_admitted
from kvreuse.server.state import ServerState, StateDep
from kvreuse.warm import WARM_PARAMS, prompt_usage, tier_writes

router = APIRouter(dependencies=[Depends(authenticate)], route_class=FastJSONRoute)

FLUSH_TIMEOUT_S = 120.0


@router.post("/cache/warm")
async def warm(body: WarmRequest, request: Request, state: StateDep, tenant: TenantDep):
    check_model(state.model_name, body.model)
    if body.pin and not state.engine.can_pin:
        raise APIError(400, PINS_UNSUPPORTED, param="pin")
    warmed: list[tuple[Sequence, RequestOutput]] = []
    tiers = state.engine.tiers
    before = tiers.snapshot() if tiers is not None else None
    batch = state.config.engine.max_num_seqs  # in batches, so a long list cannot fill the queue
    for start in range(0, len(body.items), batch):
        items = body.items[start:start + batch]
        warmed += await asyncio.gather(*(_warm_one(state, item, request, tenant) for item in items))
    total = prompt_usage([output for _, output in warmed])
    flushed = True if tiers is None else await asyncio.to_thread(tiers.flush, FLUSH_TIMEOUT_S)
    writes = tier_writes(tiers, before, flushed).summary()
    answer = {"object": "cache.warm", "num_items": len(body.items), "prompt_tokens": total.prompt_tokens,
              "cached_tokens": total.cached_tokens, "cached_tokens_details": total.cached_by_tier(),
              "computed_prompt_tokens": total.computed_prompt_tokens, "tiers": tiers.tier_names if tiers else [],
              **{k: v for k, v in writes.items() if k != "flushed"}}
    if body.pin:
        answer["pins"] = [await _pin(state, seq, body.pin_ttl_s, tenant) for seq, _ in warmed]
    return answer


async def _pin(state: ServerState, seq: Sequence, ttl_s: int | None, tenant: str | None) -> dict:
    """Pin what a warmed item left cached (its prompt, under its request's salt), as `tenant`'s pin: within its share
    of the pins' share of the pool (pins.py)."""
    result = await state.engine.pin(seq.prompt_token_ids, seq.cache_salt, ttl_s, tenant, state.num_tenants)
    return {"pinned_tokens": result.pinned_tokens, "refused": result.refused}


async def _warm_one(state: ServerState, item: WarmItem, request: Request, tenant: str | None
                    ) -> tuple[Sequence, RequestOutput]:
    """One item as a warming completion, prepared and admitted as the caller's request would be; its sequence and
    output."""
    fields = {"model": state.model_name, "max_tokens": WARM_PARAMS.max_tokens,
              "temperature": WARM_PARAMS.temperature, "cache_salt": item.cache_salt}
    front, prepare = state.engine.front_end, state.preparation.run
    if item.messages is not None:
        body = ChatCompletionRequest(messages=item.messages, **fields)
        prompt, _ = await prepare(tenant, request, chat_prompt, front, body, tenant)
    else:
        [prompt] = await prepare(tenant, request, completion_prompts, front, CompletionRequest(prompt=item.prompt,
                                                                                             **fields), tenant)
    _, output = await collect_admitted(state, admit(state, prompt.seq, tenant), request)
    return prompt.seq, output


@router.post("/cache/unpin", dependencies=[Depends(admin_only("ends every tenant's pins"))])
async def unpin(state: StateDep):
    if not state.engine.can_pin:
        raise APIError(400, PINS_UNSUPPORTED)
    return {"status": "ok", "unpinned_blocks": await state.engine.unpin()}


@router.post("/reset_prefix_cache", dependencies=[Depends(admin_only(
    "drops every tenant's cached KV (?tiers=true: in the shared tiers too)"))])
async def reset_prefix_cache(state: StateDep, tiers: bool = False):
    answer = {"status": "ok", "dropped": await state.engine.reset_prefix_cache(tiers)}
    store = state.engine.tiers
    if tiers and store is not None:
        answer["remaining"] = {u.name: u.num_entries for u in await asyncio.to_thread(store.usage)}
    return answer


@router.get("/cache/stats", dependencies=[Depends(admin_only(
    "shows every tenant's cache, the disk path and the Redis URL"))])
async def cache_stats(state: StateDep):
    snapshots = await state.engine.snapshots()
    memory = _memory(snapshots)
    own = [s for s in snapshots if s.replica is None]
    if not own:  # a cluster: each replica's pool (the tiers are theirs too)
        return {"memory": memory, "replicas": {s.replica: {**_memory([s]), "tiers": s.tiers} for s in snapshots}}
    [snapshot], tiers = own, state.engine.tiers
    usage = await asyncio.to_thread(tiers.usage) if tiers else []
    return {"memory": memory, "pins": snapshot.pins, "sessions": snapshot.sessions,
            "tiers": [{**u.__dict__, **snapshot.tiers["tiers"][u.name]} for u in usage],
            "write_queue": {k: snapshot.tiers[k] for k in ("queued_blocks", "dropped_blocks", "queued_bytes")}
            if tiers else None}


def _memory(snapshots: list[EngineSnapshot]) -> dict[str, int]:
    """The pools' blocks and cached bytes, summed over `snapshots`."""
    return {"blocks_cached": sum(s.blocks_cached for s in snapshots),
            "blocks_in_use": sum(s.blocks_in_use for s in snapshots),
            "blocks_total": sum(s.blocks_total for s in snapshots),
            "kv_bytes_cached": sum(s.kv_bytes_cached for s in snapshots)}
