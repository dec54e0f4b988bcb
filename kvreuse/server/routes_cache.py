"""Cache administration: `POST /cache/warm`, `POST /reset_prefix_cache` (vLLM's name), `GET /cache/stats`.

API key required when configured. Warming runs each item as a one-token completion under the caller's tenant salt
(so it warms exactly what that tenant's requests will find), then waits until the lower tiers have written it.
Resetting drops what no request holds: blocks in use stay until their requests finish.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request

from kvreuse.kvcache.accounting import ReuseRecord
from kvreuse.server.auth import TenantDep, authenticate
from kvreuse.server.prompts import chat_prompt, check_model, completion_prompts, off_loop
from kvreuse.server.protocol import ChatCompletionRequest, CompletionRequest, WarmItem, WarmRequest
from kvreuse.server.responses import admit, collect_admitted
from kvreuse.server.state import ServerState, StateDep

router = APIRouter(dependencies=[Depends(authenticate)])

FLUSH_TIMEOUT_S = 120.0


@router.post("/cache/warm")
async def warm(body: WarmRequest, request: Request, state: StateDep, tenant: TenantDep):
    check_model(state.model_name, body.model)
    total = ReuseRecord()
    batch = state.engine.config.engine.max_num_seqs  # in batches, so a long list cannot fill the queue
    for start in range(0, len(body.items), batch):
        items = body.items[start:start + batch]
        records = await asyncio.gather(*(_warm_one(state, item, request, tenant) for item in items))
        for record in records:
            total += record
    tiers = state.engine.tiers
    written = True if tiers is None else await asyncio.to_thread(tiers.flush, FLUSH_TIMEOUT_S)
    return {"object": "cache.warm", "num_items": len(body.items), "prompt_tokens": total.prompt_tokens,
            "cached_tokens": total.cached_tokens, "cached_tokens_details": total.cached_by_tier(),
            "computed_prompt_tokens": total.computed_prompt_tokens,
            "tiers": tiers.tier_names if tiers else [], "tiers_written": written}


async def _warm_one(state: ServerState, item: WarmItem, request: Request, tenant: str | None) -> ReuseRecord:
    """One item as a one-token greedy completion; its reuse record (the usage)."""
    fields = {"model": state.model_name, "max_tokens": 1, "temperature": 0.0, "cache_salt": item.cache_salt}
    if item.messages is not None:
        body = ChatCompletionRequest(messages=item.messages, **fields)
        prompt, _ = await off_loop(chat_prompt, state.engine, body, tenant)
    else:
        [prompt] = await off_loop(completion_prompts, state.engine, CompletionRequest(prompt=item.prompt, **fields),
                                  tenant)
    seq = prompt.seq
    _, output = await collect_admitted(state, admit(state, seq, tenant), seq, request)
    return output.usage


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(state: StateDep, tiers: bool = False):
    return {"status": "ok", "dropped": await state.async_engine.reset_prefix_cache(tiers)}


MEMORY_KEYS = ("blocks_cached", "blocks_in_use", "blocks_total", "kv_bytes_cached")


@router.get("/cache/stats")
async def cache_stats(state: StateDep):
    snapshots = await state.async_engine.snapshots()
    memory = {key: sum(s[key] for s in snapshots.values()) for key in MEMORY_KEYS}
    if "" not in snapshots:  # a cluster: each replica's pool (the tiers are theirs too)
        return {"memory": memory, "replicas": {name: {key: s[key] for key in MEMORY_KEYS} | {"tiers": s.get("tiers")}
                                               for name, s in snapshots.items()}}
    snapshot, tiers = snapshots[""], state.engine.tiers
    usage = await asyncio.to_thread(tiers.usage) if tiers else []
    return {"memory": memory, "tiers": [{**u.__dict__, **snapshot["tiers"]["tiers"][u.name]} for u in usage],
            "write_queue": {k: snapshot["tiers"][k] for k in ("queued_blocks", "dropped_blocks", "queued_bytes")}
            if tiers else None}
